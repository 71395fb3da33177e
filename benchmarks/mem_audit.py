"""Running out of memory, command by command: the real CLI in a child process whose memory is capped
(``resource.setrlimit`` in ``preexec_fn``), at a few caps between "cannot even start" and "enough".

The checkpoints: two random Llamas (hidden 768, FFN 2048, 8 layers, vocabulary 8192, float32: 278 MB of weights
each, the largest tensor 25 MB) with a WordLevel tokenizer, written once under ROOT/models and reused. Cases:
``merge`` (average in memory and streamed, an average aligned on heads,ffn in memory), ``align`` (heads,ffn: in memory,
``--stream``; the recommended groups' residual made an aligned merge 73 s, too long for a sweep of caps),
``run`` (a mergekit linear config), ``moe`` (random gates), ``extract-lora`` (rank 8) and ``barrier`` (a .txt of
LM lines, no alignment). One thread everywhere (``OMP_NUM_THREADS=1``, ``--workers 1``, ``-j 1``).

First the limit: the smallest cap under which a command starts at all (imports done: ``merge --print-plan``), for
RLIMIT_AS and RLIMIT_DATA, found by bisection. Then every case uncapped (its peak RSS), then under each cap of
``--caps`` (MB of the chosen limit). Per run: exit code, stderr's line count, whether it holds a traceback, its last
line, what is left beside the output (temporary folders, lock files, the output of a failed run) and whether the
inputs' files are unchanged (size and mtime per run; their bytes' SHA-256 at the start and the end).

    .venv/bin/python benchmarks/mem_audit.py [--root /tmp/memaudit] [--limit data|as] [--caps 400,600,...]
        [--only TEXT] [--package DIR] [--no-probe] [--kill] [--json FILE]
    .venv/bin/python benchmarks/mem_audit.py --table BEFORE.json AFTER.json     (the markdown table of two runs)

``--kill``: also a memory merge killed with SIGKILL (as the kernel's OOM killer does: no handler runs) once its
temporary folder exists, then the same command again (the temporary folder of a dead process is removed by the next
writer of that output, docs/cache.md). ``--package DIR``: run the CLI with DIR first on PYTHONPATH (an older
``symmerge`` source tree: the figures before a fix). Prints one row per (case, cap).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

DIMS = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
            num_key_value_heads=12, max_position_embeddings=128, tie_word_embeddings=False)
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
LIMITS = {"as": resource.RLIMIT_AS, "data": resource.RLIMIT_DATA}


def make_models(root: Path) -> dict[str, Path]:
    """ROOT/models/{a,b} (seeds 0, 1) and ROOT/lines.txt, made once."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folders = {}
    for seed, name in enumerate("ab"):
        folder = root / "models" / name
        folders[name] = folder
        if (folder / "config.json").exists():
            continue
        torch.manual_seed(seed)
        tmp = folder.with_name(name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        LlamaForCausalLM(LlamaConfig(**DIMS)).to(torch.float32).save_pretrained(str(tmp))
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, DIMS["vocab_size"])}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                pad_token="<unk>").save_pretrained(str(tmp))
        tmp.rename(folder)
    lines = root / "lines.txt"
    if not lines.exists():
        import random

        rng = random.Random(0)
        lines.write_text("".join(" ".join(f"w{rng.randrange(3, 8192)}" for _ in range(32)) + "\n" for _ in range(16)))
    return folders


def cases(root: Path, m: dict[str, Path]) -> dict[str, list[str]]:
    a, b = str(m["a"]), str(m["b"])
    (root / "linear.yml").write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {a}\n    parameters: "
                                     f"{{weight: 0.5}}\n  - model: {b}\n    parameters: {{weight: 0.5}}\n")
    (root / "moe.yml").write_text(f"base_model: {a}\ngate_mode: random\nexperts:\n  - source_model: {a}\n    "
                                  f"positive_prompts: [w5]\n  - source_model: {b}\n    positive_prompts: [w6]\n")
    quiet = ["--progress", "none"]
    return {
        "merge-memory-average": ["merge", a, b, "--method", "average", "--align", "none", "--mode", "memory", *quiet],
        "merge-stream-average": ["merge", a, b, "--method", "average", "--align", "none", "--mode", "stream", *quiet],
        "merge-memory-aligned": ["merge", a, b, "--method", "average", "--align", "heads,ffn", "--workers", "1",
                                 *quiet],
        "align-memory": ["align", b, a, "--symmetries", "heads,ffn", "--workers", "1", *quiet],
        "align-stream": ["align", b, a, "--symmetries", "heads,ffn", "--stream", *quiet],
        "run-linear": ["run", str(root / "linear.yml"), "-j", "1", "-q"],
        "moe-random": ["moe", str(root / "moe.yml"), "-j", "1", "-q"],
        "extract-lora": ["extract-lora", b, a, "--rank", "8", "-j", "1", *quiet],
        "barrier": ["barrier", a, b, "--data", str(root / "lines.txt"), "--align", "none", "--points", "3", *quiet],
    }


def with_output(command: list[str], out: Path) -> list[str]:
    """``command`` writing ``out`` (run and moe take it as their second positional argument)."""
    if command[0] in ("run", "moe"):
        return [command[0], command[1], str(out), *command[2:]]
    return [*command, "-o", str(out)]


def stat_print(folders) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for f in folders for p in sorted(Path(f).rglob("*"))
            if p.is_file()}


def content_print(folders) -> str:
    h = hashlib.sha256()
    for f in folders:
        for p in sorted(Path(f).rglob("*")):
            if p.is_file():
                h.update(str(p).encode())
                with open(p, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 22), b""):
                        h.update(block)
    return h.hexdigest()


def run_capped(argv: list[str], limit: str, cap_mb: float | None, env: dict, log: Path) -> dict:
    """The CLI (``python -m symmerge.cli ARGV``) under ``cap_mb`` MB of ``limit`` (None: uncapped): exit code, wall
    seconds, peak RSS (MB, the child's own rusage) and stderr."""
    def cap():
        if cap_mb is not None:
            n = int(cap_mb * 2 ** 20)
            resource.setrlimit(LIMITS[limit], (n, n))

    with open(log, "wb") as err:
        start = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "symmerge.cli", *argv], stdout=subprocess.DEVNULL, stderr=err,
                             env=env, preexec_fn=cap, cwd=log.parent)  # not the worktree: PYTHONPATH's package first
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
    text = log.read_text(errors="replace")
    return {"rc": p.returncode, "wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "stderr": text}


def left_beside(out: Path) -> list[str]:
    """What is in OUT's parent folder (the run's scratch folder: nothing else is written there)."""
    return sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else []


def starts(limit: str, env: dict, probe: list[str], root: Path) -> dict:
    """The smallest cap (MB, within 16 MB) under which ``probe`` (a print-plan: the imports, the inputs' headers)
    exits 0, by bisection between 64 MB and 4096 MB."""
    lo, hi, tried, failure = 64, 4096, [], ""
    while hi - lo > 16:
        mid = (lo + hi) // 2
        r = run_capped(probe, limit, mid, env, root / "probe.err")
        tried.append((mid, r["rc"]))
        lo, hi = (lo, mid) if r["rc"] == 0 else (mid, hi)
        if r["rc"] != 0:
            failure = (r["stderr"].strip().splitlines() or [""])[-1]
    return {"limit": limit, "starts_at_mb": hi, "fails_at_mb": lo, "tried": tried, "last_failure_line": failure}


def one_row(name: str, cap, r: dict, left: list[str], inputs_same: bool) -> dict:
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    return {"case": name, "cap_mb": cap, "rc": r["rc"], "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"],
            "stderr_lines": len(lines), "traceback": "Traceback (most recent call last)" in r["stderr"],
            "last_line": lines[-1][:300] if lines else "", "left": left, "inputs_same": inputs_same}


def killed_then_rerun(command: list[str], scratch: Path, env: dict) -> dict:
    """As a kernel's OOM kill: ``command`` (a merge writing ``scratch/out``) killed with SIGKILL once its temporary
    folder exists, what it left; then the same command again: its exit code, its notes, what is left after it."""
    import signal

    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    out = scratch / "out"
    p = subprocess.Popen([sys.executable, "-m", "symmerge.cli", *with_output(command, out)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env, cwd=scratch.parent)
    deadline = time.time() + 120
    while time.time() < deadline and not any(".symmerge-tmp-" in n for n in left_beside(out)) and p.poll() is None:
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    left_killed = left_beside(out)
    again = subprocess.run([sys.executable, "-m", "symmerge.cli", *with_output(command, out)], capture_output=True,
                           text=True, env=env, cwd=scratch.parent)
    result = {"killed_rc": p.returncode, "left_by_killed": left_killed, "rerun_rc": again.returncode,
              "rerun_notes": [line for line in again.stderr.splitlines() if line.startswith("note:")],
              "left_after_rerun": left_beside(out)}
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def shown(row: dict) -> str:
    """One run as a table cell: exit code, stderr's lines (TB: a traceback), what was left, the inputs, the message."""
    text = row["last_line"].replace("|", "/")
    for prefix in ("symmerge: error: ", "/tmp/memaudit/models/"):
        text = text.replace(prefix, "")
    left = f", left {' '.join(row['left'])}" if row["left"] else ""
    inputs = "" if row["inputs_same"] else ", INPUTS CHANGED"
    tb = " TB" if row["traceback"] else ""
    return f"{row['rc']} ({row['stderr_lines']} l{tb}{left}{inputs}) {text[:90]}".strip()


def table(before: str, after: str) -> None:
    """The markdown table of two runs' rows (the same cases and caps), before and after."""
    rows_b = {(r["case"], r["cap_mb"]): r for r in json.loads(Path(before).read_text())["rows"]}
    rows_a = {(r["case"], r["cap_mb"]): r for r in json.loads(Path(after).read_text())["rows"]}
    print("| case | cap MB | before: rc (stderr lines) last line | after: rc (stderr lines) last line | peak RSS MB "
          "after | wall s after |")
    print("|---|---|---|---|---|---|")
    for key, a in rows_a.items():
        b = rows_b.get(key)
        cap = "none" if key[1] is None else f"{key[1]:.0f}"
        print(f"| {key[0]} | {cap} | {shown(b) if b else 'not run'} | {shown(a)} | {a['peak_rss_mb']:.0f} | "
              f"{a['wall_s']:.1f} |")


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--table"]:
        table(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/memaudit")
    ap.add_argument("--limit", choices=sorted(LIMITS), default="data")
    ap.add_argument("--caps", default="", help="MB, comma-separated (default: from the start-up cap up)")
    ap.add_argument("--only", default="")
    ap.add_argument("--package", default="")
    ap.add_argument("--no-probe", action="store_true", help="skip the start-up bisection (both limits)")
    ap.add_argument("--kill", action="store_true", help="also: a merge killed with SIGKILL, then run again")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **THREADS}
    if args.package:
        env["PYTHONPATH"] = os.pathsep.join([args.package, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    m = make_models(root)
    all_cases = {k: v for k, v in cases(root, m).items() if args.only in k}
    inputs = [m["a"], m["b"]]
    before_bytes = content_print(inputs)
    scratch = root / "scratch"
    result = {"dims": DIMS, "limit": args.limit, "package": args.package or "worktree", "load_start":
              open("/proc/loadavg").read().split()[:3], "probe": [], "rows": []}
    probe = ["merge", str(m["a"]), str(m["b"]), "--method", "average", "--align", "none", "--print-plan", "-o",
             str(scratch / "plan")]
    if not args.no_probe:
        for limit in ("as", "data"):
            p = starts(limit, env, probe, root)
            result["probe"].append(p)
            print(f"start-up under RLIMIT_{limit.upper()}: starts at {p['starts_at_mb']} MB, fails at "
                  f"{p['fails_at_mb']} MB ({p['last_failure_line'][:160]})", flush=True)
    startup = next((p["starts_at_mb"] for p in result["probe"] if p["limit"] == args.limit), None)
    caps = [float(c) for c in args.caps.split(",") if c] or [startup - 32] + [startup + d
                                                                              for d in (150, 400, 800, 1600, 3200)]
    print(f"{'case':22s} {'cap MB':>7s} {'rc':>4s} {'wall s':>7s} {'peak MB':>8s} {'lines':>5s} tb  left  "
          "inputs  last line", flush=True)
    for name, command in all_cases.items():
        for cap in [None, *caps]:
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            out = scratch / "out"
            before = stat_print(inputs)
            r = run_capped(with_output(command, out), args.limit, cap, env, root / "run.err")
            left = left_beside(out)
            if r["rc"] == 0 and left == ["out"]:
                left = []  # a run that succeeded leaves its output, and only that
            row = one_row(name, cap, r, left, stat_print(inputs) == before)
            result["rows"].append(row)
            print(f"{name:22s} {'none' if cap is None else f'{cap:.0f}':>7s} {row['rc']:>4d} {row['wall_s']:>7.1f} "
                  f"{row['peak_rss_mb']:>8.0f} {row['stderr_lines']:>5d} {'Y' if row['traceback'] else '-':2s} "
                  f"{','.join(left) or '-':5s} {'same' if row['inputs_same'] else 'CHANGED':7s} "
                  f"{row['last_line'][:150]}", flush=True)
    if args.kill:
        k = killed_then_rerun(cases(root, m)["merge-memory-average"], scratch, env)
        result["sigkill"] = k
        print(f"SIGKILL of merge-memory-average once its temporary folder existed: rc {k['killed_rc']}, left "
              f"{k['left_by_killed']}; the same command again: rc {k['rerun_rc']}, notes {k['rerun_notes']}, left "
              f"{k['left_after_rerun']}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    result["inputs_bytes_same"] = content_print(inputs) == before_bytes
    result["load_end"] = open("/proc/loadavg").read().split()[:3]
    print(f"inputs' bytes unchanged over the audit: {result['inputs_bytes_same']}; load {result['load_start']} -> "
          f"{result['load_end']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
