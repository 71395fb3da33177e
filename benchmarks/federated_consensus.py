"""B5 (c) diagnostic: which functional score separates a label-flipped client from honest clients with rare
labels, on the clients of real rounds saved by ``benchmarks.federated_rounds --save-clients DIR``.

Every client model of a round is run on ``--server`` unlabeled training images (the server's data, the
same images as the ``consensus`` arms of federated_rounds; their labels are used here only to print each
client's accuracy on them). Each client's class probabilities P_i are compared with the consensus of the
others, Q_i = the unweighted mean of the other clients' probabilities; P_i' is P_i with its class prior
discounted to Q_i's and Q_i' is Q_i with its prior moved to P_i's
(:func:`symmerge.federated.consensus.prior_corrected`); TV(A, B) is the mean over the images of
½ Σ_c |A_c - B_c|. The candidate scores (larger: more outlying):

- ``disagree``: 1 - the fraction of images where argmax P_i = argmax Q_i; ``prior``: the same with P_i';
- ``tv``: TV(P_i, Q_i); ``tv_prior``: TV(P_i', Q_i); ``tv_rev``: TV(P_i, Q_i');
- ``consensus``: ½ [TV(P_i', Q_i) + TV(P_i, Q_i')], the score of ``outlier_rule="consensus"``
  (:func:`symmerge.federated.consensus.consensus_scores`);
- ``tv_temp``: TV(P_i', Q_i) at the best of 9 temperatures of P_i (0.25–4; also discounting confidence);
- ``tv_dis``: the mean of TV(P_i'(x), Q_i(x)) over the images where their argmaxes differ (0 elsewhere);
- ``js_prior``: the mean Jensen–Shannon divergence of P_i' and Q_i; ``ce_prior``: the mean
  cross-entropy of P_i' against argmax Q_i;
- ``conf_prior``: 1 - the agreement of argmax P_i' with argmax Q_i weighted by P_i's top probability;
  ``top_prior``: the same on the 30 % of images where P_i' is most confident;
- ``macro_prec``: 1 - the mean over the classes the client predicts (on at least 2 % of the images) of
  the fraction of its predictions of that class that the consensus shares;
- ``perm``: the best one-to-one relabelling's agreement minus the identity's, from the client-vs-consensus
  confusion matrix (Hungarian): a client that predicts systematically permuted classes gains much.

Each score becomes the strategy's robust z-score, 0.6745 (s - median) / max(MAD, ``--min-spread`` ×
median). Per round the z of every client is printed; ``--summary`` prints, per score, the largest z of an
honest client (every client of a ``clean*`` run folder, every client but 0 of a ``flip*`` one) and the
smallest z of the flipped client 0, with how many rounds each side crosses ``--threshold``.

``--synthetic``: instead, the consensus rule's z-scores on a tiny synthetic federation of accurate clients
(tiny ViTs, 4 class patterns + noise, a global model trained a little, then 6 clients 40 local steps
each: 4 honest with label-skewed shards, one honest client holding most of class 3, one trained on
flipped labels 3 - y), for several shares of class 3, in a round with the flipped client and in a clean
round (the tests use the same federation: tests/federated/test_federated_consensus.py).

``--relabel-rules``: instead, which detection rule for the relabelling check adds the label-flipped client's
rounds that the consensus rule misses without flagging honest clients, on the same saved clients. For every
client: ``z``, the consensus rule's robust z-score; ``cgain``, the gain of the best relabelling of its classes
onto the others' consensus (:func:`symmerge.federated.relabel.relabellings`, what the strategy's
``RelabelCheck`` uses); ``ggain``, the same gain against the round's global model (the model every client
started from) instead of the consensus. The rules: the consensus rule alone (z > 3.5); z or cgain >= 0.01 (the
strategy's ``RelabelCheck`` with its defaults); z or ggain >= t; and the ratio rules "z or gain >= max(0.002,
k x the round's second-largest gain)". Per rule and seed range (``--split``: the seeds below it and from it
are summed apart; the folders are named .../seed<S>/<attack>_<arm>): the flipped client's rounds caught and
the honest client-rounds flagged.

Run: ``python -m benchmarks.federated_rounds --seed S --runs clean:mean,flip:mean --save-clients /tmp/flip/seedS``
for S in 0 1, then ``python -m benchmarks.federated_consensus /tmp/flip/seed*/clean_mean /tmp/flip/seed*/flip_mean
--min-spread 0.1 --summary``. The relabelling rules: ``python -m benchmarks.federated_rounds --seed S --runs
clean:mean,flip:consensus --save-clients /tmp/flip2/save/seedS`` for S in 0..9, then ``python -m
benchmarks.federated_consensus --relabel-rules /tmp/flip2/save/seed*/clean_mean /tmp/flip2/save/seed*/flip_consensus
--split 5``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import torch

from .bench_federated import EXAMPLE

SCORES = ("disagree", "prior", "tv", "tv_prior", "tv_rev", "consensus", "tv_temp", "tv_dis", "js_prior", "ce_prior",
          "conf_prior", "top_prior", "macro_prec", "perm")


def candidate_scores(probs: list[torch.Tensor]) -> dict[str, list[float]]:
    from scipy.optimize import linear_sum_assignment

    from symmerge.federated.consensus import prior_corrected

    n, out = len(probs), {s: [] for s in SCORES}
    for i in range(n):
        p = probs[i]
        q = sum(probs[j] for j in range(n) if j != i) / (n - 1)
        pc = prior_corrected(p, q.mean(0))
        a, ac, b = p.argmax(1), pc.argmax(1), q.argmax(1)
        out["disagree"].append(1 - float((a == b).double().mean()))
        out["prior"].append(1 - float((ac == b).double().mean()))
        out["tv"].append(float(0.5 * (p - q).abs().sum(1).mean()))
        out["tv_prior"].append(float(0.5 * (pc - q).abs().sum(1).mean()))
        c = p.shape[1]
        conf = torch.zeros(c, c, dtype=torch.float64)
        conf.index_put_((a, b), torch.ones(len(a), dtype=torch.float64), accumulate=True)
        counts = conf.sum(1)
        used = counts >= 0.02 * len(a)
        out["macro_prec"].append(1 - float((conf.diagonal()[used] / counts[used]).mean()))
        r, k = linear_sum_assignment(-conf.numpy())
        out["perm"].append(float((conf.numpy()[r, k].sum() - conf.trace()) / len(a)))
        out["ce_prior"].append(float(-pc.gather(1, b[:, None]).clamp_min(1e-12).log().mean()))
        w = pc.max(1).values
        out["conf_prior"].append(1 - float((w * (ac == b).double()).sum() / w.sum()))
        top = w >= w.quantile(0.7)
        out["top_prior"].append(1 - float((ac == b)[top].double().mean()))
        best = None
        for tau in (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0):
            pt = prior_corrected((p.clamp_min(1e-12).log() / tau).softmax(1), q.mean(0))
            tv = float(0.5 * (pt - q).abs().sum(1).mean())
            best = tv if best is None else min(best, tv)
        out["tv_temp"].append(best)
        qc = prior_corrected(q, p.mean(0))
        out["tv_rev"].append(float(0.5 * (p - qc).abs().sum(1).mean()))
        out["consensus"].append(0.5 * (out["tv_rev"][-1] + out["tv_prior"][-1]))
        mid = 0.5 * (pc + q)
        kl = lambda a, m: (a * (a.clamp_min(1e-12) / m.clamp_min(1e-12)).log()).sum(1)  # noqa: E731
        out["js_prior"].append(float((0.5 * kl(pc, mid) + 0.5 * kl(q, mid)).mean()))
        out["tv_dis"].append(float((0.5 * (pc - q).abs().sum(1) * (ac != b).double()).mean()))
    return out


# ---------------------------------------------------------------- a tiny synthetic federation

CLASSES = 4


def server_images(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The consensus arms' unlabeled server images (``benchmarks.federated_rounds --server-images n``): ``n``
    Fashion-MNIST training images (uint8) picked with seed 0, and their labels (for diagnostics only)."""
    from symmerge.demo.datasets import fashion_mnist

    images, labels = fashion_mnist("train")
    pick = np.random.default_rng(0).choice(len(images), n, replace=False)
    return images[pick], labels[pick]


def probabilities(model, state_dict: dict, x: torch.Tensor) -> torch.Tensor:
    """``state_dict``'s class probabilities (float64) on the pixel values ``x``, loaded into ``model``."""
    model.load_state_dict(state_dict)
    with torch.no_grad():
        return torch.cat([model(pixel_values=x[j:j + 500]).logits.double().softmax(-1) for j in range(0, len(x), 500)])


def tiny_vit(seed: int = 0):
    """A tiny ViT classifier (hidden 16, 2 layers, 8x8 one-channel images, :data:`CLASSES` labels)."""
    import transformers as T

    torch.manual_seed(seed)
    return T.ViTForImageClassification(T.ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8,
        patch_size=4, num_channels=1, num_labels=CLASSES)).eval()


def synthetic(n: int, seed: int, classes=None):
    """Images of :data:`CLASSES` fixed patterns + noise (8x8, 1 channel); labels drawn from ``classes``
    (a probability per class; default uniform)."""
    rng = np.random.default_rng(seed)
    patterns = np.random.default_rng(1234).normal(0, 1, (CLASSES, 1, 8, 8))
    y = rng.choice(CLASSES, n, p=classes)
    x = patterns[y] + rng.normal(0, 0.8, (n, 1, 8, 8))
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)


def train_tiny(model, x, y, steps: int, seed: int):
    """``steps`` of Adam (lr 3e-3) on random batches of 32."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        i = torch.randint(0, len(x), (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(pixel_values=x[i]).logits, y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def synthetic_clients(mixes: dict, flipped: int, global_steps: int, local_steps: int):
    """The global model (trained ``global_steps`` on balanced data) and each node's model of ``mixes``
    (node -> class shares of its 300 examples), trained ``local_steps`` from it; node ``flipped`` on
    labels 3 - y."""
    x, y = synthetic(400, 0)
    g = train_tiny(tiny_vit(0), x, y, global_steps, seed=0)
    clients = {}
    for node, mix in mixes.items():
        cx, cy = synthetic(300, node, np.array(mix))
        model = tiny_vit(0)
        model.load_state_dict(g.state_dict())
        train_tiny(model, cx, CLASSES - 1 - cy if node == flipped else cy, local_steps, seed=node)
        clients[node] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return g, clients


def synthetic_sweep(global_steps: int = 30, local_steps: int = 40) -> None:
    from symmerge.federated.aggregate import CONSENSUS_MIN_SPREAD, update_outliers
    from symmerge.federated.consensus import client_probabilities, consensus_scores
    from symmerge.io.data import Batch, Data

    server_x, _ = synthetic(200, 99)
    data = Data("server images", "image", [Batch({"pixel_values": server_x}, None)], 200, False)
    print("others' share of class 3 | skewed client's share | round | z of nodes 1-4 (honest), 5 (skewed), "
          "9 (flipped) | accuracy of node 5")
    for other, own in ((0.05, 0.85), (0.05, 0.6), (0.1, 0.85), (0.1, 0.7), (0.15, 0.7), (0.25, 0.5)):
        mixes = {1: [0.5, 0.3, 0.2], 2: [0.2, 0.5, 0.3], 3: [0.3, 0.2, 0.5], 4: [0.4, 0.4, 0.2], 9: [0.35, 0.35, 0.3]}
        mixes = {k: [v * (1 - other) for v in m] + [other] for k, m in mixes.items()}
        mixes[5] = [(1 - own) / 3] * 3 + [own]
        g, clients = synthetic_clients(mixes, 9, global_steps, local_steps)
        probs = dict(zip(clients, client_probabilities(g, list(clients.values()), data)))
        _, server_y = synthetic(200, 99)
        acc = float((probs[5].argmax(1) == server_y).double().mean())
        for label, nodes in (("with the flipped client", [1, 2, 3, 4, 5, 9]), ("clean", [1, 2, 3, 4, 5])):
            z = [z for z, _ in update_outliers(consensus_scores([probs[n] for n in nodes]), 1e9,
                                               min_spread=CONSENSUS_MIN_SPREAD)]
            print(f"{other:>5} | {own:>5} | {label:<24} | " + " ".join(f"{n}: {v:5.2f}" for n, v in zip(nodes, z))
                  + f" | {acc:.3f}", flush=True)


# ---------------------------------------------------------------- the relabelling check's detection rules

def gains_of_round(probs: list[torch.Tensor], start: torch.Tensor) -> list[dict]:
    from symmerge.federated.aggregate import CONSENSUS_MIN_SPREAD, update_outliers
    from symmerge.federated.consensus import consensus_scores
    from symmerge.federated.relabel import relabelling, relabellings

    cg = [r["gain"] for r in relabellings(probs)]
    gg = [relabelling(p, start)["gain"] for p in probs]
    z = [v for v, _ in update_outliers(consensus_scores(probs), 1e9, min_spread=CONSENSUS_MIN_SPREAD)]

    def second(values, i):  # the largest of the others
        return max(values[:i] + values[i + 1:])

    return [{"z": z[i], "cg": cg[i], "gg": gg[i], "cg2": second(cg, i), "gg2": second(gg, i)} for i in range(len(probs))]


RULES = {"consensus z > 3.5": lambda r: r["z"] > 3.5,
         "z or cgain >= 0.01 (relabel)": lambda r: r["z"] > 3.5 or r["cg"] >= 0.01}
for _t in (0.004, 0.006, 0.008, 0.01):
    RULES[f"z or ggain >= {_t}"] = (lambda t: lambda r: r["z"] > 3.5 or r["gg"] >= t)(_t)
for _k in (2, 3, 4):
    for _g in ("cg", "gg"):
        RULES[f"z or {_g}ain >= max(0.002, {_k} x 2nd)"] = (
            lambda k, g: lambda r: r["z"] > 3.5 or (r[g] >= 0.002 and r[g] >= k * r[g + "2"]))(_k, _g)


def relabel_rules(runs: list[str], server: int, split: int) -> None:
    """``--relabel-rules``: every rule of :data:`RULES` on the saved rounds of ``runs`` (see the module text)."""
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task

    from symmerge.demo.datasets import pixel_values

    x = torch.from_numpy(pixel_values(server_images(server)[0]))
    model = task.load_model(task.settings({}))

    def probs_of(sd):
        return probabilities(model, sd, x)

    rows = []
    for run in runs:
        seed = int(re.search(r"seed(\d+)", run).group(1))
        flip = Path(run).name.startswith("flip")
        for f in sorted(Path(run).glob("round*.pt"), key=lambda f: int(f.stem[5:])):
            d = torch.load(f)
            stats = gains_of_round([probs_of(sd) for sd in d["states"]], probs_of(d["start"]))
            for pid, s in zip(d["pids"], stats):
                rows.append({**s, "seed": seed, "run": Path(run).name, "round": int(f.stem[5:]), "pid": pid,
                             "attacker": flip and pid == 0})
    for label, part in ((f"seeds < {split}", [r for r in rows if r["seed"] < split]),
                        (f"seeds >= {split}", [r for r in rows if r["seed"] >= split])):
        if not part:
            continue
        n_att = sum(r["attacker"] for r in part)
        print(f"\n{label}: {n_att} rounds of the flipped client, {len(part) - n_att} honest client-rounds")
        print(f"{'rule':<38} {'flipped caught':>15} {'honest flagged':>15}  where (seed, run, round, client)")
        for name, rule in RULES.items():
            caught = sum(rule(r) for r in part if r["attacker"])
            honest = [(r["seed"], r["run"], r["round"], r["pid"]) for r in part if not r["attacker"] and rule(r)]
            print(f"{name:<38} {caught:>9} of {n_att:<3} {len(honest):>15}  {honest[:4]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="folders of round<r>.pt files (federated_rounds --save-clients)")
    p.add_argument("--synthetic", action="store_true", help="the tiny synthetic federation's sweep instead")
    p.add_argument("--server", type=int, default=1000, help="unlabeled server images")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--min-spread", type=float, default=0.0, help="the robust z-score's MAD floor, x the median")
    p.add_argument("--scores", default=",".join(SCORES), help="which scores to print")
    p.add_argument("--threshold", type=float, default=3.5, help="the outlier threshold the summary counts against")
    p.add_argument("--summary", action="store_true", help="only the table of the largest honest / smallest flipped z")
    p.add_argument("--relabel-rules", action="store_true",
                   help="the relabelling check's detection rules on the saved rounds instead (folders named "
                        ".../seed<S>/<attack>_<arm>)")
    p.add_argument("--split", type=int, default=5, help="--relabel-rules: seeds below this and from it are "
                                                        "summarised apart")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.synthetic:
        synthetic_sweep()
        return 0
    if args.relabel_rules:
        if not args.runs:
            p.error("give the folders of saved rounds")
        relabel_rules(args.runs, args.server, args.split)
        return 0
    if not args.runs:
        p.error("give the folders of saved rounds (or --synthetic)")
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task

    from symmerge.demo.datasets import pixel_values
    from symmerge.federated.aggregate import update_outliers

    images, labels = server_images(args.server)
    x, y = torch.from_numpy(pixel_values(images)), torch.from_numpy(labels)
    cfg = task.settings({})
    model = task.load_model(cfg)
    chosen = args.scores.split(",")
    honest = {name: [] for name in chosen}  # (z, run, round, client)
    flipped = {name: [] for name in chosen}
    for run in args.runs:
        flip = Path(run).name.startswith("flip")
        for f in sorted(Path(run).glob("round*.pt"), key=lambda f: int(f.stem[5:])):
            d = torch.load(f)
            probs, accs = [], []
            for sd in d["states"]:
                pr = probabilities(model, sd, x)
                probs.append(pr)
                accs.append(float((pr.argmax(1) == y).double().mean()))
            if not args.summary:
                print(f"{run} {f.stem}: clients {d['pids']}, accuracy on the server images "
                      f"{' '.join(f'{a:.2f}' for a in accs)}", flush=True)
            for name, scores in candidate_scores(probs).items():
                if name not in chosen:
                    continue
                z = [z for z, _ in update_outliers(scores, 1e9, min_spread=args.min_spread)]
                for pid, v in zip(d["pids"], z):
                    (flipped if flip and pid == 0 else honest)[name].append((v, run, f.stem, pid))
                if not args.summary:
                    print(f"  {name:<10} score " + " ".join(f"{s:6.3f}" for s in scores) + "   z "
                          + " ".join(f"{v:6.2f}" for v in z))
    print(f"\n{'score':<11} {'largest honest z':>17} {'(where)':<34} {'honest > thr':>13} {'smallest flipped z':>19} "
          f"{'flipped > thr':>14}")
    for name in chosen:
        top, low = max(honest[name]), min(flipped[name]) if flipped[name] else None
        where = f"{Path(top[1]).parent.name}/{Path(top[1]).name} {top[2]} client {top[3]}"
        print(f"{name:<11} {top[0]:>17.2f} {where:<34} {sum(v > args.threshold for v, *_ in honest[name]):>6} of "
              f"{len(honest[name]):<4} {low[0] if low else float('nan'):>19.2f} "
              f"{sum(v > args.threshold for v, *_ in flipped[name]):>7} of {len(flipped[name]):<4}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
