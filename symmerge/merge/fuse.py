"""High-level fusion, the Python API behind ``symmerge merge``: a short pipeline over one options object
(:class:`MergeOptions`, shared with the CLI):

    load → choose anchor → align → statistics (on the aligned models) → merge (→ REPAIR) → task heads → evaluate

Anchor (left unchanged, every other model aligned to it): the given one; else the base model for
task-vector methods (task arithmetic, TIES, DARE, DARE-TIES); else, for two models, the second (the
paper's convention, as in ``symmerge barrier``); else the model closest (L2) to the plain average of
all models. Alignment returns every model — the anchor too — in the same parameterisation (norms
folded when the residual stream's group needs it). Heads (parameters outside the base model): a
language model's (``lm_head``: its rows are the vocabulary) is merged like the body; a task head
(``classifier.*``) is kept from one model (``head_from``), or merged when every model has the same label
space (``heads``: ``auto``, ``keep``, ``merge``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ..core.distance import distance_before_after
from ..device import resolve_device
from ..errors import SymmergeError, UsageError, keywords_checked, options_argument, unexpected_keyword
from ..evaluate.metrics import evaluate
from ..io.checkpoint import parse_size
from ..io.data import Data, check_data, check_data_path, has_labels, load_data
from ..io.arguments import keeps_models, model_argument, models_argument
from ..io.reader import load_model
from ..io.prefix import adapt_models, merge_anchor_entry, not_merged
from ..io.sentence_transformers import check_pipelines
from ..io.tokenizers import check_tokenizers
from ..pipeline.align import align_pair, as_model, canonical, load_align_data
from ..pipeline.bound import bind
from ..pipeline.data import read_once
from ..option_ranges import check as check_range, model_index, whole_in_range
from ..pipeline.distill import DistillSettings, check_lr, check_steps, distill
from ..pipeline.joint import align_joint
from ..pipeline.options import JOINT_REFINE, RECOMMENDED_NAME, AlignOptions, refuse_unread_align_data
from ..pipeline.recommend import frame_readers, held_symmetries, moves_heads_input, moving, recommended
from ..pipeline.report import match_fields
from ..progress import line, stage, stage_printer
from ..pipeline.verify import with_state_dict
from .registry import get_method
from .repair import DEFAULT_CHANNELS, parse_channels, repair, statistics_data
from .option_defaults import MERGE
from .heads import (HEAD_POLICIES, anchor_proxy, check_bodies, check_heads_mergeable, head_keys, head_policy,
                    head_report, untied, with_tied)
from .statistics import FISHER_VARIANTS, gather
from .distances import SquaredSums
from .outputs import check_result
from .plan import MergePlan, anchor_rule, average_keys, closest_to_average, merge_report, plan_merge
from .steps import plain_merge_steps



def check_model_count(m, n: int, has_base: bool) -> None:
    """A merge takes as many models as the method takes (:meth:`Method.check_inputs`), as a config's
    ``merge_method`` does (and mergekit): one model is a merge too (with a base, its task vector applied; without,
    the model itself)."""
    m.check_inputs(n, has_base)


@keywords_checked
@dataclass(frozen=True)
class MergeOptions:
    """Everything a merge needs besides the models (immutable: :meth:`check` returns the validated copy the
    plan keeps, ``dataclasses.replace`` makes a changed one). ``align``: the alignment options (default: the
    recommended set, resolved against the anchor; no symmetries: no alignment); ``data``: one data file
    (or :class:`~symmerge.io.data.Data`) for all models or one per model, for the statistics;
    ``eval_data``: the same for evaluation (scoring the inputs and the result, with ``evaluate``).
    Without ``eval_data``, evaluation falls back to ``data`` and says so (:meth:`evaluation_data`)."""

    method: str = "average"
    align: AlignOptions = field(default_factory=lambda: AlignOptions(symmetries=RECOMMENDED_NAME))
    anchor: object = None
    data: list = field(default_factory=list)
    eval_data: list = field(default_factory=list)
    weights: list | None = None
    params: dict = field(default_factory=dict)
    base: object = None
    heads: str = MERGE["heads"]
    head_from: int = MERGE["head_from"]
    device: object = "cpu"
    fisher_variant: str = MERGE["fisher_variant"]
    fisher_normalize: bool = False
    fisher_samples: int = MERGE["fisher_samples"]
    gram_normalize: bool = True
    batch_size: int = MERGE["batch_size"]
    max_examples: int | None = None
    max_length: int | None = None
    allow_pickle: bool = False
    allow_tokenizer_mismatch: bool = False  # merge models whose tokenizers differ (the report records it)
    evaluate: bool = True
    progress: bool = True
    repair: bool = False  # REPAIR the merged model on the alignment's unlabeled data (``align.align_data``)
    repair_channels: tuple = DEFAULT_CHANNELS  # the channels REPAIR corrects (symmerge.merge.repair)
    repair_samples: int | None = None  # REPAIR's statistics on the first this many examples (None: all)
    distill: int = MERGE["distill"]  # distillation steps toward the inputs' ensemble after the merge
    distill_lr: float = MERGE["distill_lr"]  # the distillation's learning rate (symmerge.pipeline.distill)
    joint: bool | None = None  # N models in one frame (None: when more than two models and no anchor/base)
    joint_rounds: int = MERGE["joint_rounds"]  # cap on the joint alignment's rounds after the star
    joint_refine: str = MERGE["joint_refine"]  # what those rounds re-solve: every group, or the permutations only
    mode: str = MERGE["mode"]  # symmerge.merge(...): auto, memory or stream (symmerge.merge.plan.choose_mode)
    shard_size: object = MERGE["shard_size"]  # the output's largest shard (streamed or written from memory)

    def __post_init__(self):
        for name in ("data", "eval_data"):  # one file (or Data) for every model, as the keyword form takes it
            if isinstance(getattr(self, name), (str, Path, Data)):
                object.__setattr__(self, name, [getattr(self, name)])
        if isinstance(self.align, (str, list, tuple)):  # a symmetry list, as merge_models(align=...) takes it
            object.__setattr__(self, "align", AlignOptions(symmetries=self.align))
        if not isinstance(self.align, AlignOptions):
            raise UsageError(f"MergeOptions(): align must be an AlignOptions or a symmetry list such as 'attn,ffn', "
                             f"got {type(self.align).__name__}")

    @classmethod
    def of(cls, options, keywords: dict, owner: str = "merge_models()") -> "MergeOptions":
        """The options of a call: ``options``, or made from ``keywords`` (:meth:`from_keywords`), never both;
        ``owner``: the entry called, as an unknown keyword's error names it."""
        hint = f" (a method goes in MergeOptions(method={options!r}))" if isinstance(options, str) else ""
        return options_argument(options, cls, keywords, build=lambda **kw: cls.from_keywords(**kw, _owner=owner),
                                hint=hint)

    @classmethod
    def from_keywords(cls, method: str = "average", align=RECOMMENDED_NAME, rescale: str | None = None,
                      verify: bool | None = None, evaluate_result: bool | None = None, data=None, eval_data=None,
                      _owner: str = "merge_models()", **kw) -> "MergeOptions":
        """The keyword form of :func:`merge_models` (``align``: a symmetry list or AlignOptions; ``rescale`` and
        ``verify`` are the alignment's, beside a symmetry list only; ``evaluate`` or ``evaluate_result``)."""
        known = [f.name for f in fields(cls)] + ["rescale", "verify", "evaluate_result"]
        unknown = sorted(set(kw) - set(known))
        if unknown:
            raise unexpected_keyword(_owner, unknown[0], known)
        if "evaluate" in kw and evaluate_result is not None:
            raise UsageError(f"{_owner}: evaluate and evaluate_result are one option: give one")
        evaluate = kw.pop("evaluate", evaluate_result)
        if isinstance(align, AlignOptions):
            given = [k for k, v in (("rescale", rescale), ("verify", verify)) if v is not None]
            if given:  # they were dropped in silence: the AlignOptions' own values ran
                raise UsageError(f"{_owner}: {' and '.join(given)} beside align=AlignOptions(...): give "
                                 f"{'it' if len(given) == 1 else 'them'} in the AlignOptions")
        else:
            align = AlignOptions(symmetries=align, rescale="joint" if rescale is None else rescale,
                                 verify=True if verify is None else verify)

        def items(x):
            return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]

        return cls(method="average" if method is None else method, align=align, data=items(data),
                   eval_data=items(eval_data), evaluate=True if evaluate is None else evaluate, **kw)

    def check(self, n: int) -> "MergeOptions":
        """Validate against ``n`` models before any expensive step; returns the validated options (a new
        object: the method's parameters checked and completed, the REPAIR channels parsed; ``anchor`` and
        ``head_from``, indices into the models, checked 0..n-1 by :func:`~symmerge.option_ranges.model_index`,
        a negative one refused); ``self`` is left as it is."""
        m = get_method(self.method)
        self._check_types()
        check_model_count(m, n, self.base is not None)
        params = m.check_params(dict(self.params or {}))
        for flag, value in (("--fisher-samples", self.fisher_samples), ("--batch-size", self.batch_size),
                            ("--max-examples", self.max_examples), ("--max-length", self.max_length)):
            whole_in_range(flag, 1, value)  # the flags' declared minimum (symmerge/options/declared.py); None: unset
        if self.fisher_variant not in FISHER_VARIANTS:
            raise SymmergeError(f"unknown Fisher variant {self.fisher_variant!r}; "
                                f"choose {' or '.join(FISHER_VARIANTS)}")
        if self.heads not in HEAD_POLICIES:
            raise SymmergeError(f"unknown head policy {self.heads!r}; choose {', '.join(HEAD_POLICIES)}")
        if n == 0:
            raise SymmergeError("nothing to merge: no models given")
        for flag, files in (("--data", self.data), ("--eval-data", self.eval_data)):
            if len(files) not in (0, 1, n):
                raise SymmergeError(f"{flag}: give one data file for all models or one per model ({n}), "
                                    f"got {len(files)}")
            for spec in files:
                if not isinstance(spec, Data):
                    check_data_path(spec, flag)
        if m.needs and not self.data:
            raise SymmergeError(f"method {m.name!r} needs data for its {m.needs} statistics: pass --data FILE")
        if m.needs == "activations" and len(self.data) > 1:
            raise SymmergeError(f"method {m.name!r} compares the models' activations on the same inputs: "
                                "give one --data")
        if m.needs_base and self.base is None:
            raise SymmergeError(f"method {m.name!r} needs a base model (the common pre-trained model): pass --base")
        if self.base is not None and not (m.needs_base or m.accepts_base):
            also = (" (a config's base_model is merged as one more model: list it among the models)"
                    if m.ignores_base else "")
            raise SymmergeError(f"method {m.name!r} does not use a base model{also}")
        parse_size(self.shard_size)  # a size it cannot read: refused before the merge, in either mode
        # an index (else a folder or a model): 0..n-1, checked with or without alignment
        if isinstance(self.anchor, int):
            model_index(self.anchor, n)
        elif isinstance(self.anchor, (str, Path)) and not Path(self.anchor).expanduser().exists():  # before any load
            raise SymmergeError(f"--anchor {self.anchor}: no such folder (an index into the models, 0..{n - 1}, or a "
                                "Hugging Face model folder)")
        model_index(self.head_from, n, what="--head-from index")  # the same rule: 0..n-1, a negative one refused
        if self.weights is not None and len(self.weights) != n:
            raise SymmergeError(f"got {len(self.weights)} weights for {n} models")
        if self.weights is not None:  # the method's rule for them, before any model is read (NaN: after the alignment)
            from .base import normalized_weights

            if m.check_weights is not None:
                m.check_weights(list(self.weights), params)
            else:
                normalized_weights(list(self.weights), n, normalize=m.normalize_weights)
        if self.repair and self.align.align_data is None:
            raise SymmergeError("REPAIR needs unlabeled data for its statistics: pass --align-data FILE")
        channels = parse_channels(self.repair_channels)
        statistics_data(None, self.repair_samples)  # a whole number >= 1
        check_lr(self.distill_lr)  # a bad learning rate refused whether or not --distill asks for steps
        if check_steps(self.distill):
            if self.align.align_data is None:
                raise SymmergeError("--distill needs unlabeled data to distil on: pass --align-data FILE")
        refuse_unread_align_data(self.align, (self.repair, check_steps(self.distill)))
        if self.joint and (self.anchor is not None or self.base is not None):
            raise SymmergeError("joint alignment brings every model into one common frame: it takes no --anchor "
                                "or --base (an anchor means the star: every model aligned to it)")
        check_range("joint_rounds", self.joint_rounds)  # the flag's declared range (symmerge/option_ranges.py)
        if self.joint_refine not in JOINT_REFINE:
            raise SymmergeError(f"unknown --joint-refine {self.joint_refine!r}; choose {', '.join(JOINT_REFINE)}")
        return replace(self, params=params, repair_channels=channels)

    def _check_types(self) -> None:
        """The fields a user gives by hand, of the types they take: one :class:`UsageError` naming the field."""
        if self.base is not None:
            model_argument(self.base, "base")
        if self.anchor is not None and not _is_index(self.anchor):
            model_argument(self.anchor, "anchor (an index into models, a folder or a model)")
        if not _is_index(self.head_from):
            raise UsageError(f"head_from must be an index into the models, got {self.head_from!r}")
        if self.joint not in (None, True, False):  # a str or a number was taken for its truth
            raise UsageError(f"joint must be True, False or None (the default: joint for more than two models "
                             f"without an anchor or a base), got {self.joint!r}")
        from .plan import MODES

        if self.mode not in MODES:
            raise SymmergeError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.params is not None and not isinstance(self.params, dict):
            raise UsageError(f"params must be a dict of the method's parameters ({{'density': 0.5}}), "
                             f"got {self.params!r}")
        if self.weights is not None and (not isinstance(self.weights, (list, tuple)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.weights)):
            raise UsageError(f"weights must be a list of numbers, one per model, got {self.weights!r}")

    def use_joint(self, n: int) -> bool:
        """Joint alignment (every model to the mean of the others) rather than the star: asked for, or by
        default for more than two models without an anchor or a base, with a matcher that runs jointly (all three:
        ``learned`` learns random convex combinations of the N models, :mod:`symmerge.pipeline.learn_joint`)."""
        if self.joint is not None:
            return self.joint
        return n > 2 and self.anchor is None and self.base is None and self.align.matcher.joint

    def evaluation_data(self, needs) -> tuple[list, str | None]:
        """(the files evaluation runs on, a note when they are the ``--data`` files): ``eval_data``;
        else ``data``, which for a method with statistics means scoring on the statistics' own data."""
        if self.eval_data or not self.data:
            return list(self.eval_data), None
        if needs and not all(f.labeled if isinstance(f, Data) else has_labels(f) for f in self.data):
            return [], ("no --eval-data given and --data has no labels (the statistics need none): the result is not "
                        "scored; pass labelled held-out data with --eval-data")
        if needs:
            return list(self.data), ("no --eval-data given: the evaluation used the statistics data (--data), so its "
                                     "scores are not held-out scores; pass held-out data with --eval-data")
        return list(self.data), ("no --eval-data given: the evaluation used --data (the method gathers no "
                                 "statistics from it)")

    def load_kw(self) -> dict:
        return {"batch_size": self.batch_size, "max_examples": self.max_examples, "max_length": self.max_length}


def _is_index(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _name(x, i) -> str:
    return str(x) if isinstance(x, (str, Path)) else f"model {i}"


# what reads the evaluation data's labels (named when a file lacks them)
EVALUATION_READER = "the evaluation (accuracy and loss of the merged model and its inputs; --eval-data, else --data)"


class _DataCache:
    """Data files loaded once each and validated against every model that uses them. The statistics' files
    (``--data``) are read with labels only where the statistics use them (the Fisher's): RegMean's Gram matrices
    and OT fusion's activations take unlabeled data; the evaluation's need labels."""

    def __init__(self, opts: MergeOptions, needs=None):
        self.opts, self.loaded = opts, {}
        self.stats_labels = needs not in ("gram", "activations")
        self.stats_reader = f"--method {opts.method}'s statistics (from each model's loss on the labels)"

    def for_model(self, i: int, model) -> Data:
        return self.get(_files_of(self.opts.data, i)[0], model, labels=self.stats_labels, reader=self.stats_reader)

    def get(self, spec, model, labels: bool = True, reader: str = EVALUATION_READER) -> Data:
        """``spec`` loaded (once) and checked against ``model``; ``reader``: what reads its labels, named when they
        are missing."""
        if isinstance(spec, Data):
            check_data(spec, model, use_labels=labels)
            return spec
        key = (str(spec), labels)
        if key not in self.loaded:
            self.loaded[key] = load_data(spec, model, labels=labels, labels_for=reader, **self.opts.load_kw())
        else:
            check_data(self.loaded[key], model)
        return self.loaded[key]


def tokenizer_inputs(models, names, opts: MergeOptions) -> list:
    """(name, model or folder) of every input whose tokenizer must agree: the models, the base, a given
    anchor folder."""
    extra = [(_name(x, label), x) for x, label in ((opts.base, "base"), (opts.anchor, "anchor"))
             if isinstance(x, (str, Path)) or (label == "base" and x is not None)]
    return list(zip(names, models)) + extra


def _files_of(files, i: int) -> list:
    """The files model ``i`` uses: the one file for all, or its own."""
    return list(files) if len(files) == 1 else [files[i]] if len(files) > 1 else []


def choose_anchor(models, names, body, anchor, base_model, base_name, allow_pickle=False, head_from=0):
    """(anchor model, info) by the one anchor rule (:func:`symmerge.merge.plan.anchor_rule`); ``anchor``:
    None, an index, or a model/folder. A given anchor of the base class (``BertModel``) beside models of its
    task class is read as the task class, as a base model is (:func:`symmerge.io.prefix.adapt_models`; the
    head it lacks is ``models[head_from]``'s, never compared: each model is aligned to an anchor carrying its
    own head); ``info["base_adapted"]`` says so."""
    index, rule = anchor_rule(len(models), anchor, base_model is not None)
    if rule == "base model":
        return base_model, {"index": None, "name": base_name, "rule": rule}
    if rule == "closest to the average":
        sds = [x.state_dict() for x in models]
        keys = average_keys(untied(models[0], body), head_keys(models[0]), lambda k: sds[0][k].dtype)
        idx, dists = closest_to_average(lambda k: [sd[k] for sd in sds], keys)
        return models[idx], {"index": idx, "name": names[idx], "rule": rule, "distances_to_average": dists}
    if index is not None:
        return models[index], {"index": index, "name": names[index], "rule": rule}
    anchor_model = as_model(anchor, allow_pickle)
    name = _name(anchor, "anchor")
    (*_, anchor_model), adapted = adapt_models(list(models) + [anchor_model], list(names) + [name], head_from)
    check_bodies([models[0], anchor_model], [names[0], name])
    info = {"index": None, "name": name, "rule": rule}
    if adapted:
        info["base_adapted"] = merge_anchor_entry(adapted[-1], name)
    return anchor_model, info


def resolve_alignment(targets, anchor_model, options: AlignOptions,
                      output_reader: str | None = None, held: dict | None = None) -> tuple[AlignOptions, str | None]:
    """The options every model is aligned with, and a note when 'recommended' had to leave a group out: the
    facts of these models handed to the one rule (:func:`symmerge.pipeline.recommend.recommended`) — the groups
    the anchor binds (the models share its body), the heads of every target checked against the anchor's, what
    reads the output frame (``output_reader``)."""
    def heads_check(why: str) -> None:
        for name, x in targets:
            if x is not anchor_model:
                check_heads_mergeable([x, anchor_model], [name, "the anchor"], labels=False, why=why)

    available = (bind(anchor_model, options.layers, options.residual).symmetries if options.recommended
                 else None)
    return recommended(options, available=available, heads_check=heads_check, output_reader=output_reader,
                       held=held)


def align_all(targets, anchor_model, body, options: AlignOptions, progress: bool = False):
    """Align every (name, model) of ``targets`` to the anchor (``options`` resolved, see
    :func:`resolve_alignment`); the anchor itself is brought into the same parameterisation. Returns
    (models, per-model reports)."""
    if options.dual and len(targets) > 2:  # each pair would move it
        raise SymmergeError(f"--learn-frame dual with {len(targets)} models runs jointly (every model moved into one "
                            "shared frame); the star aligns each model to one anchor: leave out the anchor, base or "
                            "--star")
    moved, reports = [], []
    anchor_form = canonical(anchor_model, options)
    for name, x in targets:
        if x is anchor_model:
            moved.append(anchor_form)
            reports.append({"model": name, "anchor": True})
            continue
        proxy = anchor_model if moving(options, moves_heads_input) else anchor_proxy(x, anchor_model, set(body))
        with stage(f"aligned {name} to the anchor", enabled=progress):
            res = align_pair(x, proxy, options, progress=stage_printer(desc=f"aligning {name}") if progress else None)
        moved.append(res.model)
        rep = res.report
        if rep.get("frame") == "dual":  # both models moved into a frame between them (pipeline/dual.py)
            moved = [res.anchor if m is anchor_form else m for m in moved]
            anchor_form = res.anchor
        reports.append({"model": name, "anchor": False, "distance_before": rep["distance_before"],
                        "distance_after": rep["distance_after"], "verify_max_rel_diff": rep.get("verify_max_rel_diff"),
                        "seconds": rep["seconds"], **match_fields(rep),
                        "distances": distance_before_after(x, proxy, res.model, *_aligned_groups(res))})
    return moved, reports


def _aligned_groups(res) -> tuple:
    """(the instances ``res`` aligned, the anchor in the aligned model's parameterisation, each of their tensors'
    layer): the ``per_module`` and ``per_layer`` tables of the align report (README: a layer's distance is over its
    instances' tensors), which a streamed aligned merge copies from it."""
    solved = [i for i in res.instances if i.name in res.report.get("per_module", {})]
    layer = {k: i.layer for i in solved if i.layer >= 0 for k in i.keys()}
    return solved, res.anchor, layer.get


def gather_stats(needs, models, names, cache: _DataCache, opts: MergeOptions, dev):
    """Per model (already aligned): the statistics a method ``needs`` on its data file; (stats, rows)."""
    stats, info = [], []
    for i, x in enumerate(models):
        d = cache.for_model(i, x)
        if opts.progress:
            line(f"{needs} statistics of {names[i]} on {d.path} ({d.n} examples)")
        s = gather(needs, x, d, device=dev, progress=opts.progress, variant=opts.fisher_variant,
                   normalize=opts.fisher_normalize, samples=opts.fisher_samples)
        stats.append(s.means() if needs == "gram" and opts.gram_normalize else s.tensors)
        info.append({"model": names[i], "data": d.path, "examples": s.examples, "seconds": s.seconds,
                     **d.cut_info()})
        x.to("cpu")
    return stats, info


@keeps_models
def merge_models(models, method: str | None = None, options: MergeOptions | None = None, plan=None, **keywords):
    """Merge ``models`` (transformers models or HF folders); returns ``(model, report)``.

    Give a :class:`MergeOptions`, or the same as keywords: ``method``; ``align`` (``"none"`` or a
    symmetry list such as ``"attn,ffn,rescale"``, ``"recommended"`` (default: the groups of
    :data:`~symmerge.pipeline.options.RECOMMENDED` the models have), or an :class:`AlignOptions`) with
    ``rescale`` and ``verify``; ``anchor`` (index into ``models``, a model/folder, or ``None`` for the default rule);
    ``data`` (a file or :class:`~symmerge.io.data.Data` for all models, or one per model: statistics);
    ``eval_data`` (the same, for evaluation with ``evaluate_result`` — with one file per model, the merged
    body is evaluated on file i with model i's head; without it, evaluation falls back to ``data`` and the
    report's ``evaluation.note`` says so); ``weights``, ``params``, ``base``, ``heads``, ``head_from``,
    ``device``, the statistics options, ``batch_size``, ``max_examples``, ``max_length``, ``allow_pickle``,
    ``progress``; ``plan``: its :class:`~symmerge.merge.plan.MergePlan` (made here, in memory, when not given).

    A short pipeline of named stages, each taking the record the one before returned and returning its own
    (frozen) record: :func:`_load_and_check` → :class:`Loaded` → :func:`_align` → :class:`Aligned` →
    :func:`_statistics` → :class:`Statistics` → :func:`_merge` → :class:`Merged` → :func:`_report` (the
    report) and :func:`_evaluate` → :class:`Evaluated`; writing is :func:`symmerge.merge.api.merge_to_folder`'s.
    """
    t0 = time.perf_counter()
    models = models_argument(models)
    options = MergeOptions.of(options, {**({} if method is None else {"method": method}), **keywords})
    if plan is not None and not isinstance(plan, MergePlan):
        raise UsageError(f"merge_models(): plan is a MergePlan (symmerge.merge.plan.plan_merge) or None, got "
                         f"{type(plan).__name__}")
    if plan is None:
        plan = plan_merge(models, options, mode="memory")
    elif plan.mode != "memory":
        raise SymmergeError(f"merge_models runs in memory; the plan streams ({plan.why})")
    options = plan.options or options  # the options the plan validated
    merged = _merge(_statistics(_align(_load_and_check(plan, options, models, t0))))
    report = _report(merged)
    evaluated = _evaluate(merged)
    if evaluated.evaluation is not None:
        report["evaluation"] = evaluated.evaluation
    report["timings"] = {**merged.timings, "evaluate": evaluated.seconds, "total": time.perf_counter() - t0}
    return merged.out.to("cpu").eval(), report


def align_models(models, options: MergeOptions, plan) -> "Aligned":
    """Only the first stages of a merge (:func:`_load_and_check`, :func:`_align`): ``models`` and
    ``options.base`` loaded, checked and brought into one frame by ``plan`` (its frame and anchor rule), for
    a caller that merges them its own way (``symmerge run`` with ``align:``). Returns the :class:`Aligned`
    record: ``aligned``, ``aligned_base``, ``alignment`` (the report's entry), and the :class:`Loaded` one
    (``loaded.tokenizer``, ``loaded.adapted``)."""
    return _align(_load_and_check(plan, plan.options or options, models, time.perf_counter()))


@dataclass(frozen=True)
class Loaded:
    """What :func:`_load_and_check` hands on: the inputs loaded and checked, every data file read, before any
    expensive step. ``opts``: the options as the later stages read them (``heads`` resolved from ``auto`` by the
    model class, generated alignment data sampled once); ``requested_heads``: ``heads`` as asked for."""

    plan: object  # the operation's MergePlan
    opts: MergeOptions
    requested_heads: str
    dev: object
    names: list
    models: list
    base_model: object
    base_name: str | None
    adapted: list  # base-class inputs read as the task class (symmerge.io.prefix.adapt_models)
    body: list  # the parameter names every input shares
    tokenizer: object
    embedding: object  # a sentence-transformers pipeline's facts, or None
    cache: _DataCache
    eval_files: list
    eval_note: str | None
    timings: dict  # 'generate' (when alignment data was sampled) and 'load', in seconds

    @property
    def m(self):
        """The plan's merge method."""
        return self.plan.method


@dataclass(frozen=True)
class Aligned:
    """What :func:`_align` hands on: every model (and the base) in one frame, and the report's ``alignment``."""

    loaded: Loaded
    aligned: list
    aligned_base: object
    alignment: dict
    anchor_adapted: list  # a base-class anchor read as the task class: reported, not merged
    seconds: float


@dataclass(frozen=True)
class Statistics:
    """What :func:`_statistics` hands on: the method's statistics on the aligned models (None: it needs none)."""

    aligned: Aligned
    stats: list | None
    info: list | None
    seconds: float


@dataclass(frozen=True)
class Merged:
    """What :func:`_merge` hands on: the merged model (``out``, REPAIRed when asked for) and what made it."""

    statistics: Statistics
    sds: list  # the aligned models' state dicts
    holder: object  # the aligned model whose head (and non-merged tensors) the result carries
    merged_sd: dict
    steps: list | None  # the executor's steps (None: a method with its own loop)
    result_warnings: list
    out: object
    repair: dict | None
    seconds: dict  # 'merge', and 'repair' / 'distill' when they ran
    distill: dict | None = None  # the distillation's report (not function-preserving), when asked for

    @property
    def timings(self) -> dict:
        """Every stage's seconds up to this one, in the order they ran."""
        st = self.statistics
        return {**st.aligned.loaded.timings, "align": st.aligned.seconds, "statistics": st.seconds, **self.seconds}


@dataclass(frozen=True)
class Evaluated:
    """What :func:`_evaluate` measures: the report's ``evaluation`` (None: nothing was scored)."""

    evaluation: dict | None
    seconds: float


def _load_and_check(plan, options: MergeOptions, models, t0: float) -> Loaded:
    """Tokenizers and pipelines compared, the models (and base) loaded, bodies and heads checked, every data
    file loaded and checked against the models that use it — before any expensive step."""
    m, names, timings = plan.method, list(plan.names), {}
    dev = resolve_device(options.device)
    tokenizer = check_tokenizers(tokenizer_inputs(models, names, options), options.allow_tokenizer_mismatch)
    # a sentence-transformers pipeline's facts
    embedding = check_pipelines(list(zip(names, models)), m, options.base, options.allow_pickle)
    loaded, base_model, base_name, adapted = _load_inputs(models, names, options)
    body = check_bodies(loaded + ([base_model] if base_model is not None else []),
                        names + ([base_name] if base_model is not None else []))
    opts = replace(options, heads=head_policy(options.heads, type(loaded[0])))  # 'auto': by the model class
    if opts.heads == "merge":
        check_heads_mergeable(loaded, names)
    cache = _DataCache(opts, m.needs)
    eval_files, eval_note = opts.evaluation_data(m.needs) if opts.evaluate else ([], None)
    _check_data(loaded, cache, eval_files, opts, m.needs)
    if opts.align.matcher.needs_data or opts.repair or opts.distill:  # read (or sampled) once, for every reader
        opts = replace(opts, align=read_once(opts.align, loaded, timings=timings, progress=opts.progress))
    timings["load"] = time.perf_counter() - t0 - timings.get("generate", 0.0)
    return Loaded(plan=plan, opts=opts, requested_heads=options.heads, dev=dev, names=names, models=loaded,
                  base_model=base_model, base_name=base_name, adapted=adapted, body=body, tokenizer=tokenizer,
                  embedding=embedding, cache=cache, eval_files=eval_files, eval_note=eval_note, timings=timings)


def _load_inputs(models, names, opts: MergeOptions) -> tuple[list, object, str | None, list]:
    """(the models, the base model, its name, the adapted inputs): every input loaded as any transformers model (a
    plain merge needs no spec), base-class inputs read as the task class (:func:`symmerge.io.prefix.adapt_models`)."""
    what = f"{len(models)} models" + (" and the base" if opts.base is not None else "")
    with stage(f"loaded {what}", enabled=opts.progress):
        loaded = [_load(x, opts.allow_pickle) for x in models]
        base_name = _name(opts.base, "base") if opts.base is not None else None
        base_model = _load(opts.base, opts.allow_pickle) if opts.base is not None else None
    (*loaded, base_model), adapted = adapt_models(loaded + [base_model], names + [base_name], opts.head_from)
    return loaded, base_model, base_name, adapted


def _check_data(models, cache: _DataCache, eval_files, opts: MergeOptions, needs) -> None:
    """Every data file loaded once and checked against every model that uses it: the statistics' files (a method
    that ``needs`` them) and the evaluation's."""
    with stage("loaded and checked the data", enabled=opts.progress and bool(opts.data or eval_files)):
        for i, x in enumerate(models):
            for spec in _files_of(opts.data, i) if needs else []:
                cache.get(spec, x, labels=cache.stats_labels, reader=cache.stats_reader)
            for spec in _files_of(eval_files, i) if i == opts.head_from or len(eval_files) > 1 else []:
                cache.get(spec, x)


def _align(ld: Loaded) -> Aligned:
    """Every model aligned to the plan's anchor (the star) or into one frame (joint), with the options the
    plan resolved, narrowed against the anchor (:func:`resolve_alignment`)."""
    t = time.perf_counter()
    plan, opts = ld.plan, ld.opts
    alignment = plan.alignment()
    if not plan.aligns:
        return Aligned(ld, ld.models, ld.base_model, alignment, [], time.perf_counter() - t)
    alignment.pop("note", None)
    anchor_model, alignment["anchor"] = choose_anchor(ld.models, ld.names, ld.body, opts.anchor, ld.base_model,
                                                      ld.base_name, opts.allow_pickle, opts.head_from)
    # a base-class anchor is reported, not merged: the anchor is no input of the merge
    anchor_adapted = [alignment["anchor"]["base_adapted"]] if "base_adapted" in alignment["anchor"] else []
    targets = list(zip(ld.names, ld.models)) + ([(ld.base_name, ld.base_model)] if ld.base_model is not None else [])
    align_opts, note = resolve_alignment(targets, anchor_model, plan.align.with_(align_data=opts.align.align_data),
                                         frame_readers(ld.embedding, anchor_model.config),
                                         held_symmetries(anchor_model.config))
    alignment.update(symmetries=list(align_opts.symmetries), rescale=align_opts.effective_rescale)
    if note:
        alignment["note"] = note
    if plan.frame == "joint":
        aligned, aligned_base = _align_jointly(ld, align_opts, alignment), ld.base_model
    else:
        moved, alignment["models"] = align_all(targets, anchor_model, ld.body, align_opts, progress=opts.progress)
        aligned = moved[:len(ld.models)]
        aligned_base = moved[len(ld.models)] if ld.base_model is not None else None
    return Aligned(ld, aligned, aligned_base, alignment, anchor_adapted, time.perf_counter() - t)


def _align_jointly(ld: Loaded, align_opts: AlignOptions, alignment: dict) -> list:
    """The models in one frame (:func:`symmerge.pipeline.joint.align_joint`: the star, then every model to the
    mean of the others); ``alignment`` gets the joint alignment's report."""
    opts = ld.opts
    joint = align_joint(ld.models, align_opts, anchor=alignment["anchor"]["index"], names=ld.names,
                        max_rounds=opts.joint_rounds, progress=opts.progress, refine=opts.joint_refine)
    alignment["anchor"]["rule"] += " (the star's anchor; then every model to the mean of the others)"
    alignment["joint"] = {k: v for k, v in joint.report.items() if k != "models"}
    alignment["models"] = [{**r, "anchor": i == alignment["anchor"]["index"]}
                           for i, r in enumerate(joint.report["models"])]
    return joint.models


def _statistics(al: Aligned) -> Statistics:
    """The statistics the method needs, gathered on the aligned models."""
    t, ld = time.perf_counter(), al.loaded
    stats, info = None, None
    if ld.m.needs:
        stats, info = gather_stats(ld.m.needs, al.aligned, ld.names, ld.cache, ld.opts, ld.dev)
    return Statistics(al, stats, info, time.perf_counter() - t)


def _merge(st: Statistics) -> Merged:
    """The body (and the heads when merged) merged — by the executor over the state dicts for a per-tensor method
    (:func:`_execute`), by the method's own loop for one with statistics or the architecture — and every result
    checked (:func:`symmerge.merge.outputs.check_result`); REPAIR if asked for."""
    t, al = time.perf_counter(), st.aligned
    ld = al.loaded
    opts, m = ld.opts, ld.m
    keys = untied(ld.models[0], ld.body + (sorted(head_keys(ld.models[0])) if opts.heads == "merge" else []))
    keys = [k for k in keys if k not in not_merged(ld.adapted)]  # a base model's missing head: kept, not merged
    sds = [x.state_dict() for x in al.aligned]
    holder = al.aligned[opts.head_from]
    base_sd = (al.aligned_base.state_dict() if m.needs_base or (m.accepts_base and al.aligned_base is not None)
               else None)
    with stage(f"merged ({m.name})", enabled=opts.progress):
        if m.needs or m.needs_model:
            merged_sd, warnings = _merge_with_statistics(st, keys, sds, base_sd)
            steps = None
        else:  # the executor with memory sources: the streamed merge's steps and loop
            merged_sd, steps, warnings = _execute(ld, holder, keys, sds, base_sd)
            ld.plan.steps = steps
        out = with_state_dict(in_result_dtype(holder, merged_sd), with_tied(holder, merged_sd))
    seconds = {"merge": time.perf_counter() - t}
    out, repair_info = _repair(out, al, seconds)
    out, distill_info = _distill(out, al, seconds)
    if distill_info is not None:  # what another model's head is scored with
        trained = out.state_dict()
        merged_sd = {k: trained[k] for k in merged_sd}
    return Merged(st, sds, holder, merged_sd, steps, warnings, out, repair_info, seconds, distill_info)


def in_result_dtype(holder, merged: dict):
    """``holder`` (a copy) in the merged tensors' floating dtype when they share one it is not in, else itself.

    The result of a method with a base is in the base's dtype (the executor's reference, as mergekit's): a
    float32 base with bfloat16 models gives float32, which loading it into a bfloat16 holder would round, and the
    streamed merge writes as float32."""
    import copy

    dtypes = {t.dtype for t in merged.values() if t.is_floating_point()}
    if len(dtypes) != 1 or (dtype := dtypes.pop()) == holder.dtype:
        return holder
    return copy.deepcopy(holder).to(dtype)


def _repair(out, al: Aligned, seconds: dict) -> tuple[object, dict | None]:
    """(the merged model, REPAIR's report) — REPAIRed on the alignment's unlabeled data when asked for (its seconds
    added to ``seconds``), else as it is."""
    opts = al.loaded.opts
    if not opts.repair:
        return out, None
    t = time.perf_counter()
    out, info = repair(out, al.aligned, opts.weights,
                       statistics_data(load_align_data(opts.align, out), opts.repair_samples),
                       channels=opts.repair_channels, progress=opts.progress)
    seconds["repair"] = time.perf_counter() - t
    return out, info


def _distill(out, al: Aligned, seconds: dict) -> tuple[object, dict | None]:
    """(the merged model, the distillation's report) — distilled toward the ensemble of the aligned inputs on the
    alignment's unlabeled data when asked for (no longer function-preserving: reported as such; its seconds added
    to ``seconds``), else as it is."""
    ld = al.loaded
    opts = ld.opts
    if not opts.distill:
        return out, None
    t = time.perf_counter()
    out, info = distill(out, al.aligned, load_align_data(opts.align, out), opts.weights,
                        DistillSettings(steps=opts.distill, lr=opts.distill_lr), ld.dev, opts.progress)
    seconds["distill"] = time.perf_counter() - t
    return out, info


def _execute(ld: Loaded, holder, keys, sds, base_sd) -> tuple[dict, list, list]:
    """(the merged tensors, the steps run, the result warnings) of a per-tensor method: the plain merge's steps
    (:func:`~symmerge.merge.steps.plain_merge_steps`: ``keys`` merged, the rest of the holder's tensors copied)
    run by the executor (:class:`~symmerge.merge.executor.StreamExecutor`) from the state dicts, as a streamed
    merge runs them from the files."""
    from .executor import MemorySource, MemoryTarget, StreamExecutor

    opts, n = ld.opts, len(sds)
    order = untied(holder, list(sds[opts.head_from]))
    # a tensor transformers fuses from several stored ones (a mixture's experts) is merged as the files store it,
    # one stored tensor at a time, as the streamed merge reads it: a per-tensor rule (a TIES threshold, DARE's
    # seeded mask, Model Stock's angle) sees one expert's tensor, not the fused stack of every expert
    fused = {k: f for k, f in stored_parts(holder).items() if k in set(order)}
    if fused:
        sds = [split_fused(sd, fused) for sd in sds]
        base_sd = split_fused(base_sd, fused) if base_sd is not None else None
        keys, order = unfused(keys, fused), unfused(order, fused)
    steps = plain_merge_steps(order, keys, n, base=n if base_sd is not None else None, weights=opts.weights,
                              params=opts.params, head_from=opts.head_from, method=ld.m)
    sources = [MemorySource(sd, name) for sd, name in zip(sds, ld.names)]
    if base_sd is not None:
        sources.append(MemorySource(base_sd, ld.base_name or "base"))
    target = MemoryTarget()
    facts = StreamExecutor(sources, steps, ld.m, naming=opts.head_from, progress=False, distances=False,
                           keep=True).run(target=target)
    wanted = set(keys)
    merged = {k: v for k, v in target.tensors.items() if k in wanted}
    for key, f in fused.items():  # the stored tensors' results stacked into the fused tensor again
        if all(p.name in merged for p in f.parts):
            dtype = merged[f.parts[0].name].dtype
            merged[key] = f.stack({p.name: merged.pop(p.name) for p in f.parts}, dtype)
    return merged, steps, facts["result_warnings"]


def stored_parts(model) -> dict:
    """``{in-memory name: symmerge.io.fused.Fused}``: the tensors of ``model`` its checkpoint stores as several."""
    from ..io.hf import disk_to_memory_names

    return disk_to_memory_names(model.config.to_dict(), model.config, fused=True)[2]


def split_fused(sd: dict, fused: dict) -> dict:
    """``sd`` with each fused tensor replaced by its stored tensors (views of it), in its place."""
    out = {}
    for k, t in sd.items():
        if k in fused:
            out.update(fused[k].split(t))
        else:
            out[k] = t
    return out


def unfused(keys, fused: dict) -> list:
    """``keys`` with each fused tensor's name replaced by its stored tensors' names, in their place."""
    return [name for k in keys for name in ([p.name for p in fused[k].parts] if k in fused else [k])]


def _merge_with_statistics(st: Statistics, keys, sds, base_sd) -> tuple[dict, list]:
    """(the merged tensors, the result warnings) of a method that reads statistics or the architecture
    (Fisher, RegMean, OT fusion): its own state-dict loop (their statistics and whole-model rules are no
    per-tensor step of the executor), the results checked as the executor checks them."""
    al = st.aligned
    opts, m = al.loaded.opts, al.loaded.m
    sub = [{k: sd[k] for k in keys} for sd in sds]
    stats = st.stats
    stats_sub = (None if stats is None else stats if m.needs_model
                 else [{k: s[k] for k in keys if k in s} for s in stats])
    extra = {"base": {k: base_sd[k] for k in keys}} if base_sd is not None else {}
    if m.needs_model:  # the architecture, and the model the others were aligned to
        extra.update(model=al.aligned[0], anchor=al.alignment["anchor"]["index"])
    merged = m.merge(sub, weights=opts.weights, stats=stats_sub, **extra, **opts.params)
    warnings = [w for k, t in merged.items()
                if (w := check_result(k, t, [sd[k] for sd in sub], m, opts.params, opts.weights)) is not None]
    return merged, warnings


def _report(mg: Merged) -> dict:
    """The report (:func:`symmerge.merge.plan.merge_report`) from the plan and what was measured."""
    st = mg.statistics
    al = st.aligned
    ld = al.loaded
    opts, names = ld.opts, ld.names
    head_info = head_report(head_keys(ld.models[0]), opts.heads, ld.requested_heads, opts.head_from, names,
                            head_keys(mg.holder), mg.steps)
    with stage("distances between the inputs and to the result", enabled=opts.progress):
        before, after, to_result = _report_distances(mg)
    report = merge_report(ld.plan, base=ld.base_name, alignment=al.alignment, head=head_info,
                          distances_between_inputs={"before_alignment": before, "after_alignment": after},
                          distance_result_to_inputs=to_result, statistics=_statistics_entry(st), device=str(ld.dev),
                          repair=mg.repair, tokenizer=ld.tokenizer, embedding=ld.embedding,
                          result_warnings=mg.result_warnings)
    if mg.distill is not None:
        report["distillation"] = mg.distill
    adapted = ld.adapted + al.anchor_adapted
    if adapted:
        report["base_adapted"] = adapted
    return report


def _statistics_entry(st: Statistics) -> dict | None:
    """The report's ``statistics``: their kind, per model, and the options they were gathered with."""
    if st.info is None:
        return None
    opts, needs = st.aligned.loaded.opts, st.aligned.loaded.m.needs
    return {"kind": needs, "per_model": st.info,
            **({"gram_normalize": opts.gram_normalize} if needs == "gram" else
               {"fisher_variant": opts.fisher_variant, "fisher_normalize": opts.fisher_normalize,
                "fisher_samples": opts.fisher_samples} if needs == "fisher" else {})}


def _evaluate(mg: Merged) -> Evaluated:
    """The merged model as saved, and the inputs, scored on the evaluation data."""
    t, ld = time.perf_counter(), mg.statistics.aligned.loaded
    opts = ld.opts
    if not ld.eval_files:  # nothing scored; the reason, where there is one (--data without labels), kept
        return Evaluated({"merged": [], "note": ld.eval_note} if ld.eval_note else None, time.perf_counter() - t)
    ev = _evaluate_all(mg, ld.eval_files)
    ev["data_role"] = "--eval-data" if opts.eval_data else "--data"
    if ld.eval_note:
        ev["note"] = ld.eval_note
    cut = sorted({d.path for d in ld.cache.loaded.values() if d.cut and d.path in {r["data"] for r in ev["merged"]}})
    if cut:  # the evaluation files --max-examples cut (each data set knows whether it was cut)
        ev["max_examples"] = {"limit": opts.max_examples, "cut": cut,
                              "note": f"--max-examples {opts.max_examples}: at most the first {opts.max_examples} "
                                      f"examples of {', '.join(cut)} were scored"}
    return Evaluated(ev, time.perf_counter() - t)


def _load(x, allow_pickle: bool):
    """A folder loaded as any transformers model (no symmetry spec needed), or the model given."""
    return load_model(x, allow_pickle=allow_pickle, spec=False) if isinstance(x, (str, Path)) else x


def _report_distances(mg: Merged) -> tuple[dict, dict, dict]:
    """The report's (``before_alignment``, ``after_alignment``, ``distance_result_to_inputs``) by the rule of the
    streamed merge's steps (:mod:`symmerge.merge.distances`: one function per tensor, the values summed exactly)
    over the tensors it measures: the body's floating tensors, each once (a tied alias is its source's tensor), a
    tensor transformers fuses from several stored ones as the files store it (:func:`split_fused`); the result as
    the merge returned it (REPAIRed or distilled when asked for)."""
    al = mg.statistics.aligned
    ld = al.loaded
    keys = untied(ld.models[0], ld.body)
    fused = {k: f for k, f in stored_parts(mg.holder).items() if k in set(keys)}

    def stored(sd):
        return split_fused(sd, fused) if fused else sd

    keys, result = unfused(keys, fused), stored(mg.out.state_dict())
    after_sds, after = [stored(sd) for sd in mg.sds], SquaredSums()
    keys = [k for k in keys if after_sds[0][k].is_floating_point()]
    for k in keys:
        after.add([sd[k] for sd in after_sds], result[k])
    pairs, to_result = after.totals()
    if al.aligned is not ld.models:  # before alignment: the inputs as loaded, their pairs alone
        before_sds, before = [stored(x.state_dict()) for x in ld.models], SquaredSums()
        for k in keys:
            before.add([sd[k] for sd in before_sds])
        before_pairs = before.totals()[0]
    names = ld.names
    after_table = {f"{names[i]} | {names[j]}": math.sqrt(v) for (i, j), v in sorted(pairs.items())}
    before_table = after_table if al.aligned is ld.models else {
        f"{names[i]} | {names[j]}": math.sqrt(v) for (i, j), v in sorted(before_pairs.items())}
    return before_table, after_table, {nm: math.sqrt(to_result.get(i, 0.0)) for i, nm in enumerate(names)}


def _evaluate_all(mg: Merged, files) -> dict:
    """The merged model's rows (one per file) and the inputs' (each on the files it is scored on)."""
    ld = mg.statistics.aligned.loaded
    opts, models, names = ld.opts, ld.models, ld.names
    result = {"merged": [], "models": []}
    per_model = len(files) > 1 or len(models) == 1
    for j, spec in enumerate(files):
        # with one file per model, file j is scored with model j's head (the paper's protocol)
        owner = j if per_model else opts.head_from
        aligned = mg.statistics.aligned.aligned[owner]
        probe = mg.out if (opts.heads == "merge" or owner == opts.head_from) else with_state_dict(
            aligned, with_tied(aligned, mg.merged_sd))
        d = ld.cache.get(spec, probe)
        r = evaluate(probe, d, device=ld.dev, progress=opts.progress, desc="evaluating merged")
        probe.to("cpu")
        # the saved model carries head_from's head (or the merged heads): a row scored with another model's head
        # is of a model that was not saved, and says so
        result["merged"].append({"data": d.path, "head_from": names[owner] if opts.heads == "keep" else "merged",
                                 "as_saved": probe is mg.out, **r})
        result["models"] += [_evaluate_input(ld, i, d) for i in range(len(models)) if not per_model or i == j]
    return result


def _evaluate_input(ld: Loaded, i: int, d: Data) -> dict:
    """Input ``i``'s row on the data set ``d``: its scores, or why it was skipped (``d`` does not fit it)."""
    x, name = ld.models[i], ld.names[i]
    try:
        check_data(d, x)
    except SymmergeError as e:
        return {"model": name, "data": d.path, "skipped": str(e)}
    r = evaluate(x, d, device=ld.dev, progress=ld.opts.progress, desc=f"evaluating {name}")
    x.to("cpu")
    return {"model": name, "data": d.path, **r}
