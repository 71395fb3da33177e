"""A mergekit-moe config read as mergekit-moe 0.1.5 reads it: a base model (attention, norms, embeddings and
head of the output), experts whose MLPs become the experts of every layer, the router's initialisation
(``gate_mode``), the output dtype, the experts per token, an optional shared expert (Qwen2-MoE output).

    base_model: path/to/base
    gate_mode: hidden            # hidden | cheap_embed | random
    dtype: bfloat16              # float32 | float16 | bfloat16 (and their short names)
    experts_per_token: 2         # optional
    architecture: mixtral        # optional: mixtral | qwen (inferred: qwen with shared_experts or a qwen2 base)
    experts:
      - source_model: path/to/expert_1
        positive_prompts: ["..."]
        negative_prompts: ["..."]   # optional
    shared_experts:                # optional, Qwen2-MoE: at most one
      - source_model: path/to/shared
        positive_prompts: ["..."]  # needed by hidden / cheap_embed
        residual_scale: 0.1        # optional: the shared expert's output scaled

Every error is one line naming the file, line and key; an unknown key is one warning line (with a "did
you mean" where one is close) and ignored, as mergekit ignores it. The build is :mod:`.moe_build`.
"""

from __future__ import annotations

import difflib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SymmergeError
from .source import Doc, read_documents

GATE_MODES = ("hidden", "cheap_embed", "random")
ARCHITECTURES = ("mixtral", "qwen")
DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16", "fp16": "float16",
          "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
EXPERTS = "experts"  # the config's key (the word is also a symmetry's name: compared through this constant)
KEYS = ("base_model", EXPERTS, "gate_mode", "dtype", "experts_per_token", "shared_experts", "architecture",
        "name")
EXPERT_KEYS = ("source_model", "positive_prompts", "negative_prompts", "noise_scale", "residual_scale")


@dataclass(frozen=True)
class Expert:
    """One expert (or the shared expert): its model folder and prompts; ``residual_scale`` (shared expert only)
    multiplies its output (its down projection)."""

    source: str
    positive: tuple = ()
    negative: tuple = ()
    residual_scale: float | None = None
    noise_scale: float | None = None  # N(0, noise_scale²) added to each of its MLP weights (mergekit-moe's key)


@dataclass
class MoeConfig:
    """A parsed mergekit-moe config (``doc``: where each key is, for errors found later)."""

    base: str
    experts: list
    gate_mode: str = "hidden"
    dtype: str | None = None
    experts_per_token: int = 2
    shared: list = field(default_factory=list)
    architecture: str | None = None
    doc: Doc | None = None
    text: str = ""

    def at(self, *where) -> str:
        return self.doc.at(*where) if self.doc is not None else ".".join(map(str, where))


def is_moe_config(data) -> bool:
    """A mergekit-moe config (``experts`` or ``gate_mode``), not a mergekit-yaml one."""
    return isinstance(data, dict) and (EXPERTS in data or "gate_mode" in data)


def _warn_unknown(doc: Doc, mapping: dict, known, where=()) -> None:
    for key in mapping:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"symmerge: warning: {doc.at(*where, key)}: unknown key, ignored as mergekit-moe ignores it{hint}",
              file=sys.stderr)


def _prompts(doc: Doc, item: dict, key: str, where) -> tuple:
    value = item.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise doc.error(f"expected a list of strings, got {value!r}", *where, key)
    return tuple(value)


def _folder(doc: Doc, value, where) -> str:
    if not isinstance(value, str) or not value.strip():
        raise doc.error(f"expected a model folder, got {value!r}", *where)
    from ..io.lora import split_spec

    try:
        adapter = split_spec(value)[1]
    except SymmergeError:  # more than one '+': no folder either, said below
        adapter = None
    if adapter is not None:
        raise doc.error(f"{value}: a LoRA input (BASE+ADAPTER) is not taken by moe, as mergekit-moe 0.1.5 takes none "
                        "(it stops: 'LoRA not merged'); merge the adapter into a folder first (a `symmerge run` "
                        "config: merge_method: passthrough, models: [{model: BASE+ADAPTER}]) and name that folder",
                        *where)
    folder = Path(value).expanduser()  # ~ is the home folder, as in a `run` config
    if not folder.is_absolute():  # relative to the working directory, as mergekit reads it
        folder = Path.cwd() / folder
    if not (folder / "config.json").is_file():
        raise doc.error(f"{value}: not a model folder (no config.json); symmerge reads local folders only", *where)
    return str(folder)


def _finite(doc: Doc, value, where) -> float | None:
    """``value`` as a finite number (None: not given), else one error at ``where`` (NaN was taken, and failed late
    as an overflow blamed on a model tensor)."""
    if value is None:
        return None
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number):
        raise doc.error(f"expected a finite number, got {value!r}", *where)
    return number


def _experts(doc: Doc, key: str, gate_mode: str) -> list:
    items = doc.data.get(key)
    if items is None and key == EXPERTS:  # 'experts:' with no value: as an empty list
        raise doc.error("expected a non-empty list of experts (each with source_model)", key)
    if items is None:
        return []
    if not isinstance(items, list) or not items:
        raise doc.error("expected a non-empty list of experts (each with source_model)", key)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"source_model": item}
        if not isinstance(item, dict) or "source_model" not in item:
            raise doc.error("an expert is a mapping with source_model", key, i)
        _warn_unknown(doc, item, EXPERT_KEYS, (key, i))
        positive = _prompts(doc, item, "positive_prompts", (key, i))
        negative = _prompts(doc, item, "negative_prompts", (key, i))
        if gate_mode in ("hidden", "cheap_embed") and not positive:
            raise doc.error(f"gate_mode {gate_mode} needs positive_prompts for every expert", key, i)
        if item.get("residual_scale") is not None and key != "shared_experts":
            raise doc.error("residual_scale applies to shared_experts only", key, i, "residual_scale")
        scale, noise = (_finite(doc, item.get(name), (key, i, name)) for name in ("residual_scale", "noise_scale"))
        if noise is not None and noise < 0:
            raise doc.error(f"expected a number >= 0 (the noise's standard deviation), got {noise!r}", key, i,
                            "noise_scale")
        out.append(Expert(_folder(doc, item["source_model"], (key, i, "source_model")), positive, negative, scale,
                          noise or None))
    return out


def read_moe_config(path) -> MoeConfig:
    """Parse the mergekit-moe config at ``path`` (one document); every error before anything is read."""
    docs = read_documents(path)
    if len(docs) != 1:
        raise SymmergeError(f"{path}: a mergekit-moe config is one YAML document, got {len(docs)}")
    doc = docs[0]
    data = doc.data
    _warn_unknown(doc, data, KEYS)
    if "base_model" not in data:
        raise doc.error("base_model is required (the model whose attention, norms and embeddings the MoE keeps)")
    gate_mode = data.get("gate_mode", "hidden")
    if gate_mode not in GATE_MODES:
        raise doc.error(f"unknown gate_mode {gate_mode!r}; expected one of {', '.join(GATE_MODES)}", "gate_mode")
    dtype = data.get("dtype")
    if dtype is not None:
        if str(dtype) not in DTYPES:
            raise doc.error(f"unknown dtype {dtype!r}; expected one of float32, float16, bfloat16", "dtype")
        dtype = DTYPES[str(dtype)]
    k = data.get("experts_per_token", 2)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise doc.error(f"expected a positive integer, got {k!r}", "experts_per_token")
    arch = data.get("architecture")
    if arch is not None and str(arch).lower() not in ARCHITECTURES:
        raise doc.error(f"unsupported architecture {arch!r}; symmerge writes {' or '.join(ARCHITECTURES)}",
                        "architecture")
    if EXPERTS not in data:
        raise doc.error("experts is required (a list of source_model entries)")
    experts = _experts(doc, "experts", gate_mode)
    if k > len(experts):
        given = "experts_per_token" in data
        raise doc.error(f"experts_per_token {k}{'' if given else ' (the default, as mergekit-moe)'} is more than the "
                        f"{len(experts)} expert{'s' if len(experts) != 1 else ''}"
                        f"{'' if given else f': add experts, or set experts_per_token: {len(experts)}'}",
                        *(("experts_per_token",) if given else ("experts",)))
    shared = _experts(doc, "shared_experts", gate_mode)
    if len(shared) > 1:
        raise doc.error("at most one shared expert is supported (as mergekit-moe)", "shared_experts")
    return MoeConfig(base=_folder(doc, data["base_model"], ("base_model",)), experts=experts, gate_mode=gate_mode,
                     dtype=dtype, experts_per_token=k, shared=shared,
                     architecture=str(arch).lower() if arch is not None else None, doc=doc,
                     text=Path(path).read_text(encoding="utf-8"))
