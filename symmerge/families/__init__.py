"""Architecture families: one module each, stating the roles of the family's tensors
(:mod:`symmerge.families.roles`); the symmetry groups are generated from them."""

from __future__ import annotations

from ..core.spec import Spec
from ..errors import SymmergeError, UsageError
from . import bert, clip, deberta, distilbert, gemma, gpt2, gpt_neox, llama, moe, olmo2, phi, phi3, t5, vit

SPECS: tuple[Spec, ...] = (bert.SPEC, distilbert.SPEC, deberta.SPEC, vit.SPEC, gpt2.SPEC, llama.LLAMA, llama.QWEN3,
                           phi.SPEC)
# dense decoder families
SPECS += (gemma.GEMMA, gemma.GEMMA2, gemma.GEMMA3, gpt_neox.SPEC, phi3.SPEC, olmo2.SPEC)
SPECS += (moe.MIXTRAL, moe.QWEN2_MOE, moe.QWEN3_MOE, moe.OLMOE)  # mixtures of experts
SPECS += (t5.SPEC, clip.SPEC, clip.TEXT, clip.VISION)  # several layer stacks (and CLIP's single towers)

# user-facing symmetry names (``--symmetries``), in the order groups are solved
SYMMETRIES = ("heads", "attn", "ffn", "rescale", "residual")
SYMMETRIES += ("experts",)  # mixtures of experts: the experts of a layer, with the router's rows
# the one symmetry that is no group of its own: with it, the groups' scales are solved too (``--rescale``)
SCALES = "rescale"


def supported_model_types() -> list[str]:
    """The ``model_type`` s (config.json's) that have a family spec, sorted: the models ``align`` and the aligned
    merges take."""
    return sorted(t for s in SPECS for t in s.model_types)


def spec_for(model_type: str) -> Spec:
    """The :class:`~symmerge.core.spec.Spec` (the family's roles and symmetry groups) of ``model_type`` (a config's
    ``model_type``, e.g. ``"llama"``); raises :class:`SymmergeError` naming the supported ones when none has it (and
    :class:`UsageError` for anything but a str: a model or a config given here was printed whole in the error)."""
    if not isinstance(model_type, str):
        hint = ": pass its config's model_type" if hasattr(model_type, "model_type") or hasattr(
            getattr(model_type, "config", None), "model_type") else ""
        raise UsageError(f"spec_for takes a config's model_type (a str such as 'llama'), got "
                         f"{type(model_type).__name__}{hint}")
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    raise SymmergeError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}")


__all__ = ["SCALES", "SPECS", "SYMMETRIES", "spec_for", "supported_model_types"]


def symmetries_whose(test) -> tuple[str, ...]:
    """The symmetry names (``--symmetries``) of the groups of any family whose kind satisfies ``test`` (a
    predicate on :class:`~symmerge.groups.base.Kind`: its declared capabilities, e.g.
    ``lambda kind: kind.moves_heads_input``); callers ask this instead of naming a symmetry."""
    from ..core.kinds import get_kind

    return tuple(dict.fromkeys(g.symmetry for spec in SPECS for g in spec.groups if test(get_kind(g.kind))))
