"""Every merge method at the edges of its parameters, against mergekit 0.1.5 itself.

Each case is one mergekit config over tiny random checkpoints (Llama, hidden 32, 2 layers, fine-tunes = base +
N(0, 0.004), from tests/mergekit_oracle.py; a BertModel with an int64 ``position_ids`` buffer; copies where a
fine-tune equals the base in some tensors, where one tensor is zero in every model, and where the "fine-tune" is
the base negated). mergekit merges it in this process (``run_merge``), symmerge runs ``symmerge run CONFIG OUT``
(``symmerge.cli.main``) in this process too, and the two outputs are compared tensor by tensor:

* ``gap``: ‖symmerge − mergekit‖ / ‖mergekit − base‖ over every floating tensor (the share of the merge's own
  change the two disagree on; ``/ ‖mergekit‖`` where the merge changes nothing);
* ``max|Δ|/max|t|``: the largest per-tensor max |symmerge − mergekit| over that tensor's largest magnitude;
* a verdict: ``held`` (both ran, same names and dtypes, ``max|Δ|/max|t|`` within the bound: float32 1e-5,
  4 roundings of a half dtype where the merge computes in it or writes it; ``t`` the larger of the two results
  and the reference input at that tensor), ``both refuse`` (mergekit raised, symmerge exit 2 with one ``error:``
  line), ``symmerge accepts`` / ``symmerge refuses`` (one tool only: judged in docs/results/methodedge_audit.md),
  ``stochastic`` (DARE / DELLA masks differ by construction: the share of entries left at the base's value and
  ‖merged − base‖ are printed for both), ``DIFFERS`` (a defect or an explained difference).

    /tmp/mk-local/bin/python benchmarks/methodedge_audit.py [--only SUBSTRING] [--json FILE]
    python benchmarks/methodedge_audit.py --table FILE.json   # a run's rows as a markdown table

Runs in a venv that has mergekit (PYTHONPATH=the worktree first). One thread.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mergekit_oracle as mo  # noqa: E402

HALF = {"float16": 4 * 2.0 ** -10, "bfloat16": 4 * 2.0 ** -7}
STOCHASTIC = ("dare_linear", "dare_ties", "della", "della_linear")


# ------------------------------------------------------------------ inputs


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of folder ``src`` at ``dst`` with its tensors passed through ``change(dict) -> dict``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        sd = change(load_file(str(f)))
        save_file(sd, str(f), metadata={"format": "pt"})
    return dst


def _bert(root: Path, n: int = 2, noise: float = 0.004) -> tuple[Path, list[Path]]:
    """A tiny BertModel and ``n`` fine-tunes, each with an int64 ``embeddings.position_ids`` buffer stored."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=48, max_position_embeddings=32), add_pooling_layer=True)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    paths = []
    for i in range(n + 1):
        sd = dict(base)
        if i:
            g = torch.Generator().manual_seed(i)
            sd = {k: v + noise * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                  for k, v in base.items()}
        model.load_state_dict(sd, strict=False)
        folder = root / ("bert-base" if i == 0 else f"bert-ft{i}")
        model.save_pretrained(str(folder))
        mo.save_tokenizer(folder)
        f = folder / "model.safetensors"
        stored = load_file(str(f))
        stored["embeddings.position_ids"] = torch.arange(32, dtype=torch.int64)[None]
        save_file(stored, str(f), metadata={"format": "pt"})
        paths.append(folder)
    return paths[0], paths[1:]


def inputs(root: Path) -> dict:
    """Every checkpoint the cases name: ``base``/``ft1``/``ft2``/``ft3`` (float32 Llama), ``*_bf16``,
    ``*_f16``, ``same1`` (ft1 with its attention and norms equal to the base's), ``zero_*`` (base, ft1, ft2 with
    one MLP weight all zeros), ``neg`` (the base negated), ``copy`` (the base again), BERT."""
    f = {}
    base, fts = mo.family(root / "f32", "llama", "float32", n=3, layers=2, hidden=32)
    f.update(base=base, ft1=fts[0], ft2=fts[1], ft3=fts[2])
    for dt, tag in (("bfloat16", "bf16"), ("float16", "f16")):
        b, ft = mo.family(root / tag, "llama", dt, n=2, layers=2, hidden=32)
        f.update({f"base_{tag}": b, f"ft1_{tag}": ft[0], f"ft2_{tag}": ft[1]})
    from safetensors.torch import load_file

    base_sd = {}
    for file in base.glob("*.safetensors"):
        base_sd.update(load_file(str(file)))
    same = ("self_attn", "norm")
    f["same1"] = _rewrite(fts[0], root / "same1",
                          lambda sd: {k: base_sd[k].clone() if any(s in k for s in same) else v
                                      for k, v in sd.items()})
    zero = "model.layers.0.mlp.down_proj.weight"
    for name, src in (("zero_base", base), ("zero_ft1", fts[0]), ("zero_ft2", fts[1])):
        f[name] = _rewrite(src, root / name, lambda sd: {k: torch.zeros_like(v) if k == zero else v
                                                          for k, v in sd.items()})
    f["neg"] = _rewrite(base, root / "neg", lambda sd: {k: -v for k, v in sd.items()})
    f["copy"] = _rewrite(base, root / "copy", lambda sd: sd)
    b, ft = _bert(root)
    f.update(bert_base=b, bert_ft1=ft[0], bert_ft2=ft[1])
    return f


# ------------------------------------------------------------------ cases


def _m(name, **params):
    return {"model": name, **({"parameters": params} if params else {})}


def cases() -> list[tuple[str, dict, str]]:
    """(label, config with model names for paths, the base's name for the gap)."""
    out = []

    def add(label, method, models, base=None, params=None, dtype="float32", out_dtype=None, ref=None, **extra):
        cfg = {"merge_method": method, "models": models, "dtype": dtype}
        if base:
            cfg["base_model"] = base
        if params:
            cfg["parameters"] = params
        if out_dtype:
            cfg["out_dtype"] = out_dtype
        cfg.update(extra)
        out.append((label, cfg, ref or base or "base"))

    two = lambda w1, w2, **p: [_m("ft1", weight=w1, **p), _m("ft2", weight=w2, **p)]  # noqa: E731
    # weights
    for method in ("linear", "task_arithmetic", "ties", "breadcrumbs", "dare_linear", "della_linear", "nuslerp",
                   "multislerp"):
        base = None if method == "linear" else "base"
        extra = {"density": 1.0} if method in ("ties", "dare_linear") else {}
        if method == "breadcrumbs":
            extra = {"density": 0.9, "gamma": 0.01}
        if method == "della_linear":
            extra = {"density": 1.0, "epsilon": 0.0}
        ms = lambda w1, w2: [_m("ft1", weight=w1, **extra), _m("ft2", weight=w2, **extra)]  # noqa: E731
        add(f"{method} weights [1, 0]", method, ms(1.0, 0.0), base)
        add(f"{method} weights [0, 0]", method, ms(0.0, 0.0), base)
        add(f"{method} weights [-0.5, 1.5]", method, ms(-0.5, 1.5), base)
        if method not in ("nuslerp", "multislerp"):
            add(f"{method} weights [0.3, 0.3] normalize true", method, ms(0.3, 0.3), base, {"normalize": True})
            add(f"{method} weights [0.3, 0.3] normalize false", method, ms(0.3, 0.3), base, {"normalize": False})
            add(f"{method} weight gradient [0, 0.5, 1]", method,
                [_m("ft1", weight=[0.0, 0.5, 1.0], **extra), _m("ft2", weight=[1.0, 0.5, 0.0], **extra)], base)
            add(f"{method} weight per filter self_attn", method,
                [_m("ft1", weight=[{"filter": "self_attn", "value": 0.2}, {"value": 0.8}], **extra),
                 _m("ft2", weight=0.5, **extra)], base)
    add("linear weights [-0.5, 1.5] normalize false", "linear", two(-0.5, 1.5), None, {"normalize": False})
    add("linear weights [0, 0] normalize false", "linear", two(0.0, 0.0), None, {"normalize": False})
    add("linear weights [1, -1] (sum 0)", "linear", two(1.0, -1.0), None)
    add("task_arithmetic weights [1, -1]", "task_arithmetic", two(1.0, -1.0), "base")
    add("task_arithmetic int8_mask", "task_arithmetic", two(0.6, 0.9), "base", {"int8_mask": True})
    add("ties int8_mask", "ties", two(0.6, 0.9, density=0.5), "base", {"int8_mask": True})
    add("task_arithmetic lambda 0", "task_arithmetic", two(0.6, 0.9), "base", {"lambda": 0.0})
    add("task_arithmetic lambda -1", "task_arithmetic", two(0.6, 0.9), "base", {"lambda": -1.0})
    add("ties lambda 0", "ties", two(0.6, 0.9, density=0.5), "base", {"lambda": 0.0})
    add("ties lambda -0.5", "ties", two(0.6, 0.9, density=0.5), "base", {"lambda": -0.5})
    # density
    for method in ("ties", "breadcrumbs_ties", "dare_ties", "dare_linear", "della", "sce"):
        for d in (0.0, 1.0, 1e-6, 1.5, -0.1):
            if method == "sce":
                add(f"sce select_topk {d}", method, [_m("ft1"), _m("ft2")], "base", {"select_topk": d})
                continue
            p = {"density": d}
            if method == "breadcrumbs_ties":
                p["gamma"] = 0.0
            if method == "della":
                p["epsilon"] = 0.0
            add(f"{method} density {d}", method, two(0.6, 0.9, **p), "base")
    add("ties consensus_method count", "ties", two(0.6, 0.9, density=0.5), "base", {"consensus_method": "count"})
    add("ties consensus_method sum", "ties", two(0.6, 0.9, density=0.5), "base", {"consensus_method": "sum"})
    add("dare_linear density 1 rescale false", "dare_linear", two(0.6, 0.9, density=1.0), "base",
        {"rescale": False})
    add("dare_linear density 0.5 rescale false", "dare_linear", two(0.6, 0.9, density=0.5), "base",
        {"rescale": False})
    add("dare_ties density 0.5 rescale true", "dare_ties", two(0.6, 0.9, density=0.5), "base", {"rescale": True})
    # DELLA epsilon
    add("della epsilon > density (0.3, 0.5)", "della", two(0.6, 0.9, density=0.3, epsilon=0.5), "base")
    add("della epsilon = density (0.4, 0.4)", "della", two(0.6, 0.9, density=0.4, epsilon=0.4), "base")
    add("della density+epsilon > 1 (0.8, 0.3)", "della", two(0.6, 0.9, density=0.8, epsilon=0.3), "base")
    add("della epsilon 0 (density 0.5)", "della", two(0.6, 0.9, density=0.5, epsilon=0.0), "base")
    add("della epsilon negative", "della", two(0.6, 0.9, density=0.5, epsilon=-0.1), "base")
    add("della lambda 0 (density 1)", "della", two(0.6, 0.9, density=1.0, epsilon=0.0), "base", {"lambda": 0.0})
    add("della lambda -1 (density 1)", "della", two(0.6, 0.9, density=1.0, epsilon=0.0), "base", {"lambda": -1.0})
    # breadcrumbs gamma
    for d, g in ((0.9, 0.0), (1.0, 0.0), (0.9, 0.2), (0.5, 0.5), (0.9, 1.0), (0.9, -0.1)):
        add(f"breadcrumbs density {d} gamma {g}", "breadcrumbs", two(0.6, 0.9), "base", {"density": d, "gamma": g})
    # slerp / nuslerp t
    for t in (0.0, 1.0, -0.5, 1.5):
        add(f"slerp t {t}", "slerp", [_m("base"), _m("ft1")], "base", {"t": t})
        add(f"nuslerp weights [{1 - t}, {t}]", "nuslerp", [_m("ft1", weight=1 - t), _m("ft2", weight=t)],
            "base", ref="base")
    add("slerp t gradient [0, 0.5, 1]", "slerp", [_m("base"), _m("ft1")], "base", {"t": [0.0, 0.5, 1.0]})
    add("slerp t per filter", "slerp", [_m("base"), _m("ft1")], "base",
        {"t": [{"filter": "self_attn", "value": [0.0, 1.0]}, {"filter": "mlp", "value": 0.7}, {"value": 0.4}]})
    add("slerp identical endpoints", "slerp", [_m("base"), _m("copy")], "base", {"t": 0.3})
    add("slerp antipodal endpoints", "slerp", [_m("base"), _m("neg")], "base", {"t": 0.3})
    add("slerp zero tensor", "slerp", [_m("zero_base"), _m("zero_ft1")], "zero_base", {"t": 0.3})
    for flat in (True, False):
        for row in (True, False):
            add(f"nuslerp flatten {flat} row_wise {row} (no base)", "nuslerp",
                [_m("base", weight=0.4), _m("ft1", weight=0.6)], None,
                {"nuslerp_flatten": flat, "nuslerp_row_wise": row})
            add(f"nuslerp flatten {flat} row_wise {row} (base)", "nuslerp", two(0.4, 0.6), "base",
                {"nuslerp_flatten": flat, "nuslerp_row_wise": row})
    add("nuslerp identical endpoints", "nuslerp", [_m("base", weight=0.5), _m("copy", weight=0.5)], None)
    add("nuslerp antipodal endpoints", "nuslerp", [_m("base", weight=0.5), _m("neg", weight=0.5)], None)
    # karcher
    for p in ({"max_iter": 0}, {"max_iter": 1}, {"tol": 0.0}, {"max_iter": 1, "tol": 0.0}):
        add(f"karcher {p}", "karcher", [_m("ft1"), _m("ft2")], None, p)
    add("karcher {'tol': 0.0} three models", "karcher", [_m("ft1"), _m("ft2"), _m("ft3")], None, {"tol": 0.0})
    add("karcher identical models", "karcher", [_m("base"), _m("copy")], None)
    add("karcher antipodal models", "karcher", [_m("base"), _m("neg")], None)
    # model_stock
    add("model_stock two models", "model_stock", [_m("ft1"), _m("ft2")], "base")
    add("model_stock three models", "model_stock", [_m("ft1"), _m("ft2"), _m("ft3")], "base")
    add("model_stock filter_wise", "model_stock", [_m("ft1"), _m("ft2")], "base", {"filter_wise": True})
    add("model_stock one fine-tune equal to the base", "model_stock", [_m("ft1"), _m("copy")], "base")
    # degenerate tensors
    for method, p in (("task_arithmetic", {}), ("ties", {"density": 0.5}), ("breadcrumbs", {}),
                      ("sce", {}), ("model_stock", {}), ("ram", {}), ("ramplus_tl", {}),
                      ("dare_linear", {"density": 1.0}), ("della", {"density": 1.0, "epsilon": 0.0}),
                      ("multislerp", {}), ("arcee_fusion", {})):
        if method == "arcee_fusion":
            add("arcee_fusion zero task vector", method, [_m("base"), _m("same1")], "base")
            continue
        w = {"weight": 0.7} if method not in ("sce", "model_stock", "ram", "ramplus_tl") else {}
        add(f"{method} zero task vector", method, [_m("same1", **w, **p), _m("ft2", **w, **p)], "base")
        add(f"{method} all-zero tensor", method, [_m("zero_ft1", **w, **p), _m("zero_ft2", **w, **p)],
            "zero_base")
    add("nearswap t 0", "nearswap", [_m("base"), _m("ft1")], "base", {"t": 0.0})
    add("nearswap identical", "nearswap", [_m("base"), _m("copy")], "base", {"t": 0.003})
    add("linear all-zero tensor", "linear", [_m("zero_ft1", weight=0.5), _m("zero_ft2", weight=0.5)], None,
        ref="zero_base")
    # encoder with an int64 buffer
    add("bert linear", "linear", [_m("bert_ft1", weight=0.5), _m("bert_ft2", weight=0.5)], None, ref="bert_base")
    add("bert ties", "ties", [_m("bert_ft1", weight=0.6, density=0.5), _m("bert_ft2", weight=0.9, density=0.5)],
        "bert_base")
    add("bert slerp t 1", "slerp", [_m("bert_base"), _m("bert_ft1")], "bert_base", {"t": 1.0})
    add("bert model_stock", "model_stock", [_m("bert_ft1"), _m("bert_ft2")], "bert_base")
    # dtypes
    for dt in ("bfloat16", "float16"):
        tag = "bf16" if dt == "bfloat16" else "f16"
        b = f"base_{tag}"
        ws = lambda w1, w2, **p: [_m(f"ft1_{tag}", weight=w1, **p), _m(f"ft2_{tag}", weight=w2, **p)]  # noqa
        add(f"{dt} linear weights [1, 0]", "linear", ws(1.0, 0.0), None, dtype=dt, ref=b)
        add(f"{dt} linear weights [0.3, 0.3] normalize false", "linear", ws(0.3, 0.3), None,
            {"normalize": False}, dtype=dt, ref=b)
        add(f"{dt} task_arithmetic lambda -1", "task_arithmetic", ws(0.6, 0.9), b, {"lambda": -1.0}, dtype=dt)
        add(f"{dt} ties density 1", "ties", ws(0.6, 0.9, density=1.0), b, dtype=dt)
        add(f"{dt} ties density 1e-6", "ties", ws(0.6, 0.9, density=1e-6), b, dtype=dt)
        add(f"{dt} slerp t 0", "slerp", [_m(b), _m(f"ft1_{tag}")], b, {"t": 0.0}, dtype=dt)
        add(f"{dt} slerp t 1.5", "slerp", [_m(b), _m(f"ft1_{tag}")], b, {"t": 1.5}, dtype=dt)
        add(f"{dt} karcher tol 0", "karcher", [_m(f"ft1_{tag}"), _m(f"ft2_{tag}")], None, {"tol": 0.0},
            dtype=dt, ref=b)
        add(f"{dt} karcher max_iter 1", "karcher", [_m(f"ft1_{tag}"), _m(f"ft2_{tag}")], None, {"max_iter": 1},
            dtype=dt, ref=b)
        add(f"{dt} inputs, dtype float32 out_dtype {dt}: ties density 1e-6", "ties", ws(0.6, 0.9, density=1e-6), b,
            dtype="float32", out_dtype=dt)
        add(f"float32 inputs, dtype {dt} out_dtype float32: linear [0.25, 0.75]", "linear",
            [_m("ft1", weight=0.25), _m("ft2", weight=0.75)], None, dtype=dt, out_dtype="float32", ref="base")
        add(f"float32 inputs, dtype {dt} out_dtype float32: task_arithmetic [-0.5, 1.5]", "task_arithmetic",
            [_m("ft1", weight=-0.5), _m("ft2", weight=1.5)], "base", dtype=dt, out_dtype="float32")
        add(f"float32 inputs, dtype float32 out_dtype {dt}: slerp t 1.5", "slerp", [_m("base"), _m("ft1")], "base",
            {"t": 1.5}, dtype="float32", out_dtype=dt)
    # every method computing in a half dtype on float32 files, written as float32 (mergekit: its result in the
    # compute dtype, or in float32 for the methods that return float32, widened by out_dtype)
    for dt in ("bfloat16", "float16"):
        for method, models, base, p in (
                ("linear", [_m("ft1", weight=0.3), _m("ft2", weight=0.7)], None, {}),
                ("task_arithmetic", [_m("ft1", weight=0.6), _m("ft2", weight=0.9)], "base", {}),
                ("ties", [_m("ft1", weight=0.6, density=0.5), _m("ft2", weight=0.9, density=0.5)], "base", {}),
                ("breadcrumbs", [_m("ft1", weight=0.6), _m("ft2", weight=0.9)], "base", {"density": 0.7}),
                ("sce", [_m("ft1"), _m("ft2")], "base", {"select_topk": 0.5}),
                ("slerp", [_m("base"), _m("ft1")], "base", {"t": 0.3}),
                ("nuslerp", [_m("ft1", weight=0.4), _m("ft2", weight=0.6)], "base", {}),
                ("multislerp", [_m("ft1", weight=0.4), _m("ft2", weight=0.6)], "base", {}),
                ("karcher", [_m("ft1"), _m("ft2")], None, {}),
                ("model_stock", [_m("ft1"), _m("ft2")], "base", {}),
                ("nearswap", [_m("base"), _m("ft1")], "base", {"t": 0.003}),
                ("arcee_fusion", [_m("base"), _m("ft1")], "base", {}),
                ("ram", [_m("ft1"), _m("ft2")], "base", {"epsilon": 0.004}),
                ("ramplus_tl", [_m("ft1"), _m("ft2")], "base", {"epsilon": 0.004, "r": 0.5, "alpha": 0.3}),
                ("passthrough", [_m("ft1", scale=0.5)], None, {})):
            add(f"float32 files, dtype {dt} out_dtype float32: {method}", method, models, base, p, dtype=dt,
                out_dtype="float32", ref="base")
    return out


def _paths(cfg, files):
    def fix(m):
        return {**m, "model": str(files[m["model"]])}

    cfg = dict(cfg)
    cfg["models"] = [fix(m) for m in cfg["models"]]
    if "base_model" in cfg:
        cfg["base_model"] = str(files[cfg["base_model"]])
    return cfg


def _sum(files, names, weights):
    sds = [mo.tensors(files[n]) for n in names]
    return {k: (sum(w * sd[k].double() for w, sd in zip(weights, sds)).to(v.dtype) if v.is_floating_point() else v)
            for k, v in sds[0].items()}


# where mergekit crashes (0.1.5: its BERT architecture's aliases are a tuple), the rule computed here
EXPECT = {"bert linear": lambda f: _sum(f, ("bert_ft1", "bert_ft2"), (0.5, 0.5)),
          "bert slerp t 1": lambda f: mo.tensors(f["bert_ft1"])}


# ------------------------------------------------------------------ one case


def _mergekit(cfg, out) -> str | None:
    """None if mergekit merged ``cfg`` into ``out``; else the last line of its exception."""
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mo.run_mergekit(cfg, out)
    except BaseException as e:  # noqa: BLE001 - a crash is a result here
        if isinstance(e, KeyboardInterrupt):
            raise
        lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
        return " / ".join(lines[:3])[:200]
    return None


def _symmerge(cfg_path, out) -> tuple[int, str]:
    from symmerge.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rc = main(["run", str(cfg_path), str(out), "--progress", "none"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001
            err.write("CRASH " + traceback.format_exc().splitlines()[-1])
            rc = -1
    lines = [ln for ln in err.getvalue().splitlines()
             if ln.startswith(("symmerge: error", "error", "CRASH", "Traceback"))]
    return rc, " / ".join(lines)[:240]


def compare(ours: dict, theirs: dict, base: dict) -> dict:
    names = sorted(set(ours) | set(theirs))
    missing = sorted(set(theirs) - set(ours))
    extra = sorted(set(ours) - set(theirs))
    dtypes = sorted({k for k in set(ours) & set(theirs) if ours[k].dtype != theirs[k].dtype})
    num = den = den0 = 0.0
    worst, worst_key, maxabs, nonfinite, ints_equal = 0.0, None, 0.0, [], True
    half = None
    for k in names:
        if k not in ours or k not in theirs:
            continue
        a, b = ours[k], theirs[k]
        if not b.is_floating_point():
            ints_equal &= a.dtype == b.dtype and torch.equal(a, b)
            continue
        if b.dtype in (torch.float16, torch.bfloat16):
            half = str(b.dtype).split(".")[1]
        a64, b64 = a.double(), b.double()
        fa, fb = torch.isfinite(a64), torch.isfinite(b64)
        if not (fa.all() and fb.all()):
            nonfinite.append(k)
            if not torch.equal(fa, fb) or not torch.equal(a64[~fa].nan_to_num(0), b64[~fb].nan_to_num(0)):
                worst = math.inf
                worst_key = k
            a64, b64 = a64.nan_to_num(0, 0, 0), b64.nan_to_num(0, 0, 0)
        d = (a64 - b64).abs()
        maxabs = max(maxabs, float(d.max()) if d.numel() else 0.0)
        scale = max(float(b64.abs().max()) if b64.numel() else 0.0, float(a64.abs().max()) if a64.numel() else 0.0,
                    float(base[k].double().abs().max()) if k in base and base[k].numel() else 0.0)
        rel = float(d.max()) / scale if scale > 0 else (0.0 if float(d.max()) == 0 else math.inf)
        if rel > worst:
            worst, worst_key = rel, k
        num += float(d.pow(2).sum())
        ref = b64 - (base[k].double() if k in base and base[k].shape == b.shape else 0.0)
        den += float(ref.pow(2).sum())
        den0 += float(b64.pow(2).sum())
    gap = math.sqrt(num) / math.sqrt(den) if den > 0 else (math.sqrt(num) / max(math.sqrt(den0), 1e-300))
    return {"missing": missing, "extra": extra, "dtype_differs": dtypes, "gap": gap, "max_rel": worst,
            "worst": worst_key, "max_abs": maxabs, "nonfinite": nonfinite, "ints_equal": ints_equal,
            "half": half}


def _stoch(sd: dict, base: dict) -> tuple[float, float]:
    """(share of floating entries equal to the base's, ‖sd − base‖)."""
    same = total = 0
    norm = 0.0
    for k, v in sd.items():
        if not v.is_floating_point() or k not in base or base[k].shape != v.shape:
            continue
        b = base[k].to(v.dtype)
        same += int((v == b).sum())
        total += v.numel()
        norm += float((v.double() - b.double()).pow(2).sum())
    return same / max(total, 1), math.sqrt(norm)


def run_case(label, cfg, ref, files, work: Path, expect=None) -> dict:
    import yaml

    cfg = _paths(cfg, files)
    work.mkdir(parents=True)
    path = work / "config.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.perf_counter()
    mk_err = _mergekit(cfg, work / "mergekit")
    t1 = time.perf_counter()
    rc, sm_err = _symmerge(path, work / "symmerge")
    t2 = time.perf_counter()
    row = {"case": label, "method": cfg["merge_method"], "mergekit": mk_err or "ok",
           "symmerge": "ok" if rc == 0 else f"exit {rc}: {sm_err}", "mergekit_s": round(t1 - t0, 2),
           "symmerge_s": round(t2 - t1, 2)}
    if mk_err and rc != 0:
        one_line = rc == 2 and sm_err.startswith("symmerge: error") and " / " not in sm_err
        row["verdict"] = "both refuse" if one_line else "both refuse (symmerge: not one clear line)"
        return row
    if mk_err:
        row["verdict"] = "symmerge accepts"
        if expect is not None:  # mergekit crashed: symmerge against the rule computed here
            want = expect(files)
            ours = mo.tensors(work / "symmerge")
            c = compare(ours, want, mo.tensors(files[ref]))
            row.update(c)
            ok = not c["missing"] and not c["extra"] and c["ints_equal"] and c["max_rel"] <= 1e-5
            row["verdict"] += " (= the rule computed here)" if ok else " (DIFFERS from the rule computed here)"
        else:  # at least: the integer buffers are the base's, every float finite
            ours, base = mo.tensors(work / "symmerge"), mo.tensors(files[ref])
            ints = all(torch.equal(v, base[k]) for k, v in ours.items() if not v.is_floating_point())
            finite = all(torch.isfinite(v).all() for v in ours.values() if v.is_floating_point())
            row["verdict"] += f" (int buffers = the base's: {ints}; finite: {finite})"
        return row
    if rc != 0:
        one_line = rc == 2 and sm_err.startswith("symmerge: error") and " / " not in sm_err
        row["verdict"] = "symmerge refuses" if one_line else "symmerge CRASHES"
        theirs = mo.tensors(work / "mergekit")
        bad = [k for k, v in theirs.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        row["mergekit"] = f"ok ({len(bad)} tensors with NaN/inf)" if bad else "ok (finite)"
        return row
    ours, theirs = mo.tensors(work / "symmerge"), mo.tensors(work / "mergekit")
    base = mo.tensors(files[ref])
    c = compare(ours, theirs, base)
    row.update(c)
    if cfg.get("dtype") in HALF:  # a merge computed in a half dtype: where mergekit's values are that dtype's
        half = mo.DTYPES[cfg["dtype"]]  # values, symmerge's must be too

        def held_in(t):
            return bool(torch.equal(t, t.to(half).to(t.dtype)))

        row["not_in_dtype"] = sorted(k for k, t in theirs.items() if t.is_floating_point() and k in ours
                                     and held_in(t) and not held_in(ours[k]))
    if cfg["merge_method"] in STOCHASTIC and c["max_rel"] > 1e-5:
        so, no = _stoch(ours, base)
        st, nt = _stoch(theirs, base)
        row.update(verdict="stochastic", unchanged=(round(so, 4), round(st, 4)),
                   norm_ratio=round(no / nt, 4) if nt else (1.0 if no == 0 else math.inf))
        return row
    # the rounding of the dtype the merge computes in (a config's ``dtype``) or is written in, the coarser
    bound = max(HALF.get(c["half"], 1e-5), HALF.get(cfg.get("dtype"), 1e-5))
    ok = (not c["missing"] and not c["extra"] and not c["dtype_differs"] and c["ints_equal"]
          and c["max_rel"] <= bound and not row.get("not_in_dtype"))
    row["verdict"] = "held" if ok else "DIFFERS"
    return row


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def print_table(rows) -> None:
    print("| case | verdict | mergekit | symmerge | gap | max\\|Δ\\|/max\\|t\\| | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gap = f"{r['gap']:.1e}" if "gap" in r else ""
        rel = f"{r['max_rel']:.1e}" if "max_rel" in r else ""
        note = []
        if "unchanged" in r:
            note.append(f"unchanged share {r['unchanged'][0]} / {r['unchanged'][1]}, ‖Δ‖ ratio {r['norm_ratio']}")
        if r.get("nonfinite"):
            note.append(f"{len(r['nonfinite'])} tensors non-finite in both")
        if r.get("not_in_dtype"):
            note.append(f"{len(r['not_in_dtype'])} tensors hold values outside the compute dtype")
        if r.get("max_rel", 0) > 1e-5 and r.get("worst"):
            note.append(f"worst: {r['worst']}")
        sm = r["symmerge"] if r["symmerge"] == "ok" else r["symmerge"].split("error: ", 1)[-1]
        sm = sm.split(".yml line 2: ", 1)[-1]
        print(f"| {_cell(r['case'])} | {r['verdict']} | {_cell(r['mergekit'])[:110]} | {_cell(sm)[:140]} | {gap} | "
              f"{rel} | {_cell('; '.join(note))} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="cases whose label contains this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", default=None, help="print the rows of a --json file as a markdown table")
    args = ap.parse_args(argv)
    if args.table:
        print_table(json.loads(Path(args.table).read_text())["rows"])
        return 0
    logging.disable(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            files = inputs(tmp / "in")
        todo = [c for c in cases() if not args.only or args.only in c[0]]
        print(f"{len(todo)} cases; load {open('/proc/loadavg').read().split()[:3]}", flush=True)
        for i, (label, cfg, ref) in enumerate(todo):
            row = run_case(label, cfg, ref, files, tmp / f"case{i}", EXPECT.get(label))
            rows.append(row)
            extra = ""
            if "gap" in row:
                extra = f" gap {row['gap']:.1e} max|Δ|/max|t| {row['max_rel']:.1e}"
                if row.get("nonfinite"):
                    extra += f" nonfinite {len(row['nonfinite'])}"
                if row["missing"] or row["extra"] or row["dtype_differs"] or not row["ints_equal"]:
                    extra += (f" missing {row['missing'][:2]} extra {row['extra'][:2]} "
                              f"dtype {row['dtype_differs'][:2]} ints_equal {row['ints_equal']}")
            if row.get("not_in_dtype"):
                extra += f" {len(row['not_in_dtype'])} tensors not in {cfg['dtype']}"
            if "unchanged" in row:
                extra += f" unchanged {row['unchanged']} norm ratio {row['norm_ratio']}"
            print(f"| {label} | {row['verdict']} | mergekit: {row['mergekit']} | symmerge: {row['symmerge']} |"
                  f"{extra}", flush=True)
    took = time.perf_counter() - start
    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print(f"{len(rows)} cases in {took:.0f} s; load {open('/proc/loadavg').read().split()[:3]}; {counts}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "seconds": round(took, 1), "counts": counts},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
