"""B7's learned rows (``benchmarks.llama_text``): the ``learned-dual`` row and the α-range flags reach the
alignment's settings, the function checks measure what they say (absolute and relative, and fail on a changed
model), and a dual alignment of two real ``LlamaForCausalLM`` is checked on both moved models, each
against its own original, within fp32's 1e-5 relative. Tiny random models: seconds."""

from __future__ import annotations

import pytest
import torch

from benchmarks import llama_text as lt
from factories import make_model
from symmerge.io.data import Batch
from symmerge.pipeline.align import align_pair
from test_learn import unlabeled

pytestmark = pytest.mark.usefixtures("single_thread")


def _pair():
    return tuple(make_model("llama", head=True, seed=s, dtype=torch.float32) for s in (0, 1))


def _batch(model) -> Batch:
    return unlabeled(model, n_batches=1, batch=4, seed=7).batches[0]


def test_the_dual_row_and_the_alpha_range_reach_the_settings():
    args = lt.parse_args(["--rows", "learned,learned-dual", "--learn-alpha-low", "0.25", "--learn-alpha-high",
                          "0.75", "--learn-steps", "7", "--learn-budget", "30", "--temperature", "--learn-seed", "3"])
    one, dual = (lt.row_options(args, r, "unused.txt") for r in args.rows)
    assert (one.learn.frame, dual.learn.frame) == ("one-sided", "dual")
    for o in (one, dual):
        assert (o.match, o.learn.alpha_low, o.learn.alpha_high, o.learn.steps, o.learn.budget, o.learn.seed) == \
            ("learned", 0.25, 0.75, 7, 30.0, 3)
    assert args.temperature and args.temperature_examples == 100
    plain = lt.row_options(lt.parse_args(["--rows", "learned"]), "learned", "unused.txt")
    assert (plain.learn.alpha_low, plain.learn.alpha_high, plain.learn.budget, plain.learn.seed) == (0.1, 0.9, None, 0)
    assert lt.ROWS["learned-dual"] == {**lt.ROWS["learned"], "frame": "dual"}  # the row leaves ROWS unchanged
    lt.row_options(args, "learned-dual", "unused.txt")
    assert "frame" in lt.ROWS["learned-dual"]


def test_function_checks_are_the_logit_difference_and_fail_on_a_changed_model():
    a, _ = _pair()
    batch = _batch(a)
    assert lt.function_checks(a, a, batch) == (0.0, 0.0)
    changed = make_model("llama", head=True, seed=0, dtype=torch.float32)
    with torch.no_grad():
        changed.lm_head.weight[3] += 0.5
    diff, rel = lt.function_checks(changed, a, batch)
    with torch.no_grad():
        la, lc = a(**batch.inputs).logits.double(), changed(**batch.inputs).logits.double()
    assert diff == pytest.approx((lc - la).abs().max().item(), rel=1e-12) and diff > 1e-3
    assert rel == pytest.approx(diff / la.abs().max().item(), rel=1e-12)
    assert lt.function_check(changed, a, batch) == diff


def test_a_dual_alignment_checks_both_moved_models_against_their_originals():
    a, b = _pair()
    args = lt.parse_args(["--rows", "learned-dual", "--learn-steps", "4", "--learn-batch", "4",
                          "--learn-alpha-low", "0.5", "--learn-alpha-high", "0.5"])
    opts = lt.row_options(args, "learned-dual", unlabeled(a, n_batches=2, batch=4))
    res = align_pair(a, b, opts)
    assert res.report["learned"]["models_moved"] == 2
    batch = _batch(a)
    fields = lt.function_fields(res.model, a, res.anchor, b, batch)
    assert set(fields) == {"function_check", "function_check_rel", "function_check_anchor",
                           "function_check_anchor_rel"}
    assert fields["function_check_rel"] <= 1e-5 and fields["function_check_anchor_rel"] <= 1e-5
    moved = [k for k, v in b.state_dict().items() if not torch.equal(v, res.anchor.state_dict()[k])]
    assert moved  # B really moved: its check compares two different parameterisations
    # negative control: B's moved form is not A's function, and the check says so
    assert lt.function_checks(res.anchor, a, batch)[1] > 1e-2
    # an anchor that did not move gets no anchor check
    assert set(lt.function_fields(a, a, b, b, batch)) == {"function_check", "function_check_rel"}
