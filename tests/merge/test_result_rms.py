"""The merged tensor's norm check measures in float64: a finite result near float32's range (task arithmetic with
lambda 1e38: entries ~1e20 and more) warned "rms inf" (a float32 sum of squares overflowed), naming a norm that is
finite."""

from __future__ import annotations

import math

import torch

from symmerge.merge.outputs import check_result
from symmerge.merge.registry import get_method


def test_a_large_finite_result_is_warned_with_its_finite_norm():
    inputs = [torch.full((64, 64), 0.02), torch.full((64, 64), 0.03)]
    value = torch.full((64, 64), 3e20)  # finite in float32; its squares are not
    warning = check_result("w", value, inputs, get_method("task_arithmetic"), {"lambda": 1e38}, None)
    assert warning is not None and "far outside" in warning["warning"]
    assert math.isfinite(warning["rms"]) and abs(warning["rms"] / 3e20 - 1) < 1e-6
    assert "inf" not in warning["warning"]
