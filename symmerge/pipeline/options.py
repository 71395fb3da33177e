"""Alignment options, validated in one place and shared by ``align``, ``align --stream``, ``merge``
and ``barrier`` (the CLI and the Python API build the same object)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from numbers import Integral

from ..errors import SymmergeError, UsageError, keywords_checked, options_argument
from ..families import SCALES, SYMMETRIES
from ..groups import RESCALE_MODES, Options
from ..option_ranges import check as check_range, in_range, seed as check_seed
from .matchers import DEFAULT_MATCHER, MATCHERS, matcher, streaming_refusal

PAPER = ("attn", "ffn", "rescale")  # the paper's matching: per-head rotations and scales, FFN permutations
ALIASES = {"paper": PAPER}
# The symmetry set that merges best in the project's measurements (docs/results.md): ``align``, ``merge``
# and ``barrier`` align with it by default (``recommended``), which resolves per model to the
# groups of this set the model has (:meth:`AlignOptions.for_model`).
RECOMMENDED = ("heads", "attn", "ffn", "rescale", "residual")
RECOMMENDED += ("experts",)  # mixtures of experts
RECOMMENDED_NAME = "recommended"
# the default of every entry, the commands' and the library's alike (AlignOptions, ``symmerge.align``, MergeOptions,
# BarrierOptions): before 2026-12-01 AlignOptions and ``symmerge.align`` defaulted to the paper's set (PAPER), so
# ``symmerge.align(a, b)`` and ``symmerge align a b`` gave two alignments
DEFAULT_SYMMETRIES = RECOMMENDED_NAME
RESIDUAL_CHOICES = ("largest", "permutation")
MATCH_MODES = tuple(MATCHERS)  # weights, activations, learned: the matcher plug-ins (pipeline/matchers.py)
# the descent over coupled groups stops when a sweep gains less than this fraction of the objective: on B7
# (two Llamas) the sweeps after that gain 0.04 % in all over 50 more sweeps (docs/results.md, B7)
DESCENT_TOL = 1e-4
# what the joint alignment's rounds after the star re-solve (symmerge.pipeline.joint): "all" — every group of
# the options (MergeMany; for the continuous groups generalized Procrustes); "discrete" — only the groups whose
# elements form a finite set (head and unit permutations, a permutation residual group: ``Kind.discrete``),
# the star's rotations and scales kept. Neither merges better everywhere (docs/results.md: discrete on the
# MNIST-5k ViTs with --match weights, all on B5's label-skewed clients): the issue's MergeMany stays the default
JOINT_REFINE = ("all", "discrete")
DEFAULT_REFINE = "all"
# the closed form a learned alignment starts from: weights, activations (the matchers that do not learn)
LEARN_STARTS = tuple(name for name, m in MATCHERS.items() if not m.learns)
# what the interpolated model learns to predict: α·p_A + (1−α)·p_B, or softmax(α·log p_A + (1−α)·log p_B)
LEARN_TARGETS = ("probabilities", "log-probabilities")
LEARN_PRECISIONS = ("float32", "bfloat16")  # the training steps' forward and backward (checks: float32)
# A moved onto B, or both models moved into a frame between them with their norms split (pipeline/dual.py)
LEARN_FRAMES = ("one-sided", "dual")
# the augmented views of the unlabeled images (learn.augmented): flip-shift (a flip, a shift of up to 2 pixels), strong
# (a shift of up to 4 and a cut-out square), mixup (flip-shift, then a mix with another image of the batch)
AUGMENT_STYLES = ("flip-shift", "strong", "mixup")
# --learn-dirichlet uniform (inf reads the same: Dirichlet(C)'s limit as C grows): every joint learned step at the
# plain average, each of the N models weighted 1/N; "auto": C chosen on held-out data (learn_joint.choose_concentration)
DIRICHLET_UNIFORM = "uniform"
DIRICHLET_AUTO = "auto"


def refuse_unread_align_data(align: "AlignOptions", readers=()) -> None:
    """One error when ``align.align_data`` is given and nothing reads it: a data-free matcher and none of the
    entry's ``readers`` (the names of its options that read the data: ``repair``, ``distill``, ``temperature``)
    asked for (``--align-data`` with ``--match weights`` is the same error; the Python API dropped the data in
    silence)."""
    if align.align_data is None or align.matcher.needs_data or any(readers):
        return
    data_matchers = " or ".join(repr(n) for n, m in MATCHERS.items() if m.needs_data)
    raise UsageError(f"align_data: nothing reads it with match={align.match!r} (data-free); it is for match="
                     f"{data_matchers} (or repair, distill or temperature where the entry has them): give one, or "
                     "leave align_data out")


def refuse_unread_joint(rounds, refine, defaults: tuple, aligns: str, what: str = "merge") -> None:
    """One error when ``rounds`` or ``refine`` (``--joint-rounds``, ``--joint-refine``) differ from ``defaults``
    while the ``what`` aligns in another frame (``aligns``: which): only the joint alignment reads them (they were
    accepted and dropped in silence)."""
    given = [flag for flag, value, default in (("--joint-rounds", rounds, defaults[0]),
                                               ("--joint-refine", refine, defaults[1])) if value != default]
    if given:
        it = "it" if len(given) == 1 else "them"
        raise SymmergeError(f"{', '.join(given)}: the joint alignment's options (more than two models brought into "
                            f"one frame, in memory, with no --anchor, --base or --star), and this {what} aligns "
                            f"{aligns}: nothing would read {it} (leave {it} out)")


def refuse_unread_mixture(align: "AlignOptions", joint: bool) -> None:
    """One error when the learned alignment's mixing options given would be read by nothing: ``--learn-dirichlet``
    (the weights of more than two models learned jointly, in one frame) where a pair is learned (``joint`` False),
    ``--learn-alpha-low``/``--learn-alpha-high`` (a pair's α range) where the models are learned jointly."""
    if not align.matcher.learns:
        return
    settings, default = align.learn, LearnSettings()
    if not joint and settings.dirichlet != default.dirichlet:
        raise SymmergeError("--learn-dirichlet: the mixture weights of more than two models learned jointly (one "
                            "frame, no --anchor, --base or --star); a pair draws its α from U(--learn-alpha-low, "
                            "--learn-alpha-high): nothing would read it (leave it out)")
    given = [flag for flag, name in (("--learn-alpha-low", "alpha_low"), ("--learn-alpha-high", "alpha_high"))
             if getattr(settings, name) != getattr(default, name)]
    if joint and given:
        it = "it" if len(given) == 1 else "them"
        raise SymmergeError(f"{', '.join(given)}: the range of a pair's mixing weight α; more than two models learned "
                            f"jointly draw their weights from Dirichlet (--learn-dirichlet): nothing would read {it} "
                            f"(leave {it} out)")


def _names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [] if value.strip() in ("", "none") else value.split(",")
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"symmetries must be a comma list such as 'attn,ffn' or a list of names, got {value!r}")
    expanded = []
    for v in value:
        expanded += list(ALIASES.get(v.strip(), (v,)))
    return tuple(dict.fromkeys(v.strip() for v in expanded if v.strip()))


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x not in (float("inf"),)


def _layers(value) -> tuple[int, ...] | None:
    """``layers`` as a tuple of layer indices: None (every layer), an int, 'i,j' or a list of ints."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [value] if isinstance(value, int) else value
    try:
        out = tuple(int(i) if isinstance(i, str) else i for i in items)
    except (TypeError, ValueError):
        out = None
    if out is None or isinstance(value, bool) or not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise UsageError(f"layers must be layer indices (an int, '0,2' or a list of ints), got {value!r}")
    if not out:  # as --layers "": an empty list aligned the model-wide groups only
        raise UsageError(f"layers {value!r} names no layer; leave it out (None) to align every layer")
    twice = sorted({i for i in out if out.count(i) > 1})
    if twice:  # each instance was bound twice: solved twice over, the descent's objective rose
        raise UsageError(f"layers {value!r} names layer {twice[0]} twice; give each layer once")
    return out


def is_recommended(value) -> bool:
    """Whether a ``--symmetries``/``--align`` value asks for the recommended set."""
    return _names(value) == (RECOMMENDED_NAME,)


def parse_symmetries(value) -> tuple[str, ...]:
    """'attn,ffn' or an iterable → a validated tuple; 'none' or '' → (); ``paper`` names the paper's set
    (attn, ffn, rescale) and may be combined (``paper,heads``); 'recommended' → :data:`RECOMMENDED`
    (before it is resolved against a model)."""
    names = _names(value)
    if names == (RECOMMENDED_NAME,):
        return RECOMMENDED
    for alone in (RECOMMENDED_NAME, "none"):  # 'none,ffn' said "unknown symmetry 'none'; choose from ... or none"
        if alone in names:
            raise SymmergeError(f"{alone!r} stands alone; it cannot be combined with other symmetries")
    unknown = [n for n in names if n not in SYMMETRIES]
    if unknown:
        raise SymmergeError(f"unknown symmetry {unknown[0]!r}; choose from {', '.join(SYMMETRIES)}, "
                            f"{RECOMMENDED_NAME} or none")
    return names


def describe_symmetries(default: str) -> str:
    """The help text of ``--symmetries``/``--align``: every symmetry, and what the default means."""
    text = ("comma list of heads (head permutation), attn (per-head QK/VO rotations), ffn (FFN unit permutation), "
            "rescale (per-head and per-unit scales), residual (one transform of the residual stream, in the "
            "largest group of the family unless --residual permutation), experts (a permutation of each "
            "mixture-of-experts layer's experts); or none; or paper (attn,ffn,rescale, the "
            f"paper's set); or {RECOMMENDED_NAME}: the groups of {','.join(RECOMMENDED)} that the model has (no "
            "residual for a base model, whose output is the stream)")
    return f"{text}. Default: {default}"


@keywords_checked
@dataclass(frozen=True)
class LearnSettings:
    """Learned alignment: Adam on the continuous group elements, ``steps`` of ``batch`` examples, learning
    rate ``lr`` with cosine decay, α drawn from U(``alpha_low``, ``alpha_high``) at every step, a
    ``holdout`` fraction of the unlabeled data for early stopping (checked every ``check_every`` steps,
    stopping after ``patience`` checks without improvement; 0, the default: every example trains, and the
    objective is checked on the training examples at the start and the end only — the end is kept only if
    not worse; the history then has no held-out column), a ``seed``, and an optional time budget in
    seconds (``budget``). ``start``: the closed form learning starts from (``activations``: activation
    matching on the same data; ``weights``: data-free weight matching); ``augment``: randomly flipped and shifted
    views of every training image (images only; ``augment_style``: :data:`AUGMENT_STYLES`, how strongly they
    differ from it); ``target``: ``probabilities`` (α·p_A + (1−α)·p_B) or
    ``log-probabilities`` (their normalised geometric mean); ``positions`` (sequence models): the
    objective on at most this many randomly chosen scored positions of each batch (drawn once, so the
    endpoints' predictions are computed and cached there only; 0: every position); ``max_length``:
    the alignment texts truncated to this many tokens (None: the model's context); ``precision``: the
    training steps (the elements' transform, forward and backward) and the endpoints' predictions in
    ``float32`` or under ``bfloat16`` autocast (CPU; the checks stay float32, and the learned elements are
    applied and verified in float64 as always);
    ``check_batches``: the objective checks on at most this many batches (the first; 0: every batch of
    the held-out part, or of the training set without one); ``layerwise``: the interpolated model built
    and differentiated one layer at a time (gradient checkpointing per layer, the layer's tensors computed
    from the learned elements inside it): the same objective and gradient in memory bounded by a few layers instead of
    θ(α) and its graph for the whole model (docs/results/learned_scale.md); ``dirichlet``: the concentration of the
    mixture weights of the joint learned alignment of N models (w ~ Dirichlet(dirichlet, …); 1: uniform on the simplex;
    larger: mixtures nearer the plain average), ``"uniform"`` (``inf`` reads the same: every step at the plain average,
    each model weighted 1/N, the objective checked there alone), or ``"auto"`` (the default): chosen on held-out data —
    the last ``dirichlet_holdout`` of the unlabeled batches is held out, the mixtures are learned on the rest
    for every concentration of ``dirichlet_grid`` (``dirichlet_steps`` steps each; 0: half of ``steps``),
    and the one whose uniform average of the N models matches the uniform mixture of their predictions
    best on the held-out part is learned again on all the data with ``steps`` steps
    (:func:`symmerge.pipeline.learn_joint.choose_concentration`). See :mod:`symmerge.pipeline.learn`; the
    defaults are the best recipe measured (docs/merge.md, "Unlabeled data")."""

    steps: int = 200
    batch: int = 100
    lr: float = 1e-2
    alpha_low: float = 0.1
    alpha_high: float = 0.9
    holdout: float = 0.0
    check_every: int = 25
    patience: int = 6
    seed: int = 0
    budget: float | None = None
    start: str = "activations"
    augment: int = 4
    augment_style: str = "flip-shift"
    target: str = "log-probabilities"
    positions: int = 0
    max_length: int | None = None
    precision: str = "float32"
    check_batches: int = 0
    layerwise: bool = False
    dirichlet: float | str = "auto"
    dirichlet_grid: tuple = (1.0, 3.0, 10.0, 30.0)
    dirichlet_steps: int = 0
    dirichlet_holdout: float = 0.2
    frame: str = "one-sided"

    def draw_alpha(self, generator) -> float:
        """One step's mixing weight α ~ U(``alpha_low``, ``alpha_high``) from ``generator``, drawn in float32 whatever
        the caller's default dtype."""
        import torch

        u = torch.rand(1, generator=generator, dtype=torch.float32).item()
        return self.alpha_low + (self.alpha_high - self.alpha_low) * u

    def __post_init__(self):
        if self.frame not in LEARN_FRAMES:
            raise SymmergeError(f"unknown learned-alignment frame {self.frame!r}; "
                                f"choose one of {', '.join(LEARN_FRAMES)}")
        if self.start not in LEARN_STARTS:
            raise SymmergeError(f"unknown learned-alignment start {self.start!r}; "
                                f"choose one of {', '.join(LEARN_STARTS)}")
        if self.target not in LEARN_TARGETS:
            raise SymmergeError(f"unknown learned-alignment target {self.target!r}; "
                                f"choose one of {', '.join(LEARN_TARGETS)}")
        if self.augment_style not in AUGMENT_STYLES:
            raise SymmergeError(f"unknown learned-alignment augmentation style {self.augment_style!r}; choose one of "
                                f"{', '.join(AUGMENT_STYLES)}")
        if self.precision not in LEARN_PRECISIONS:
            raise SymmergeError(f"unknown learned-alignment precision {self.precision!r}; choose one of "
                                f"{', '.join(LEARN_PRECISIONS)}")
        if self.dirichlet == float("inf"):  # Dirichlet(C) tends to the uniform weights as C grows
            object.__setattr__(self, "dirichlet", DIRICHLET_UNIFORM)
        if self.dirichlet not in (DIRICHLET_AUTO, DIRICHLET_UNIFORM) and \
                not (_is_number(self.dirichlet) and self.dirichlet > 0):
            raise SymmergeError(f"the Dirichlet concentration must be > 0 (or 'auto', or 'uniform'), got "
                                f"{self.dirichlet!r}")
        grid = tuple(self.dirichlet_grid)
        if not grid or not all(_is_number(c) and c > 0 for c in grid):
            raise SymmergeError(f"dirichlet_grid must be concentrations > 0, got {self.dirichlet_grid!r}")
        object.__setattr__(self, "dirichlet_grid", tuple(float(c) for c in grid))
        if (_is_number(self.dirichlet_steps) and self.dirichlet_steps < 0) or \
                not (_is_number(self.dirichlet_holdout) and 0.0 < self.dirichlet_holdout < 1.0):
            raise SymmergeError(f"learned alignment needs dirichlet_steps >= 0 and dirichlet_holdout in (0, 1), got "
                                f"{self.dirichlet_steps}, {self.dirichlet_holdout}")
        for name in ("steps", "batch", "positions", "max_length", "check_batches", "augment"):  # the flags' ranges
            check_range(f"learn_{name}", getattr(self, name))
        if not (_is_number(self.lr) and self.lr > 0):
            raise SymmergeError(f"learned alignment needs lr > 0, got {self.lr}")
        self._check_counts()
        if not (_is_number(self.alpha_low) and _is_number(self.alpha_high)):
            raise SymmergeError(f"--learn-alpha-low/--learn-alpha-high must be numbers in [0, 1], got "
                                f"{self.alpha_low!r} and {self.alpha_high!r}")
        if not 0.0 <= self.alpha_low <= self.alpha_high <= 1.0:  # low = high: every step at that one α
            raise SymmergeError(f"--learn-alpha-low/--learn-alpha-high: the learned alignment's α range must satisfy "
                                f"0 <= low <= high <= 1, got {self.alpha_low:g} and {self.alpha_high:g}")
        if not (_is_number(self.holdout) and 0.0 <= self.holdout < 1.0):
            raise SymmergeError(f"holdout fraction must be in [0, 1), got {self.holdout}")

    def _check_counts(self) -> None:
        """The seed, the budget and the early-stopping and Dirichlet counts: whole numbers (seconds: a number) in
        range, else one error naming the field."""
        in_range("--learn-budget", 0, self.budget)
        check_seed("--learn-seed", self.seed)
        for name, minimum in (("seed", None), ("check_every", 1), ("patience", 0), ("dirichlet_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral) or (minimum is not None and value < minimum):
                at_least = "" if minimum is None else f" >= {minimum}"
                raise SymmergeError(f"LearnSettings(): {name} must be a whole number{at_least}, got {value!r}")


@keywords_checked
@dataclass(frozen=True)
class AlignOptions:
    """How to align: ``symmetries`` (``--symmetries``; default ``recommended``, as every command: the groups of
    :data:`RECOMMENDED` the model has), ``rescale`` (``joint``, ``sequential`` or
    ``none``; only used when ``rescale`` is among the symmetries), ``layers`` (only these layers),
    ``residual`` (``largest``: the largest function-preserving group of the family's residual stream —
    O(d) for RMSNorm, O(d−1) for pre-LN LayerNorm after folding the norms, permutations for post-LN;
    ``permutation``: LayerNorm streams keep to permutations), ``untie`` (tied LM heads become heads of
    their own, so that the final norm can fold into them: the output then has an untied head),
    ``max_sweeps`` (cap of the coordinate descent over coupled groups), ``descent_tol`` (it stops when a
    sweep lowers the objective by less than this fraction: :data:`DESCENT_TOL`), ``verify`` / ``verify_tol``
    (the equivalence check), ``device`` (cost GEMMs), ``workers`` (layers whose FFN cost GEMM and exact
    assignment are solved at once on a thread pool: None = one per core, 1 = one after another; the
    elements are bit-identical either way). ``restarts``, ``solver_budget``, ``solver_seed``: the data-free
    solver's search (:func:`symmerge.pipeline.engine.search`): after the plain starts (today's, the identity,
    a canonical frame), ``restarts`` restarts (None, the default: no search, the one descent as before it) drawn
    with ``solver_seed``, none begun after ``solver_budget`` seconds (None: no limit; 0: the first descent
    alone, as before the search); the lowest objective is kept. ``ends_weight``: the data-free objective counts the
    stream's ends (embeddings, task heads, norms, the writers' biases: the tensors no per-layer group moves) this
    many times (1, the default: the plain squared distance; :func:`symmerge.pipeline.engine.weighted_ends`).
    ``depth_decay``: the data-free objective weighs the per-layer groups' tensors less with depth, geometrically from
    the first layer (once) to the last (``1/depth_decay``; 1, the default: every layer once;
    :func:`symmerge.pipeline.engine.depth_weights`).

    ``match``: what the elements are fitted to — ``weights`` (data-free: the L2 distance of the
    weights), ``activations`` (statistics of both models' activations on ``align_data``: the residual
    stream, per-head queries/keys/values, FFN units), ``learned`` (starting from the best closed form,
    the continuous elements — the residual transform, per-head invertible maps, scales — optimised so
    that the interpolated model matches the interpolated predictions on ``align_data``; see
    :mod:`symmerge.pipeline.learn`). ``align_data``: a data file or :class:`~symmerge.io.data.Data` (the
    same formats as ``--data``; labels, if present, are ignored), of which ``align_samples`` examples
    are used; ``learn``: settings of the learned alignment (:class:`LearnSettings`)."""

    symmetries: tuple | str = DEFAULT_SYMMETRIES
    rescale: str = "joint"
    layers: tuple | None = None
    residual: str = "largest"
    untie: bool = False
    max_sweeps: int = 200
    descent_tol: float = DESCENT_TOL
    match: str = DEFAULT_MATCHER
    align_data: object = None
    align_samples: int = 1000
    learn: "LearnSettings" = None
    verify: bool = True
    verify_tol: float | None = None
    device: object = "cpu"
    workers: int | None = None
    restarts: int | None = None
    solver_budget: float | None = None
    solver_seed: int = 0
    ends_weight: float = 1.0
    depth_decay: float = 1.0
    recommended: bool = False  # symmetries came from 'recommended': resolve against each model

    def __post_init__(self):
        listed = isinstance(self.symmetries, (str, list)) and not is_recommended(self.symmetries)
        if self.recommended is True and listed:
            # recommended is the resolution's own mark: beside a list it replaced the list in silence
            raise UsageError(f"AlignOptions(): recommended=True asks for 'recommended', symmetries={self.symmetries!r} "
                             "for a list: give one (symmetries='recommended' is the default)")
        if is_recommended(self.symmetries):
            object.__setattr__(self, "recommended", True)
        object.__setattr__(self, "symmetries", parse_symmetries(self.symmetries))
        if self.rescale not in RESCALE_MODES:
            raise SymmergeError(f"unknown rescale mode {self.rescale!r}; choose one of {', '.join(RESCALE_MODES)}")
        if self.residual not in RESIDUAL_CHOICES:
            raise SymmergeError(f"unknown residual group {self.residual!r}; choose {' or '.join(RESIDUAL_CHOICES)}")
        if self.matcher.needs_data and self.align_data is None:
            raise SymmergeError(f"--match {self.match} needs unlabeled data: pass --align-data FILE")
        check_range("align_samples", self.align_samples)
        if self.learn is None:
            object.__setattr__(self, "learn", LearnSettings())
        if not isinstance(self.learn, LearnSettings):
            raise UsageError(f"learn must be a LearnSettings (symmerge.LearnSettings(steps=...)), got "
                             f"{type(self.learn).__name__}")
        if not (_is_number(self.descent_tol) and 0.0 <= self.descent_tol < 1.0):
            raise SymmergeError(f"descent_tol must be in [0, 1), got {self.descent_tol}")
        check_range("max_sweeps", self.max_sweeps)
        if self.restarts is not None and (isinstance(self.restarts, bool) or not isinstance(self.restarts, int)
                                          or self.restarts < 0):
            raise SymmergeError(f"restarts must be a whole number >= 0 (or None: the default), "
                                f"got {self.restarts!r}")
        if self.solver_budget is not None and not _is_number(self.solver_budget):
            raise SymmergeError(f"the solver budget must be a number of seconds >= 0 (or None: no limit), "
                                f"got {self.solver_budget!r}")
        check_range("solver_budget", self.solver_budget)
        check_seed("--solver-seed", self.solver_seed)
        if not (_is_number(self.ends_weight) and self.ends_weight > 0):
            raise SymmergeError(f"the ends weight must be a finite number > 0, got {self.ends_weight!r}")
        if not (_is_number(self.depth_decay) and self.depth_decay > 0):
            raise SymmergeError(f"the depth decay must be a finite number > 0, got {self.depth_decay!r}")
        if self.verify_tol is not None and not (_is_number(self.verify_tol) and self.verify_tol >= 0):
            raise SymmergeError(f"--verify-tol must be a finite number >= 0 (the largest relative output difference "
                                f"accepted; --no-verify skips the check), got {self.verify_tol!r}")
        object.__setattr__(self, "layers", _layers(self.layers))
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise SymmergeError(f"workers must be a whole number >= 1 (or None: one per core), got {self.workers!r}")

    @property
    def matcher(self):
        """The :class:`~symmerge.pipeline.matchers.Matcher` of ``match``: what it can do."""
        return matcher(self.match)

    @property
    def dual(self) -> bool:
        """Whether the alignment moves every model, the anchor too, into a frame between them (the dual learned
        frame, :mod:`symmerge.pipeline.dual`): ``learn.frame == "dual"`` with a matcher that learns. The other
        matchers move A onto B whatever ``learn`` says, as they ignore every learned setting; the one test of it."""
        return self.learn.frame == "dual" and self.matcher.learns

    def streamed_refusal(self, flag: str = "streaming") -> str | None:
        """Why the data-free alignment streamed from the files (``align --stream``, each model of ``merge --mode
        stream``; :func:`~symmerge.pipeline.stream.align_streaming`) cannot align with these options (None: it can):
        its matcher must stream, and it aligns no residual stream, so ``untie`` and a ``residual`` group other than
        the default (which change what the in-memory alignment gives) are refused rather than left out. ``flag``
        names the streamed mode in the text."""
        refusal = streaming_refusal(self.match, flag)
        if refusal is None and (self.untie or self.residual != RESIDUAL_CHOICES[0]):
            refusal = f"{flag} does not align the residual stream; --untie and --residual do not apply"
        return refusal

    @property
    def effective_rescale(self) -> str:
        return self.rescale if SCALES in self.symmetries else "none"

    def solver_options(self, device=None) -> Options:
        return Options(frozenset(self.symmetries), self.effective_rescale, device, self.workers)

    @classmethod
    def of(cls, options) -> "AlignOptions":
        """``options`` (None: the defaults), or one :class:`UsageError` when it is no :class:`AlignOptions`."""
        hint = f" (symmetries go in AlignOptions(symmetries={options!r}))" if isinstance(options, str) else ""
        return options_argument(options, cls, hint=hint)

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
        names = tuple(s for s in RECOMMENDED if s in available or (s == SCALES and available))
        return replace(self, symmetries=names, recommended=False)

    def for_model(self, model) -> "AlignOptions":
        """:meth:`resolved` against the groups ``model`` (a transformers model) has."""
        if not self.recommended:
            return self
        from .bound import bind

        return self.resolved(bind(model, self.layers, self.residual).symmetries)
