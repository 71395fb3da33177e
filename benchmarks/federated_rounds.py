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
alignment, weighted mean, no norm rule).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .bench_federated import EXAMPLE, replies_for

ARMS = {"fedavg": {"alignment": "none", "norm_factor": None},
        "mean": {"norm_factor": None},
        "robust": {"aggregation": "median", "norm_factor": 10.0},
        "filtered": {"norm_factor": 10.0, "outlier_rule": "krum", "outlier_threshold": 3.5},
        "clipped": {"norm_factor": 10.0, "norm_clip": True, "outlier_rule": "krum", "outlier_threshold": 3.5},
        "clip": {"norm_factor": 10.0, "norm_clip": True}}
ATTACKS = ("clean", "scale100", "flip", "absent")


def run_one(task, cfg, attack: str, arm: str, rounds: int, clients: int, test, log=print) -> list[float]:
    from flwr.app import ArrayRecord

    from symmerge.demo.train import accuracy
    from symmerge.federated import AlignedFedAvg

    model = task.load_model(cfg)
    strategy = AlignedFedAvg(model, fraction_evaluate=0.0, min_clients=2, **ARMS[arm])
    arrays = ArrayRecord(model.state_dict())
    data = [task.load_partition(pid, clients, cfg) for pid in range(clients)]
    accs = []
    for r in range(1, rounds + 1):
        start = arrays.to_torch_state_dict()
        states, sizes, pids = [], [], []
        for pid, (x, y) in enumerate(data):
            if attack == "absent" and pid == 0:
                continue
            local = task.load_model(cfg)
            local.load_state_dict(start)
            flip = attack == "flip" and pid == 0
            task.train(local, x, 9 - y if flip else y, cfg, seed=1000 * r + pid)
            sd = {k: v.detach().clone() for k, v in local.state_dict().items()}
            if attack == "scale100" and pid == 0:
                sd = {k: start[k] + 100.0 * (v - start[k]) for k, v in sd.items()}
            states.append(sd)
            sizes.append(len(x))
            pids.append(pid)
        strategy.global_arrays = arrays
        arrays, _ = strategy.aggregate_train(r, replies_for(states, sizes))
        model.load_state_dict(arrays.to_torch_state_dict())
        accs.append(accuracy(model, *test)[1])
        rec = strategy.rounds[-1]
        log(f"  {attack}:{arm} round {r}: accuracy {accs[-1]:.4f}, left out "
            f"{[(pids[x['node'] - 1], x['kind']) for x in rec['left_out']]} (client, kind), clipped "
            f"{[pids[x['node'] - 1] for x in rec['clipped']]}, {rec['seconds']:.1f} s "
            f"aggregation", flush=True)
    return accs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--out", help="folder for results.json")
    args = p.parse_args(argv)
    for arm in ("filtered", "clipped"):
        ARMS[arm].update(outlier_rule=args.outlier_rule, outlier_threshold=args.outlier_threshold)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task

    cfg = task.settings({"dirichlet-alpha": args.alpha, "local-steps": args.local_steps, "init-seed": args.seed,
                         "data-seed": args.seed, "examples-per-client": 100000})
    test_x, test_y = task.load_test({**cfg, "test-examples": args.test})
    t0 = time.perf_counter()
    results = {}
    for spec in args.runs.split(","):
        attack, arm = spec.split(":")
        if attack not in ATTACKS or arm not in ARMS:
            raise SystemExit(f"bad run {spec!r}: ATTACK:ARM with ATTACK in {list(ATTACKS)} and ARM in {list(ARMS)}")
        results[spec] = run_one(task, cfg, attack, arm, args.rounds, args.clients, (test_x, test_y))
    print(f"\n{'run':<18}" + "".join(f"{'round ' + str(r):>10}" for r in range(1, args.rounds + 1)))
    for spec, accs in results.items():
        print(f"{spec:<18}" + "".join(f"{a:>10.4f}" for a in accs))
    print(f"{time.perf_counter() - t0:.0f} s in all")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"accuracy_per_round": results, "args": vars(args)},
                                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
