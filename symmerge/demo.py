"""The built-in demo on the real all-MiniLM-L6-v2 (see ``symmerge demo --help``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .align import align, instances_for
from .apply import apply, random_elements
from .assets import minilm_path
from .io import atomic_dir, load_model
from .verify import with_state_dict

SENTENCES = [
    "The cat sat quietly on the warm windowsill all afternoon.",
    "Interest rates were raised again to slow down inflation.",
    "She finally finished the marathon after six hours of running.",
    "The new bridge connects the old town with the harbour district.",
    "Researchers found that the vaccine reduced hospital admissions.",
    "My laptop battery dies after barely two hours of work.",
    "The orchestra played Beethoven's fifth symphony to a full hall.",
    "Heavy snow closed the mountain pass for most of the week.",
    "He forgot his keys and had to wait outside in the rain.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Stock markets fell sharply after the earnings report.",
    "A small boat drifted slowly across the calm lake at dawn.",
]

VARIANTS = [  # (label, symmetries, rescale)
    ("none", (), "none"),
    ("attn (paper Alg. 1)", ("attn",), "none"),
    ("ffn", ("ffn",), "none"),
    ("attn+ffn", ("attn", "ffn"), "none"),
    ("attn+ffn+rescale seq.", ("attn", "ffn", "rescale"), "sequential"),
    ("attn+ffn+rescale joint", ("attn", "ffn", "rescale"), "joint"),
]


def disguise(model, noise: float, seed: int):
    """Same function, other weights: a hidden random group element, then relative Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    _, instances = instances_for(model)
    sd = apply(model.state_dict(), instances, random_elements(instances, g))
    noisy = {k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1 else v
             for k, v in sd.items()}
    return with_state_dict(model, noisy)


def embed(model, batch) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings (the sentence-transformers recipe for MiniLM)."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def interpolate(sd_a: dict, sd_b: dict, alpha: float) -> dict:
    return {k: alpha * sd_a[k] + (1 - alpha) * sd_b[k] if sd_a[k].is_floating_point() else sd_b[k] for k in sd_a}


def cosine_curve(model, anchor, batch, reference, alphas) -> list[float]:
    """Mean cosine similarity to the anchor's embeddings along α·θ_model + (1−α)·θ_anchor."""
    sd_a, sd_b = model.state_dict(), anchor.state_dict()
    probe = with_state_dict(anchor, sd_b)
    out = []
    for alpha in alphas:
        probe.load_state_dict(interpolate(sd_a, sd_b, alpha))
        out.append((embed(probe, batch) * reference).sum(-1).mean().item())
    return out


def run_demo(out: Path, noise: float = 0.01, seed: int = 0) -> dict:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    path = minilm_path()
    print(f"loading real all-MiniLM-L6-v2 from {path}")
    anchor = load_model(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    model = disguise(anchor, noise, seed)
    reference = embed(anchor, batch)
    alphas = [i / 10 for i in range(11)]
    rows, curves = [], {}
    for label, symmetries, rescale in VARIANTS:
        start = time.perf_counter()
        aligned, report = align(model, anchor, symmetries=symmetries, rescale=rescale, inputs=batch)
        seconds = time.perf_counter() - start
        curve = cosine_curve(aligned, anchor, batch, reference, alphas)
        curves[label] = curve
        rows.append({
            "variant": label,
            "distance_to_anchor": report["distance_after"],
            "max_rel_output_change": report["verify_max_rel_diff"],
            "midpoint_cosine": curve[5],
            "seconds": seconds,
            "per_layer": _per_layer(report),
        })
    _print_table(rows, noise)
    with atomic_dir(out) as tmp:
        (tmp / "demo.json").write_text(json.dumps({"noise": noise, "seed": seed, "alphas": alphas,
                                                    "rows": rows, "curves": curves}, indent=2) + "\n")
        _plot(rows, alphas, curves, tmp / "demo.png")
    print(f"wrote {out / 'demo.json'} and {out / 'demo.png'}")
    return {"rows": rows, "curves": curves}


def _per_layer(report) -> dict[str, float]:
    layers: dict[str, float] = {}
    for name, d in report["per_module"].items():
        layer = name.split(".")[1]
        layers[layer] = layers.get(layer, 0.0) + d["after"] ** 2
    return {k: v**0.5 for k, v in layers.items()}


def _print_table(rows, noise) -> None:
    print(f"\nMiniLM-L6 vs. a disguised copy (hidden group element + {noise:g}·std noise), 12 real sentences")
    head = f"{'alignment':26s} {'L2 to anchor':>13s} {'max rel Δoutput':>16s} {'midpoint cos':>13s} {'seconds':>8s}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['variant']:26s} {r['distance_to_anchor']:13.3f} {r['max_rel_output_change']:16.2e} "
              f"{r['midpoint_cosine']:13.4f} {r['seconds']:8.2f}")
    print("midpoint cos: cosine similarity of sentence embeddings of the 50/50 weight average to the anchor's (1 = perfect)\n")


def _plot(rows, alphas, curves, file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    layers = list(rows[0]["per_layer"].keys())
    width = 0.8 / len(rows)
    for k, r in enumerate(rows):
        ax1.bar([i + k * width for i in range(len(layers))], [r["per_layer"][l] for l in layers], width, label=r["variant"])
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(layers))], [f"layer {l}" for l in layers])
    ax1.set_ylabel("L2 distance to anchor (matched tensors)")
    ax1.set_title("Per-layer distance after alignment")
    ax1.legend(fontsize=8)
    for label, curve in curves.items():
        ax2.plot(alphas, curve, marker="o", label=label)
    ax2.set_xlabel("α  (θ = α·θ_aligned + (1−α)·θ_anchor)")
    ax2.set_ylabel("cosine similarity to anchor embeddings")
    ax2.set_title("Interpolation path on real sentences")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)
