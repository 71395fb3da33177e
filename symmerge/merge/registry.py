"""The registry of merge methods (:mod:`symmerge.merge` registers its methods here on import)."""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from ..errors import SymmergeError, did_you_mean
from .base import Method, check_needs

METHODS: dict[str, Method] = {}


def register(module: ModuleType | Method) -> Method:
    """Add a method module (its ``METHOD``) or a ready :class:`Method` to :data:`METHODS`, also under each of
    its ``other_names`` (the same rule and defaults, named as asked); a method whose ``needs`` is not ``None``
    or one of :data:`STATISTICS` is refused (SymmergeError)."""
    method = module if isinstance(module, Method) else module.METHOD
    check_needs(method.name, method.needs)
    METHODS[method.name] = method
    for alias in method.other_names:
        METHODS[alias] = replace(method, name=alias, other_names=())
    return method


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise SymmergeError(f"unknown merge method {name!r}{did_you_mean(name, METHODS)}; known methods: "
                            f"{', '.join(sorted(METHODS))}") from None
