"""``AlignedFedAvg``: Flower's message-API ``FedAvg`` with the clients' models aligned into the global
model's frame before they are aggregated, and every reply checked first.

Used exactly like ``flwr.serverapp.strategy.FedAvg`` in a ``ServerApp``::

    strategy = AlignedFedAvg(template=model, aggregation=Aggregation(min_clients=2), fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=3)

Clients reply as in Flower's PyTorch quickstart: the model's state dict as the ``arrays`` ArrayRecord
and ``num-examples`` in their MetricRecord.

One round of :meth:`AlignedFedAvg.aggregate_train`:

1. every reply is checked; a reply is left out, with a logged reason naming its node, when it is an
   error or missing (sampled but no reply), malformed (no ArrayRecord / no positive ``num-examples`` / tied
   tensors that differ),
   has other tensor names, shapes or dtypes than the global model (another architecture), or holds
   NaN/Inf (:func:`~symmerge.federated.aggregate.check_state_dict`);
2. every accepted client's model is aligned to the **current global model**, the fixed anchor
   (:func:`~symmerge.pipeline.align.align_pair`: the star of the N-model alignment with the global
   model as its centre; the global model is never moved, so the global frame stays fixed from round to
   round and the clients, who all start the round from the global model, are pulled back into it);
3. a client whose aligned distance to the global model (its update norm) is beyond ``outliers.norm_factor``
   × the median of the others' is left out (with ``outliers.norm_clip``: kept, its update scaled down to
   that median norm);
4. with ``outliers.rule`` set, a client whose aligned update is an outlier among the remaining ones
   (robust z-score of its ``distance`` / ``cosine`` / ``krum`` score beyond ``outliers.threshold``:
   :func:`~symmerge.federated.aggregate.update_outliers`), or with ``rule="consensus"`` whose
   predictions on the server's unlabeled data (``outliers.data``) disagree with the other clients'
   consensus once class priors are discounted (:mod:`symmerge.federated.consensus`), is left out (kind
   ``outlier``); with ``outliers.relabel`` also a client whose best relabelling of the classes onto the
   consensus's gains the check's ``threshold`` (:mod:`symmerge.federated.relabel`);
5. if fewer than ``aggregation.min_clients`` remain, the previous global model is returned unchanged (the same
   ArrayRecord, byte for byte); otherwise the aligned models are aggregated: the mean weighted by
   ``num-examples`` (FedAvg), the coordinate-wise ``median`` or the ``trimmed_mean``.
6. with ``alignment.joint``, step 5 aggregates the remaining clients in their **joint** frame instead
   (:func:`~symmerge.pipeline.joint.align_joint` on the clients' own models, from the star on the client
   closest to their average, as ``merge_models(..., joint=True)``; with ``match="learned"`` the learned
   joint alignment: random convex combinations of the clients trained against the same combinations of
   their predictions on the server's unlabeled data), and the aggregate is then moved into the global
   model's frame by one data-free alignment to it (the same function): the global frame stays fixed.
   Steps 2–4 (the distances, the norm and outlier rules) still use each client aligned to the global
   model, data-free (the matcher runs once, in the joint alignment).

The parameterisation. Alignment acts on the canonical parameterisation of the chosen groups. The
default symmetries (:data:`FEDERATED_SYMMETRIES`: head permutations, per-head rotations, FFN
permutations, rescalings) need none: the aligned models are the clients' models in the same
parameterisation, and the global model that goes back to the clients is an ordinary checkpoint of the
template's class. A residual-stream group that folds the norms into their readers (``residual`` with
``residual="largest"`` on LayerNorm/RMSNorm models) is allowed too: then the global model is kept in the
folded parameterisation from the first aggregation on (the same function; the norms' gains are 1 and
their biases 0, and clients train them from there), each round's clients are folded the same way
before alignment, and the aggregate is folded. ``residual`` with ``residual="permutation"`` needs no
folding for LayerNorm models. ``AlignedFedAvg.folds`` tells which case holds.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections import Counter
from logging import INFO, WARNING

import torch

try:
    from flwr.app import ArrayRecord, MetricRecord
    from flwr.serverapp.strategy import FedAvg
    from flwr.supercore import log
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("symmerge.federated needs Flower: pip install 'symmerge[flower]'") from e

from ..core.distance import sq_distance
from ..core.resolve import declared_ties
from ..errors import SymmergeError, UsageError, closest
from ..io.arguments import model_argument
from ..io.generate import is_generate
from ..pipeline.align import align_pair, as_model, canonical
from ..pipeline.data import read_once
from ..pipeline.options import AlignOptions
from ..pipeline.verify import with_state_dict
from .aggregate import (CONSENSUS_MIN_SPREAD, CONSENSUS_RULE, LEFT_OUT_KINDS, aggregate, check_state_dict,
                        median_of_others, norm_outliers, scale_update, update_outliers, update_scores)
from .consensus import client_probabilities, consensus_scores, server_data
from .options import (FEDERATED_SYMMETRIES, MIN_ALIGN_GAIN, MOVED, Aggregation, ClientAlignment, OutlierPolicy,
                      alignment_options)
from .relabel import relabellings

__all__ = ["AlignedFedAvg", "FEDERATED_SYMMETRIES", "MIN_ALIGN_GAIN", "alignment_options"]
PREFIX = "symmerge-"  # the strategy's own keys in the round's MetricRecord


class _LeftOut(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def _check_fedavg_keywords(kwargs: dict) -> None:
    """A keyword that neither AlignedFedAvg nor FedAvg takes: one :class:`UsageError` naming the closest (a
    keyword of the former flat signature: the options object that holds it now)."""
    own = ["template", "alignment", "aggregation", "outliers"]
    fedavg = [p for p in inspect.signature(FedAvg.__init__).parameters if p != "self"]
    unknown = next((k for k in kwargs if k not in fedavg), None)
    if unknown is None:
        return
    close = closest(unknown, own + fedavg + list(MOVED))
    hint = f" (did you mean {MOVED[close] if close in MOVED else repr(close)}?)" if close else ""
    raise UsageError(f"AlignedFedAvg() got an unexpected keyword argument {unknown!r}{hint}")


class AlignedFedAvg(FedAvg):
    """FedAvg with symmetry-aligned, checked aggregation (see the module docstring).

    ``template``: a transformers model (or HF folder) of the federation's architecture, held by the
    server (its own copy: the caller's model is left as it came): client state dicts are loaded into copies
    of it for alignment, and its tensor names, shapes and dtypes are the contract every reply is checked
    against. Three options objects, one per concern
    (:mod:`symmerge.federated.options`, each validated when made): ``alignment``, a :class:`ClientAlignment`
    (or, for its ``options`` alone, an :class:`AlignOptions` or a symmetries string; default: data-free,
    :data:`FEDERATED_SYMMETRIES`); ``aggregation``, an :class:`Aggregation` (or its ``rule`` alone:
    ``"mean"``, ``"median"``, ``"trimmed_mean"``); ``outliers``, an :class:`OutlierPolicy` (default: the
    norm rule at 10 × the others' median, no outlier rule). Every other keyword goes to ``FedAvg`` (one it does
    not take either is a :class:`~symmerge.errors.UsageError` naming the closest).

    After each round, :attr:`rounds` holds its full record (accepted and left-out node ids with reasons,
    distances, seconds); the returned MetricRecord carries the numeric part (keys ``symmerge-*``)."""

    def __init__(self, template, *, alignment: ClientAlignment | AlignOptions | str | None = None,
                 aggregation: Aggregation | str = "mean", outliers: OutlierPolicy | None = None, **fedavg_kwargs):
        moved = sorted(k for k in fedavg_kwargs if k in MOVED)
        if moved:
            raise SymmergeError("AlignedFedAvg takes its options grouped: " + "; ".join(
                f"{k} -> {MOVED[k]}" for k in moved))
        _check_fedavg_keywords(fedavg_kwargs)
        super().__init__(**fedavg_kwargs)
        self.client_alignment = alignment if isinstance(alignment, ClientAlignment) else ClientAlignment(alignment)
        self.aggregation = aggregation if isinstance(aggregation, Aggregation) else Aggregation(aggregation)
        self.outliers = OutlierPolicy() if outliers is None else outliers
        if not isinstance(self.outliers, OutlierPolicy):
            raise SymmergeError(f"outliers must be an OutlierPolicy (or None), got {outliers!r}")
        # the server's own copy (the caller's model is left as it came: its train/eval mode, its tensors)
        self.template = as_model(model_argument(template, "template"))
        self.template = (copy.deepcopy(self.template) if self.template is template else self.template).eval()
        self.alignment = self.client_alignment.options.for_model(self.template)
        align_data = self.alignment.align_data  # as given (the consensus rule's default: its own samples of it)
        if self.alignment.matcher.needs_data and not is_generate(self.alignment.align_data):
            # the server's alignment data read and checked against the template once, here: a missing or unusable
            # file is one error now (it was every client left out as "alignment", every round)
            self.alignment = read_once(self.alignment, [self.template], progress=False)
        if self.alignment.symmetries and self.alignment.untie and declared_ties(self.template):
            raise SymmergeError("untie=True would send the clients an untied global model, which their models (the "
                                "template's class, its weights tied) cannot load without dropping one of the tied "
                                "tensors: leave untie off in a federation")
        # the consensus rule's unlabeled server examples (default: the alignment's), loaded once
        self.outlier_data = server_data(
            self.outliers.data if self.outliers.data is not None else align_data, self.template,
            self.outliers.samples) if self.outliers.rule == CONSENSUS_RULE else None
        self.reference = {k: v.detach() for k, v in self.template.state_dict().items()}
        self.folds = bool(self.alignment.symmetries) and canonical(self.template, self.alignment) is not self.template
        self.global_arrays: ArrayRecord | None = None  # set by configure_train: the model sent this round
        self.sampled_nodes: list[int] = []
        self.rounds: list[dict] = []

    def summary(self) -> None:
        super().summary()
        agg, out = self.aggregation, self.outliers
        log(INFO, "\t└──> symmerge: align %s (match %s), aggregation %s%s, norm_factor %s%s, outlier_rule %s%s, "
                  "min_clients %d%s",
            ",".join(self.alignment.symmetries) or "none", self.alignment.match, agg.rule,
            f" (trim {agg.trim:g})" if agg.rule == "trimmed_mean" else "", out.norm_factor,
            " (clip)" if out.norm_clip else "", out.rule,
            (f" (threshold {out.threshold:g})" if out.rule else "") + (
                f", relabel detect (threshold {out.relabel.threshold:g})" if out.relabel else ""),
            agg.min_clients,
            ", global model kept with its norms folded" if self.folds else "")

    def configure_train(self, server_round, arrays, config, grid):
        """FedAvg's, remembering the global model and the nodes sampled (the anchor and the roll call); a global
        model that does not match the template is one error here, before any client trains."""
        self.global_arrays = arrays
        self._global_state_dict()
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.sampled_nodes = [m.metadata.dst_node_id for m in messages]
        return messages

    # ------------------------------------------------------------------ checks
    def _unpack(self, msg) -> tuple[dict, float]:
        content = msg.content
        arrays = content.array_records
        if self.arrayrecord_key in arrays:
            record = arrays[self.arrayrecord_key]
        elif len(arrays) == 1:
            record = next(iter(arrays.values()))
        else:
            raise _LeftOut("malformed", f"no {self.arrayrecord_key!r} ArrayRecord in the reply "
                                        f"(array records: {sorted(arrays)})")
        weight = None
        for metrics in content.metric_records.values():
            if self.weighted_by_key in metrics:
                weight = metrics[self.weighted_by_key]
                break
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not (math.isfinite(weight) and weight > 0):
            raise _LeftOut("malformed", f"no positive {self.weighted_by_key!r} in the reply's metrics (got {weight!r})")
        try:
            state_dict = record.to_torch_state_dict()
        except Exception as e:  # noqa: BLE001 - whatever a client sent, the round goes on
            raise _LeftOut("malformed", f"arrays do not convert to tensors: {e}") from e
        return state_dict, float(weight)

    def _left_out(self, record: list, node: int, kind: str, reason: str) -> None:
        log(WARNING, "aggregate_train: left out node %s (%s): %s", node, kind, reason)
        record.append({"node": node, "kind": kind, "reason": reason})

    # ------------------------------------------------------------------ the round
    def aggregate_train(self, server_round, replies):
        """Check, align into the global frame, aggregate; ``(ArrayRecord, MetricRecord)`` as FedAvg. Named
        stages: :meth:`_global_state_dict` and :meth:`_candidates` (load and check) → :meth:`_align_all` →
        :meth:`_norm_rule` → :meth:`_outlier_rule` → :meth:`_aggregate` → :meth:`_finish` (the report); too few
        clients left after a stage, or a failed aggregate, keep the previous global model."""
        t0 = time.perf_counter()
        global_sd = self._global_state_dict()
        candidates, left_out = self._candidates(list(replies))
        record = {"round": server_round, "left_out": left_out, "kept_previous": False, "folded": self.folds,
                  "symmetries": list(self.alignment.symmetries), "aggregation": self.aggregation.rule,
                  "outlier_rule": self.outliers.rule, "outlier_z": {}, "clipped": [], "unaligned": []}
        if self.outliers.relabel is not None:
            record.update(relabel="detect", relabel_gain={})
        if len(candidates) < self.aggregation.min_clients:
            return self._keep_previous(record, candidates, t0)
        t_align = time.perf_counter()
        anchor = with_state_dict(self.template, global_sd)
        anchor = canonical(anchor, self.alignment) if self.alignment.symmetries else anchor
        anchor_sd = anchor.state_dict()
        keys = [k for k, v in anchor_sd.items() if v.is_floating_point()]
        aligned, raw = self._align_all(candidates, anchor, anchor_sd, keys, left_out, record)
        align_seconds = time.perf_counter() - t_align
        kept = self._norm_rule(aligned, raw, global_sd, anchor, anchor_sd, keys, left_out, record)
        kept = self._outlier_rule(kept, anchor, anchor_sd, keys, left_out, record)
        if len(kept) < self.aggregation.min_clients:
            return self._keep_previous(record, kept, t0, align_seconds)
        merged = self._aggregate(server_round, kept, raw, anchor, anchor_sd, keys, record)
        if merged is None:
            return self._keep_previous(record, kept, t0, align_seconds, why=record["note"])
        arrays = ArrayRecord({k: v.detach().contiguous() for k, v in merged.items()})
        record.update(accepted=[k[0].metadata.src_node_id for k in kept], weights=[k[2] for k in kept],
                      distance_before=[k[3] for k in kept], distance_after=[k[4] for k in kept],
                      align_seconds=align_seconds)
        metrics = self._client_metrics([k[0] for k in kept])
        return arrays, self._finish(record, metrics, t0)

    def _global_state_dict(self) -> dict:
        """The round's global model (set by :meth:`configure_train`), checked against the template."""
        if self.global_arrays is None:
            raise SymmergeError("AlignedFedAvg.aggregate_train needs the round's global model: configure_train sets "
                                "it (or set strategy.global_arrays)")
        global_sd = self.global_arrays.to_torch_state_dict()
        problem = check_state_dict(global_sd, self.reference, "the template")
        if problem is not None:
            what = "is not finite" if problem[0] == "non_finite" else "does not match the template"
            raise SymmergeError(f"the global model (the ArrayRecord sent this round: initial_arrays in round 1) "
                                f"{what}: {problem[1]}")
        return global_sd

    def _candidates(self, replies: list) -> tuple[list, list]:
        """(the replies whose model is well formed: (message, state dict, weight), the left-out nodes: sampled
        without a reply, error replies, malformed or mismatched models)."""
        valid, errors = self._check_and_log_replies(replies, is_train=True, validate=False)
        left_out: list[dict] = []
        replied = {m.metadata.src_node_id for m in replies}
        for node in self.sampled_nodes:
            if node not in replied:
                self._left_out(left_out, node, "missing", "sampled for this round but sent no reply")
        for msg in errors:
            self._left_out(left_out, msg.metadata.src_node_id, "error",
                           f"error reply (code {msg.error.code}): {msg.error.reason}")
        candidates = []
        for msg in valid:
            node = msg.metadata.src_node_id
            try:
                state_dict, weight = self._unpack(msg)
                problem = check_state_dict(state_dict, self.reference)
                if problem is not None:
                    raise _LeftOut(*problem)
            except _LeftOut as e:
                self._left_out(left_out, node, e.kind, e.reason)
                continue
            candidates.append((msg, state_dict, weight))
        return candidates, left_out

    def _align_all(self, candidates, anchor, anchor_sd, keys, left_out, record) -> tuple[list, dict]:
        """(every candidate aligned into the global frame: (message, state dict, weight, distance before, after),
        {node: the client's own state dict}); a failed alignment or an overflowing distance leaves it out."""
        aligned = []
        raw = {}
        for msg, state_dict, weight in candidates:
            node = msg.metadata.src_node_id
            try:
                sd, before, after = self._align(state_dict, anchor, anchor_sd, keys, node, record)
            except Exception as e:  # noqa: BLE001 - a client's weights must not crash the server's solvers
                self._left_out(left_out, node, "alignment", f"alignment failed: {type(e).__name__}: {e}")
                continue
            if not math.isfinite(after):
                self._left_out(left_out, node, "non_finite", f"its distance to the global model overflows ({after})")
                continue
            aligned.append((msg, sd, weight, before, after))
            raw[node] = state_dict  # the client's own model (its update scaled down when clipped)
        return aligned, raw

    def _norm_rule(self, aligned, raw, global_sd, anchor, anchor_sd, keys, left_out, record) -> list:
        """The norm rule, on the aligned updates: an outlier is left out, or with ``norm_clip`` its own update
        scaled down to the others' median norm and aligned again (``raw`` then holds the scaled model)."""
        distances = [a[4] for a in aligned]
        kept = []
        for i, (item, reason) in enumerate(zip(aligned, norm_outliers(distances, self.outliers.norm_factor))):
            if reason is None:
                kept.append(item)
            elif self.outliers.norm_clip:
                # the client's own update (before alignment: a huge update would steer the alignment) scaled
                # down to the others' median norm, then aligned like the others
                node, target = item[0].metadata.src_node_id, median_of_others(distances, i)
                state_dict = raw[node]
                float_keys = [k for k, v in global_sd.items() if v.is_floating_point()]
                scale = target / max(sq_distance(state_dict, global_sd, float_keys) ** 0.5, 1e-300)
                log(WARNING, "aggregate_train: clipped node %s: %s; its update scaled by %.4g", node, reason, scale)
                record["clipped"].append({"node": node, "reason": reason, "scale": scale})
                try:
                    sd, _, after = self._align(scale_update(state_dict, global_sd, float_keys, scale), anchor,
                                               anchor_sd, keys, node, record)
                except Exception as e:  # noqa: BLE001
                    self._left_out(left_out, node, "alignment", f"alignment failed: {type(e).__name__}: {e}")
                    continue
                kept.append((item[0], sd, item[2], item[3], after))
                raw[node] = scale_update(state_dict, global_sd, float_keys, scale)
            else:
                self._left_out(left_out, item[0].metadata.src_node_id, "norm", reason)
        return kept

    def _aggregate(self, server_round, kept, raw, anchor, anchor_sd, keys, record) -> dict | None:
        """The kept clients aggregated (jointly aligned first with ``joint``); None, with the record's note, when
        the joint alignment fails or the aggregate is not finite. One client (``min_clients=1``) has no joint
        alignment to run: it is aggregated as aligned to the global model."""
        if self.client_alignment.joint and len(kept) > 1:
            try:
                merged = self._joint_aggregate([raw[k[0].metadata.src_node_id] for k in kept], [k[2] for k in kept],
                                               anchor, keys, record)
            except Exception as e:  # noqa: BLE001 - the clients' weights must not crash the server's solvers
                log(WARNING, "aggregate_train: round %d: the joint alignment failed (%s: %s); the previous global "
                             "model is kept", server_round, type(e).__name__, e)
                record["note"] = f"the joint alignment failed: {type(e).__name__}: {e}"
                return None
        else:
            merged = aggregate([k[1] for k in kept], [k[2] for k in kept], keys, anchor_sd, self.aggregation.rule,
                               self.aggregation.trim)
        if not all(bool(torch.isfinite(merged[k]).all()) for k in keys):  # e.g. huge finite values that overflow
            log(WARNING, "aggregate_train: round %d: the aggregate is not finite", server_round)
            record["note"] = "the aggregate was not finite: the previous global model is kept"
            return None
        return merged

    def _align(self, state_dict: dict, anchor, anchor_sd: dict, keys, node=None,
               record: dict | None = None) -> tuple[dict, float, float]:
        """A client's model aligned to the global model: (state dict, distance before, distance after). With
        ``min_align_gain``, an alignment that lowers the distance by less than that fraction is not used: the
        client comes back as it was sent (in the global model's parameterisation), its distance unchanged, and
        ``record["unaligned"]`` names it."""
        model = with_state_dict(self.template, state_dict)
        if not self.alignment.symmetries:
            sd = model.state_dict()
            d = sq_distance(sd, anchor_sd, keys) ** 0.5
            return sd, float(d), float(d)
        # joint: this alignment only feeds the distances and the rules (the aggregate comes from the joint one),
        # so it is data-free whatever the matcher
        joint, min_gain = self.client_alignment.joint, self.client_alignment.min_align_gain
        res = align_pair(model, anchor, self.alignment.with_(match="weights") if joint else self.alignment)
        before, after = float(res.report["distance_before"]), float(res.report["distance_after"])
        gain = (before - after) / before if before > 0 else 0.0
        if min_gain > 0 and not joint and gain < min_gain:
            # the identity element (norms folded if the frame is)
            unaligned = canonical(model, self.alignment).state_dict()
            if record is not None:
                record["unaligned"].append({"node": node, "gain": gain})
            return unaligned, before, float(sq_distance(unaligned, anchor_sd, keys) ** 0.5)
        return res.model.state_dict(), before, after

    def _joint_aggregate(self, state_dicts: list, weights: list, anchor, keys, record: dict) -> dict:
        """The clients aligned jointly (anchor: the client closest to their average), aggregated, then moved into
        the global model's frame by a data-free alignment of the aggregate to it (its function unchanged)."""
        from ..merge.heads import head_keys
        from ..merge.plan import average_keys, closest_to_average
        from ..pipeline.joint import align_joint

        t = time.perf_counter()
        models = [with_state_dict(self.template, sd) for sd in state_dicts]
        body = average_keys(keys, head_keys(self.template), lambda k: state_dicts[0][k].dtype)
        star, _ = closest_to_average(lambda k: [sd[k] for sd in state_dicts], body)
        joint = align_joint(models, self.alignment.with_(verify=False), anchor=star,
                            max_rounds=self.client_alignment.joint_rounds, refine=self.client_alignment.joint_refine)
        sds = [x.state_dict() for x in joint.models]
        merged = aggregate(sds, weights, keys, sds[star], self.aggregation.rule, self.aggregation.trim)
        back = align_pair(with_state_dict(joint.models[star], merged), anchor,
                          self.alignment.with_(match="weights", verify=False))
        record["joint"] = {**{k: v for k, v in joint.report.items() if k != "models"},
                           "seconds": time.perf_counter() - t,
                           "distance_to_global_before": float(back.report["distance_before"]),
                           "distance_to_global_after": float(back.report["distance_after"])}
        return back.model.state_dict()

    def _outlier_rule(self, kept: list, anchor, anchor_sd: dict, keys, left_out: list, record: dict) -> list:
        """The clients of ``kept`` whose aligned update is not an outlier (the others are left out)."""
        rule, threshold = self.outliers.rule, self.outliers.threshold
        if rule is None:
            return kept
        if len(kept) < 3:
            return self._too_few_to_score(kept, record)
        if rule == CONSENSUS_RULE:  # functional: the clients' predictions on the server's data
            # (the aligned models compute what the clients' models compute); a client whose predictions cannot
            # be had is left out before the others are scored (it must not enter their consensus)
            probs = client_probabilities(anchor, [k[1] for k in kept], self.outlier_data)
            for item, p in zip(kept, probs):
                if isinstance(p, str):
                    self._left_out(left_out, item[0].metadata.src_node_id, "outlier", p)
            kept = [item for item, p in zip(kept, probs) if not isinstance(p, str)]
            if len(kept) < 3:
                return self._too_few_to_score(kept, record)
            probs = [p for p in probs if not isinstance(p, str)]
            scores = consensus_scores(probs)
            flags = update_outliers(scores, threshold, rule, CONSENSUS_MIN_SPREAD)
            if self.outliers.relabel is not None:
                return self._relabel(kept, probs, flags, left_out, record)
        else:
            scores = update_scores([k[1] for k in kept], anchor_sd, keys, rule)
            flags = update_outliers(scores, threshold, rule)
        record["outlier_z"] = {k[0].metadata.src_node_id: z for k, (z, _) in zip(kept, flags)}
        out = []
        for item, (_, reason) in zip(kept, flags):
            if reason is None:
                out.append(item)
            else:
                self._left_out(left_out, item[0].metadata.src_node_id, "outlier", reason)
        return out

    def _too_few_to_score(self, kept: list, record: dict) -> list:
        """``kept`` as it is: the outlier rule compares each client with the others' median (or consensus) and
        needs 3 clients; said in the log, since the rule was asked for."""
        log(WARNING, "aggregate_train: round %d: the outlier rule %r needs at least 3 clients, %d remain: it was not "
                     "applied", record["round"], self.outliers.rule, len(kept))
        return kept

    def _relabel(self, kept: list, probs: list, flags: list, left_out: list, record: dict) -> list:
        """The consensus rule with the relabelling check (``outliers.relabel``): a client is left out (kind
        ``outlier``) when the consensus rule flags it or its best relabelling of the classes onto the others'
        consensus gains at least the check's ``threshold``; the logged reason names the relabelling's confident
        cycles (those gaining ``min_cycle`` each)."""
        check = self.outliers.relabel
        record["outlier_z"] = {k[0].metadata.src_node_id: z for k, (z, _) in zip(kept, flags)}
        found = relabellings(probs, check.min_cycle)
        out = []
        for item, (z, reason), r in zip(kept, flags, found):
            node = item[0].metadata.src_node_id
            record["relabel_gain"][node] = r["gain"]
            if reason is None and r["gain"] < check.threshold:
                out.append(item)
                continue
            moved = {i: j for i, j in enumerate(r["kept"]) if i != j}
            why = (f"its best relabelling of the classes (client class -> consensus class: {moved or 'none'}) gains "
                   f"{r['gain']:.4g} of the probability mass ({r['kept_gain']:.4g} in the confident cycles), "
                   f"relabel threshold {check.threshold:g}")
            self._left_out(left_out, node, "outlier", (reason + "; " if reason else "") + why)
        return out

    def _keep_previous(self, record: dict, accepted, t0: float, align_seconds: float = 0.0, why: str | None = None):
        log(WARNING, "aggregate_train: round %d keeps the previous global model: %s", record["round"],
            why or f"{len(accepted)} client(s) accepted, min_clients is {self.aggregation.min_clients}")
        record.update(kept_previous=True, accepted=[], weights=[], distance_before=[], distance_after=[],
                      align_seconds=align_seconds)
        return self.global_arrays, self._finish(record, MetricRecord(), t0)

    def aggregate_evaluate(self, server_round, replies):
        """FedAvg's aggregation of the clients' evaluation metrics, reply by reply: a reply without one
        MetricRecord holding a positive finite ``num-examples`` (the ``weighted_by_key``), or whose metric names
        differ from the other replies' (those most replies share), is left out with a logged warning naming its
        node, where Flower's FedAvg would raise and end the run; ``None`` when no reply remains."""
        valid, _ = self._check_and_log_replies(list(replies), is_train=False, validate=False)
        checked = []
        for msg in valid:
            records = list(msg.content.metric_records.values())
            weight = records[0].get(self.weighted_by_key) if len(records) == 1 else None
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                    math.isfinite(weight) and weight > 0):
                log(WARNING, "aggregate_evaluate: left out node %s (malformed): not one MetricRecord with a positive "
                             "%r (metric records: %d, %r: %r)", msg.metadata.src_node_id, self.weighted_by_key,
                    len(records), self.weighted_by_key, weight)
                continue
            checked.append((msg, frozenset(records[0].keys())))
        if not checked:
            return None
        names = Counter(k for _, k in checked).most_common(1)[0][0]
        for msg, k in checked:
            if k != names:
                log(WARNING, "aggregate_evaluate: left out node %s (malformed): metric names %s, the other replies' %s",
                    msg.metadata.src_node_id, sorted(k), sorted(names))
        try:
            return self.evaluate_metrics_aggr_fn([m.content for m, k in checked if k == names], self.weighted_by_key)
        except Exception as e:  # noqa: BLE001 - clients' metrics must not end the run
            log(WARNING, "aggregate_evaluate: round %d: the clients' metrics were not aggregated: %s: %s", server_round,
                type(e).__name__, e)
            return None

    def _client_metrics(self, messages) -> MetricRecord:
        """The clients' own train metrics, aggregated by FedAvg's function over the accepted replies."""
        try:
            return self.train_metrics_aggr_fn([m.content for m in messages], self.weighted_by_key)
        except Exception as e:  # noqa: BLE001 - clients' extra metrics must not break the round
            log(WARNING, "aggregate_train: the clients' metrics were not aggregated: %s", e)
            return MetricRecord()

    def _finish(self, record: dict, metrics: MetricRecord, t0: float) -> MetricRecord:
        record["seconds"] = time.perf_counter() - t0
        self.rounds.append(record)
        before, after = record["distance_before"], record["distance_after"]
        metrics[PREFIX + "clients-aggregated"] = len(record["accepted"])
        metrics[PREFIX + "clients-left-out"] = len(record["left_out"])
        for kind in LEFT_OUT_KINDS:
            metrics[f"{PREFIX}left-out-{kind.replace('_', '-')}"] = sum(x["kind"] == kind for x in record["left_out"])
        aggregated = set(record["accepted"])  # the per-round counts are of the clients that entered the aggregate
        metrics[PREFIX + "clients-clipped"] = len({x["node"] for x in record["clipped"]} & aggregated)
        metrics[PREFIX + "clients-unaligned"] = len({x["node"] for x in record.get("unaligned", [])} & aggregated)
        metrics[PREFIX + "kept-previous"] = int(record["kept_previous"])
        metrics[PREFIX + "distance-before"] = float(sum(before) / len(before)) if before else 0.0
        metrics[PREFIX + "distance-after"] = float(sum(after) / len(after)) if after else 0.0
        metrics[PREFIX + "align-seconds"] = float(record["align_seconds"])
        metrics[PREFIX + "seconds"] = float(record["seconds"])
        log(INFO, "aggregate_train: round %d: %d aggregated, %d left out, distance to the global model %.4g -> "
                  "%.4g (mean, aligned), %.2f s", record["round"], len(record["accepted"]), len(record["left_out"]),
            metrics[PREFIX + "distance-before"], metrics[PREFIX + "distance-after"], record["seconds"])
        return metrics
