"""The text demo's caches (``symmerge.demo.text``: the corpus splits and the trained tokenizers) as a user meets them:
a split file or a tokenizer file that was changed, or a manifest that no longer reads, is built again with a note,
never reused; an entry of an earlier version is reused when it still matches what it recorded."""

from __future__ import annotations

import json

import pytest

from symmerge.demo import text
from symmerge.io.cache import DIGESTS
from test_text_lm import TEXTS, make_corpus


@pytest.mark.parametrize("damage", ["appended", "manifest", "missing"])
def test_damaged_splits_are_built_again(damage, tmp_path, capsys):
    src = make_corpus(tmp_path / "src")
    first = text.corpus_splits(src, fractions=(0.2, 0.2), root=tmp_path / "c")
    good = {s: p.read_bytes() for s, p in first.items()}
    folder = first["train"].parent
    if damage == "appended":
        with open(first["train"], "a") as f:
            f.write("a line nobody wrote\n")
    elif damage == "manifest":
        (folder / "manifest.json").write_text("{junk")
    else:
        first["test"].unlink()
    capsys.readouterr()
    assert text.corpus_splits(src, fractions=(0.2, 0.2), root=tmp_path / "c") == first
    assert {s: p.read_bytes() for s, p in first.items()} == good
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and str(folder) in notes[0] and "again" in notes[0]


def test_splits_of_an_earlier_version_are_checked_by_their_line_counts(tmp_path, capsys):
    src = make_corpus(tmp_path / "src")
    first = text.corpus_splits(src, fractions=(0.2, 0.2), root=tmp_path / "c")
    manifest = first["train"].parent / "manifest.json"
    old = json.loads(manifest.read_text())
    for entry in old["splits"].values():
        del entry["sha256"]
    manifest.write_text(json.dumps(old))
    assert text.corpus_splits(src, fractions=(0.2, 0.2), root=tmp_path / "c") == first
    assert "note" not in capsys.readouterr().err  # reused as it is
    with open(first["validation"], "a") as f:
        f.write("one more line\n")
    text.corpus_splits(src, fractions=(0.2, 0.2), root=tmp_path / "c")
    assert "note: " in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["junk", "vocabulary"])
def test_a_damaged_tokenizer_is_trained_again(damage, tmp_path, capsys):
    tok = text.train_tokenizer(TEXTS, vocab_size=300, max_length=64, root=tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("bpe")]
    assert (folder / DIGESTS).is_file()
    good = (folder / "tokenizer.json").read_text()
    if damage == "junk":
        (folder / "tokenizer.json").write_text("{junk")
    else:  # still a valid tokenizer: two tokens' ids swapped
        data = json.loads(good)
        vocab = data["model"]["vocab"]
        a, b = list(vocab)[-2:]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (folder / "tokenizer.json").write_text(json.dumps(data))
    capsys.readouterr()
    again = text.train_tokenizer(TEXTS, vocab_size=300, max_length=64, root=tmp_path)
    assert (folder / "tokenizer.json").read_text() == good and again.get_vocab() == tok.get_vocab()
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and str(folder) in notes[0] and "training the tokenizer again" in notes[0]
