"""Issue 42, item 1: the midpoint-deviation objective J_mid (data-free) — does it order known points of a B1-recipe
ViT pair by their barriers, and where does its descent lead?

    python -m benchmarks.datafree_midpoint --pairs 0,1 --out DIR [--descend all:0 block:0 all:1 ...]

**J_mid.** Two linear factors interpolated together: the midpoint's composite differs from the mean of the
endpoints' composites by exactly a quarter of the product of the differences,
``½(W₂ᴬW₁ᴬ + W₂ᴮW₁ᴮ) − ¼(W₂ᴬ + W₂ᴮ)(W₁ᴬ + W₁ᴮ) = ¼ ΔW₂ ΔW₁`` (``Δ = A′ − B``, HF orientation: a ``Linear``
computes ``x Wᵀ``, a composite is ``W₂ W₁``). J_mid sums ``‖ΔW₂ ΔW₁‖²_F`` (white inputs) over, on the canonical
(LayerNorm-folded) weights the matchers use:

* ``qk[l, h]`` — the score form ``[ΔW_Qʰ | Δb_Qʰ]ᵀ ΔW_Kʰ`` (the query bias as an input column; the key bias dropped:
  it shifts each query's scores by a constant, which softmax removes);
* ``ov[l, h]`` — the OV circuit ``ΔW_Oʰ [ΔW_Vʰ | Δb_Vʰ]``;
* ``ffn[l]`` — the FFN linearised, ``ΔW_out [ΔW_in | Δb_in]``;
* ``pair[w, r]`` — every writer of the residual stream (the embeddings ``[patch | patch bias | positions | CLS]``,
  each layer's attention output and FFN output, with their biases) and every later reader (each layer's Q, K, V
  and FFN input, the classifier): ``ΔR P ΔW``, ``P`` the centring the readers see through their LayerNorm.

The readers' input columns and the writers' output rows are centred (``P``; ``--no-centre`` in the table's
variants: not). Each term is computed through Gram matrices, ``‖Δ₂Δ₁‖² = ⟨Δ₂ᵀΔ₂, Δ₁Δ₁ᵀ⟩``. J_mid is invariant under
any function-preserving map applied to both A′ and B, except the stream scale (it scales the writers).

**What is run, per pair.** The points (elements of B1's best alignment, ``benchmarks.vit_fashion_mnist.BEST_ALIGN``,
from ``benchmarks.datafree_objectives``' configurations; with ``--learned-point`` also the data-dependent reference
points of docs/results/datafree_frontier.md, section 1: the learned alignment, its stream with every per-layer
group solved data-free, and the descents started there), each checked as ``align`` checks it, its 5-point barrier
on B1's curve set, the weight objectives and the J_mid variants at it, and each variant's Spearman rank
correlation with the barriers. ``--descend VARIANT:LAMBDA``: from the ``plain:10`` optimum (``--depth-decay 10``),
the discrete elements kept, the continuous ones (the stream rotation in O(d−1) and scale, per-head invertible maps
on QK and VO: the learned alignment's parametrisation, ``symmerge.pipeline.learn``) optimised by Adam on
``J_variant / J_variant(start) + λ · D₁₀ / D₁₀(start)`` (``D₁₀`` the F = 10 weight objective), then composed after
the start's elements, checked and verified (A's outputs kept), the barrier measured at ``--checkpoints`` steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks import vit_fashion_mnist as b1
from benchmarks.common import bench_main, machine
from benchmarks.datafree_multistart import curve_of
from benchmarks.datafree_objectives import descent, elements_of, prepared
from symmerge.core.apply import apply, canonicalize
from symmerge.core.distance import sq_distance
from symmerge.pipeline import engine
from symmerge.pipeline.verify import verify_elements, verify_forward, with_state_dict

CONFIGS = ("plain:1", "plain:10", "plain:32", "plain:1000", "trunc:whole:f0.25:10", "trunc:whole:e0.5:10",
           "trunc:whole:f0.25s0.5:10", "hom:1000,100,10")
READERS = ("q", "k", "v", "fc1")  # per layer, in this order, then the classifier


def _centre_in(x: torch.Tensor) -> torch.Tensor:
    """A reader with its input axis (the last) projected onto the complement of the all-ones direction."""
    return x - x.mean(-1, keepdim=True)


def _centre_out(x: torch.Tensor) -> torch.Tensor:
    """A writer with its output axis (the first) so projected."""
    return x - x.mean(0, keepdim=True)


def _with_bias(w: torch.Tensor, b: torch.Tensor, bias: bool) -> torch.Tensor:
    """``[W | b]``: the bias as one more input column (zeros without ``bias``)."""
    return torch.cat([w, (b if bias else torch.zeros_like(b))[:, None]], 1)


def factors(sd: dict, layers: int, bias: bool = True, centre: bool = True) -> tuple[list, torch.Tensor, torch.Tensor]:
    """The matrices J_mid multiplies, from a canonical ViT state dict (in-memory names): per layer ``q``
    (``[W_Q | b_Q]``), ``k``, ``v`` (``[W_V | b_V]``), ``o``, ``fc1`` (``[W_in | b_in]``), ``fc2``, the writers
    ``o_w``, ``fc2_w`` with their biases; the embeddings as one writer (d × (pixels + 1 + positions + 1)); the
    classifier. Readers' inputs and writers' outputs centred with ``centre``."""
    cin, cout = (_centre_in, _centre_out) if centre else (lambda x: x, lambda x: x)
    out = []
    for layer in range(layers):
        g = lambda name: sd[f"vit.layers.{layer}.{name}"]  # noqa: E731
        att = {n: g(f"attention.{n}_proj.weight") for n in "qkvo"}
        o, fc2 = cout(att["o"]), cout(g("mlp.fc2.weight"))
        bo, bfc2 = cout(g("attention.o_proj.bias")[:, None])[:, 0], cout(g("mlp.fc2.bias")[:, None])[:, 0]
        out.append({"q": _with_bias(cin(att["q"]), g("attention.q_proj.bias"), bias), "k": cin(att["k"]),
                    "v": _with_bias(cin(att["v"]), g("attention.v_proj.bias"), bias), "o": o,
                    "fc1": _with_bias(cin(g("mlp.fc1.weight")), g("mlp.fc1.bias"), bias), "fc2": fc2,
                    "o_w": _with_bias(o, bo, bias), "fc2_w": _with_bias(fc2, bfc2, bias)})
    patch = sd["vit.embeddings.patch_embeddings.projection.weight"]
    d = patch.shape[0]
    emb = torch.cat([patch.reshape(d, -1), sd["vit.embeddings.patch_embeddings.projection.bias"][:, None],
                     sd["vit.embeddings.position_embeddings"].reshape(-1, d).T,
                     sd["vit.embeddings.cls_token"].reshape(d, 1)], 1)
    return out, cout(emb), cin(sd["classifier.weight"])


def reads(layers: int) -> torch.Tensor:
    """(2L + 1, 4L + 1) booleans: writer ``w`` (embeddings, then per layer attention out, FFN out) is read by reader
    ``r`` (per layer :data:`READERS`, then the classifier): every reader after it in the forward."""
    mask = torch.zeros(2 * layers + 1, 4 * layers + 1, dtype=torch.bool)
    mask[0] = True
    for layer in range(layers):
        mask[1 + 2 * layer, 4 * layer + 3:] = True  # attention out: this layer's FFN on
        mask[2 + 2 * layer, 4 * layer + 4:] = True  # FFN out: the next layer on
    return mask


def _pair_value(x2: torch.Tensor, x1: torch.Tensor, bound: bool) -> torch.Tensor:
    """``‖x2 x1‖²`` batched over leading axes (``⟨x2ᵀx2, x1x1ᵀ⟩``); ``bound``: ``‖x2‖²‖x1‖²`` instead."""
    g2, g1 = x2.mT @ x2, x1 @ x1.mT
    if bound:
        return g2.diagonal(0, -2, -1).sum(-1) * g1.diagonal(0, -2, -1).sum(-1)
    return (g2 * g1).sum((-1, -2))


def _grams(get, layers: int, emb: torch.Tensor, cls: torch.Tensor):
    """The stream's reader Grams ``RᵀR`` (4L + 1, d, d) and writer Grams ``WWᵀ`` (2L + 1, d, d)."""
    readers = [x.mT @ x for layer in range(layers) for x in
               (get("q", layer)[:, :-1], get("k", layer), get("v", layer)[:, :-1], get("fc1", layer)[:, :-1])]
    writers = [emb @ emb.mT] + [x @ x.mT for layer in range(layers) for x in (get("o_w", layer), get("fc2_w", layer))]
    return torch.stack(readers + [cls.mT @ cls]), torch.stack(writers)


def terms(sd_a: dict, sd_b: dict, layers: int, heads: int, bias: bool = True, centre: bool = True,
          of: str = "deviation") -> dict:
    """J_mid's terms between A′ (``sd_a``) and B (``sd_b``), canonical ViT state dicts: ``qk`` (L, H), ``ov`` (L, H),
    ``ffn`` (L,), ``pair`` (2L + 1, 4L + 1; zero where the reader does not read the writer). Differentiable.
    ``of``: ``deviation`` (``‖Δ₂Δ₁‖²``), ``own`` (``‖M_A‖² + ‖M_B‖²``, the endpoints' composites: invariant under the
    orthogonal elements of A′ but for the head pairing, which changes a head's sum) or ``bound`` (``‖Δ₂‖²‖Δ₁‖²``, what the weight distance bounds the deviation by)."""
    fa, ea, ca = factors(sd_a, layers, bias, centre)
    fb, eb, cb = factors(sd_b, layers, bias, centre)
    d = ea.shape[0]
    dh, bound = d // heads, of == "bound"

    def values(get, emb, cls):
        qk = torch.stack([_pair_value(get("q", i).reshape(heads, dh, -1).mT, get("k", i).reshape(heads, dh, -1),
                                      bound) for i in range(layers)])
        ov = torch.stack([_pair_value(get("o", i).reshape(d, heads, dh).transpose(0, 1),
                                      get("v", i).reshape(heads, dh, -1), bound) for i in range(layers)])
        ffn = torch.stack([_pair_value(get("fc2", i), get("fc1", i), bound) for i in range(layers)])
        R, W = _grams(get, layers, emb, cls)
        if bound:
            pair = W.diagonal(0, -2, -1).sum(-1)[:, None] * R.diagonal(0, -2, -1).sum(-1)[None]
        else:
            pair = torch.einsum("wij,rij->wr", W, R)
        return {"qk": qk, "ov": ov, "ffn": ffn, "pair": pair * reads(layers)}

    if of == "own":
        one, two = values(lambda n, i: fa[i][n], ea, ca), values(lambda n, i: fb[i][n], eb, cb)
        return {k: one[k] + two[k] for k in one}
    return values(lambda n, i: fa[i][n] - fb[i][n], ea - eb, ca - cb)


def depth(layers: int, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights by depth ``decay^(-l/(L-1))`` per layer (L,) and per stream writer (2L + 1,: the embeddings as
    layer 0, each layer's writers as their layer)."""
    w = torch.tensor([decay ** (-i / max(layers - 1, 1)) for i in range(layers)], dtype=torch.float64)
    return w, w[torch.tensor([0] + [i for i in range(layers) for _ in (0, 1)])]


def objective(t: dict, variant: str, layers: int, own: dict | None = None) -> torch.Tensor:
    """One scalar of the terms ``t``: ``VARIANT`` is ``all``, ``block`` (qk + ov + ffn), ``stream`` (the pairs),
    ``qk``, ``ov`` or ``ffn``, optionally ``rel-`` (each term divided by the endpoints' own ``own``) and ``@F``
    (weighted by depth, decay ``F``)."""
    name, _, decay = variant.partition("@")
    if name.startswith("rel-"):
        t = {k: torch.where(own[k] > 0, t[k] / own[k].clamp_min(1e-300), 0.0) for k in t}
        name = name[4:]
    w, ww = depth(layers, float(decay) if decay else 1.0)
    parts = {"qk": (t["qk"].sum(1) * w.to(t["qk"])).sum(), "ov": (t["ov"].sum(1) * w.to(t["ov"])).sum(),
             "ffn": (t["ffn"] * w.to(t["ffn"])).sum(), "stream": (t["pair"].sum(1) * ww.to(t["pair"])).sum()}
    chosen = {"all": ("qk", "ov", "ffn", "stream"), "block": ("qk", "ov", "ffn")}.get(name, (name,))
    return sum(parts[p] for p in chosen)


# the variants tabulated at every point ("nobias"/"uncentred": the same terms without the biases / the centring)
VARIANTS = ("all", "block", "stream", "qk", "ov", "ffn", "rel-all", "rel-block", "rel-stream", "all@10", "block@10",
            "stream@10", "rel-all@10", "all@100", "all nobias", "all uncentred")


def variant_values(sd: dict, cb: dict, layers: int, heads: int) -> dict:
    """Every :data:`VARIANTS` value, and the orthogonality ``Σ‖Δ₂Δ₁‖² / Σ‖Δ₂‖²‖Δ₁‖²`` of the block and stream
    terms, at the point ``sd`` (A′) against ``cb`` (B)."""
    base, own, bound = (terms(sd, cb, layers, heads, of=of) for of in ("deviation", "own", "bound"))
    out = {v: float(objective(base, v, layers, own)) for v in VARIANTS if " " not in v}
    out["all nobias"] = float(objective(terms(sd, cb, layers, heads, bias=False), "all", layers))
    out["all uncentred"] = float(objective(terms(sd, cb, layers, heads, centre=False), "all", layers))
    for part in ("block", "stream"):
        out[f"orthogonality {part}"] = float(objective(base, part, layers) / objective(bound, part, layers))
    return out


def spearman(x, y) -> float:
    """Spearman's rank correlation (no ties expected)."""
    rx, ry = (torch.tensor(v, dtype=torch.float64).argsort().argsort().double() for v in (x, y))
    return float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])


def reference_points(a, b, files, setup: dict, ca: dict, cb: dict) -> dict:
    """The data-dependent reference points of docs/results/datafree_frontier.md (section 1): ``{name: elements or
    {"state_dict": canonical A′}}`` — the learned alignment (1 000 unlabeled training images, ~1 min on B1), its
    stream with every per-layer group solved data-free for it, and the F = 1 and F = 10 descents started there."""
    from benchmarks import unlabeled
    from benchmarks.datafree_diagnose import composed_stream
    from symmerge.pipeline.align import align_pair

    inst = setup["instances"]
    learned = align_pair(a, b, unlabeled.row_options("learned", files["stats"], 1000))
    wide = [i for i in engine.active(inst, setup["opts"]) if not i.kind.per_layer]
    stream = {i.name: composed_stream(learned.elements[i.name]) for i in wide}
    around = engine.solve_local([i for i in inst if i.kind.per_layer], apply(ca, wide, stream), cb, setup["opts"])
    return {"learned (GL head maps, stream scale)": {"state_dict": canonicalize(learned.model.state_dict(), wide)},
            "learned stream, per-layer solved": {**stream, **around},
            "F = 1 descent from there": descent(setup, ca, cb, 1.0, start=around)[0],
            "F = 10 descent from there": descent(setup, ca, cb, 10.0, start=around)[0]}


def data_free_points(setup: dict, ca: dict, cb: dict) -> dict:
    """``{name: elements}``: :data:`CONFIGS` (``benchmarks.datafree_objectives``), the F = 10 descent cut at 2
    sweeps, and no alignment."""
    inst, opts = setup["instances"], setup["opts"]
    points = {c: elements_of(c, setup, ca, cb)[0] for c in CONFIGS}
    points["plain:10, 2 sweeps"] = engine.search(inst, ca, cb, opts, max_sweeps=2, tol=setup["options"].descent_tol,
                                                 starts=engine.Restarts(None, None, depth_decay=10.0))[0]
    points["none"] = {i.name: i.kind.identity(i) for i in engine.active(inst, opts)}
    return points


def measured_point(found, ctx: dict) -> dict:
    """One point's row: checked and verified as ``align`` does (elements; a state dict is A's learned alignment,
    verified by ``align`` itself), its barrier, weight objectives and J_mid variants."""
    a, b, bound, setup, ca, cb = (ctx[k] for k in ("a", "b", "bound", "setup", "ca", "cb"))
    inst = bound.instances
    if "state_dict" in found:
        sd, row = found["state_dict"], {}
        alphas = [i / (ctx["points"] - 1) for i in range(ctx["points"])]
        from symmerge.evaluate.metrics import interpolation_curve

        row["barrier"] = interpolation_curve(with_state_dict(a, sd), with_state_dict(b, cb), ctx["curve"], alphas,
                                             progress=False)["barrier"]
    else:
        verify_elements(inst, found)
        sd = apply(ca, inst, found)
        row = verify_forward(a, with_state_dict(a, sd), bound.spec)
        row["barrier"] = curve_of(a, b, ca, cb, inst, found, ctx["curve"], ctx["points"])["barrier"]
    sd64, cb64 = ({k: v.double() for k, v in x.items()} for x in (sd, cb))
    row["objective"] = sq_distance(sd64, cb64, setup["matched"])
    row["objective_F10"] = sq_distance(*engine.weighted(inst, sd64, cb64, setup["opts"], depth_decay=10),
                                       setup["matched"])
    row["jmid"] = variant_values(sd64, cb64, a.config.num_hidden_layers, a.config.num_attention_heads)
    return row


def descend(spec: str, ctx: dict, start: dict, args) -> dict:
    """``spec`` ``VARIANT:LAMBDA[:stream]``: Adam (``args.lr``, ``args.steps``) on the continuous elements composed
    after ``start`` (the learned alignment's parametrisation: stream rotation in O(d−1) and scale, per-head invertible
    QK and VO maps; ``stream``: the stream's alone; the discrete elements kept) for
    ``J_VARIANT / J(start) + λ · D₁₀ / D₁₀(start)`` (``none``: no J term); ``{step: elements}`` at
    ``args.checkpoints`` and the loss history."""
    from symmerge.pipeline.learn import Parameters, norm_eps

    a, setup, ca, cb = ctx["a"], ctx["setup"], ctx["ca"], ctx["cb"]
    inst, opts, layers, heads = setup["instances"], setup["opts"], a.config.num_hidden_layers, a.config.num_attention_heads
    variant, lam, only = (spec.split(":") + ["", ""])[:3]
    a0, b0 = ({k: v.double() for k, v in x.items()} for x in (apply(ca, inst, start), cb))
    weights = engine.objective_weights(inst, opts, 1.0, 10.0)
    own = terms(a0, b0, layers, heads, of="own")  # ``rel-``: each term's weight held at the start's
    free = [i for i in inst if not i.kind.per_layer] if only == "stream" else inst
    params = Parameters(free, opts, torch.float64, {"norm_eps": norm_eps(a.config)})

    def parts():
        moved = {**a0, **params.transform(a0)}
        j = (objective(terms(moved, b0, layers, heads), variant, layers, own) if variant != "none"
             else torch.zeros((), dtype=torch.float64))
        d10 = sum(weights.get(k, 1.0) * (moved[k] - b0[k]).square().sum() for k in setup["matched"])
        return j, d10

    with torch.no_grad():
        j0, d0 = (float(x) for x in parts())
    opt = torch.optim.Adam(params.parameters(), lr=args.lr)
    kept, history = {}, []
    for step in range(args.steps + 1):
        if step in args.checkpoints:
            learned = params.elements()
            kept[step] = {**start, **{n: (start[n], e) for n, e in learned.items()}}
        if step == args.steps:
            break
        opt.zero_grad()
        j, d10 = parts()
        loss = (j / j0 if j0 else j) + float(lam or 0) * d10 / d0
        loss.backward()
        opt.step()
        history.append({"step": step, "J": float(j.detach()), "D10": float(d10.detach()), "loss": float(loss.detach())})
    return {"kept": kept, "history": history, "J_start": j0, "D10_start": d0}


def shown(spec: str) -> str:
    """The J_mid variant a descent's rows show: its own (``all`` for ``none`` or one not tabulated)."""
    variant = spec.split(":")[0]
    return variant if variant in VARIANTS else "all"


def run_pair(seeds: str, args, log=print) -> dict:
    _, _, folders, _, files, a, b, _, curve = b1.load_pair(b1.parse_args(["--seeds", seeds]), log)
    bound, setup, ca, cb = prepared(a, b)
    ctx = {"a": a, "b": b, "bound": bound, "setup": setup, "ca": ca, "cb": cb, "curve": curve, "points": args.points}
    points = ({"plain:10": elements_of("plain:10", setup, ca, cb)[0]} if args.descend_only
              else data_free_points(setup, ca, cb))
    if args.learned_point:
        points.update(reference_points(a, b, files, setup, ca, cb))
    rows = {}
    for name, found in points.items():
        rows[name] = measured_point(found, ctx)
        log(f"  {seeds} {name:38s} barrier {rows[name]['barrier']:.4f}  J all {rows[name]['jmid']['all']:9.2f}  "
            f"objective {rows[name]['objective']:8.2f}")
    descents = {}
    for spec in args.descend:
        t = time.perf_counter()
        run = descend(spec, ctx, points["plain:10"], args)
        seconds = time.perf_counter() - t
        descents[spec] = {"seconds": seconds, "J_start": run["J_start"], "D10_start": run["D10_start"],
                          "history": run["history"][::10], "checkpoints": {}}
        for step, found in run["kept"].items():
            row = descents[spec]["checkpoints"][str(step)] = measured_point(found, ctx)
            log(f"  {seeds} descend {spec:14s} step {step:4d}  J {row['jmid'][shown(spec)]:9.2f}  "
                f"F10 objective {row['objective_F10']:8.2f}  barrier {row['barrier']:.4f}  "
                f"verified {row['verify_max_rel_diff']:.1e}")
    return {"seeds": seeds, "models": [str(f) for f in folders], "points": rows, "descents": descents}


def point_table(pair: dict) -> list:
    """The points by barrier, each variant's values and its Spearman correlation with the barriers."""
    rows = pair["points"]
    order = sorted(rows, key=lambda n: rows[n]["barrier"])
    aligned = [n for n in order if n != "none"]
    lines = [f"Pair {pair['seeds']}: the points by barrier (J_mid variants; ρ: Spearman with the barrier over all "
             "points / the aligned ones)", "", "| variant | ρ all | ρ aligned | " + " | ".join(order) + " |",
             "|---" * (len(order) + 3) + "|", "| barrier | | | " + " | ".join(f"{rows[n]['barrier']:.3f}" for n in order)
             + " |"]
    columns = [("objective", lambda r: r["objective"]), ("objective F = 10", lambda r: r["objective_F10"])]
    columns += [(v, lambda r, v=v: r["jmid"][v]) for v in next(iter(rows.values()))["jmid"]]
    for label, get in columns:
        rho = [spearman([get(rows[n]) for n in ns], [rows[n]["barrier"] for n in ns]) for ns in (order, aligned)]
        lines.append(f"| {label} | {rho[0]:.2f} | {rho[1]:.2f} | " + " | ".join(f"{get(rows[n]):.4g}" for n in order)
                     + " |")
    return lines + [""]


def markdown(result: dict) -> str:
    lines = []
    for pair in result["pairs"]:
        if len(pair["points"]) > 2:
            lines += point_table(pair)
        for spec, run in pair["descents"].items():
            lines += [f"Pair {pair['seeds']}: descent of `{spec}` from `plain:10` ({run['seconds']:.0f} s)", "",
                      "| step | J (this variant) | J all | F = 10 objective | barrier | verified (max rel. diff) |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {s} | {r['jmid'][shown(spec)]:.2f} | {r['jmid']['all']:.2f} | {r['objective_F10']:.2f} | "
                      f"{r['barrier']:.4f} | {r['verify_max_rel_diff']:.1e} |" for s, r in run["checkpoints"].items()]
            lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.datafree_midpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", nargs="+", default=["0,1"], help="seeds of A,B per pair (default: B1's 0,1)")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--points", type=int, default=5, help="α values of each curve (default 5)")
    p.add_argument("--learned-point", action="store_true", help="also the data-dependent reference points")
    p.add_argument("--descend", nargs="*", default=[], help="VARIANT:LAMBDA[:stream] descents from plain:10")
    p.add_argument("--descend-only", action="store_true", help="no point table: plain:10 and the descents only")
    p.add_argument("--steps", type=int, default=300, help="Adam steps of each descent (default 300)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (default 1e-3)")
    p.add_argument("--checkpoints", default="0,30,100,300", help="steps whose elements are measured")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.set_defaults(plot_only=None, train_only=False)
    args = p.parse_args(argv)
    args.checkpoints = {int(s) for s in args.checkpoints.split(",")}
    return args


def run(args) -> dict:
    t0 = time.perf_counter()
    result = {"benchmark": "datafree_midpoint",
              "command": " ".join(["python -m benchmarks.datafree_midpoint"] + sys.argv[1:]), "machine": machine(),
              "points": args.points, "pairs": [run_pair(s, args) for s in args.pairs]}
    result["seconds_total"] = time.perf_counter() - t0
    return result


def main(argv=None) -> int:
    """Run, print the tables, write ``results.json`` and ``tables.md`` into ``--out`` (atomically)."""
    from symmerge.io.model import atomic_dir, write_json

    def written(result: dict, out: Path) -> None:
        text = markdown(result)
        with atomic_dir(out) as tmp:
            write_json(tmp / "results.json", result)
            (tmp / "tables.md").write_text(text)

    return bench_main(parse_args(argv), None, run, lambda result: print("\n" + markdown(result)), written, "tables.md")


if __name__ == "__main__":
    sys.exit(main())
