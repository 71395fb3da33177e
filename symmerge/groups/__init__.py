"""Group kinds as plug-ins: one module per kind, one registry.

Adding a kind = writing a module with a :class:`~symmerge.groups.base.Kind` subclass (element type,
binding, cost and solver, transform, random element, validity check) and registering its instance
here. Families name kinds in their groups; resolve, apply, the solver engine and the tests loop over
kinds without knowing any.
"""

from __future__ import annotations

from ..errors import SymmergeError
from .base import Kind, Options, RESCALE_MODES

KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    if not kind.name or kind.name in KINDS:
        raise ValueError(f"group kind {kind.name!r} is unnamed or registered twice")
    KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise SymmergeError(f"unknown group kind {name!r}; known: {', '.join(sorted(KINDS))}") from None


from . import head_orthogonal, heads, permutation, residual, rope_pairs  # noqa: E402

for _module in (heads, head_orthogonal, rope_pairs, permutation, residual):
    register(_module.KIND)

from . import experts  # noqa: E402  (mixtures of experts)

register(experts.KIND)

__all__ = ["Kind", "Options", "RESCALE_MODES", "KINDS", "register", "get_kind"]
