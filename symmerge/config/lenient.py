"""How mergekit reads what it does not insist on, in one place (the layer that reads mergekit documents; the
YAML loader itself is :mod:`.source`):

* **unknown keys and method parameters** are ignored (mergekit's pydantic models ignore extra keys; a method
  resolves only the parameters it declares): each is one warning line naming the file, line and key, with a
  "did you mean" when a known name is close (:func:`unknown`);
* **values are read by the parameter's type**, as a lax validator does: a number written as a string of
  YAML 1.1 (``1e-5``: PyYAML's float needs a dot) is a number for a numeric parameter, ``1.0`` / ``0`` and
  ``"true"`` / ``"no"`` are booleans for a boolean one, an integral float an integer for an integer one
  (:func:`coerce_setting`, through scalars, gradients and filters); a value that is none of these is left
  as written, for :func:`~symmerge.config.params.check_setting` to name.
"""

from __future__ import annotations

import re

from ..errors import did_you_mean

_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_TRUE = ("true", "yes", "on", "y", "t", "1")
_FALSE = ("false", "no", "off", "n", "f", "0")


IGNORED = "; ignored, as mergekit ignores it"  # the end of every line of unknown()


def unknown(doc, what: str, name, known, *where) -> str:
    """The warning line of an ignored key or parameter ``name`` (``where``: its key path in ``doc``), which is
    not a ``what`` (``a mergekit key``); ``known``: the names it could have meant."""
    return f"{doc.at(*where)}: not {what}{did_you_mean(name, known)}{IGNORED}"


def _number(v):
    if isinstance(v, str) and _NUMBER.match(v.strip()):
        f = float(v)
        return int(f) if f.is_integer() and not any(c in v for c in ".eE") else f
    return v


def coerce(value, kind):
    """``value`` (a scalar) read as ``kind`` (``bool``, ``int``, ``float``, ``str`` or None) where a lax
    validator would; otherwise unchanged."""
    if kind in (float, int):
        v = _number(value)
        if kind is int and isinstance(v, float) and v.is_integer():
            return int(v)
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            return v  # ints are numbers already (gradients interpolate them as mergekit does)
        return v
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        return value
    if kind is None:
        return _number(value)  # an undeclared kind: a number written as a string is a number
    return value


def coerce_setting(setting, kind):
    """A parameter setting (a scalar, a gradient, a filter or a list of filters) with every scalar coerced."""
    if isinstance(setting, dict):
        return {k: (coerce_setting(v, kind) if k == "value" else v) for k, v in setting.items()}
    if isinstance(setting, list):
        return [coerce_setting(v, kind) for v in setting]
    if isinstance(setting, (bool, int, float, str)):
        return coerce(setting, kind)
    return setting
