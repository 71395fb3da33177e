"""Group kinds as plug-ins: one module per kind, one registry.

Adding a kind = writing a module with a :class:`~symmerge.groups.base.Kind` subclass (element type,
binding, cost and solver, transform, random element, validity check) and registering its instance
here (the registry itself is :mod:`symmerge.core.kinds`, which the core reads without importing
the kinds). Families name kinds in their groups; resolve, apply, the solver engine and the tests loop over
kinds without knowing any.
"""

from __future__ import annotations

from ..core.kinds import KINDS, get_kind, register
from .base import Kind, Options, RESCALE_MODES

from . import head_orthogonal, heads, permutation, residual, rope_pairs  # noqa: E402

for _module in (heads, head_orthogonal, rope_pairs, permutation, residual):
    register(_module.KIND)

from . import experts  # noqa: E402  (mixtures of experts)

register(experts.KIND)

__all__ = ["Kind", "Options", "RESCALE_MODES", "KINDS", "register", "get_kind"]
