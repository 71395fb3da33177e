"""Federated learning with symmetry-aligned aggregation: :class:`AlignedFedAvg`, a strategy for
Flower's message API (``pip install 'symmerge[flower]'``). The checks and aggregation rules, which
need no Flower, are in :mod:`symmerge.federated.aggregate`; its options objects in
:mod:`symmerge.federated.options`. Both import without Flower: only ``AlignedFedAvg`` needs it, and it is
imported when it is first named (``from symmerge.federated import AlignedFedAvg``; without Flower, one
``ImportError`` saying what to install)."""

from .aggregate import (AGGREGATIONS, CONSENSUS_RULE, LEFT_OUT_KINDS, OUTLIER_RULES, aggregate, check_state_dict,
                        norm_outliers, update_outliers, update_scores)
from .consensus import consensus_scores, prior_corrected
from .options import (FEDERATED_SYMMETRIES, Aggregation, ClientAlignment, OutlierPolicy, RelabelCheck,
                      alignment_options)

__all__ = ["AlignedFedAvg", "AGGREGATIONS", "Aggregation", "ClientAlignment", "CONSENSUS_RULE", "FEDERATED_SYMMETRIES",
           "LEFT_OUT_KINDS", "OutlierPolicy", "RelabelCheck", "aggregate", "OUTLIER_RULES", "alignment_options",
           "check_state_dict", "consensus_scores", "norm_outliers", "prior_corrected", "update_outliers",
           "update_scores"]


def __getattr__(name: str):
    """``AlignedFedAvg``, imported when it is named: the one part that needs Flower (PEP 562)."""
    if name == "AlignedFedAvg":
        from .strategy import AlignedFedAvg

        return AlignedFedAvg
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
