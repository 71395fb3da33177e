"""List the supported families, the symmetry groups of each and the checkpoint tensors they act on."""

from __future__ import annotations

from ..families import SPECS

NOTATION = """\
Each group below acts on the tensors listed under it, named as they are stored in a checkpoint
written by save_pretrained for the task class shown ({i}: the layer index; a base-model checkpoint
has the same names without the base-model prefix, e.g. 'vit.').
  [axis N]     the tensor axis that carries the group's index: for a Linear weight 0 = output rows
               (a bias has only axis 0), 1 = input columns (GPT-2's Conv1D is stored transposed).
  s^+1, s^-1   with the 'rescale' symmetry, the tensor is multiplied (s^+1) or divided (s^-1) by the
               group's scale s: per head (attention), per RoPE frequency pair, per SwiGLU unit. Shown
               only on groups that have a scale; permutations of heads, of plain FFN units and of the
               residual stream have none.
"""

KIND_TEXT = {
    "heads": "permutation of the attention heads (GQA: of the key/value heads with their query heads)",
    "head_orthogonal": "per-head orthogonal rotation",
    "rope_pairs": "per-head 2x2 rotation of each RoPE frequency pair",
    "permutation": "permutation of the FFN hidden units",
    "residual": "one transform of the residual stream through every layer, norm and task head: a permutation "
                "(LayerNorm models) or an orthogonal map with the norms folded into their readers (RMSNorm "
                "models; signed permutations where a tied LM head keeps the final norm from folding)",
}


def has_scale(group) -> bool:
    """Whether ``rescale`` gives the group a scale (per head, per RoPE pair or per SwiGLU unit)."""
    if group.kind == "head_orthogonal":
        return True
    if group.kind == "rope_pairs":
        return not group.param("pair_norms")
    return group.kind == "permutation" and bool(group.param("unit_scale"))


def describe(group) -> str:
    text = KIND_TEXT.get(group.kind, group.kind)
    if has_scale(group):
        text += ", and a scale s ≠ 0 per unit" if group.kind == "permutation" else ", and a scale s > 0"
    return f"{group.name}  (symmetry '{group.symmetry}'; {text})"


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    from ..io.checkpoint import template_disk_names

    print(NOTATION)
    for spec in SPECS:
        task_class, names = template_disk_names(spec)
        print(f"{spec.family}  (model_type: {', '.join(spec.model_types)}; names as in a {task_class} checkpoint)")
        for g in spec.groups:
            print(f"  {describe(g)}")
            scale = has_scale(g)
            for m in g.members:
                marks = [f"axis {m.axis}"] + ([f"s^{m.power:+d}"] if scale and m.power else [])
                extra = f", part {m.chunk[0] + 1} of {m.chunk[1]}" if m.chunk[1] > 1 else ""
                print(f"      {names.get((m.name, m.root), m.name)}  [{', '.join(marks)}{extra}]")
            if g.param("pair_norms"):
                norms = ", ".join(names.get((n, False), n) for n in g.param("pair_norms"))
                print(f"      restricted by the per-head norms {norms}: no scale; a free pair rotation only where "
                      "their weights on j and j + r/2 are equal, else a sign flip")
        print()
    return 0
