"""The relabelling check of :class:`~symmerge.federated.AlignedFedAvg` (``relabel=...``, with the consensus
rule's unlabeled server data): does a client map the classes differently from the others, and if so, which
permutation of its output rows maps them back (no Flower needed here).

A permutation of the label space is a symmetry of the *training problem*: training from a model θ on labels
σ(y) gives exactly the model, with the rows of its output layer permuted by σ, that training from θ with
its output rows permuted by σ⁻¹ on the labels y gives (every step is equivariant under the permutation of
the rows and the labels). A client trained on flipped labels (9 − y) is therefore an honest client, started
from a relabelled global model, seen through permuted output rows; what no class prior explains is that
its class i fires where the others' consensus says σ⁻¹(i).

:func:`relabelling` measures it on the server's unlabeled examples: C[i, j] = mean over the examples of
p′(i | x) q(j | x), p′ the client's probabilities with its class prior discounted to the consensus's
(:func:`~symmerge.federated.consensus.prior_corrected`), q the consensus (the unweighted mean of the others'
probabilities). The best one-to-one assignment of the client's classes to the consensus's (Hungarian:
``scipy.optimize.linear_sum_assignment``) gains ``best − trace(C)`` over the identity (in probability mass:
the fraction of the examples' joint mass that the relabelling moves onto the diagonal; 0 for a pure prior
shift, whose C after the correction is the consensus's own Gram matrix, for which the identity is optimal).
The permutation is split into cycles and only the cycles that gain at least ``min_cycle_gain`` each are kept
(the confidently estimated part; a weak client's noise gives small cycles among similar classes).

:func:`output_layer` finds the classifier's output layer (the weight whose rows are the classes, and its
bias), :func:`permute_rows` moves client class i's rows to row π(i): the repaired model predicts class π(i)
wherever the client predicted i (exactly the same function with its outputs relabelled).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import SymmergeError
from .consensus import prior_corrected, with_consensus

# relabel=: "detect" leaves a relabelling client out; "repair" aggregates it with its output rows permuted back,
# "repair_update" with only its update's output rows permuted, "body" without its output layer
# "distill": left out of the parameter average, its relabelled predictions distilled into the aggregate on the
# server's unlabeled data
RELABEL_MODES = ("detect", "repair", "repair_update", "body", "distill")


def check_relabel(mode, threshold, min_cycle, weight, outlier_rule, joint: bool) -> None:
    if mode is None:
        return
    if mode not in RELABEL_MODES:
        raise SymmergeError(f"unknown relabel {mode!r}; choose one of {', '.join(RELABEL_MODES)} (or None: off)")
    if outlier_rule != "consensus":
        raise SymmergeError(f"relabel={mode!r} compares the clients' predictions on the server's unlabeled data: it "
                            f"needs outlier_rule='consensus' (got {outlier_rule!r})")
    if joint and mode != "detect":
        raise SymmergeError(f"relabel={mode!r} repairs a client before the aggregation: not with joint=True")
    for name, v, lo in (("relabel_threshold", threshold, 0.0), ("relabel_min_cycle", min_cycle, 0.0),
                        ("relabel_weight", weight, 0.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (np.isfinite(v) and v > lo):
            raise SymmergeError(f"{name} must be a number > {lo:g}, got {v!r}")


def confusion(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """C[i, j] = mean over the examples of p′(i | x) q(j | x) (float64, (K, K), summing to 1): ``p`` (M, K)
    the client's probabilities with its class prior discounted to ``q``'s class marginal, ``q`` (M, K) the
    consensus's."""
    p, q = p.double(), q.double()
    return prior_corrected(p, q.mean(dim=0)).T @ q / p.shape[0]


def cycles(perm: list[int]) -> list[list[int]]:
    """The cycles of length > 1 of the permutation ``perm`` (``perm[i]``: where i goes)."""
    seen, out = set(), []
    for start in range(len(perm)):
        if start in seen or perm[start] == start:
            continue
        cycle, i = [], start
        while i not in seen:
            seen.add(i)
            cycle.append(i)
            i = perm[i]
        out.append(cycle)
    return out


def relabelling(p: torch.Tensor, q: torch.Tensor, min_cycle_gain: float = 0.0) -> dict:
    """The best relabelling of a client's classes onto the consensus's (see the module docstring):
    ``{"gain": best − trace, "permutation": [π(0), ..., π(K − 1)] (the whole assignment), "kept": the
    permutation with only the cycles that gain at least min_cycle_gain each (the others left at the
    identity), "kept_gain": what those cycles gain}``."""
    from scipy.optimize import linear_sum_assignment

    c = confusion(p, q).numpy()
    rows, cols = linear_sum_assignment(-c)
    perm = [0] * len(rows)
    for r, k in zip(rows, cols):
        perm[int(r)] = int(k)
    gain = float(c[rows, cols].sum() - np.trace(c))
    kept, kept_gain = list(range(len(perm))), 0.0
    for cycle in cycles(perm):
        g = float(sum(c[i, perm[i]] - c[i, i] for i in cycle))
        if g >= min_cycle_gain and g > 0:
            for i in cycle:
                kept[i] = perm[i]
            kept_gain += g
    return {"gain": max(gain, 0.0), "permutation": perm, "kept": kept, "kept_gain": kept_gain}


def relabellings(probs: list[torch.Tensor], min_cycle_gain: float = 0.0) -> list[dict]:
    """:func:`relabelling` of each client's probabilities (a list of (M, K) tensors) against the consensus,
    the unweighted mean of the others'."""
    if len(probs) < 2:
        return [relabelling(p, p, min_cycle_gain) for p in probs]
    return [relabelling(p, q, min_cycle_gain) for p, q in with_consensus(probs)]


def output_layer(model) -> list[str]:
    """The state-dict keys of a classifier's output layer: the weight whose rows are the classes
    (``config.num_labels`` of them), then its bias if it has one; found among the linear layers outside the
    base model (the last such layer with ``num_labels`` outputs), e.g. ``classifier.weight``,
    ``classifier.bias`` for ViTForImageClassification, ``classifier.out_proj.*`` for RoBERTa's."""
    n = getattr(model.config, "num_labels", None)
    prefix = getattr(model, "base_model_prefix", "")
    found = None
    for name, module in model.named_modules():
        if prefix and (name == prefix or name.startswith(prefix + ".")):
            continue
        if isinstance(module, torch.nn.Linear) and module.out_features == n:
            found = name
    if found is None:
        raise SymmergeError(f"relabel needs a classifier's output layer with num_labels={n} outputs outside the base "
                            f"model; none in {type(model).__name__}")
    keys = [f"{found}.weight"] + ([f"{found}.bias"] if getattr(model.get_submodule(found), "bias", None) is not None
                                  else [])
    return keys


def permute_rows(state_dict: dict, keys, perm: list[int], base: dict | None = None) -> dict:
    """``state_dict`` with the rows of ``keys`` moved: row i goes to row ``perm[i]`` (the model then predicts
    class perm[i] wherever it predicted i). With ``base`` (the global model), only the update is moved:
    row perm[i] becomes base's row perm[i] + (row i − base's row i). Every other entry is shared, not copied."""
    out = dict(state_dict)
    if sorted(perm) != list(range(len(perm))):
        raise SymmergeError(f"not a permutation: {perm}")
    for k in keys:
        if state_dict[k].shape[0] != len(perm):
            raise SymmergeError(f"{k!r} has {state_dict[k].shape[0]} rows, the permutation {len(perm)}")
    index = torch.empty(len(perm), dtype=torch.long)
    index[torch.tensor(perm, dtype=torch.long)] = torch.arange(len(perm))  # new row j = old row index[j]
    for k in keys:
        t = state_dict[k]
        if base is None:
            out[k] = t[index].clone()
        else:
            b = base[k]
            out[k] = (b.double() + (t.double() - b.double())[index]).to(t.dtype)
    return out


def relabelled_probabilities(probs: torch.Tensor, perm: list[int]) -> torch.Tensor:
    """A client's class probabilities (M, K) with class i's column moved to ``perm[i]``: what the client's model
    with its output rows permuted by :func:`permute_rows` predicts."""
    out = torch.empty_like(probs)
    out[:, torch.tensor(perm, dtype=torch.long)] = probs
    return out


def distill(model, state_dict: dict, data, extra: list[tuple[float, torch.Tensor]], weight: float, steps: int,
            lr: float = 1e-3, seed: int = 0) -> tuple[dict, dict]:
    """The aggregate ``state_dict`` (loaded into a copy of ``model``) trained ``steps`` Adam steps on the server's
    unlabeled ``data`` (its batches in turn) towards the mixture of its own predictions (weight ``weight``, its
    clients' total example count) and the ``extra`` clients' (``(weight, probabilities (M, K))``, in the data's
    order: the relabelled clients' predictions, their rows permuted back): the clients left out of the
    parameter average contribute their function, not their parameters. Returns the new state dict (each
    tensor's dtype kept) and a report (``steps``, ``loss_before``, ``loss_after``: the soft cross-entropy to the
    targets, mean over the data)."""
    import copy

    student = copy.deepcopy(model)
    student.load_state_dict(state_dict)
    student.eval()
    batches = list(data)
    with torch.no_grad():
        own = torch.cat([student(**b.inputs).logits.double().softmax(dim=-1) for b in batches])
    total = weight + sum(w for w, _ in extra)
    target = (weight * own + sum(w * p.double() for w, p in extra)) / total
    bounds, start = [], 0
    for b in batches:
        n = next(iter(b.inputs.values())).shape[0]
        bounds.append((start, start + n))
        start += n

    def loss_of(i):
        lo, hi = bounds[i]
        logp = student(**batches[i].inputs).logits.log_softmax(dim=-1)
        return -(target[lo:hi].to(logp.dtype) * logp).sum(dim=-1).mean()

    def mean_loss():
        with torch.no_grad():
            return float(sum(loss_of(i) * (bounds[i][1] - bounds[i][0]) for i in range(len(batches))) / start)

    before = mean_loss()
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed))
    student.train()
    for step in range(steps):
        loss = loss_of(int(order[step % len(batches)]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    student.eval()
    out = {k: v.detach().clone() for k, v in student.state_dict().items()}
    return out, {"steps": steps, "loss_before": before, "loss_after": mean_loss()}
