"""transformers glue every io module shares: the model class a config names, its config object, the
tensor names a checkpoint uses against the loaded model's, and silencing transformers' own output."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from ..core.resolve import declared_ties
from ..errors import RemoteCodeError, SymmergeError
from .arguments import flag_arguments


_REMOTE_CODE = [False]  # process-wide: loads may run in worker threads, which a ContextVar would not reach
REMOTE_CODE_FLAG = "--trust-remote-code"


def remote_code_allowed() -> bool:
    """Whether code shipped in a model or tokenizer folder may run (``--trust-remote-code``; never by
    default): the value every ``from_pretrained`` symmerge calls passes as ``trust_remote_code``."""
    return _REMOTE_CODE[0]


def trust_remote_code(allowed: bool = True):
    """Within the block, let (``allowed``) or forbid code from model folders to run, as ``--trust-remote-code``
    does for a command: ``with symmerge.trust_remote_code(): symmerge.merge(...)``. ``allowed``: True or False
    (anything else, ``"no"`` included, is one :class:`~symmerge.errors.UsageError`, at the call)."""
    flag_arguments(allowed=allowed)
    return _remote_code_block(allowed)


@contextlib.contextmanager
def _remote_code_block(allowed: bool):
    before = _REMOTE_CODE[0]
    _REMOTE_CODE[0] = allowed
    try:
        yield
    finally:
        _REMOTE_CODE[0] = before


def allow_remote_code(allowed: bool) -> None:
    """Set :func:`remote_code_allowed` for the rest of the process (a command, inside the
    :func:`trust_remote_code` block the command line opens; a config's ``trust_remote_code: true``)."""
    _REMOTE_CODE[0] = bool(allowed)


def _known_model_type(model_type) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def check_remote_code(config: dict, where) -> None:
    """Refuse, in one line naming the flag, a folder whose config needs code of its own (an ``auto_map`` and
    a ``model_type`` transformers does not know) unless :func:`remote_code_allowed`; transformers would
    otherwise ask on the terminal, and import the folder's ``.py`` files on ``y``."""
    auto_map = config.get("auto_map")
    if not auto_map or remote_code_allowed() or _known_model_type(config.get("model_type")):
        return
    names = sorted({str(v if not isinstance(v, (list, tuple)) else next((x for x in v if x), "")).split(".")[0]
                    for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])} - {""})
    code = ", ".join(f"{n}.py" for n in names) or "its own code"
    raise RemoteCodeError(f"{where}: the model needs code shipped in its folder ({code}: config.json's auto_map); "
                          f"symmerge runs no code from a model folder unless asked: pass {REMOTE_CODE_FLAG} "
                          "if you trust it")


def check_tokenizer_code(folder) -> None:
    """As :func:`check_remote_code`, for a tokenizer: ``tokenizer_config.json`` whose ``auto_map`` names a
    tokenizer class transformers does not have."""
    import json
    from pathlib import Path

    import transformers

    path = Path(folder) / "tokenizer_config.json"
    if remote_code_allowed() or not path.is_file():
        return
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return  # unreadable: transformers' own loader says so
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return
    cls = config.get("tokenizer_class")
    if isinstance(cls, str) and (hasattr(transformers, cls) or hasattr(transformers, cls.removesuffix("Fast"))):
        return  # transformers' own class: loaded without the folder's code
    raise RemoteCodeError(f"{folder}: the tokenizer needs code shipped in its folder (tokenizer_config.json's "
                          f"auto_map); symmerge runs no code from a model folder unless asked: pass "
                          f"{REMOTE_CODE_FLAG} if you trust it")


def auto_tokenizer(folder, **keywords):
    """``AutoTokenizer.from_pretrained(folder, ...)`` offline, running the folder's code only when asked
    (:func:`check_tokenizer_code` first: one line, never transformers' prompt)."""
    from transformers import AutoTokenizer

    check_tokenizer_code(folder)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=remote_code_allowed(),
                                         **keywords)


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
        model_type = config.get("model_type")
        if not _known_model_type(model_type):  # (transformers' own message lists its 400 types)
            custom = (": a model with its own code is read in memory only (symmerge merge --mode memory "
                      f"{REMOTE_CODE_FLAG})") if config.get("auto_map") else ""
            raise SymmergeError(f"transformers has no model type {model_type!r}{custom}")
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
