"""The model class of a checkpoint whose config.json names none (no ``architectures``, as
``PretrainedConfig.save_pretrained`` writes a bare config): inferred from the checkpoint's tensor names.

Every class transformers' auto mappings list for the ``model_type`` (the base model, causal LM, masked
LM, sequence classification, ...) is built weightless (``meta`` device) and the names it saves are
compared with the names stored in the safetensors files. The one class whose names match exactly
(tied weights stored once or under both names alike) is taken; else one clear error names the closest
class and exactly which tensors are missing or unexpected.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SymmergeError

# auto mappings searched, in order of preference when two classes save the same names
_MAPPINGS = ("MODEL_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
             "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
             "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
             "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
             "MODEL_FOR_PRETRAINING_MAPPING_NAMES", "MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES")


def candidate_classes(model_type: str) -> list[str]:
    """Names of the transformers classes the auto mappings give for ``model_type`` (no duplicates)."""
    from transformers.models.auto import modeling_auto as auto

    names: list[str] = []
    for mapping in _MAPPINGS:
        value = getattr(auto, mapping, {}).get(model_type)
        for name in (value if isinstance(value, (list, tuple)) else [value]):
            if name and name not in names:
                names.append(name)
    return names


def stored_names(files) -> set[str]:
    """Tensor names stored in safetensors ``files`` (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as handle:
            names.update(handle.keys())
    return names


def saved_names(cls, config: dict) -> tuple[set[str], set[str]]:
    """(names ``save_pretrained`` writes for a ``cls`` model of ``config``, their tied aliases) from a
    weightless model."""
    from .hf import disk_to_memory, hf_config, quiet_transformers
    from ..core.resolve import declared_ties

    with quiet_transformers():
        cfg = hf_config({**config, "architectures": [cls.__name__]})
        with torch.device("meta"):
            model = cls(cfg)
        names = set(disk_to_memory(model))
        ties = declared_ties(model)
    aliases = {a for a in ties if a in names}
    return names, aliases


def infer_architecture(config: dict, files, where: str = "") -> str:
    """The class name for a config without ``architectures``, from the tensor names in ``files``."""
    import transformers

    model_type = config.get("model_type")
    stored = stored_names([Path(f) for f in files])
    tried = []
    for name in candidate_classes(model_type):
        cls = getattr(transformers, name, None)
        if cls is None:
            continue
        try:
            names, aliases = saved_names(cls, config)
        except Exception:  # a class this config cannot build (e.g. a head needing a setting it lacks)
            continue
        missing = names - stored - aliases  # a tied alias may be stored or not
        unexpected = stored - names
        if not missing and not unexpected:
            return name
        tried.append((len(missing) + len(unexpected), name, sorted(missing), sorted(unexpected)))
    if not tried:
        raise SymmergeError(f"{where}: config.json names no architectures and transformers has no model class for "
                            f"model_type {model_type!r}")
    _, name, missing, unexpected = min(tried)
    parts = [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else ""]
    raise SymmergeError(f"{where}: config.json names no architectures, and no {model_type} class saves exactly the "
                        f"tensors stored here; the closest, {name}: {'; '.join(p for p in parts if p)}. Add "
                        f"\"architectures\": [\"ClassName\"] to config.json")
