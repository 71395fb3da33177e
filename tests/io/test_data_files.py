"""The data files users bring, as they bring them (audit of ``io.data``): each is read as documented, or
refused in one ``SymmergeError`` naming the file, the line or field and what to do; never a traceback, never
silently wrong numbers."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import write_tokenizer
from factories import make_model
from symmerge.errors import SymmergeError
from symmerge.io.data import has_labels, load_data

pytestmark = pytest.mark.usefixtures("single_thread")

ROWS = [{"text": "the cat sat", "label": 0}, {"text": "a dog ran fast", "label": 1}]


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """(a tiny BERT sequence classifier with 3 labels, the folder holding its WordPiece tokenizer)."""
    folder = tmp_path_factory.mktemp("bert")
    write_tokenizer(folder)
    return make_model("bert", head=True, dtype=torch.float32), str(folder)


def read(path, classifier, **kw):
    model, tokenizer = classifier
    return load_data(path, model, tokenizer=tokenizer, **kw)


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# ------------------------------------------------------------------ encodings


def test_invalid_utf8_in_a_jsonl_is_one_error_naming_the_line(tmp_path, classifier):
    """It was a UnicodeDecodeError traceback (not a SymmergeError: the CLI re-raised it)."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(jsonl(ROWS).encode() + b'{"text": "caf\xe9", "label": 0}\n')
    with pytest.raises(SymmergeError) as e:
        read(path, classifier)
    line = one_line(e)
    assert f"{path}:3:" in line and "UTF-8" in line, line


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_a_utf8_bom_is_read_as_notepad_writes_it(tmp_path, classifier, suffix):
    """A BOM (Windows editors write one) made a .jsonl 'not valid JSON' and stayed in a .txt's first text as a
    token; now it is dropped, and the file reads as the same file without it."""
    text = jsonl(ROWS) if suffix == ".jsonl" else "the cat sat\na dog ran fast\n"
    plain, bom = tmp_path / f"plain{suffix}", tmp_path / f"bom{suffix}"
    plain.write_text(text, encoding="utf-8")
    bom.write_text(text, encoding="utf-8-sig")
    assert bom.read_bytes().startswith(b"\xef\xbb\xbf")
    if suffix == ".jsonl":
        a, b = read(plain, classifier), read(bom, classifier)
        assert has_labels(bom)
    else:
        a, b = (load_data(p, tokenizer=classifier[1], labels=False) for p in (plain, bom))
    assert torch.equal(a.batches[0].inputs["input_ids"], b.batches[0].inputs["input_ids"])


def test_invalid_utf8_in_a_txt_names_the_line(tmp_path, classifier):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"the cat\n\ncaf\xe9 sat\nthe dog\n")
    with pytest.raises(SymmergeError, match=rf"{path}:3: not UTF-8 text \(byte 0xe9 at column 4\)"):
        load_data(path, tokenizer=classifier[1], labels=False)


# ------------------------------------------------------------------ .jsonl labels


@pytest.mark.parametrize("label, says", [
    ("positive", "map label names to the model's class ids"), ("1", "map label names"), (1.0, "got 1.0"),
    (True, "got True"), ([1], "got [1]"), (None, "got None"), (-1, "got -1"),
    (10 ** 30, "got 1000000000000000000000000000000"),
])
def test_a_label_that_is_no_class_id_is_one_error_naming_the_line(tmp_path, classifier, label, says):
    """A label above 2**63 was torch's 'Overflow when unpacking long long' traceback; a negative one was named by
    its example's 0-based index, not its line."""
    path = tmp_path / "labels.jsonl"
    path.write_text(jsonl([ROWS[0], {"text": "the dog", "label": label}]))
    with pytest.raises(SymmergeError) as e:
        read(path, classifier)
    line = one_line(e)
    assert line.startswith(f"{path}:2: ") and "class id" in line and says in line, line


def test_a_line_without_a_label_names_the_line_and_the_way_out(tmp_path, classifier):
    path = tmp_path / "some.jsonl"
    path.write_text(jsonl([ROWS[0], {"text": "the dog"}, ROWS[1]]))
    with pytest.raises(SymmergeError, match=rf"^{path}:2: no 'label'"):
        read(path, classifier)
    assert read(path, classifier, labels=False).n == 3  # unlabeled data reads only 'text'


# ------------------------------------------------------------------ tokenizers without a pad token


WORDS = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "a", "dog", "ran", "fast", "on", "mat"]


def gpt_style_tokenizer(folder) -> str:
    """A word-level fast tokenizer with BOS/EOS and no pad token (as GPT-2's and Llama's ship)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    assert fast.pad_token is None
    fast.save_pretrained(str(folder))
    return str(folder)


def decoder_classifier(pad_token_id):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=3, pad_token_id=pad_token_id)
    return LlamaForSequenceClassification(config).eval()


def test_a_decoder_classifier_without_a_pad_token_pads_with_its_config_pad_id(tmp_path):
    """A tokenizer without a pad token (GPT-2, Llama) on .jsonl texts of unequal lengths was transformers'
    'Asking to pad but the tokenizer does not have a padding token' traceback. Now the texts are padded with the
    model's config pad_token_id, the id its classification head skips: each text's logits are those it gets alone."""
    folder = gpt_style_tokenizer(tmp_path / "tok")
    path = tmp_path / "texts.jsonl"
    path.write_text(jsonl([{"text": "the cat sat on a mat", "label": 0}, {"text": "a dog", "label": 2}]))
    model = decoder_classifier(pad_token_id=2)
    data = load_data(path, model, tokenizer=folder)
    batch = data.batches[0]
    assert batch.mask.sum(1).tolist() == [6, 2] and batch.labels.tolist() == [0, 2]
    with torch.no_grad():
        together = model(**batch.inputs).logits
        alone = [model(input_ids=batch.inputs["input_ids"][i:i + 1, batch.mask[i]]).logits[0] for i in range(2)]
    torch.testing.assert_close(together, torch.stack(alone), rtol=1e-5, atol=1e-6)


def test_a_decoder_classifier_without_any_pad_id_is_one_error(tmp_path):
    folder = gpt_style_tokenizer(tmp_path / "tok")
    path = tmp_path / "texts.jsonl"
    path.write_text(jsonl([{"text": "the cat sat", "label": 0}, {"text": "a dog", "label": 1}]))
    with pytest.raises(SymmergeError) as e:
        load_data(path, decoder_classifier(pad_token_id=None), tokenizer=folder)
    line = one_line(e)
    assert str(path) in line and "pad" in line and "pad_token_id" in line, line


def test_texts_for_a_tokenizer_without_pad_eos_or_unk_are_padded_under_the_mask(tmp_path):
    """A word-level tokenizer with no special token at all (no pad, EOS or UNK) on .txt lines of unequal lengths was
    transformers' 'Asking to pad but the tokenizer does not have a padding token' traceback. The attention mask and
    the -100 labels mark the padding, so any id pads: each line's next-token loss is the one it gets alone."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = WORDS[3:]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert fast.pad_token is None and fast.eos_token is None and fast.unk_token is None
    fast.save_pretrained(str(tmp_path / "tok"))
    path = tmp_path / "lines.txt"
    path.write_text("the cat sat on a mat\na dog ran\n")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=24,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    batch = load_data(path, model, tokenizer=str(tmp_path / "tok")).batches[0]
    assert batch.mask.sum(1).tolist() == [6, 3] and (batch.labels[1, 3:] == -100).all()
    with torch.no_grad():
        together = model(**batch.inputs).logits
        for i, n in enumerate((6, 3)):
            alone = model(input_ids=batch.inputs["input_ids"][i:i + 1, :n]).logits[0]
            torch.testing.assert_close(together[i, :n], alone, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ texts longer than the model reads


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_texts_longer_than_the_model_reads_are_cut_and_the_cut_is_said(tmp_path, classifier, capsys, suffix):
    """A text longer than the model's positions (the tiny BERT: 40) was cut to its first 40 tokens without a
    word; now the data records how many were cut (``texts_truncated``, ``max_tokens`` in the reports' cut fields)
    and one note goes to stderr. A text of exactly 40 tokens is not counted."""
    exact = " ".join(["cat"] * 38)  # [CLS] + 38 + [SEP] = 40 tokens: read whole
    texts = [" ".join(["cat"] * 5000), "the cat sat", exact]
    path = tmp_path / f"long{suffix}"
    path.write_text(jsonl({"text": t, "label": 0} for t in texts) if suffix == ".jsonl" else "\n".join(texts) + "\n")
    model, tokenizer = classifier
    data = load_data(path, model if suffix == ".jsonl" else None, tokenizer=tokenizer, labels=suffix == ".jsonl",
                     max_length=40 if suffix == ".txt" else None)
    assert data.batches[0].mask.sum(1).tolist() == [40, 5, 40]
    assert data.truncated == 1 and data.max_tokens == 40
    assert data.cut_info() == {"texts_truncated": 1, "max_tokens": 40}
    err = capsys.readouterr().err
    assert f"note: {path}: 1 of its 3 texts is longer than 40 tokens and was cut to its first 40" in err, err
    short = tmp_path / f"short{suffix}"
    short.write_text(path.read_text().replace(texts[0], "a dog"))
    data = load_data(short, model if suffix == ".jsonl" else None, tokenizer=tokenizer, labels=suffix == ".jsonl")
    assert data.truncated == 0 and data.cut_info() == {} and "note" not in capsys.readouterr().err


# ------------------------------------------------------------------ how many examples


@pytest.mark.parametrize("max_examples", [0, -1])
def test_load_data_refuses_a_max_examples_below_one(tmp_path, classifier, max_examples):
    """``max_examples=0`` read the whole file and ``-1`` silently dropped a .txt's last line (``lines[:-1]``);
    the flags refuse them (``--max-examples``/``--align-samples`` must be >= 1), and so does the function now."""
    path = tmp_path / "lines.txt"
    path.write_text("the cat\na dog\nthe mat\n")
    says = rf"max_examples must be >= 1 \(or None: every example\), got {max_examples}"
    with pytest.raises(SymmergeError, match=says):
        load_data(path, tokenizer=classifier[1], labels=False, max_examples=max_examples)


def test_a_max_examples_above_the_file_reads_it_whole_and_says_no_cut(tmp_path, classifier, capsys):
    path = tmp_path / "lines.txt"
    path.write_text("the cat\na dog\nthe mat\n")
    data = load_data(path, tokenizer=classifier[1], labels=False, max_examples=100)
    assert data.n == 3 and not data.cut and data.cut_info() == {} and "note" not in capsys.readouterr().err


# ------------------------------------------------------------------ JSON that is not JSON Lines


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_named_jsonl_says_it_is_an_array(tmp_path, classifier, indent):
    """A JSON array (pandas' to_json(orient='records'), json.dump(rows)) read as 'expected an object with a string
    field text' or 'not valid JSON (Expecting value: line 2 column 1)'; now it is named for what it is."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS, indent=indent))
    with pytest.raises(SymmergeError) as e:
        read(path, classifier)
    line = one_line(e)
    assert line.startswith(f"{path}:1: a JSON array, not JSON Lines") and "one object per line" in line, line


def test_an_object_spread_over_lines_says_one_per_line(tmp_path, classifier):
    path = tmp_path / "pretty.jsonl"
    path.write_text(json.dumps(ROWS[0], indent=2))
    with pytest.raises(SymmergeError, match=rf"^{path}:1: not valid JSON .*one JSON object per line"):
        read(path, classifier)


# ------------------------------------------------------------------ pixels


def images(path, x, y=None):
    import numpy as np

    np.savez(path, pixel_values=x, labels=np.arange(len(x)) % 3 if y is None else y)
    return path


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    from conftest import vit_folder
    from transformers import ViTForImageClassification

    return ViTForImageClassification.from_pretrained(str(vit_folder(tmp_path_factory.mktemp("vit") / "vit", 0)))


def test_uint8_pixels_are_refused_saying_how_to_scale_them(tmp_path, vit):
    import numpy as np

    path = images(tmp_path / "u8.npz", np.random.default_rng(0).integers(0, 256, (4, 1, 8, 8)).astype(np.uint8))
    with pytest.raises(SymmergeError) as e:
        load_data(path, vit)
    line = one_line(e)
    assert line.startswith(f"{path}: pixel_values") and "uint8" in line and "/ 255" in line, line


def test_float_pixels_in_0_255_are_read_with_a_note(tmp_path, vit, capsys):
    """0–255 pixels stored as floats were scored as if normalised, without a word: now a note says what they look
    like and how the model's own processor scales them (they are still read: a model may be trained on them)."""
    import numpy as np

    raw = np.random.default_rng(0).integers(0, 256, (4, 1, 8, 8)).astype(np.float32)
    data = load_data(images(tmp_path / "raw.npz", raw), vit)
    assert data.n == 4
    err = capsys.readouterr().err
    assert f"note: {tmp_path / 'raw.npz'}: pixel_values run from 0 to 255" in err and "/ 255" in err, err
    load_data(images(tmp_path / "scaled.npz", raw / 127.5 - 1), vit)
    assert "note" not in capsys.readouterr().err


# ------------------------------------------------------------------ a model folder without a tokenizer


def test_a_model_folder_without_a_tokenizer_is_one_line_saying_what_to_add(tmp_path):
    """transformers' refusal ran over five lines ('Couldn't instantiate the backend tokenizer from one of: (1) ...');
    now its first line, and what to copy into the folder."""
    folder = tmp_path / "llama"
    make_model("llama", head=True, dtype=torch.float32).save_pretrained(str(folder))
    path = tmp_path / "lines.txt"
    path.write_text("the cat\na dog\n")
    model = make_model("llama", head=True, dtype=torch.float32)
    with pytest.raises(SymmergeError) as e:
        load_data(path, model, tokenizer=str(folder))
    line = one_line(e)
    assert line.startswith(f"{folder}: no usable tokenizer in the model folder") and "tokenizer.json" in line, line


# ------------------------------------------------------------------ generate: specs


@pytest.mark.parametrize("spec, says", [
    ("generate:4:4:18446744073709551616", "SEED must be below 2**64"),
    ("generate:100000000000000000000", "N x LEN must be below 2**63"),
])
def test_a_generate_spec_past_what_torch_takes_is_one_error(spec, says):
    """A SEED of 2**64 was torch's 'Overflow when unpacking long long' traceback once the models were loaded, an N
    of 10**20 Python's OverflowError; now the spec's own error, before any model is read."""
    from symmerge.io.generate import parse_generate

    with pytest.raises(SymmergeError, match=re.escape(f"--align-data '{spec}': {says}")):
        parse_generate(spec)
    assert parse_generate("generate:4:4:18446744073709551615")[2] == 2 ** 64 - 1


# ------------------------------------------------------------------ empty texts


@pytest.mark.parametrize("text", ["", "   ", "\t"])
def test_an_empty_text_in_a_jsonl_is_one_error_naming_the_line(tmp_path, classifier, text):
    """An empty text was read: a tokenizer adding no BOS (the B7 Llamas') made it a row of pads only, which a decoder's
    classification head scores at a pad position (and a file of them was 'no usable tokenizer'); a .txt skips its
    blank lines, a .jsonl's labelled example cannot be dropped without changing the data."""
    path = tmp_path / "empty.jsonl"
    path.write_text(jsonl([ROWS[0], {"text": text, "label": 1}]))
    for labels in (True, False):
        with pytest.raises(SymmergeError, match=rf"^{path}:2: field 'text' is empty"):
            read(path, classifier, labels=labels)


def test_counting_the_cut_texts_says_nothing_of_indexing_errors(tmp_path, classifier, capfd, caplog):
    """Counting the texts cut (each one tokenized again whole) made transformers warn 'Token indices sequence length
    is longer than the specified maximum ... will result in indexing errors' (the real MiniLM's tokenizer, 512): no
    such error happens, the texts are cut; only the note is said."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(classifier[1], model_max_length=40)
    path = tmp_path / "long.txt"
    path.write_text(" ".join(["cat"] * 100) + "\n")
    capfd.readouterr()
    assert load_data(path, tokenizer=tokenizer, labels=False).truncated == 1
    err = capfd.readouterr().err
    assert "Token indices" not in err and err.count("\n") == 1 and err.startswith("note: "), err
    assert not [r for r in caplog.records if "Token indices" in r.getMessage()]


# ------------------------------------------------------------------ .npz arrays


def test_a_pickled_object_array_is_refused_by_name_and_never_unpickled(tmp_path, vit, monkeypatch):
    """np.load's allow_pickle stays off: the refusal names the array and says what to store instead (it quoted
    numpy's 'Object arrays cannot be loaded when allow_pickle=False')."""
    import pickle

    import numpy as np

    x = np.zeros((2, 1, 8, 8), dtype=np.float32)
    path = tmp_path / "objects.npz"
    np.savez(path, pixel_values=np.array([x[0], None], dtype=object), labels=np.array([0, 1]))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(SymmergeError) as e:
        load_data(path, vit)
    line = one_line(e)
    assert line.startswith(f"{path}: array 'pixel_values' holds pickled Python objects") and "float32" in line, line
    np.savez(path, pixel_values=x, labels=np.array([0, None], dtype=object))
    with pytest.raises(SymmergeError, match=r"'labels' holds pickled .* np\.asarray\(labels, dtype=np\.int64\)"):
        load_data(path, vit)


@pytest.mark.parametrize("labels, says", [
    ([[0], [1]], "labels.reshape(-1)"), ([0.0, 1.0], "labels.astype(np.int64)"),
])
def test_labels_of_another_shape_or_dtype_say_the_fix(tmp_path, vit, labels, says):
    import numpy as np

    path = images(tmp_path / "y.npz", np.zeros((2, 1, 8, 8), dtype=np.float32), np.array(labels))
    with pytest.raises(SymmergeError) as e:
        load_data(path, vit)
    line = one_line(e)
    assert line.startswith(f"{path}: labels must be a 1-D integer array") and says in line, line


def test_a_jsonl_label_out_of_range_names_its_line(tmp_path, classifier):
    """A label >= num_labels was 'label 7 of example 2': the 0-based index among the examples, which is not the
    line a user opens when blank lines come before it; now the line too."""
    path = tmp_path / "range.jsonl"
    path.write_text("\n" + jsonl(ROWS) + "\n" + jsonl([{"text": "the dog", "label": 7}]))
    with pytest.raises(SymmergeError) as e:
        read(path, classifier)
    line = one_line(e)
    assert line.startswith(f"{path}:5: label 7") and "num_labels=3" in line, line


# ------------------------------------------------------------------ tokenizers that pad on the left


def test_a_left_padding_tokenizer_is_read_padded_on_the_right(tmp_path):
    """A tokenizer saved with padding_side='left' (chat models' often are) padded .txt lines on the left, and each
    line's first token was scored as predicted from a pad (22 tokens scored on three lines where 20 are, loss 8.188
    against 8.175 for the lines alone); the data is now padded on the right, whatever the tokenizer's side, and
    scores what the lines score alone."""
    from symmerge.evaluate.metrics import evaluate

    folder = gpt_style_tokenizer(tmp_path / "tok")
    model = make_model("llama", head=True, dtype=torch.float32, vocab_size=len(WORDS))
    path = tmp_path / "lines.txt"
    lines = ["the cat", "a dog ran fast on the mat", "the cat sat on a mat"]
    path.write_text("\n".join(lines) + "\n")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    data = load_data(path, model, tokenizer=tokenizer)
    assert data.batches[0].mask[:, 0].all() and tokenizer.padding_side == "left"
    loss, count = 0.0, 0
    with torch.no_grad():
        for line in lines:
            ids = tokenizer(line, return_tensors="pt")["input_ids"]
            logits = model(input_ids=ids).logits[0, :-1].double()
            loss += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    score = evaluate(model, data, progress=False)
    assert score["n"] == count and score["loss"] == pytest.approx(loss / count, rel=1e-6)


def test_a_decoder_classifier_is_padded_with_its_config_pad_id_not_the_tokenizers(tmp_path):
    """A tokenizer whose pad token (here '<unk>', 0) is not the model's config pad_token_id (2) padded with 0, and a
    decoder's classification head, which looks for 2 to find each text's last token, read the shorter text's score
    at a pad position: 0.13 off its logits alone. Now the pads carry the config's id; the tokenizer is left as it is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gpt_style_tokenizer(tmp_path / "tok"), pad_token="<unk>")
    path = tmp_path / "texts.jsonl"
    path.write_text(jsonl([{"text": "the cat sat on a mat", "label": 0}, {"text": "a dog", "label": 1}]))
    model = decoder_classifier(pad_token_id=2)
    batch = load_data(path, model, tokenizer=tokenizer).batches[0]
    assert batch.inputs["input_ids"][1, 2:].tolist() == [2] * 4 and tokenizer.pad_token_id == 0
    with torch.no_grad():
        together = model(**batch.inputs).logits
        alone = [model(input_ids=batch.inputs["input_ids"][i:i + 1, batch.mask[i]]).logits[0] for i in range(2)]
    torch.testing.assert_close(together, torch.stack(alone), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["Generate:4", "GENERATE", "generated:4"])
def test_a_near_generate_spec_says_what_generate_is_spelled(spec):
    """'--align-data Generate:4' was 'unknown data format ""', with no word of generate."""
    from symmerge.io.data import check_data_path

    with pytest.raises(SymmergeError, match=r"or generate\[:N\[:LEN\[:SEED\]\]\] \(lower case\)"):
        check_data_path(spec, "--align-data")


def test_labelled_text_for_a_causal_lm_names_the_kind_of_model_before_its_pad_token(tmp_path):
    """A causal LM without a pad token given labelled ``.jsonl``: the kind of model is the fault, checked first (as
    :func:`check_data` orders it). Before, the pad-token advice came first, and following it led to this line."""
    import mergekit_oracle as mk

    model = make_model("llama", head=True, dtype=torch.float32)
    model.config.pad_token_id = None
    folder = tmp_path / "tok"
    folder.mkdir()
    mk.save_tokenizer(folder)
    path = tmp_path / "d.jsonl"
    path.write_text(jsonl([{"text": "w5 w6", "label": 0}, {"text": "w7", "label": 1}]))
    with pytest.raises(SymmergeError) as e:
        load_data(path, model, tokenizer=str(folder))
    assert one_line(e) == f"{path}: labelled data needs a classification model, got {type(model).__name__}"
