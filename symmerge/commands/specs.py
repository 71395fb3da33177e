"""List the supported families, the symmetry groups of each and the checkpoint tensors they act on."""

from __future__ import annotations

from ..families import SPECS
from ..groups import get_kind

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
  per expert   mixtures of experts: the tensor stacks the experts on its axis 0 (as transformers fuses
               them in memory; checkpoints store one tensor per expert); the group has one instance per
               expert, acting on that expert's slice (axis N counts the whole tensor's axes).
"""

def has_scale(group) -> bool:
    """Whether ``rescale`` gives the group a scale (per head, per RoPE pair or per SwiGLU unit)."""
    return get_kind(group.kind).scale_text(group) is not None


def describe(group) -> str:
    kind = get_kind(group.kind)
    scale = kind.scale_text(group)
    text = group.param("description") or kind.description + (f", and {scale}" if scale else "")
    return f"{group.name}  (symmetry '{group.symmetry}'; {text})"


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    from ..io.checkpoint import template_disk_names

    print(NOTATION)
    for spec in SPECS:
        task_class, names = template_disk_names(spec)
        print(f"{spec.family}  (model_type: {', '.join(spec.model_types)}; names as in a {task_class} checkpoint)")
        if spec.in_memory_only:
            print(f"    in memory only: {spec.in_memory_only}")
        for g in spec.groups:
            print(f"  {describe(g)}")
            scale = has_scale(g)
            for m in g.members:
                marks = [f"axis {m.axis}"] + ([f"s^{m.power:+d}"] if scale and m.power else [])
                extra = f", part {m.chunk[0] + 1} of {m.chunk[1]}" if m.chunk[1] > 1 else ""
                extra += f" sized {'/'.join(m.parts)} heads" if m.parts else ""
                extra += " of every head" if m.interleaved else ""
                extra += ", per expert" if m.stacked else ""
                print(f"      {names.get((m.name, m.root), m.name)}  [{', '.join(marks)}{extra}]")
            if g.param("pair_norms"):
                norms = ", ".join(names.get((n, False), n) for n in g.param("pair_norms"))
                print(f"      restricted by the query/key norms {norms} (per head, or over all heads): no scale; "
                      "a free pair rotation only where their weights on j and j + r/2 are equal in every head, "
                      "else a sign flip")
            _residual_notes(g, spec, names)
        print()
    return 0


def _residual_notes(group, spec, names) -> None:
    """What restricts or reshapes a residual group beyond its norm type (norms on block outputs, 1 + w)."""
    if group.param("fixed_norms"):
        norms = ", ".join(names.get((n, False), n) for n in group.param("fixed_norms"))
        print(f"      restricted by the norms on the blocks' outputs {norms}: signed permutations of the stream "
              "(the norm weights permuted), orthogonal maps only where all of them are uniform")
    offsets = {f.offset for f in spec.folds if f.offset}
    if offsets and group.param("norm"):
        print(f"      the norms multiply by {offsets.pop():g} + weight: folded as such, leaving the weight at 0")
