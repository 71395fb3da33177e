"""List the supported architecture families and the symmetry groups of each."""

from ..families import SPECS


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    for spec in SPECS:
        print(f"{spec.family}  (model_type: {', '.join(spec.model_types)})")
        for g in spec.groups:
            members = ", ".join(f"{m.name}[axis {m.axis}, a^{m.power:+d}]" for m in g.members)
            print(f"  {g.name:8s} {g.kind:16s} {members}")
            if g.param("pair_norms"):
                print(f"  {'':8s} {'':16s} restricted by the per-head norms {', '.join(g.param('pair_norms'))}: no scale; "
                      "a free pair rotation only where their weights on j and j + r/2 are equal, else a sign flip")
    return 0
