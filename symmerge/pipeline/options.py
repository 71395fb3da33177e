"""Alignment options, validated in one place and shared by ``align``, ``align --stream``, ``merge``
and ``barrier`` (the CLI and the Python API build the same object)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import SymmergeError
from ..families import SYMMETRIES
from ..groups import RESCALE_MODES, Options

PAPER = ("attn", "ffn", "rescale")  # the paper's matching: per-head rotations and scales, FFN permutations
DEFAULT_SYMMETRIES = PAPER
ALIASES = {"paper": PAPER}
RESIDUAL_CHOICES = ("largest", "permutation")


def parse_symmetries(value) -> tuple[str, ...]:
    """'attn,ffn' or an iterable → a validated tuple; 'none' or '' → (); ``paper`` names the paper's
    set (attn, ffn, rescale) and may be combined (``paper,heads``)."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [] if value.strip() in ("", "none") else value.split(",")
    expanded = []
    for v in value:
        expanded += list(ALIASES.get(v.strip(), (v,)))
    names = tuple(dict.fromkeys(v.strip() for v in expanded if v.strip()))
    unknown = [n for n in names if n not in SYMMETRIES]
    if unknown:
        raise SymmergeError(f"unknown symmetry {unknown[0]!r}; choose from {', '.join(SYMMETRIES)} (or none)")
    return names


@dataclass(frozen=True)
class AlignOptions:
    """How to align: ``symmetries`` (``--symmetries``), ``rescale`` (``joint``, ``sequential`` or
    ``none``; only used when ``rescale`` is among the symmetries), ``layers`` (only these layers),
    ``residual`` (``largest``: the largest function-preserving group of the family's residual stream —
    O(d) for RMSNorm, O(d−1) for pre-LN LayerNorm after folding the norms, permutations for post-LN;
    ``permutation``: LayerNorm streams keep to permutations), ``untie`` (tied LM heads become heads of
    their own, so that the final norm can fold into them: the output then has an untied head),
    ``max_sweeps`` (cap of the coordinate descent over coupled groups), ``verify`` / ``verify_tol``
    (the equivalence check), ``device`` (cost GEMMs)."""

    symmetries: tuple = DEFAULT_SYMMETRIES
    rescale: str = "joint"
    layers: tuple | None = None
    residual: str = "largest"
    untie: bool = False
    max_sweeps: int = 50
    verify: bool = True
    verify_tol: float | None = None
    device: object = "cpu"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "symmetries", parse_symmetries(self.symmetries))
        if self.rescale not in RESCALE_MODES:
            raise SymmergeError(f"unknown rescale mode {self.rescale!r}; choose one of {', '.join(RESCALE_MODES)}")
        if self.residual not in RESIDUAL_CHOICES:
            raise SymmergeError(f"unknown residual group {self.residual!r}; choose {' or '.join(RESIDUAL_CHOICES)}")
        if self.max_sweeps < 1:
            raise SymmergeError(f"max_sweeps must be >= 1, got {self.max_sweeps}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))

    @property
    def effective_rescale(self) -> str:
        return self.rescale if "rescale" in self.symmetries else "none"

    def solver_options(self, device=None) -> Options:
        return Options(frozenset(self.symmetries), self.effective_rescale, device)

    def with_(self, **changes) -> "AlignOptions":
        return replace(self, **changes)
