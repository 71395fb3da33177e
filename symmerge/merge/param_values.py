"""Method parameters (``--param KEY=VALUE``, a config's ``parameters``) checked where they are parsed: a
value of the wrong kind or out of range is one error naming the parameter, before anything is loaded.

The kind comes from the method's default (a number, an integer, a true/false flag, a word); the ranges of
the parameters whose meaning bounds them are in :data:`RANGES`. The methods check their parameters again
when they run (the Python API), in their own words."""

from __future__ import annotations

import math

from ..errors import SymmergeError

# name: (low, high, low included, high included)
RANGES = {
    "density": (0.0, 1.0, False, True),  # TIES: the fraction of each task vector kept
    "drop": (0.0, 1.0, True, False),  # DARE: the probability an entry is dropped
    "alpha": (0.0, 1.0, True, True),  # RegMean: the Grams' off-diagonal scale
    "eps": (0.0, math.inf, False, False),  # Fisher: the floor of the summed Fishers
    "seed": (0, math.inf, True, False),
    "reg": (0.0, math.inf, False, False),  # OT fusion: the entropic regularisation
}


def _interval(name: str) -> str:
    low, high, lo_in, hi_in = RANGES[name]
    return f"{'[' if lo_in else '('}{low:g}, {high:g}{']' if hi_in else ')'}".replace("inf", "∞")


def _inside(name: str, value: float) -> bool:
    if name not in RANGES:
        return math.isfinite(value)
    low, high, lo_in, hi_in = RANGES[name]
    return (low < value or (lo_in and value == low)) and (value < high or (hi_in and value == high))


def check_param_values(method_name: str, params: dict) -> dict:
    """``params`` (parsed by the CLI: numbers, true/false, words) against ``method_name``'s defaults:
    unknown names and values of the wrong kind or outside their range are one :class:`SymmergeError`
    (``--param NAME: expected ..., got 'VALUE'``). Returns ``params``."""
    from . import get_method

    method = get_method(method_name)
    method.check_params(dict(params))  # unknown names: the method's own error
    for name, value in params.items():
        default = method.params.get(name)
        shown = value if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else value
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise SymmergeError(f"--param {name}: expected true or false, got {shown!r}")
            continue
        if isinstance(default, int) or name == "seed":
            if isinstance(value, bool) or not isinstance(value, int) or not _inside(name, value):
                where = f" in {_interval(name)}" if name in RANGES else ""
                raise SymmergeError(f"--param {name}: expected an integer{where}, got {shown!r}")
            continue
        if isinstance(default, float) or name in RANGES:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _inside(name, float(value)):
                where = f" in {_interval(name)}" if name in RANGES else ""
                raise SymmergeError(f"--param {name}: expected a number{where}, got {shown!r}")
            continue
        if isinstance(default, str) and not isinstance(value, str):
            raise SymmergeError(f"--param {name}: expected a word (default {default!r}), got {shown!r}")
    return params
