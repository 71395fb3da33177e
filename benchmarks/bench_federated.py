"""Seconds per round of ``AlignedFedAvg.aggregate_train`` for B5's setting: N clients (default 8) holding
small ViTs (the examples/federated app's model: hidden 64, 4 layers, 4 heads, FFN 256, 7x7 patches)
that each trained a few local steps from one global model on its Dirichlet(0.3) Fashion-MNIST shard.

Prints, for each aggregation setting (data-free alignment with the mean, the median; no alignment),
the median seconds of ``--repeats`` rounds on the same replies, the alignment's share, and the mean
distance of the clients to the global model before and after alignment. Needs Flower (the ``flower``
extra). Run: ``python -m benchmarks.bench_federated [--clients 8] [--local-steps 20] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "federated"


def replies_for(states: list[dict], examples: list[int]):
    from flwr.app import ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

    out = []
    for node, (sd, n) in enumerate(zip(states, examples), start=1):
        md = Metadata(run_id=1, message_id=f"r{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="m",
                      group_id="1", created_at=time.time(), ttl=600.0, message_type=MessageType.TRAIN)
        out.append(Message(content=RecordDict({"arrays": ArrayRecord(sd), "metrics": MetricRecord(
            {"num-examples": n})}), metadata=md))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet label skew of the shards")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task

    from symmerge.federated import AlignedFedAvg

    cfg = task.settings({"dirichlet-alpha": args.alpha, "local-steps": args.local_steps, "examples-per-client": 2000})
    global_model = task.load_model(cfg)
    start = {k: v.clone() for k, v in global_model.state_dict().items()}
    states, examples = [], []
    t0 = time.perf_counter()
    for pid in range(args.clients):
        model = task.load_model(cfg)
        x, y = task.load_partition(pid, args.clients, cfg)
        task.train(model, x, y, cfg, seed=pid)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        examples.append(len(x))
    train_seconds = time.perf_counter() - t0
    params = sum(v.numel() for v in start.values())
    print(f"{args.clients} clients, {params} parameters each, {args.local_steps} local steps each "
          f"({train_seconds:.0f} s of training), examples {examples}")
    print(f"{'setting':<34} {'s/round':>8} {'align s':>8} {'dist before':>12} {'dist after':>11}")
    rows = []
    for label, kw in (("aligned data-free, mean", {}), ("aligned data-free, median", {"aggregation": "median"}),
                      ("no alignment (checks only), mean", {"alignment": "none"})):
        strategy = AlignedFedAvg(global_model, fraction_evaluate=0.0, **kw)
        from flwr.app import ArrayRecord

        strategy.global_arrays = ArrayRecord(start)
        times, aligns = [], []
        for _ in range(args.repeats):
            strategy.aggregate_train(1, replies_for(states, examples))
            rec = strategy.rounds[-1]
            times.append(rec["seconds"])
            aligns.append(rec["align_seconds"])
        rec = strategy.rounds[-1]
        before = statistics.mean(rec["distance_before"])
        after = statistics.mean(rec["distance_after"])
        rows.append((label, statistics.median(times), statistics.median(aligns), before, after))
        print(f"{label:<34} {rows[-1][1]:>8.2f} {rows[-1][2]:>8.2f} {before:>12.4f} {after:>11.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
