"""Method parameters (``--param KEY=VALUE``, a config's ``parameters``) checked where they are parsed: an
unknown name, a value of the wrong kind or out of its range is one error naming the parameter, before the
output is checked or anything is loaded. The checks are the method's own (:class:`symmerge.merge.base.Check`,
applied by :meth:`~symmerge.merge.base.Method.check_params`); this only runs them at parse time."""

from __future__ import annotations


def check_param_values(method_name: str, params: dict) -> dict:
    """``params`` as parsed (numbers, true/false, words), checked by ``method_name``'s own parameter checks
    (:class:`~symmerge.errors.SymmergeError` on the first bad one); returns ``params`` unchanged."""
    from . import get_method

    get_method(method_name).check_params(dict(params))
    return params
