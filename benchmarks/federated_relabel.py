"""B5 (c) diagnostic for the relabelling check (``AlignedFedAvg(relabel=...)``): which detection rule adds the
label-flipped client's rounds that the consensus rule misses without flagging honest clients, on the clients of
real rounds saved by ``benchmarks.federated_rounds --save-clients DIR`` (the same clients for every rule).

For every saved round, every client's class probabilities on ``--server`` unlabeled training images (the
consensus arms' server images) give: ``z``, the consensus rule's robust z-score; ``cgain``, the gain of the best
relabelling of its classes onto the others' consensus (:func:`symmerge.federated.relabel.relabellings`, what
``relabel`` uses); ``ggain``, the same gain against the round's global model (the model every client started
from) instead of the consensus. The rules: the consensus rule alone (z > 3.5); z or cgain >= 0.01 (the
strategy's ``relabel`` with its defaults); z or ggain >= t; and the ratio rules "z or gain >= max(0.002, k x the
round's second-largest gain)". Per rule and seed range: the flipped client's rounds caught and the honest
client-rounds flagged (every client of a ``clean*`` folder, every client but 0 of a ``flip*`` one).

Run: ``python -m benchmarks.federated_rounds --seed S --runs clean:mean,flip:consensus --save-clients /tmp/flip2/save/seedS``
for S in 0..9, then ``python -m benchmarks.federated_relabel /tmp/flip2/save/seed*/clean_mean
/tmp/flip2/save/seed*/flip_consensus --split 5`` (``--split``: seeds below it and from it are summed apart).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from .bench_federated import EXAMPLE
from .federated_consensus import probabilities, server_images


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="folders of round<r>.pt files (federated_rounds --save-clients), "
                                           "named .../seed<S>/<attack>_<arm>")
    p.add_argument("--server", type=int, default=1000, help="unlabeled server images")
    p.add_argument("--split", type=int, default=5, help="seeds below this and from it are summarised apart")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task

    from symmerge.demo.datasets import pixel_values

    x = torch.from_numpy(pixel_values(server_images(args.server)[0]))
    model = task.load_model(task.settings({}))

    def probs_of(sd):
        return probabilities(model, sd, x)

    rows = []
    for run in args.runs:
        seed = int(re.search(r"seed(\d+)", run).group(1))
        flip = Path(run).name.startswith("flip")
        for f in sorted(Path(run).glob("round*.pt"), key=lambda f: int(f.stem[5:])):
            d = torch.load(f)
            stats = gains_of_round([probs_of(sd) for sd in d["states"]], probs_of(d["start"]))
            for pid, s in zip(d["pids"], stats):
                rows.append({**s, "seed": seed, "run": Path(run).name, "round": int(f.stem[5:]), "pid": pid,
                             "attacker": flip and pid == 0})
    for label, part in ((f"seeds < {args.split}", [r for r in rows if r["seed"] < args.split]),
                        (f"seeds >= {args.split}", [r for r in rows if r["seed"] >= args.split])):
        if not part:
            continue
        n_att = sum(r["attacker"] for r in part)
        print(f"\n{label}: {n_att} rounds of the flipped client, {len(part) - n_att} honest client-rounds")
        print(f"{'rule':<38} {'flipped caught':>15} {'honest flagged':>15}  where (seed, run, round, client)")
        for name, rule in RULES.items():
            caught = sum(rule(r) for r in part if r["attacker"])
            honest = [(r["seed"], r["run"], r["round"], r["pid"]) for r in part if not r["attacker"] and rule(r)]
            print(f"{name:<38} {caught:>9} of {n_att:<3} {len(honest):>15}  {honest[:4]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
