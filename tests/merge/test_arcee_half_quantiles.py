"""arcee_fusion in float16/bfloat16 takes its quartiles from a partial sort of the importances' float32 values;
mergekit indexes a full ``torch.sort`` of them in the half dtype. The same numbers, hence the same merge, bit for
bit — on ties (many equal importances) and on a constant tensor; the control: another index (off by one) differs."""
import pytest
import torch

from symmerge.merge.specialized import _arcee_half, arcee_importance


def _by_full_sort(tensors, base, shift=0):
    importance = arcee_importance(tensors[0], base)
    s = torch.sort(importance.reshape(-1)).values
    q1, median, q3 = (s[min(int(q * (s.numel() - 1)) + shift, s.numel() - 1)] for q in (0.25, 0.5, 0.75))
    keep = importance >= median + 1.5 * (q3 - q1)
    return base.float() + (tensors[0] - base).float() * keep


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64, 300), (1000,), (3, 5, 40)])
def test_the_half_precision_rule_equals_mergekits_full_sort(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    base = torch.randn(shape, generator=g).to(dtype)
    other = (base.float() + 0.05 * torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.3)).to(dtype)
    assert torch.equal(_arcee_half([other], base), _by_full_sort([other], base))
    assert torch.equal(_arcee_half([base.clone()], base), _by_full_sort([base.clone()], base))  # all importances 0


def test_the_comparison_can_fail():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 300, generator=g).bfloat16()
    other = (base.float() + 0.05 * torch.randn(64, 300, generator=g)).bfloat16()
    assert not torch.equal(_by_full_sort([other], base, shift=40), _by_full_sort([other], base))
