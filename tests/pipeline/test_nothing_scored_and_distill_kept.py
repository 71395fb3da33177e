"""Faults a probe of the learned path found (2026-12-03), each reproduced first with ``symmerge`` on tiny GPT-2s:

* next-token data whose texts are one token long score nothing: learned alignment learned on 0/0 (``loss=nan``,
  exit 0, ``held_out_start: null``), a joint run printed "objective nan -> nan", ``--distill`` was a
  ZeroDivisionError traceback (all such texts) or "distillation diverged; lower --distill-lr" (the first minibatches
  such texts). Batches that score nothing are now dropped (:func:`symmerge.pipeline.data.with_scored_items`,
  ``scoring``), and data with nothing to score is one error naming the file;
* ``--distill`` kept a model whose held-out KL to the ensemble rose (0.2257 -> 1.6199 on a trained ViT pair, its
  accuracy 0.950 -> 0.17), with no warning: it now keeps the merge undistilled, and says so."""

from __future__ import annotations

import pytest
import torch

from conftest import npz_file, vit_folder
from symmerge.errors import SymmergeError
from symmerge.io.data import Batch, Data, load_data
from symmerge.merge.fuse import merge_models
from symmerge.pipeline.data import with_scored_items
from symmerge.pipeline.distill import DistillSettings, distill

pytestmark = pytest.mark.usefixtures("single_thread")


def _lm_batch(lengths, width=5, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = torch.tensor([[j < n for j in range(width)] for n in lengths])
    return Batch({"input_ids": ids, "attention_mask": mask.long()}, None, mask)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16)).eval()


def test_batches_that_score_nothing_are_dropped_and_none_left_is_one_error():
    one, mixed, full = _lm_batch([1, 1]), _lm_batch([1, 3]), _lm_batch([5, 4])
    data = Data("d.txt", "lm", [one, mixed, one, full], 8, labeled=False)
    kept = with_scored_items(data, "learned alignment")
    assert kept.batches == [mixed, full] and kept.n == 4
    with pytest.raises(SymmergeError, match=r"d\.txt: no text has a next token to predict.*learned alignment"):
        with_scored_items(Data("d.txt", "lm", [one, one], 4, labeled=False), "learned alignment")
    images = Data("d.npz", "image", [Batch({"pixel_values": torch.zeros(2, 1, 8, 8)}, None, None)], 2, labeled=False)
    assert with_scored_items(images, "x") is images


def test_distillation_on_one_token_texts_is_one_error_not_a_division_by_zero():
    a, b = _gpt2(), _gpt2()
    data = Data("d.txt", "lm", [_lm_batch([1, 1], seed=s) for s in range(4)], 8, labeled=False)
    with pytest.raises(SymmergeError, match="no text has a next token to predict.*distillation"):
        distill(a, [a, b], data, settings=DistillSettings(steps=2))


def test_distillation_skips_the_minibatches_that_score_nothing():
    a = _gpt2()
    torch.manual_seed(1)
    b = type(a)(a.config).eval()
    batches = [_lm_batch([1] * 4, seed=s) for s in range(3)] + [_lm_batch([5, 4, 5, 3], seed=9 + s) for s in range(3)]
    data = Data("d.txt", "lm", batches, 24, labeled=False)
    _, report = distill(a, [a, b], data, settings=DistillSettings(steps=3, batch=4, holdout=0.2))
    values = [report["kl_before"]["train"], report["kl_after"]["held_out"], report["loss_first"]]
    assert all(v is not None and v == v for v in values), report  # no NaN anywhere


def test_a_distillation_that_raises_the_held_out_kl_keeps_the_merge(tmp_path):
    from transformers import ViTForImageClassification

    a, b = (ViTForImageClassification.from_pretrained(vit_folder(tmp_path / f"m{s}", seed=s)).eval() for s in (0, 1))
    merged = merge_models([a, b], "average", align="none", evaluate_result=False, progress=False)[0]
    data = load_data(npz_file(tmp_path / "train.npz", n=64, seed=1), a, batch_size=16, labels=False)
    out, report = distill(merged, [a, b], data, settings=DistillSettings(steps=8, lr=5.0))
    assert report["kl_after"]["held_out"] > report["kl_before"]["held_out"]  # such a step size overshoots
    assert report["kept"] is False and "kept undistilled" in report["warning"]
    assert out is merged
    good, report = distill(merged, [a, b], data, settings=DistillSettings(steps=30, lr=3e-3))
    assert report["kept"] is True and "warning" not in report and good is not merged
