"""The "unlabeled data" table shared by the benchmarks (issue 13): for each row — no alignment, the
paper's matching, the best data-free matching, activation matching, learned alignment, each with and
without REPAIR — one alignment of A to B (timed), the loss along θ(α) = α·θ_A + (1−α)·θ_B on the curve
set (with REPAIR at every α for the REPAIR rows) and its barrier, and the α = 0.5 merges of the
requested methods scored on the test set (REPAIR applied after each merge for the REPAIR rows; its
statistics on the same unlabeled images as the alignment).

Nothing here is tuned on the evaluation sets: alignment and REPAIR see only ``align_data`` (unlabeled
training examples; labels, if present, are ignored)."""

from __future__ import annotations

import os
import time

from symmerge.evaluate.metrics import evaluate, interpolation_curve
from symmerge.merge.fuse import merge_models
from symmerge.pipeline.align import align_pair, load_align_data
from symmerge.pipeline.options import AlignOptions, LearnSettings

ALL = "heads,attn,ffn,rescale,residual"
PAPER = "attn,ffn,rescale"
# row label -> (match mode, symmetries, REPAIR, extra AlignOptions fields). ``None`` match: no alignment.
ROWS = {
    "none": (None, "none", False, {}),
    "paper (attn+ffn+rescale, weights)": ("weights", PAPER, False, {}),
    "best data-free (all groups, weights)": ("weights", ALL, False, {"max_sweeps": 200}),
    "activations": ("activations", ALL, False, {}),
    "activations + REPAIR": ("activations", ALL, True, {}),
    "learned": ("learned", ALL, False, {}),
    "learned + REPAIR": ("learned", ALL, True, {}),
}
# rows whose alignment is the same as another's (REPAIR changes only the merge): computed once
SAME_ALIGNMENT = {"activations + REPAIR": "activations", "learned + REPAIR": "learned"}


def row_options(label: str, align_data, samples: int, learn: LearnSettings | None = None) -> AlignOptions | None:
    match, syms, _, extra = ROWS[label]
    if match is None:
        return None
    if match == "weights":
        return AlignOptions(symmetries=syms, **extra)
    return AlignOptions(symmetries=syms, match=match, align_data=align_data, align_samples=samples,
                        learn=learn or LearnSettings(), **extra)


def run_rows(a, b, align_data, samples: int, curve, test, stats: dict, alphas, log=print, learn=None,
             rows=None, methods=("average", "fisher", "regmean"), heads: str = "merge") -> dict:
    """``{"rows": {label: {...}}, "curves": {label: curve}}``. ``stats``: method → Data for its statistics
    (None for the average). ``test``: None skips the merges (language models: the α = 0.5 point of the
    curve is the plain average's loss)."""
    from symmerge.merge.barrier import repaired_curve
    from symmerge.merge.repair import repair

    rows = list(rows or ROWS)
    out, curves, aligned = {}, {}, {}
    for label in rows:
        match, syms, with_repair, _ = ROWS[label]
        opts = row_options(label, align_data, samples, learn)
        load = os.getloadavg()[0]
        if label in SAME_ALIGNMENT and SAME_ALIGNMENT[label] in aligned:
            moved, end_b, info = aligned[SAME_ALIGNMENT[label]]
        else:
            t, cpu = time.perf_counter(), time.process_time()
            res = None if opts is None else align_pair(a, b, opts)
            secs, cpu = time.perf_counter() - t, time.process_time() - cpu
            moved, end_b = (a, b) if res is None else (res.model, res.anchor)
            rep = {} if res is None else res.report
            info = {"match": match, "symmetries": syms, "align_seconds": secs, "align_cpu_seconds": cpu,
                    "load_average": load,
                    "unlabeled_images": rep.get("align_samples_used", 0)}
            if "learned" in rep:
                info["learned"] = rep["learned"]
            if "activation_seconds" in rep:
                info["activation_seconds"] = rep["activation_seconds"]
            aligned[label] = (moved, end_b, info)
        entry = {**info, "repair": with_repair}
        if with_repair:
            curves[label] = repaired_curve(moved, end_b, curve, alphas, opts, progress=False, label=label)
            rdata = load_align_data(opts, end_b)
        else:
            curves[label] = interpolation_curve(moved, end_b, curve, alphas, progress=False, label=label)
        entry["barrier"] = curves[label]["barrier"]
        mid = alphas.index(0.5) if 0.5 in alphas else len(alphas) // 2
        entry["curve_mid_loss"], entry["curve_mid_accuracy"] = curves[label]["loss"][mid], curves[label]["accuracy"][mid]
        entry["merges"] = {}
        for method in methods if test is not None else ():
            t = time.perf_counter()
            merged, _ = merge_models([moved, end_b], method, align="none", data=stats.get(method), heads=heads,
                                     evaluate_result=False, progress=False)
            if with_repair:
                merged, _ = repair(merged, [moved, end_b], None, rdata)
            secs = time.perf_counter() - t
            score = evaluate(merged, test, progress=False)
            entry["merges"][method] = {"test_accuracy": score["accuracy"], "test_loss": score["loss"], "seconds": secs}
            log(f"  {label:38s} {method:8s} accuracy {score['accuracy']:.4f}  loss {score['loss']:.4f}")
        log(f"  {label:38s} barrier {entry['barrier']:.4f}  α=0.5 loss {entry['curve_mid_loss']:.4f}  "
            f"align {entry['align_seconds']:.1f} s (load {entry['load_average']:.1f}), "
            f"{entry['unlabeled_images']} unlabeled images")
        out[label] = entry
    return {"rows": out, "curves": curves}


NAMES = {"average": "average", "fisher": "Fisher", "regmean": "RegMean"}


def markdown(result: dict, endpoints_mean: float | None, methods=("average", "fisher", "regmean"),
             metric: str = "accuracy") -> str:
    """The table: one row per alignment; barrier, α = 0.5 score per merge method, images, seconds."""
    rows = result["rows"]
    methods = [m for m in methods if any(m in r["merges"] for r in rows.values())]
    n = len(result["alphas"])
    head = ["alignment", f"loss barrier ({n} points)", "α = 0.5 loss (curve set)"]
    head += [f"{NAMES[m]} α = 0.5 test accuracy (%)" for m in methods]
    head += ["unlabeled images", "alignment seconds: wall (load) / CPU"]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, r in rows.items():
        cells = [label, f"{r['barrier']:.4f}", f"{r['curve_mid_loss']:.4f}"]
        for m in methods:
            acc = r["merges"][m]["test_accuracy"]
            rel = f" ({100 * acc / endpoints_mean:.1f} %)" if endpoints_mean else ""
            cells.append(f"{100 * acc:.2f}{rel}")
        cells += [str(r["unlabeled_images"]), f"{r['align_seconds']:.1f} ({r['load_average']:.1f}) / {r.get('align_cpu_seconds', float('nan')):.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(result: dict, path, title: str, labels=None) -> None:
    from benchmarks.common import pyplot

    plt = pyplot()
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(12, 4.5))
    has_acc = any(any(x is not None for x in c.get("accuracy", [])) for c in result["curves"].values())
    for name, c in result["curves"].items():
        if labels and name not in labels:
            continue
        ax_l.plot(result["alphas"], c["loss"], marker="o", ms=4, label=f"{name}: LB {c['barrier']:.3f}")
        if has_acc:
            ax_a.plot(result["alphas"], c["accuracy"], marker="o", ms=4, label=name)
    ax_l.set(xlabel="α (0 = model B, 1 = model A aligned to B)", ylabel="loss (cross-entropy)",
             title="loss along θ(α) = α·θ_A + (1−α)·θ_B")
    ax_a.set(xlabel="α", ylabel="accuracy", title="accuracy")
    ax_l.legend(fontsize=8, loc="upper left")
    if has_acc:
        ax_a.legend(fontsize=8, loc="lower left")
    else:
        ax_a.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
