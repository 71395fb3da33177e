"""The ``consensus`` outlier rule of :class:`~symmerge.federated.AlignedFedAvg`: a functional check of
each client's model on unlabeled data held by the server (no Flower needed here).

A client trained on relabelled data (flipped labels, 9 - y) sends an update of ordinary norm, and under
label skew its aligned update is no further from the others' than an honest client's whose classes
nobody else holds (docs/federated.md). What tells them apart is what the models predict. Each
client's class probabilities on the server's examples are compared with the consensus, the unweighted
mean of the other clients' probabilities, after the client's class prior is discounted
(:func:`prior_corrected`), and the consensus's prior moved to the client's: an honest client with rare
labels mostly over-predicts its own classes (a shift of its class prior, which the correction undoes),
while a relabelled client moves probability to other classes than the consensus wherever it learned (a
relabelling, which no class prior undoes). The score (:func:`consensus_scores`) is the mean total
variation distance between the two, both ways; the strategy
turns it into the robust z-score of the other rules (:func:`~symmerge.federated.aggregate.update_outliers`,
with the MAD taken as at least :data:`~symmerge.federated.aggregate.CONSENSUS_MIN_SPREAD` × the median).
"""

from __future__ import annotations

import copy

import torch

from ..errors import SymmergeError


def prior_corrected(probs: torch.Tensor, marginal: torch.Tensor, iterations: int = 1000,
                    tol: float = 1e-10) -> torch.Tensor:
    """``probs`` (M, C) with the class prior discounted: each class's column scaled by one factor and every
    row renormalised, the factors chosen (by alternate scaling, as Sinkhorn's) so that the mean of the rows is
    ``marginal`` (C,). A model whose predictions differ from another's only by a shift of its class prior
    (label skew: p'(y|x) ∝ p(y|x) w(y)) is brought back to the other's predictions (exactly, in the limit
    of the ``iterations``; they stop once every class's mean is within ``tol`` of its target); a
    relabelling (flipped labels) is not undone."""
    p = probs.double().clamp_min(1e-12)
    target = marginal.double().clamp_min(1e-12)
    target = target / target.sum()
    v = torch.ones(p.shape[1], dtype=torch.float64)
    for _ in range(iterations):
        pc = p * v
        pc = pc / pc.sum(dim=1, keepdim=True)
        mean = pc.mean(dim=0)
        if float((mean - target).abs().max()) < tol:
            break
        v = v * target / mean.clamp_min(1e-300)
    pc = p * v
    return pc / pc.sum(dim=1, keepdim=True)


def with_consensus(probs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(p, q)`` for each client (float64): its probabilities and the consensus q, the unweighted mean of the
    other clients' (at least two clients)."""
    total = sum(p.double() for p in probs)
    return [(p.double(), (total - p.double()) / (len(probs) - 1)) for p in probs]


def consensus_scores(probs: list[torch.Tensor]) -> list[float]:
    """The ``consensus`` outlier rule's score of each client from its class probabilities on the server's
    unlabeled data (a list of (M, C) tensors, one per client). With q the consensus, the unweighted mean of
    the other clients' probabilities, and TV(a, b) the mean over the M examples of ½ Σ_c |a_c - b_c|, the
    score is ½ [TV(p', q) + TV(p, q')]: p' is the client's p with its class prior discounted to the
    consensus's (:func:`prior_corrected` to q's class marginal), q' the consensus with its prior moved to the
    client's. The two terms ask whether the client, had it the others' label mix, would predict what they
    predict, and whether the others, had they the client's label mix, would predict what it predicts.
    Larger: more outlying. A client with rare labels over-predicts its own classes, which the corrections
    discount; a client trained on relabelled data moves probability to other classes than the consensus
    wherever it learned, which no class prior undoes."""
    if len(probs) < 2:
        return [0.0] * len(probs)
    scores = []
    for p, q in with_consensus(probs):
        forward = 0.5 * (prior_corrected(p, q.mean(dim=0)) - q).abs().sum(dim=1).mean()
        backward = 0.5 * (p - prior_corrected(q, p.mean(dim=0))).abs().sum(dim=1).mean()
        scores.append(float(0.5 * (forward + backward)))
    return scores


def server_data(data, model, max_examples: int):
    """The server's unlabeled examples for the consensus rule: ``data`` (a data file as ``--align-data``
    reads it, or a loaded :class:`~symmerge.io.data.Data`; labels, if present, are not used), at most
    ``max_examples``, checked against ``model``, which must be a classifier."""
    from ..io.data import Data, check_data, head_kind, load_data, take

    if head_kind(model) != "classification":
        raise SymmergeError(f"outlier_rule='consensus' compares class predictions: it needs a classification model, "
                            f"got {type(model).__name__}")
    if data is None:
        raise SymmergeError("outlier_rule='consensus' needs unlabeled data held by the server: pass "
                            "OutlierPolicy(data=FILE) (or an alignment with align_data)")
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1:
        raise SymmergeError(f"outlier_samples (OutlierPolicy.samples) must be a whole number >= 1, "
                            f"got {max_examples!r}")
    if isinstance(data, Data):
        check_data(data, model, use_labels=False)
        return take(data, max_examples)
    return load_data(data, model, max_examples=max_examples, batch_size=min(256, max_examples), labels=False)


def client_probabilities(model, state_dicts: list[dict], data) -> list:
    """Each state dict's class probabilities (float64, (M, C)) on ``data``, loaded in turn into one copy of
    ``model`` (the original is left untouched); for a state dict whose forward pass fails or gives
    non-finite probabilities, a string saying why instead (whatever a client sent, the server goes on)."""
    clone = copy.deepcopy(model).eval()
    out = []
    for sd in state_dicts:
        try:
            clone.load_state_dict(sd)
            with torch.no_grad():
                probs = torch.cat([clone(**b.inputs).logits.double().softmax(dim=-1) for b in data])
        except Exception as e:  # noqa: BLE001 - a client's weights must not crash the server
            out.append(f"its model fails on the server's data: {type(e).__name__}: {e}")
            continue
        if not bool(torch.isfinite(probs).all()):
            out.append("its predictions on the server's data are not finite")
            continue
        out.append(probs)
    return out
