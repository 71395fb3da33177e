"""High-level fusion: load → check → align to an anchor → statistics on the aligned models → merge →
task heads → evaluate. The Python API behind ``symmerge merge``.

Alignment is an option of every method. Anchor (left unchanged, every other model aligned to it):
the given one; else the base model for task-vector methods (task arithmetic, TIES, DARE); else, for
two models, the second (the paper's convention, as in ``symmerge barrier``); else the model closest
(L2) to the plain average of all models. Statistics (Grams, Fishers) are gathered on the *aligned*
models. Task heads (parameters outside the base model, e.g. ``classifier.*``) are kept from one
model by default (``head_from``), or merged when every model has the same label space.
"""

from __future__ import annotations

import time
from pathlib import Path

from .align import align as align_model
from .align import as_model, folded, instances_for, parse_symmetries
from .data import Data, check_data, check_data_path, load_data
from .device import resolve_device
from .distance import distance
from .errors import SymmergeError
from .evaluate import distance_before_after, evaluate
from .heads import anchor_proxy, check_bodies, check_heads_mergeable, head_keys, untied, with_tied
from .merge import get_method
from .stats import fisher_stats, gram_stats
from .verify import with_state_dict

HEAD_POLICIES = ("keep", "merge")


def closest_to_average(state_dicts, keys) -> tuple[int, list[float]]:
    avg = {k: sum(sd[k].double() for sd in state_dicts) / len(state_dicts) for k in keys}
    dists = [distance(sd, avg, keys) for sd in state_dicts]
    return min(range(len(dists)), key=dists.__getitem__), dists


def _name(x, i) -> str:
    return str(x) if isinstance(x, (str, Path)) else f"model {i}"


def _as_data_list(data, n: int):
    if data is None:
        return []
    items = list(data) if isinstance(data, (list, tuple)) else [data]
    if len(items) not in (1, n):
        raise SymmergeError(f"give one data file for all models or one per model ({n}), got {len(items)}")
    return items


def _load_for(spec, model, cache: dict, **kw) -> Data:
    """Data for ``model``: loaded once per file, validated against each model that uses it."""
    if isinstance(spec, Data):
        check_data(spec, model)
        return spec
    key = str(spec)
    if key not in cache:
        cache[key] = load_data(spec, model, **kw)
    else:
        check_data(cache[key], model)
    return cache[key]


def choose_anchor(models, names, body, anchor, base_model, base_name, allow_pickle=False):
    """(anchor model, info) by the module's rule; ``anchor``: None, an index, or a model/folder."""
    if anchor is None and base_model is not None:
        return base_model, {"index": None, "name": base_name, "rule": "base model"}
    if anchor is None and len(models) == 2:
        return models[1], {"index": 1, "name": names[1], "rule": "second of two"}
    if anchor is None:
        idx, dists = closest_to_average([x.state_dict() for x in models], body)
        return models[idx], {"index": idx, "name": names[idx], "rule": "closest to the average",
                             "distances_to_average": dists}
    if isinstance(anchor, int):
        if not -len(models) <= anchor < len(models):
            raise SymmergeError(f"anchor index {anchor} out of range for {len(models)} models")
        anchor %= len(models)
        return models[anchor], {"index": anchor, "name": names[anchor], "rule": "given"}
    anchor_model = as_model(anchor, allow_pickle)
    check_bodies([models[0], anchor_model], [names[0], _name(anchor, "anchor")])
    return anchor_model, {"index": None, "name": _name(anchor, "anchor"), "rule": "given"}


def align_all(targets, anchor_model, body, symmetries, rescale, verify):
    """Align every (name, model) of ``targets`` except the anchor itself; (models, per-model reports)."""
    moved, reports = [], []
    for name, x in targets:
        if x is anchor_model:  # the residual group acts on the folded form: the anchor is folded too
            moved.append(folded(x) if "residual" in symmetries else x)
            reports.append({"model": name, "anchor": True})
            continue
        _, instances = instances_for(x)
        if "residual" in symmetries:  # the head reads the stream: it is matched too, so heads must agree
            check_heads_mergeable([x, anchor_model], [name, "the anchor"], labels=False,
                                  why="the residual symmetry rotates the heads' input; leave it out")
            proxy = anchor_model
        else:
            proxy = anchor_proxy(x, anchor_model, set(body))
        y, rep = align_model(x, proxy, symmetries, rescale=rescale, verify=verify)
        moved.append(y)
        reports.append({"model": name, "anchor": False, "distance_before": rep["distance_before"],
                        "distance_after": rep["distance_after"], "verify_max_rel_diff": rep.get("verify_max_rel_diff"),
                        "seconds": rep["seconds"], "distances": distance_before_after(x, proxy, y, instances)})
    return moved, reports


def gather_stats(kind, models, names, data_specs, cache, load_kw, dev, progress, gram_normalize=True,
                 fisher_variant="empirical", fisher_normalize=False, fisher_samples=1):
    """Per model (already aligned): its Grams or Fisher on its data file; (stats dicts, report rows)."""
    stats, info = [], []
    for i, x in enumerate(models):
        d = _load_for(data_specs[i if len(data_specs) > 1 else 0], x, cache, **load_kw)
        if kind == "gram":
            s = gram_stats(x, d, device=dev, progress=progress)
            stats.append(s.means() if gram_normalize else s.tensors)
        else:
            s = fisher_stats(x, d, variant=fisher_variant, normalize=fisher_normalize, samples=fisher_samples,
                             device=dev, progress=progress)
            stats.append(s.tensors)
        info.append({"model": names[i], "data": d.path, "examples": s.examples, "seconds": s.seconds})
        x.to("cpu")
    return stats, info


def merge_models(models, method: str = "average", align="none", anchor=None, data=None, weights=None,
                 params: dict | None = None, base=None, rescale: str = "joint", heads: str = "keep",
                 head_from: int = 0, device="cpu", fisher_variant: str = "empirical", fisher_normalize: bool = False,
                 fisher_samples: int = 1, gram_normalize: bool = True, batch_size: int = 32,
                 max_examples: int | None = None, max_length: int | None = None, verify: bool = True,
                 allow_pickle: bool = False, evaluate_result: bool = True, progress: bool = True):
    """Merge ``models`` (transformers models or HF folders) with ``method``; returns ``(model, report)``.

    ``align``: ``"none"`` or a symmetry list (``"attn"``, ``"attn,ffn"``, ``"attn,ffn,rescale"``).
    ``anchor``: index into ``models``, a model/folder, or ``None`` for the default rule (module doc).
    ``data``: a data file (or :class:`~symmerge.data.Data`) for all models, or one per model; used
    for statistics (RegMean, Fisher) and, with ``evaluate_result``, to evaluate the inputs and the
    result (with one file per model, the merged body is evaluated on file i with model i's head).
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    m = get_method(method)
    params = m.check_params(dict(params or {}))
    symmetries = parse_symmetries(align)
    if heads not in HEAD_POLICIES:
        raise SymmergeError(f"unknown head policy {heads!r}; choose keep or merge")
    dev = resolve_device(device)
    names = [_name(x, i) for i, x in enumerate(models)]
    if not names:
        raise SymmergeError("nothing to merge: no models given")
    data_specs = _as_data_list(data, len(names))
    for spec in data_specs:
        if not isinstance(spec, Data):
            check_data_path(spec)
    if m.needs and not data_specs:
        raise SymmergeError(f"method {m.name!r} needs data for its {m.needs} statistics: pass --data FILE")
    if m.needs_base and base is None:
        raise SymmergeError(f"method {m.name!r} needs a base model (the common pre-trained model): pass --base")
    if base is not None and not m.needs_base:
        raise SymmergeError(f"method {m.name!r} does not use a base model")
    if not -len(names) <= head_from < len(names):
        raise SymmergeError(f"--head-from {head_from} out of range for {len(names)} models")
    head_from %= len(names)
    if weights is not None and len(weights) != len(names):
        raise SymmergeError(f"got {len(weights)} weights for {len(names)} models")

    models = [as_model(x, allow_pickle) for x in models]
    base_name = _name(base, "base") if base is not None else None
    base_model = as_model(base, allow_pickle) if base is not None else None
    everything = models + ([base_model] if base_model is not None else [])
    body = check_bodies(everything, names + ([base_name] if base_model is not None else []))
    if heads == "merge":
        check_heads_mergeable(models, names)
    cache: dict = {}
    load_kw = {"batch_size": batch_size, "max_examples": max_examples, "max_length": max_length}
    for i, x in enumerate(models):  # read and validate the data now, before any expensive step
        if m.needs or (evaluate_result and (i == head_from or len(data_specs) > 1)):
            for j, spec in enumerate(data_specs):
                if len(data_specs) == 1 or j == i:
                    _load_for(spec, x, cache, **load_kw)
    timings["load"] = time.perf_counter() - t0

    # ------------------------------------------------ alignment
    t = time.perf_counter()
    alignment: dict = {"symmetries": list(symmetries), "rescale": rescale if "rescale" in symmetries else "none",
                       "anchor": {"index": None, "name": None, "rule": None}, "models": []}
    aligned, aligned_base = list(models), base_model
    if symmetries:
        anchor_model, alignment["anchor"] = choose_anchor(models, names, body, anchor, base_model, base_name,
                                                          allow_pickle)
        targets = list(zip(names, models)) + ([(base_name, base_model)] if base_model is not None else [])
        moved, alignment["models"] = align_all(targets, anchor_model, body, symmetries, rescale, verify)
        aligned, aligned_base = moved[:len(models)], moved[len(models)] if base_model is not None else None
    timings["align"] = time.perf_counter() - t

    # ------------------------------------------------ statistics on the aligned models
    t = time.perf_counter()
    stats, stats_info = None, None
    if m.needs:
        stats, stats_info = gather_stats(m.needs, aligned, names, data_specs, cache, load_kw, dev, progress,
                                         gram_normalize=gram_normalize, fisher_variant=fisher_variant,
                                         fisher_normalize=fisher_normalize, fisher_samples=fisher_samples)
    timings["statistics"] = time.perf_counter() - t

    # ------------------------------------------------ merge
    t = time.perf_counter()
    keys = untied(models[0], body + (sorted(head_keys(models[0])) if heads == "merge" else []))
    sds = [x.state_dict() for x in aligned]
    sub = [{k: sd[k] for k in keys} for sd in sds]
    stats_sub = None if stats is None else [{k: s[k] for k in keys if k in s} for s in stats]
    extra = {"base": {k: aligned_base.state_dict()[k] for k in keys}} if m.needs_base else {}
    merged_sd = m.merge(sub, weights=weights, stats=stats_sub, **extra, **params)
    holder = aligned[head_from]
    out = with_state_dict(holder, with_tied(holder, merged_sd))
    timings["merge"] = time.perf_counter() - t

    hk = head_keys(models[0])
    head_info = ({"policy": "none", "note": "base models without a task head"} if not hk else
                 {"policy": "merge", "keys": sorted(hk)} if heads == "merge" else
                 {"policy": "keep", "from_index": head_from, "from": names[head_from], "keys": sorted(head_keys(holder))})
    report = {
        "method": m.name,
        "params": params,
        "weights": list(weights) if weights is not None else None,
        "models": names,
        "base": base_name,
        "model_type": models[0].config.model_type,
        "alignment": alignment,
        "head": head_info,
        "statistics": None if stats_info is None else {
            "kind": m.needs, "per_model": stats_info,
            **({"gram_normalize": gram_normalize} if m.needs == "gram" else
               {"fisher_variant": fisher_variant, "fisher_normalize": fisher_normalize, "fisher_samples": fisher_samples}),
        },
        "distances_between_inputs": {"before_alignment": _pairwise([x.state_dict() for x in models], body, names),
                                     "after_alignment": _pairwise(sds, body, names)},
        "distance_result_to_inputs": {n: distance(out.state_dict(), sd, body) for n, sd in zip(names, sds)},
        "device": str(dev),
    }

    # ------------------------------------------------ evaluation
    t = time.perf_counter()
    if evaluate_result and data_specs:
        report["evaluation"] = _evaluate_all(out, models, aligned, merged_sd, data_specs, names, heads, head_from,
                                             cache, load_kw, dev, progress)
    timings["evaluate"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    report["timings"] = timings
    return out.to("cpu").eval(), report


def _pairwise(sds, keys, names) -> dict:
    return {f"{names[i]} | {names[j]}": distance(sds[i], sds[j], keys)
            for i in range(len(sds)) for j in range(i + 1, len(sds))}


def _evaluate_all(out, models, aligned, merged_sd, data_specs, names, heads, head_from, cache, load_kw, dev,
                  progress) -> dict:
    result = {"merged": [], "models": []}
    per_model = len(data_specs) > 1 or len(models) == 1
    for j, spec in enumerate(data_specs):
        # with one file per model, file j is scored with model j's head (the paper's protocol)
        owner = j if per_model else head_from
        probe = out if (heads == "merge" or owner == head_from) else with_state_dict(
            aligned[owner], with_tied(aligned[owner], merged_sd))
        d = _load_for(spec, probe, cache, **load_kw)
        r = evaluate(probe, d, device=dev, progress=progress, desc="evaluating merged")
        probe.to("cpu")
        result["merged"].append({"data": d.path, "head_from": names[owner] if heads == "keep" else "merged", **r})
        for i, x in enumerate(models):
            if per_model and i != j:
                continue
            try:
                check_data(d, x)
            except SymmergeError as e:
                result["models"].append({"model": names[i], "data": d.path, "skipped": str(e)})
                continue
            r = evaluate(x, d, device=dev, progress=progress, desc=f"evaluating {names[i]}")
            x.to("cpu")
            result["models"].append({"model": names[i], "data": d.path, **r})
    return result
