"""The layer template of a checkpoint, from its config.json and safetensors headers only (no weights read).

A model's tensors are the ones before its stack of layers (embeddings), the layers ``PREFIX{i}.SUFFIX`` for
i in 0 … L−1 (L from config.json) and the ones after (final norm, LM head). A slice of layers ``[a, b)`` of
a model maps output layer j to input layer a + (j − offset) by rewriting the index in the name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SymmergeError

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# tensors outside the layers that come before them (the rest come after): mergekit's pre_weights
PRE_MARKERS = ("embed", "wte", "wpe", "word_embeddings", "position_embeddings", "tok_embeddings", "emb_ln",
               "rotary_emb")
_INDEX = re.compile(r"^(.*?\.)(\d+)(\..+)$")


@dataclass
class Layout:
    """Tensor names (in-memory naming) with shapes and dtypes, and the layer template."""

    folder: str
    config: dict
    shapes: dict
    dtypes: dict
    layers: int
    layer_key: str | None
    prefix: str = ""
    suffixes: tuple = ()
    pre: tuple = ()
    post: tuple = field(default_factory=tuple)
    optional: tuple = ()  # layer suffixes only some layers hold (a module of symmerge.config.modules)
    # layers of several kinds (a dense FFN among mixtures of experts: Qwen2-MoE's mlp_only_layers): each layer's
    # suffixes, which a slice must keep in place (); () when every layer holds the same tensors
    layer_sets: tuple = ()

    def layer_name(self, i: int, suffix: str) -> str:
        return f"{self.prefix}{i}{suffix}"


def num_layers(config: dict) -> tuple[int | None, str | None]:
    for k in LAYER_KEYS:
        if isinstance(config.get(k), int):
            return config[k], k
    text = config.get("text_config")
    if isinstance(text, dict):
        for k in LAYER_KEYS:
            if isinstance(text.get(k), int):
                return text[k], None
    return None, None


def from_names(folder, config: dict, shapes: dict, dtypes: dict) -> Layout:
    """The layout of a model whose tensors are ``shapes`` (name → shape) and ``dtypes``."""
    layers, key = num_layers(config)
    if not layers:
        raise SymmergeError(f"{folder}: config.json gives no layer count ({', '.join(LAYER_KEYS)})")
    by_prefix: dict[str, dict[int, set]] = {}
    for name in shapes:
        m = _INDEX.match(name)
        if m:
            by_prefix.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add(m.group(3))
    prefix = next((p for p, idx in by_prefix.items() if set(idx) == set(range(layers))), None)
    if prefix is None:
        raise SymmergeError(f"{folder}: cannot find its {layers} layers in the tensor names (no NAME.{{i}}.… for "
                            f"i = 0 … {layers - 1})")
    stack = by_prefix[prefix]
    per = [frozenset(stack[i]) for i in range(layers)]
    common = frozenset.intersection(*per)
    mixed = any(p != per[0] for p in per)
    rest = [n for n in shapes if not (n.startswith(prefix) and _INDEX.match(n) and _INDEX.match(n).group(1) == prefix)]
    pre = tuple(sorted(n for n in rest if any(m in n for m in PRE_MARKERS)))
    post = tuple(sorted(n for n in rest if n not in pre))
    return Layout(str(folder), config, dict(shapes), dict(dtypes), layers, key, prefix, tuple(sorted(common)), pre,
                  post, tuple(sorted(frozenset.union(*per) - common)), tuple(per) if mixed else ())


def layer_kind(lay: Layout, i: int) -> frozenset | None:
    """The suffixes layer ``i`` of ``lay`` holds, or None past its layers."""
    if not 0 <= i < lay.layers:
        return None
    return lay.layer_sets[i] if lay.layer_sets else frozenset(lay.suffixes + lay.optional)


def read_names(folder, ckpt=None) -> tuple[dict, dict, dict]:
    """(config.json, tensor name → shape, tensor name → dtype name) of the HF folder ``folder``: its config.json
    and safetensors headers (``ckpt``: its :class:`~symmerge.io.checkpoint.LazyCheckpoint`, already read)."""
    from ..io.checkpoint import LazyCheckpoint

    ckpt = ckpt if ckpt is not None else LazyCheckpoint(Path(folder), spec=False)
    dtypes = {k: str(v).replace("torch.", "") for k, v in ckpt.dtype.items()}
    return dict(ckpt.config), dict(ckpt.shape), dtypes


def read_layout(folder) -> Layout:
    """The layout of the HF folder ``folder``: its config.json and safetensors headers."""
    return from_names(folder, *read_names(folder))

