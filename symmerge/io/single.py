"""A single ``.safetensors`` file as a model input (as ``mergekit-pytorch`` takes them): the file's tensors,
under the config of a ``config.json`` beside it, else of a folder given with it (the base model of a merge, the
anchor of an alignment).

:func:`as_folder` gives a folder that holds the file (linked, never copied or modified) as ``model.safetensors``
and the small files the model needs — config.json, the tokenizer and the generation config — copied from the
file's own folder, else from ``config_from``. Every reader then sees an HF folder. The folder lives in the
system's temporary directory for the life of the process (one per file and config source)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import SymmergeError

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
              "tokenizer.model", "chat_template.jinja")
_VIEWS: dict = {}


def is_single_file(x) -> bool:
    """Whether ``x`` names a single ``.safetensors`` file (not a folder)."""
    return isinstance(x, (str, Path)) and str(x).endswith(".safetensors") and Path(x).is_file()


def as_folder(path, config_from=None) -> Path:
    """The folder view of the single file ``path`` (see the module); ``config_from``: a model folder whose
    config.json (and tokenizer) is used when the file has none beside it."""
    path = Path(path).resolve()
    own = path.parent
    source = own if (own / "config.json").is_file() else None
    if source is None and config_from is not None:
        cf = Path(config_from)
        cf = cf.parent if is_single_file(cf) else cf
        source = cf if (cf / "config.json").is_file() else None
    if source is None:
        raise SymmergeError(f"{path}: a single .safetensors file needs a config.json beside it, or a base model "
                            "(anchor) folder to take its config from")
    key = (str(path), str(source.resolve()))
    if key in _VIEWS and _VIEWS[key].is_dir():
        return _VIEWS[key]
    # "single-": a file named lora-16 must not give symmerge-lora-16-*, a gone process's LoRA merge cache to others
    view = Path(tempfile.mkdtemp(prefix=f"symmerge-single-{path.stem}-"))
    atexit.register(shutil.rmtree, view, True)
    os.symlink(path, view / "model.safetensors")
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, view / name)
    _VIEWS[key] = view
    return view


def folders(models, config_from=None) -> list:
    """``models`` with each single file replaced by its folder view (``config_from``: see :func:`as_folder`;
    default: the first input that is a folder)."""
    models = list(models)
    if config_from is None:
        config_from = next((m for m in models if isinstance(m, (str, Path)) and Path(m).is_dir()), None)
    return [as_folder(m, config_from) if is_single_file(m) else m for m in models]
