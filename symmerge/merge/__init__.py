"""``symmerge.merge(models, out, options=None, **keywords) -> report``: merge ``models`` (HF folders or transformers
models) into the folder ``out`` with a :class:`~symmerge.merge.fuse.MergeOptions` (or its fields as keywords), written
as ``symmerge merge`` writes it; see :func:`symmerge.merge.api.merge_to_folder`. (In memory, returning the model:
:func:`symmerge.merge_models`.)

This package holds the fusion methods: a registry of :class:`Method` objects, each a per-tensor rule run by one
merge loop.

Every method module defines ``METHOD`` (its :class:`Method`, see :mod:`.base`: ``name``, the
per-tensor rule, ``needs`` — ``None`` or one of :data:`STATISTICS`, the statistics it consumes —,
``needs_model`` — the method needs the architecture (OT fusion, :mod:`.ot_fusion`, which defines
three methods in ``METHODS``) —,
``needs_base`` — task-vector methods need a base model —, ``params`` — defaults of its keyword
parameters — and ``doc``) and ``merge(state_dicts, weights=None, stats=None, **params)`` (that is
``METHOD.merge``; task-vector methods take ``base=``). ``state_dicts`` hold the same keys and
shapes; only the keys to be merged are passed (task heads kept per task are left out by the
caller). Task-vector methods are built from a sparsifier and a consensus (:mod:`.parts`).
"""

from __future__ import annotations

import sys as _sys
import types as _types

from .base import STATISTICS, Method, merge_state_dicts
from .registry import METHODS, get_method, register

from . import (average, breadcrumbs, dare, dare_ties, della, fisher, ot_fusion, regmean,  # noqa: E402
               specialized, spherical, task_arithmetic, ties)

for _m in (average, task_arithmetic, ties, dare, dare_ties, fisher, regmean, *ot_fusion.METHODS,
           # mergekit's methods under mergekit's names (``dare`` is ``dare_linear``'s other name)
           average.LINEAR, breadcrumbs.METHOD, breadcrumbs.TIES, della.METHOD, della.LINEAR,
           *spherical.METHODS, *specialized.METHODS):
    register(_m)

# mergekit's merge_method names, each a registered method with mergekit's defaults
MERGEKIT_METHODS = ("linear", "slerp", "nuslerp", "multislerp", "karcher", "task_arithmetic", "ties", "dare_ties",
                    "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce", "model_stock",
                    "nearswap", "arcee_fusion", "passthrough", "ram", "ramplus_tl")

__all__ = ["MERGEKIT_METHODS", "METHODS", "STATISTICS", "Method", "get_method", "merge_state_dicts", "register"]


class _MergeEntry(_types.ModuleType):
    """``symmerge.merge`` is both this package and the library entry that writes:
    ``symmerge.merge(models, out, options) -> report`` is :func:`symmerge.merge.api.merge_to_folder`."""

    def __call__(self, models, out, options=None, **keywords):
        from .api import merge_to_folder

        return merge_to_folder(models, out, options, **keywords)


_sys.modules[__name__].__class__ = _MergeEntry
