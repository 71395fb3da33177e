"""The registry of group kinds: the core names a group's kind and looks it up here; the kinds themselves
are plug-ins (:mod:`symmerge.groups`, one module per kind) that register on import. The core never
imports them, so the dependency runs one way: ``groups`` → ``core``."""

from __future__ import annotations

from ..errors import SymmergeError

KINDS: dict = {}  # name -> a symmerge.groups.base.Kind instance


def register(kind):
    name = kind.name
    if not name or name in KINDS:
        raise ValueError(f"group kind {name!r} is unnamed or registered twice")
    KINDS[name] = kind
    return kind


def get_kind(name: str):
    try:
        return KINDS[name]
    except KeyError:
        known = ", ".join(sorted(KINDS)) or "none (import symmerge.groups to register them)"
        raise SymmergeError(f"unknown group kind {name!r}; known: {known}") from None
