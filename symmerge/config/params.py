"""Parameter values as mergekit writes them: a scalar, a gradient (a list of numbers interpolated over a
slice's layers) or filters (``[{filter: self_attn, value: ...}, {value: ...}]``, the first whose filter is a
substring of the tensor's name wins; no filter or ``*`` matches everything).

:func:`check_setting` validates a value once, where it is written; :func:`evaluate` gives its value for one
tensor at one position ``t`` in [0, 1], exactly as mergekit 0.1.x does (``mergekit.config.evaluate_setting``):
a gradient of n values at ``t`` takes ``i = int(t (n - 1))`` and interpolates linearly between values i and
i + 1 (booleans and strings are not interpolated: value i); a filter list that matches nothing, like an absent
value, gives ``None`` and the next level down is asked.
"""

from __future__ import annotations

from ..errors import SymmergeError

SCALARS = (bool, int, float, str)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_setting(doc, value, where, kind=None) -> None:
    """Raise one clear error naming ``where`` (a key path in ``doc``) unless ``value`` is a scalar, a gradient
    or a list of filters. ``kind``: the type the method's parameter takes (``bool``, ``float``, ...), or None."""
    if isinstance(value, dict):
        value = [value]  # one conditional value
        single = True
    else:
        single = False
    if value is None:
        raise doc.error("needs a value (a number, a gradient [a, b, ...] or filters [{filter: ..., value: ...}])",
                        *where)
    if isinstance(value, SCALARS):
        _check_kind(doc, value, where, kind)
        return
    if not isinstance(value, list):
        raise doc.error(f"not a parameter value: {value!r}", *where)
    if not value:
        raise doc.error("an empty list: a gradient needs at least one value", *where)
    if all(isinstance(v, SCALARS) for v in value):
        _check_gradient(doc, value, where, kind)
        return
    if not all(isinstance(v, dict) for v in value):
        raise doc.error("mixes plain values and filters: a gradient is a list of numbers, filters a list of "
                        "mappings {filter: NAME, value: ...}", *where)
    for i, cond in enumerate(value):
        here = where if single else where + (i,)
        unknown = sorted(set(cond) - {"filter", "value"})
        if unknown:
            raise doc.error(f"unknown key {unknown[0]!r} in a filter (keys: filter, value)", *here)
        if "value" not in cond:
            raise doc.error("a filter needs 'value'", *here)
        f = cond.get("filter")
        if f is not None and (not isinstance(f, str) or not f):
            raise doc.error(f"'filter' is a part of a tensor name (e.g. self_attn, mlp), got {f!r}", *here, "filter")
        v = cond["value"]
        if isinstance(v, (dict, type(None))) or (isinstance(v, list) and not all(isinstance(x, SCALARS) for x in v)):
            raise doc.error("a filter's value is a number or a gradient [a, b, ...]", *here, "value")
        if isinstance(v, list):
            if not v:
                raise doc.error("an empty list: a gradient needs at least one value", *here, "value")
            _check_gradient(doc, v, here + ("value",), kind)
        else:
            _check_kind(doc, v, here + ("value",), kind)


def _check_gradient(doc, values, where, kind):
    if kind is bool:
        if not all(isinstance(v, bool) for v in values):
            raise doc.error("a list of true/false expected", *where)
        return
    if not all(_is_number(v) for v in values):
        bad = next(v for v in values if not _is_number(v))
        raise doc.error(f"a gradient is a list of numbers, got {bad!r}", *where)


def _check_kind(doc, value, where, kind):
    if kind is None or kind is str:
        return
    if kind is bool and not isinstance(value, bool):
        raise doc.error(f"true or false expected, got {value!r}", *where)
    if kind in (int, float) and not _is_number(value):
        raise doc.error(f"a number expected, got {value!r}", *where)


def evaluate(setting, tensor_name: str, t: float):
    """The value of ``setting`` for tensor ``tensor_name`` at gradient position ``t`` (None: not set here)."""
    if isinstance(setting, dict):
        setting = [setting]
    if isinstance(setting, SCALARS):
        return setting
    if isinstance(setting, list):
        if not setting:
            return None
        if all(isinstance(e, SCALARS) for e in setting):
            if not all(_is_number(e) for e in setting):
                return setting[int(t * (len(setting) - 1))]
            scaled = t * (len(setting) - 1)
            i0 = int(scaled)
            i1 = min(len(setting) - 1, i0 + 1)
            frac = scaled - i0
            return (1 - frac) * setting[i0] + frac * setting[i1]
        for cond in setting:
            f = cond.get("filter")
            if f is None or f == "*" or (tensor_name and f in tensor_name):
                return evaluate(cond["value"], tensor_name, t)
        return None
    raise SymmergeError(f"unexpected parameter value {setting!r}")


def resolve(name: str, scopes, tensor_name: str, t: float):
    """The first value of ``name`` set in ``scopes`` (mappings, highest precedence first), or None."""
    for scope in scopes:
        if scope and name in scope:
            v = evaluate(scope[name], tensor_name, t)
            if v is not None:
                return v
    return None
