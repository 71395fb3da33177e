"""Issue 42, item 1: data-free learned alignment on probes the two models generate themselves (model inversion).

No real image (train or test) builds the alignment: the probes come from the two models' weights only, by
optimising pixels; the learned alignment (``--match learned``, as ``benchmarks.unlabeled.row_options`` runs it)
then fits them. B1's curve set only scores the barrier, as in docs/results/datafree_frontier.md.

    python -m benchmarks.datafree_probes --seeds 0,1 --out DIR [generation options] [--starts activations,weights:10]
    python -m benchmarks.datafree_probes --seeds 0,1 --reuse DIR/probes.npz --out DIR2 --starts weights:10
    python -m benchmarks.datafree_probes --seeds 0,1 --reuse DIR/probes.npz --out DIR3 --rounds 2
    python -m benchmarks.datafree_probes --tiny --out DIR            # the smoke test (tiny B1, seconds)

**Generation** (``generate``): ``--probes`` images, class-balanced (probe i targets class i mod 10), from uniform
noise pixels, Adam on the (normalised) pixels for ``--steps`` steps at ``--lr`` with a cosine decay, the pixel range
clamped after every step. The loss, on a randomly shifted (±``--jitter`` pixels, the same shift for the batch) and
optionally flipped view:

* the cross-entropy of *both* models toward the target class (``--target-prob`` p < 1: toward the soft target, p on
  the class and (1 − p)/9 on each other);
* ``--tv`` × the total variation (mean absolute difference of neighbouring pixels) and ``--l2`` × the mean square of
  the normalised pixels;
* ``--psaq`` × minus the patch-similarity entropy (the idea of PSAQ-ViT, Li et al. 2022, written here): in each
  block's output the cosine similarities of every pair of patch tokens, their density estimated by a Gaussian kernel
  (bandwidth ``--psaq-bandwidth``) and its differential entropy averaged over the blocks and both models; real
  images give diverse similarities, noise uniform ones.

Quality: the fraction of probes each model, and both, classify as their target (unshifted), and the mean
probability of the target.

**Alignment** (each of ``--starts``): ``activations`` (the learned alignment's usual start: activation matching on
the same probes) or ``weights:F`` (the data-free weight matching with ``--depth-decay F``), then the learned steps
(``LearnSettings`` defaults: 200 steps, 4 flipped-and-shifted views). Each alignment is verified as ``align``
verifies it (the report's max relative output difference); the barrier on B1's curve set at ``--points`` α values.

**Adversarial rounds** (``--rounds R``, DFAD-style min-max): from A aligned by the first start, each round pushes a
copy of the probes for ``--adv-steps`` steps toward where the aligned midpoint departs from the endpoints (maximising
KL(t ‖ p_mid), t the normalised geometric mean of the endpoints' predictions, with ``--adv-ce`` × their CE toward the
class and the TV prior), then learns the alignment of the current A to B (activations start) on the probes and the
pushed copy; the composed alignment is checked against the original A as ``align`` checks one.

Writes ``results.json`` (and ``probes*.npz``, not for the repository) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import unlabeled
from benchmarks import vit_fashion_mnist as b1
from benchmarks.common import machine
from symmerge.demo.datasets import PIXEL_MEAN, PIXEL_STD, write_npz
from symmerge.evaluate.metrics import interpolate, interpolation_curve
from symmerge.io.model import load_model
from symmerge.pipeline.align import align_pair
from symmerge.pipeline.bound import bind
from symmerge.pipeline.options import AlignOptions, LearnSettings
from symmerge.pipeline.verify import verify_forward, with_state_dict

LOW, HIGH = (0 - PIXEL_MEAN) / PIXEL_STD, (1 - PIXEL_MEAN) / PIXEL_STD  # the normalised pixel range


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of vertically and horizontally neighbouring pixels, per image: (N,)."""
    return ((x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(1)
            + (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1))


def similarity_entropy(hidden: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """The differential entropy (Gaussian-kernel estimate) of the cosine similarities between every pair of patch
    tokens of one block's output ``hidden`` (N, 1 + P, d; the CLS token first, left out), per image: (N,)."""
    p = F.normalize(hidden[:, 1:], dim=-1)
    n_patch = p.shape[1]
    i, j = torch.triu_indices(n_patch, n_patch, 1)
    s = (p @ p.transpose(1, 2))[:, i, j]  # (N, M)
    z = (s[:, :, None] - s[:, None, :]) / bandwidth
    density = torch.exp(-0.5 * z * z).mean(-1) / (bandwidth * math.sqrt(2 * math.pi))
    return -torch.log(density + 1e-12).mean(-1)


def shifted(x: torch.Tensor, jitter: int, flip: bool, g: torch.Generator) -> torch.Tensor:
    """``x`` rolled by a random shift of at most ``jitter`` pixels each way (one shift for the batch), and
    flipped left-right with probability ½ when ``flip``."""
    if jitter:
        dy, dx = (int(v) for v in torch.randint(-jitter, jitter + 1, (2,), generator=g))
        x = torch.roll(x, shifts=(dy, dx), dims=(-2, -1))
    if flip and bool(torch.rand((), generator=g) < 0.5):
        x = x.flip(-1)
    return x


def probe_loss(models, x, target, cfg, g) -> tuple[torch.Tensor, dict]:
    """The generation loss of a batch ``x`` toward ``target`` (one class per probe) and its parts."""
    view = shifted(x, cfg.jitter, cfg.flip, g)
    classes = None
    ce, ent = 0.0, 0.0
    for m in models:
        out = m(pixel_values=view, output_hidden_states=cfg.psaq > 0)
        logits = out.logits
        classes = logits.shape[-1]
        if cfg.target_prob >= 1:
            ce = ce + F.cross_entropy(logits, target)
        else:
            soft = torch.full_like(logits, (1 - cfg.target_prob) / (classes - 1))
            soft.scatter_(1, target[:, None], cfg.target_prob)
            ce = ce + -(soft * F.log_softmax(logits, -1)).sum(-1).mean()
        if cfg.psaq > 0:
            hs = out.hidden_states[1:]
            ent = ent + sum(similarity_entropy(h, cfg.psaq_bandwidth).mean() for h in hs) / len(hs)
    ce, ent = ce / len(models), ent / len(models)
    tv = total_variation(x).mean()
    l2 = (x * x).flatten(1).mean(1).mean()
    loss = ce + cfg.tv * tv + cfg.l2 * l2 - cfg.psaq * ent
    return loss, {k: float(torch.as_tensor(v).detach()) for k, v in (("ce", ce), ("tv", tv), ("l2", l2), ("entropy", ent))}


def generate(models, cfg, log=print) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(probes (N, C, H, W) normalised float32, targets (N,), report)`` from the models alone."""
    for m in models:
        m.eval()
        for p in m.parameters():
            p.requires_grad_(False)
    config = models[0].config
    classes = config.num_labels
    shape = (config.num_channels, config.image_size, config.image_size)
    g = torch.Generator().manual_seed(cfg.seed)
    targets = torch.arange(cfg.probes) % classes
    x_all = (torch.rand((cfg.probes, *shape), generator=g) - PIXEL_MEAN) / PIXEL_STD
    t0, last = time.perf_counter(), {}
    for lo in range(0, cfg.probes, cfg.gen_batch):
        x = x_all[lo:lo + cfg.gen_batch].clone().requires_grad_(True)
        y = targets[lo:lo + cfg.gen_batch]
        opt = torch.optim.Adam([x], lr=cfg.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
        for step in range(cfg.steps):
            loss, last = probe_loss(models, x, y, cfg, g)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                x.clamp_(LOW, HIGH)
            if (step + 1) % max(1, cfg.steps // 4) == 0:
                log(f"  probes {lo}-{lo + len(y) - 1} step {step + 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items())
                    + f" ({time.perf_counter() - t0:.0f} s)")
        x_all[lo:lo + cfg.gen_batch] = x.detach()
    seconds = time.perf_counter() - t0
    return x_all, targets, {"seconds": seconds, "final_loss_parts": last, **quality(models, x_all, targets)}


def midpoint(moved, anchor, alpha: float = 0.5):
    """The model with weights α·θ_moved + (1 − α)·θ_anchor (a frozen copy of ``anchor``'s modules)."""
    m = with_state_dict(anchor, interpolate(moved.state_dict(), anchor.state_dict(), alpha)).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def adversarial(moved, anchor, x0: torch.Tensor, targets: torch.Tensor, cfg, log=print) -> tuple[torch.Tensor, dict]:
    """Probes pushed, from ``x0``, toward where the midpoint of the aligned pair departs from the endpoints: Adam on the
    pixels maximising KL(t ‖ p_mid), t the normalised geometric mean of the two endpoints' predictions (the learned
    alignment's target at α = ½), with ``cfg.adv_ce`` × both endpoints' cross-entropy toward the probe's class and
    ``cfg.tv`` × the total variation keeping them probes of that class; shifted and flipped views as in
    :func:`generate`. Returns ``(probes, report)``."""
    ends = [moved, anchor]
    for m in ends:
        m.eval()
        for p in m.parameters():
            p.requires_grad_(False)
    mid = midpoint(moved, anchor)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    out, t0, kls = x0.clone(), time.perf_counter(), []
    for lo in range(0, len(x0), cfg.gen_batch):
        x = x0[lo:lo + cfg.gen_batch].clone().requires_grad_(True)
        y = targets[lo:lo + cfg.gen_batch]
        opt = torch.optim.Adam([x], lr=cfg.lr)
        for _ in range(cfg.adv_steps):
            view = shifted(x, cfg.jitter, cfg.flip, g)
            logp = [F.log_softmax(m(pixel_values=view).logits, -1) for m in ends]
            target = F.log_softmax(0.5 * (logp[0] + logp[1]), -1)
            kl = (target.exp() * (target - F.log_softmax(mid(pixel_values=view).logits, -1))).sum(-1).mean()
            ce = sum(F.nll_loss(lp, y) for lp in logp) / 2
            loss = -kl + cfg.adv_ce * ce + cfg.tv * total_variation(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                x.clamp_(LOW, HIGH)
        kls.append(float(kl.detach()))
        out[lo:lo + cfg.gen_batch] = x.detach()
    with torch.no_grad():
        def mid_kl(z):
            lp = [F.log_softmax(m(pixel_values=z).logits, -1) for m in ends]
            t = F.log_softmax(0.5 * (lp[0] + lp[1]), -1)
            return float((t.exp() * (t - F.log_softmax(mid(pixel_values=z).logits, -1))).sum(-1).mean())
        rep = {"seconds": time.perf_counter() - t0, "midpoint_kl_before": mid_kl(x0), "midpoint_kl_after": mid_kl(out),
               **quality(ends, out, targets)}
    log(f"  adversarial probes: midpoint KL {rep['midpoint_kl_before']:.4f} -> {rep['midpoint_kl_after']:.4f}, "
        f"both give the target to {rep['target_fraction_both']:.3f} ({rep['seconds']:.0f} s)")
    return out, rep


@torch.no_grad()
def quality(models, x, targets) -> dict:
    """How the models classify the probes: per model the fraction given the target and the mean target probability,
    and the fraction both give the target."""
    hits, out = [], {}
    for name, m in zip("AB", models):
        p = torch.cat([m(pixel_values=x[i:i + 500]).logits.softmax(-1) for i in range(0, len(x), 500)])
        hit = p.argmax(-1) == targets
        hits.append(hit)
        out[f"target_fraction_{name}"] = float(hit.float().mean())
        out[f"target_probability_{name}"] = float(p[torch.arange(len(x)), targets].mean())
    out["target_fraction_both"] = float((hits[0] & hits[1]).float().mean())
    return out


def align_on(a, b, data_path: str, n: int, start: str, curve, alphas, log=print) -> dict:
    """One learned alignment of A to B on the probes from ``start`` (``activations`` or ``weights:F``), verified, and its
    barrier on the curve set."""
    decay = 1.0
    if start.startswith("weights"):
        _, _, f = start.partition(":")
        decay = float(f or 1)
    learn = LearnSettings(start="weights" if start.startswith("weights") else start)
    opts = AlignOptions(symmetries=unlabeled.ALL, match="learned", align_data=data_path, align_samples=n, learn=learn,
                        depth_decay=decay)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    res = align_pair(a, b, opts)
    secs = time.perf_counter() - t
    c = interpolation_curve(res.model, res.anchor, curve, alphas, progress=False)
    rep = res.report
    row = {"start": start, "align_seconds": secs, "load_average": load, "barrier": c["barrier"], "alphas": alphas,
           "loss": c["loss"], "accuracy": c["accuracy"], "verify_max_rel_diff": rep.get("verify_max_rel_diff"),
           "verify_max_abs_diff": rep.get("verify_max_abs_diff"), "probes_used": rep.get("align_samples_used"),
           "learned": {k: v for k, v in (rep.get("learned") or {}).items() if k != "history"}}
    log(f"  start {start:14s} barrier ({len(alphas)} points) {c['barrier']:.4f}  midpoint accuracy "
        f"{c['accuracy'][len(alphas) // 2]:.4f}  align {secs:.0f} s (load {load:.1f})  max rel. diff "
        f"{row['verify_max_rel_diff']:.2e}")
    return row, res.model


def references(a, b, files: dict, curve, alphas, real: bool, log=print) -> list:
    """The data-free weight matching (all groups, ``--depth-decay`` 1 and 10) and, with ``real``, the learned
    alignment on 1 000 real unlabeled training images (B1's stats file: data-dependent, a reference only)."""
    rows = []
    for decay in (1.0, 10.0):
        t = time.perf_counter()
        res = align_pair(a, b, AlignOptions(symmetries=unlabeled.ALL, depth_decay=decay))
        secs = time.perf_counter() - t
        c = interpolation_curve(res.model, res.anchor, curve, alphas, progress=False)
        rows.append({"reference": f"data-free weights, depth decay {decay:g}", "barrier": c["barrier"], "loss": c["loss"],
                     "accuracy": c["accuracy"], "align_seconds": secs, "load_average": os.getloadavg()[0],
                     "verify_max_rel_diff": res.report.get("verify_max_rel_diff")})
        log(f"  reference data-free F = {decay:g}: barrier {c['barrier']:.4f} ({secs:.1f} s)")
    if real:
        row, _ = align_on(a, b, str(files["stats"]), 1000, "activations", curve, alphas, log)
        rows.append({"reference": "learned on 1 000 real unlabeled training images (not data-free)", **row})
    return rows


def adversarial_rounds(a, moved, b, x, targets, args, curve, alphas, out: Path) -> list:
    """``args.rounds`` rounds from ``moved`` (A aligned on the probes ``x``): adversarial probes from ``x`` against the
    current midpoint, then the learned alignment (activations start) of the current A to B on ``x`` and them; the
    composed alignment checked against the original A as ``align`` checks one."""
    spec, rows = bind(a, None, "largest").spec, []
    for r in range(1, args.rounds + 1):
        print(f"round {r}")
        xa, rep = adversarial(moved, b, x, targets, args)
        path = write_npz(out / f"probes_round{r}.npz", torch.cat([x, xa]).numpy(), None)
        row, moved = align_on(moved, b, str(path), 2 * len(x), "activations", curve, alphas)
        row.update(round=r, adversarial=rep, **{f"composed_{k}": v for k, v in verify_forward(a, moved, spec).items()})
        print(f"  composed with the earlier rounds: max rel. diff {row['composed_verify_max_rel_diff']:.2e}")
        rows.append(row)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.datafree_probes", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1", help="the B1-recipe pair (default B1's 0,1)")
    p.add_argument("--tiny", action="store_true", help="tiny B1 models and few probes and steps: the smoke test")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--reuse", help="a probes.npz of an earlier run: no generation")
    p.add_argument("--probes", type=int, default=500, help="probes to generate (default 500)")
    p.add_argument("--gen-batch", type=int, default=250, help="probes optimised together (default 250)")
    p.add_argument("--steps", type=int, default=300, help="generation steps (default 300)")
    p.add_argument("--lr", type=float, default=0.05, help="generation Adam learning rate (default 0.05)")
    p.add_argument("--tv", type=float, default=0.3, help="total-variation weight (default 0.3)")
    p.add_argument("--l2", type=float, default=0.0, help="weight of the normalised pixels' mean square (default 0)")
    p.add_argument("--jitter", type=int, default=2, help="random shift in pixels at each step (default 2)")
    p.add_argument("--flip", action="store_true", help="random left-right flips at each step")
    p.add_argument("--target-prob", type=float, default=1.0, help="soft target's mass on the class (default 1: CE)")
    p.add_argument("--psaq", type=float, default=0.0, help="weight of the patch-similarity entropy (default 0)")
    p.add_argument("--psaq-bandwidth", type=float, default=0.05, help="its kernel bandwidth (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="the probes' noise and jitter seed (default 0)")
    p.add_argument("--starts", default="activations", help="learned alignment starts, comma-separated: activations, "
                   "weights:F (data-free, depth decay F), or none (only --references) (default activations)")
    p.add_argument("--rounds", type=int, default=0, help="adversarial rounds after the first start's alignment "
                   "(default 0)")
    p.add_argument("--adv-steps", type=int, default=50, help="steps of each adversarial round (default 50)")
    p.add_argument("--adv-ce", type=float, default=1.0, help="the class term's weight in the adversarial rounds "
                   "(default 1)")
    p.add_argument("--references", choices=("data-free", "all"), help="also the data-free weight matching (depth "
                   "decay 1 and 10) and with 'all' the learned alignment on 1 000 real training images (not data-free)")
    p.add_argument("--points", type=int, default=5, help="α values of each curve (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    if args.tiny:
        args.probes, args.gen_batch, args.steps = min(args.probes, 40), min(args.gen_batch, 40), min(args.steps, 5)
        args.adv_steps = min(args.adv_steps, 3)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"{out}: exists and is not empty; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    b1_args = b1.parse_args(["--seeds", args.seeds] + (["--tiny"] if args.tiny else []))
    _, seeds, folders, _, files, a, b, _, curve = b1.load_pair(b1_args, print)
    result = {"argv": sys.argv[1:] if argv is None else list(argv), "seeds": seeds, "folders": [str(f) for f in folders],
              "machine": machine(), "load_average_start": os.getloadavg()[0]}
    alphas = [i / (args.points - 1) for i in range(args.points)]
    if args.references:
        result["references"] = references(a, b, files, curve, alphas, args.references == "all")
    if args.starts == "none":
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0
    probe_file = out / "probes.npz"
    if args.reuse:
        x = torch.from_numpy(np.load(args.reuse)["pixel_values"])
        targets = torch.arange(len(x)) % a.config.num_labels
        result["probes"] = {"reused": args.reuse, **quality([a, b], x, targets)}
        probe_file = Path(args.reuse)
    else:
        gen_a, gen_b = (load_model(f) for f in folders)  # copies: generation freezes their parameters
        print(f"generating {args.probes} probes ({args.steps} steps)")
        load = os.getloadavg()[0]
        x, targets, rep = generate([gen_a, gen_b], args)
        result["probes"] = {"config": {k: getattr(args, k) for k in ("probes", "gen_batch", "steps", "lr", "tv", "l2",
                                                                    "jitter", "flip", "target_prob", "psaq",
                                                                    "psaq_bandwidth", "seed")},
                            "load_average": load, **rep}
        write_npz(probe_file, x.numpy(), None)
    q = result["probes"]
    print(f"probes: both models give the target to {q['target_fraction_both']:.3f} (A {q['target_fraction_A']:.3f}, "
          f"B {q['target_fraction_B']:.3f}; mean target probability A {q['target_probability_A']:.3f}, "
          f"B {q['target_probability_B']:.3f})" + (f", generated in {q['seconds']:.0f} s" if "seconds" in q else ""))
    result["alignments"], moved = [], []
    for s in args.starts.split(","):
        row, m = align_on(a, b, str(probe_file), len(x), s, curve, alphas)
        result["alignments"].append(row)
        moved.append(m)
    if args.rounds:
        result["rounds"] = adversarial_rounds(a, moved[0], b, x, targets, args, curve, alphas, out)
    result["seconds_total"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'results.json'} ({result['seconds_total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
