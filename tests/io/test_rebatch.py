"""``io.data.rebatch`` and the one meaning of ``--learn-batch`` / ``--learn-max-length``: an in-memory ``Data``
handed to the learned alignment is batched (and its sequences cut) as reading its file with those settings batches
it, so the learned alignment from a ``Data`` equals the one from the file, bit for bit (before, a ``Data``'s own
batches were the steps' minibatches: the demo's batches of 50 gave another alignment than its file)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import npz_file, vit_folder, write_tokenizer
from factories import make_model
from symmerge.errors import SymmergeError
from symmerge.io.data import load_data, rebatch
from symmerge.io.model import load_model

LINES = ["the cat sat on the mat", "a dog", "the dog sat on a cat ran fast", "slow", "cat ran on the mat",
         "the a cat dog sat on mat ran fast slow the", "dog dog", "the mat"] * 2


def _same(x, y) -> None:
    assert x.n == y.n and x.format == y.format and len(x.batches) == len(y.batches)
    for b, c in zip(x.batches, y.batches):
        assert b.inputs.keys() == c.inputs.keys()
        for k in b.inputs:
            assert torch.equal(b.inputs[k], c.inputs[k]), k
        assert (b.labels is None) == (c.labels is None) and (b.labels is None or torch.equal(b.labels, c.labels))
        assert (b.mask is None) == (c.mask is None) and (b.mask is None or torch.equal(b.mask, c.mask))


@pytest.fixture
def lm_folder(tmp_path):
    model = make_model("llama", head=True, seed=0, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "m")
    write_tokenizer(tmp_path / "m")
    (tmp_path / "lines.txt").write_text("\n".join(LINES) + "\n")
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n"
                                                  for i, t in enumerate(LINES)))
    return tmp_path, model


@pytest.mark.parametrize("before, after", [(3, 5), (7, 5), (5, 3), (1, 16), (16, 1)])
def test_images_rebatched_equal_the_file_read_so(tmp_path, before, after):
    path = npz_file(tmp_path / "x.npz", n=17)
    model = load_model(vit_folder(tmp_path / "v", 0))
    _same(rebatch(load_data(path, model, batch_size=before), after), load_data(path, model, batch_size=after))


@pytest.mark.parametrize("name", ["lines.txt", "texts.jsonl"])
@pytest.mark.parametrize("before, after", [(3, 5), (5, 3), (2, 16)])
def test_texts_rebatched_equal_the_file_read_so(lm_folder, name, before, after):
    folder, model = lm_folder
    owner = model if name.endswith(".txt") else None  # labelled texts: no classifier here, the tokenizer alone
    read = lambda n: load_data(folder / name, owner, tokenizer=folder / "m", batch_size=n)  # noqa: E731
    _same(rebatch(read(before), after), read(after))


def test_max_length_keeps_each_sequences_first_tokens(lm_folder):
    folder, model = lm_folder
    data = load_data(folder / "lines.txt", model, tokenizer=folder / "m", batch_size=4)
    cut = rebatch(data, 6, max_length=4)
    rows = [ids[m] for b in data.batches for ids, m in zip(b.inputs["input_ids"], b.mask)]
    out = [ids[m] for b in cut.batches for ids, m in zip(b.inputs["input_ids"], b.mask)]
    assert [len(b.mask) for b in cut.batches] == [6, 6, 4]
    assert len(out) == len(rows) and all(torch.equal(o, r[:4]) for o, r in zip(out, rows))
    assert max(b.mask.shape[1] for b in cut.batches) == 4 > 3
    labels = [lab[m] for b in cut.batches for lab, m in zip(b.labels, b.mask)]
    assert all(torch.equal(lab, o) for lab, o in zip(labels, out))  # the LM's targets are its tokens
    assert all((b.labels[~b.mask] == -100).all() for b in cut.batches)


def test_already_so_batched_is_returned_as_is_and_bad_sizes_refused(tmp_path):
    path = npz_file(tmp_path / "x.npz", n=12)
    data = load_data(path, load_model(vit_folder(tmp_path / "v", 0)), batch_size=5)
    assert rebatch(data, 5) is data
    with pytest.raises(SymmergeError, match="batch size"):
        rebatch(data, 0)


def _learned(a, b, source, **learn):
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    options = AlignOptions(symmetries="recommended", match="learned", align_data=source, align_samples=12,
                           learn=LearnSettings(steps=6, check_every=3, augment=0, **learn))
    return align_pair(a, b, options, progress=None).model.state_dict()


def test_learned_alignment_from_a_data_equals_it_from_the_file_images(tmp_path, single_thread):
    a, b = (load_model(vit_folder(tmp_path / n, s)) for n, s in (("a", 0), ("b", 1)))
    path = npz_file(tmp_path / "x.npz", n=16)
    from_file = _learned(a, b, path, batch=5)
    from_data = _learned(a, b, load_data(path, a, batch_size=3), batch=5)
    assert all(torch.equal(from_file[k], from_data[k]) for k in from_file)
    other = _learned(a, b, path, batch=3)  # the batch size matters: the test can tell
    assert not all(torch.equal(from_file[k], other[k]) for k in from_file)


def test_learned_alignment_from_a_data_equals_it_from_the_file_text(lm_folder, single_thread):
    folder, a = lm_folder
    b = make_model("llama", head=True, seed=3, dtype=torch.float32).eval()
    data = load_data(folder / "lines.txt", a, tokenizer=folder / "m", batch_size=3, labels=False)
    as_read = load_data(folder / "lines.txt", a, tokenizer=folder / "m", batch_size=5, labels=False,
                        max_examples=12)
    from_file = _learned(a, b, as_read, batch=5)  # the file read as --align-samples 12 --learn-batch 5 reads it
    from_data = _learned(a, b, data, batch=5)
    assert all(torch.equal(from_file[k], from_data[k]) for k in from_file)


def _to_left(data):
    """``data`` padded on the left instead: each row's real tokens moved to its end (pads and mask along)."""
    from symmerge.io.data import Batch, Data

    def roll(b):
        shifts = (~b.mask).sum(1)
        move = lambda t: torch.stack([r.roll(int(s)) for r, s in zip(t, shifts)])  # noqa: E731
        return Batch({k: move(v) for k, v in b.inputs.items()}, None if b.labels is None else move(b.labels),
                     move(b.mask))
    return Data(data.path, data.format, [roll(b) for b in data.batches], data.n, data.labeled)


def test_left_padded_texts_stay_left_padded(lm_folder):
    folder, model = lm_folder
    read = lambda n: load_data(folder / "lines.txt", model, tokenizer=folder / "m", batch_size=n)  # noqa: E731
    left = rebatch(_to_left(read(3)), 5)
    assert all(b.mask[:, -1].all() for b in left.batches) and not left.batches[0].mask[:, 0].all()
    _same(left, _to_left(read(5)))
