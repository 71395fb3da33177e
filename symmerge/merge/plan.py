"""One merge plan, resolved once from the inputs' headers (config.json, safetensors headers; no weights) and
the options, and executed by both wings (in memory: :mod:`symmerge.merge.fuse`; streamed:
:mod:`symmerge.merge.stream`), neither of which re-derives a rule:

* the **mode** (``auto`` / ``memory`` / ``stream``) and why (:func:`choose_mode`);
* what the **alignment** resolves to for these models (:func:`~symmerge.pipeline.recommend.recommended`, the one
  function holding every rule that narrows 'recommended': here, nothing for a model type without a symmetry
  spec, nor when a base model is given; the aligning wing hands it the facts it learns against the anchor —
  the groups the anchor binds, whether the heads differ, whether a pipeline reads the output frame, whether it
  streams) and whether its **matcher** can run in the chosen mode (a matcher that cannot stream is refused by
  the plan, in one error naming ``--match`` and ``--mode``);
* the **frame** (``none``: nothing aligned; ``base``: every model aligned to the base; ``star``: every model to
  one anchor; ``joint``: every model into one common frame) and the **anchor** rule (:func:`anchor_rule`);
* the **method** and its checked parameters, the **statistics** it needs, the requested **head** policy;
* the **report**: :func:`merge_report` builds it from the plan plus what was measured, in both wings, through the
  one report builder of every command (:func:`symmerge.pipeline.report.build_report`).

The per-tensor steps (:class:`~symmerge.merge.steps.TensorStep`, :attr:`MergePlan.steps`) are made by one rule
(:func:`symmerge.merge.steps.plain_merge_steps`) from the checkpoint headers (:func:`symmerge.merge.stream.plain_steps`,
also ``--print-plan``'s) or the loaded state dicts (in memory), and run by one executor
(:class:`symmerge.merge.executor.StreamExecutor`) from the files or from memory (``MemorySource``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core import memory
from ..core.distance import sq_distance
from ..errors import SymmergeError
from ..option_ranges import model_index
from ..io.model import ShardIndexError, read_config, weight_files
from ..pipeline.options import AlignOptions, refuse_unread_joint
from ..pipeline.report import build_report
from ..pipeline.recommend import BASE_NOTE, has_spec, plain_fallback, recommended  # noqa: F401 (the plan's rules)
from ..pipeline.recommend import model_wide, moving
from .option_defaults import MERGE
from .registry import get_method

MODES = ("auto", "stream", "memory")
ONE_MODEL_NOTE = ("'recommended' aligns nothing for one model without a base or an anchor of its own: there is "
                  "nothing to align it to")
ONE_MODEL_LIST_NOTE = ("one model without a base or an anchor of its own: nothing to align it to (the symmetries asked "
                       "for were checked; none is aligned)")
MEMORY_FRACTION = 0.5  # auto: models larger than this fraction of the available memory are streamed
FRAMES = ("none", "base", "star", "joint")
FRAME_WORDS = {"none": "nothing", "base": "every model to the base", "star": "every model to one anchor"}


def anchor_rule(n: int, anchor, base_given: bool) -> tuple[int | None, str]:
    """(index of the anchor among the ``n`` models or None, the rule): the given one (an index or a
    model/folder: None); else the base model; else, for two models, the second (the paper's convention);
    else the model closest (L2) to the plain average — measured by the wing (:func:`closest`), index None
    here."""
    if anchor is None and base_given:
        return None, "base model"
    if anchor is None and n == 2:
        return 1, "second of two"
    if anchor is None:
        return None, "closest to the average"
    if isinstance(anchor, int):
        return model_index(anchor, n), "given"
    return None, "given"


def closest(distances) -> int:
    """The index of the smallest distance (the model closest to the average)."""
    return min(range(len(distances)), key=list(distances).__getitem__)


def average_keys(keys, heads, dtype) -> list[str]:
    """The tensors the distance to the average runs over, in both wings: the body (``keys`` outside the task
    heads ``heads``; tied aliases are not among ``keys``), floating point only (``dtype(key)``)."""
    heads = set(heads)
    return [k for k in keys if k not in heads and dtype(k).is_floating_point]


def closest_to_average(tensors, keys) -> tuple[int, list[float]]:
    """(index of the model closest to the plain average of all models, every model's distance (L2) to it)
    over ``keys`` (:func:`average_keys`), one tensor at a time: ``tensors(key)`` gives the models' tensors of
    ``key`` (from memory or read from their checkpoints). Each model's per-tensor squares are summed exactly
    (``math.fsum``): the same figures whatever order the keys come in (the state dict's, the files')."""
    sq: list[list[float]] = []
    for k in keys:
        ts = tensors(k)
        sq = sq or [[] for _ in ts]
        avg = {"x": sum(t.double() for t in ts) / len(ts)}
        for i, t in enumerate(ts):
            sq[i].append(sq_distance({"x": t}, avg, ["x"]))
    dists = [math.sqrt(math.fsum(v)) for v in sq]
    return closest(dists), dists


def checkpoint_bytes(folder) -> int:
    """Bytes of a folder's weight files (0 when it is not a folder of safetensors weights)."""
    try:
        files, safe = weight_files(Path(folder))
    except ShardIndexError:  # a bad index is refused, not read as 'no safetensors'
        raise
    except SymmergeError:
        return 0
    return sum(os.path.getsize(f) for f in files) if safe else 0


def stream_refusal(method, options, aligns: bool = False) -> str | None:
    """Why this merge needs the models in memory (``None``: it can stream)."""
    if method.needs:
        return (f"method {method.name!r} needs the models in memory (its {method.needs} statistics come from "
                "running them on data)")
    if method.needs_model:
        return f"method {method.name!r} needs the models in memory (it reads the architecture)"
    if options.repair:
        return "REPAIR needs the models in memory (it runs them on data)"
    if options.distill:
        return "distillation needs the models in memory (it trains the merged model on data)"
    if options.joint:
        return "joint alignment (every model to the mean of the others) needs the models in memory"
    if options.data or options.eval_data:
        return "evaluating the merged model on data needs it in memory"
    if aligns and options.align.matcher.learns:  # each model learned onto the anchor from the files
        from ..pipeline.learn_layerwise_write import merge_refusal

        return merge_refusal(options.align)
    if aligns:  # each model aligned onto the anchor by align --stream's engine: its refusals
        return options.align.streamed_refusal()
    return None


def choose_mode(mode: str, method, options, models, aligns: bool) -> tuple[str, str]:
    """('stream' or 'memory', why) for ``--mode`` ``mode``. ``auto`` streams every per-tensor merge that
    aligns nothing (reading each tensor once is faster and smaller than loading the models); an aligned
    one is loaded when the models fit in half the available memory, else streamed (each model aligned by
    ``align --stream``'s engine, or learned from the files with ``--match learned``); a merge that cannot stream
    (statistics, REPAIR, evaluation, activation matching) is loaded, or refused when it would not fit.
    ``stream`` refuses what cannot stream; ``memory`` always loads."""
    if mode not in MODES:
        raise SymmergeError(f"unknown --mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "memory":
        return "memory", "--mode memory"
    refusal = stream_refusal(method, options, aligns)
    if any(not isinstance(x, (str, Path)) for x in models) or (options.base is not None and
                                                                not isinstance(options.base, (str, Path))):
        refusal = refusal or "models given as objects are already in memory"
    if refusal is None and any(checkpoint_bytes(x) == 0 for x in models):
        refusal = "streaming reads safetensors folders"
    if mode == "stream":
        if refusal:
            raise SymmergeError(f"--mode stream: {refusal}; use --mode memory")
        return "stream", "--mode stream"
    if refusal is None and not aligns:
        return "stream", "auto: a per-tensor merge without alignment streams"
    total = sum(checkpoint_bytes(x) for x in models if isinstance(x, (str, Path)))
    free = memory.available_memory()
    too_big = free is not None and total > MEMORY_FRACTION * free
    if refusal is None:  # aligned: in memory (every group, residual included) unless the models do not fit
        if too_big:
            return "stream", (f"auto: the models ({total / 1e9:.1f} GB) exceed half the available memory: each "
                              "is aligned streamed (the groups that stream), then merged tensor by tensor")
        return "memory", "auto: aligned merges load the models when they fit"
    if too_big:
        raise SymmergeError(f"--mode auto: the models ({total / 1e9:.1f} GB) would not fit in memory "
                            f"({free / 1e9:.1f} GB available) and this merge cannot stream: {refusal}")
    return "memory", f"auto: {refusal}"


def _name(x, i) -> str:
    return str(x) if isinstance(x, (str, Path)) else f"model {i}"


# config.json fields that change what the weights compute without changing a shape (activation, positions, norms'
# epsilon, routing, soft-capping): inputs that differ in one were trained for different settings, and the merged model
# keeps one input's value (its config.json is the --head-from model's)
BEHAVIOUR_FIELDS = (
    "hidden_act", "activation_function", "hidden_activation", "rope_theta", "rope_scaling", "rope_parameters",
    "rotary_emb_base", "rotary_pct", "partial_rotary_factor", "position_embedding_type", "rms_norm_eps",
    "layer_norm_eps", "layer_norm_epsilon", "num_experts_per_tok", "norm_topk_prob", "sliding_window",
    "use_sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
    "query_pre_attn_scalar", "clip_qkv", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
    "use_parallel_residual", "tie_word_embeddings", "attention_multiplier", "embedding_multiplier",
    "logits_scaling", "residual_multiplier")


def config_of(x) -> dict:
    """A folder's config.json, or a model object's config, as a dict as transformers reads it: through the model
    type's config class (no code run), so that spellings of one setting agree (transformers 4's top-level
    ``rope_theta`` and 5's ``rope_parameters``; a field left out and its default)."""
    if not isinstance(x, (str, Path)):
        return x.config.to_dict()
    raw = read_config(Path(x), spec=False)
    from transformers import CONFIG_MAPPING

    from ..io.hf import quiet_transformers

    try:
        with quiet_transformers():  # its validation warnings are the loading's to give
            return CONFIG_MAPPING[raw["model_type"]].from_dict(raw).to_dict()
    except Exception:  # a type transformers lacks, or a config it refuses (its validators raise their own error
        return raw  # types): read as written here; loading the model refuses it in one line


def config_differences(configs: dict) -> list[dict]:
    """The :data:`BEHAVIOUR_FIELDS` (at the top of config.json or in a nested ``*_config``) in which ``configs``
    (``{name: config}``, :func:`config_or_none`'s; a None left out) differ: ``{"field", "values": {name: value}}``
    each, in the fields' order."""
    configs = {name: c for name, c in configs.items() if c is not None}

    def flat(config: dict) -> dict:
        out = {k: config[k] for k in BEHAVIOUR_FIELDS if k in config}
        for sub, inner in config.items():
            if sub.endswith("_config") and isinstance(inner, dict):
                out.update({f"{sub}.{k}": inner[k] for k in BEHAVIOUR_FIELDS if k in inner})
        return out

    flats = {name: flat(c) for name, c in configs.items()}
    fields = list(dict.fromkeys(k for f in flats.values() for k in f))
    found = []
    for key in fields:
        values = {name: f.get(key) for name, f in flats.items()}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            found.append({"field": key, "values": values})
    return found


def differences_warning(found: list[dict], holder: str) -> str | None:
    """One line naming the behaviour fields the merged inputs differ in (``holder``: whose config the output has)."""
    if not found:
        return None
    shown = "; ".join(f"{d['field']} " + ", ".join(f"{v!r} ({n})" for n, v in d["values"].items()) for d in found)
    return (f"the models' configs differ in what the weights compute: {shown}; the merged model's config.json is "
            f"{holder}'s, so the weights of the others are read with its settings")


def config_or_none(x):
    """``x``'s config (:func:`config_of`), or None where it cannot be read here (its loading refuses it)."""
    try:
        return config_of(x)
    except (SymmergeError, OSError, AttributeError):
        return None


def model_type_of(x) -> str:
    """The model type of a folder (its config.json) or of a model object."""
    if isinstance(x, (str, Path)):
        return read_config(Path(x), spec=False)["model_type"]
    return x.config.model_type


@dataclass
class MergePlan:
    """A merge resolved before any weight is read (:func:`plan_merge`)."""

    method: object  # the Method
    names: list
    model_type: str
    mode: str
    why: str
    align: AlignOptions  # what is aligned (no symmetries: nothing); 'recommended' resolved per anchor later
    requested: str  # the alignment as asked for ('recommended', 'none' or the list)
    note: str | None
    frame: str  # FRAMES
    anchor_index: int | None
    anchor_rule: str | None
    params: dict = field(default_factory=dict)
    weights: list | None = None
    statistics: str | None = None  # what the method needs gathered (Method.needs)
    heads: str = "auto"  # as requested (resolved by the model class: symmerge.merge.heads.head_policy)
    # every output tensor's step (symmerge.merge.steps.TensorStep: copy, or merge with which inputs and arguments),
    # made by the wing from the headers (streamed) or the state dicts (in memory) and run by the one executor;
    # None for the methods with their own loop (statistics, the architecture)
    steps: list | None = None
    options: object = None  # the MergeOptions the plan validated (MergeOptions.check), which the wings run on
    # config_differences of the inputs (and the base): merge's plan; None (not reported) for a config's merges
    config_differences: list | None = None

    @property
    def aligns(self) -> bool:
        return bool(self.align.symmetries)

    @property
    def symmetries(self) -> list:
        """The symmetries this merge aligns as far as the headers tell (what ``--print-plan`` shows): 'recommended'
        among the family's groups, without the model-wide ones (the residual stream) when it streams, as the run
        resolves it per anchor."""
        align = self.align
        if align.recommended and has_spec(self.model_type):
            from ..families import spec_for

            align = align.resolved(g.symmetry for g in spec_for(self.model_type).groups)
        dropped = moving(align, model_wide) if self.mode == "stream" else []
        return [s for s in align.symmetries or [] if s not in dropped]

    def alignment(self) -> dict:
        """The report's ``alignment`` entry before anything is measured."""
        out = {"symmetries": [], "requested": self.requested, "rescale": "none",
               "anchor": {"index": None, "name": None, "rule": None}, "models": []}
        if self.note:
            out["note"] = self.note
        return out

    def fields(self) -> dict:
        """The report's fields the plan decides."""
        return {"method": self.method.name, "params": self.params, "weights": self.weights,
                "models": list(self.names), "model_type": self.model_type, "mode": self.mode,
                **({} if self.config_differences is None else {"config_differences": self.config_differences})}

    def describe(self) -> dict:
        """The plan as the report records it (``plan``)."""
        steps = None if self.steps is None else {"merge": sum(s.merge for s in self.steps),
                                                 "copy": sum(not s.merge for s in self.steps)}
        return {"mode": self.mode, "why": self.why, "frame": self.frame,
                "anchor_rule": self.anchor_rule if self.aligns else None,
                "match": self.align.match if self.aligns else None, "statistics": self.statistics,
                "steps": steps}


def _same_folder(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, TypeError, ValueError):
        return False


def anchor_among_models(models, anchor):
    """``anchor`` as an index when it is a folder of ``models`` (``--anchor models/a`` with ``models/a`` merged:
    that model is the anchor, not an outside one every model, itself included, would be aligned to); else as given."""
    if isinstance(anchor, (str, os.PathLike)) and not isinstance(anchor, bool):
        for i, x in enumerate(models):
            if isinstance(x, (str, os.PathLike)) and _same_folder(x, anchor):
                return i
    return anchor


def base_among_models(models, options):
    """(models, options) without the base model where ``options.base`` is a folder of ``models`` and the method
    merges task vectors from it (its base policy required or optional): the base is the base, not one more model
    with a zero task vector — a mergekit config's reading of ``base_model`` listed among ``models`` (slerp's two
    models are the base and one other). Its weight goes with it; an ``anchor``/``head_from`` index after it moves
    down one; an anchor that names it becomes None (the base is then the frame, as ``--base`` without
    ``--anchor``), a ``head_from`` that names it 0 (the first merged model). Else as given."""
    base = options.base
    if base is None or not isinstance(base, (str, os.PathLike)) or not get_method(options.method).uses_base:
        return models, options
    at = next((i for i, x in enumerate(models) if isinstance(x, (str, os.PathLike)) and _same_folder(x, base)), None)
    if at is None or len(models) == 1:
        return models, options
    changes = {}
    if isinstance(options.anchor, int) and not isinstance(options.anchor, bool) and options.anchor >= at:
        changes["anchor"] = None if options.anchor == at else options.anchor - 1  # the base: the frame it gives
    if isinstance(options.head_from, int) and options.head_from > at:
        changes["head_from"] = options.head_from - 1
    elif options.head_from == at:
        changes["head_from"] = 0  # the first merged model (the base's own head is not a merged model's)
    weights = options.weights
    if weights is not None and len(weights) == len(models):
        changes["weights"] = [w for i, w in enumerate(weights) if i != at]
    return [x for i, x in enumerate(models) if i != at], replace(options, **changes)


def plan_merge(models, options, mode: str = "auto") -> MergePlan:
    """The :class:`MergePlan` of merging ``models`` (folders or model objects) with ``options`` (a
    :class:`~symmerge.merge.fuse.MergeOptions`, checked here) in ``mode``: read from the first input's
    config.json and the folders' sizes only. An anchor folder that is one of ``models`` is its index."""
    n = len(models)
    anchor = anchor_among_models(models, options.anchor)
    if anchor is not options.anchor:
        options = replace(options, anchor=anchor)
    options = options.check(n)
    m = get_method(options.method)
    model_type = model_type_of(models[0])
    names = [_name(x, i) for i, x in enumerate(models)]
    inputs = list(zip(names, models)) + ([] if options.base is None else [
        (str(options.base) if isinstance(options.base, (str, Path)) else "base", options.base)])
    configs = {name: config_or_none(x) for name, x in inputs}  # each read once
    align, note = recommended(options.align, model_type=model_type, base_given=options.base is not None,
                              config=configs[names[0]])
    alone = n == 1 and options.base is None and options.anchor in (None, 0)  # it would be aligned against itself
    if align.symmetries and align.recommended and alone:
        align, note = align.with_(symmetries=()), ONE_MODEL_NOTE
    aligns = bool(align.symmetries)
    if aligns and has_spec(model_type):  # --align experts on a dense family: one line, as align and barrier say
        from ..families import spec_for
        from ..pipeline.recommend import require_declared

        require_declared(spec_for(model_type), align)
    if aligns and alone:  # an explicit list, checked: nothing aligned in either mode (a mergekit config's rule too)
        align, note, aligns = align.with_(symmetries=()), ONE_MODEL_LIST_NOTE, False
    mode, why = choose_mode(mode, m, options, models, aligns)
    if aligns and mode == "stream" and not align.recommended:  # an explicit residual: refused now, as the run does
        recommended(align, streamed=True)
    index, rule = anchor_rule(n, options.anchor, options.base is not None) if aligns else (None, None)
    if not aligns:
        frame = "none"
    elif options.anchor is None and options.base is not None:
        frame = "base"
    elif mode == "memory" and options.use_joint(n):
        frame = "joint"
    else:
        frame = "star"
    if frame != "joint":
        refuse_unread_joint(options.joint_rounds, options.joint_refine, (MERGE["joint_rounds"], MERGE["joint_refine"]),
                            FRAME_WORDS[frame] if n > 2 or frame != "star" else "a pair (the model onto the anchor)")
    plan = MergePlan(method=m, names=names, model_type=model_type, mode=mode,
                     why=why, align=align, requested=options.align.requested, note=note, frame=frame,
                     anchor_index=index, anchor_rule=rule, params=options.params,
                     weights=list(options.weights) if options.weights is not None else None,
                     statistics=m.needs, heads=options.heads, options=options,
                     config_differences=config_differences(configs))
    if aligns:  # the data-free search's options, read only where the residual stream is aligned (as align says)
        from ..pipeline.matchers import search_refusal
        from ..pipeline.options import refuse_unread_mixture

        refuse_unread_mixture(align, frame == "joint")

        symmetries = plan.symmetries
        refusal = search_refusal(align, bool(moving(align.with_(symmetries=symmetries), model_wide)), symmetries)
        if refusal:
            raise SymmergeError(refusal)
    return plan


def stream_entry(facts: dict) -> dict:
    """The report's ``stream`` entry from a streamed run's facts (:meth:`symmerge.merge.executor.StreamExecutor.run`):
    the same fields after ``symmerge merge``'s streamed merge and a config's."""
    keys = ("shards", "bytes_written", "largest_tensor_bytes", "read_ahead_budget_bytes", "read_ahead_peak_bytes",
            "direct_io")
    return {k: facts[k] for k in keys} | {"seconds": facts["thread_seconds"]}


def merge_report(plan: MergePlan, *, base, alignment: dict, head: dict, distances_between_inputs: dict,
                 distance_result_to_inputs: dict, statistics=None, device="cpu", repair=None, stream=None,
                 tokenizer=None, embedding=None, side_files=None, names=None, result_warnings=None) -> dict:
    """The merge report, in both wings and for each merge of a config: the plan plus what was measured, by the one
    report builder (:func:`symmerge.pipeline.report.build_report`; ``names``: the inputs as the report names them;
    default the plan's)."""
    if names is not None:
        plan = replace(plan, names=list(names))
    measured = {"base": base, "alignment": alignment, "head": head, "statistics": statistics,
                "distances_between_inputs": distances_between_inputs,
                "distance_result_to_inputs": distance_result_to_inputs, "device": device, "repair": repair}
    if stream is not None:
        measured["stream"] = stream
    measured["tokenizer"] = tokenizer
    if embedding:
        measured["sentence_transformers"] = embedding
    if side_files is not None:
        measured["side_files"] = side_files
    measured["result_warnings"] = list(result_warnings or [])  # symmerge.merge.outputs.check_result
    return build_report(plan, measured)
