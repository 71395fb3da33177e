"""B5 (b)'s tables and plot from ``benchmarks.federated_rounds`` runs (one results.json per local-epochs
setting and seed, each with the ``fedavg``, ``mean`` (aligned) and ``guarded`` arms).

Run: ``python -m benchmarks.federated_rounds_report results/b5b/e*_seed* --out docs/results/b5b`` writes
``tables.md`` (accuracy per round, rounds to reach FedAvg's final accuracy, the alignment's distance gain,
the aligned aggregate against the plain average of the same clients in the same round) and
``accuracy_per_round.png``. A run cut short (fewer rounds, e.g. assembled from ``RUN.partial.json``) shows
"—" for its missing rounds, and "rounds to FedAvg's final" compares with FedAvg's last completed round.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .federated_rounds import rounds_to_reach

LABELS = {"clean:fedavg": "FedAvg", "clean:mean": "aligned", "clean:guarded": "aligned, min_align_gain 0.05"}


def load(folders) -> list[dict]:
    out = []
    for f in folders:
        d = json.loads((Path(f) / "results.json").read_text())
        out.append({"epochs": d["args"]["local_epochs"], "seed": d["args"]["seed"], "runs": d["runs"],
                    "args": d["args"]})
    return sorted(out, key=lambda x: (x["epochs"], x["seed"]))


def tables(results: list[dict]) -> str:
    rounds = max(len(r["runs"][k]["accuracy"]) for r in results for k in r["runs"])
    head = "| E | seed | arm | " + " | ".join(f"round {i}" for i in range(1, rounds + 1)) + \
           " | rounds to FedAvg's final | seconds |\n|---:|---:|---|" + "---:|" * (rounds + 2) + "\n"
    lines = [head]
    diag = ["| E | seed | round | mean distance gain of the alignment | largest gain on the FedAvg clients (probe) | "
            "aligned aggregate | plain average of the same clients |\n|---:|---:|---:|---:|---:|---:|---:|\n"]
    for r in results:
        fed = r["runs"]["clean:fedavg"]["accuracy"]
        for spec, run in r["runs"].items():
            reach = rounds_to_reach(run["accuracy"], fed[-1])
            acc = [f"{a:.4f}" for a in run["accuracy"]] + ["—"] * (rounds - len(run["accuracy"]))  # a run cut short
            seconds = f"{run['seconds']:.0f}" if run.get("seconds") is not None else "—"
            lines.append(f"| {r['epochs']:g} | {r['seed']} | {LABELS.get(spec, spec)} | " + " | ".join(acc)
                         + f" | {reach if reach is not None else 'not reached'} | {seconds} |\n")
        aligned, probe = r["runs"].get("clean:mean"), r["runs"]["clean:fedavg"].get("probe_gain") or []
        if aligned:
            for i, (gain, acc, plain) in enumerate(zip(aligned["gain"], aligned["accuracy"], aligned["paired_fedavg"])):
                p = f"{max(probe[i]):.4f}" if i < len(probe) else ""
                diag.append(f"| {r['epochs']:g} | {r['seed']} | {i + 1} | {gain:.4f} | {p} | {acc:.4f} | {plain:.4f} |\n")
    return "".join(lines) + "\n" + "".join(diag)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = sorted({r["epochs"] for r in results})
    fig, axes = plt.subplots(1, len(epochs), figsize=(4.2 * len(epochs), 3.4), squeeze=False)
    styles = {"clean:fedavg": ("k", "-"), "clean:mean": ("tab:red", "--"), "clean:guarded": ("tab:blue", ":")}
    for ax, e in zip(axes[0], epochs):
        for r in (x for x in results if x["epochs"] == e):
            for spec, run in r["runs"].items():
                color, ls = styles.get(spec, ("gray", "-"))
                acc = run["accuracy"]
                ax.plot(range(1, len(acc) + 1), acc, color=color, ls=ls, marker="os"[r["seed"] % 2], ms=4,
                        label=f"{LABELS.get(spec, spec)}, seed {r['seed']}")
        ax.set_xticks(range(1, max(len(run["accuracy"]) for r in results for run in r["runs"].values()) + 1))
        ax.set_title(f"E = {e:g} local epochs")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    results = load(args.folders)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = tables(results)
    (out / "tables.md").write_text(text)
    plot(results, out / "accuracy_per_round.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
