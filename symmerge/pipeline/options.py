"""Alignment options, validated in one place and shared by ``align``, ``align --stream``, ``merge``
and ``barrier`` (the CLI and the Python API build the same object)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import SymmergeError
from ..families import SYMMETRIES
from ..groups import RESCALE_MODES, Options

DEFAULT_SYMMETRIES = ("attn", "ffn", "rescale")  # ``align``'s default (the paper's matching)
# The symmetry set that merges best in the project's measurements (docs/results.md): ``merge`` and
# ``barrier`` align with it by default, as ``--align recommended``, which resolves per model to the
# groups of this set the model has (:meth:`AlignOptions.for_model`).
RECOMMENDED = ("heads", "attn", "ffn", "rescale", "residual")
RECOMMENDED_NAME = "recommended"
RESIDUAL_CHOICES = ("largest", "permutation")


def _names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [] if value.strip() in ("", "none") else value.split(",")
    return tuple(dict.fromkeys(v.strip() for v in value if v.strip()))


def is_recommended(value) -> bool:
    """Whether a ``--symmetries``/``--align`` value asks for the recommended set."""
    return _names(value) == (RECOMMENDED_NAME,)


def parse_symmetries(value) -> tuple[str, ...]:
    """'attn,ffn' or an iterable → a validated tuple; 'none' or '' → (); 'recommended' → :data:`RECOMMENDED`
    (before it is resolved against a model)."""
    names = _names(value)
    if names == (RECOMMENDED_NAME,):
        return RECOMMENDED
    if RECOMMENDED_NAME in names:
        raise SymmergeError(f"{RECOMMENDED_NAME!r} stands alone; it cannot be combined with other symmetries")
    unknown = [n for n in names if n not in SYMMETRIES]
    if unknown:
        raise SymmergeError(f"unknown symmetry {unknown[0]!r}; choose from {', '.join(SYMMETRIES)}, "
                            f"{RECOMMENDED_NAME} or none")
    return names


def describe_symmetries(default: str) -> str:
    """The help text of ``--symmetries``/``--align``: every symmetry, and what the default means."""
    text = ("comma list of heads (head permutation), attn (per-head QK/VO rotations), ffn (FFN unit permutation), "
            "rescale (per-head and per-unit scales), residual (one transform of the residual stream); or none; or "
            f"{RECOMMENDED_NAME}: the groups of {','.join(RECOMMENDED)} that the model has (no residual for a base "
            "model or a family without a residual group)")
    return f"{text}. Default: {default}"


@dataclass(frozen=True)
class AlignOptions:
    """How to align: ``symmetries`` (``--symmetries``), ``rescale`` (``joint``, ``sequential`` or
    ``none``; only used when ``rescale`` is among the symmetries), ``layers`` (only these layers),
    ``residual`` (``permutation``: LayerNorm streams keep to permutations; ``largest``: the largest
    function-preserving group of the family), ``max_sweeps`` (cap of the coordinate descent over
    coupled groups), ``verify`` / ``verify_tol`` (the equivalence check), ``device`` (cost GEMMs)."""

    symmetries: tuple = DEFAULT_SYMMETRIES
    rescale: str = "joint"
    layers: tuple | None = None
    residual: str = "permutation"
    max_sweeps: int = 50
    verify: bool = True
    verify_tol: float | None = None
    device: object = "cpu"
    extra: dict = field(default_factory=dict, compare=False)
    recommended: bool = False  # symmetries came from 'recommended': resolve against each model

    def __post_init__(self):
        if is_recommended(self.symmetries):
            object.__setattr__(self, "recommended", True)
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
        if "symmetries" in changes:
            changes.setdefault("recommended", False)
        return replace(self, **changes)

    @property
    def requested(self) -> str:
        """What was asked for, as the user wrote it: 'recommended', 'none' or the symmetry list."""
        return RECOMMENDED_NAME if self.recommended else ",".join(self.symmetries) or "none"

    def resolved(self, available) -> "AlignOptions":
        """With 'recommended': the recommended symmetries among ``available`` (the symmetries whose groups a
        model binds; ``rescale`` is kept when any group is), else ``self`` unchanged."""
        if not self.recommended:
            return self
        available = set(available)
        names = tuple(s for s in RECOMMENDED if s in available or (s == "rescale" and available))
        return replace(self, symmetries=names, recommended=False)

    def for_model(self, model) -> "AlignOptions":
        """:meth:`resolved` against the groups ``model`` (a transformers model) has."""
        if not self.recommended:
            return self
        from .align import instances_for

        _, instances = instances_for(model, self.layers, self.residual)
        return self.resolved(i.group.symmetry for i in instances)
