"""The public entries' checks of what they were given as models and as an output folder: a wrong type (None, a
list where one model goes, a state dict, one model where a list goes) is one :class:`~symmerge.errors.UsageError`
naming the argument, before any work, rather than an ``AttributeError`` from deep inside the alignment."""

from __future__ import annotations

import os

import torch

from ..errors import UsageError

MODEL_KINDS = "a Hugging Face model folder (str or Path) or a transformers model (torch.nn.Module)"


def _is_model(x) -> bool:
    return isinstance(x, (str, os.PathLike, torch.nn.Module))


def _hint(x) -> str:
    if isinstance(x, dict):
        return " (a state dict: load it into its transformers model first, model.load_state_dict(sd))"
    if isinstance(x, (list, tuple)):
        return " (one model here; merge_models and symmerge.merge take a list)"
    return ""


def model_argument(x, name: str = "model"):
    """``x`` when it is a model the library reads (:data:`MODEL_KINDS`), else one error naming ``name``."""
    if not _is_model(x):
        raise UsageError(f"{name} must be {MODEL_KINDS}, got {type(x).__name__}{_hint(x)}")
    return x


def models_argument(models, name: str = "models") -> list:
    """``models`` (a list or tuple of models, :func:`model_argument` each) as a list, else one error."""
    if not isinstance(models, (list, tuple)):
        one = " (one model: give a list of the models to merge)" if _is_model(models) else ""
        raise UsageError(f"{name} must be a list of models ({MODEL_KINDS} each), got {type(models).__name__}{one}")
    return [model_argument(m, f"{name}[{i}]") for i, m in enumerate(models)]


def output_argument(out, name: str = "out"):
    """``out`` when it names a folder (str or Path), else one error."""
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise UsageError(f"{name} must be the output folder's path (str or Path), got {out!r}")
    return out


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


def keeps_modes(fn):
    """``fn`` leaving the models it is given in the train/eval mode they came in, module by module (evaluation and
    verification switch a model to eval mode; a caller's model in train mode would be left in eval mode)."""
    import functools

    @functools.wraps(fn)
    def kept(*args, **kwargs):
        modules = [m for model in _modules_in([*args, *kwargs.values()]) for m in model.modules()]
        modes = [m.training for m in modules]
        try:
            return fn(*args, **kwargs)
        finally:
            for m, mode in zip(modules, modes):
                m.training = mode

    return kept


def flag_arguments(**flags) -> None:
    """Each of ``flags`` (an entry's ``stream=``, ``allow_pickle=``...) True or False, else one error naming it (a
    string such as ``"no"`` would read as true)."""
    wrong = next((name for name, value in flags.items() if not isinstance(value, bool)), None)
    if wrong is not None:
        raise UsageError(f"{wrong} must be True or False, got {flags[wrong]!r}")
