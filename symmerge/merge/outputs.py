"""Results checked before they are written, in both wings (the executor's merging thread, and the in-memory
methods that keep their own loop: statistics and the architecture's):

* a non-finite merged tensor is an error naming the tensor and the arguments that made it (``--param
  lambda=1e300`` overflows a task vector to Inf): nothing is written;
* a merged tensor that is all zeros while its inputs are not, or whose norm is far outside its inputs'
  range (:data:`FAR`), is a warning: a line in the log and an entry of the report's ``result_warnings``.

The norms are estimated from an evenly strided sample of :data:`SAMPLE` entries of each tensor, enough for a
factor of :data:`FAR` (a sample of zeros is confirmed on the whole result). Finiteness needs every entry: with
``full`` one pass over the result (its norm, finite exactly when every entry is, unless the squares overflow:
then the entries are checked); the streamed executor passes ``full=False`` and checks the distances it measures
anyway (:func:`refuse_non_finite` when one is not finite: a non-finite result makes them so), so the streamed
merge spends no extra pass.
"""

from __future__ import annotations

import math

import torch

from ..errors import SymmergeError

FAR = 100.0  # a result norm more than this factor above the largest input norm, or below the smallest, is far
SAMPLE = 1 << 14  # entries of each input sampled for its norm


def _wide(t: torch.Tensor):
    """float32 accumulation, float64 for float64 tensors (a norm may not narrow its input)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _rms(t: torch.Tensor) -> float:
    flat = t.reshape(-1)
    if flat.numel() > SAMPLE:
        flat = flat[:: flat.numel() // SAMPLE]
    # float64: a float32 sum of squares of values near 1e20 overflowed, and a finite result warned "rms inf"
    return float(torch.linalg.vector_norm(flat, dtype=torch.float64)) / math.sqrt(max(flat.numel(), 1))


def describe_arguments(method, params, weights) -> str:
    """The arguments a merged tensor was made with, those that differ from the method's defaults (for the
    error; an alias is named by its parameter: ``lambda`` is ``scale``)."""
    defaults = getattr(method, "params", None) or {}
    given = ", ".join(f"{k}={v!r}" for k, v in sorted(dict(params or {}).items())
                      if k not in defaults or defaults[k] != v)
    text = f"method {method.name!r}" + (f" with {given}" if given else "")
    return text + (f", weights {list(weights)}" if weights is not None else "")


def refuse_non_finite(name: str, value: torch.Tensor, method, params, weights=None) -> None:
    """One error naming the merged tensor ``name`` and the arguments (``params`` as given, ``weights``) when
    ``value`` holds NaN or Inf."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = "NaN" if bool(torch.isnan(value).any()) else "Inf"
        why = "a parameter or weight out of range"
        if value.dtype == torch.float16:  # the inputs are finite: the method's half arithmetic can overflow
            why += (", or the method's float16 arithmetic past float16's largest value (65504): merge in float32 "
                    "(a config's dtype: float32, or float32 copies of the inputs)")
        raise SymmergeError(f"the merged tensor {name!r} holds {bad} values "
                            f"({describe_arguments(method, params, weights)}): {why}; nothing was written")


def check_result(name: str, value: torch.Tensor, inputs, method, params, weights=None,
                 full: bool = True) -> dict | None:
    """Refuse a non-finite merged tensor ``value`` of output ``name`` (with ``full``; one error naming it and the
    arguments: ``params`` as given, ``weights``); return a warning entry (``{"tensor", "warning", "rms",
    "inputs_rms"}``) when it is all zeros while some input is not, or its norm is far outside its ``inputs``'
    range; else None."""
    if not value.is_floating_point() or value.numel() == 0:
        return None
    if full:
        norm = float(torch.linalg.vector_norm(value.reshape(-1), dtype=_wide(value)))
        if not math.isfinite(norm):
            refuse_non_finite(name, value, method, params, weights)
    ranges = [_rms(t) for t in inputs if t is not None and t.is_floating_point()]
    if not ranges:
        return None
    lo, hi = min(ranges), max(ranges)
    rms = _rms(value)
    if rms == 0.0 and hi > 0.0 and not bool(value.any()):
        return {"tensor": name, "warning": "all zeros (its inputs are not)", "rms": 0.0, "inputs_rms": [lo, hi]}
    if rms > FAR * hi or (lo > 0.0 and rms * FAR < lo):
        return {"tensor": name, "warning": f"norm far outside its inputs' range (rms {rms:.3g}, inputs "
                                           f"{lo:.3g}…{hi:.3g})", "rms": rms, "inputs_rms": [lo, hi]}
    return None
