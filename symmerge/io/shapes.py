"""Every tensor checked against the model class ``config.json`` names — its shape, and that none is missing
and none is extra — in the streamed paths and in memory alike.

A streamed merge or alignment never builds the model, so a checkpoint whose safetensors headers state a
wrong shape (two inputs transposed the same way merge without complaint) would be written as a folder
``from_pretrained`` rejects; and in memory ``from_pretrained`` fills a missing tensor at random and drops an
extra one. :func:`expected_tensors` builds the config's class on the ``meta`` device (no memory, no weights)
and reads its state dict's shapes, its buffers (derived, never missing), the stored names of the tensors
transformers fuses in memory and the class's own ignore patterns; the facts of a config are cached with its
tensor names (:mod:`symmerge.io.names_cache`), so a cached read builds nothing. :func:`check_shapes` and
:func:`check_complete` compare a :class:`~symmerge.io.checkpoint.LazyCheckpoint` against them — the one
reader both paths use (:func:`symmerge.io.model.load_model` reads the headers through it before loading):
a difference is one error naming the tensors as the checkpoint does (:func:`refuse_incomplete`).

:func:`check_config_counts` runs before any of that, on the stored names alone: a ``config.json`` whose
layer count exceeds the layers the checkpoint stores, or whose hidden size is no dimension of any stored
tensor, is refused before its model is built (10 million layers would take minutes on ``meta``).
"""

from __future__ import annotations

import re

import torch

from ..errors import SymmergeError
from .hf import model_class, quiet_transformers


def _build(config: dict, cfg):
    import transformers

    cls = model_class(config)
    try:
        with quiet_transformers(), torch.device("meta"):
            return cls(cfg) if cls is not transformers.AutoModel else transformers.AutoModel.from_config(cfg)
    except Exception as e:
        raise SymmergeError(f"transformers cannot build a {config.get('model_type')} model from this config "
                            f"({type(e).__name__}: {e})") from None


def expected_tensors(config: dict, cfg, mapped=()) -> dict:
    """What the model ``config`` describes (``cfg``: its transformers config) holds: ``shapes`` {state-dict
    name: shape}, ``buffers`` (every buffer's name: derived, persistent or not, never missing), ``stored``
    {in-memory name: the names save_pretrained splits it into} for the tensors not stored one to one (the
    in-memory names ``mapped`` are), and the class's ``ignore_missing`` / ``ignore_unexpected`` patterns."""
    from .fused import _revert

    model = _build(config, cfg)
    sd = model.state_dict()
    mapped, stored = set(mapped), {}
    for k, t in sd.items():
        if k in mapped:
            continue
        try:
            names = sorted(_revert(model, k, torch.empty(t.shape, device="meta")))
        except Exception:  # no conversion: stored under its own name
            continue
        if names and names != [k]:
            stored[k] = names
    cls = type(model)
    return {"shapes": {k: [int(d) for d in v.shape] for k, v in sd.items()},
            "buffers": sorted(n for n, _ in model.named_buffers()), "stored": stored,
            "ignore_missing": list(getattr(cls, "_keys_to_ignore_on_load_missing", None) or []),
            "ignore_unexpected": list(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])}


def expected_shapes(config: dict, cfg) -> dict[str, list[int]]:
    """{state-dict name: shape} of the model ``config`` describes (``cfg``: its transformers config)."""
    return expected_tensors(config, cfg)["shapes"]


def check_shapes(ckpt, expected: dict) -> None:
    """Every tensor of ``ckpt`` the config's class has is of the class's shape, else one error."""
    if not expected:
        return
    for key, shape in ckpt.shape.items():
        want = expected.get(key)
        if want is not None and tuple(want) != tuple(shape):
            name = ckpt.disk_name.get(key, key)
            raise SymmergeError(f"{ckpt.folder}: tensor {name!r} is {tuple(shape)} in the checkpoint, but its "
                                f"config.json ({ckpt.class_name}) makes it {tuple(want)}: a mismatched or corrupt "
                                "checkpoint (transformers would refuse to load it)")


def check_dtypes(ckpt, expected: dict, buffers=()) -> None:
    """Every weight of the config's class (a tensor of its state dict, not a buffer) stored in a floating-point
    dtype, else one error: an integer weight (a quantized or corrupt checkpoint) was cast to float by transformers
    when loaded, and read as it is from the files, so memory and disk gave two models."""
    if not expected:
        return
    skip = set(buffers or ())
    for key, dtype in ckpt.dtype.items():
        if key in expected and key not in skip and not dtype.is_floating_point:
            name = ckpt.disk_name.get(key, key)
            raise SymmergeError(f"{ckpt.folder}: tensor {name!r} is stored as {str(dtype).removeprefix('torch.')}, "
                                f"but its config.json ({ckpt.class_name}) makes it a floating-point weight: a "
                                "quantized or corrupt checkpoint (symmerge reads floating-point weights)")


def _names(names, limit: int = 3) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def refuse_incomplete(folder, class_name: str, missing=(), extra=()) -> None:
    """The one error for a checkpoint whose tensors are not its config's (names as stored on disk), in every
    path: nothing is ever initialised at random, nothing dropped silently."""
    if missing:
        raise SymmergeError(f"{folder}: the checkpoint lacks {len(missing)} tensor(s) its config.json ({class_name}) "
                            f"has: {_names(missing)} — a truncated or mismatched checkpoint (symmerge never fills a "
                            "tensor at random)")
    if extra:
        raise SymmergeError(f"{folder}: the checkpoint holds {len(extra)} tensor(s) its config.json ({class_name}) "
                            f"has no place for: {_names(extra)} — a mismatched checkpoint (symmerge never drops a "
                            "tensor silently)")


def _matches(key: str, patterns) -> bool:
    return any(re.search(p, key) for p in patterns)


def check_complete(ckpt, expected: dict, stored_names) -> None:
    """No tensor of the config's class is missing from ``ckpt`` (declared ties and buffers aside: a tie's
    alias is its source, a buffer is derived) and ``ckpt`` holds no tensor the class has no place for
    (``stored_names``: the in-memory names the checkpoint's files hold before ties were folded and fused
    tensors assembled)."""
    shapes = expected.get("shapes")
    if not shapes:
        return
    buffers, fused = set(expected.get("buffers", ())), expected.get("stored", {})
    parts = {n for names in fused.values() for n in names}
    present = set(ckpt.shape)
    known = set(shapes) | buffers | parts | set(ckpt.ties)
    extra = [ckpt.disk_name.get(k, k) for k in stored_names
             if k not in known and not _matches(k, expected.get("ignore_unexpected", ()))]
    missing = []
    for k in shapes:
        if k in present or k in buffers or _matches(k, expected.get("ignore_missing", ())):
            continue
        if k in ckpt.ties and ckpt.ties[k] in present:
            continue
        if k in fused and any(n in present for n in fused[k]):  # stored split: name the parts it lacks
            missing += [n for n in fused[k] if n not in present]
            continue
        missing.append(ckpt.save_name(k))
    refuse_incomplete(ckpt.folder, ckpt.class_name, missing, extra)


# the main stack's layer count under its usual names (a stack's own count, such as T5's num_decoder_layers, may
# describe a stack the class does not build: T5EncoderModel)
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
HIDDEN_SIZES = ("hidden_size", "n_embd", "d_model")  # and DistilBERT's top-level "dim"
_NUMBERED = re.compile(r"(?:^|\.)(?:layers?|h|blocks?)\.(\d+)\.")


def _config_values(config: dict, keys, depth: int = 0):
    """(path, value) of every integer ``keys`` entry of ``config`` and its sub-configs (dicts)."""
    for k, v in config.items():
        if k in keys and isinstance(v, int) and not isinstance(v, bool):
            yield k, v
        elif isinstance(v, dict) and depth < 4:
            yield from ((f"{k}.{p}", x) for p, x in _config_values(v, keys, depth + 1))


def check_config_counts(folder, config: dict, shapes: dict) -> None:
    """``config.json`` cross-checked against the stored tensors ``shapes`` ({stored name: shape}) before any
    model is built from it: no layer count above the layers stored (the largest index of a numbered layer
    stack, ``layers.N.`` / ``h.N.`` / ``block.N.``, plus one), and every hidden size a dimension of some
    stored tensor."""
    if not shapes:
        return
    indices = [int(m) for name in shapes for m in _NUMBERED.findall(name)]
    if indices:
        stored = max(indices) + 1
        for key, value in _config_values(config, LAYER_COUNTS):
            if value > stored:
                raise SymmergeError(f"{folder}: config.json says {key}={value}, but the checkpoint stores "
                                    f"{stored} layer(s): a mismatched config.json")
    dims = {int(d) for s in shapes.values() for d in s}
    top = [("dim", config["dim"])] if isinstance(config.get("dim"), int) else []
    for key, value in [*_config_values(config, HIDDEN_SIZES), *top]:
        if value > 0 and value not in dims:
            raise SymmergeError(f"{folder}: config.json says {key}={value}, but no tensor of the checkpoint has a "
                                "dimension of that size: a mismatched config.json")
