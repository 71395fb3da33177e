"""symmerge.demo.text (reST cleaning, document splits, the BPE tokenizer, token blocks) and
symmerge.demo.lm (a tiny GPT-2 learns, the cache key and reuse) — on small synthetic files written to
tmp, no downloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from symmerge.demo import text
from symmerge.demo.lm import gpt2_config, lm_scores, train_gpt2
from symmerge.demo.train import TrainSettings, load_report
from symmerge.errors import SymmergeError
from symmerge.evaluate.metrics import evaluate
from symmerge.io.data import load_data
from symmerge.io.model import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

RST = """\
:mod:`bisect` --- Array bisection algorithm
===========================================

.. module:: bisect
   :synopsis: Array bisection algorithms.
.. sectionauthor:: Someone <someone@example.org>

This module provides support for maintaining a list in sorted order
without having to sort the list after each insertion, see :func:`~os.path.join`.

For example::

    >>> bisect([1, 2], 3)
    2

.. function:: bisect_left(a, x, lo=0)

   Locate the insertion point for *x* in *a* to keep ``a`` sorted,
   as `the paper <https://example.org>`_ explains [#]_.

   .. versionchanged:: 3.10
      Added the *key* parameter to the function.

* A bullet item that is long enough to count as prose.
* short one

.. code-block:: python

   print("this is code, not prose, and it is long enough")

+--------+--------+
| a      | table  |
+--------+--------+

>>> a doctest line that must vanish, with several words
An object's :meth:`__del__` method is called, see os_ and :ref:`the section <sec>`.
"""

EXPECTED = [
    "This module provides support for maintaining a list in sorted order without having to sort the list "
    "after each insertion, see join.",
    "Locate the insertion point for x in a to keep a sorted, as the paper explains.",
    "Added the key parameter to the function.",
    "A bullet item that is long enough to count as prose.",
]


def test_rst_paragraphs_keeps_prose_only():
    got = text.rst_paragraphs(RST)
    assert got == EXPECTED


def test_clean_inline_markup():
    assert text.clean_inline("an object's :meth:`__del__`, :func:`os.path.join`, :func:`~os.path.join`, "
                             "``x = 1``, *emph* **strong** foo_ `Bar <http://x>`_") == \
        "an object's __del__, os.path.join, join, x = 1, emph strong foo Bar"


def make_corpus(folder, n=12):
    rng = np.random.default_rng(3)
    words = "the module function returns a value when its argument is given and raises an error".split()
    for i in range(n):
        sub = folder / ("library" if i % 2 else "howto")
        sub.mkdir(parents=True, exist_ok=True)
        paras = [" ".join(rng.choice(words, 12)).capitalize() + "." for _ in range(1 + i % 4)]
        (sub / f"doc{i:02d}.rst.txt").write_text(f"Title {i}\n=======\n\n" + "\n\n".join(paras) + "\n")
    return folder


def test_corpus_splits_deterministic_by_document(tmp_path):
    src = make_corpus(tmp_path / "src")
    s1 = text.corpus_splits(src, fractions=(0.2, 0.2), seed=0, root=tmp_path / "c1")
    s2 = text.corpus_splits(src, fractions=(0.2, 0.2), seed=0, root=tmp_path / "c2")
    for s in text.SPLITS:
        assert s1[s].read_bytes() == s2[s].read_bytes() and s1[s].stat().st_size > 0
    manifest = json.loads((s1["train"].parent / "manifest.json").read_text())
    parts = {s: manifest["splits"][s]["documents"] for s in text.SPLITS}
    every = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.rst.txt"))
    assert sorted(sum(parts.values(), [])) == every  # a partition of the documents
    assert len(set(sum(parts.values(), []))) == len(every)
    docs = text.read_documents(src)
    for s in text.SPLITS:  # each split's file holds exactly its documents' paragraphs, in name order
        assert text.read_lines(s1[s]) == [p for d in parts[s] for p in docs[d]]
    chars = {s: manifest["splits"][s]["characters"] for s in text.SPLITS}
    assert chars["test"] >= 0.2 * sum(chars.values()) * 0.9 and chars["train"] > chars["test"]
    other = text.corpus_splits(src, fractions=(0.2, 0.2), seed=1, root=tmp_path / "c1")
    assert json.loads((other["train"].parent / "manifest.json").read_text())["splits"]["test"]["documents"] \
        != parts["test"]
    # cached: a second call finds the folder without re-reading (the manifest is not rewritten)
    stamp = (s1["train"].parent / "manifest.json").stat().st_mtime_ns
    assert text.corpus_splits(src, fractions=(0.2, 0.2), seed=0, root=tmp_path / "c1") == s1
    assert (s1["train"].parent / "manifest.json").stat().st_mtime_ns == stamp


def test_split_and_read_errors(tmp_path, monkeypatch):
    with pytest.raises(SymmergeError, match="no \\*.rst.txt"):
        text.read_documents(tmp_path)
    with pytest.raises(SymmergeError, match="at least 3 documents"):
        text.split_documents({"a": ["x"], "b": ["y"]})
    with pytest.raises(SymmergeError, match="fractions"):
        text.split_documents({"a": ["x"], "b": ["y"], "c": ["z"]}, fractions=(0.6, 0.5))
    monkeypatch.setattr(text, "PYDOCS_SYSTEM_DIR", tmp_path / "nowhere")
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path / "empty"))
    with pytest.raises(SymmergeError, match="not available"):
        text.python_docs_dir(fetch=False)


TEXTS = ["The function returns the value of its argument.", "An error is raised when the file is missing.",
         "Use the module to parse command line options.", "Python's documentation — “quotes”, ünïcode and tabs."] * 20


def test_tokenizer_round_trip_and_cache(tmp_path):
    tok = text.train_tokenizer(TEXTS, vocab_size=300, max_length=64, root=tmp_path / "a")
    again = text.train_tokenizer(TEXTS, vocab_size=300, max_length=64, root=tmp_path / "b")
    assert tok.backend_tokenizer.to_str() == again.backend_tokenizer.to_str()  # deterministic
    assert len(tok) == 300 and tok.eos_token == tok.pad_token == text.EOT and tok.eos_token_id == 0
    assert tok.model_max_length == 64
    for s in TEXTS[:4] + ["unseen words: zebra Ω 🙂"]:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == s
    phrase = "The function returns the value"
    assert len(tok(phrase)["input_ids"]) < 0.7 * len(phrase.encode())  # merges learned: fewer tokens than bytes
    stream = text.token_stream(TEXTS[:3], tok)
    assert (stream == tok.eos_token_id).sum() == 3 and stream[-1] == tok.eos_token_id
    b = text.blocks(stream, 8)
    assert b.shape == (len(stream) // 8, 8) and b.dtype == np.int64 and np.array_equal(b.ravel(), stream[:b.size])
    with pytest.raises(SymmergeError, match="257"):
        text.train_tokenizer(TEXTS, vocab_size=100, root=tmp_path)
    with pytest.raises(SymmergeError, match="fill one block"):
        text.blocks(stream[:3], 8)
    # a reused folder: same object content, no retraining
    folder = next((tmp_path / "a").iterdir())
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    text.train_tokenizer(TEXTS, vocab_size=300, max_length=64, root=tmp_path / "a")
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp


def test_tiny_gpt2_learns_and_is_cached(tmp_path):
    tok = text.train_tokenizer(TEXTS, vocab_size=300, max_length=32, root=tmp_path / "tok")
    stream = text.token_stream(TEXTS, tok)
    blocks = text.blocks(stream, 16)
    config = gpt2_config(len(tok), context=32, hidden=32, layers=1, heads=2, eos_token_id=tok.eos_token_id)
    settings = TrainSettings(steps=60, batch_size=8, lr=3e-3, seed=0)
    from transformers import GPT2LMHeadModel

    torch.manual_seed(settings.seed)  # the initialisation train_gpt2 starts from (same seed)
    before, _ = lm_scores(GPT2LMHeadModel(config), blocks)
    logs = []
    folder = train_gpt2(config, blocks, settings, tok, name="t", eval_blocks=blocks, eval_every=20,
                        root=tmp_path / "m", progress=False, log=logs.append)
    report = load_report(folder)
    assert report["eval_loss"] < before - 1.0  # learned the repeated sentences
    assert [p["step"] for p in report["eval_curve"]] == [20, 40]
    assert report["eval_curve"][-1]["loss"] < report["eval_curve"][0]["loss"]
    assert report["tie_word_embeddings"] is True and report["tokens_seen"] == 60 * 8 * 16
    model = load_model(folder)
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    assert lm_scores(model, blocks)[0] == pytest.approx(report["eval_loss"], rel=1e-6)
    # the folder's tokenizer serves the .txt data format (AutoTokenizer), and scores the same texts
    data_file = tmp_path / "held.txt"
    text.write_lines(data_file, TEXTS[:8])
    data = load_data(data_file, model)
    score = evaluate(model, data, progress=False)
    assert 0 < score["loss"] < before and score["n"] > 0
    # cached: same inputs reuse the folder; another seed trains anew
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert train_gpt2(config, blocks, settings, tok, name="t", root=tmp_path / "m", progress=False,
                      log=logs.append) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp and "reusing" in logs[-1]
    other = train_gpt2(config, blocks, TrainSettings(steps=2, batch_size=8, seed=1), tok, name="t",
                       root=tmp_path / "m", progress=False, log=logs.append)
    assert other != folder


def test_train_gpt2_rejects_bad_input(tmp_path):
    tok = text.train_tokenizer(TEXTS, vocab_size=300, max_length=32, root=tmp_path / "tok")
    config = gpt2_config(len(tok), context=8, hidden=16, layers=1, heads=2)
    s = TrainSettings(steps=1, batch_size=2)
    kw = dict(root=tmp_path, progress=False, log=lambda *_: None)
    with pytest.raises(SymmergeError, match="exceed the model's context"):
        train_gpt2(config, np.zeros((4, 16), np.int64), s, tok, **kw)
    with pytest.raises(SymmergeError, match="token ids"):
        train_gpt2(config, np.full((4, 8), 300), s, tok, **kw)
    with pytest.raises(SymmergeError, match="shape"):
        train_gpt2(config, np.zeros(8, np.int64), s, tok, **kw)
    with pytest.raises(SymmergeError, match="tokenizer has"):
        train_gpt2(gpt2_config(512, context=8, hidden=16, layers=1, heads=2), np.zeros((4, 8)), s, tok, **kw)
    with pytest.raises(SymmergeError, match="divisible"):
        gpt2_config(300, hidden=30, heads=4)


def test_training_leaves_the_callers_random_state(tmp_path):
    """train_gpt2 (every causal LM of the demos) seeds torch for its initialisation and dropout; the caller's global
    generator is as it was after it, not re-seeded to ``settings.seed``."""
    tok = text.train_tokenizer(TEXTS, vocab_size=300, max_length=32, root=tmp_path / "tok")
    blocks = text.blocks(text.token_stream(TEXTS, tok), 16)
    config = gpt2_config(len(tok), context=32, hidden=16, layers=1, heads=2, eos_token_id=tok.eos_token_id)
    torch.manual_seed(1234)
    torch.rand(5)
    state = torch.get_rng_state()
    folder = train_gpt2(config, blocks, TrainSettings(steps=2, batch_size=8, seed=0), tok, name="r",
                        root=tmp_path / "m", progress=False, log=lambda *_: None)
    assert (folder / "model.safetensors").exists()
    assert torch.equal(torch.get_rng_state(), state)
