"""SCE's selection ranks the models' variance per entry as mergekit computes it (``torch.var(..., dim=0,
unbiased=False)``); symmerge computes the same bits faster (:func:`symmerge.merge.specialized.torch_variance`).
Held equal to torch bit for bit over dtypes, model counts, scales from 1e-6 to 5e3, equal values (zero variance),
variances that overflow float16, and chunk borders — and a float32 Welford, one rounding off, is shown to differ
(the test can fail)."""
import pytest
import torch

from symmerge.merge.specialized import torch_variance


def _cases(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for scale in (1e-6, 1e-3, 1.0, 50.0):
        x = torch.randn(n, 30011, generator=g) * scale * torch.rand(1, 30011, generator=g) ** 3
        x[:, ::7] = x[0:1, ::7]  # equal across the models: variance 0
        x[:, 1::11] *= 1e2  # far-apart magnitudes in one tensor (finite in float16: inputs are refused otherwise)
        x = x.to(dtype)
        assert torch.isfinite(x).all()
        out.append(x)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [2, 3, 4, 7, 12])
def test_the_variance_is_torch_var_bit_for_bit(dtype, n):
    for x in _cases(dtype, n, n):
        ref = torch.var(x, dim=0, unbiased=False)
        got = torch_variance(x, rows=4096)  # several chunks, the last one short
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got, ref)


def test_a_three_dimensional_stack_keeps_its_shape():
    x = torch.randn(3, 17, 9).bfloat16()
    assert torch.equal(torch_variance(x), torch.var(x, dim=0, unbiased=False))


def test_a_float32_welford_is_not_torchs_result():
    """The control: the same updates in float32 differ from torch on these inputs, so the equality above is not
    vacuous (torch accumulates in float64)."""
    diffs = 0
    for x in _cases(torch.bfloat16, 3, 0) + _cases(torch.bfloat16, 4, 1):
        y = x.float()
        mean, m2 = torch.zeros_like(y[0]), torch.zeros_like(y[0])
        for i in range(y.shape[0]):
            delta = y[i] - mean
            mean = mean + delta / (i + 1)
            m2 = m2 + delta * (y[i] - mean)
        diffs += int(((m2 / y.shape[0]).bfloat16() != torch.var(x, dim=0, unbiased=False)).sum())
    assert diffs > 0
