"""The torch definitions of the task-vector rules, kept in the tests as the oracle of the one kernel
(:func:`symmerge.merge.kernels_whole.task_vector_into`) after they left the product.

* :func:`own_rule`: symmerge's own variants (weight first): θ_b + λ · consensus(sparsify(w_i τ_i)) in float64,
  with the sparsifier applied to each weighted task vector — a model-wide (``scope="model"``) or per-tensor
  (``scope="tensor"``) magnitude threshold compared in float32 (ties at the threshold kept), or DARE's drop
  (:func:`symmerge.merge.parts.dare_keep_mask`) with the 1/(1 − p) rescale — and the sum or the disjoint mean
  (γ = sign(Σ τ̂_i), the mean of the non-zero τ̂_i of sign γ, 0 where none);
* :func:`radix_thresholds`: the model-wide threshold by a radix select on the float32 bit patterns in torch,
  chunk by chunk (the kernels count the same histograms);
* mergekit's forms: the product's own torch code (:func:`symmerge.merge.parts._whole_task_vector_tensor`), which
  is the implementation for float16/bfloat16 and computes in float64 for every other dtype;
* :func:`ramplus_lambdas`: RAM+'s per-model factors counted by torch.

:func:`torch_rules` swaps them in for the kernel (a pytest ``monkeypatch``), so that ``get_method(...).merge``
runs the definitions end to end.
"""

from __future__ import annotations

import torch

from symmerge.merge import parts
from symmerge.merge.base import weighted_sum

_HALF = 1 << 16


def _bits(t: torch.Tensor):
    """float32 bit patterns of |t| (monotonic in the magnitude), chunk by chunk."""
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), _HALF):
        yield flat[i:i + _HALF].abs().float().view(torch.int32)


def radix_thresholds(visit, weights, density: float, total=None, sampler=None) -> list[float]:
    """:func:`symmerge.merge.parts.task_vector_thresholds` in torch: per model, the smallest float32 magnitude of
    (θ_i − θ_base)·w_i (float64) kept when keeping the top ``density`` fraction, by a radix select (high 16
    bits counted on a first visit, the low 16 bits of the chosen high bin on a second)."""
    n = len(weights)

    def task_vectors():
        for ts, base in visit():
            b = base.reshape(-1)
            ts = [t.reshape(-1) for t in ts]
            for i in range(0, b.numel(), _HALF):
                bb = b[i:i + _HALF].double()
                yield tuple((t[i:i + _HALF].double() - bb) * w for t, w in zip(ts, weights))

    high = torch.zeros(n, _HALF, dtype=torch.int64)
    for group in task_vectors():
        for i, t in enumerate(group):
            for bits in _bits(t):
                high[i] += torch.bincount(bits >> 16, minlength=_HALF)
    bins, ranks = parts._high_bins(high, density)
    low = torch.zeros(n, _HALF, dtype=torch.int64)
    for group in task_vectors():
        for i, t in enumerate(group):
            for bits in _bits(t):
                inside = bits[(bits >> 16) == bins[i]]
                if inside.numel():
                    low[i] += torch.bincount(inside & 0xFFFF, minlength=_HALF)
    return parts._radix_values(low, bins, ranks)


def disjoint_mean(vectors) -> torch.Tensor:
    """Elect γ = sign(Σ τ̂_i) and average the entries agreeing with γ (non-zero ones only)."""
    stacked = torch.stack(vectors)
    elected = torch.sign(stacked.sum(0))
    agree = (torch.sign(stacked) == elected) & (stacked != 0)
    count = agree.sum(0)
    total = stacked.masked_fill(~agree, 0.0).sum(0)
    return (total / count.clamp(min=1)).masked_fill(count == 0, 0.0)


def own_rule(sparsifier: str, consensus: str, key, tensors, weights, base, params, context) -> torch.Tensor:
    """symmerge's own variant of the rule, float64 (see the module doc); ``context``: the model-wide thresholds."""
    b = base.double()
    taus = [(t.double() - b) * w for t, w in zip(tensors, weights)]
    if sparsifier == "magnitude":
        density = float(parts._scalar(params["density"]))
        if density < 1.0:
            thresholds = context if params["scope"] == "model" else [
                radix_thresholds(lambda: [([t], base)], [w], density)[0] for t, w in zip(tensors, weights)]
            taus = [t.masked_fill(t.abs().float() < thr, 0.0) for t, thr in zip(taus, thresholds)]
    elif sparsifier == "dare":
        p = float(parts._scalar(params["drop"]))
        if p > 0.0:
            taus = [(t / (1.0 - p)).masked_fill(~parts.dare_keep_mask(t.shape, p, params["seed"], i, key), 0.0)
                    for i, t in enumerate(taus)]
    if consensus == "sum":
        merged = weighted_sum(taus, [1.0] * len(taus))
        if params["normalize"] == "count":
            merged = merged / len(taus)
    else:
        merged = disjoint_mean(taus)
    return b + float(params["scale"]) * merged


def reference_into(sparsifier, consensus, key, tensors, weights, base, params, context, out) -> bool:
    """A stand-in for :func:`symmerge.merge.parts._whole_into`: the torch definition written into ``out``; False
    where the product runs its torch code anyway (the half dtypes under mergekit's forms)."""
    if base is None or parts._in_dtype(sparsifier, consensus, base, params):
        return False
    if not parts._needs_whole(sparsifier, consensus, params):
        value = own_rule(sparsifier, consensus, key, tensors, weights, base, params, context)
    else:
        value = parts._whole_task_vector_tensor(sparsifier, consensus, key, tensors, weights, base, params, context)
    out.copy_(value.to(out.dtype))
    return True


def ramplus_lambdas(key, tensors, base, weights, params, context):
    """RAM+'s factors λ_i = 1 + r · clamp(shared_i / max(unique_i, eps), 0, alpha), the active entries counted by
    torch (|τ_i| > eps; shared: another model changes the entry too)."""
    eps = float(params["epsilon"])
    b = base.double()
    active = torch.stack([(t.double() - b).abs() > eps for t in tensors]).reshape(len(tensors), -1)
    count = active.sum(0)
    shared_n, unique_n = (active & (count > 1)).sum(1), (active & (count == 1)).sum(1)
    rho = shared_n.double() / unique_n.double().clamp(min=eps)
    return (1.0 + float(params["r"]) * rho.clamp(0.0, float(params["alpha"]))).reshape(-1, 1)


def torch_rules(monkeypatch) -> None:
    """Swap the torch definitions in for the kernels in ``get_method(...).merge`` (task-vector rules, the
    model-wide threshold, SCE's and RAM's kernels)."""
    from symmerge.merge import specialized

    monkeypatch.setattr(parts, "_whole_into", reference_into)
    monkeypatch.setattr(parts, "task_vector_thresholds", radix_thresholds)
    monkeypatch.setattr(specialized, "_sce_into", lambda *a: False)
    monkeypatch.setattr(specialized, "_ram_into", lambda *a: False)
    monkeypatch.setattr(specialized, "_ramplus_lambdas", ramplus_lambdas)
