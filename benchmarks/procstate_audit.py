"""symmerge as a library inside a caller's process: what each call leaves changed, and what an earlier call
changes in a later one (docs/results/procstate_audit.md).

Every case runs ``symmerge.cli.main([...])`` (align, merge in memory and streamed, barrier, run, extract-lora, moe)
or a Python entry (``align``, ``align_pair``, ``merge_models``, ``merge``, ``align_to_folder``) on tiny
random-config checkpoints (hidden <= 64), between two snapshots of the process state: torch's threads, default
dtype, deterministic algorithms, grad mode, backends' flags, the global RNGs of torch, numpy and ``random`` (the
state *and* whether the caller's next draw is the one it would have been), ``os.environ``, the working folder,
``sys.path``, signal handlers, ``warnings`` filters and ``showwarning``, logging levels and handlers (root,
transformers), ``sys.stdout``/``stderr``, open file descriptors, threads, temporary folders, the caller's models
(parameters, buffers, ``requires_grad``, ``training``, device, dtype, config). Then every case 5x: the same output
bytes each time, RSS after gc; an error between two runs, and ``-q`` before a ``--progress lines`` run.

    .venv/bin/python benchmarks/procstate_audit.py [--json OUT.json] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import io
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mergekit_oracle as mk  # noqa: E402
from factories import make_model  # noqa: E402


# ------------------------------------------------------------------ the snapshot


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _loggers() -> dict:
    out = {}
    for name in ("", "transformers", "symmerge", "torch", "huggingface_hub", "urllib3"):
        logger = logging.getLogger(name)
        out[name or "root"] = (logger.level, logger.disabled, logger.propagate,
                               tuple(type(h).__name__ + ":" + str(id(h)) for h in logger.handlers))
    return out


def _model_state(model) -> dict:
    return {"params": {n: (_digest(p.detach().cpu().numpy().tobytes()), p.requires_grad, str(p.device), str(p.dtype),
                           id(p)) for n, p in model.named_parameters()},
            "buffers": {n: (_digest(b.detach().cpu().numpy().tobytes()), str(b.dtype))
                        for n, b in model.named_buffers()},
            "training": tuple(m.training for m in model.modules()),
            "config": _digest(model.config.to_json_string().encode())}


def _temp_entries() -> set:
    """The entries of the temporary folder, the audit's own inputs and outputs left out (:func:`main` gives the
    process a private one: the machine's /tmp is shared with other processes making and removing folders)."""
    root = Path(tempfile.gettempdir())
    try:
        return {p.name for p in root.iterdir() if not p.name.startswith("procstate-")}
    except OSError:
        return set()


def snapshot(models=()) -> dict:
    """Everything a call could leave changed in its caller's process. The RNGs are compared by their state, which a
    draw of the caller's would consume: taken without drawing."""
    import transformers

    fds = sorted(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else []
    fd_targets = {}
    for fd in fds:
        with contextlib.suppress(OSError):
            fd_targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return {
        "torch.num_threads": torch.get_num_threads(),
        "torch.num_interop_threads": torch.get_num_interop_threads(),
        "torch.default_dtype": str(torch.get_default_dtype()),
        "torch.deterministic": (torch.are_deterministic_algorithms_enabled(),
                                torch.is_deterministic_algorithms_warn_only_enabled()),
        "torch.grad_enabled": torch.is_grad_enabled(),
        "torch.inference_mode": torch.is_inference_mode_enabled(),
        "torch.rng": _digest(torch.get_rng_state().numpy().tobytes()),
        "torch.initial_seed": torch.initial_seed(),
        "torch.backends": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
                           torch.backends.cudnn.enabled, torch.backends.cuda.matmul.allow_tf32,
                           torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
                           torch.backends.mkldnn.enabled),
        "torch.anomaly": torch.is_anomaly_enabled(),
        "numpy.rng": _digest(repr(np.random.get_state()).encode()),
        "numpy.errstate": tuple(sorted(np.geterr().items())),
        "random.rng": _digest(repr(random.getstate()).encode()),
        "os.environ": dict(os.environ),
        "cwd": os.getcwd(),
        "sys.path": list(sys.path),
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)},
        "warnings.filters": [repr(f) for f in warnings.filters],
        "warnings.showwarning": repr(warnings.showwarning),
        "logging": _loggers(),
        "logging.disable": logging.root.manager.disable,
        "transformers.verbosity": transformers.logging.get_verbosity(),
        "transformers.progress_bar": transformers.utils.logging.is_progress_bar_enabled(),
        "sys.stdout/stderr": (id(sys.stdout), id(sys.stderr)),
        "sys.excepthook": repr(sys.excepthook),
        "gc": (gc.isenabled(), gc.get_threshold()),
        "fds": fd_targets,
        "threads": sorted(t.name for t in threading.enumerate()),
        "tempdir": sorted(_temp_entries()),
        "models": [_model_state(m) for m in models],
    }


def diff(before: dict, after: dict) -> list[str]:
    """The keys that changed, each with a short description of how."""
    out = []
    for key in before:
        a, b = before[key], after[key]
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and key != "models":
            added = sorted(set(b) - set(a))
            removed = sorted(set(a) - set(b))
            changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
            parts = []
            if added:
                parts.append("+" + ",".join(f"{k}={b[k]}" if key != "fds" else f"{k}->{b[k]}" for k in added))
            if removed:
                parts.append("-" + ",".join(str(k) for k in removed))
            if changed:
                parts.append("~" + ",".join(f"{k}: {a[k]} -> {b[k]}" for k in changed))
            out.append(f"{key}: {' '.join(parts)}")
        elif key == "tempdir":
            out.append(f"{key}: +{sorted(set(b) - set(a))} -{sorted(set(a) - set(b))}")
        elif key == "threads":
            out.append(f"{key}: {a} -> {b}")
        elif key == "models":
            out.append("models: changed")
        else:
            out.append(f"{key}: {a} -> {b}")
    return out


def next_draws() -> tuple:
    """The caller's next draws from each global RNG (consumes them: used on a state saved and put back)."""
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def folder_digest(folder: Path) -> str:
    """The bytes of the weights and the report of an output (the report's timings and paths left out)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file() and p.suffix in (".safetensors", ".bin"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
        elif p.is_file() and p.name == "barrier.json":
            data = json.loads(p.read_text())
            h.update(json.dumps({k: data.get(k) for k in ("alphas", "unaligned", "aligned")}, sort_keys=True,
                                default=str).encode())
    return h.hexdigest()[:12]


# ------------------------------------------------------------------ the inputs


def _vit(path: Path, seed: int) -> Path:
    from transformers import ViTConfig, ViTForImageClassification

    g = torch.Generator().manual_seed(seed)
    model = ViTForImageClassification(ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                intermediate_size=24, image_size=8, patch_size=4, num_channels=1,
                                                num_labels=3, initializer_range=0.4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(path))
    return path


def _llama(path: Path, seed: int, base: Path | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    if base is None:
        model = AutoModelForCausalLM.from_config(mk._config("llama", 2, hidden=32), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(0.1 * torch.randn(p.shape, generator=g) + (1.0 if p.dim() == 1 else 0.0))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(base))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(path))
    mk.save_tokenizer(path)
    return path


def inputs(root: Path) -> dict:
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    d = {"vit_a": _vit(root / "vit_a", 1), "vit_b": _vit(root / "vit_b", 2)}
    rng = np.random.default_rng(0)
    d["npz"] = root / "data.npz"
    np.savez(d["npz"], pixel_values=rng.standard_normal((24, 1, 8, 8)).astype(np.float32),
             labels=rng.integers(0, 3, 24))
    d["base"] = _llama(root / "base", 10)
    d["ft1"] = _llama(root / "ft1", 11, base=d["base"])
    d["ft2"] = _llama(root / "ft2", 12, base=d["base"])
    d["run_yml"] = root / "run.yml"
    d["run_yml"].write_text(yaml.safe_dump({"models": [{"model": str(d["ft1"]), "parameters": {"density": 0.5,
                                                                                               "weight": 0.5}},
                                                       {"model": str(d["ft2"]), "parameters": {"density": 0.5,
                                                                                               "weight": 0.5}}],
                                            "merge_method": "dare_ties", "base_model": str(d["base"]),
                                            "dtype": "float32"}))
    d["moe_yml"] = root / "moe.yml"
    d["moe_yml"].write_text(yaml.safe_dump({"base_model": str(d["base"]), "gate_mode": "random", "dtype": "float32",
                                            "experts": [{"source_model": str(d["ft1"]), "positive_prompts": ["w5"]},
                                                        {"source_model": str(d["ft2"]), "positive_prompts": ["w9"]}]}))
    return d


def cli_cases(d: dict) -> dict:
    """name -> (argv without the output, the output's flag form): ``OUT`` is replaced by a fresh folder."""
    return {
        "align": ["align", d["vit_a"], d["vit_b"], "-o", "OUT"],
        "align --stream": ["align", d["vit_a"], d["vit_b"], "-o", "OUT", "--stream"],
        "align --match learned": ["align", d["vit_a"], d["vit_b"], "-o", "OUT", "--match", "learned", "--align-data",
                                  d["npz"], "--align-samples", "24"],
        "merge (memory)": ["merge", d["vit_a"], d["vit_b"], "--method", "average", "-o", "OUT"],
        "merge --mode stream": ["merge", d["ft1"], d["ft2"], "--method", "ties", "--base", d["base"], "--align",
                                "none", "--mode", "stream", "-o", "OUT"],
        "merge fisher --data": ["merge", d["vit_a"], d["vit_b"], "--method", "fisher", "--data", d["npz"],
                                "--eval-data", d["npz"], "-o", "OUT"],
        "barrier": ["barrier", d["vit_a"], d["vit_b"], "--data", d["npz"], "--points", "3", "-o", "OUT"],
        "run (dare_ties, seeded)": ["run", d["run_yml"], "OUT", "--random-seed", "3"],
        "run --num-threads 2": ["run", d["run_yml"], "OUT", "--random-seed", "3", "--num-threads", "2"],
        "extract-lora": ["extract-lora", d["ft1"], d["base"], "-o", "OUT", "--rank", "2"],
        "extract-lora --num-threads 2": ["extract-lora", d["ft1"], d["base"], "-o", "OUT", "--rank", "2",
                                         "--num-threads", "2"],
        "moe (random gate)": ["moe", d["moe_yml"], "OUT", "--random-seed", "4"],
        "moe --num-threads 2": ["moe", d["moe_yml"], "OUT", "--random-seed", "4", "--num-threads", "2"],
    }


# ------------------------------------------------------------------ the calls


class Runner:
    def __init__(self, root: Path, d: dict):
        self.root, self.d, self.n = root, d, 0

    def out(self) -> Path:
        self.n += 1
        return self.root / f"out{self.n}"

    def cli(self, argv, quiet=True):
        from symmerge.cli import main

        out = self.out()
        argv = [str(out) if a == "OUT" else str(a) for a in argv] + (["--progress", "none"] if quiet and argv[0]
                                                                      not in ("run", "moe") else [])
        if quiet and argv[0] in ("run", "moe"):
            argv.append("--quiet")
        err, std = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
            code = main(argv)
        return code, out, err.getvalue()

    def python(self, name):
        """A Python entry on loaded models (the caller's, checked unchanged) or folders."""
        import symmerge
        from transformers import ViTForImageClassification

        a = ViTForImageClassification.from_pretrained(str(self.d["vit_a"]))
        b = ViTForImageClassification.from_pretrained(str(self.d["vit_b"]))
        a.train()  # the caller's mode: must be kept
        b.eval()
        b.requires_grad_(False)
        out = self.out()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            before = snapshot([a, b])
            if name == "symmerge.align":
                aligned, _ = symmerge.align(a, b)
                aligned.save_pretrained(str(out))
            elif name == "symmerge.align_pair":
                result = symmerge.align_pair(a, b, symmerge.AlignOptions(symmetries="heads,attn,ffn,rescale,residual"))
                out = out.with_suffix(".txt")
                out.write_text(json.dumps({k: _digest(v.detach().numpy().tobytes())
                                           for k, v in sorted(result.model.state_dict().items())}))
            elif name == "symmerge.merge_models":
                merged, _ = symmerge.merge_models([a, b], "average")
                merged.save_pretrained(str(out))
            elif name == "symmerge.merge (folders)":
                symmerge.merge([str(self.d["vit_a"]), str(self.d["vit_b"])], str(out),
                               symmerge.MergeOptions(method="average", mode="auto"))
            elif name == "demo's train_vit (fresh)":
                from symmerge.demo.train import TrainSettings, train_vit, vit_config

                rng = np.random.default_rng(0)
                out = train_vit(vit_config(16, 1, 2, 32, patch=4, image_size=8, num_labels=3),
                          rng.integers(0, 255, (32, 8, 8), dtype=np.uint8), rng.integers(0, 3, 32),
                                TrainSettings(steps=3, batch_size=8, seed=0), name="t", root=out, cache=False,
                                progress=False, log=lambda *_: None)
            elif name == "symmerge.align_to_folder --stream":
                symmerge.align_to_folder(str(self.d["vit_a"]), str(self.d["vit_b"]), str(out),
                                         symmerge.AlignOptions(symmetries="attn,ffn"), stream=True)
            after = snapshot([a, b])
        return before, after, out


PY_CASES = ("symmerge.align", "symmerge.align_pair", "symmerge.merge_models", "symmerge.merge (folders)",
            "symmerge.align_to_folder --stream", "demo's train_vit (fresh)")


def _digest_of(out: Path) -> str:
    if out.is_file():
        return _digest(out.read_bytes())
    return folder_digest(out) if out.exists() else "-"


def audit(repeat: int, threads: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="procstate-") as tmp:
        root = Path(tmp)
        d = inputs(root / "in")
        runner = Runner(root / "outs", d)
        (root / "outs").mkdir()
        cases = cli_cases(d)
        # state: each call once, snapshots around it; the caller's next draws with and without the call
        for name, argv in cases.items():
            torch.set_num_threads(threads)  # each row from the caller's own count
            torch.manual_seed(123), np.random.seed(123), random.seed(123)
            expected = next_draws()
            torch.manual_seed(123), np.random.seed(123), random.seed(123)
            before = snapshot()
            t = time.perf_counter()
            code, out, err = runner.cli(argv)
            seconds = time.perf_counter() - t
            after = snapshot()
            same_draws = next_draws() == expected
            rows.append({"case": name, "kind": "state", "exit": code, "seconds": round(seconds, 2),
                         "changed": diff(before, after), "caller_draws_same": same_draws,
                         "stderr": err.strip().splitlines()[-1:] if code else []})
        for name in PY_CASES:
            torch.set_num_threads(threads)
            torch.manual_seed(123), np.random.seed(123), random.seed(123)
            expected = next_draws()
            torch.manual_seed(123), np.random.seed(123), random.seed(123)
            t = time.perf_counter()
            try:
                before, after, _ = runner.python(name)
                changed, code = diff(before, after), 0
            except Exception as e:  # recorded, not hidden
                changed, code = [f"{type(e).__name__}: {e}"], 1
            seconds = time.perf_counter() - t
            rows.append({"case": name, "kind": "state", "exit": code, "seconds": round(seconds, 2),
                         "changed": changed, "caller_draws_same": next_draws() == expected, "stderr": []})
        # repeated: each case `repeat` times, the same output bytes, RSS after gc
        for name, argv in cases.items():
            digests, rss = [], []
            for _ in range(repeat):
                code, out, _ = runner.cli(argv)
                digests.append(_digest_of(out) if code == 0 else f"exit {code}")
                gc.collect()
                rss.append((round(rss_mb(), 1), len(os.listdir("/proc/self/fd")), threading.active_count()))
            rows.append({"case": name, "kind": "repeat", "digests": digests, "same": len(set(digests)) == 1,
                         "rss_mb": rss})
        for name in PY_CASES:
            digests, rss = [], []
            for _ in range(repeat):
                _, _, out = runner.python(name)
                digests.append(_digest_of(out))
                gc.collect()
                rss.append((round(rss_mb(), 1), len(os.listdir("/proc/self/fd")), threading.active_count()))
            rows.append({"case": name, "kind": "repeat", "digests": digests, "same": len(set(digests)) == 1,
                         "rss_mb": rss})
        torch.set_num_threads(threads)
        rows += _after_errors(runner, d, cases)
        rows += _callers_settings(runner, cases, threads)
    return rows


SETTINGS = {
    "default dtype float64": lambda: _setting(torch.set_default_dtype, torch.get_default_dtype(), torch.float64),
    "torch.no_grad()": lambda: torch.no_grad(),
    "torch.inference_mode()": lambda: torch.inference_mode(),
    "deterministic algorithms": lambda: _setting(
        lambda v: torch.use_deterministic_algorithms(v), torch.are_deterministic_algorithms_enabled(), True),
    "2 torch threads": lambda: _setting(torch.set_num_threads, torch.get_num_threads(), 2),
}


@contextlib.contextmanager
def _setting(setter, old, new):
    setter(new)
    try:
        yield
    finally:
        setter(old)


def _callers_settings(runner: Runner, cases: dict, threads: int) -> list[dict]:
    """The caller's own settings around a call: the same output as under torch's defaults (or an error saying why)."""
    rows = []
    chosen = ("align", "align --match learned", "merge (memory)", "merge fisher --data", "barrier")
    base = {name: _digest_of(runner.cli(cases[name])[1]) for name in chosen}
    base.update({name: _digest_of(runner.python(name)[2]) for name in ("symmerge.align", "symmerge.merge_models")})
    for label, setting in SETTINGS.items():
        for name in (*chosen, "symmerge.align", "symmerge.merge_models"):
            torch.set_num_threads(threads)
            try:
                with setting():
                    if name in cases:
                        code, out, err = runner.cli(cases[name])
                        got = _digest_of(out) if code == 0 else f"exit {code}: {err.strip().splitlines()[-1:]}"
                    else:
                        got = _digest_of(runner.python(name)[2])
            except Exception as e:  # recorded, not hidden
                got = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append({"case": f"{name} under {label}", "kind": "caller", "same": got == base[name],
                         "digest": got, "baseline": base[name]})
    return rows


def _after_errors(runner: Runner, d: dict, cases: dict) -> list[dict]:
    """A call after a failed one (a bad input, an interrupted call, a quiet call) gives the same result and the same
    messages as in a fresh sequence."""
    rows = []
    argv = cases["merge (memory)"]
    code, out, err = runner.cli(argv, quiet=False)
    first = (code, _digest_of(out), err.count("\n"))
    bad = [["merge", d["vit_a"], d["base"], "--method", "average", "-o", "OUT"],  # two architectures
           ["merge", d["vit_a"], d["vit_b"], "--method", "nosuch", "-o", "OUT"],  # argparse's exit (SystemExit)
           ["barrier", d["vit_a"], d["vit_b"], "--data", d["run_yml"], "-o", "OUT"]]  # a bad data file
    for b in bad:
        try:
            code_b, _, err_b = runner.cli(b)
        except SystemExit as e:
            code_b, err_b = e.code, ""
        code, out, err = runner.cli(argv, quiet=False)
        rows.append({"case": f"merge after `{' '.join(str(x) for x in b[:1] + b[3:5])}...` (exit {code_b})",
                     "kind": "after-error", "same": (code, _digest_of(out), err.count("\n")) == first,
                     "stderr_lines": err.count("\n"), "first_stderr_lines": first[2]})
    # an interrupted call: SIGINT delivered during the merge (a KeyboardInterrupt inside it)
    from symmerge.merge import api

    original = api.merge_to_folder

    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        return original(*a, **k)

    api.merge_to_folder = interrupted
    try:
        code_i, _, err_i = runner.cli(argv)
    except KeyboardInterrupt:
        code_i, err_i = "KeyboardInterrupt", ""
    finally:
        api.merge_to_folder = original
    code, out, err = runner.cli(argv, quiet=False)
    rows.append({"case": f"merge after an interrupted merge (exit {code_i})", "kind": "after-error",
                 "same": (code, _digest_of(out), err.count("\n")) == first, "stderr_lines": err.count("\n"),
                 "first_stderr_lines": first[2]})
    # progress: a -q call, then one with --progress lines prints its lines
    runner.cli(argv + ["-q"], quiet=False)
    code, out, err = runner.cli(argv + ["--progress", "lines"], quiet=False)
    fresh_lines = err.count("\n")
    runner.cli(argv + ["--progress", "lines"], quiet=False)
    code, out, err2 = runner.cli(argv + ["-q"], quiet=False)
    rows.append({"case": "merge --progress lines after -q; -q after --progress lines", "kind": "after-error",
                 "same": fresh_lines > 0 and err2.count("\n") <= first[2], "stderr_lines": fresh_lines,
                 "first_stderr_lines": err2.count("\n")})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="procstate-tmp-") as private:
        tempfile.tempdir = private  # this process's temporary files only (symmerge's included)
        try:
            rows = audit(args.repeat, args.threads)
        finally:
            tempfile.tempdir = None
    print(f"{'case':<44} {'kind':<11} result")
    for r in rows:
        if r["kind"] == "state":
            what = "; ".join(r["changed"]) or "nothing changed"
            draws = "" if r["caller_draws_same"] else " | the caller's next draws DIFFER"
            print(f"{r['case']:<44} {'state':<11} exit {r['exit']}, {r['seconds']} s: {what}{draws}")
        elif r["kind"] == "repeat":
            print(f"{r['case']:<44} {'repeat':<11} {'same' if r['same'] else 'DIFFER'} {r['digests']} (RSS MB, fds, "
                  f"threads) {r['rss_mb']}")
        elif r["kind"] == "caller":
            print(f"{r['case']:<44} {'caller':<11} {'same' if r['same'] else 'DIFFER'} {r['digest']} "
                  f"(baseline {r['baseline']})")
        else:
            print(f"{r['case']:<44} {'after':<11} {'same' if r['same'] else 'DIFFER'} (stderr lines "
                  f"{r['stderr_lines']} / {r['first_stderr_lines']})")
    print(f"total {time.perf_counter() - t:.1f} s, load {open('/proc/loadavg').read().split()[:3]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
