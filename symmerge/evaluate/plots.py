"""Plots of interpolation curves and subset-of-layers matching (matplotlib, Agg backend).

Every plot is read at a glance: its legend lies outside the data (below the panels, shared when the
panels share their lines), every number in it has three significant digits (:func:`sig`: ``0.00895``
beside ``0.000``, never ``0`` beside ``0.00895``), and its title names the models and the data.
"""

from __future__ import annotations

from pathlib import Path

PATH_TITLE = "linear interpolation θ(α) = α·θ_A + (1−α)·θ_B"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sig(x, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits, trailing zeros kept, so that numbers side by side read
    alike: 2.65, 0.830, 0.00895, 0.000 (a zero gets ``digits`` decimals), 12.4, 1234 (no exponent below
    10⁶ and above 1e-4); ``–`` for None, NaN."""
    if x is None or x != x:
        return "–"
    x = float(x)
    if x == 0:
        return f"{0:.{digits}f}"
    if 1e-4 <= abs(x) < 10 ** digits:
        text = f"{x:#.{digits}g}"
        return text.rstrip(".") if "e" not in text else text
    if 10 ** digits <= abs(x) < 1e6:
        return f"{x:.0f}"
    return f"{x:.{digits - 1}e}"


def short_name(x) -> str:
    """A model or data path as a title shows it: the last folder or file name."""
    text = str(x).rstrip("/")
    return Path(text).name or text


def study_title(result: dict) -> str:
    """The title of a barrier study's plot: the models, the data (and how many examples), the path."""
    models = [result[k] for k in ("model_a", "model_b") if result.get(k)] or list(result.get("models") or [])
    names = [short_name(m) for m in models]
    if len(names) == 2:
        who = f"A = {names[0]}, B = {names[1]}"
    elif names:
        who = f"{len(names)} models: " + ", ".join(names)
    else:
        who = "models"
    data = result.get("data")
    n = result.get("examples")
    on = f" on {short_name(data)}" + (f" ({n} examples)" if n else "") if data else ""
    return f"{who}{on}\n{PATH_TITLE}"


def legend_below(fig, handles, labels, columns: int | None = None):
    """One legend for the whole figure, below its panels (outside every axes); save with
    ``bbox_inches="tight"`` so that it is kept."""
    columns = columns or min(len(labels), 2 if max((len(s) for s in labels), default=0) > 40 else 3)
    fig.tight_layout()
    bottom = min(ax.get_position().y0 for ax in fig.axes)
    return fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, bottom - 0.12), ncol=max(1, columns),
                      fontsize=9, frameon=False)


def plot_curves(alphas, curves: dict, path, title: str = PATH_TITLE) -> None:
    """Loss and accuracy against α, one line per variant (its barrier in the shared legend, below)."""
    plt = _pyplot()
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(10, 4))
    handles, labels = [], []
    for name, c in curves.items():
        (h,) = ax_l.plot(alphas, c["loss"], marker="o")
        ax_a.plot(alphas, c["accuracy"], marker="o", color=h.get_color())
        handles.append(h)
        labels.append(f"{name}: barrier {sig(c['barrier'])}")
    ax_l.set(xlabel="α (0 = B, 1 = A)", ylabel="loss (cross-entropy, nats)", title="loss")
    ax_a.set(xlabel="α (0 = B, 1 = A)", ylabel="accuracy (fraction correct)", title="accuracy")
    fig.suptitle(title)
    legend_below(fig, handles, labels)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_subsets(result: dict, path, title: str | None = None) -> None:
    """Evaluation loss against the matched subset (whole layers on the x axis), with the unmatched / fully matched
    references; ``title``: the study's (:func:`study_title`), above the panel's own."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a layer index or count, never 1.2
    rows = result["subsets"]
    xs = [r["layers"][0] if result["mode"] == "single" else len(r["layers"]) for r in rows]
    ax.plot(xs, [r["loss"] for r in rows], marker="o", label="matched subset")
    ax.axhline(result["unmatched"]["loss"], color="grey", ls="--",
               label=f"no matching ({sig(result['unmatched']['loss'])})")
    ax.axhline(result["all_layers"]["loss"], color="green", ls=":",
               label=f"all layers matched ({sig(result['all_layers']['loss'])})")
    ax.set(xlabel="matched layer i" if result["mode"] == "single" else "last k layers matched",
           ylabel=f"loss at α = {result['alpha']} (nats)",
           title=f"subset-of-layers matching ({','.join(result['symmetries'])})")
    if title:
        fig.suptitle(title.replace(PATH_TITLE, f"θ(α) = α·θ_A + (1−α)·θ_B at α = {result['alpha']}"))
    legend_below(fig, *ax.get_legend_handles_labels())
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_many(result: dict, path) -> None:
    """N models: the mean pairwise interpolation loss per variant, and the accuracy of each variant's
    N-way average beside the endpoints' mean and the ensemble's."""
    plt = _pyplot()
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    alphas = result["alphas"]
    names = list(result["variants"])
    handles, labels = [], []
    for name in names:
        pairs = list(result["variants"][name]["pairs"].values())
        mean = [sum(p["loss"][k] for p in pairs) / len(pairs) for k in range(len(alphas))]
        (h,) = ax_l.plot(alphas, mean, marker="o")
        handles.append(h)
        labels.append(f"{name}: mean barrier {sig(result['variants'][name]['mean_barrier'])}")
    ax_l.set(xlabel="α along each pair (0 = j, 1 = i)", ylabel="loss (nats), mean over pairs",
             title="pairwise interpolation")
    bars = ["endpoints (mean)", "ensemble"] + [f"average ({n})" for n in names]
    values = [result["endpoints_mean"]["accuracy"], result["ensemble"]["accuracy"]] + \
        [result["variants"][n]["average"]["accuracy"] for n in names]
    ax_a.barh(bars, values, color=["grey", "black"] + ["C%d" % i for i in range(len(names))])
    for y, v in enumerate(values):
        ax_a.text(v, y, f" {sig(v)}", va="center", fontsize=8)
    ax_a.set(xlabel="accuracy (fraction correct)", title=f"{len(result['models'])}-way average", xlim=(0, 1.12))
    fig.suptitle(study_title(result).replace(PATH_TITLE, "pairwise interpolation and the N-way average"))
    legend_below(fig, handles, labels)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
