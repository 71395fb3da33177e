"""B5 (a): one-shot federated aggregation of clients trained from different initialisations.

4 clients (seeds 0-3) train the examples/federated ViT (hidden 64, 4 layers, 4 heads, 7x7 patches) on
Dirichlet(0.5) label-skewed Fashion-MNIST shards (cached under ~/.cache/symmerge/vit). They are
aggregated once by ``AlignedFedAvg.aggregate_train``, with client 0's model as the global model (the
fixed frame). Printed: each client's accuracy on the 10 000 test images; FedAvg (no alignment);
aligned data-free (the strategy's default groups; the recommended set with the residual stream); aligned
learned (on at most 1 000 unlabeled server images, taken from the training set without labels); the
ensemble of the 4 (mean of their probabilities) as the ceiling.

Run: ``FLWR_TELEMETRY_ENABLED=0 python -m benchmarks.federated_oneshot [--steps 600] [--out DIR]``;
``--strategy-joint``: the strategy with ``joint=True`` (the clients aligned jointly, data-free and learned)
in place of its default rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "federated"


def more_rows(clients, sizes, unlabeled, args, test_x, test_y, details=None):
    """(label, accuracy, seconds) of symmerge's own N-model merge (``merge_models``, what the strategy's
    aggregate equals) with the steps B5 (a) had not tried: REPAIR after the aggregation, the joint
    alignment (each client to the mean of the others, no fixed frame), a longer learned alignment, the
    learned joint alignment (Dirichlet mixtures of the N clients, ``joint-learned``). ``details``: a dict that
    gets each joint-learned row's ``dirichlet_choice`` (``--learn-dirichlet auto``: the held-out scores)."""
    from symmerge import AlignOptions, MergeOptions, merge_models
    from symmerge.demo.train import accuracy
    from symmerge.pipeline.options import LearnSettings

    def opts(match, steps=None, **learn):
        kw = {"learn": LearnSettings(**({"steps": steps} if steps else {}), **learn)} if steps or learn else {}
        return AlignOptions(symmetries="recommended", match=match, align_data=unlabeled,
                            align_samples=args.align_samples, **kw)

    joint_learn = {k: v for k, v in (("dirichlet", args.learn_dirichlet), ("target", args.learn_target),
                                     ("steps", args.joint_learn_steps), ("dirichlet_steps", args.dirichlet_steps))
                   if v is not None}
    joint_learn_label = "".join(f", {k} {v}" for k, v in joint_learn.items())
    groups = {"repair": [("FedAvg + REPAIR", AlignOptions(symmetries="none", align_data=unlabeled,
                                                          align_samples=args.align_samples), False, True),
                         ("aligned data-free (recommended) + REPAIR", opts("weights"), False, True),
                         ("aligned activations (recommended) + REPAIR", opts("activations"), False, True)],
              "joint": [("joint activations (recommended)", opts("activations"), True, False),
                        ("joint activations (recommended) + REPAIR", opts("activations"), True, True)],
              "learned": [("aligned learned (recommended) + REPAIR", opts("learned"), False, True),
                          (f"aligned learned (recommended), {args.learn_steps} steps",
                           opts("learned", args.learn_steps), False, False)],
              # the learned JOINT alignment: every client's continuous elements learned together so that random
              # convex combinations of the 4 (Dirichlet weights) predict the same combination of their predictions
              "joint-learned": [(f"joint learned (recommended){joint_learn_label}", opts("learned", **joint_learn), True,
                                 False)]}
    chosen = args.more_cases.split(",")
    if args.skip_learned and "learned" in chosen:
        chosen.remove("learned")
    cases = [case for name in chosen for case in groups[name]]
    for label, align, joint, repair in cases:
        t = time.perf_counter()
        merged, report = merge_models(clients, options=MergeOptions(
            method="average", align=align, anchor=None if joint else clients[0], joint=joint, weights=sizes,
            heads="merge", repair=repair, evaluate=False, progress=False))
        learned = report["alignment"].get("joint", {}).get("learned", {})
        if details is not None and "dirichlet_choice" in learned:
            details[label] = learned["dirichlet_choice"]
            print(f"  {label}: Dirichlet concentration {learned['dirichlet']:g} chosen on held-out images: "
                  f"{json.dumps(learned['dirichlet_choice'])}", flush=True)
        yield label, accuracy(merged, test_x, test_y)[1], time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--align-samples", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-learned", action="store_true")
    p.add_argument("--more", action="store_true",
                   help="also the rows that try to close the gap: REPAIR after the aggregation, joint alignment "
                        "(every client to the mean of the others), more learned steps")
    p.add_argument("--only-more", action="store_true", help="the --more rows only (the strategy's rows skipped)")
    p.add_argument("--learn-steps", type=int, default=600, help="the --more rows' longer learned alignment")
    p.add_argument("--more-cases", default="repair,joint,learned", help="which --more rows: repair, joint, learned, joint-learned")
    p.add_argument("--strategy-joint", action="store_true",
                   help="the strategy's rows with joint=True (data-free and learned) instead of its default rows")
    p.add_argument("--joint-refine", default="all", choices=("all", "discrete"),
                   help="--strategy-joint rows: what the joint rounds re-solve (AlignedFedAvg's joint_refine)")
    p.add_argument("--strategy-cases", default="data-free,learned", help="--strategy-joint rows: data-free, learned")
    p.add_argument("--learn-dirichlet", type=lambda v: v if v == "auto" else float(v),
                   help="the joint-learned row's Dirichlet concentration (default 1), or auto: chosen on held-out "
                        "server images")
    p.add_argument("--dirichlet-steps", type=int,
                   help="--learn-dirichlet auto: learning steps per candidate concentration (default: half the steps)")
    p.add_argument("--learn-target", help="the joint-learned row's target: log-probabilities (default) or probabilities")
    p.add_argument("--joint-learn-steps", type=int, help="the joint-learned row's learning steps (default 200)")
    p.add_argument("--out", help="folder for results.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task
    from flwr.app import ArrayRecord

    from symmerge import AlignOptions
    from symmerge.demo.datasets import fashion_mnist, pixel_values, write_npz
    from symmerge.demo.train import TrainSettings, accuracy, load_trained, train_vit, vit_config
    from symmerge.federated import AlignedFedAvg, ClientAlignment, OutlierPolicy

    from .bench_federated import replies_for

    t0 = time.perf_counter()
    config = vit_config(hidden=64, layers=4, heads=4, patch=7)
    images, labels = fashion_mnist("train")
    test_x, test_y = fashion_mnist("test")
    shards = task.dirichlet_shards(labels, args.clients, args.alpha, 0)
    clients, sizes = [], []
    for i, idx in enumerate(shards):
        folder = train_vit(config, images[idx], labels[idx], TrainSettings(steps=args.steps, batch_size=64, lr=1e-3,
                                                                         seed=i), name=f"b5a-client{i}", progress=False)
        clients.append(load_trained(folder))
        sizes.append(len(idx))
    print(f"shards: {sizes} examples; label counts per shard: "
          f"{[np.bincount(labels[idx], minlength=10).tolist() for idx in shards]}")

    def probs(model):
        x = torch.from_numpy(pixel_values(test_x))
        with torch.no_grad():
            return torch.cat([model(pixel_values=x[j:j + 1000]).logits.softmax(-1) for j in range(0, len(x), 1000)])

    rows = {}
    client_probs = [probs(m) for m in clients]
    for i, pr in enumerate(client_probs):
        rows[f"client {i}"] = float((pr.argmax(-1).numpy() == test_y).mean())
    rows["ensemble of the clients (ceiling)"] = float((sum(client_probs).argmax(-1).numpy() == test_y).mean())

    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        server = rng.choice(len(images), args.align_samples, replace=False)
        unlabeled = write_npz(Path(tmp) / "server.npz", images[server], np.zeros(len(server), np.int64))
        settings = [("FedAvg (no alignment)", "none"),
                    ("aligned data-free (heads,attn,ffn,rescale)", None),
                    ("aligned data-free (recommended: + residual)", AlignOptions(symmetries="recommended")),
                    ("aligned activations (recommended)", AlignOptions(symmetries="recommended", match="activations",
                                                                    align_data=unlabeled,
                                                                    align_samples=args.align_samples))]
        if not args.skip_learned:
            settings.append(("aligned learned (recommended)", AlignOptions(
                symmetries="recommended", match="learned", align_data=unlabeled, align_samples=args.align_samples)))
        settings = [(label, alignment, False) for label, alignment in settings]
        if args.strategy_joint:  # the strategy's joint aggregation in place of its default rows
            learned = AlignOptions(symmetries="recommended", match="learned", align_data=unlabeled,
                                   align_samples=args.align_samples)
            cases = {"data-free": (f"AlignedFedAvg(joint=True), data-free (recommended), refine {args.joint_refine}",
                                   AlignOptions(symmetries="recommended"), True),
                     "learned": ("AlignedFedAvg(joint=True), learned (recommended)", learned, True)}
            settings = [cases[c] for c in args.strategy_cases.split(",")]
        seconds, details = {}, {}
        if args.only_more:
            settings = []
        for label, alignment, joint in settings:
            strategy = AlignedFedAvg(clients[0], alignment=ClientAlignment(
                alignment, joint=joint, **({"joint_refine": args.joint_refine} if joint else {})),
                outliers=OutlierPolicy(norm_factor=None), fraction_evaluate=0.0)
            strategy.global_arrays = ArrayRecord(clients[0].state_dict())
            arrays, _ = strategy.aggregate_train(1, replies_for([m.state_dict() for m in clients], sizes))
            merged = load_trained(folder)
            merged.load_state_dict(arrays.to_torch_state_dict())
            rows[label] = accuracy(merged, test_x, test_y)[1]
            seconds[label] = strategy.rounds[-1]["seconds"]
            choice = strategy.rounds[-1].get("joint", {}).get("learned", {}).get("dirichlet_choice")
            if choice is not None:
                details[label] = choice
            print(f"{label:<46} accuracy {rows[label]:.4f}  ({seconds[label]:.1f} s)", flush=True)
        if args.more or args.only_more:
            for label, acc, secs in more_rows(clients, sizes, unlabeled, args, test_x, test_y, details):
                rows[label], seconds[label] = acc, secs
                print(f"{label:<46} accuracy {acc:.4f}  ({secs:.1f} s)", flush=True)
    print()
    ceiling = rows["ensemble of the clients (ceiling)"]
    best_client = max(rows[f"client {i}"] for i in range(args.clients))
    print(f"{'model':<46} {'test accuracy':>13} {'/ ensemble':>10}")
    for label, acc in rows.items():
        print(f"{label:<46} {acc:>13.4f} {acc / ceiling:>10.3f}")
    print(f"best single client {best_client:.4f}; {time.perf_counter() - t0:.0f} s in all")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"accuracy": rows, "aggregation_seconds": seconds,
                                                     "dirichlet_choice": details,
                                                     "shard_sizes": sizes, "args": vars(args)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
