"""Align a model to an anchor inside its symmetry orbit, in memory:
load → spec → canonical form → solve → apply → verify → report."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..core.apply import apply, canonicalize
from ..core.distance import parameter_keys, sq_distance
from ..core.layout import check_layouts, layout_of
from ..core.resolve import config_sizes, declared_ties, resolve
from ..device import resolve_device
from ..errors import SymmergeError
from ..families import spec_for
from ..io.model import load_model
from ..progress import stage
from .engine import solve
from .options import DEFAULT_SYMMETRIES, AlignOptions
from .report import Distances, alignment_report
from .verify import ELEMENT_CHECK, verify_elements, verify_forward, with_state_dict


def _load(x, allow_pickle: bool, progress: bool):
    """``as_model``, with a progress line when a folder is read."""
    if not isinstance(x, (str, Path)):
        return x
    with stage(f"loaded {x}", enabled=progress):
        return load_model(x, allow_pickle=allow_pickle)


def as_model(model, allow_pickle: bool = False):
    return load_model(model, allow_pickle=allow_pickle) if isinstance(model, (str, Path)) else model


def instances_for(model, layers=None, residual: str = "largest"):
    """(spec, instances) of a transformers model, ties as the model class declares them."""
    from ..io.checkpoint import DiskNames

    spec = spec_for(model.config.model_type)
    sizes = config_sizes(spec, model.config)
    return spec, resolve(spec, model.state_dict(), sizes.pop("num_layers"), sizes.pop("num_heads"), layers,
                         ties=declared_ties(model), residual=residual, architecture=type(model).__name__,
                         disk_names=DiskNames(model), **sizes)


def load_align_data(options: AlignOptions, model):
    """The unlabeled alignment data (``align_data``: a path or a loaded Data), at most ``align_samples``
    examples, validated against ``model`` (labels, if present, are not used)."""
    from ..io.data import Data, check_data, load_data, take

    if isinstance(options.align_data, Data):
        check_data(options.align_data, model, use_labels=False)
        return take(options.align_data, options.align_samples)
    max_length = options.learn.max_length if options.match == "learned" else None
    return load_data(options.align_data, model, max_examples=options.align_samples, max_length=max_length,
                     batch_size=min(options.learn.batch, options.align_samples), labels=False)


def untied(model):
    """``model`` itself, or — when its class ties weights (an LM head sharing the embeddings) — an equal
    copy of a class instance built with ``tie_word_embeddings=False``, every alias a tensor of its own."""
    if not declared_ties(model):
        return model
    import copy

    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    clone = type(model)(config).to(next(model.parameters()).dtype)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def check_compatible(model, anchor) -> None:
    """Same model_type, heads, tensor names and shapes, else one clear error."""
    check_layouts([layout_of(model, "model"), layout_of(anchor, "anchor")])


def _model_wide(instances, opts) -> list:
    return [i for i in instances if not i.kind.per_layer and i.kind.active(i, opts)]


def canonical(model, options: AlignOptions):
    """``model`` in the parameterisation the options' groups act on (untied with ``untie``; norms folded
    into their readers when the residual stream's group needs it; the same function), or ``model``."""
    model = untied(model) if options.untie else model
    _, instances = instances_for(model, residual=options.residual)
    wide = _model_wide(instances, options.solver_options())
    sd = model.state_dict()
    new = canonicalize(sd, wide)
    return model if all(new[k] is sd[k] for k in sd) else with_state_dict(model, new)


_GROUP_NAMES = {"orthogonal": "O(d) (RMSNorm, norms folded)",
                "centered": "O(d-1) x {+-1}: orthogonal maps fixing the all-ones direction (LayerNorm, norms folded)",
                "permutation": "S_d: permutations (LayerNorm kept: post-LN, or --residual permutation)",
                "signed_permutation": "signed permutations (RMSNorm kept: --residual permutation, or a final norm "
                                      "that cannot fold into a tied head)"}


@dataclass
class Alignment:
    """The result of :func:`align_pair`: the aligned model, the anchor in the same parameterisation
    (its norms folded when the aligned model's are), the report, and the solved elements."""

    model: object
    anchor: object
    report: dict
    elements: dict
    instances: list


def _require_groups(spec, instances, symmetries) -> None:
    """A requested symmetry whose groups this model does not have is an error, not a silent no-op."""
    bound = {i.group.symmetry for i in instances}
    for name in symmetries:
        if spec.group(name) is None and not any(g.symmetry == name for g in spec.groups):
            continue  # not a group of its own (rescale)
        if name not in bound:
            if name == "residual":
                raise SymmergeError(
                    "the residual symmetry needs a model with a task head reading the residual stream (e.g. "
                    "LlamaForCausalLM, ViTForImageClassification, GPT2LMHeadModel) of a family with a residual "
                    f"spec; this {spec.family} model has no residual group (a base model's output is the stream)")
            raise SymmergeError(f"this {spec.family} model has no {name!r} group")


def align_pair(model, anchor, options: AlignOptions | None = None, inputs: dict | None = None, progress=None,
               allow_pickle: bool = False) -> Alignment:
    """Move ``model`` inside its symmetry orbit as close as possible (L2) to ``anchor``.

    ``model``/``anchor``: transformers models or HF folder paths. Returns an :class:`Alignment`; raises
    :class:`SymmergeError` if the options' verification fails."""
    options = options or AlignOptions()
    model, anchor = (_load(x, allow_pickle, progress is not None) for x in (model, anchor))
    check_compatible(model, anchor)
    start = time.perf_counter()
    was_tied = bool(declared_ties(model) or declared_ties(anchor))
    if options.untie:
        model, anchor = untied(model), untied(anchor)
    spec, instances = instances_for(model, options.layers, options.residual)
    requested = options.requested
    options = options.resolved(i.group.symmetry for i in instances)
    _require_groups(spec, instances, options.symmetries)
    # cost GEMMs on ``options.device`` (default cpu: where the tensors are)
    gemm_device = None if options.device in (None, "cpu") else resolve_device(options.device)
    opts = options.solver_options(gemm_device)
    sd_a, sd_b = model.state_dict(), anchor.state_dict()
    wide = _model_wide(instances, opts)
    ca, cb = canonicalize(sd_a, wide), canonicalize(sd_b, wide)
    folded = any(ca[k] is not sd_a[k] for k in sd_a)
    sweeps: list[float] = []
    fields: dict = {"match": options.match}
    getattr(progress, "start", lambda: None)()  # the engine's progress lines count from here
    if options.match == "weights":
        elements = solve(instances, ca, cb, opts, progress=progress, history=sweeps, max_sweeps=options.max_sweeps,
                         tol=options.descent_tol)
    else:
        data = load_align_data(options, model)
        fields["align_samples_used"] = data.n
        if options.match == "activations":
            from .activations import match_activations

            elements = match_activations(instances, with_state_dict(model, ca), with_state_dict(anchor, cb), data,
                                         opts, progress=progress, timings=fields.setdefault("activation_seconds", {}))
        else:
            from .learn import learn_alignment

            start_elements = None
            if options.learn.start == "activations":
                from .activations import match_activations

                start_elements = match_activations(instances, with_state_dict(model, ca), with_state_dict(anchor, cb),
                                                   data, opts, progress=progress,
                                                   timings=fields.setdefault("activation_seconds", {}))
            elements, fields["learned"] = learn_alignment(instances, model, anchor, ca, cb, data, options,
                                                          progress=progress, start=start_elements)
    verify_elements(instances, elements)
    aligned_sd = apply(ca, instances, elements)
    match_seconds = time.perf_counter() - start
    aligned = with_state_dict(model, aligned_sd)
    keys = parameter_keys(model)
    distances = Distances()
    for k in keys:
        distances.add(k, sq_distance(ca, cb, [k]), sq_distance(aligned_sd, cb, [k]))
    fields.update(streamed=False, mode="in-memory", verify=ELEMENT_CHECK, match_seconds=match_seconds)
    if "residual" in options.symmetries:
        res = next(i for i in wide if i.group.symmetry == "residual")
        fields.update(residual_variant=res.info.variant, residual_group=_GROUP_NAMES[res.info.variant],
                      residual_sweeps_sq_distance=sweeps, sweeps=len(sweeps), norms_folded=folded,
                      untied=options.untie and was_tied)
        if folded:  # the distances above compare folded A and B; merging needs the anchor folded too
            fields["distance_before_unfolded"] = sq_distance(sd_a, sd_b, keys) ** 0.5
    solved = [i for i in instances if i.kind.active(i, opts)]
    report = alignment_report(spec, model.config.model_type, options, solved, distances, keys,
                              symmetries_requested=requested, **fields)
    if options.verify:
        with stage("verified the aligned model's outputs", enabled=progress is not None):
            report.update(verify_forward(model, aligned, spec, options.verify_tol, inputs))
    else:
        report.update(verify_max_abs_diff=None, verify_max_rel_diff=None)
    report["seconds"] = time.perf_counter() - start
    anchor_out = with_state_dict(anchor, cb) if folded else anchor
    return Alignment(aligned, anchor_out, report, elements, instances)


def align(model, anchor, symmetries=DEFAULT_SYMMETRIES, rescale: str = "joint", verify: bool = True, layers=None,
          verify_tol: float | None = None, inputs: dict | None = None, allow_pickle: bool = False, progress=None,
          **options):
    """``(aligned_model, report)``: :func:`align_pair` with keyword options (``symmetries``: subset of
    ``heads`` (head permutation), ``attn`` (per-head QK and VO rotations; RoPE models: per frequency
    pair), ``ffn`` (hidden-unit permutation), ``rescale`` (per-head QK/VO scales, solved ``joint``ly or
    ``sequential``ly as in the paper; RoPE pair scales; SwiGLU unit scales), ``residual`` (one transform
    of the residual stream; with folded norms the aligned model is returned folded — :func:`align_pair`
    also returns the anchor in that form). Further keywords: see :class:`AlignOptions`."""
    opts = AlignOptions(symmetries=symmetries, rescale=rescale, layers=layers, verify=verify, verify_tol=verify_tol,
                        **options)
    result = align_pair(model, anchor, opts, inputs=inputs, progress=progress, allow_pickle=allow_pickle)
    return result.model, result.report
