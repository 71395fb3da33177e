"""Plots of interpolation curves and subset-of-layers matching (matplotlib, Agg backend)."""

from __future__ import annotations


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


def plot_many(result: dict, path) -> None:
    """N models: the mean pairwise interpolation loss per variant, and the accuracy of each variant's
    N-way average beside the endpoints' mean and the ensemble's."""
    plt = _pyplot()
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    alphas = result["alphas"]
    names = list(result["variants"])
    for name in names:
        pairs = list(result["variants"][name]["pairs"].values())
        mean = [sum(p["loss"][k] for p in pairs) / len(pairs) for k in range(len(alphas))]
        ax_l.plot(alphas, mean, marker="o",
                  label=f"{name} (mean barrier {result['variants'][name]['mean_barrier']:.3g})")
    ax_l.set(xlabel="α along each pair (0 = j, 1 = i)", ylabel="loss, mean over pairs", title="pairwise interpolation")
    ax_l.legend()
    labels = ["endpoints (mean)", "ensemble"] + [f"average ({n})" for n in names]
    values = [result["endpoints_mean"]["accuracy"], result["ensemble"]["accuracy"]] + \
        [result["variants"][n]["average"]["accuracy"] for n in names]
    ax_a.barh(labels, values, color=["grey", "black"] + ["C%d" % i for i in range(len(names))])
    ax_a.set(xlabel="accuracy", title=f"{len(result['models'])}-way average")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
