"""Issue 42, item 1: is the data-free barrier a variance collapse that weight norms can undo? After the best data-free
alignment of a ViT pair, θ(α) = α·θ_A + (1−α)·θ_B is evaluated as it is and with its weight norms restored, without
data: each group's norm set to the interpolation α·‖A‖ + (1−α)‖B‖ of its endpoints' (REPAIR corrects the
activations' statistics with data; here only the weights are used). The groups: per row (an FFN unit of ``fc1``),
per head (the query, key or value block of one head), per tensor (the writers ``o_proj`` and ``fc2``, every matrix);
the bias is scaled with its rows, or left (``bias=False``). Not function-preserving alignment: a different merged
model, reported beside the plain curve.

    python -m benchmarks.datafree_norm_repair --pair b1 [--seeds 0,1] [--depth-decay 10]
    python -m benchmarks.datafree_norm_repair --pair demo [--seeds 0]

``b1``: benchmarks/vit_fashion_mnist.py's pair, models and curve set (2 000 test images); ``demo``: the demo's MNIST-5k
pair and its 1 000 test digits. Prints one line per variant: the loss barrier, the α = ½ loss and accuracy.
"""

from __future__ import annotations

import argparse
import os

import torch

# each variant: tensor-name part → the group whose norm is restored ("row", "head", "tensor")
VARIANTS = {
    "q,k per head": {"q_proj": "head", "k_proj": "head"},
    "v per head": {"v_proj": "head"},
    "fc1 per unit": {"fc1": "row"},
    "writers per tensor": {"o_proj": "tensor", "fc2": "tensor"},
    "q,k,v per head, fc1 per unit, writers per tensor": {"q_proj": "head", "k_proj": "head", "v_proj": "head",
                                                         "fc1": "row", "o_proj": "tensor", "fc2": "tensor"},
    "every matrix per tensor": {"proj": "tensor", "fc": "tensor", "classifier": "tensor"},
}


def group_norms(t: torch.Tensor, mode: str, heads: int) -> torch.Tensor:
    """One norm per output row of ``t``: the row's own, its head block's, or the whole tensor's."""
    if mode == "row":
        return t.reshape(t.shape[0], -1).norm(dim=1)
    if mode == "head":
        return t.reshape(heads, -1).norm(dim=1).repeat_interleave(t.shape[0] // heads)
    return t.norm().expand(t.shape[0])


def norm_repair(sd_a: dict, sd_b: dict, groups: dict, heads: int, bias: bool = True):
    """``transform(model, α)`` for :func:`~symmerge.evaluate.metrics.interpolation_curve`: θ(α)'s matrices named by
    ``groups`` rescaled, row by row, to their endpoints' interpolated group norms (their biases too when ``bias``)."""
    chosen = []
    for k, v in sd_b.items():
        mode = next((m for part, m in groups.items() if part in k), None)
        if mode is not None and k.endswith(".weight") and v.dim() >= 2:
            chosen.append((k, mode))

    def transform(model, alpha):
        sd = model.state_dict()
        with torch.no_grad():
            for k, mode in chosen:
                w = sd[k]
                target = alpha * group_norms(sd_a[k], mode, heads) + (1 - alpha) * group_norms(sd_b[k], mode, heads)
                s = (target / group_norms(w, mode, heads).clamp_min(1e-30)).to(w.dtype)
                w.mul_(s.view(-1, *([1] * (w.dim() - 1))))
                if bias and (b := sd.get(k[:-len("weight")] + "bias")) is not None:
                    b.mul_(s)
        return model

    return transform


def load(pair: str, seeds: str):
    """(model A, model B, the curve set, the symmetries of the best data-free alignment)."""
    if pair == "b1":
        from benchmarks import vit_fashion_mnist as b1

        _, _, _, _, _, a, b, _, curve = b1.load_pair(b1.parse_args(["--seeds", seeds]), print)
        return a, b, curve, b1.BEST_ALIGN
    from symmerge.demo.demo import ALIGN_BEST, FULL, demo_pair
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    folders, _, test_npz, *_ = demo_pair(FULL, int(seeds.split(",")[0]), progress=False)
    a, b = (load_model(f) for f in folders)
    return a, b, load_data(test_npz, a, batch_size=250), ALIGN_BEST


def main(argv=None) -> int:
    from symmerge.evaluate.metrics import interpolation_curve
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions

    p = argparse.ArgumentParser(prog="python -m benchmarks.datafree_norm_repair", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=("b1", "demo"), default="b1")
    p.add_argument("--seeds", default=None, help="b1: seeds of A,B (default 0,1); demo: the demo's seed (default 0)")
    p.add_argument("--depth-decay", type=float, default=1.0, help="the data-free descent's depth decay (default 1)")
    p.add_argument("--points", type=int, default=5, help="α values of each curve (default 5)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    a, b, curve, symmetries = load(args.pair, args.seeds or ("0,1" if args.pair == "b1" else "0"))
    res = align_pair(a, b, AlignOptions(symmetries=symmetries, depth_decay=args.depth_decay), progress=None)
    moved, anchor = res.model, res.anchor
    sd_a, sd_b = moved.state_dict(), anchor.state_dict()
    heads = anchor.config.num_attention_heads
    alphas = [i / (args.points - 1) for i in range(args.points)]
    mid = alphas.index(0.5)
    print(f"{args.pair} {args.seeds or ''} {symmetries} depth decay {args.depth_decay}: {args.points}-point curves")
    rows = [("plain θ(α)", None)] + [(f"{name}, bias={bias}", norm_repair(sd_a, sd_b, groups, heads, bias))
                                     for name, groups in VARIANTS.items() for bias in (True, False)]
    for name, transform in rows:
        c = interpolation_curve(moved, anchor, curve, alphas, progress=False, transform=transform)
        print(f"  {name:60s} barrier {c['barrier']:.4f}  α=½ loss {c['loss'][mid]:.4f}  "
              f"accuracy {c['accuracy'][mid]:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
