"""mergekit's named modules (``modules: {encoder: ..., decoder: ...}``) for architectures made of several
stacks: which tensors each module of an architecture owns, and each module's layer template.

A multi-module model is merged module by module, each with its own ``models`` / ``slices`` / ``parameters``
(mergekit 0.1.x, ``MergePlanner.plan_module``): a module's tensors before its layers (at t = 0, from its
first slice's sources), its layers (t = the layer's place in its slice), the tensors after them (t = 0, from
its last slice's sources). A config without ``modules:`` merges every module with the document's ``models``.

The maps are symmerge's own, written from the architectures' tensor names in ``transformers``: a module is its
layer stack (``LAYERS{i}.…``, its count under a config.json key) and the named tensors before and after it;
a named tensor a checkpoint does not hold (an embedding tied to another) is left out, as mergekit leaves out an
optional tensor. Every tensor of a checkpoint belongs to exactly one module, or the checkpoint is refused. An
architecture without a map keeps the one module ``default``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SymmergeError
from .layout import Layout


@dataclass(frozen=True)
class Module:
    """One module of an architecture: the prefix of its layers (``encoder.block.``) and the config.json key
    of their count (None: a module without layers), the tensors before and after its layers."""

    name: str
    layers: str | None
    layers_key: str | None
    pre: tuple = ()
    post: tuple = ()


_T5 = (
    Module("encoder", "encoder.block.", "num_layers", ("encoder.embed_tokens.weight",),
           ("encoder.final_layer_norm.weight",)),
    Module("decoder", "decoder.block.", "num_decoder_layers", ("decoder.embed_tokens.weight",),
           ("decoder.final_layer_norm.weight",)),
    Module("shared", None, None, ("shared.weight",), ("lm_head.weight",)),
)
# architecture (config.json's ``architectures[0]``) -> its modules, in mergekit's order of planning
# mT5 has T5's tensor names; T5Model has no LM head, T5EncoderModel only the encoder and the shared embedding
MAPS = {"T5ForConditionalGeneration": _T5, "MT5ForConditionalGeneration": _T5, "T5Model": _T5, "MT5Model": _T5,
        "T5EncoderModel": _T5[0::2], "MT5EncoderModel": _T5[0::2]}


def architecture(config: dict) -> str | None:
    archs = config.get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def module_map(config: dict) -> tuple | None:
    """The modules of the model whose config.json is ``config``, or None (one module, ``default``)."""
    return MAPS.get(architecture(config) or "")


def module_names(config: dict) -> tuple:
    found = module_map(config)
    return tuple(m.name for m in found) if found else ("default",)


def _owner(name: str, modules) -> str | None:
    for m in modules:
        if name in m.pre or name in m.post or (m.layers and re.match(re.escape(m.layers) + r"\d+\.", name)):
            return m.name
    return None


def module_layout(folder, config: dict, shapes: dict, dtypes: dict, module: str) -> Layout:
    """The layout of module ``module`` of a multi-module checkpoint (names, shapes and dtypes of the whole
    model): its layers' template (suffixes every layer holds; the others, such as T5's relative attention bias
    in its first block only, optional) and its tensors before and after them."""
    modules = module_map(config)
    if modules is None:
        raise SymmergeError(f"{folder}: named modules are for models of several stacks; symmerge has module maps "
                            f"for {', '.join(sorted(MAPS))}, not for {architecture(config) or 'this model'} (its one "
                            "module is 'default')")
    by_name = {m.name: m for m in modules}
    if module not in by_name:
        raise SymmergeError(f"{folder}: {architecture(config)} has no module {module!r} (its modules: "
                            f"{', '.join(by_name)})")
    stray = next((n for n in shapes if _owner(n, modules) is None), None)
    if stray is not None:
        raise SymmergeError(f"{folder}: tensor {stray!r} belongs to no module of {architecture(config)} "
                            f"({', '.join(by_name)})")
    m = by_name[module]
    count = 0
    required: tuple = ()
    optional: tuple = ()
    if m.layers is not None:
        count = config.get(m.layers_key)
        if not isinstance(count, int):
            raise SymmergeError(f"{folder}: config.json gives no {m.layers_key!r} (the layers of module {module!r})")
        per = [{n[len(f"{m.layers}{i}"):] for n in shapes if n.startswith(f"{m.layers}{i}.")} for i in range(count)]
        if any(not s for s in per) or any(re.match(re.escape(m.layers) + rf"{count}\.", n) for n in shapes):
            raise SymmergeError(f"{folder}: module {module!r} does not have the {count} layers config.json gives "
                                f"({m.layers}0 … {m.layers}{count - 1})")
        common = set.intersection(*per) if per else set()
        required = tuple(sorted(common))
        optional = tuple(sorted(set().union(*per) - common))
    own = {n: s for n, s in shapes.items() if _owner(n, modules) == module}
    return Layout(str(folder), config, own, {n: dtypes[n] for n in own}, count, m.layers_key, m.layers or "",
                  required, tuple(n for n in m.pre if n in shapes), tuple(n for n in m.post if n in shapes),
                  optional)
