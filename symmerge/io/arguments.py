"""The public entries' checks of what they were given as models and as an output folder: a wrong type (None, a
list where one model goes, a state dict, one model where a list goes) is one :class:`~symmerge.errors.UsageError`
naming the argument, before any work, rather than an ``AttributeError`` from deep inside the alignment."""

from __future__ import annotations

import os

import torch

from ..errors import UsageError, unexpected_keyword
from .finite import check_finite

MODEL_KINDS = "a Hugging Face model folder (str or Path) or a transformers model (torch.nn.Module)"


def _is_model(x) -> bool:
    return isinstance(x, (str, os.PathLike, torch.nn.Module))


def _hint(x) -> str:
    if isinstance(x, dict):
        return " (a state dict: load it into its transformers model first, model.load_state_dict(sd))"
    if isinstance(x, (list, tuple)):
        return " (one model here; merge_models and symmerge.merge take a list)"
    return ""


def utf8_path(path) -> bool:
    """Whether ``path`` (str or PathLike) is valid UTF-8: the file system takes any bytes, but the reports and model
    cards that name a path are UTF-8 text and safetensors opens UTF-8 paths only."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def utf8_checked(x, name: str):
    """``x``; a path (str or PathLike) that is no UTF-8 is one error naming ``name``."""
    if isinstance(x, (str, os.PathLike)) and not utf8_path(x):
        raise UsageError(f"{name} {os.fsencode(x)!r}: the path is not valid UTF-8 (symmerge names its inputs and "
                         "output in UTF-8 reports and model cards): rename it")
    return x


def model_argument(x, name: str = "model"):
    """``x`` when it is a model the library reads (:data:`MODEL_KINDS`; a path in UTF-8), else one error naming
    ``name``. A model given in memory is checked as a folder is when it is loaded: a NaN or Inf weight is one
    error naming ``name`` and the tensor (it reached the solvers, which failed deep inside or carried the NaN)."""
    if not _is_model(x):
        raise UsageError(f"{name} must be {MODEL_KINDS}, got {type(x).__name__}{_hint(x)}")
    if isinstance(x, torch.nn.Module):
        with torch.no_grad():
            check_finite(x.state_dict(), f"{name} (in memory)")
    return utf8_checked(x, name)


def models_argument(models, name: str = "models") -> list:
    """``models`` (a list or tuple of models, :func:`model_argument` each) as a list, else one error."""
    if not isinstance(models, (list, tuple)):
        one = " (one model: give a list of the models to merge)" if _is_model(models) else ""
        raise UsageError(f"{name} must be a list of models ({MODEL_KINDS} each), got {type(models).__name__}{one}")
    return [model_argument(m, f"{name}[{i}]") for i, m in enumerate(models)]


def output_argument(out, name: str = "out"):
    """``out`` when it names a folder (str or Path, in UTF-8), else one error."""
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise UsageError(f"{name} must be the output folder's path (str or Path), got {out!r}")
    return utf8_checked(out, name)


def _modules_in(values) -> list:
    """The ``torch.nn.Module`` s among ``values``, inside lists and tuples and an options object's fields too."""
    import dataclasses

    found = []
    for v in values:
        if isinstance(v, torch.nn.Module):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += _modules_in(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            found += _modules_in([getattr(v, f.name) for f in dataclasses.fields(v)])
    return found


def _held(model) -> list:
    """Every module of ``model`` with what a call could change in it: its train/eval flag, its parameter objects
    (each with its tensor, its gradient and the gradient's tensor, ``requires_grad``) and its buffers."""
    return [(m, m.training, dict(m._parameters),
             {k: (p.data, p.grad, None if p.grad is None else p.grad.data, p.requires_grad)
              for k, p in m._parameters.items() if p is not None},
             dict(m._buffers)) for m in model.modules()]


def _put_back(t: torch.Tensor, data: torch.Tensor) -> None:
    if t.data.data_ptr() != data.data_ptr() or t.device != data.device or t.dtype != data.dtype \
            or t.shape != data.shape:
        t.data = data


def _restore(held: list) -> None:
    """Put back what :func:`_held` noted: a ``.to(device)`` or ``.to(dtype)`` inside a call (which moves a module
    in place, giving its parameters new tensors or new parameter objects) is undone at no cost, the very tensors
    being kept."""
    for m, mode, params, tensors, buffers in held:
        m.training = mode
        for k, p in params.items():
            if m._parameters.get(k) is not p:
                m._parameters[k] = p
            if p is None:
                continue
            data, grad, grad_data, requires_grad = tensors[k]
            _put_back(p, data)
            if grad is not None:
                _put_back(grad, grad_data)
            if p.grad is not grad:
                p.grad = grad
            if p.requires_grad != requires_grad:
                p.requires_grad_(requires_grad)
        for k, b in buffers.items():
            if m._buffers.get(k) is not b:
                m._buffers[k] = b


def arguments_bind(fn, args, kwargs) -> None:
    """``fn(*args, **kwargs)``'s arguments checked against its signature before it runs: a misspelt keyword is one
    :class:`UsageError` (a ``TypeError`` too) naming the closest parameter (``align_pair(symetries=...)`` was Python's
    bare TypeError), a missing or surplus argument Python's words as a UsageError."""
    import inspect

    signature = inspect.signature(fn)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        params = signature.parameters
        takes_any = any(str(p).startswith("**") for p in params.values())  # a **keywords parameter
        unknown = None if takes_any else next((k for k in kwargs if k not in params), None)
        if unknown is not None:
            error = unexpected_keyword(f"{fn.__name__}()", unknown, [k for k in params if not k.startswith("_")])
            if "options" in params and "did you mean" not in str(error):  # align_pair(symmetries=...)
                error = UsageError(f"{error} (an option of the alignment goes in options=AlignOptions(...))")
            raise error from None
        raise UsageError(f"{fn.__name__}(): {e}") from None


def keeps_models(fn):
    """``fn`` leaving the models it is given as they came, even when it raises: every module's train/eval mode
    (evaluation and verification switch a model to eval mode), and every parameter and buffer where it was — the
    same tensor on the same device in the same dtype (statistics and evaluation move a model to ``device`` with
    ``.to``, which moves the caller's own module in place; a model on a GPU evaluated on the CPU came back on the
    CPU). It computes under torch's default autograd modes whatever the caller's (a ``torch.no_grad()`` or
    ``torch.inference_mode()`` around the call: Fisher's statistics and the learned alignment take gradients), and
    the caller's modes are back after it."""
    import functools

    @functools.wraps(fn)
    def kept(*args, **kwargs):
        arguments_bind(fn, args, kwargs)
        seen, held = set(), []
        for model in _modules_in([*args, *kwargs.values()]):
            if id(model) not in seen:
                seen.add(id(model))
                held += _held(model)
        try:
            with torch.inference_mode(False), torch.enable_grad():
                return fn(*args, **kwargs)
        finally:
            _restore(held)

    return kept


def flag_arguments(**flags) -> None:
    """Each of ``flags`` (an entry's ``stream=``, ``allow_pickle=``...) True or False, else one error naming it (a
    string such as ``"no"`` would read as true)."""
    wrong = next((name for name, value in flags.items() if not isinstance(value, bool)), None)
    if wrong is not None:
        raise UsageError(f"{wrong} must be True or False, got {flags[wrong]!r}")
