"""The inputs' tokenizers are compared before anything is aligned or merged (issue 23, item 2): the
same vocabulary size with different ids is one clear error naming the tokens, so is an added special
token; --allow-tokenizer-mismatch lets it through and the report says so; a folder without a tokenizer
is allowed with a note."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, save_folder
from factories import VOCAB, make_model
from symmerge.errors import SymmergeError
from symmerge.io.tokenizers import check_tokenizers, read_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]


def tokenizer(words=WORDS, added=()):
    """A real BertTokenizerFast over ``words`` (ids = positions), with ``added`` special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]")
    if added:
        tok.add_special_tokens({"additional_special_tokens": list(added)})
    return tok


def bert_folder(path, seed=0, tok=None):
    """A tiny BertModel folder with the tokenizer ``tok`` (none if ``None``)."""
    save_folder(make_model("bert", seed=seed), path)
    if tok is not None:
        tok.save_pretrained(str(path))
    return path


@pytest.fixture
def swapped():
    words = list(WORDS)
    words[10], words[11] = words[11], words[10]  # same size, two ids exchanged
    return tokenizer(words)


def test_identical_tokenizers_pass_and_are_recorded(tmp_path):
    a, b = bert_folder(tmp_path / "a", 0, tokenizer()), bert_folder(tmp_path / "b", 1, tokenizer())
    (b / "tokenizer_config.json").write_text(  # another writer's config: same content, other bytes
        json.dumps(json.loads((b / "tokenizer_config.json").read_text()), indent=4))
    entry = check_tokenizers([("a", a), ("b", b)])
    assert entry["status"] == "same" and entry["models"] == ["a", "b"] and "note" not in entry
    view = read_tokenizer(a)
    assert view.vocab["w0"] == 5 and view.special["cls_token"] == "[CLS]" and "[PAD]" in view.special_tokens and view.added == {}


def test_same_size_different_ids_is_one_clear_error(tmp_path, capsys, swapped):
    a, b = bert_folder(tmp_path / "a", 0, tokenizer()), bert_folder(tmp_path / "b", 1, swapped)
    assert len(read_tokenizer(a).vocab) == len(read_tokenizer(b).vocab)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "w0 w1", "label": 0}\n')
    for argv in (["merge", a, b, "--method", "average"], ["merge", a, b, "--method", "average", "--align", "none",
                                                             "--mode", "stream"],
                 ["align", a, b], ["align", a, b, "--stream"],
                 ["barrier", a, b, "--data", data]):
        out = tmp_path / f"out-{argv[0]}"
        assert run_cli(*argv, "-o", out) == 2
        err = capsys.readouterr().err
        assert "tokenizers of" in err and "token 'w5' has id 10 in" in err and "and 11 in" in err, err
        assert "token 'w6' has id 11" in err and "--allow-tokenizer-mismatch" in err
        assert not out.exists()
    # the Python API too, before any model is loaded
    from symmerge import align, merge_models

    with pytest.raises(SymmergeError, match="token 'w5' has id 10"):
        merge_models([a, b], "average", progress=False)
    with pytest.raises(SymmergeError, match="token 'w5' has id 10"):
        align(a, b)


def test_the_flag_lets_a_mismatch_through_and_the_report_says_so(tmp_path, capsys, swapped):
    a, b = bert_folder(tmp_path / "a", 0, tokenizer()), bert_folder(tmp_path / "b", 1, swapped)
    out = tmp_path / "out"
    assert run_cli("merge", a, b, "--method", "average", "--allow-tokenizer-mismatch", "-o", out) == 0
    assert "tokenizers differ" in capsys.readouterr().err
    entry = json.loads((out / "symmerge_report.json").read_text())["tokenizer"]
    assert entry["status"] == "different" and entry["allow_mismatch"] is True
    assert entry["mismatches"][0]["models"] == [str(a), str(b)]
    assert any("'w5' has id 10" in d for d in entry["mismatches"][0]["differences"])
    aligned = tmp_path / "aligned"
    assert run_cli("align", a, b, "--allow-tokenizer-mismatch", "-o", aligned) == 0
    assert json.loads((aligned / "symmerge_report.json").read_text())["tokenizer"]["status"] == "different"


def test_an_added_special_token_is_an_error(tmp_path, capsys):
    a = bert_folder(tmp_path / "a", 0, tokenizer())
    b = bert_folder(tmp_path / "b", 1, tokenizer(added=["<extra>"]))
    assert run_cli("merge", a, b, "--method", "average", "-o", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"token '<extra>' (id {VOCAB}) is in {b} only" in err, err
    assert "special token additional_special_tokens is None in" in err and "'<extra>' is a special token in" in err
    # a special role given to another token is named too, even when the vocabularies agree
    c = bert_folder(tmp_path / "c", 2, tokenizer())
    config = json.loads((c / "tokenizer_config.json").read_text())
    config["cls_token"] = "[SEP]"
    (c / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SymmergeError, match=r"special token cls_token is '\[CLS\]' in a and '\[SEP\]' in c"):
        check_tokenizers([("a", a), ("c", c)])


def test_malformed_tokenizer_files_are_one_clear_error(tmp_path):
    a, b = bert_folder(tmp_path / "a", 0, tokenizer()), bert_folder(tmp_path / "b", 1, tokenizer())
    tj = json.loads((b / "tokenizer.json").read_text())
    tj["added_tokens"] = [{"id": "x"}]
    (b / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(SymmergeError, match="malformed tokenizer files"):
        check_tokenizers([("a", a), ("b", b)])
    (b / "tokenizer.json").write_text("{not json")
    with pytest.raises(SymmergeError, match="tokenizer.json: unreadable tokenizer file"):
        check_tokenizers([("a", a), ("b", b)])


def test_a_folder_without_tokenizer_is_allowed_with_a_note(tmp_path, capsys):
    a, b = bert_folder(tmp_path / "a", 0, tokenizer()), bert_folder(tmp_path / "b", 1)
    out = tmp_path / "out"
    assert run_cli("merge", a, b, "--method", "average", "-o", out) == 0
    err = capsys.readouterr().err
    assert f"note: tokenizers: no tokenizer in {b}" in err
    entry = json.loads((out / "symmerge_report.json").read_text())["tokenizer"]
    assert entry["status"] == "not_compared" and f"no tokenizer in {b}" in entry["note"]


def test_in_memory_models_are_not_compared(tmp_path):
    from symmerge import merge_models

    a = bert_folder(tmp_path / "a", 0, tokenizer())
    _, report = merge_models([a, make_model("bert", seed=1)], "average", align="none", progress=False)
    assert report["tokenizer"]["status"] == "not_compared"
    assert "model 1 given as in-memory model" in report["tokenizer"]["note"]


def test_vocab_txt_and_the_real_minilm_tokenizer(tmp_path, minilm):
    """Without tokenizer.json, vocab.txt is read; the real MiniLM tokenizer equals its vocab.txt reading."""
    import shutil

    path = minilm[0]
    full = read_tokenizer(path)
    slow = tmp_path / "slow"
    slow.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{path}/{name}", slow / name)
    assert check_tokenizers([("full", path), ("slow", slow)])["status"] == "same"
    assert len(full.vocab) == 30522 and full.special["mask_token"] == "[MASK]"
    lines = (slow / "vocab.txt").read_text().splitlines()
    lines[2000], lines[2001] = lines[2001], lines[2000]
    (slow / "vocab.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(SymmergeError, match=f"token {lines[2001]!r} has id 2000 in full and 2001 in slow"):
        check_tokenizers([("full", path), ("slow", slow)])
