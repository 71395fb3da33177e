"""Every entry gives one result: ``symmerge merge`` (flags), ``symmerge run`` with a config of symmerge's own keys,
``symmerge run`` with a mergekit config, and the Python API (``symmerge.merge(models, out, options)``,
``symmerge.merge_models``), compared on the same merge.

For every registered method that merges without data (``symmerge merge --help``'s list, the registry) and each of
its parameters at its default and at one or two other values (per-model lists too), each entry that can express the
case runs it on tiny random checkpoints (``tests/factories.py``: Llama and GPT-2, saved in float32 and bfloat16; a
base and two fine-tunes = base + N(0, 0.01²), each with a WordPiece tokenizer). The commands run in child processes
forked from a fork server that imported torch and symmerge and ran nothing, each running ``symmerge.cli.main`` (its
parsing, checks, one-line errors and exit code; ``--exec``: the installed ``symmerge`` script instead), one thread
each; the library runs in this process. Compared:

* the output tensors, name by name, bit for bit (dtype, shape and bytes);
* ``config.json`` and the side files (tokenizer files, generation config), byte for byte as JSON;
* ``symmerge_report.json`` field by field, leaving out what names the run itself (``timings``, the command line, a
  config run's ``config`` entry, the threads' seconds, the read-ahead's peak); the differences judged right
  (:data:`BY_DESIGN`) are named apart;
* for bad values (out of range, wrong type, unknown parameter, a parameter the method does not take, NaN, a weight
  list of the wrong length, a missing required parameter): each entry's exit code (the API: the exception) and its
  error line, with a config's ``FILE line N: parameters.KEY:`` prefix taken off.

Where an entry cannot express a case, the row says "not expressible" and why. The "tokenizer source" cases tell the
base's ``tokenizer_config.json`` apart from the fine-tunes', so that which model's tokenizer an entry copies shows.
Results: docs/results/entryeq_audit.md.

    .venv/bin/python benchmarks/entryeq_audit.py [--only TEXT] [--quick] [--no-bad] [--exec] [--json FILE]
    .venv/bin/python benchmarks/entryeq_audit.py --table FILE.json

``--quick``: Llama float32 only. Prints one row per case: case, entries compared, held?, first
difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import yaml  # noqa: E402

torch.set_num_threads(1)

ENTRIES = ("cli", "own", "mk", "api", "api_models")
# report fields that name the entry itself, not the merge
VOLATILE = ("timings", "config", "command", "command_line", "output", "out", "symmerge_version", "created")
# measurements of the run itself, not of the merge (seconds, how far the reader got ahead of the writer)
VOLATILE_FIELDS = ("stream.seconds", "stream.read_ahead_peak_bytes")


# ---------------------------------------------------------------------------------------------------- the models

def _words(n: int) -> list[str]:
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(n - 5)]


def make_models(root: Path, family: str, dtype: torch.dtype, marked: bool = False) -> dict:
    """A base and two fine-tunes of ``family`` saved in ``dtype`` under ``root``, each with a tokenizer (``marked``:
    the base's ``tokenizer_config.json`` set apart from the fine-tunes' by its ``model_max_length``)."""
    from factories import make_model
    from transformers import BertTokenizer

    base = make_model(family, head=True, dtype=torch.float32, seed=0)
    sd = base.state_dict()
    vocab = base.config.vocab_size
    out = {}
    for i, name in enumerate(("B", "M1", "M2")):
        g = torch.Generator().manual_seed(100 + i)
        model = make_model(family, head=True, dtype=torch.float32, seed=0)
        if i:
            model.load_state_dict({k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                                   for k, v in sd.items()})
        folder = root / f"{family}-{str(dtype)[6:]}{'-marked' if marked else ''}" / name
        model.to(dtype).save_pretrained(folder)
        words = root / f"{name}-vocab.txt"
        words.write_text("\n".join(_words(vocab)) + "\n")
        BertTokenizer(vocab_file=str(words)).save_pretrained(str(folder))
        words.unlink()
        cfg = folder / "tokenizer_config.json"
        data = json.loads(cfg.read_text())
        data["model_max_length"] = 512 if name == "B" and marked else 256  # whose tokenizer was copied shows
        cfg.write_text(json.dumps(data, indent=2))
        out[name] = str(folder)
    return out


# ---------------------------------------------------------------------------------------------------- the cases

def _methods():
    from symmerge.merge import METHODS

    return METHODS


def _values(method) -> list[tuple[str, dict]]:
    """(label, params) of a method: its defaults, then one or two other values per parameter."""
    other = {
        "density": [0.5], "gamma": [0.05], "epsilon": [0.05], "scale": [0.7], "lambda": [0.7], "normalize": [False],
        "rescale": [False, "inverse"], "scope": ["model", "tensor"], "seed": [3], "drop": [0.3], "int8_mask": [True],
        "select_topk": [0.5], "filter_wise": [True], "t": [0.3], "nuslerp_flatten": [False],
        "nuslerp_row_wise": [True], "normalize_weights": [False], "eps": [1e-3], "max_iter": [3], "tol": [1e-2],
        "r": [0.3], "alpha": [0.5], "reg": [0.1], "cross_heads": [False],
    }
    out = []
    names = [*method.params, *method.aliases]
    required = {k for k, v in method.params.items() if repr(v) == "REQUIRED"}
    for k in names:
        for v in other.get(k, []):
            if k in required:
                continue
            p = {r: 0.5 for r in required}
            p[k] = v
            if method.name == "nuslerp" and k == "nuslerp_row_wise":
                p["nuslerp_flatten"] = False  # row_wise needs flatten off
            out.append((f"{k}={v}", p))
    defaults = {r: 0.5 for r in required}
    if "units" in method.params:  # OT fusion: RoPE attention is not transported (one refusal alike everywhere)
        rope = {"units": "ffn,residual"}
        return [("defaults", defaults), ("units=ffn,residual", rope),
                *((f"units=ffn,residual {label}", {**rope, **p}) for label, p in out)]
    if "t" in required:
        out.append(("t=0.2", {"t": 0.2}))
    return [("defaults", defaults), *out]


def _layout(method, base_kind: str, m) -> tuple[list[str], str | None]:
    """(merged models, base or None) for ``method``."""
    lo, hi = method.models
    if hi == 1:
        models = [m["M1"]]
    else:
        models = [m["M1"], m["M2"]]
    if method.needs_base or (method.accepts_base and base_kind == "with base"):
        return models, m["B"]
    return models, None


def cases(quick: bool, only: str | None) -> list[dict]:
    from symmerge.merge import METHODS

    out = []
    combos = [("llama", torch.float32)] if quick else [("llama", torch.float32), ("llama", torch.bfloat16),
                                                       ("gpt2", torch.float32), ("gpt2", torch.bfloat16)]
    for family, dtype in combos:
        full = family == "llama" and dtype == torch.float32
        for name in sorted(METHODS):
            method = METHODS[name]
            if method.needs is not None:  # statistics on --data: not a mergekit method, run on real data elsewhere
                continue
            for base_kind in (["with base", "no base"] if method.accepts_base else ["-"]):
                values = _values(method) if full else _values(method)[:1]
                for label, params in values:
                    weights_cases = [None]
                    if full and label == "defaults" and method.models[1] != 1:
                        weights_cases.append([0.6, 0.4])
                    for weights in weights_cases:
                        c = dict(method=name, family=family, dtype=str(dtype)[6:], base_kind=base_kind,
                                 label=label, params=params, weights=weights)
                        out.append(c)
                if full:  # per-model lists
                    for k in method.per_model:
                        if method.models[1] == 1:
                            continue
                        per = {"density": [0.7, 0.4], "gamma": [0.02, 0.05], "epsilon": [0.05, 0.1],
                               "drop": [0.2, 0.5]}.get(k)
                        if per is None:
                            continue
                        out.append(dict(method=name, family=family, dtype=str(dtype)[6:], base_kind=base_kind,
                                        label=f"{k}={per} (per model)", params={k: per}, weights=None,
                                        per_model=k))
    for name, params in (("ties", {}), ("linear", {}), ("slerp", {"t": 0.5}), ("passthrough", {})):
        # whose tokenizer (and side files) the output carries: the base's tokenizer_config told apart
        out.append(dict(method=name, family="llama", dtype="float32", base_kind="-", label="tokenizer source",
                        params=params, weights=None, marked=True))
    if only:
        out = [c for c in out if only in _case_name(c)]
    return out


def _case_name(c) -> str:
    w = "" if c.get("weights") is None else f" w={c['weights']}"
    b = "" if c["base_kind"] == "-" else f" [{c['base_kind']}]"
    return f"{c['family']}/{c['dtype']} {c['method']}{b} {c['label']}{w}"


# ---------------------------------------------------------------------------------------------------- the entries

def _symmerge():
    return str(Path(sys.executable).with_name("symmerge"))


EXEC = {"on": False}  # --exec: every command a new ``symmerge`` process (exec'd); else forked from this one


def _child(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``symmerge ARGV`` in a child process: its exit code and stderr. With ``--exec`` the installed ``symmerge``
    script; else a child forked from a fork server (torch and symmerge imported once, nothing run) that runs the
    command's own ``symmerge.cli.main`` — the same parsing, checks, error lines and exit code, without the 1-2 s of
    imports each."""
    if EXEC["on"]:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        p = subprocess.run([_symmerge(), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        return p.returncode, p.stderr
    err = cwd / ".stderr"
    p = _server().Process(target=_forked_main, args=(list(argv), str(cwd), str(err)))
    p.start()
    p.join(600)
    if p.exitcode is None:
        p.kill()
        p.join()
        return 124, "timed out"
    return p.exitcode, err.read_text() if err.exists() else ""


_SERVER = {}


def _server():
    """A multiprocessing fork server that has imported torch and the command (and run nothing: no thread of a merge
    is alive in it when it forks a command)."""
    if "ctx" not in _SERVER:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "transformers", "safetensors.torch", "symmerge.cli",
                                    "symmerge.commands.merge", "symmerge.commands.run", "symmerge.merge.fuse"])
        _SERVER["ctx"] = ctx
    return _SERVER["ctx"]


def _forked_main(argv, cwd, err):
    os.chdir(cwd)
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    rc = 99
    try:
        torch.set_num_threads(1)
        from symmerge.cli import main as cli_main

        rc = cli_main(argv)
    except SystemExit as e:  # argparse's refusals exit (2), as the installed script does
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a traceback is an outcome to see
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _scalar(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def run_cli(c, models, base, out: Path, work: Path):
    argv = ["merge", *models, "--method", c["method"], "--align", "none", "-o", str(out), "--progress", "none"]
    if base is not None:
        argv += ["--base", base]
    if c.get("weights_text") is not None:
        argv += ["--weights", c["weights_text"]]
    elif c["weights"] is not None:
        argv += ["--weights", ",".join(repr(float(w)) for w in c["weights"])]
    for k, v in c["params"].items():
        if isinstance(v, list):  # one value per model (before 3a3c978: not expressible, one value only)
            v = ",".join(str(x) for x in v)
        v = ("true" if v else "false") if isinstance(v, bool) else v
        argv += ["--param", f"{k}={v}"]
    return _child(argv, work)


def run_own(c, models, base, out: Path, work: Path):
    cfg = {"method": c["method"], "align": "none", "progress": "none"}
    weights = c["weights"]
    if c.get("weights_text") is not None:
        return None, "not expressible: a weight list of another length is models' count (one weight per model)"
    cfg["models"] = [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, weights)] if weights \
        else list(models)
    if base is not None:
        cfg["base_model"] = base
    if c["params"]:
        cfg["parameters"] = {k: _scalar(v) for k, v in c["params"].items()}
    path = work / f"{out.name}.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return _child(["run", str(path), str(out)], work)


def run_mk(c, models, base, out: Path, work: Path):
    from symmerge.merge import MERGEKIT_METHODS, METHODS

    method = METHODS[c["method"]]
    if c["method"] not in MERGEKIT_METHODS and c["method"] not in {n for m in MERGEKIT_METHODS
                                                                  for n in METHODS[m].other_names}:
        return None, "not expressible: not a mergekit method"
    if c.get("weights_text") is not None:
        return None, "not expressible: a weight list of another length is models' count (one weight per model)"
    weights = c["weights"]
    if weights is None and method.weight_required:
        weights = [1.0] * len(models)  # mergekit has no default weight; 1.0 each is the others' default
        c.setdefault("mk_note", "weight 1.0 each given (mergekit requires one)")
    entries = []
    for i, m in enumerate(models):
        p = {}
        if weights is not None:
            p["weight"] = weights[i]
        for k, v in c["params"].items():
            if isinstance(v, list):
                p[k] = v[i]
        entries.append({"model": m, **({"parameters": p} if p else {})})
    cfg = {"merge_method": c["method"], "models": entries}
    if base is not None:
        cfg["base_model"] = base
    glob = {k: _scalar(v) for k, v in c["params"].items() if not isinstance(v, list)}
    if glob:
        cfg["parameters"] = glob
    path = work / f"{out.name}.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return _child(["run", str(path), str(out), "--quiet"], work)


def _options(c, base):
    from symmerge.merge.fuse import MergeOptions

    weights = c["weights"]
    if c.get("weights_text") is not None:
        weights = [float(x) for x in c["weights_text"].split(",")]
    return MergeOptions(method=c["method"], base=base, params=dict(c["params"]), weights=weights, align="none",
                        progress=False)


def _api_call(fn):
    try:
        fn()
        return 0, ""
    except Exception as e:  # noqa: BLE001 - the refusal is what is compared
        return 2, f"{type(e).__name__}: {' '.join(str(e).split())}"


def run_api(c, models, base, out: Path, work: Path):
    import symmerge

    return _api_call(lambda: symmerge.merge(list(models), str(out), _options(c, base)))


def run_api_models(c, models, base, out: Path, work: Path):
    """merge_models: the model in memory, its state dict saved as tensors to compare (no folder is written)."""
    from safetensors.torch import save_file

    from symmerge.merge.fuse import merge_models

    def go():
        model, report = merge_models(list(models), options=_options(c, base))
        out.mkdir(parents=True)
        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        seen, unique = set(), {}
        for k, v in sd.items():  # tied tensors once, as save_pretrained writes them
            if v.data_ptr() in seen:
                continue
            seen.add(v.data_ptr())
            unique[k] = v
        save_file(unique, str(out / "model.safetensors"))
        (out / "symmerge_report.json").write_text(json.dumps(report, default=str))

    return _api_call(go)


RUNNERS = {"cli": run_cli, "own": run_own, "mk": run_mk, "api": run_api, "api_models": run_api_models}


# ---------------------------------------------------------------------------------------------------- comparing

def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tensor_difference(a: dict, b: dict) -> str | None:
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))
        return f"tensor names differ: {only[:2]}"
    for k in sorted(a):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        if _bits(x) != _bits(y):
            d = (x.double() - y.double()).abs().max().item()
            return f"{k}: max |Δ| {d:.3g}"
    return None


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list):
        if not obj:
            yield prefix, []
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def report_difference(a: dict, b: dict, outs: tuple) -> str | None:
    """The report fields (dotted paths, lists' indices left out) whose values differ, ``; ``-joined (None: none)."""
    import re

    def clean(r, out):
        r = {k: v for k, v in r.items() if k not in VOLATILE}
        flat = dict(_flat(r))
        return {k: (str(v).replace(str(out), "OUT") if isinstance(v, str) else v) for k, v in flat.items()
                if not k.startswith(VOLATILE_FIELDS)}

    fa, fb = clean(a, outs[0]), clean(b, outs[1])
    fields = []
    for k in sorted(set(fa) | set(fb)):
        x, y = fa.get(k, "<absent>"), fb.get(k, "<absent>")
        if x != y and not (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
            field = re.sub(r"\[\d+\]", "", k)
            field = ".".join(field.split(".")[:2]) if not field.startswith("distance") else field.split(".")[0]
            if field not in fields:
                fields.append(field)
    return "report " + ", ".join(fields) if fields else None


# report fields that differ by design between an entry and the command line, with the reason (docs/configs.md,
# docs/results/entryeq_audit.md); every other difference is a defect
BY_DESIGN = {
    "mk": {"head.": "a mergekit config merges every tensor as its steps say: head entry is that note",
           "plan.why": "says why the plan streams (a config's steps)",
           "tokenizer": "a mergekit config runs no tokenizer check (as mergekit)"},
    "api_models": {"mode": "merge_models runs in memory and writes nothing", "plan.mode": "in memory",
                   "plan.why": "in memory", "side_files": "writes no folder", "stream.": "not streamed",
                   "distance": "in memory: summed in another order (last digits)"},
}


def by_design(entry: str, field: str) -> str | None:
    return next((why for prefix, why in BY_DESIGN.get(entry, {}).items() if field.startswith(prefix)), None)


SIDE_SKIP = {"README.md", "symmerge_report.json", "symmerge_config.yml", "mergekit_config.yml"}


def side_difference(a: Path, b: Path) -> str | None:
    def files(folder):
        return {p.name for p in folder.iterdir() if p.is_file() and p.name not in SIDE_SKIP
                and not p.name.endswith(".safetensors") and not p.name.endswith(".safetensors.index.json")}

    fa, fb = files(a), files(b)
    if fa != fb:
        return f"side files differ: {sorted(fa ^ fb)}"
    for name in sorted(fa):
        x, y = (a / name).read_bytes(), (b / name).read_bytes()
        if name.endswith(".json"):
            jx, jy = json.loads(x), json.loads(y)
            if jx != jy:
                k = next(k for k in sorted(set(jx) | set(jy)) if jx.get(k) != jy.get(k))
                return f"{name} {k}: {jx.get(k)!r} vs {jy.get(k)!r}"
        elif x != y:
            return f"{name} differs"
    return None


def error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "error" in ln]
    return lines[-1].strip() if lines else (stderr.strip().splitlines() or [""])[-1]


def normalized(line: str) -> str:
    """An error line without the entry's own words: the program's prefix, a config's ``FILE line N:`` and the API's
    exception name."""
    import re

    line = re.sub(r"^symmerge( merge| run)?: error: ", "", line)
    line = re.sub(r"^[A-Za-z]*Error: ", "", line)
    line = re.sub(r"^\S+\.yml line \d+: ", "", line)
    line = re.sub(r"^(models\[\d+\]\.)?parameters\.\w+: ", "", line)  # the config's key, named before the words
    line = re.sub(r"^[\w.]+\.(weight|bias): ", "", line)  # a tensor a value was checked on
    return line.strip()


# ---------------------------------------------------------------------------------------------------- running

def run_case(c, models_by_combo, work: Path, entries=ENTRIES) -> dict:
    m = models_by_combo[(c["family"], c["dtype"], bool(c.get("marked")))]
    method = _methods()[c["method"]]
    models, base = _layout(method, c["base_kind"], m)
    results = {}
    for e in entries:
        if e == "api_models" and (c["label"] != "defaults" and not c.get("bad")):
            continue
        out = work / f"{e}"
        shutil.rmtree(out, ignore_errors=True)
        rc, text = RUNNERS[e](c, models, base, out, work)
        results[e] = {"rc": rc, "text": text, "out": out}
    row = {"case": _case_name(c), **{k: c[k] for k in ("method", "family", "dtype", "label")}}
    ran = {e: r for e, r in results.items() if r["rc"] is not None}
    row["not_expressible"] = {e: r["text"] for e, r in results.items() if r["rc"] is None}
    row["rc"] = {e: r["rc"] for e, r in ran.items()}
    row["errors"] = {e: error_line(r["text"]) for e, r in ran.items() if r["rc"] != 0}
    if c.get("mk_note"):
        row["note"] = c["mk_note"]
    diffs = []
    ok = [e for e, r in ran.items() if r["rc"] == 0]
    if c.get("bad"):
        def accepted(text):
            warned = [ln for ln in text.splitlines() if "warning:" in ln]
            return "(accepted" + (f"; {warned[0].split('warning: ', 1)[1]}" if warned else "") + ")"

        lines = {e: normalized(error_line(r["text"])) if r["rc"] else accepted(r["text"]) for e, r in ran.items()}
        raw = {e: error_line(r["text"]) if r["rc"] else accepted(r["text"]) for e, r in ran.items()}
        row["lines"] = lines
        first = next(iter(lines.values()), None)
        for e, ln in lines.items():
            if ln != first:
                diffs.append(f"{e}: {ln!r} vs {next(iter(lines))}: {first!r}")
                break
        names = [k for k in c["params"]] or ["weights"]
        row["names_option"] = all(any(n in ln or (n == "weights" and "weight" in ln) for n in names)
                                  for e, ln in raw.items() if ran[e]["rc"])
        row["all_refuse"] = all(r["rc"] for r in ran.values())
        row["held"] = not diffs
    else:
        failed = [e for e, r in ran.items() if r["rc"] != 0]
        refusals = {normalized(row["errors"][e]) for e in failed}
        if failed and len(failed) == len(ran) and len(refusals) == 1:  # every entry refuses alike
            row.update(held=True, compared=list(ran), differences=[], refused=row["errors"][failed[0]])
            return row
        if failed:
            diffs.append(f"{failed[0]} failed: {row['errors'][failed[0]]}")
        ref = ok[0] if ok else None
        row["tensors"], row["side"], row["report"] = {}, {}, {}
        for e in ok[1:]:
            a, b = results[ref]["out"], results[e]["out"]
            row["tensors"][e] = tensor_difference(tensors(a), tensors(b))
            if e != "api_models":
                row["side"][e] = side_difference(a, b)
            ra = json.loads((a / "symmerge_report.json").read_text())
            rb = json.loads((b / "symmerge_report.json").read_text())
            row["report"][e] = report_difference(ra, rb, (a, b))
            report_fields = (row["report"][e] or "report ")[len("report "):].split(", ") if row["report"][e] else []
            designed = [f for f in report_fields if by_design(e, f)
                        or (e == "mk" and f == "weights" and c.get("mk_note"))]  # 1.0 each given, the others: none
            row.setdefault("by_design", {})[e] = designed
            rest = [f for f in report_fields if f not in designed]
            side = row["side"].get(e)
            if side and e == "mk" and side.startswith("tokenizer_config.json"):
                row["by_design"][e] = designed + ["tokenizer source (base's, as mergekit)"]
                side = None
            diffs += [f"{e} vs {ref}: {d}" for d in (row["tensors"][e], side, "report " + ", ".join(rest) if rest
                                                      else None) if d]
        row["tensors_held"] = len(ok) > 1 and not failed and not any(row["tensors"].values())
        row["held"] = not diffs and len(ok) > 1
    row["compared"] = list(ran)
    row["differences"] = diffs
    for r in results.values():
        shutil.rmtree(r["out"], ignore_errors=True)
    return row


# the bad values: (method, label, params, weights text or None); every entry that can express it
BAD = [
    ("ties", "density out of range", {"density": 1.5}, None),
    ("ties", "density wrong type", {"density": "abc"}, None),
    ("ties", "density NaN", {"density": float("nan")}, None),
    ("ties", "unknown parameter", {"densty": 0.5}, None),
    ("ties", "parameter of another method (t)", {"t": 0.5}, None),
    ("ties", "scope not a choice", {"scope": "layer"}, None),
    ("ties", "normalize not a bool", {"normalize": "maybe"}, None),
    ("ties", "weights of the wrong length", {}, "0.5"),
    ("ties", "weights of the wrong length (3)", {}, "0.5,0.3,0.2"),
    ("ties", "weights NaN", {}, "nan,0.5"),
    ("ties", "lambda and scale both", {"lambda": 0.5, "scale": 0.5}, None),
    ("slerp", "t missing", {}, None),
    ("slerp", "t NaN", {"t": float("nan")}, None),
    ("slerp", "t wrong type", {"t": "half"}, None),
    ("linear", "normalize wrong type", {"normalize": "maybe"}, None),
    ("linear", "weights sum to 0", {}, "1,-1"),
    ("karcher", "max_iter negative", {"max_iter": -1}, None),
    ("karcher", "max_iter not whole", {"max_iter": 2.5}, None),
    ("karcher", "tol negative", {"tol": -1}, None),
    ("della", "density+epsilon above 1", {"density": 0.9, "epsilon": 0.2}, None),
    ("dare_ties", "drop out of range", {"drop": 1.5}, None),
    ("dare_ties", "density and drop both", {"density": 0.5, "drop": 0.5}, None),
    ("dare_ties", "seed not whole", {"seed": 1.5}, None),
    ("task_arithmetic", "lambda infinite", {"lambda": float("inf")}, None),
    ("sce", "select_topk negative", {"select_topk": -0.1}, None),
    ("average", "negative weight", {}, "-1,2"),
    ("average", "parameter it does not take", {"density": 0.5}, None),
    ("ram", "epsilon negative", {"epsilon": -1}, None),
    ("ot_wts", "reg negative", {"reg": -1}, None),
    ("ot_wts", "units unknown", {"units": "bogus"}, None),
]


def bad_cases(only):
    out = []
    for method, label, params, wtext in BAD:
        c = dict(method=method, family="llama", dtype="float32", base_kind="-" if not _methods()[method].accepts_base
                 else "with base", label=f"BAD {label}", params=params, weights=None, weights_text=wtext, bad=True)
        if not only or only in _case_name(c):
            out.append(c)
    return out


def _cell(row) -> str:
    """A row's verdict and its first difference, for the markdown table."""
    if row.get("refused"):
        return f"held: every entry refuses alike (`{normalized(row['refused'])[:90]}`)"
    if row["label"].startswith("BAD"):
        lines = row.get("lines", {})
        mk = lines.get("mk", "")
        if row["held"]:
            return f"held: `{next(iter(lines.values()), '')[:110]}`"
        if "ignored, as mergekit ignores it" in mk:
            return "by design: a mergekit config warns and ignores it (as mergekit); the others refuse"
        verdict = "each names the option" if row.get("names_option") else "DIFFERS"
        return f"{verdict}: " + "; ".join(f"{e}: `{ln[:80]}`" for e, ln in lines.items() if e in ("cli", "mk"))
    if row["held"]:
        designed = sorted({f for fs in row.get("by_design", {}).values() for f in fs})
        return "held" + (f" (by design: {', '.join(designed)})" if designed else "")
    if row.get("tensors_held"):
        return "tensors held; " + "; ".join(row["differences"])[:200]
    return "DIFFERS: " + "; ".join(row["differences"])[:200]


def table(path: str) -> str:
    """A run's rows (``--json``) as a markdown table."""
    data = json.loads(Path(path).read_text())
    out = ["| # | case | entries compared | not expressible | held? / first difference |", "|---|---|---|---|---|"]
    for i, row in enumerate(data["rows"]):
        ne = "; ".join(f"{e}: {why.removeprefix('not expressible: ')}" for e, why in row["not_expressible"].items())
        out.append(f"| {i + 1} | {row['case']} | {', '.join(row['compared'])} | {ne or '–'} | {_cell(row)} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="only the cases whose name holds TEXT")
    ap.add_argument("--quick", action="store_true", help="Llama float32 only")
    ap.add_argument("--no-bad", action="store_true", help="leave the bad values out")
    ap.add_argument("--exec", action="store_true", help="run every command as a new symmerge process (slower)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--table", metavar="FILE", help="print the rows of a --json FILE as a markdown table")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    EXEC["on"] = args.exec
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="entryeq-") as tmp:
        root = Path(tmp)
        todo = cases(args.quick, args.only) + ([] if args.no_bad else bad_cases(args.only))
        combos = sorted({(c["family"], c["dtype"], bool(c.get("marked"))) for c in todo})
        models = {(f, d, k): make_models(root / "models", f, getattr(torch, d), k) for f, d, k in combos}
        work = root / "work"
        work.mkdir()
        rows = []
        for i, c in enumerate(todo):
            row = run_case(c, models, work)
            rows.append(row)
            mark = "held" if row["held"] else ("tensors held" if row.get("tensors_held") else "DIFFERS")
            ignored = c.get("bad") and all(ln == first_line or (e == "mk" and "ignored, as mergekit ignores it" in ln)
                                           for e, ln in row["lines"].items()
                                           for first_line in [row["lines"].get("cli")])
            if c.get("bad") and not row["held"] and ignored:
                mark = "held (by design: mk warns and ignores it, as mergekit)"
            elif c.get("bad") and not row["held"]:
                mark = ("all refuse, each naming the option" if row["all_refuse"] and row["names_option"] else
                        "all refuse" if row["all_refuse"] else "DIFFERS")
            if row["held"] and any(row.get("by_design", {}).values()):
                mark = "held (by design: " + ", ".join(e for e, f in row["by_design"].items() if f) + ")"
            cmp = ",".join(row["compared"]) + ("" if not row["not_expressible"] else
                                               " (n/e: " + ",".join(row["not_expressible"]) + ")")
            first = "; ".join(row["differences"])[:400] or row.get("refused", "")
            if c.get("bad"):
                first = first or "; ".join(f"{e}: {ln}" for e, ln in list(row["lines"].items())[:1])
            print(f"{i + 1:4d} | {row['case']} | {cmp} | {mark} | {first}", flush=True)
    seconds = time.perf_counter() - started
    held = sum(r["held"] for r in rows)
    print(f"{held}/{len(rows)} held; {seconds:.0f} s; load {open('/proc/loadavg').read().split()[:3]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": seconds, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
