"""The one reader of model folders, in memory and streamed: :func:`load_model` reads a safetensors folder's
headers through :class:`~symmerge.io.checkpoint.LazyCheckpoint` — the streamed paths' reader, with its checks
(config.json against the stored tensors, shard indexes confined to the folder, every tensor's shape, none
missing, none extra: :mod:`symmerge.io.shapes`) — before transformers builds anything, then loads the model
(:func:`symmerge.io.model.load_model`, which refuses what transformers itself reports it filled at random or
dropped: a pickle checkpoint has no headers to read first). The same bad checkpoint gets the same one-line error
whichever path reads it."""

from __future__ import annotations

from pathlib import Path

from . import model as _model
from .checkpoint import LazyCheckpoint


def load_model(path, allow_pickle: bool = False, device: str = "cpu", spec: bool = True):
    """:func:`symmerge.io.model.load_model` after the headers' checks (safetensors folders)."""
    path = Path(path)
    config = _model.read_config(path, spec=spec)  # an unsupported model type first, as before
    files, safe = _model.weight_files(path, allow_pickle)
    from .hf import _known_model_type

    # a model with its own code (--trust-remote-code): no transformers class describes its tensors before its
    # code runs, so its headers cannot be checked first; transformers' loading report is checked after
    if safe and _known_model_type(config.get("model_type")):
        LazyCheckpoint(path, spec=False)
    return _model.load_model(path, allow_pickle=allow_pickle, device=device, spec=spec)
