"""Align a model to an anchor inside its symmetry orbit: load → spec → solve → apply → verify."""

from __future__ import annotations

import time
from pathlib import Path

from .apply import apply, fold_norms
from .distance import distance, parameter_keys, per_module
from .errors import SymmergeError
from .io import load_model
from .resolve import config_sizes, resolve
from .solve import RESCALE_MODES, solve
from .spec import SYMMETRIES, spec_for
from .verify import compare, default_tolerance, sample_inputs, with_state_dict

DEFAULT_SYMMETRIES = ("attn", "ffn", "rescale")


def parse_symmetries(value) -> tuple[str, ...]:
    """'attn,ffn' or an iterable → a validated tuple; 'none' or '' → ()."""
    if isinstance(value, str):
        value = [] if value.strip() in ("", "none") else value.split(",")
    names = tuple(v.strip() for v in value if v.strip())
    unknown = [n for n in names if n not in SYMMETRIES]
    if unknown:
        raise SymmergeError(f"unknown symmetry {unknown[0]!r}; choose from {', '.join(SYMMETRIES)}")
    return names


def as_model(model, allow_pickle: bool = False):
    return load_model(model, allow_pickle=allow_pickle) if isinstance(model, (str, Path)) else model


def check_layouts(types, heads, shapes) -> None:
    """Model and anchor layouts given as pairs: model types, attention-head counts and
    ``{tensor name: shape}``; anything different raises one clear error."""
    (ta, tb), (ha, hb), (sa, sb) = types, heads, shapes
    if ta != tb:
        raise SymmergeError(f"architectures differ: model is {ta!r}, anchor is {tb!r}")
    if ha != hb:  # same shapes, but the head blocks would not correspond
        raise SymmergeError(f"architectures differ: model has {ha} attention heads, anchor has {hb}")
    if sa.keys() != sb.keys():
        only = sorted(set(sa) ^ set(sb))[:3]
        raise SymmergeError(f"architectures differ: tensors present in only one model, e.g. {only}")
    for k in sa:
        if tuple(sa[k]) != tuple(sb[k]):
            raise SymmergeError(f"shapes differ for {k}: {tuple(sa[k])} vs {tuple(sb[k])}")


def check_compatible(model, anchor) -> None:
    """Same model_type, same tensor names and shapes, else one clear error."""
    pair = (model, anchor)
    check_layouts([m.config.model_type for m in pair], [m.config.num_attention_heads for m in pair],
                  [{k: t.shape for k, t in m.state_dict().items()} for m in pair])


def instances_for(model, layers=None):
    spec = spec_for(model.config.model_type)
    sizes = config_sizes(spec, model.config)
    return spec, resolve(spec, model.state_dict(), sizes.pop("num_layers"), sizes.pop("num_heads"), layers, **sizes)


def folded(model):
    """``model`` with its norm weights folded into their readers (the same function, a copy; the
    parameterisation the ``residual`` symmetry acts on), or ``model`` itself when nothing folds."""
    _, instances = instances_for(model)
    if not any(i.folds for i in instances):
        return model
    return with_state_dict(model, fold_norms(model.state_dict(), instances))


def align(model, anchor, symmetries=DEFAULT_SYMMETRIES, rescale: str = "joint", verify: bool = True,
          layers=None, verify_tol: float | None = None, inputs: dict | None = None, allow_pickle: bool = False,
          progress=None):
    """Move ``model`` inside its symmetry orbit as close as possible (L2) to ``anchor``.

    ``model``/``anchor``: transformers models or HF folder paths. ``symmetries``: subset of
    ``attn`` (per-head QK and VO rotations; RoPE models: per frequency pair), ``ffn`` (hidden-unit
    permutation), ``rescale`` (per-head QK/VO scales, solved ``joint``ly or ``sequential``ly as in
    the paper; RoPE pair scales; SwiGLU unit scales), ``residual`` (opt-in, pre-RMSNorm decoders with
    their head: one orthogonal transform of the residual stream after folding the norm weights into
    their readers — the aligned model is returned folded, and distances compare it with the folded
    anchor: :func:`folded` gives the anchor in that form; ``merge_models`` and ``barrier_study`` fold it themselves).
    ``layers``: only align these layer indices. Returns ``(aligned_model, report)``; raises
    :class:`SymmergeError` if ``verify`` and the aligned model's outputs differ beyond tolerance.
    """
    if rescale not in RESCALE_MODES:
        raise SymmergeError(f"unknown rescale mode {rescale!r}; choose one of {', '.join(RESCALE_MODES)}")
    symmetries = parse_symmetries(symmetries)
    model, anchor = as_model(model, allow_pickle), as_model(anchor, allow_pickle)
    check_compatible(model, anchor)
    start = time.perf_counter()
    spec, instances = instances_for(model, layers)
    sd_a, sd_b = model.state_dict(), anchor.state_dict()
    unfolded = (sd_a, sd_b)
    fold = "residual" in symmetries and any(i.folds for i in instances)
    if fold:  # the residual symmetry acts on the folded parameterisation (norm weights = 1), anchor too
        sd_a, sd_b = fold_norms(sd_a, instances), fold_norms(sd_b, instances)
    sweeps: list[float] = []
    elements = solve(instances, sd_a, sd_b, symmetries, rescale, progress=progress, history=sweeps)
    aligned_sd = apply(sd_a, instances, elements)
    match_seconds = time.perf_counter() - start
    aligned = with_state_dict(model, aligned_sd)
    keys = parameter_keys(model)
    report = {
        "family": spec.family,
        "model_type": model.config.model_type,
        "symmetries": list(symmetries),
        "rescale": rescale if "rescale" in symmetries else "none",
        "layers": list(layers) if layers is not None else "all",
        "distance_before": distance(sd_a, sd_b, keys),
        "distance_after": distance(aligned_sd, sd_b, keys),
        "per_module": {
            name: {"before": before, "after": after}
            for (name, before), after in zip(
                per_module(instances, sd_a, sd_b).items(), per_module(instances, aligned_sd, sd_b).values()
            )
        },
        "match_seconds": match_seconds,
    }
    if "residual" in symmetries:
        report["residual_variant"] = next(i.variant for i in instances if i.name == "residual")
        report["residual_sweeps_sq_distance"] = sweeps
        report["norms_folded"] = fold
        if fold:  # distances above compare folded A/B; the anchor must be folded too before merging
            report["distance_before_unfolded"] = distance(*unfolded, keys)
    if verify:
        dtype = next(model.parameters()).dtype
        tol = default_tolerance(dtype) if verify_tol is None else verify_tol
        diff = compare(model, aligned, inputs or sample_inputs(model, spec))
        report.update(verify_max_abs_diff=diff["max_abs_diff"], verify_max_rel_diff=diff["max_rel_diff"],
                      verify_tolerance=tol)
        if not diff["max_rel_diff"] <= tol:
            raise SymmergeError(
                f"aligned model is not equivalent: max relative output difference {diff['max_rel_diff']:.3g} > {tol:.3g}"
            )
    else:
        report.update(verify_max_abs_diff=None, verify_max_rel_diff=None)
    report["seconds"] = time.perf_counter() - start
    return aligned, report
