"""transformers glue every io module shares: the model class a config names, its config object, the
tensor names a checkpoint uses against the loaded model's, and silencing transformers' own output."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from ..core.resolve import declared_ties
from ..errors import SymmergeError


def model_class(config: dict):
    """The transformers class named by the config's ``architectures`` (AutoModel if absent)."""
    import transformers

    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' warnings and its 'Loading weights' / 'Writing model shards' bars on
    stderr (symmerge reports errors itself), restoring both settings afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def hf_config(config: dict):
    """The transformers config object of a config.json dict (its class knows aliases such as GPT-2's
    ``n_head`` for ``num_attention_heads``)."""
    import transformers

    cls = model_class(config)
    cfg_cls = getattr(cls, "config_class", None) or transformers.AutoConfig
    if cfg_cls is transformers.AutoConfig:
        return transformers.AutoConfig.for_model(**config)
    return cfg_cls.from_dict(dict(config))


def disk_to_memory_names(config: dict, cfg=None, fused: bool = False) -> tuple:
    """(checkpoint tensor name → the model's ``state_dict`` name, the model's declared ties
    ``{alias: source}``). transformers 5 renames some families' weights on load and back on save
    (ViT: ``encoder.layer.0.attention.attention.query`` on disk is ``layers.0.attention.q_proj`` in
    memory); the specs use the in-memory names. Derived from transformers' own reverse conversion
    applied to a weightless (``meta``) model, whose class also declares the ties. ``fused``: a third item,
    the in-memory tensors stored as several tensors (:func:`symmerge.io.fused.fused_parts`)."""
    import transformers

    cls = model_class(config)
    try:
        with quiet_transformers():
            cfg = hf_config(config) if cfg is None else cfg
            with torch.device("meta"):
                model = cls(cfg) if cls is not transformers.AutoModel else transformers.AutoModel.from_config(cfg)
            rename = disk_to_memory(model)
            if fused:
                from .fused import fused_parts

                parts = fused_parts(model, rename.values())
    except SymmergeError:
        raise
    except Exception as e:
        raise SymmergeError(f"transformers cannot build a {config.get('model_type')} model from this config "
                            f"({type(e).__name__}: {e})") from None
    if fused:
        return rename, declared_ties(model), parts
    return rename, declared_ties(model)


def disk_to_memory(model) -> dict[str, str]:
    """{name in a checkpoint ``save_pretrained`` writes: ``state_dict`` name} of a transformers model."""
    from transformers.core_model_loading import revert_weight_conversion

    sd = model.state_dict()
    reverted = revert_weight_conversion(model, sd)
    names_of: dict[int, str] = {}
    for k, t in sd.items():
        names_of.setdefault(id(t), k)
    return {disk: names_of[id(t)] for disk, t in reverted.items() if id(t) in names_of}


class DiskNames(Mapping):
    """A loaded model's ``{state_dict name: name in its checkpoint}``, worked out on first use (error
    messages name tensors as the user's checkpoint does: ViT's ``layers.0.mlp.fc1.weight`` in memory is
    ``vit.encoder.layer.0.intermediate.dense.weight`` on disk)."""

    def __init__(self, model):
        self._model, self._names = model, None

    def _table(self) -> dict:
        if self._names is None:
            try:
                self._names = {m: d for d, m in disk_to_memory(self._model).items()}
            except Exception:  # messages fall back to the in-memory names
                self._names = {}
        return self._names

    def __getitem__(self, key):
        return self._table()[key]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())


def attention_heads(config):
    """The attention-head count(s) a layout check compares: the config's ``num_attention_heads``, or — for a
    config made of sub-configs without one of its own (CLIP: ``text_config``, ``vision_config``) — a tuple of
    ``(sub-config, heads)``; None when the model has no attention heads."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None:
        return heads
    subs = tuple((name, getattr(getattr(config, name, None), "num_attention_heads", None))
                 for name in sorted(getattr(type(config), "sub_configs", {}) or {}))
    subs = tuple((name, h) for name, h in subs if h is not None)
    return subs or None


def is_conv1d(module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear layer whose weight is stored in × out."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def linear_output_axis(module) -> int | None:
    """The weight axis of a linear layer's outputs: 0 for an ``nn.Linear``, 1 for a ``Conv1D``; else None."""
    if isinstance(module, torch.nn.Linear):
        return 0
    return 1 if is_conv1d(module) else None
