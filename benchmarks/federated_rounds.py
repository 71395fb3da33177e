"""B5 (b)/(c) at a small scale: multi-round federated training from one shared init, in one process.

8 clients hold Dirichlet(``--alpha``) label-skewed Fashion-MNIST shards (the examples/federated app's
shards and ViT); every round each trains ``--local-steps`` steps from the global model, and
``AlignedFedAvg.aggregate_train`` (the very strategy a Flower ServerApp runs; the rounds are driven
here without Ray, to keep the benchmark cheap) builds the next global model, scored on ``--test``
test images after each round. ``--attack scale100``: client 0 sends global + 100 x its update;
``flip``: client 0 trains on flipped labels (9 - y); ``absent``: client 0 sends nothing (the clean
run without the attacker's shard: what a perfect filter can reach). Each run is one row: its settings
and the accuracy per round.

Run: ``FLWR_TELEMETRY_ENABLED=0 python -m benchmarks.federated_rounds --runs clean:mean,scale100:mean,scale100:robust``
(``mean``: weighted mean, no norm rule; ``robust``: coordinate-wise median and norm_factor 10;
``filtered``: weighted mean, norm_factor 10 and the outlier rule on the aligned updates
(``--outlier-rule``, default ``krum``, ``--outlier-threshold``, default 3.5); ``clipped``: the same,
with ``norm_clip`` (an update beyond the norm rule is scaled down to the others' median norm, not left
out); ``clip``: weighted mean and ``norm_clip``, no outlier rule; ``fedavg``: no
alignment, weighted mean, no norm rule; ``guarded``: aligned, weighted mean, ``min_align_gain``
(``--min-align-gain``, default 0.05, the strategy's default: a client whose alignment lowers its distance to
the global model by less keeps its own frame); ``consensus``: weighted mean, norm_factor 10 and the functional
outlier rule ``consensus`` on ``--server-images`` unlabeled training images held by the server;
``consensus_clip``: the same with ``norm_clip``; ``relabel_detect``: the consensus arm with the relabelling
check (``--relabel-threshold``, ``--relabel-min-cycle``); every other aligned arm aligns every client
(``min_align_gain=0``, as they were measured before the guard existed)).
B5 (b): ``--runs clean:fedavg,clean:mean,clean:guarded --local-epochs E [--examples-per-client N] --probe``.

B5 (b)'s tables and plot from such runs (one results.json per local-epochs setting and seed, each with the
``fedavg``, ``mean`` (aligned) and ``guarded`` arms), nothing trained:
``python -m benchmarks.federated_rounds --report results/b5b/e*_seed* --out docs/results/b5b`` writes
``tables.md`` (accuracy per round, rounds to reach FedAvg's final accuracy, the alignment's distance gain,
the aligned aggregate against the plain average of the same clients in the same round) and
``accuracy_per_round.png``. A run cut short (fewer rounds, e.g. assembled from ``RUN.partial.json``) shows
"—" for its missing rounds, and "rounds to FedAvg's final" compares with FedAvg's last completed round.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .bench_federated import EXAMPLE, replies_for

# the aligned arms but "guarded" align every client (min_align_gain 0: as measured before the guard existed)
ARMS = {"fedavg": {"alignment": "none", "norm_factor": None},
        "mean": {"norm_factor": None, "min_align_gain": 0.0},
        "robust": {"aggregation": "median", "norm_factor": 10.0, "min_align_gain": 0.0},
        "filtered": {"norm_factor": 10.0, "outlier_rule": "krum", "outlier_threshold": 3.5, "min_align_gain": 0.0},
        "clipped": {"norm_factor": 10.0, "norm_clip": True, "outlier_rule": "krum", "outlier_threshold": 3.5,
                    "min_align_gain": 0.0},
        "clip": {"norm_factor": 10.0, "norm_clip": True, "min_align_gain": 0.0},
        "guarded": {"norm_factor": None, "min_align_gain": 0.05},
        "consensus": {"norm_factor": 10.0, "outlier_rule": "consensus", "outlier_threshold": 3.5, "min_align_gain": 0.0},
        "consensus_clip": {"norm_factor": 10.0, "norm_clip": True, "outlier_rule": "consensus", "outlier_threshold": 3.5,
                           "min_align_gain": 0.0}}
# the consensus arm with the relabelling check: a client whose best relabelling of the classes gains >= the
# check's threshold is left out too (the repairs measured beside it are no longer in the strategy: docs/federated.md)
ARMS["relabel_detect"] = {**ARMS["consensus"], "relabel": True}
ATTACKS = ("clean", "scale100", "flip", "absent")
RELABEL: dict = {}  # the relabel arm's RelabelCheck settings (set from the command line)


def strategy_options(arm: str, server_data=None) -> dict:
    """AlignedFedAvg's options objects for the flat settings of ``ARMS[arm]`` (``server_data``: the consensus
    arms' unlabeled server images)."""
    from symmerge.federated import Aggregation, ClientAlignment, OutlierPolicy, RelabelCheck
    from symmerge.federated.options import MIN_ALIGN_GAIN

    a = dict(ARMS[arm])
    alignment = ClientAlignment(a.pop("alignment", None), min_align_gain=a.pop("min_align_gain", MIN_ALIGN_GAIN))
    aggregation = Aggregation(a.pop("aggregation", "mean"), min_clients=2)
    rule = a.pop("outlier_rule", None)
    outliers = OutlierPolicy(norm_factor=a.pop("norm_factor", 10.0), norm_clip=a.pop("norm_clip", False), rule=rule,
                             threshold=a.pop("outlier_threshold", 3.5), data=server_data if rule == "consensus" else None,
                             relabel=RelabelCheck(**RELABEL) if a.pop("relabel", False) else None)
    if a:
        raise ValueError(f"arm {arm!r}: unknown settings {sorted(a)}")
    return {"alignment": alignment, "aggregation": aggregation, "outliers": outliers}


TRAINED: dict = {}  # (start model's hash, round, client, flipped, steps) -> the client's trained state dict


def _digest(state_dict: dict) -> str:
    h = hashlib.sha256()
    for k, v in state_dict.items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def local_steps(cfg: dict, n: int, epochs: float | None) -> int:
    """A client's local steps in a round: ``local-steps``, or ``epochs`` passes over its ``n`` examples."""
    return int(cfg["local-steps"]) if epochs is None else max(1, int(math.ceil(epochs * n / int(cfg["batch-size"]))))


_WORKER: dict = {}  # a training worker's task module, settings and shards


def _worker_init(example: str, cfg: dict, clients: int, threads: int) -> None:
    sys.path.insert(0, example)
    from fedvit import task

    torch.set_num_threads(threads)
    _WORKER.update(task=task, cfg=cfg, clients=clients, shards={})


def _train_client(start: dict, pid: int, flip: bool, steps: int, seed: int, device) -> dict:
    """One client's local training in a worker process (``--workers``): the state dict it sends."""
    task, cfg, shards = _WORKER["task"], _WORKER["cfg"], _WORKER["shards"]
    if pid not in shards:
        shards[pid] = task.load_partition(pid, _WORKER["clients"], cfg)
    x, y = shards[pid]
    local = task.load_model(cfg)
    local.load_state_dict(start)
    task.train(local, x, 9 - y if flip else y, {**cfg, "local-steps": steps}, seed=seed, device=device)
    return {k: v.detach().clone() for k, v in local.state_dict().items()}


def run_one(task, cfg, attack: str, arm: str, rounds: int, clients: int, test, log=print, epochs: float | None = None,
            probe: bool = False, save: Path | None = None, server_data=None, device=None,
            partial: Path | None = None, pool=None) -> dict:
    """One run: ``{"accuracy": [...], ...}`` per round, with the mean distance to the global model before and
    after alignment, the mean relative gain of the alignment, ``paired_fedavg`` (aligned arms: the accuracy of
    the plain weighted average of the same clients' models, that round) and, with ``probe`` for an arm without
    alignment, ``probe_gain``: what the data-free alignment would have gained on its clients. A client's
    local training is reused across runs when it starts from the same model (the first round of every arm).
    ``server_data``: the server's unlabeled images (a .npz) for the consensus arms. ``save``: a folder that gets each round's clients (``round<r>.pt``: the round's global model, the clients'
    state dicts, partition ids and example counts), for offline diagnostics. ``device``: where the clients'
    local training runs (the aggregation and the scoring stay on the CPU). ``partial``: a JSON file rewritten
    after every round with the run so far (what a run cut short still leaves). ``pool``: a process pool
    (:func:`_worker_init`) that trains a round's clients side by side; each client's training is the same
    as in this process (the same batches, from the same seed)."""
    from flwr.app import ArrayRecord

    from symmerge.demo.train import accuracy
    from symmerge.federated import AlignedFedAvg, aggregate
    from symmerge.pipeline.align import align_pair

    model = task.load_model(cfg)
    strategy = AlignedFedAvg(model, fraction_evaluate=0.0, **strategy_options(arm, server_data))
    arrays = ArrayRecord(model.state_dict())
    data = [task.load_partition(pid, clients, cfg) for pid in range(clients)]
    out = {"accuracy": [], "distance_before": [], "distance_after": [], "gain": [], "unaligned": [], "outlier_z": [],
           "left_out": [], "relabel_gain": [],
           "paired_fedavg": [], "probe_gain": [], "local_steps": [local_steps(cfg, len(x), epochs) for x, _ in data]}
    for r in range(1, rounds + 1):
        start = arrays.to_torch_state_dict()
        digest = _digest(start)
        states, sizes, pids, jobs, keys = [], [], [], {}, []
        for pid, (x, y) in enumerate(data):
            if attack == "absent" and pid == 0:
                continue
            flip = attack == "flip" and pid == 0
            steps = local_steps(cfg, len(x), epochs)
            key = (digest, r, pid, flip, steps)
            keys.append((pid, key))
            if key in TRAINED or key in jobs:
                continue
            if pool is not None:
                jobs[key] = pool.submit(_train_client, start, pid, flip, steps, 1000 * r + pid, device)
                continue
            local = task.load_model(cfg)
            local.load_state_dict(start)
            task.train(local, x, 9 - y if flip else y, {**cfg, "local-steps": steps}, seed=1000 * r + pid,
                       device=device)
            TRAINED[key] = {k: v.detach().clone() for k, v in local.state_dict().items()}
        TRAINED.update({key: job.result() for key, job in jobs.items()})
        for pid, key in keys:
            sd = dict(TRAINED[key])
            if attack == "scale100" and pid == 0:
                sd = {k: start[k] + 100.0 * (v - start[k]) for k, v in sd.items()}
            states.append(sd)
            sizes.append(len(data[pid][0]))
            pids.append(pid)
        if save is not None:
            save.mkdir(parents=True, exist_ok=True)
            torch.save({"start": start, "states": states, "pids": pids, "sizes": sizes}, save / f"round{r}.pt")
        strategy.global_arrays = arrays
        arrays, _ = strategy.aggregate_train(r, replies_for(states, sizes))
        model.load_state_dict(arrays.to_torch_state_dict())
        out["accuracy"].append(accuracy(model, *test)[1])
        rec = strategy.rounds[-1]
        before, after = rec["distance_before"], rec["distance_after"]
        if before:
            out["distance_before"].append(sum(before) / len(before))
            out["distance_after"].append(sum(after) / len(after))
            out["gain"].append(sum((b - a) / b for b, a in zip(before, after) if b > 0) / len(before))
        out["unaligned"].append([pids[x["node"] - 1] for x in rec.get("unaligned", [])])
        out["outlier_z"].append({pids[n - 1]: z for n, z in rec.get("outlier_z", {}).items()})  # client -> z
        out["left_out"].append([pids[x["node"] - 1] for x in rec["left_out"]])
        out["relabel_gain"].append({pids[n - 1]: g for n, g in rec.get("relabel_gain", {}).items()})
        keys = [k for k, v in start.items() if v.is_floating_point()]
        if strategy.alignment.symmetries:  # the same clients, plainly averaged: alignment's effect in this round
            plain = task.load_model(cfg)
            plain.load_state_dict(aggregate(states, sizes, keys, start))
            out["paired_fedavg"].append(accuracy(plain, *test)[1])
        elif probe:  # what a data-free alignment would gain on these clients (a guard's decision)
            anchor = task.load_model(cfg)
            anchor.load_state_dict(start)
            gains = []
            for sd in states:
                local = task.load_model(cfg)
                local.load_state_dict(sd)
                rep = align_pair(local, anchor, AlignedFedAvg(anchor, fraction_evaluate=0.0).alignment).report
                gains.append((rep["distance_before"] - rep["distance_after"]) / rep["distance_before"])
            out["probe_gain"].append(gains)
        extra = (f", paired FedAvg {out['paired_fedavg'][-1]:.4f}" if out["paired_fedavg"] else "") + (
            f", alignment gain {out['gain'][-1]:.4f} (mean), unaligned {out['unaligned'][-1]}"
            if strategy.alignment.symmetries and out["gain"] else "") + (
            f", probe gain max {max(out['probe_gain'][-1]):.4f}" if out["probe_gain"] else "") + (
            ", outlier z " + " ".join(f"{pids[n - 1]}: {z:.2f}" for n, z in rec["outlier_z"].items())
            if rec.get("outlier_z") else "") + (
            ", relabel gain " + " ".join(f"{pids[n - 1]}: {g:.4f}" for n, g in rec["relabel_gain"].items())
            if rec.get("relabel_gain") else "")
        log(f"  {attack}:{arm} round {r}: accuracy {out['accuracy'][-1]:.4f}, left out "
            f"{[(pids[x['node'] - 1], x['kind']) for x in rec['left_out']]} (client, kind), clipped "
            f"{[pids[x['node'] - 1] for x in rec['clipped']]}, {rec['seconds']:.1f} s "
            f"aggregation{extra}", flush=True)
        if partial is not None:
            partial.write_text(json.dumps(out) + "\n")
    return out


def rounds_to_reach(accuracy: list[float], target: float) -> int | None:
    """The first round (1-based) whose accuracy is at least ``target`` (None: never)."""
    return next((r + 1 for r, a in enumerate(accuracy) if a >= target), None)


# ---------------------------------------------------------------- --report: B5 (b)'s tables and plot

LABELS = {"clean:fedavg": "FedAvg", "clean:mean": "aligned", "clean:guarded": "aligned, min_align_gain 0.05"}


def load_runs(folders) -> list[dict]:
    out = []
    for f in folders:
        d = json.loads((Path(f) / "results.json").read_text())
        out.append({"epochs": d["args"]["local_epochs"], "seed": d["args"]["seed"], "runs": d["runs"],
                    "args": d["args"]})
    return sorted(out, key=lambda x: (x["epochs"], x["seed"]))


def report_tables(results: list[dict]) -> str:
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


def report_plot(results: list[dict], path: Path) -> None:
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


def write_report(folders, out) -> str:
    """``tables.md`` and ``accuracy_per_round.png`` of the runs in ``folders`` written into ``out``; the tables."""
    results = load_runs(folders)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = report_tables(results)
    (out / "tables.md").write_text(text)
    report_plot(results, out / "accuracy_per_round.png")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", nargs="+", metavar="RUN",
                   help="write B5 (b)'s tables and plot from these runs' folders into --out (nothing is trained)")
    p.add_argument("--runs", default="clean:mean,clean:robust,scale100:mean,scale100:robust,flip:mean,flip:robust")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    p.add_argument("--test", type=int, default=2000, help="test images scored after each round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--outlier-rule", default="krum", help="the filtered arm's outlier rule: distance, cosine, krum")
    p.add_argument("--outlier-threshold", type=float, default=3.5, help="the filtered arm's robust z threshold")
    p.add_argument("--local-epochs", type=float, help="local work as epochs: each client runs E passes over its shard "
                                                    "per round (ceil(E x shard / batch) steps; overrides --local-steps)")
    p.add_argument("--examples-per-client", type=int, default=100000, help="each client's shard capped at this many")
    p.add_argument("--min-align-gain", type=float, default=0.05, help="the guarded arm's min_align_gain")
    p.add_argument("--probe", action="store_true", help="arms without alignment: record what alignment would gain")
    p.add_argument("--server-images", type=int, default=1000,
                   help="the consensus arms: unlabeled training images held by the server")
    p.add_argument("--relabel-threshold", type=float, default=0.01, help="the relabel arm's RelabelCheck threshold")
    p.add_argument("--relabel-min-cycle", type=float, default=0.002, help="the relabel arm's RelabelCheck min_cycle")
    p.add_argument("--device", help="where the clients' local training runs (e.g. cuda; default: the CPU); the "
                                    "aggregation and the scoring stay on the CPU")
    p.add_argument("--workers", type=int, default=1, help="processes that train a round's clients side by side "
                                                          "(each with --threads threads; 1: in this process)")
    p.add_argument("--out", help="folder for results.json (and, while running, RUN.partial.json after each round)")
    p.add_argument("--save-clients", help="folder: each run's clients of every round saved under RUN/round<r>.pt "
                                          "(diagnostics: benchmarks/federated_consensus.py)")
    args = p.parse_args(argv)
    if args.report:
        if not args.out:
            p.error("--report needs --out")
        print(write_report(args.report, args.out))
        return 0
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    ARMS["guarded"]["min_align_gain"] = args.min_align_gain
    RELABEL.update(threshold=args.relabel_threshold, min_cycle=args.relabel_min_cycle)
    for arm in ("filtered", "clipped"):
        ARMS[arm].update(outlier_rule=args.outlier_rule, outlier_threshold=args.outlier_threshold)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task

    cfg = task.settings({"dirichlet-alpha": args.alpha, "local-steps": args.local_steps, "init-seed": args.seed,
                         "data-seed": args.seed, "examples-per-client": args.examples_per_client})
    test_x, test_y = task.load_test({**cfg, "test-examples": args.test})
    server = None
    if any(ARMS.get(spec.split(":")[-1], {}).get("outlier_rule") == "consensus" for spec in args.runs.split(",")):
        # the consensus arms' server data: --server-images training images, their labels dropped
        from symmerge.demo.datasets import write_npz

        from .federated_consensus import server_images

        images, _ = server_images(args.server_images)
        tmp = tempfile.TemporaryDirectory()
        server = write_npz(Path(tmp.name) / "server.npz", images, np.zeros(len(images), np.int64))
    pool = None
    if args.workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init, initargs=(str(EXAMPLE), cfg, args.clients, args.threads))
    t0 = time.perf_counter()
    results, details = {}, {}
    for spec in args.runs.split(","):
        attack, arm = spec.split(":")
        if attack not in ATTACKS or arm not in ARMS:
            raise SystemExit(f"bad run {spec!r}: ATTACK:ARM with ATTACK in {list(ATTACKS)} and ARM in {list(ARMS)}")
        t = time.perf_counter()
        details[spec] = run_one(task, cfg, attack, arm, args.rounds, args.clients, (test_x, test_y),
                                epochs=args.local_epochs, probe=args.probe, server_data=server, device=args.device,
                                partial=(Path(args.out) / (spec.replace(":", "_") + ".partial.json")
                                         if args.out else None), pool=pool,
                                save=Path(args.save_clients) / spec.replace(":", "_") if args.save_clients else None)
        details[spec]["seconds"] = time.perf_counter() - t
        results[spec] = details[spec]["accuracy"]
    if pool is not None:
        pool.shutdown()
    print(f"\n{'run':<18}" + "".join(f"{'round ' + str(r):>10}" for r in range(1, args.rounds + 1)))
    for spec, accs in results.items():
        print(f"{spec:<18}" + "".join(f"{a:>10.4f}" for a in accs))
    fedavg = next((accs for spec, accs in results.items() if spec.endswith(":fedavg")), None)
    if fedavg is not None:  # rounds to reach FedAvg's final accuracy
        reach = {spec: rounds_to_reach(accs, fedavg[-1]) for spec, accs in results.items()}
        print("rounds to reach FedAvg's final accuracy " + f"({fedavg[-1]:.4f}): "
              + ", ".join(f"{spec} {r if r is not None else 'never'}" for spec, r in reach.items()))
    print(f"{time.perf_counter() - t0:.0f} s in all")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"accuracy_per_round": results, "runs": details, "args": vars(args)},
                                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
