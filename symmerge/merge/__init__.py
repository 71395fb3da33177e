"""Fusion methods: a registry of small modules, each ``merge(state_dicts, weights=None, stats=None, **params)``.

Every method module defines ``NAME``, ``NEEDS`` (``None``, ``"gram"`` or ``"fisher"``: the
statistics it consumes), ``NEEDS_BASE`` (task-vector methods need a base model), ``PARAMS``
(defaults of its keyword parameters) and ``merge``. ``state_dicts`` hold the same keys and shapes;
only the keys to be merged are passed (task heads kept per task are left out by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

from ..errors import SymmergeError


@dataclass(frozen=True)
class Method:
    name: str
    merge: Callable
    needs: str | None = None
    needs_base: bool = False
    params: dict = field(default_factory=dict)
    doc: str = ""

    def check_params(self, params: dict) -> dict:
        """Known parameters with defaults filled in; unknown names → SymmergeError."""
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            known = ", ".join(self.params) or "none"
            raise SymmergeError(f"method {self.name!r} has no parameter {unknown[0]!r} (parameters: {known})")
        return {**self.params, **params}


METHODS: dict[str, Method] = {}


def register(module: ModuleType | Method) -> Method:
    """Add a method module (or a ready :class:`Method`) to :data:`METHODS`."""
    if not isinstance(module, Method):
        module = Method(module.NAME, module.merge, getattr(module, "NEEDS", None),
                        getattr(module, "NEEDS_BASE", False), dict(getattr(module, "PARAMS", {})),
                        (module.__doc__ or "").strip().splitlines()[0])
    METHODS[module.name] = module
    return module


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise SymmergeError(f"unknown merge method {name!r}; known methods: {', '.join(sorted(METHODS))}") from None


from . import average, dare, fisher, regmean, task_arithmetic, ties  # noqa: E402

for _m in (average, task_arithmetic, ties, dare, fisher, regmean):
    register(_m)
