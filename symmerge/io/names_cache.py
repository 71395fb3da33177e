"""What a checkpoint's config implies about its tensor names, cached on disk per transformers version.

A streamed merge never builds a model, yet it must know how the checkpoint's tensor names map to the
model's ``state_dict`` names, which weights the class ties, its base-model prefix and head counts. All
of it comes from a weightless model of the config's class (:func:`symmerge.io.hf.disk_to_memory_names`),
and importing transformers' modeling stack to build one is most of a small merge's time (1.5–2.5 s of
the 5.8 s of averaging two SmolLM2-135M). These facts depend only on the config and the transformers
version, so they are kept in ``~/.cache/symmerge/names/`` (``$SYMMERGE_CACHE_DIR/names`` if set), one
JSON file per (transformers version, symmerge version, config), written atomically; an unreadable entry
is rebuilt. ``SYMMERGE_NAME_CACHE=0`` turns the cache off. Facts that do not serialise (the fused
experts' split of a mixture of experts) are never cached: those checkpoints build the model each time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("SYMMERGE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "symmerge") / "names"


def _enabled() -> bool:
    return os.environ.get("SYMMERGE_NAME_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def _transformers_version() -> str:
    """The installed transformers' version, read once per process (a merge of N models asks once per model and
    document; each read walks the installed distributions)."""
    from importlib.metadata import version

    return version("transformers")


def _key(config: dict, fused: bool) -> str:
    from .._version import __version__

    text = json.dumps([_transformers_version(), __version__, bool(fused), config], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _heads_from_json(value):
    """attention_heads' value back from JSON (a tuple of (sub-config, heads) pairs was a list of lists)."""
    if isinstance(value, list):
        return tuple((str(name), int(h)) for name, h in value)
    return value


_KEPT = ("rename", "ties", "class", "prefix", "heads", "shapes", "tensors")


def facts(config: dict, fused: bool, build) -> dict:
    """``build()``'s facts for ``config`` (a dict with ``rename``, ``ties``, ``parts``, ``class``,
    ``prefix``, ``heads``, ``shapes``: the class's tensor shapes, and ``tensors``: its buffers, fused tensors and
    ignore patterns, :mod:`symmerge.io.shapes`), from the
    cache when an entry exists, else built and cached (when
    ``parts`` is empty). The returned dict also says ``cached``: whether it came from the cache."""
    path = cache_dir() / f"{_key(config, fused)}.json" if _enabled() else None
    if path is not None and path.is_file():
        try:
            entry = json.loads(path.read_text())
            if set(entry) >= set(_KEPT):
                return {**entry, "parts": {}, "heads": _heads_from_json(entry["heads"]), "cached": True}
        except (OSError, ValueError):
            pass  # rebuilt below
    out = build()
    if path is not None and not out.get("parts"):
        entry = {k: out[k] for k in _KEPT}
        try:
            text = json.dumps(entry)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError):
            pass  # a cache that cannot be written is no cache
    return {**out, "cached": False}
