"""Issue 42, item 1: does ``--depth-decay F`` help the data-free alignment of other families than B1's ViTs?
Evidence for a default, measured F = 1 (today) against the other decays in one run.

    python -m benchmarks.datafree_families [--pairs demo:0 demo:2 demo:4 b7 disjoint b1:0,1] [--decays 1,10,32]
                                           [--out DIR]

For each pair, model A is aligned to model B without data (``align_pair``, ``match="weights"``) with the
symmetries ``recommended`` resolves to for the family (``symmerge.pipeline.recommend``, as ``symmerge align`` and
``barrier`` resolve it) and ``AlignOptions(depth_decay=F)`` for each F of ``--decays``; every alignment is verified
as ``align`` verifies it (each element valid, A's outputs kept: the report's max relative difference). Then
θ(α) = α·θ_A' + (1−α)·θ_B (θ_B in the aligned model's parameterisation, its norms folded as A's are: what
``merge`` and ``barrier`` interpolate) is scored on the pair's own held-out set at the pair benchmark's α values.

Pairs (each reuses its benchmark's loaders, models and held-out data; :data:`PAIRS`):

* ``demo:S`` — ``symmerge demo --seed S``'s two MNIST-5k ViTs (seeds S, S+1; trained in seconds if not cached),
  its 1 000 test digits, its 11 α values;
* ``b7`` / ``b7-gqa`` — B7's Llama pair (``benchmarks.llama_datafree``; the GQA pair with two KV heads), its 200
  held-out paragraphs, 5 α values;
* ``b4`` / ``b4-untie`` — B4's GPT-2 pair (``benchmarks.gpt2_text``; tied LM head; trained if not cached), its
  held-out curve paragraphs and α values; ``b4-untie`` aligns with ``untie`` (B4's ``recommended --untie``);
* ``b6`` — B6's Mixtral pair (``benchmarks.moe_text``; trained if not cached), its held-out curve paragraphs and
  α values (``recommended`` adds the ``experts`` group);
* ``disjoint`` — the two ViTs trained on disjoint halves of Fashion-MNIST's classes
  (``benchmarks.disjoint_classes``), its 10 000 test images (all classes), 5 α values;
* ``llama:NAME_A,NAME_B`` — two other cached Llama folders (under the cache's ``llama/``), on B7's held-out
  paragraphs;
* ``b1:SA,SB`` — a B1-recipe Fashion-MNIST ViT pair (``benchmarks.vit_fashion_mnist``), its curve set, 5 α values.

Per pair and F: the loss barrier, loss and accuracy at α = ½ (and the endpoints'), the weighted objective the
descent minimised (its last sweep), the unweighted distance of the aligned A to B, the sweeps, wall and CPU
seconds of the alignment, the verification. Writes ``results.json`` and ``tables.md`` into ``--out``.
``--train-only A|B`` trains (or finds cached) the pairs' models and stops (both models of each pair).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

DEFAULT_PAIRS = ("demo:0", "demo:2", "demo:4", "b7", "disjoint")


@dataclass
class Pair:
    """Two models of one family, the held-out data their path is scored on, and the α values."""

    name: str
    family: str
    a: object
    b: object
    data: object
    points: int
    models: tuple = ()
    align: dict = field(default_factory=dict)  # further AlignOptions of the pair's alignments (B4: untie)


def demo_pair(seed: str, log=print) -> Pair:
    from symmerge.demo.demo import FULL, demo_pair as trained, deterministic
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    with deterministic():  # trained as `symmerge demo` trains them
        folders, _, test_npz, *_ = trained(FULL, int(seed), progress=False, log=log)
    a, b = (load_model(f) for f in folders)
    return Pair(f"demo:{seed}", "ViT (demo, MNIST-5k)", a, b, load_data(test_npz, a, batch_size=250), FULL.points,
                tuple(str(f) for f in folders))


def llama_pair(kv_heads: int | None, log=print, names: str | None = None) -> Pair:
    """B7's cached pair (``names``: two other cached Llama folders, ``NAME_A,NAME_B`` under the cache's
    ``llama/``, scored on B7's held-out paragraphs as well)."""
    from benchmarks import llama_datafree
    from symmerge.demo.datasets import cache_dir

    folders = None if names is None else [cache_dir() / "llama" / n for n in names.split(",")]
    if folders is not None and (len(folders) != 2 or not all(f.is_dir() for f in folders)):
        raise SystemExit(f"llama:{names}: give two cached model folders under {cache_dir() / 'llama'}, NAME_A,NAME_B")
    folders, a, b, curve = llama_datafree.load_pair(kv_heads, 200, folders)
    name = f"llama:{names}" if names else "b7-gqa" if kv_heads else "b7"
    c = a.config
    heads = f"GQA, {c.num_key_value_heads} KV heads" if c.num_key_value_heads != c.num_attention_heads else "MHA"
    family = f"Llama ({'cached' if names else 'B7'}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, {heads})"
    return Pair(name, family, a, b, curve, len(llama_datafree.ALPHAS), tuple(str(f) for f in folders))


def disjoint_pair(_, log=print) -> Pair:
    from benchmarks import disjoint_classes
    from symmerge.demo.datasets import cache_dir, write_npz
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    args = disjoint_classes.parse_args(["--out", "unused"])
    folders, _, x_test, y_test, _ = disjoint_classes.prepare(args, log)
    test = write_npz(cache_dir() / "benchmarks" / "datafree-families" / "disjoint-test.npz", x_test.numpy(), y_test)
    a, b = (load_model(f) for f in folders)
    return Pair("disjoint", "ViT (disjoint classes, Fashion-MNIST)", a, b, load_data(test, a, batch_size=500), 5,
                tuple(str(f) for f in folders))


def b1_pair(seeds: str, log=print) -> Pair:
    from benchmarks import vit_fashion_mnist as b1

    _, _, folders, _, _, a, b, _, curve = b1.load_pair(b1.parse_args(["--seeds", seeds]), log)
    return Pair(f"b1:{seeds}", "ViT (B1 recipe, Fashion-MNIST)", a, b, curve, 5, tuple(str(f) for f in folders))


def gpt2_pair(untie: bool, log=print) -> Pair:
    """B4's two GPT-2s (``benchmarks.gpt2_text``: tied LM head; trained if not cached), its held-out paragraphs;
    ``untie``: aligned with ``AlignOptions(untie=True)`` (the stream in O(d−1), B4's ``recommended --untie``)."""
    from benchmarks import gpt2_text
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    args = gpt2_text.parse_args(["--out", "unused"])
    data = gpt2_text.prepare_data(args, gpt2_text.work_dir(args))
    _, _, folders = gpt2_text.train_pair(args, data, log)
    a, b = (load_model(f) for f in folders)
    family = f"GPT-2 (B4, {a.config.n_layer} layers, tied head{', untie' if untie else ''})"
    return Pair("b4-untie" if untie else "b4", family, a, b, load_data(data["files"]["curve"], a, batch_size=32),
                args.points, tuple(str(f) for f in folders), {"untie": True} if untie else {})


def moe_pair(_, log=print) -> Pair:
    """B6's two Mixtral-style models (``benchmarks.moe_text``: trained if not cached), its held-out paragraphs."""
    from benchmarks import moe_text
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    args = moe_text.parse_args(["--out", "unused"])
    data = moe_text.prepare_data(args, moe_text.work_dir(args))
    _, _, folders = moe_text.train_pair(args, data, log)
    a, b = (load_model(f) for f in folders)
    c = a.config
    family = f"Mixtral (B6, {c.num_hidden_layers} layers, {c.num_local_experts} experts, top-{c.num_experts_per_tok})"
    return Pair("b6", family, a, b, load_data(data["files"]["curve"], a, batch_size=32), args.points,
                tuple(str(f) for f in folders))


PAIRS = {"demo": demo_pair, "b7": lambda _, log=print: llama_pair(None, log),
         "b7-gqa": lambda _, log=print: llama_pair(2, log), "disjoint": disjoint_pair, "b1": b1_pair,
         "llama": lambda names, log=print: llama_pair(None, log, names), "b6": moe_pair,
         "b4": lambda _, log=print: gpt2_pair(False, log), "b4-untie": lambda _, log=print: gpt2_pair(True, log)}


def load(spec: str, log=print) -> Pair:
    """The pair named by ``spec`` (``kind`` or ``kind:argument``, see :data:`PAIRS`)."""
    kind, _, arg = spec.partition(":")
    if kind not in PAIRS:
        raise SystemExit(f"unknown pair {spec!r}; choose among {', '.join(PAIRS)} (demo:SEED, b1:SEED_A,SEED_B, "
                         "llama:NAME_A,NAME_B)")
    return PAIRS[kind](arg, log)


def measure(a, b, data, decay: float, points: int, symmetries: str = "recommended", **align):
    """A aligned to B data-free with ``depth_decay=decay`` (and the further ``AlignOptions`` ``align``), scored
    along the path at ``points`` α values: ``(row, Alignment)``. ``align_pair`` verifies the alignment (an error
    if it fails)."""
    from symmerge.evaluate.metrics import interpolation_curve
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions

    wall, cpu = time.perf_counter(), time.process_time()
    res = align_pair(a, b, AlignOptions(symmetries=symmetries, depth_decay=decay, **align))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    alphas = [i / (points - 1) for i in range(points)]
    curve = interpolation_curve(res.model, res.anchor, data, alphas, progress=False)
    rep, mid = res.report, alphas.index(0.5)
    row = {"depth_decay": decay, "symmetries": rep["symmetries"], "barrier": curve["barrier"],
           "loss_mid": curve["loss"][mid], "accuracy_mid": curve["accuracy"][mid],
           "accuracy_endpoints": [curve["accuracy"][-1], curve["accuracy"][0]], "alphas": alphas,
           "loss": curve["loss"], "accuracy": curve["accuracy"],
           "objective": rep["residual_sweeps_sq_distance"][-1], "distance_after": rep["distance_after"],
           "sweeps": rep["sweeps"], "seconds": wall, "cpu_seconds": cpu, "load_average": os.getloadavg()[0],
           "verify_max_rel_diff": rep["verify_max_rel_diff"], "verify_max_abs_diff": rep["verify_max_abs_diff"]}
    return row, res


def run_pair(pair: Pair, decays, log=print) -> dict:
    rows = []
    for decay in decays:
        row, _ = measure(pair.a, pair.b, pair.data, decay, pair.points, **pair.align)
        rows.append(row)
        log(f"  {pair.name:10s} F={decay:<4g} barrier {row['barrier']:.4f}  acc(½) {row['accuracy_mid']:.4f}  "
            f"objective {row['objective']:.2f}  sweeps {row['sweeps']:3d}  {row['seconds']:6.2f} s  "
            f"verify {row['verify_max_rel_diff']:.1e}")
    return {"pair": pair.name, "family": pair.family, "models": list(pair.models), "examples": pair.data.n,
            "points": pair.points, "align": pair.align, "rows": rows}


def markdown(result: dict) -> str:
    lines = ["| pair | F | barrier | loss at ½ | acc at ½ (endpoints A / B) | objective (weighted) | distance after | "
             "sweeps | wall s | max rel diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["pairs"]:
        for r in p["rows"]:
            ea, eb = r["accuracy_endpoints"]
            lines.append(f"| {p['pair']} | {r['depth_decay']:g} | {r['barrier']:.4f} | {r['loss_mid']:.4f} | "
                         f"{r['accuracy_mid']:.4f} ({ea:.4f} / {eb:.4f}) | {r['objective']:.2f} | "
                         f"{r['distance_after']:.3f} | {r['sweeps']} | {r['seconds']:.2f} | "
                         f"{r['verify_max_rel_diff']:.1e} |")
    lines += ["", "Change against the first F (barrier and loss: negative is better; accuracy: positive is better):", ""]
    for p in result["pairs"]:
        base = p["rows"][0]
        lines.append(f"- {p['pair']} ({p['family']}; {p['examples']} held-out examples, {p['points']} points): " + ", ".join(
            f"F = {r['depth_decay']:g}: {r['barrier'] - base['barrier']:+.4f} (loss at ½ "
            f"{r['loss_mid'] - base['loss_mid']:+.4f}, acc at ½ {r['accuracy_mid'] - base['accuracy_mid']:+.4f})"
            for r in p["rows"][1:]))
    return "\n".join(lines) + "\n"


def run(args, log=print) -> dict:
    from benchmarks.common import machine

    t0 = time.perf_counter()
    result = {"benchmark": "datafree_families", "machine": machine(), "decays": args.decays,
              "command": " ".join(["python -m benchmarks.datafree_families"] + args.argv),
              "pairs": [run_pair(load(s, log), args.decays, log) for s in args.pairs]}
    result["seconds_total"] = time.perf_counter() - t0
    return result


def print_tables(result: dict, log=print) -> None:
    log("\n" + markdown(result))


def parse_args(argv=None):
    from benchmarks.common import add_run_args

    p = argparse.ArgumentParser(prog="python -m benchmarks.datafree_families", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", nargs="+", default=list(DEFAULT_PAIRS), help="pairs (default: %(default)s)")
    p.add_argument("--decays", default="1,10,32", help="comma-separated depth decays; the first is the reference")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    add_run_args(p)
    args = p.parse_args(argv)
    args.decays = [float(f) for f in args.decays.split(",")]
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv=None) -> int:
    from benchmarks.common import bench_main, write_results

    args = parse_args(argv)
    return bench_main(args, lambda: [load(s) for s in args.pairs], run, print_tables,
                      lambda result, out: write_results(out, result, markdown(result)), "tables.md")


if __name__ == "__main__":
    sys.exit(main())
