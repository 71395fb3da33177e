"""What a checkpoint's config implies about its tensor names, cached on disk per transformers version.

A streamed merge never builds a model, yet it must know how the checkpoint's tensor names map to the
model's ``state_dict`` names, which weights the class ties, its base-model prefix and head counts. All
of it comes from a weightless model of the config's class (:func:`symmerge.io.hf.disk_to_memory_names`),
and importing transformers' modeling stack to build one is most of a small merge's time (1.5–2.5 s of
the 5.8 s of averaging two SmolLM2-135M). These facts depend only on the config and the transformers
version, so they are kept in the cache's ``names/`` folder (``$SYMMERGE_CACHE/names``, else
``~/.cache/symmerge/names``: :func:`symmerge.io.cache.cache_root`), one JSON file per (transformers version, symmerge
version, config), written atomically; an unreadable or malformed entry is rebuilt, and a cache that cannot be found or
written is no cache (the facts are built each time). ``SYMMERGE_NAME_CACHE=0`` turns the cache off.
``$SYMMERGE_CACHE_DIR`` (the tests' hook: their own name cache, the real data caches left where they are) moves this
folder alone to ``$SYMMERGE_CACHE_DIR/names``. Facts that do not serialise (the fused
experts' split of a mixture of experts) are never cached: those checkpoints build the model each time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path | None:
    """The entries' folder; None without a cache root (no ``$SYMMERGE_CACHE`` and no home folder)."""
    from ..errors import SymmergeError
    from .cache import cache_root

    root = os.environ.get("SYMMERGE_CACHE_DIR", "").strip()
    try:
        return (Path(root).expanduser() if root else cache_root()) / "names"
    except SymmergeError:
        return None


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


def read_entry(name: str) -> dict | None:
    """The cached entry ``name`` (a JSON object), or None: the cache off or missing, no such entry, or one that
    does not read as an object (it is then written again by :func:`write_entry`)."""
    folder = cache_dir() if _enabled() else None
    if folder is None:
        return None
    try:
        entry = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def write_entry(name: str, entry: dict) -> None:
    """Cache ``entry`` as ``name`` (a temporary file of this process's, then one rename: two processes writing the
    same entry at once each publish a complete file); a cache that cannot be written is no cache."""
    folder = cache_dir() if _enabled() else None
    if folder is None:
        return
    path = folder / name
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        text = json.dumps(entry)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def facts(config: dict, fused: bool, build) -> dict:
    """``build()``'s facts for ``config`` (a dict with ``rename``, ``ties``, ``parts``, ``class``,
    ``prefix``, ``heads``, ``shapes``: the class's tensor shapes, and ``tensors``: its buffers, fused tensors and
    ignore patterns, :mod:`symmerge.io.shapes`), from the
    cache when an entry exists, else built and cached (when
    ``parts`` is empty). The returned dict also says ``cached``: whether it came from the cache."""
    name = f"{_key(config, fused)}.json"
    entry = read_entry(name)
    if entry is not None and set(entry) >= set(_KEPT):
        return {**entry, "parts": {}, "heads": _heads_from_json(entry["heads"]), "cached": True}
    out = build()
    if not out.get("parts"):
        write_entry(name, {k: out[k] for k in _KEPT})
    return {**out, "cached": False}
