"""mergekit's task-vector arithmetic in the inputs' own dtype, where its rounding is the observable result.

mergekit computes a merge in the working dtype (a config's ``dtype``): float16/bfloat16 task vectors, their
products with the weights and their sums are rounded there. Two things follow from that rounding and are
reproduced here, by torch ops in mergekit's order: TIES' elected sign (:func:`mergekit_election`; near-cancelling
weighted sums of few distinct values take the sign of their rounding, whatever dtype), and, for float16/bfloat16
inputs, the whole rule (:func:`combine_in_dtype`). The masks (which entries are kept) come from
:mod:`symmerge.merge.parts`.
"""

from __future__ import annotations

import contextlib

import torch

_THREADS: int | None = None  # torch's intra-op threads when the merge began (None: leave the count as it is)


def remember_threads(n: int) -> None:
    """Called by the executor before it pins torch to one intra-op thread: ``n`` is the count this process
    computes with, as mergekit's process does on the same machine (and the same ``--num-threads``)."""
    global _THREADS
    _THREADS = int(n)


HALF = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def mergekit_threads(dtype, reductions: bool = True):
    """The one place mergekit's thread count is applied: the executor runs every merge step (the method's
    ``prepare``, ``tensor_context``, ``fused_into`` and ``tensor``) inside this block; one whose arithmetic is in
    float16/bfloat16 (``dtype``: the inputs' dtype, or the one a config's ``dtype`` computes in) by a rule that
    reduces whole tensors (``reductions``: the method's ``half_reductions``) runs with torch's intra-op thread count
    as mergekit runs it; others keep the executor's single thread (two OpenMP threads cost 4–5× the CPU time of one
    on the elementwise bfloat16 ops of a SmolLM2 layer at load 9 on 2 cores). A sum, dot product or norm
    over more than 32 768 entries is split among torch's threads, and in float16/bfloat16 the split shows in the
    rounding (a bfloat16 dot product of 884 736 entries: 644 on one thread, 640 on two), so mergekit's arithmetic
    in the half dtype is mergekit's result only with mergekit's thread count."""
    from ..core.parallel import torch_threads

    with torch_threads(_THREADS if reductions and dtype in HALF else None):
        yield


def l1_factor(t, base, keep):
    """mergekit's L1 rescale factor Σ|τ| / Σ|kept τ| of τ = t − base in base's dtype (a 0-dim tensor of it), or 0.0
    where either sum is below 1e-7 (no rescale)."""
    d = t.to(base.dtype) - base
    before, after = d.abs().sum(), (d * keep.to(device=base.device, dtype=base.dtype)).abs().sum()
    return 0.0 if (before < 1e-7 or after < 1e-7) else before / after


def deltas_in_dtype(tensors, base, keeps, weights, rescale):
    """mergekit's weighted task vectors in the tensors' dtype D, stacked: (θ_i − θ_b)·keep_i (× Σ|τ_i| / Σ|kept τ_i|
    under the L1 ``rescale``), times w_i, each rounded to D; and the weights in D, shaped to broadcast."""
    dtype = base.dtype
    w = torch.tensor([float(x) for x in weights], dtype=dtype, device=base.device).reshape(-1, *([1] * base.dim()))
    deltas = torch.empty((len(tensors), *base.shape), dtype=dtype, device=base.device)
    for i, (t, keep) in enumerate(zip(tensors, keeps)):
        d = t.to(dtype) - base
        if keep is not None:
            masked = d * keep.to(device=base.device, dtype=dtype)
            if rescale is True:
                factor = l1_factor(t, base, keep)
                if not isinstance(factor, float):
                    masked = masked * factor
            d = masked
        deltas[i] = d
    return deltas.mul_(w), w


def mergekit_election(tensors, base, keeps, weights, rescale) -> torch.Tensor:
    """mergekit's elected sign (True: +) of TIES' consensus, computed as mergekit computes it in the tensors'
    dtype D: γ = + where Σ_i x_i ≥ 0, x_i the weighted deltas of :func:`deltas_in_dtype` summed in model order
    (float32 accumulation for float16, bfloat16 and float32, float64 for float64), rounded to D. Where the inputs
    take few distinct values (float16/bfloat16 checkpoints) many weighted sums nearly cancel, and their sign is
    that rounding's; the rest of the rule is float64 arithmetic (within one rounding of mergekit's).
    ``keeps[i]``: a boolean mask, or None (every entry kept)."""
    return deltas_in_dtype(tensors, base, keeps, weights, rescale)[0].sum(0) >= 0


def combine_in_dtype(tensors, base, keeps, weights, consensus: str, normalize, scale: float, rescale) -> torch.Tensor:
    """mergekit's task-vector rule in the inputs' half dtype D, op for op (where its rounding is the rule's
    observable result): the weighted deltas δ_i of :func:`deltas_in_dtype`; ``sum``: Σ δ_i (÷ Σ w_i when
    ``normalize``, 1 where |Σ w_i| < 1e-8); ``ties``: γ = + where Σ δ_i ≥ 0, Σ of the agreeing δ_i (÷ the agreeing
    weights when ``normalize``, 1 where none); × λ unless 1; + θ_b, in D (sums accumulate in float32, then round
    to D). ``keeps[i]``: a boolean mask or None (all kept)."""
    dtype = base.dtype
    deltas, w = deltas_in_dtype(tensors, base, keeps, weights, rescale)
    if consensus == "ties":
        agree = (deltas.sign() == ((deltas.sum(0) >= 0).to(dtype) * 2 - 1)).to(dtype)
        mixed = (deltas * agree).sum(0)
        divisor = (w * agree).sum(0)
        divisor[divisor == 0] = 1
    else:
        mixed = deltas.sum(0)
        divisor = w.sum(0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize is True:
        mixed /= divisor
    if float(scale) != 1.0:
        mixed *= float(scale)
    return (base + mixed).to(dtype)
