"""Merging and barriers with the residual symmetry: the aligned model comes back with its norms folded,
so the anchor must be folded too before the two are averaged or interpolated. B is a hidden symmetry
transform of A (every group, the residual stream included): aligned, A lands on the folded B exactly,
so the 50/50 average computes B's function and the interpolation path has no barrier."""

from __future__ import annotations

import pytest
import torch

from conftest import make_inputs, output_rel_diff
from factories import disguised, make_model
from symmerge.merge.barrier import barrier_study
from symmerge.io.data import Batch, Data
from symmerge.merge.fuse import merge_models

pytestmark = pytest.mark.usefixtures("single_thread")


def _pair():
    a = make_model("llama", head=True, dtype=torch.float32, seed=0)
    b = disguised(a, ("attn", "ffn", "rescale", "residual"), seed=5)[0]
    a.config.name_or_path = b.config.name_or_path = ""
    return a, b


def test_average_with_residual_alignment_recovers_the_function():
    a, b = _pair()
    x = make_inputs(a)
    assert output_rel_diff(a, b, x) < 1e-5  # same function, different weights
    merged, rep = merge_models([a, b], "average", align="attn,ffn,rescale,residual", anchor=1,
                               evaluate_result=False, progress=False)
    assert output_rel_diff(b, merged, x) < 1e-4
    plain, _ = merge_models([a, b], "average", align="attn,ffn,rescale", anchor=1, evaluate_result=False,
                            progress=False)
    assert output_rel_diff(b, plain, x) > 1e-2  # without the residual group the stream bases differ


def test_barrier_with_residual_is_flat():
    a, b = _pair()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, a.config.vocab_size, (4, 12), generator=g)
    labels = ids.clone()
    data = Data("synthetic", "lm", [Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels,
                                          torch.ones_like(ids, dtype=torch.bool))], 4)
    study = barrier_study(a, b, data, aligns=("attn,ffn,rescale,residual",), points=5, progress=False)
    curve = study["curves"]["attn,ffn,rescale,residual"]
    flat = max(curve["loss"]) - min(curve["loss"])
    assert curve["barrier"] < 1e-4 and flat < 1e-4 * max(curve["loss"])  # every θ(α) is B's function
    none = study["curves"]["none"]["loss"]
    assert max(none) - min(none) > 1e3 * max(flat, 1e-7)  # unaligned, the path leaves that function
