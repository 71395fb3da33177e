"""The options of :class:`~symmerge.federated.AlignedFedAvg`, one frozen dataclass per concern, each
validated once when it is made (no Flower needed here):

* :class:`ClientAlignment`: how the accepted clients are aligned (the :class:`AlignOptions`, the guard
  ``min_align_gain``, the joint aggregation);
* :class:`Aggregation`: how the aligned clients are combined (``rule``, ``trim``) and how many must remain
  (``min_clients``);
* :class:`OutlierPolicy`: which clients are left out before that (the norm rule, the outlier rule, the
  consensus rule's server data, and the relabelling check :class:`RelabelCheck`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..errors import SymmergeError, UsageError, keywords_checked
from ..pipeline.options import DEFAULT_REFINE, JOINT_REFINE, AlignOptions
from .aggregate import CONSENSUS_RULE, check_aggregation, check_outlier_rule

# the recommended set without the residual stream: groups that need no change of parameterisation
FEDERATED_SYMMETRIES = ("heads", "attn", "ffn", "rescale")
# a client's alignment is kept only if it lowers its distance to the global model by at least this fraction;
# otherwise the client enters the aggregate as it was sent (the identity element): see AlignedFedAvg
MIN_ALIGN_GAIN = 0.05


def _whole(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SymmergeError(f"{name} must be a whole number >= {low}, got {value!r}")


def _flag(owner: str, name: str, value) -> None:
    # checked before any use (a string such as "false" would read as true)
    if not isinstance(value, bool):
        raise UsageError(f"{owner}(): {name} must be True or False, got {value!r}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise SymmergeError(f"{name} must be a number > 0, got {value!r}")


def alignment_options(alignment) -> AlignOptions:
    """``None`` → data-free alignment over :data:`FEDERATED_SYMMETRIES`; a symmetries string (``"none"``:
    no alignment, plain robust FedAvg) → those, data-free; an :class:`AlignOptions` as given."""
    if alignment is None:
        return AlignOptions(symmetries=FEDERATED_SYMMETRIES)
    if isinstance(alignment, AlignOptions):
        return alignment
    return AlignOptions(symmetries=alignment)


@keywords_checked
@dataclass(frozen=True)
class ClientAlignment:
    """How each accepted client is aligned. ``options``: an :class:`AlignOptions` or a symmetries string
    (``None``, the default: data-free, :data:`FEDERATED_SYMMETRIES`; ``"none"``: no alignment; with
    ``match="activations"`` or ``"learned"`` and ``align_data``: unlabeled data held by the server), turned
    into an :class:`AlignOptions` here. ``min_align_gain``: a client whose alignment lowers its distance to the
    global model by less than this fraction is aggregated as it was sent. ``joint``: aggregate the accepted
    clients in their joint frame (``joint_rounds``, ``joint_refine``: the joint alignment's cap on rounds and
    what they re-solve, as ``merge --joint-rounds/--joint-refine``)."""

    options: AlignOptions | str | None = None
    min_align_gain: float = MIN_ALIGN_GAIN
    joint: bool = False
    joint_rounds: int = 10
    joint_refine: str = DEFAULT_REFINE

    def __post_init__(self):
        _flag("ClientAlignment", "joint", self.joint)
        object.__setattr__(self, "options", alignment_options(self.options))
        if self.options.dual:  # each client is aligned onto the global model, which must stay
            raise SymmergeError("the dual learned frame moves the anchor too, and a federated round aligns each client "
                                "onto the global model, which stays as it is: use the one-sided frame")
        if isinstance(self.min_align_gain, bool) or not isinstance(self.min_align_gain, (int, float)) or not (
                0.0 <= self.min_align_gain < 1.0):
            raise SymmergeError(f"min_align_gain must be a fraction in [0, 1), got {self.min_align_gain!r}")
        object.__setattr__(self, "min_align_gain", float(self.min_align_gain))
        if self.joint and not self.options.symmetries:
            raise SymmergeError("joint=True aligns the clients jointly: it needs symmetries (alignment is 'none')")
        _whole("joint_rounds", self.joint_rounds, 0)
        if self.joint_refine not in JOINT_REFINE:
            raise SymmergeError(f"unknown joint_refine {self.joint_refine!r}; choose {', '.join(JOINT_REFINE)}")


@keywords_checked
@dataclass(frozen=True)
class Aggregation:
    """How the aligned clients are combined: ``rule`` ``mean`` (weighted by ``num-examples``), ``median``
    or ``trimmed_mean`` (``trim``: the fraction cut from each end, per coordinate); with fewer than
    ``min_clients`` accepted clients the previous global model is kept."""

    rule: str = "mean"
    trim: float = 0.2
    min_clients: int = 2

    def __post_init__(self):
        check_aggregation(self.rule, self.trim, ("Aggregation rule", "Aggregation trim"))
        _whole("min_clients", self.min_clients, 1)


@keywords_checked
@dataclass(frozen=True)
class RelabelCheck:
    """The relabelling check of the consensus rule (:mod:`symmerge.federated.relabel`): a client whose best
    relabelling of the classes onto the others' consensus gains at least ``threshold`` (probability mass) is
    left out; ``min_cycle``: the gain a cycle of that relabelling needs to be named in the logged reason (its
    confidently estimated part)."""

    threshold: float = 0.01
    min_cycle: float = 0.002

    def __post_init__(self):
        _positive("relabel threshold", self.threshold)
        _positive("relabel min_cycle", self.min_cycle)
        object.__setattr__(self, "threshold", float(self.threshold))
        object.__setattr__(self, "min_cycle", float(self.min_cycle))


@keywords_checked
@dataclass(frozen=True)
class OutlierPolicy:
    """Which accepted clients are left out before the aggregation. ``norm_factor``: a client whose aligned
    update norm exceeds this multiple of the median of the others' is left out (``None``: no such rule);
    with ``norm_clip`` it is kept instead, its update scaled down to the median of the others' norms.
    ``rule`` (``distance``, ``cosine`` or ``krum``; ``None``, the default: off) with ``threshold``: a client
    whose aligned update's score has a robust z-score beyond the threshold is left out. ``rule="consensus"``:
    the functional rule, on the clients' predictions on ``data`` (unlabeled data held by the server, as
    ``align_data``; default: the alignment's ``align_data``), at most ``samples`` examples; a classifier only.
    ``relabel``: a :class:`RelabelCheck` (only with ``rule="consensus"``; ``None``: off)."""

    norm_factor: float | None = 10.0
    norm_clip: bool = False
    rule: str | None = None
    threshold: float = 3.5
    data: object = None
    samples: int = 1000
    relabel: RelabelCheck | None = None

    def __post_init__(self):
        _flag("OutlierPolicy", "norm_clip", self.norm_clip)
        if self.norm_factor is not None and not (isinstance(self.norm_factor, (int, float))
                                                 and not isinstance(self.norm_factor, bool)
                                                 and self.norm_factor > 1 and math.isfinite(self.norm_factor)):
            raise SymmergeError(f"norm_factor must be a number > 1 (or None), got {self.norm_factor!r}")
        check_outlier_rule(self.rule, self.threshold, ("OutlierPolicy rule", "OutlierPolicy threshold"))
        object.__setattr__(self, "threshold", float(self.threshold))
        _whole("OutlierPolicy.samples", self.samples, 1)
        if self.data is not None and self.rule != CONSENSUS_RULE:  # it would be ignored
            raise SymmergeError(f"OutlierPolicy: data is the consensus rule's unlabeled server data: it needs "
                                f"rule='consensus' (got {self.rule!r})")
        if self.relabel is not None:
            if not isinstance(self.relabel, RelabelCheck):
                raise SymmergeError(f"relabel must be a RelabelCheck (or None: off), got {self.relabel!r}")
            if self.rule != CONSENSUS_RULE:
                raise SymmergeError(f"the relabelling check compares the clients' predictions on the server's "
                                    f"unlabeled data: it needs rule='consensus' (got {self.rule!r})")


# every keyword AlignedFedAvg once took by itself, and the options object that holds it now
MOVED = {**{f"{f.name}": f"ClientAlignment({f.name}=...)" for f in fields(ClientAlignment) if f.name != "options"},
         "trim": "Aggregation(trim=...)", "min_clients": "Aggregation(min_clients=...)",
         "norm_factor": "OutlierPolicy(norm_factor=...)", "norm_clip": "OutlierPolicy(norm_clip=...)",
         "outlier_rule": "OutlierPolicy(rule=...)", "outlier_threshold": "OutlierPolicy(threshold=...)",
         "outlier_data": "OutlierPolicy(data=...)", "outlier_samples": "OutlierPolicy(samples=...)",
         "relabel": "OutlierPolicy(relabel=RelabelCheck())",
         "relabel_threshold": "OutlierPolicy(relabel=RelabelCheck(threshold=...))",
         "relabel_min_cycle": "OutlierPolicy(relabel=RelabelCheck(min_cycle=...))"}
