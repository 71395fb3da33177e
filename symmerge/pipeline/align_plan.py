"""The plan of one alignment (``symmerge align``, :func:`~symmerge.pipeline.to_folder.align_to_folder`), resolved
once from the two inputs' headers and the options before any weight is read:

* the **family** and its spec, the **symmetries** resolved (``recommended`` resolved here, by the one function
  :func:`~symmerge.pipeline.recommend.recommended`, from the groups the model binds, the sentence-transformers
  pipeline reading its output, whether it streams), with the note of what was left out;
* the **matcher**, the **anchor** (the second input: its frame is the target, it is never changed), the
  **verification** policy (every group element checked; the outputs compared in memory, or with
  ``--verify-forward`` when streamed) and the **mode** (in memory, streamed low-memory or pipelined);
* the **steps**: for every output tensor, the alignment maps that act on it (the group instance, its
  symmetry and kind, the axis, the slice of the axis, the sub-tensor of a stacked tensor) and the norms
  folded into it (the residual stream's canonical form), or ``copy`` when nothing acts on it.

The plan reads the folders' config.json and safetensors headers, and the one-dimensional tensors (norm weights)
whose values decide the residual stream's group (streamed: only the few tensors per-layer binding reads, Qwen3's
QK norms); nothing else. A pickle checkpoint has no headers: its plan is made from the loaded model, which the
plan keeps (``loaded``) for the alignment, so the checkpoint is read once. ``symmerge align --print-plan`` prints
:meth:`AlignPlan.printed`; the report is built from the plan and what the alignment measured by the one report builder
(:func:`symmerge.pipeline.report.build_report`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SymmergeError
from .align_steps import AlignMap, AlignStep, plan_steps  # noqa: F401  (the plan's step types)
from .options import AlignOptions, refuse_unread_mixture
from .report import build_report

MODES = {False: "in-memory", True: "low-memory"}  # the report's 'mode' of each wing ('pipeline' when pipelined)
# the mode of a streamed learned alignment (pipeline/learn_layerwise_write.py) and how it verifies its output
LEARNED_STREAM = "learned, layer by layer from the files"
OUTPUTS_CHECK = ("the written folder's logits against the model's, both run layer by layer from the files, on the "
                 "first two alignment batches (a model stored in half precision: its float32 values before the "
                 "rounding, against its float32 copy)")


@dataclass(frozen=True)
class AlignPlan:
    """An alignment resolved before any weight is read (:func:`plan_align`)."""

    model: str
    anchor: str
    model_type: str
    family: str
    options: AlignOptions  # resolved: 'recommended' is the symmetries it came to for these models
    requested: str  # as asked for: 'recommended', 'none' or the list
    note: str | None
    mode: str  # 'in-memory', 'low-memory' or 'pipeline'
    instances: tuple[str, ...] = ()
    steps: tuple[AlignStep, ...] = field(default=(), repr=False)
    residual_variant: str | None = None  # the residual stream's group as the headers and norms decide it
    verify_forward: bool = False  # streamed: --verify-forward (both models loaded after writing, outputs compared)
    bound: tuple = field(default=(), repr=False, compare=False)  # every group instance bound (core.instance.Instance)
    loaded: object = field(default=None, repr=False, compare=False)  # the model planned on when it had no headers

    def solved(self) -> list:
        """The bound instances the alignment solves (``instances``), in order."""
        names = set(self.instances)
        return [i for i in self.bound if i.name in names]

    @property
    def symmetries(self) -> tuple:
        return tuple(self.options.symmetries)

    @property
    def streamed(self) -> bool:
        return self.mode != "in-memory"

    def verify(self) -> dict:
        """The verification policy: every group element is checked (it is then function-preserving); the
        outputs are compared in memory (unless ``--no-verify``), streamed with ``--verify-forward`` (both models
        loaded after writing), and always when a learned alignment is streamed (from the written files, layer by
        layer); ``outputs_on``: how (None: not compared)."""
        from .verify import ELEMENT_CHECK

        tol, how = self.options.verify_tol, None
        if self.streamed and self.options.matcher.learns:
            how = OUTPUTS_CHECK
        elif self.streamed and self.verify_forward:
            how = "both models loaded after writing, their outputs compared on sample inputs"
        elif not self.streamed and self.options.verify:
            how = "both models' outputs compared on sample inputs, in memory, before anything is written"
        return {"elements": ELEMENT_CHECK, "outputs": True if how else None, "outputs_on": how, "tolerance": tol}

    def fields(self) -> dict:
        """The report's fields the plan decides (what was asked for and what it resolved to)."""
        o = self.options
        return {"family": self.family, "model_type": self.model_type, "symmetries": list(o.symmetries),
                "rescale": o.effective_rescale, "layers": list(o.layers) if o.layers is not None else "all",
                "symmetries_requested": self.requested, "model": self.model, "anchor": self.anchor}

    def describe(self) -> dict:
        """The plan as the report records it (``plan``): the decisions and the steps counted."""
        maps = sum(len(s.maps) for s in self.steps)
        return {"operation": "align", "mode": self.mode, "match": self.options.match, "requested": self.requested,
                "symmetries": list(self.symmetries), "note": self.note, "anchor": self.anchor,
                "anchor_rule": "given (the second input; never changed)", "residual": self.options.residual,
                "residual_variant": self.residual_variant, "verify": self.verify(),
                "instances": len(self.instances),
                "steps": {"transform": sum(s.op == "transform" for s in self.steps),
                          "copy": sum(s.op == "copy" for s in self.steps), "maps": maps}}

    def printed(self) -> dict:
        """What ``--print-plan`` prints: the report's plan fields, the group instances and every step."""
        return {**self.fields(), "plan": self.describe(), "instances": list(self.instances),
                "steps": [s.describe() for s in self.steps]}


def streamed_spec(model_type: str):
    """The symmetry spec of ``model_type`` for a streamed alignment, or one error for a family that cannot stream."""
    from ..families import spec_for

    spec = spec_for(model_type)
    if spec.in_memory_only:
        raise SymmergeError(f"streamed alignment does not support {spec.family} models: {spec.in_memory_only}")
    return spec


def per_layer_only(instances, asked: bool) -> list:
    """The instances a streamed alignment solves, one layer at a time. A per-layer kind's instance bound over a
    whole stack (layer -1: T5's self-attention heads, tied by the relative attention bias) acts on every layer of
    it at once: never streamed; 'recommended' (``asked``) leaves it out, an explicit symmetry is one error."""
    tied = [i for i in instances if i.layer < 0]
    if tied and not asked:
        raise SymmergeError(f"{', '.join(i.name for i in tied)}: one element for every layer of a stack at once "
                            f"({tied[0].group.param('description') or tied[0].kind.description}), which streamed "
                            "alignment, one layer at a time, cannot solve; align in memory (without --stream) or "
                            f"leave '{tied[0].group.symmetry}' out of --symmetries")
    return [i for i in instances if i.layer >= 0]


def _name(x, label: str) -> str:
    return str(x) if isinstance(x, (str, Path)) else label


def _safetensors_folder(x) -> bool:
    """Whether ``x`` is a folder of safetensors weights (a bad shard index is refused here, as the reader would)."""
    from ..io.model import ShardIndexError, weight_files

    if not isinstance(x, (str, Path)):
        return False
    try:
        return weight_files(Path(x))[1]
    except ShardIndexError:
        raise
    except SymmergeError:  # not a folder, no weights: the loader says so in its own words
        return False


def _headers(model, anchor, stream: bool):
    """(model, anchor) as LazyCheckpoints (a base model read as its fine-tune's class), or None when either is
    not a folder of safetensors weights (a model object, a pickle checkpoint): planned on the loaded model."""
    from ..io.checkpoint import LazyCheckpoint
    from ..io.prefix import adapt_checkpoint_pair

    if stream and not all(isinstance(x, (str, Path)) for x in (model, anchor)):
        raise SymmergeError("--stream reads safetensors folders, not models in memory")
    if not stream and not all(_safetensors_folder(x) for x in (model, anchor)):
        return None
    a, b, _ = adapt_checkpoint_pair(LazyCheckpoint(model, fused=True), LazyCheckpoint(anchor, fused=True))
    return a, b


def _check_pair(model, anchor, names=("model", "anchor")) -> None:
    """What the alignment refuses of the two checkpoints from their headers — architectures, attention heads, the
    shapes of the tensors both store — refused by the plan too (``--print-plan`` printed a plan for a BERT model and
    a Llama anchor). A tensor stored by one only (a tied head saved once) is left to the alignment, which compares
    the loaded models."""
    from dataclasses import replace

    from ..core.layout import check_layouts

    a, b = model.layout(str(names[0])), anchor.layout(str(names[1]))
    common = [k for k in a.shapes if k in b.shapes]  # the model's order: the first differing tensor named
    # the model types of the config classes transformers builds, as the plan binds them (a config.json whose
    # model_type contradicts its class is planned as the class, and refused by the alignment)
    check_layouts([replace(x, model_type=type(c.hf_config).model_type, shapes={k: x.shapes[k] for k in common})
                   for x, c in ((a, model), (b, anchor))])


def check_headers(model, anchor, names) -> None:
    """:func:`_check_pair` of two inputs that are folders of safetensors weights (else nothing: checked when loaded),
    named ``names`` in its message."""
    pair = _headers(model, anchor, stream=False)
    if pair is not None:
        _check_pair(*pair, names=names)


def _bind_headers(ckpt, spec, options: AlignOptions, streamed: bool):
    """(the instances of ``spec`` bound to the checkpoint's headers, the output's tensors): shapes as meta tensors,
    the one-dimensional tensors (norm weights, whose values decide the residual stream's group) read."""
    from ..core.resolve import config_sizes, resolve, value_keys

    sizes = config_sizes(spec, ckpt.hf_config)
    state = ckpt.meta()
    # streamed, only the few tensors per-layer binding reads (Qwen3's QK norms); in memory, the norms too
    state.update(ckpt.read(value_keys(spec, list(state), sizes["num_layers"]) if streamed
                           else [k for k, t in state.items() if t.dim() <= 1]))
    # as in memory: a declared tie's alias beside its source (a final norm cannot fold into a tied head), or with
    # --untie a tensor of its own
    state.update({alias: state[source] for alias, source in ckpt.ties.items() if source in state})
    rest = dict(sizes)
    num_layers, heads = rest.pop("num_layers"), rest.pop("num_heads")
    instances = resolve(spec, state, num_layers, heads, options.layers, model_wide=not streamed,
                        ties={} if options.untie else ckpt.ties, residual=options.residual,
                        disk_names=ckpt.disk_name, architecture=ckpt.class_name, **rest)
    return instances, list(state) if options.untie else ckpt.keys()


def plan_align(model, anchor, options: AlignOptions | None = None, *, stream: bool = False, pipeline: bool = False,
               allow_pickle: bool = False, checkpoints=None, verify_forward: bool = False,
               joint: bool = False) -> AlignPlan:
    """The :class:`AlignPlan` of aligning ``model`` to ``anchor`` (HF folders, or transformers models) with
    ``options``; ``stream``: layer by layer (``pipeline``: pipelined), whose groups are the per-layer ones.
    ``checkpoints``: the folders' (model, anchor) LazyCheckpoints already read and adapted to each other.
    ``joint``: the pair stands for more than two models aligned jointly (a barrier's), whose learned mixing
    options differ from a pair's."""
    from ..families import spec_for
    from ..io.sentence_transformers import check_pipelines
    from .engine import active
    from .matchers import search_refusal
    from .recommend import model_facts, recommended, require_declared

    options = AlignOptions.of(options)
    refuse_unread_mixture(options, joint)
    names = _name(model, "model"), _name(anchor, "anchor")
    pair = checkpoints if checkpoints is not None else _headers(model, anchor, stream)
    loaded = None
    if pair is None:  # a model in memory or a pickle checkpoint: bound on the model itself (read once: kept)
        from .bound import as_model, bind, untied

        loaded = as_model(model, allow_pickle)
        bound = bind(untied(loaded) if options.untie else loaded, options.layers, options.residual)
        spec, instances, keys = bound.spec, bound.instances, list(loaded.state_dict())
        model_type, hf_config = loaded.config.model_type, loaded.config
    else:
        _check_pair(*pair)
        ckpt = pair[0]
        model_type = type(ckpt.hf_config).model_type  # the config class's, as transformers builds the model
        hf_config = ckpt.hf_config
        spec = streamed_spec(model_type) if stream else spec_for(model_type)
        instances, keys = _bind_headers(ckpt, spec, options, stream)
    require_declared(spec, options)
    embedding = check_pipelines([(names[0], model)]) if isinstance(model, (str, Path)) else None
    asked = options.recommended
    resolved, note = recommended(options, available=[i.group.symmetry for i in instances], spec=spec,
                                 streamed=stream, **model_facts(embedding, hf_config))
    solved = active(instances, resolved.solver_options())
    if stream:
        solved = per_layer_only(solved, asked)
    refusal = search_refusal(resolved, any(not i.kind.per_layer for i in solved), resolved.symmetries)
    if refusal:
        raise SymmergeError(refusal)
    # the residual stream's group (the kind moving the heads' input), its variant as the norms decide it
    residual = next((i.info.variant for i in solved if i.kind.moves_heads_input), None)
    mode = "pipeline" if stream and pipeline else MODES[stream]
    if stream and resolved.matcher.learns:
        mode = LEARNED_STREAM
    plan = AlignPlan(model=names[0], anchor=names[1], model_type=model_type, family=spec.family, options=resolved,
                     requested=options.requested, note=note, mode=mode, instances=tuple(i.name for i in solved),
                     steps=plan_steps(keys, solved), residual_variant=residual, bound=tuple(instances),
                     loaded=loaded, verify_forward=verify_forward)
    if resolved.verify_tol is not None and not plan.verify()["outputs"]:  # the tolerance of a comparison never made
        raise SymmergeError("--verify-tol: the tolerance of the output comparison, and no outputs are compared here "
                            + ("(--no-verify)" if not resolved.verify else "(--stream checks the group elements; add "
                               "--verify-forward to compare the outputs)") + ": leave --verify-tol out")
    return plan


def plan_report(plan: AlignPlan, measured: dict) -> dict:
    """The align report (in memory and streamed): the plan and what the alignment measured
    (:func:`~symmerge.pipeline.report.build_report`); the plan's note on what 'recommended' left out goes to
    the entry of what caused it (the sentence-transformers pipeline reading the output)."""
    report = build_report(plan, measured)
    if plan.note and report.get("sentence_transformers") is not None:
        report["sentence_transformers"] = {**report["sentence_transformers"], "note": plan.note}
    return report
