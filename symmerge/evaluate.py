"""Did a fusion work? Loss/accuracy on data, linear-interpolation curves and barriers, distance tables,
subset-of-layers matching, plots.

Interpolation: θ(α) = α·θ_A + (1 − α)·θ_B (``torch.lerp``, exact at α ∈ {0, 1}); α = 1 is model A.
Barrier: max_α [L(θ(α)) − (α·L_A + (1 − α)·L_B)] over the evaluated α (≥ 0: the endpoints count).
"""

from __future__ import annotations

import copy
import math

import torch

from .data import Data, predictions
from .distance import distance, parameter_keys
from .errors import SymmergeError
from .progress import bar


def evaluate(model, data: Data, device=None, progress: bool = True, desc: str = "evaluating") -> dict:
    """Mean cross-entropy and accuracy over all of ``data`` (examples, or next tokens for lm data)."""
    device = device or next(model.parameters()).device
    model = model.to(device).eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in bar(data, desc=desc, total=len(data), unit="batch", disable=None if progress else True):
            logits, targets = predictions(model, batch.to(device))
            loss_sum += torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum").item()
            correct += (logits.argmax(-1) == targets).sum().item()
            count += targets.numel()
    if count == 0:
        raise SymmergeError(f"{data.path}: nothing to evaluate")
    return {"loss": loss_sum / count, "accuracy": correct / count, "n": count}


def interpolate(sd_a: dict, sd_b: dict, alpha: float) -> dict:
    """α·θ_A + (1 − α)·θ_B for floating tensors (others from B)."""
    return {k: torch.lerp(b, sd_a[k].to(b.dtype), float(alpha)) if b.is_floating_point() else b.clone()
            for k, b in sd_b.items()}


def barrier(alphas, losses) -> float:
    """max_α [loss(α) − (α·loss(1) + (1 − α)·loss(0))]; ``alphas`` must contain 0 and 1."""
    alphas = [float(a) for a in alphas]
    if 0.0 not in alphas or 1.0 not in alphas:
        raise SymmergeError("the barrier needs the endpoints α = 0 and α = 1")
    la, lb = losses[alphas.index(1.0)], losses[alphas.index(0.0)]
    return max(loss - (a * la + (1.0 - a) * lb) for a, loss in zip(alphas, losses))


def alpha_grid(points: int) -> list[float]:
    if points < 2:
        raise SymmergeError(f"--points must be >= 2 (the endpoints), got {points}")
    return [i / (points - 1) for i in range(points)]


def check_same_shapes(model_a, model_b) -> None:
    if model_a.config.model_type != model_b.config.model_type:
        raise SymmergeError(f"architectures differ: {model_a.config.model_type!r} vs {model_b.config.model_type!r}")
    sa, sb = model_a.state_dict(), model_b.state_dict()
    if sa.keys() != sb.keys():
        only = sorted(set(sa) ^ set(sb))[:3]
        raise SymmergeError(f"architectures differ: tensors present in only one model, e.g. {only}")
    for k in sa:
        if sa[k].shape != sb[k].shape:
            raise SymmergeError(f"shapes differ for {k}: {tuple(sa[k].shape)} vs {tuple(sb[k].shape)} "
                                "(different label spaces cannot be interpolated)")


def interpolation_curve(model_a, model_b, data: Data, alphas, device=None, progress: bool = True,
                        label: str = "") -> dict:
    """Loss and accuracy of θ(α) for each α, and the barrier."""
    check_same_shapes(model_a, model_b)
    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    probe = copy.deepcopy(model_b)
    loss, acc = [], []
    for a in bar(alphas, desc=f"interpolating {label}".strip(), unit="α", disable=None if progress else True):
        probe.load_state_dict(interpolate(sd_a, sd_b, a))
        r = evaluate(probe, data, device=device, progress=False)
        loss.append(r["loss"])
        acc.append(r["accuracy"])
    return {"loss": loss, "accuracy": acc, "barrier": barrier(alphas, loss)}


# ---------------------------------------------------------------- distances


def layer_of(key: str):
    """Layer index of a state-dict key (``...layer.3.`` / ``...layers.3.``), else None."""
    parts = key.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("layer", "layers") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def distance_table(sd_a: dict, sd_b: dict, keys, instances=()) -> dict:
    """L2 distance A–B over the whole model, per layer (all of a layer's tensors), per group instance."""
    per_layer: dict[int, float] = {}
    for k in keys:
        layer = layer_of(k)
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0.0) + (sd_a[k].double() - sd_b[k].double()).square().sum().item()
    return {
        "whole": distance(sd_a, sd_b, keys),
        "per_layer": {str(i): math.sqrt(v) for i, v in sorted(per_layer.items())},
        "per_module": {inst.name: distance(sd_a, sd_b, [s.key for s in inst.slots]) for inst in instances},
    }


def distance_before_after(model, anchor, aligned, instances=()) -> dict:
    """{"before": table(model, anchor), "after": table(aligned, anchor)} over the model's parameters."""
    keys = parameter_keys(model)
    sb = anchor.state_dict()
    return {"before": distance_table(model.state_dict(), sb, keys, instances),
            "after": distance_table(aligned.state_dict(), sb, keys, instances)}


# ---------------------------------------------------------------- subset-of-layers matching


def subset_matching(model_a, model_b, data: Data, symmetries=("attn",), mode: str = "single",
                    alpha: float = 0.5, rescale: str = "joint", device=None, progress: bool = True) -> dict:
    """Align A to B on a subset of layers only, then evaluate θ(α) (paper Fig. 6).

    ``mode="single"``: only layer i, for each i; ``mode="last"``: only the last k layers, k = 1..L.
    Also reports the unmatched (no layer) and fully matched references.
    """
    from .align import align

    if mode not in ("single", "last"):
        raise SymmergeError(f"subset mode must be 'single' or 'last', got {mode!r}")
    check_same_shapes(model_a, model_b)
    n = model_a.config.num_hidden_layers
    subsets = [[i] for i in range(n)] if mode == "single" else [list(range(n - k, n)) for k in range(1, n + 1)]
    probe, sd_b = copy.deepcopy(model_b), model_b.state_dict()

    def midpoint_eval(model):
        probe.load_state_dict(interpolate(model.state_dict(), sd_b, alpha))
        return evaluate(probe, data, device=device, progress=False)

    ref = midpoint_eval(model_a)
    rows = []
    for layers in bar(subsets, desc=f"subset matching ({mode})", unit="subset", disable=None if progress else True):
        aligned, report = align(model_a, model_b, symmetries, rescale=rescale, layers=layers)
        r = midpoint_eval(aligned)
        rows.append({"layers": layers, "loss": r["loss"], "accuracy": r["accuracy"],
                     "distance_after": report["distance_after"]})
    full, report = align(model_a, model_b, symmetries, rescale=rescale)
    r = midpoint_eval(full)
    return {"mode": mode, "alpha": alpha, "symmetries": list(symmetries), "unmatched": ref,
            "all_layers": {"loss": r["loss"], "accuracy": r["accuracy"], "distance_after": report["distance_after"]},
            "subsets": rows}


# ---------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(alphas, curves: dict, path, title: str = "linear interpolation θ(α) = α·θ_A + (1−α)·θ_B") -> None:
    """Loss and accuracy against α, one line per variant (its barrier in the legend)."""
    plt = _pyplot()
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(10, 4))
    for name, c in curves.items():
        ax_l.plot(alphas, c["loss"], marker="o", label=f"{name} (barrier {c['barrier']:.3g})")
        ax_a.plot(alphas, c["accuracy"], marker="o", label=name)
    ax_l.set(xlabel="α (0 = B, 1 = A)", ylabel="loss (cross-entropy)", title="loss")
    ax_a.set(xlabel="α (0 = B, 1 = A)", ylabel="accuracy", title="accuracy")
    ax_l.legend()
    ax_a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_subsets(result: dict, path) -> None:
    """Evaluation loss against the matched subset, with the unmatched / fully matched references."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["subsets"]
    xs = [r["layers"][0] if result["mode"] == "single" else len(r["layers"]) for r in rows]
    ax.plot(xs, [r["loss"] for r in rows], marker="o", label="matched subset")
    ax.axhline(result["unmatched"]["loss"], color="grey", ls="--", label="no matching")
    ax.axhline(result["all_layers"]["loss"], color="green", ls=":", label="all layers matched")
    ax.set(xlabel="matched layer i" if result["mode"] == "single" else "last k layers matched",
           ylabel=f"loss at α = {result['alpha']}", title=f"subset-of-layers matching ({','.join(result['symmetries'])})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
