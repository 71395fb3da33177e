"""Why aligned FedAvg does not beat FedAvg from one shared init: one round of B5 (b), taken apart.

8 clients (Dirichlet(``--alpha``) Fashion-MNIST shards of at most ``--examples-per-client`` images, the
examples/federated ViT) train ``--local-epochs`` epochs from one shared init, as round 1 of
``benchmarks.federated_rounds`` (the same seeds). Their models are then aggregated once by FedAvg and by
``AlignedFedAvg`` with each symmetry group alone and all together (data-free), and scored on ``--test``
test images. For the default groups, it prints what the alignment moved: per symmetry, the share of group
instances whose element is not the identity, the share of permuted entries (permutations) and the
largest deviation of a continuous part from the identity; and the ``null`` gain: the share of the distance
that the same alignment removes from a client whose update is replaced by Gaussian noise of the same
norm per tensor (nothing to undo there).

Run: ``FLWR_TELEMETRY_ENABLED=0 python -m benchmarks.federated_drift --local-epochs 20 --examples-per-client 300``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from .bench_federated import EXAMPLE, replies_for
from .federated_rounds import local_steps

GROUP_SETS = ("heads,attn,ffn,rescale", "heads", "attn", "ffn", "attn,rescale", "ffn,rescale")


def moved(element, identity) -> tuple[bool, float, float]:
    """(not the identity, share of permuted integer entries, largest deviation of a float part)."""
    changed, share, dev = False, 0.0, 0.0
    for f in dataclasses.fields(element):
        a, b = getattr(element, f.name), getattr(identity, f.name)
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
            continue
        if a.is_floating_point():
            d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            dev, changed = max(dev, d), changed or d > 1e-9
        else:
            s = float((a != b).double().mean()) if a.numel() else 0.0
            share, changed = max(share, s), changed or s > 0
    return changed, share, dev


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--local-epochs", type=float, default=20)
    p.add_argument("--examples-per-client", type=int, default=300)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="folder for results.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task
    from flwr.app import ArrayRecord

    from symmerge.demo.train import accuracy
    from symmerge.federated import AlignedFedAvg, ClientAlignment, OutlierPolicy
    from symmerge.pipeline.align import align_pair

    t0 = time.perf_counter()
    cfg = task.settings({"dirichlet-alpha": args.alpha, "init-seed": args.seed, "data-seed": args.seed,
                         "examples-per-client": args.examples_per_client})
    test = task.load_test({**cfg, "test-examples": args.test})
    init = task.load_model(cfg)
    start = {k: v.detach().clone() for k, v in init.state_dict().items()}
    states, sizes = [], []
    for pid in range(args.clients):
        x, y = task.load_partition(pid, args.clients, cfg)
        local = task.load_model(cfg)
        local.load_state_dict(start)
        task.train(local, x, y, {**cfg, "local-steps": local_steps(cfg, len(x), args.local_epochs)}, seed=1000 + pid)
        states.append({k: v.detach().clone() for k, v in local.state_dict().items()})
        sizes.append(len(x))
    print(f"{args.clients} clients trained {args.local_epochs:g} epochs ({time.perf_counter() - t0:.0f} s)", flush=True)

    def score(arrays) -> float:
        m = task.load_model(cfg)
        m.load_state_dict(arrays.to_torch_state_dict())
        return accuracy(m, *test)[1]

    rows = {}
    for groups in ("none",) + GROUP_SETS:
        s = AlignedFedAvg(init, alignment=ClientAlignment(groups, min_align_gain=0.0),
                          outliers=OutlierPolicy(norm_factor=None), fraction_evaluate=0.0)
        s.global_arrays = ArrayRecord(start)
        arrays, _ = s.aggregate_train(1, replies_for(states, sizes))
        rec = s.rounds[-1]
        gain = sum((b - a) / b for b, a in zip(rec["distance_before"], rec["distance_after"])) / len(states)
        rows[groups] = {"accuracy": score(arrays), "gain": gain}
        print(f"  {'FedAvg' if groups == 'none' else 'aligned ' + groups:<32} accuracy {rows[groups]['accuracy']:.4f}"
              f"  distance gain {gain:.4f}", flush=True)

    # what the default alignment moved, and the gain it gets on noise (nothing to undo)
    options = AlignedFedAvg(init, fraction_evaluate=0.0).alignment
    anchor = task.load_model(cfg)
    anchor.load_state_dict(start)
    stats: dict = {}
    null = []
    g = torch.Generator().manual_seed(0)
    for sd in states:
        local = task.load_model(cfg)
        local.load_state_dict(sd)
        res = align_pair(local, anchor, options)
        for inst in res.instances:
            e = res.elements.get(inst.name)
            if e is None:
                continue
            ch, share, dev = moved(e, inst.kind.identity(inst))
            st = stats.setdefault(inst.group.symmetry, {"instances": 0, "moved": 0, "permuted_share": 0.0,
                                                        "max_float_deviation": 0.0})
            st["instances"] += 1
            st["moved"] += int(ch)
            st["permuted_share"] = max(st["permuted_share"], share)
            st["max_float_deviation"] = max(st["max_float_deviation"], dev)
        noisy = {k: start[k] + (sd[k] - start[k]).norm() / max(v.numel(), 1) ** 0.5
                 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in start.items()}
        local.load_state_dict(noisy)
        rep = align_pair(local, anchor, options).report
        null.append((rep["distance_before"] - rep["distance_after"]) / rep["distance_before"])
    print("elements of the default alignment (heads,attn,ffn,rescale), over the clients:")
    for sym, st in stats.items():
        print(f"  {sym:<10} {st['moved']}/{st['instances']} not the identity; permuted entries up to "
              f"{st['permuted_share']:.3f}; float parts up to {st['max_float_deviation']:.4g} from the identity")
    print(f"null gain (updates replaced by noise of the same norm): {sum(null) / len(null):.4f} "
          f"(max {max(null):.4f}); {time.perf_counter() - t0:.0f} s in all")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"aggregates": rows, "elements": stats, "null_gain": null,
                                                     "args": vars(args)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
