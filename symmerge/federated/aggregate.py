"""The server-side checks and aggregation rules of :class:`~symmerge.federated.AlignedFedAvg`, on plain
PyTorch state dicts (no Flower needed here).

A client's state dict is accepted only if it has exactly the global model's tensor names, shapes and
dtypes, and only finite values (:func:`check_state_dict`); an accepted client whose distance to the
global model (after alignment) is beyond ``factor`` × the median of the other clients' distances is
left out too (:func:`norm_outliers`). The survivors are combined by :func:`aggregate`: the weighted
mean (FedAvg's rule, weights = example counts), the coordinate-wise median, or the coordinate-wise
trimmed mean (``trim`` of the values cut from each end, as Flower's ``FedTrimmedAvg``).

:func:`update_outliers` is the rule for updates that are ordinary in norm but point elsewhere (a client
trained on flipped labels): every aligned client's update (its aligned model minus the global model) gets
a score (``distance``: its L2 distance to the coordinate-wise median update; ``cosine``: 1 - its cosine
to that median update; ``krum``: the sum of its squared distances to its n - f - 2 nearest other
updates, f = ⌊(n - 3)/2⌋, as Krum), and a client whose robust z-score of that score, 0.6745 (s - median)
/ MAD, exceeds ``threshold`` is left out. It is meaningful only after alignment: in one frame the
clients' tensors can be compared coordinate by coordinate.

The functional rule (``consensus``: what the clients' models predict on unlabeled data held by the
server) is in :mod:`symmerge.federated.consensus`; its scores go through :func:`update_outliers` too.
"""

from __future__ import annotations

import math

import torch

from ..errors import SymmergeError, did_you_mean

AGGREGATIONS = ("mean", "median", "trimmed_mean")
# the kinds of reasons a client's reply is left out for (the per-round metrics count each kind)
LEFT_OUT_KINDS = ("missing", "error", "malformed", "keys", "shapes", "non_finite", "alignment", "norm", "outlier")
OUTLIER_RULES = ("distance", "cosine", "krum")  # the rules on the aligned updates
# the functional rule: each client's predictions on the server's unlabeled data against the others' consensus
CONSENSUS_RULE = "consensus"
# the consensus rule's robust z-score takes the MAD as at least this fraction of the median score (see
# update_outliers): where honest clients' scores cluster within a few percent, a MAD that small would turn an
# honest client with rare labels into an outlier (docs/federated.md, the consensus rule)
CONSENSUS_MIN_SPREAD = 0.1


def _names(keys, limit: int = 3) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(repr(k) for k in keys[:limit]) + more


def check_state_dict(state_dict: dict, reference: dict,
                     reference_name: str = "the global model") -> tuple[str, str] | None:
    """``None`` if ``state_dict`` matches ``reference`` (same tensor names, shapes and dtypes; every
    floating value finite; names that are one tensor in ``reference``, tied weights, equal), else
    ``(kind, reason)`` with kind one of :data:`LEFT_OUT_KINDS` (``reference_name``: what the reason calls
    the reference)."""
    missing, extra = set(reference) - set(state_dict), set(state_dict) - set(reference)
    if missing or extra:
        parts = ([f"missing {_names(missing)}"] if missing else []) + ([f"unexpected {_names(extra)}"] if extra else [])
        return "keys", "wrong tensor names (another architecture?): " + "; ".join(parts)
    for k, ref in reference.items():
        t = state_dict[k]
        if not isinstance(t, torch.Tensor):
            return "malformed", f"{k!r} is not a tensor"
        if tuple(t.shape) != tuple(ref.shape):
            return "shapes", f"{k!r} has shape {tuple(t.shape)}, {reference_name}'s is {tuple(ref.shape)}"
        if t.dtype != ref.dtype:
            return "shapes", f"{k!r} has dtype {t.dtype}, {reference_name}'s is {ref.dtype}"
    for k, t in state_dict.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            return "non_finite", f"{k!r} holds {n_nan} NaN and {n_inf} Inf values"
    for names in _tied(reference):
        other = next((k for k in names[1:] if not torch.equal(state_dict[k], state_dict[names[0]])), None)
        if other is not None:  # loaded into the template, one of the two values would be dropped unseen
            return "malformed", (f"{other!r} differs from {names[0]!r}, which {reference_name} ties it to (one "
                                 f"tensor): an untied model (another architecture?)")
    return None


def _tied(reference: dict) -> list[list[str]]:
    """The groups of names of ``reference`` that are one tensor (tied weights: an LM head and the embeddings)."""
    groups: dict = {}
    for k, t in reference.items():
        if t.numel():
            groups.setdefault((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), []).append(k)
    return [names for names in groups.values() if len(names) > 1]


def norm_outliers(distances: list[float], factor: float | None) -> list[str | None]:
    """For each distance, a reason if it is beyond ``factor`` × the median of the others' (``None``:
    kept). No rule without a factor, with fewer than 2 distances, or where the others' median is 0."""
    out: list[str | None] = [None] * len(distances)
    if factor is None or len(distances) < 2:
        return out
    for i, d in enumerate(distances):
        median = median_of_others(distances, i)
        if median > 0 and d > factor * median:
            out[i] = (f"update norm {d:.4g} (distance to the global model, aligned) is {d / median:.3g} x the "
                      f"median of the others ({median:.4g}), beyond norm_factor {factor:g}")
    return out


def scale_update(state_dict: dict, base: dict, keys, factor: float) -> dict:
    """``base + factor · (state_dict - base)`` on ``keys`` (in float64, each tensor's dtype out); every other
    entry is ``state_dict``'s. The norm rule's clipping: an update scaled down to an ordinary norm."""
    out = dict(state_dict)
    for k in keys:
        b = base[k].double()
        out[k] = (b + factor * (state_dict[k].double() - b)).to(state_dict[k].dtype)
    return out


def median_of_others(values: list[float], i: int) -> float:
    """The median of ``values`` without its ``i``-th (the norm rule's reference)."""
    return _median(values[:i] + values[i + 1:])


def check_outlier_rule(rule: str | None, threshold: float, names=("outlier_rule", "outlier_threshold")) -> None:
    """``rule`` one of the outlier rules (or None), ``threshold`` a number > 0; ``names``: how the message names
    them (``OutlierPolicy(rule=...)`` for the options object)."""
    known = OUTLIER_RULES + (CONSENSUS_RULE,)
    if rule is not None and rule not in known:
        raise SymmergeError(f"unknown {names[0]} {rule!r}{did_you_mean(str(rule), known)}; choose one of "
                            f"{', '.join(known)} (or None: off)")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            math.isfinite(threshold) and threshold > 0):
        raise SymmergeError(f"{names[1]} must be a number > 0, got {threshold!r}")


def _median(values: list[float]) -> float:
    v = sorted(values)
    m = len(v)
    return v[m // 2] if m % 2 else 0.5 * (v[m // 2 - 1] + v[m // 2])


def update_scores(state_dicts: list[dict], base: dict, keys, rule: str) -> list[float]:
    """Each model's outlier score under ``rule`` (see the module docstring), from its update
    ``state_dict - base`` over ``keys``; computed key by key in float64 (no model-sized copy of all
    updates at once). Larger: more outlying."""
    check_outlier_rule(rule, 1.0)
    n = len(state_dicts)
    sq = torch.zeros(n, dtype=torch.float64)  # distance: squared distance to the median update
    dot = torch.zeros(n, dtype=torch.float64)  # cosine: <u_i, median>
    gram = torch.zeros(n, n, dtype=torch.float64)  # krum (and the cosine's norms): <u_i, u_j>
    med_sq = 0.0
    for k in keys:
        b = base[k].double().reshape(-1)
        u = torch.stack([sd[k].double().reshape(-1) - b for sd in state_dicts])
        if rule == "krum":
            gram += u @ u.T
            continue
        s = u.sort(dim=0).values
        med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
        if rule == "distance":
            sq += ((u - med) ** 2).sum(dim=1)
        else:
            dot += u @ med
            gram.diagonal().add_((u * u).sum(dim=1))
            med_sq += float((med * med).sum())
    if rule == "distance":
        return sq.sqrt().tolist()
    if rule == "cosine":
        denom = (gram.diagonal() * med_sq).sqrt()
        cos = torch.where(denom > 0, dot / denom.clamp_min(1e-300), torch.zeros_like(dot))
        return (1.0 - cos).tolist()
    diag = gram.diagonal()
    dist = (diag[:, None] + diag[None, :] - 2 * gram).clamp_min(0.0)
    neighbours = max(1, n - (n - 3) // 2 - 2) if n >= 3 else 1
    scores = []
    for i in range(n):
        others = torch.cat([dist[i, :i], dist[i, i + 1:]]).sort().values
        scores.append(float(others[:neighbours].sum()))
    return scores


def update_outliers(scores: list[float], threshold: float | None, rule: str = "score",
                    min_spread: float = 0.0) -> list[tuple[float, str | None]]:
    """For each score, ``(z, reason)``: its robust z-score 0.6745 (s - median) / MAD, and a reason if
    z > ``threshold`` (``None``: kept). Only high scores are flagged. No rule with fewer than 3 scores
    or without a threshold (z 0). Where the MAD is 0, a score above the median has z = inf.
    ``min_spread``: the MAD is taken as at least this fraction of the median (a floor for scores on a
    ratio scale: clients that agree closely are not told apart by differences that are small against
    the scores themselves)."""
    n = len(scores)
    if threshold is None or n < 3:
        return [(0.0, None)] * n
    med = _median(scores)
    mad = max(_median([abs(s - med) for s in scores]), min_spread * abs(med))
    out = []
    for s in scores:
        if s <= med:
            z = 0.0 if mad == 0 else 0.6745 * (s - med) / mad
        else:
            z = math.inf if mad == 0 else 0.6745 * (s - med) / mad
        reason = None
        if z > threshold:
            what = ("its predictions on the server's unlabeled data disagree with the other clients' consensus"
                    if rule == CONSENSUS_RULE else "its aligned update is an outlier")
            reason = (f"{what}: {rule} score {s:.4g} against the clients' median {med:.4g} "
                      f"(robust z {z:.3g}), beyond outlier_threshold {threshold:g}")
        out.append((z, reason))
    return out


def check_aggregation(aggregation: str, trim: float, names=("aggregation", "trim fraction")) -> None:
    """``aggregation`` one of :data:`AGGREGATIONS`, ``trim`` in [0, 0.5); ``names``: how the message names them."""
    if aggregation not in AGGREGATIONS:
        raise SymmergeError(f"unknown {names[0]} {aggregation!r}{did_you_mean(str(aggregation), AGGREGATIONS)}; "
                            f"choose one of {', '.join(AGGREGATIONS)}")
    if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0.0 <= trim < 0.5:
        raise SymmergeError(f"{names[1]} must be a number in [0, 0.5), got {trim!r}")


def _sorted_stack(tensors) -> torch.Tensor:
    return torch.stack([t.double() for t in tensors]).sort(dim=0).values


def aggregate(state_dicts: list[dict], weights: list[float], keys, base: dict, aggregation: str = "mean",
              trim: float = 0.2) -> dict:
    """The aggregate of ``keys`` over ``state_dicts`` (float64 inside, each tensor's dtype out); every
    other entry is ``base``'s. ``mean``: Σ w_i θ_i / Σ w_i; ``median``: coordinate-wise median (the
    mean of the two middle values for an even count); ``trimmed_mean``: per coordinate, the
    ⌊trim·n⌋ smallest and largest values dropped, the rest averaged (unweighted)."""
    check_aggregation(aggregation, trim)
    n = len(state_dicts)
    if n == 0 or len(weights) != n:
        raise SymmergeError(f"aggregation needs one weight per model, got {len(weights)} for {n}")
    weights = [float(w) for w in weights]
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise SymmergeError(f"aggregation weights must be finite, >= 0 and not all 0, got {weights}")
    total = sum(weights)
    if not math.isfinite(total):  # finite weights whose sum overflows (a client claiming 1e308 examples)
        top = max(weights)
        weights = [w / top for w in weights]
        total = sum(weights)
    cut = int(math.floor(trim * n)) if aggregation == "trimmed_mean" else 0
    out = dict(base)
    for k in keys:
        dtype = state_dicts[0][k].dtype
        if aggregation == "mean":
            acc = state_dicts[0][k].double() * (weights[0] / total)
            for sd, w in zip(state_dicts[1:], weights[1:]):
                acc.add_(sd[k].double(), alpha=w / total)
        elif aggregation == "median":
            s = _sorted_stack([sd[k] for sd in state_dicts])
            acc = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
        else:
            acc = _sorted_stack([sd[k] for sd in state_dicts])[cut:n - cut].mean(dim=0)
        out[k] = acc.to(dtype)
    return out
