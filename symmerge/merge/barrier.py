"""Loss barriers along θ(α) = α·θ_A + (1 − α)·θ_B, without and with alignment of A to B.

The Python API behind ``symmerge barrier``: :func:`barrier_study` returns the ``barrier.json``
content (``alphas``; ``curves`` with one entry per variant — ``"none"`` always, plus each alignment
spec — holding ``loss``, ``accuracy`` lists and the scalar ``barrier``), :func:`write_study` writes
``barrier.json`` and ``barrier.png`` (and ``subsets.png`` when subset matching was requested). Each
aligned variant interpolates between the aligned A and the anchor B *in the same parameterisation*
(:class:`~symmerge.pipeline.align.Alignment` returns both).
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.distance import distance_before_after
from ..device import resolve_device
from ..errors import SymmergeError, UsageError, keywords_checked, options_argument
from ..io.arguments import keeps_models, model_argument, models_argument
from ..option_ranges import whole_in_range
from ..io.data import Data, check_data, check_data_path, load_data
from ..io.model import atomic_dir, write_json
from ..io.tokenizers import check_tokenizers
from ..io.prefix import adapt_models
from ..pipeline.align import align_pair, as_model, load_align_data
from ..pipeline.data import read_once
from ..pipeline.options import (DEFAULT_REFINE, RECOMMENDED_NAME, AlignOptions, is_recommended, parse_symmetries,
                                refuse_unread_align_data, refuse_unread_joint)
from ..pipeline.report import build_report, match_fields
from ..progress import bar, stage, stage_printer
from ..evaluate.metrics import alpha_grid, check_same_shapes, evaluate, interpolate, interpolation_curve
from ..evaluate.plots import plot_curves, plot_subsets, study_title
from .option_defaults import BARRIER


def variant_name(spec) -> str:
    if is_recommended(spec):
        return RECOMMENDED_NAME
    names = parse_symmetries(spec)
    return ",".join(names) if names else "none"


MAX_POINTS = 10_001  # --points: α in steps of 1e-4 at most (a typo's 10¹⁰ points would fill the memory first)


@keywords_checked
@dataclass(frozen=True)
class BarrierOptions:
    """Everything a barrier study needs besides the models and the data (one object, shared with the CLI):
    ``aligns``: the alignment variants (symmetry lists, or 'recommended': the groups of the recommended set
    the models have; a curve is named by the symmetries it aligned); ``points``: α values on [0, 1];
    ``align``: the other alignment options (:class:`AlignOptions`; its ``symmetries`` are each variant's, its
    ``align_data`` the unlabeled data of the data-driven matchers and of REPAIR); ``repair``: each variant also
    gets a curve ``"<variant>+repair"`` with REPAIR applied at every α (:mod:`symmerge.merge.repair`), on
    ``repair_channels`` (default REPAIR's) with statistics on the first ``repair_samples`` examples (None: all);
    ``temperature``: each variant also gets a curve ``"<variant>+temperature"``, θ(α)'s logits divided by the
    softmax temperature fitted at that α on the unlabeled ``align_data`` against the endpoints' mixed
    predictions (:mod:`symmerge.evaluate.temperature`, the calibration baseline of Ito et al.), with the
    fitted ``temperatures``;
    ``subsets``: layer-subset matching of two models (``single`` / ``last``); ``joint_rounds``,
    ``joint_refine``: the joint alignment of more than two models (:func:`barrier_many`)."""

    aligns: tuple = (RECOMMENDED_NAME,)
    points: int = BARRIER["points"]
    subsets: str | None = None
    device: object = "cpu"
    batch_size: int = 32
    max_examples: int | None = None
    allow_pickle: bool = False
    progress: bool = True
    align: AlignOptions = field(default_factory=AlignOptions)
    repair: bool = False
    repair_channels: tuple | None = None
    repair_samples: int | None = None
    allow_tokenizer_mismatch: bool = False
    joint_rounds: int = BARRIER["joint_rounds"]
    joint_refine: str | None = None
    temperature: bool = False

    def __post_init__(self):
        if isinstance(self.aligns, str):  # one variant: "attn,ffn" is one curve, not one per character
            object.__setattr__(self, "aligns", (self.aligns,))
        if not isinstance(self.aligns, (tuple, list)):
            raise UsageError(f"BarrierOptions(): aligns is a tuple of variants such as ('none', 'attn,ffn'), got "
                             f"{self.aligns!r}")
        if not isinstance(self.align, AlignOptions):
            raise UsageError(f"BarrierOptions(): align must be an AlignOptions (the variants' symmetries go in "
                             f"aligns=), got {type(self.align).__name__}")
        if isinstance(self.points, bool) or not isinstance(self.points, int) or self.points < 2:
            raise SymmergeError(f"--points must be a whole number >= 2 (the endpoints), got {self.points!r}")
        if self.points > MAX_POINTS:
            raise SymmergeError(f"--points must be at most {MAX_POINTS} (α in steps of {1 / (MAX_POINTS - 1):g}; "
                                f"each point evaluates the whole --data once), got {self.points}")
        for flag, value in (("--batch-size", self.batch_size), ("--max-examples", self.max_examples)):
            whole_in_range(flag, 1, value)  # the flags' declared minimum (symmerge/options/declared.py); None: unset


def _options(options, keywords: dict, name: str) -> BarrierOptions:
    """The :class:`BarrierOptions` of a call: given, or built from its fields as keywords."""
    def build(**kw) -> BarrierOptions:
        try:
            return BarrierOptions(**kw)
        except TypeError as e:
            raise UsageError(f"{name}(): {e}") from None

    return options_argument(options, BarrierOptions, keywords, build=build, owner=f"{name}(): ",
                            hint=" (the alignment options go in its align=)")


# how the models are interpolated, per frame (barrier.json's 'convention', the plan's 'interpolation')
CONVENTIONS = {"pair": "theta(alpha) = alpha*A + (1-alpha)*B; alpha=1 is A (aligned to B), alpha=0 is B",
               "joint": "pair 'i|j': theta(alpha) = alpha*model_i + (1-alpha)*model_j in the variant's frame"}


@dataclass(frozen=True)
class BarrierArm:
    """One alignment variant of a barrier study: its curve's ``name`` (the symmetries it resolved to, ``none``),
    what was asked for, and its alignment plan (:class:`~symmerge.pipeline.align_plan.AlignPlan`: the
    first model to the second — with more than two models, the maps every model's tensors get on the way into
    the joint frame —; None for the plain curve)."""

    name: str
    requested: str
    plan: object = None
    note: str | None = None

    @property
    def symmetries(self) -> tuple:
        return self.plan.symmetries if self.plan is not None else ()

    def describe(self, steps: bool = False) -> dict:
        out = {"name": self.name, "requested": self.requested, "symmetries": list(self.symmetries), "note": self.note}
        if self.plan is not None:
            out["alignment"] = self.plan.printed() if steps else self.plan.describe()
        return out


@dataclass(frozen=True)
class BarrierPlan:
    """A barrier study resolved before any weight is read (:func:`plan_barrier`): the models, the alignment
    variants (:class:`BarrierArm`, 'recommended' resolved once by
    :func:`~symmerge.pipeline.align_plan.plan_align`), the frame (``pair``: the first model aligned to the
    second, the anchor; ``joint``: every model into one frame), the interpolation points, the curves each arm
    gets (``+repair``, ``+temperature``), the evaluation data."""

    models: tuple
    model_type: str
    data: str
    alphas: tuple
    arms: tuple
    frame: str
    extras: tuple = ()  # the extra curves of each arm: '+temperature', '+repair'
    options: BarrierOptions = None

    def fields(self) -> dict:
        """The ``barrier.json`` fields the plan decides."""
        if self.frame == "pair":
            return {"model_a": self.models[0], "model_b": self.models[1], "alphas": list(self.alphas)}
        return {"models": list(self.models), "alphas": list(self.alphas)}

    def describe(self, steps: bool = False) -> dict:
        """The plan as ``barrier.json`` records it (``plan``); ``steps``: each arm's alignment steps too."""
        o = self.options
        return {"operation": "barrier", "frame": self.frame, "interpolation": CONVENTIONS[self.frame],
                "model_type": self.model_type, "data": self.data,
                "points": len(self.alphas), "batch_size": o.batch_size, "max_examples": o.max_examples,
                "device": str(o.device), "match": o.align.match,
                "curves": [a.name + x for a in self.arms for x in ("",) + self.extras],
                "arms": [a.describe(steps) for a in self.arms], "subsets": o.subsets,
                "joint": {"rounds": o.joint_rounds, "refine": o.joint_refine} if self.frame == "joint" else None}

    def printed(self) -> dict:
        """What ``symmerge barrier --print-plan`` prints."""
        return {**self.fields(), "plan": self.describe(steps=True)}


# what reads the study's data labels (named when a file lacks them)
PATH_READER = "the barrier (the loss and accuracy along the path, on --data; --align-data is the unlabeled one)"


def plan_barrier(models, data, options: BarrierOptions) -> BarrierPlan:
    """The :class:`BarrierPlan` of a study of ``models`` (two: A aligned to B; more: joint) on ``data`` with
    ``options``: read from the inputs' headers; every refusal of the study's options before any model is read."""
    from ..families import supported_model_types
    from ..pipeline.align_plan import check_headers, plan_align
    from .plan import config_or_none, model_type_of, plain_fallback
    from .repair import statistics_data

    o = options
    if len(models) < 2:
        raise SymmergeError(f"a barrier needs at least two models, got {len(models)}")
    if len(models) == 2:
        refuse_unread_joint(o.joint_rounds, o.joint_refine or DEFAULT_REFINE,
                            (BARRIER["joint_rounds"], DEFAULT_REFINE), "a pair (model A onto model B)", what="barrier")
    alphas = tuple(alpha_grid(o.points))
    if o.repair and o.align.align_data is None:
        raise SymmergeError("REPAIR needs unlabeled data for its statistics: pass align=AlignOptions(align_data=...) "
                            "(--align-data)")
    if o.temperature and o.align.align_data is None:
        raise SymmergeError("temperature calibration fits on unlabeled data: pass align=AlignOptions(align_data=...) "
                            "(--align-data)")
    if len(models) > 2 and o.align.dual:  # the star aligns each model onto a fixed anchor
        raise SymmergeError(f"the dual learned frame moves the anchor too, and a barrier of {len(models)} models "
                            "aligns each onto one fixed frame (joint alignment): use the one-sided frame, "
                            "or two models")
    refuse_unread_align_data(o.align, (o.repair, o.temperature))
    if len(models) > 2 and o.subsets:  # barrier_many had no such study: dropped in silence
        raise SymmergeError("--subsets compares two models; give exactly two")
    if len(models) > 2 and o.temperature:
        raise SymmergeError("--temperature calibrates the path between two models; give exactly two")
    statistics_data(None, o.repair_samples)  # a whole number >= 1, whether or not REPAIR runs
    if not isinstance(data, Data):
        check_data_path(data)
    labels = ("A", "B") if len(models) == 2 else tuple(f"model {i}" for i in range(len(models)))
    names = tuple(str(x) if isinstance(x, (str, Path)) else label for x, label in zip(models, labels))
    model_type = model_type_of(models[0])
    if model_type in supported_model_types():  # a family without a spec has the plain curve, checked when loaded
        for i in range(1, len(models)):  # what the study refuses of the inputs' headers (shapes, architectures)
            check_headers(models[0], models[i], (names[0], names[i]))
    arms = {"none": BarrierArm("none", "none")}
    config = config_or_none(models[0])
    for spec in o.aligns:
        if variant_name(spec) == "none":
            continue
        asked = o.align.with_(symmetries=spec)
        opts, note = plain_fallback(asked, model_type, config)
        if note:  # no spec, or settings its groups do not hold for: 'recommended' is the plain curve
            arms["none"] = BarrierArm("none", "none", note=note)
            continue
        # no model kept
        plan = replace(plan_align(models[0], models[1], opts, allow_pickle=o.allow_pickle, joint=len(models) > 2),
                       loaded=None)
        name = ",".join(plan.symmetries) or "none"
        if name not in arms:
            arms[name] = BarrierArm(name, asked.requested, plan if plan.symmetries else None, plan.note)
    extras = tuple(x for x, on in (("+temperature", o.temperature), ("+repair", o.repair)) if on)
    data_name = data.path if isinstance(data, Data) else str(data)
    return BarrierPlan(models=names, model_type=model_type, data=data_name, alphas=alphas, arms=tuple(arms.values()),
                       frame="pair" if len(models) == 2 else "joint", extras=extras, options=o)


def _variants(plan: BarrierPlan, base: AlignOptions) -> dict:
    """{curve name: AlignOptions} of the plan's arms ('none': None), on ``base`` (the study's alignment options,
    its unlabeled data read)."""
    for arm in plan.arms:
        if arm.note and arm.plan is None:
            print(f"note: {arm.note}", file=sys.stderr)
    return {arm.name: base.with_(symmetries=arm.symmetries) if arm.plan is not None else None for arm in plan.arms}


def _star_anchor(models, names) -> int:
    """The index of the joint alignment's first anchor by merge's rule for N models (the model closest to the plain
    average, :func:`symmerge.merge.fuse.choose_anchor`): the frame of ``merge M1 M2 M3`` (it was model 0 here, so the
    N-way aligned average this study scored was not the model ``merge`` writes)."""
    from .fuse import choose_anchor
    from .heads import head_keys

    heads = set(head_keys(models[0]))
    body = [k for k in models[0].state_dict() if k not in heads]
    _, info = choose_anchor(models, names, body, None, None, None)
    return info["index"]


def evaluation_copies(models) -> tuple[list, dict | None]:
    """(the models a study aligns, interpolates and evaluates, the report's ``working_copies`` entry or None): float32
    copies of models stored in a half dtype (bfloat16, float16) or in several dtypes, else the models themselves.
    In bfloat16 the interpolated weights and every forward pass are rounded to 8 bits of mantissa, so two fine-tunes'
    barriers (a few thousandths of a nat) sat at that rounding's level; the path is the same, measured in float32."""
    from ..pipeline.verify import working_copies

    work = working_copies(models)
    if all(w is m for w, m in zip(work, models)):
        return list(models), None
    stored = [str(next(m.parameters()).dtype).removeprefix("torch.") for m in models]
    return work, {"dtype": "float32", "stored": stored,
                  "note": "interpolated and evaluated on float32 copies of the models (their stored weights, exactly): "
                          "the losses are the path's in float32 arithmetic, not in the stored dtype's rounding"}


@keeps_models
def barrier_study(model_a, model_b, data, options: BarrierOptions | None = None, **keywords) -> dict:
    """Interpolation curves and barriers of A and B on ``data``, for no alignment and each variant of
    ``options.aligns`` (a :class:`BarrierOptions`, or its fields as keywords), with REPAIR curves when
    ``options.repair`` (its statistics on ``options.align.align_data``, unlabeled, kept apart from the
    evaluation ``data``)."""
    model_argument(model_a, "model_a"), model_argument(model_b, "model_b")
    o = _options(options, keywords, "barrier_study")
    subsets, device, progress = o.subsets, o.device, o.progress
    batch_size, max_examples, allow_pickle, repair = o.batch_size, o.max_examples, o.allow_pickle, o.repair
    repair_channels, repair_samples = o.repair_channels, o.repair_samples
    t0 = time.perf_counter()
    plan = plan_barrier([model_a, model_b], data, o)  # every refusal before a model is read; the arms resolved
    alphas = list(plan.alphas)
    base = o.align
    dev = resolve_device(device)
    names = list(plan.models)
    tokenizer = check_tokenizers(list(zip(names, (model_a, model_b))), o.allow_tokenizer_mismatch)
    with stage(f"loaded {names[0]} and {names[1]}", enabled=progress and isinstance(model_a, (str, Path))):
        a, b = as_model(model_a, allow_pickle, spec=False), as_model(model_b, allow_pickle, spec=False)
    (a, b), adapted = adapt_models([a, b], names)  # a base model and a fine-tune: both the fine-tune's class
    check_same_shapes(a, b, names)
    (a, b), evaluated_in = evaluation_copies([a, b])
    base = read_once(base, [a, b], progress=progress)  # read once for every variant
    variants = _variants(plan, base)
    with stage("loaded and checked the data", enabled=progress and not isinstance(data, Data)):
        if isinstance(data, Data):
            check_data(data, a)
            d = data
        else:
            d = load_data(data, a, batch_size=batch_size, max_examples=max_examples, labels_for=PATH_READER)
        check_data(d, b)
    result = {"model_a": names[0], "model_b": names[1], "data": d.path, "examples": d.n, **d.cut_info(),
              "alphas": alphas,
              "convention": CONVENTIONS["pair"],
              "rescale": base.rescale, "device": str(dev),
              "endpoints": {"A": evaluate(a, d, device=dev, progress=progress, desc="evaluating A"),
                            "B": evaluate(b, d, device=dev, progress=progress, desc="evaluating B")},
              "curves": {}, "distances": {}, "tokenizer": tokenizer, **({"base_adapted": adapted} if adapted else {}),
              **({"working_copies": evaluated_in} if evaluated_in else {})}
    a.to("cpu"), b.to("cpu")
    for v, opts in variants.items():
        t = time.perf_counter()
        if opts is None:
            moved, end_b, info = a, b, {}
        else:
            with stage(f"aligned A to B ({v})", enabled=progress):
                res = align_pair(a, b, opts, progress=stage_printer(desc=f"aligning ({v})") if progress else None)
            moved, end_b, rep = res.model, res.anchor, res.report
            info = {"distance_before": rep["distance_before"], "distance_after": rep["distance_after"],
                    "verify_max_rel_diff": rep.get("verify_max_rel_diff"), "align_seconds": rep["seconds"],
                    "match_seconds": rep.get("match_seconds"), **match_fields(rep)}
            result["distances"][v] = distance_before_after(a, b, moved, res.instances, end_b, res.bound.layer_of)
        curve = interpolation_curve(moved, end_b, d, alphas, device=dev, progress=progress, label=v)
        moved.to("cpu"), end_b.to("cpu")
        result["curves"][v] = {**curve, **info, "seconds": time.perf_counter() - t}
        if o.temperature:
            t = time.perf_counter()
            result["curves"][v + "+temperature"] = {**tempered_curve(moved, end_b, d, alphas, base, dev, progress, v),
                                                    **info, "seconds": time.perf_counter() - t}
        if repair:
            t = time.perf_counter()
            result["curves"][v + "+repair"] = {**repaired_curve(moved, end_b, d, alphas, base, dev, progress, v,
                                                                channels=repair_channels, samples=repair_samples),
                                               **info, "seconds": time.perf_counter() - t}
    if subsets:
        syms = next((o.symmetries for o in variants.values() if o is not None), ("attn",))
        result["subsets"] = subset_matching(a, b, d, syms, mode=subsets, device=dev, progress=progress,
                                            options=base)
    result["seconds"] = time.perf_counter() - t0
    return build_report(plan, result)


@keeps_models
def repaired_curve(model_a, model_b, data: Data, alphas, options: AlignOptions, device=None, progress: bool = True,
                   label: str = "", channels=None, samples: int | None = None) -> dict:
    """:func:`interpolation_curve` with REPAIR at every α (endpoint statistics gathered once on the
    alignment data of ``options``, its first ``samples`` examples; ``channels``: default REPAIR's)."""
    from .repair import DEFAULT_CHANNELS, endpoint_stats, repair, statistics_data

    stats_data = statistics_data(load_align_data(options, model_b), samples)
    endpoints = [model_a.to(device), model_b.to(device)]
    stats = endpoint_stats(endpoints, stats_data)
    channels = channels or DEFAULT_CHANNELS

    def repaired(probe, alpha):
        return repair(probe, endpoints, [alpha, 1.0 - alpha], stats_data, channels=channels, stats=stats)[0]

    return interpolation_curve(model_a, model_b, data, alphas, device=device, progress=progress,
                               label=f"{label}+repair", transform=repaired)


@keeps_models
def tempered_curve(model_a, model_b, data: Data, alphas, options: AlignOptions, device=None, progress: bool = True,
                   label: str = "") -> dict:
    """:func:`interpolation_curve` with θ(α)'s softmax temperature fitted at every α on the unlabeled
    alignment data of ``options`` (:class:`~symmerge.evaluate.temperature.Calibrator`); ``temperatures``: the
    fitted T per α (1 at the endpoints)."""
    from ..evaluate.temperature import T_RANGE, Calibrator

    calibrate = Calibrator(model_a, model_b, list(load_align_data(options, model_b)))
    curve = interpolation_curve(model_a, model_b, data, alphas, device=device, progress=progress,
                                label=f"{label}+temperature", transform=calibrate)
    temperatures = [calibrate.fitted[float(a)] for a in alphas]
    lo, hi = T_RANGE
    at = [a for a, t in zip(alphas, temperatures) if t > 0.999 * hi or t < 1.001 * lo]
    if not at:
        return {**curve, "temperatures": temperatures}
    where = ", ".join(f"{a:.3g}" for a in at)
    note = (f"the fitted temperature stopped at the bound of [{lo:g}, {hi:g}] at α = {where}: "
            "the optimum lies beyond it, and the curve there is scored at the bound")
    note = "; ".join(x for x in (curve.get("note"), note) if x)
    return {**curve, "temperatures": temperatures, "temperatures_at_bound": at, "note": note}


@keeps_models
def subset_matching(model_a, model_b, data: Data, symmetries=("attn",), mode: str = "single",
                    alpha: float = 0.5, rescale: str = "joint", device=None, progress: bool = True,
                    options: AlignOptions | None = None) -> dict:
    """Align A to B on a subset of layers only, then evaluate θ(α) (paper Fig. 6).

    ``mode="single"``: only layer i, for each i; ``mode="last"``: only the last k layers, k = 1..L.
    Also reports the unmatched (no layer) and fully matched references."""
    if mode not in ("single", "last"):
        raise SymmergeError(f"subset mode must be 'single' or 'last', got {mode!r}")
    check_same_shapes(model_a, model_b)
    opts = (options or AlignOptions(rescale=rescale)).with_(symmetries=symmetries)
    n = model_a.config.num_hidden_layers
    subsets = [[i] for i in range(n)] if mode == "single" else [list(range(n - k, n)) for k in range(1, n + 1)]
    probe = copy.deepcopy(model_b)

    def midpoint_eval(res):
        end_b = model_b if res is None else res.anchor
        probe.load_state_dict(interpolate((model_a if res is None else res.model).state_dict(), end_b.state_dict(),
                                          alpha))
        return evaluate(probe, data, device=device, progress=False)

    ref = midpoint_eval(None)
    rows = []
    for layers in bar(subsets, desc=f"subset matching ({mode})", unit="subsets", disable=None if progress else True):
        res = align_pair(model_a, model_b, opts.with_(layers=layers))
        r = midpoint_eval(res)
        rows.append({"layers": layers, "loss": r["loss"], "accuracy": r["accuracy"],
                     "distance_after": res.report["distance_after"]})
    full = align_pair(model_a, model_b, opts)
    r = midpoint_eval(full)
    return {"mode": mode, "alpha": alpha, "symmetries": list(opts.symmetries), "unmatched": ref,
            "all_layers": {"loss": r["loss"], "accuracy": r["accuracy"],
                           "distance_after": full.report["distance_after"]},
            "subsets": rows}


def write_study(result: dict, out) -> Path:
    """Atomically write ``out/barrier.json``, ``out/barrier.png`` (+ ``out/subsets.png``)."""
    out = Path(out)
    with atomic_dir(out) as tmp:
        write_json(tmp / "barrier.json", result)
        plot_curves(result["alphas"], result["curves"], tmp / "barrier.png", title=study_title(result))
        if "subsets" in result:
            plot_subsets(result["subsets"], tmp / "subsets.png", title=study_title(result))
    return out


def _load_many(models, names, allow_pickle: bool, progress: bool) -> tuple[list, list, dict | None]:
    """(the models studied, the base-class inputs read as the fine-tunes' class, the ``working_copies`` entry):
    loaded, of one shape, on float32 copies where stored in a half dtype (:func:`evaluation_copies`)."""
    with stage(f"loaded {len(models)} models", enabled=progress):
        loaded = [as_model(x, allow_pickle) for x in models]
    loaded, adapted = adapt_models(loaded, names)  # base-class models read as the fine-tunes' class
    for i in range(1, len(loaded)):
        check_same_shapes(loaded[0], loaded[i], (names[0], names[i]))
    loaded, evaluated_in = evaluation_copies(loaded)
    return loaded, adapted, evaluated_in


@keeps_models
def barrier_many(models, data, options: BarrierOptions | None = None, **keywords) -> dict:
    """N ≥ 2 models: for no alignment and each variant of ``options.aligns`` (a :class:`BarrierOptions`, or
    its fields as keywords; every model brought into one frame by joint alignment,
    :func:`~symmerge.pipeline.joint.align_joint`), the pairwise barrier matrix (the interpolation curve of
    every pair), the N-way plain average's loss and accuracy, beside each model's and the ensemble's (mean
    predicted probabilities)."""
    from ..pipeline.joint import align_joint, mean_state_dict
    from ..evaluate.metrics import evaluate_ensemble
    from ..pipeline.verify import with_state_dict

    models = models_argument(models)
    o = _options(options, keywords, "barrier_many")
    device, progress, allow_pickle = o.device, o.progress, o.allow_pickle
    batch_size, max_examples, joint_rounds, joint_refine = o.batch_size, o.max_examples, o.joint_rounds, o.joint_refine
    t0 = time.perf_counter()
    plan = plan_barrier(list(models), data, o)
    alphas = list(plan.alphas)
    base = o.align
    dev = resolve_device(device)
    names = list(plan.models)
    tokenizer = check_tokenizers(list(zip(names, models)), o.allow_tokenizer_mismatch)  # before a model is read
    loaded, adapted, evaluated_in = _load_many(models, names, allow_pickle, progress)
    base = read_once(base, loaded, progress=progress)  # read once for every variant
    variants = _variants(plan, base)
    with stage("loaded and checked the data", enabled=progress and not isinstance(data, Data)):
        d = data if isinstance(data, Data) else load_data(data, loaded[0], batch_size=batch_size,
                                                          max_examples=max_examples, labels_for=PATH_READER)
        for x in loaded:
            check_data(d, x)
    endpoints = [evaluate(x, d, device=dev, progress=progress, desc=f"evaluating {n}") for x, n in zip(loaded, names)]
    for x in loaded:
        x.to("cpu")
    result = {"models": names, "data": d.path, "examples": d.n, **d.cut_info(), "alphas": alphas,
              "convention": CONVENTIONS["joint"],
              "device": str(dev), "endpoints": dict(zip(names, endpoints)),
              "endpoints_mean": {k: sum(e[k] for e in endpoints) / len(endpoints) for k in ("loss", "accuracy")},
              "ensemble": evaluate_ensemble(loaded, d, device=dev, progress=progress), "variants": {},
              "tokenizer": tokenizer, **({"base_adapted": adapted} if adapted else {}),
              **({"working_copies": evaluated_in} if evaluated_in else {})}
    for x in loaded:
        x.to("cpu")
    n = len(loaded)
    star = _star_anchor(loaded, names) if any(opts is not None for opts in variants.values()) else None
    for v, opts in variants.items():
        t = time.perf_counter()
        info: dict = {}
        if opts is None:
            frames = loaded
        else:
            with stage(f"aligned {n} models jointly ({v})", enabled=progress):
                joint = align_joint(loaded, opts, anchor=star, names=names, max_rounds=joint_rounds,
                                    progress=progress, **({} if joint_refine is None else {"refine": joint_refine}))
            frames = joint.models
            info = {"joint": {k: val for k, val in joint.report.items() if k != "models"},
                    "verify_max_rel_diff": max((m["verify_max_rel_diff"] or 0.0) for m in joint.report["models"])}
        matrix = [[0.0] * n for _ in range(n)]
        pairs = {}
        for i in range(n):
            for j in range(i + 1, n):
                curve = interpolation_curve(frames[i], frames[j], d, alphas, device=dev, progress=progress,
                                            label=f"{v} {i}|{j}")
                pairs[f"{i}|{j}"] = curve
                matrix[i][j] = matrix[j][i] = curve["barrier"]
        keys = [k for k, p in frames[0].state_dict().items() if p.is_floating_point()]
        average = with_state_dict(frames[0], mean_state_dict([f.state_dict() for f in frames], keys))
        avg = evaluate(average, d, device=dev, progress=progress, desc=f"evaluating the {n}-way average ({v})")
        mean_acc = result["endpoints_mean"]["accuracy"]
        result["variants"][v] = {
            "barrier_matrix": matrix, "pairs": pairs,
            "mean_barrier": sum(matrix[i][j] for i in range(n) for j in range(i + 1, n)) / (n * (n - 1) / 2),
            "average": {**avg, "accuracy_vs_endpoints_mean": avg["accuracy"] / mean_acc if mean_acc else None,
                        "loss_minus_best_endpoint": avg["loss"] - min(e["loss"] for e in endpoints)},
            **info, "seconds": time.perf_counter() - t}
        for f in frames:
            f.to("cpu")
    result["seconds"] = time.perf_counter() - t0
    return build_report(plan, result)


def write_many(result: dict, out) -> Path:
    """Atomically write ``out/barrier.json`` and ``out/barrier.png`` of :func:`barrier_many`."""
    from ..evaluate.plots import plot_many

    out = Path(out)
    with atomic_dir(out) as tmp:
        write_json(tmp / "barrier.json", result)
        plot_many(result, tmp / "barrier.png")
    return out
