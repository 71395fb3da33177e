"""Two or more symmerge processes at once: the same output folder, a folder read while another process writes it,
one LoRA merge cache, the stale-temporary-folder cleaning beside a live process, the name and numba caches.

Every case launches 2-4 real ``symmerge`` processes (this file run with ``--child``: the command line itself, after
the hooks below; one thread each, ``--progress none``/``-q``) on tiny random checkpoints (hidden 32), except the
``real`` cases (the demo on the cached ViTs, the cached MiniLMs). The overlap is controlled, never raced by sleeps:

* ``start``: every process waits, its imports done, until all are ready, then all start together;
* ``hold=rename:TEXT``: the process stops just before it renames a finished temporary folder whose path holds
  ``TEXT`` into place (its output complete in ``.<name>.symmerge-tmp-*``, nothing under the output's name yet);
* ``hold=merged:TEXT``: it stops just after it has merged a ``BASE+ADAPTER`` into a folder whose path holds ``TEXT``
  (the merged model is there, not read yet).

A held process writes ``SYNC/<name>.held`` and goes on once ``SYNC/<name>.go`` exists; the audit runs the other
process in between. Each case checks the exit codes, that a refusal is one ``error:`` line without a traceback, that
every output is complete and equal, file by file, to a lone run's (the report and the model card compared without
their timings and paths), that the caches read (:func:`symmerge.io.cache.damage`, the name cache's JSON) and that
nothing is left behind (temporary folders, lock files, ``symmerge-lora-*`` folders in ``TMPDIR``).

    .venv/bin/python benchmarks/concur_audit.py [--only TEXT] [--no-real] [--json FILE] [--package DIR]
    .venv/bin/python benchmarks/concur_audit.py --table BEFORE.json[,RERUN.json] AFTER.json[,RERUN.json]

Prints one row per case: case, expected, observed, held.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve()
ERROR = re.compile(r"^(symmerge: error: |symmerge [\w-]+: error: )")
# files that hold timings, paths, the command line: compared without them
VARYING = {"symmerge_report.json", "README.md", "symmerge_lora.json", "barrier.json"}


# ------------------------------------------------------------------ the child: the command with its hooks


def _barrier(name: str) -> None:
    sync = Path(os.environ["CONCUR_SYNC"])
    (sync / f"{name}.held").write_text(str(os.getpid()))
    go, deadline = sync / f"{name}.go", time.monotonic() + 600
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _count_merges(name: str) -> None:
    """Every merge of an adapter this process does leaves ``SYNC/<name>.merged-<n>`` (the case counts them)."""
    import symmerge.io.lora as lora

    apply = lora.apply_adapter

    def counted(*args, **kwargs):
        sync = Path(os.environ["CONCUR_SYNC"])
        (sync / f"{name}.merged-{len(list(sync.glob(f'{name}.merged-*')))}").touch()
        return apply(*args, **kwargs)

    lora.apply_adapter = counted


def _install_hooks() -> None:
    hold = os.environ.get("CONCUR_HOLD", "")
    name = os.environ.get("CONCUR_NAME", "p")
    _count_merges(name)
    point, _, text = hold.partition(":")
    if point == "rename":
        import symmerge.io.model as model

        umask = model.apply_umask

        def before_rename(folder):
            if text in str(folder):
                _barrier(name)
            return umask(folder)

        model.apply_umask = before_rename
    elif point == "published":  # just after the rename that publishes a folder whose path ends with TEXT
        rename = os.rename

        def after_rename(src, dst, *args, **kwargs):
            rename(src, dst, *args, **kwargs)
            if str(dst).endswith(text):
                _barrier(name)

        os.rename = after_rename
    elif point == "merged":
        import symmerge.io.lora as lora

        record = lora.record_digests

        def after_merge(folder, *args, **kwargs):
            done = record(folder, *args, **kwargs)
            if text in str(folder):
                _barrier(name)
            return done

        lora.record_digests = after_merge


def child(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    import symmerge.cli

    if os.environ.get("CONCUR_WHICH"):
        print(f"symmerge from {Path(symmerge.cli.__file__).parent}", file=sys.stderr)
    _install_hooks()
    if os.environ.get("CONCUR_START"):
        _barrier(os.environ.get("CONCUR_NAME", "p") + "-start")
    sys.exit(symmerge.cli.main(argv))


# ------------------------------------------------------------------ inputs


def make_inputs(root: Path) -> None:
    """Three tiny Llamas (L0, L1, L2), a LoRA adapter of L0, a tiny ViT pair and its data, two mergekit configs."""
    import torch

    sys.path.insert(0, str(HERE.parents[1]))
    from benchmarks.paths_audit import _llama, _lora, _npz, _vit

    torch.set_num_threads(1)
    root.mkdir(parents=True)
    for i in range(3):
        _llama(root / f"L{i}", i)
    _lora(root / "ad", root / "L0")
    _vit(root / "V0", 0)
    _vit(root / "V1", 1)
    _npz(root / "data.npz")
    (root / "single").mkdir()  # a single-file input named lora-<the id of no running process>.safetensors
    shutil.copy(root / "L2" / "model.safetensors", root / "single" / f"lora-{_gone_pid()}.safetensors")
    shutil.copy(root / "L2" / "config.json", root / "single" / "config.json")
    for k, w in (("c1", 0.3), ("c2", 0.6)):
        (root / f"{k}.yml").write_text(f"merge_method: linear\nmodels:\n  - model: {root / 'L0'}\n    parameters:\n"
                                       f"      weight: {w}\n  - model: {root / 'L1'}\n    parameters:\n"
                                       f"      weight: {1 - w}\ndtype: float32\n")


def _gone_pid() -> int:
    from symmerge.io.output import pid_alive

    return next(n for n in range(16, 4096) if not pid_alive(n))


# ------------------------------------------------------------------ processes


@dataclass
class Proc:
    name: str
    argv: list
    hold: str = ""
    env: dict = field(default_factory=dict)
    wrap: list = field(default_factory=list)  # e.g. unshare: another PID namespace
    popen: object = None
    rc: int | None = None
    err: str = ""
    seconds: float = 0.0


class Case:
    """One case's folder, its processes and its checks."""

    def __init__(self, audit, key: str):
        self.audit, self.key = audit, key
        self.dir = audit.work / "cases" / key
        self.sync = self.dir / "sync"
        self.sync.mkdir(parents=True)
        self.procs: dict[str, Proc] = {}
        self.notes: list[str] = []

    def env(self, proc: Proc, start: bool) -> dict:
        env = dict(self.audit.env)
        env.update(CONCUR_SYNC=str(self.sync), CONCUR_NAME=proc.name, CONCUR_HOLD=proc.hold)
        if start:
            env["CONCUR_START"] = "1"
        env.update(proc.env)
        return env

    def launch(self, proc: Proc, start: bool = False) -> Proc:
        out, err = open(self.dir / f"{proc.name}.out", "w"), open(self.dir / f"{proc.name}.err", "w")
        command = [*proc.wrap, sys.executable, str(HERE), "--child", *[str(a) for a in proc.argv]]
        proc.seconds = time.perf_counter()
        proc.popen = subprocess.Popen(command, cwd=self.audit.work, env=self.env(proc, start), stdout=out,
                                      stderr=err)
        self.procs[proc.name] = proc
        return proc

    def together(self, procs: list[Proc]) -> list[Proc]:
        """Launch ``procs``; once every one has done its imports, let them all start; wait for all."""
        for p in procs:
            self.launch(p, start=True)
        self.wait_for([f"{p.name}-start" for p in procs], procs)
        for p in procs:
            (self.sync / f"{p.name}-start.go").touch()
        return [self.finish(p) for p in procs]

    def wait_for(self, names: list[str], procs: list[Proc], limit: float = 300) -> bool:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if all((self.sync / f"{n}.held").exists() for n in names):
                return True
            if any(p.popen.poll() is not None for p in procs):
                return all((self.sync / f"{n}.held").exists() for n in names)
            time.sleep(0.01)
        return False

    def release(self, proc: Proc) -> None:
        (self.sync / f"{proc.name}.go").touch()

    def finish(self, proc: Proc, limit: float = 600) -> Proc:
        try:
            proc.rc = proc.popen.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.rc = proc.popen.wait()
        proc.seconds = time.perf_counter() - proc.seconds
        proc.err = (self.dir / f"{proc.name}.err").read_text(errors="replace")
        return proc

    def run(self, proc: Proc) -> Proc:
        return self.finish(self.launch(proc))

    def path(self, name: str) -> Path:
        return self.dir / name


def short(line: str, size: int = 160) -> str:
    """An error line without the audit's work folder (``…/``) and the process ids (``N``), cut to ``size``."""
    line = re.sub(r"/tmp/concur-audit-\w+/(cases/[^/]+/)?", "…/", line)
    return re.sub(r"process \d+", "process N", line)[:size]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if ERROR.match(line)]


def refusal(p: Proc) -> str | None:
    """None when ``p`` was refused as a command should be (exit 2, one error line, no traceback); else why not."""
    if "Traceback" in p.err:
        return f"{p.name}: a traceback (rc {p.rc})"
    lines = error_lines(p.err)
    if p.rc != 2 or len(lines) != 1:
        return f"{p.name}: rc {p.rc}, {len(lines)} error lines: {p.err.strip().splitlines()[-1:] or ['(nothing)']}"
    return None


def succeeded(p: Proc) -> str | None:
    if p.rc != 0 or "Traceback" in p.err:
        tail = p.err.strip().splitlines()[-1:] or ["(nothing)"]
        return f"{p.name}: rc {p.rc}: {tail[0][:200]}"
    return None


def digest(folder: Path) -> dict:
    """{file: sha256} of every file of ``folder`` (relative names); the files in :data:`VARYING` as they read without
    their times, the command line and the output's own path and name (they differ between two runs)."""
    result = {}
    for f in sorted(folder.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        if f.name in VARYING:
            data = _stable(f.name, data, folder)
        result[str(f.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return result


DROPPED = {"timings", "seconds", "command_line", "read_ahead_peak_bytes", "platform"}


def _stable(name: str, data: bytes, folder: Path) -> bytes:
    import shlex

    text = data.decode("utf-8", "replace")
    for form in (shlex.quote(str(folder)), str(folder)):
        text = text.replace(form, "OUT")
    if not name.endswith(".json"):
        text = re.sub(r"^(\| seconds \||symmerge ).*$", "", text, flags=re.M)  # the run's times, its command line
        return re.sub(rf"^# {re.escape(folder.name)}$", "# OUT", text, flags=re.M).encode()

    def walk(o):
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items() if k not in DROPPED and not k.endswith("_seconds")}
        if isinstance(o, list):
            return [walk(v) for v in o]
        return float(f"{o:.10g}") if isinstance(o, float) else o  # a sum's last digit: the reduction order

    return json.dumps(walk(json.loads(text)), sort_keys=True).encode()


def left_behind(parent: Path, name: str) -> list[str]:
    """What symmerge left beside the output ``parent/name``: temporary folders, locks, probes."""
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# ------------------------------------------------------------------ the audit


class Audit:
    def __init__(self, work: Path, real: bool):
        self.work, self.real = work, real
        self.inp = work / "in"
        self.tmp = work / "tmp"
        self.tmp.mkdir(parents=True)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TMPDIR": str(self.tmp),
                    "SYMMERGE_CACHE": str(work / "cache"), "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONPATH": str(HERE.parents[1])}
        self.refs: dict[str, dict] = {}
        self.rows: list[dict] = []

    def lone(self, key: str, argv: list) -> dict:
        """The digest of the output a lone run of ``argv`` writes (``OUT`` in ``argv`` is its output, ``CACHE`` its
        LoRA merge cache: the lone run's own)."""
        if key not in self.refs:
            case = Case(self, "lone-" + hashlib.sha1(key.encode()).hexdigest()[:10])
            out = case.path("out")
            p = case.run(Proc("lone", [str(case.path("C")) if a == "CACHE" else a for a in _sub(argv, out)]))
            if succeeded(p):
                raise RuntimeError(f"the lone run {key} failed: {p.err[-2000:]}")
            self.refs[key] = digest(out)
        return self.refs[key]

    def row(self, case: str, expected: str, problems: list[str], observed: str, seconds: float) -> None:
        problems = [p for p in problems if p]
        held = not problems
        self.rows.append({"case": case, "expected": expected, "observed": observed if held else
                          "; ".join(problems) + f" ({observed})", "held": held, "seconds": round(seconds, 1)})
        r = self.rows[-1]
        print(f"| {len(self.rows)} | {case} | {expected} | {r['observed']} | {'held' if held else '**failed**'} | "
              f"{r['seconds']} |", flush=True)

    def tmp_leftovers(self) -> list[str]:
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("symmerge-"))


def _winner(procs: list[Proc], out: Path, refs: dict[str, dict]) -> tuple[list[str], str]:
    """Exactly one process of ``procs`` wrote ``out`` (its output equal to ``refs[its name]``), the others refused."""
    ok = [p for p in procs if p.rc == 0]
    problems = [] if len(ok) == 1 else [f"{len(ok)} processes exited 0"]
    problems += [refusal(p) for p in procs if p.rc != 0]
    if len(ok) == 1 and not out.is_dir():
        problems.append("no output")
    elif len(ok) == 1 and digest(out) != refs[ok[0].name]:
        problems.append(f"the output differs from {ok[0].name}'s lone run")
    problems.append(f"left beside the output: {left_behind(out.parent, out.name)}"
                    if left_behind(out.parent, out.name) else None)
    lines = {short(error_lines(p.err)[0]) for p in procs if p.rc != 0 and error_lines(p.err)}
    observed = (f"rc {sorted(p.rc for p in procs)}; " + ("; ".join(sorted(lines)) if lines else "no error line") +
                f"; slowest {max(p.seconds for p in procs):.1f} s")
    return problems, observed


def merge_argv(a="L0", b="L1", out="OUT", *extra):
    return ["merge", f"in/{a}", f"in/{b}", "--method", "average", "--align", "none", "-o", out, "--progress", "none",
            "-q", *extra]


def _sub(argv, out) -> list:
    return [str(out) if a == "OUT" else a for a in argv]


def same_output(audit: Audit, key: str, argvs: list[list], note: str) -> None:
    """``argvs`` (one per process) writing one output folder, started together: one writes it, the others refuse."""
    t0 = time.perf_counter()
    case = Case(audit, key)
    out = case.path("same")
    refs = {f"p{i}": audit.lone(json.dumps(a), a) for i, a in enumerate(argvs)}
    procs = case.together([Proc(f"p{i}", _sub(a, out)) for i, a in enumerate(argvs)])
    problems, observed = _winner(procs, out, refs)
    audit.row(key, f"{note}: one rc 0 with a lone run's output, the others rc 2 in one line, nothing left",
              problems, observed, time.perf_counter() - t0)


def held_writer(audit: Audit, key: str, first: list, second: list, expect: str, check) -> None:
    """``first`` held just before it renames its finished output into place; ``second`` run meanwhile, to its end;
    then ``first`` released. ``check(case, a, b)`` gives (problems, observed)."""
    t0 = time.perf_counter()
    case = Case(audit, key)
    a = case.launch(Proc("a", _sub(first, case.path("x")), hold="rename:.x.symmerge-tmp-"))
    if not case.wait_for(["a"], [a]):
        case.finish(a)
        audit.row(key, expect, [f"a never reached its rename: {a.err[-300:]}"], "", time.perf_counter() - t0)
        return
    b = case.run(Proc("b", _sub(second, case.path("x"))))
    case.release(a)
    case.finish(a)
    problems, observed = check(case, a, b)
    audit.row(key, expect, problems, observed, time.perf_counter() - t0)


def case_same_output(audit: Audit) -> None:
    plain = merge_argv()
    same_output(audit, "merge x2, one -o", [plain, plain], "two identical merges")
    sharded = [merge_argv("L0", f"L{1 + i % 2}", "OUT", "--shard-size", "20KB") for i in range(4)]
    same_output(audit, "merge x4, one -o, sharded, two different merges", sharded,
                "four merges (2 kinds), 4 shards each")
    align = ["align", "in/L1", "in/L0", "-o", "OUT", "--progress", "none", "-q"]
    same_output(audit, "align x2, one -o", [align, align], "two alignments")
    runs = [["run", "in/c1.yml", "OUT", "--progress", "none", "-q"], ["run", "in/c2.yml", "OUT", "--progress", "none",
                                                                        "-q"]]
    same_output(audit, "run x2 (two configs), one output", runs, "two mergekit configs")
    lora = ["extract-lora", "--model", "in/L1", "--base-model", "in/L0", "-o", "OUT", "--rank", "2", "-q"]
    same_output(audit, "extract-lora x2, one -o", [lora, lora], "two extractions")
    barrier = ["barrier", "in/V0", "in/V1", "--data", "in/data.npz", "-o", "OUT", "--progress", "none", "-q"]
    same_output(audit, "barrier x2, one -o (json + plots)", [barrier, barrier], "two barrier studies")


def case_new_parent(audit: Audit) -> None:
    """One output in a folder that does not exist yet, two alignments started together (``--progress lines``: the
    stage lines say whether the refused one aligned first; a streamed merge merges inside its atomic write, after
    the claim, an alignment before it)."""
    t0 = time.perf_counter()
    case = Case(audit, "align x2, one -o in a missing folder")
    out = case.path("new/parent/same")
    argv = ["align", "in/L1", "in/L0", "-o", "OUT", "--progress", "none", "-q"]
    ref = audit.lone(json.dumps(argv), argv)
    procs = case.together([Proc(f"p{i}", _sub(argv[:-2] + ["lines"], out)) for i in range(2)])
    problems, observed = _winner(procs, out, {"p0": ref, "p1": ref})
    late = [p.name for p in procs if p.rc != 0 and "verified the aligned model" in p.err]
    problems.append(f"{late} refused only after aligning" if late else None)
    audit.row(case.key, "one rc 0, the other rc 2 in one line before any work", problems, observed,
              time.perf_counter() - t0)


def case_mid_write(audit: Audit) -> None:
    argv = merge_argv("L0", "L1", "OUT", "--shard-size", "20KB")
    ref = audit.lone(json.dumps(argv), argv)

    def same(case, a, b):
        out = case.path("x")
        problems = [succeeded(a), refusal(b)]
        if out.is_dir() and digest(out) != ref:
            problems.append("the output differs from a lone run's")
        index = json.loads((out / "model.safetensors.index.json").read_text()) if out.is_dir() else {"weight_map": {}}
        shards = sorted(p.name for p in out.glob("*.safetensors")) if out.is_dir() else []
        if sorted(set(index["weight_map"].values())) != shards:
            problems.append(f"index names {sorted(set(index['weight_map'].values()))}, folder holds {shards}")
        problems.append(f"left: {left_behind(out.parent, 'x')}" if left_behind(out.parent, "x") else None)
        return problems, f"b rc {b.rc} after {b.seconds:.1f} s: {short((error_lines(b.err) or ['-'])[0])}; a rc {a.rc}"

    held_writer(audit, "merge B on the -o of merge A, A mid-rename (sharded)", argv, argv,
                "B refused at once in one line; A's output complete, its index naming its own shards", same)

    def reader(case, a, b):
        problems = [succeeded(a), refusal(b)]
        return problems, f"b rc {b.rc}: {short((error_lines(b.err) or ['-'])[0])}; a rc {a.rc}"

    held_writer(audit, "merge B reading A's output while A writes it", merge_argv(),
                ["merge", "OUT", "in/L2", "--method", "average", "--align", "none", "-o",
                 str(audit.work / "cases" / "reader-out"), "--progress", "none", "-q"],
                "B refused in one line (no such model folder yet), nothing read from A's temporary folder", reader)


def case_published(audit: Audit) -> None:
    """A ``run`` of a config of symmerge's own keys held just after its output appeared; the audit lists the output
    then, as a reader taking it at once would see it (the next step of a sweep), and again once A ended."""
    t0 = time.perf_counter()
    case = Case(audit, "run (config of symmerge's keys): its output as it appears")
    out = case.path("x")
    cfg = case.path("own.yml")
    cfg.write_text(f"models: [{audit.inp / 'L0'}, {audit.inp / 'L1'}]\nmerge_method: average\nalign: none\n"
                   "progress: none\n")
    a = case.launch(Proc("a", ["run", str(cfg), str(out), "-q"], hold=f"published:{out}"))
    if not case.wait_for(["a"], [a]):
        case.finish(a)
        audit.row(case.key, "", [f"a never held: {a.err[-300:]}"], "", time.perf_counter() - t0)
        return
    seen = sorted(p.name for p in out.iterdir())
    case.release(a)
    case.finish(a)
    final = sorted(p.name for p in out.iterdir())
    problems = [succeeded(a), None if seen == final else f"files added after the output appeared: "
                f"{sorted(set(final) - set(seen))}"]
    audit.row(case.key, "the output complete when it appears (symmerge_config.yml in it), never changed after",
              problems, f"a rc {a.rc}; {len(seen)} files when it appeared, {len(final)} at the end",
              time.perf_counter() - t0)


def case_lora_cache(audit: Audit) -> None:
    t0 = time.perf_counter()
    from symmerge.io.cache import damage

    case = Case(audit, "merge x4 of one BASE+ADAPTER, one --lora-merge-cache")
    cache = case.path("C")
    argv = merge_argv("L0", "L1", "OUT", "--lora-merge-cache", "CACHE")
    argv[1] = "in/L0+in/ad"
    ref_case = audit.lone("lora", argv)
    argv[argv.index("CACHE")] = str(cache)
    procs = case.together([Proc(f"p{i}", _sub(argv, case.path(f"o{i}"))) for i in range(4)])
    problems = [succeeded(p) for p in procs]
    problems += [f"o{i} differs" for i in range(4) if case.path(f"o{i}").is_dir() and digest(case.path(f"o{i}")) !=
                 ref_case]
    entries = [p for p in cache.iterdir()] if cache.is_dir() else []
    visible = [p for p in entries if not p.name.startswith(".")]
    problems.append(None if len(visible) == 1 else f"cache holds {[p.name for p in entries]}")
    problems += [damage(p) for p in visible]
    problems.append(f"hidden files left in the cache: {[p.name for p in entries if p.name.startswith('.')]}"
                    if any(p.name.startswith(".") for p in entries) else None)
    problems.append(f"left in TMPDIR: {audit.tmp_leftovers()}" if audit.tmp_leftovers() else None)
    waited = sum("waiting for it" in p.err for p in procs)
    merges = len(list(case.sync.glob("*.merged-*")))
    problems.append(None if merges == 1 else f"the adapter merged {merges} times")
    audit.row(case.key, "all rc 0, outputs equal a lone run's, one valid entry, the adapter merged once", problems,
              f"rc {[p.rc for p in procs]}; {waited} waited; merged {merges} time(s); entries {len(visible)}",
              time.perf_counter() - t0)

    def both(case, a, b):
        cache = case.path("C")
        entries = sorted(p.name for p in cache.iterdir())
        problems = [succeeded(a), succeeded(b), None if len(entries) == 1 else f"cache holds {entries}"]
        problems += [damage(cache / e) for e in entries if not e.startswith(".")]
        problems += [f"{n} differs" for n in ("o", "x") if case.path(n).is_dir() and digest(case.path(n)) != ref_case]
        merges = len(list(case.sync.glob("*.merged-*")))
        problems.append(None if merges == 1 else f"the adapter merged {merges} times")
        return problems, (f"a rc {a.rc}, b rc {b.rc}; b waited: {'waiting for it' in b.err}; merged {merges} "
                          f"time(s); entries {len(entries)}")

    t0 = time.perf_counter()
    case = Case(audit, "merge B of A's BASE+ADAPTER while A renames its cache entry")
    argv[argv.index(str(cache))] = str(case.path("C"))
    first = _sub(argv, case.path("o"))
    a = case.launch(Proc("a", first, hold="rename:L0+ad"))
    if case.wait_for(["a"], [a]):
        b = case.launch(Proc("b", _sub(argv, case.path("x"))))
        deadline = time.monotonic() + 120  # b waits on a's lock: it says so, then a is let go
        while "waiting for it" not in (case.dir / "b.err").read_text() and b.popen.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        case.release(a)
        case.finish(a)
        case.finish(b)
        problems, observed = both(case, a, b)
    else:
        case.finish(a)
        problems, observed = [f"a never held: {a.err[-300:]}"], ""
    audit.row(case.key, "B waits for A's entry (one note), then reuses it; both rc 0, one valid entry, merged once",
              problems,
              observed, time.perf_counter() - t0)


def case_temp_cache(audit: Audit, wrap: list, key: str) -> None:
    """A holds its own temporary LoRA merge cache (no --lora-merge-cache) with a merged model it has not read yet;
    B, a merge of an adapter (which cleans the temporary caches of processes that are gone), runs to its end."""
    t0 = time.perf_counter()
    case = Case(audit, key)
    argv = merge_argv("L0", "L1", "OUT")
    argv[1] = "in/L0+in/ad"
    a = case.launch(Proc("a", _sub(argv, case.path("o")), hold="merged:symmerge-lora-"))
    if not case.wait_for(["a"], [a]):
        case.finish(a)
        audit.row(key, "", [f"a never held: {a.err[-300:]}"], "", time.perf_counter() - t0)
        return
    mine = [p.name for p in audit.tmp.iterdir() if p.name.startswith(f"symmerge-lora-{a.popen.pid}-")]
    b = case.run(Proc("b", _sub(argv, case.path("x")), wrap=wrap))
    kept = [n for n in mine if (audit.tmp / n).is_dir()]
    case.release(a)
    case.finish(a)
    problems = [succeeded(a), succeeded(b), None if kept == mine and mine else f"A's temp cache {mine} removed by B"]
    problems.append(f"left in TMPDIR: {audit.tmp_leftovers()}" if audit.tmp_leftovers() else None)
    audit.row(key, "A's live folder left alone; both rc 0; nothing left once both end", problems,
              f"a rc {a.rc}, b rc {b.rc}; A's folder {'kept' if kept == mine and mine else 'removed'}",
              time.perf_counter() - t0)


def case_killed(audit: Audit) -> None:
    """A killed (SIGKILL) while it holds a LoRA cache entry's build lock, its merged model complete in its temporary
    folder; B, waiting on that lock, goes on, while A, ended, is not collected by its parent (this audit) until B
    ends (a sweep's driver polling its children now and then). And A killed mid-write of an output (and collected),
    B then writing the same output."""
    import signal

    from symmerge.io.cache import damage

    t0 = time.perf_counter()
    case = Case(audit, "A killed holding a LoRA cache entry's lock; B waiting on it")
    argv = merge_argv("L0", "L1", "OUT", "--lora-merge-cache", str(case.path("C")))
    argv[1] = "in/L0+in/ad"
    a = case.launch(Proc("a", _sub(argv, case.path("o")), hold="rename:L0+ad"))
    problems, observed = [f"a never held: {a.err[-300:]}"], ""
    if case.wait_for(["a"], [a]):
        b = case.launch(Proc("b", _sub(argv, case.path("x"))))
        deadline = time.monotonic() + 120
        while "waiting for it" not in (case.dir / "b.err").read_text() and b.popen.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        a.popen.send_signal(signal.SIGKILL)
        case.finish(b)  # A is collected only then: its driver (this audit) had not waited for it yet
        case.finish(a)
        entries = sorted(p.name for p in case.path("C").iterdir())
        problems = [succeeded(b), None if len(entries) == 1 else f"cache holds {entries}"]
        problems += [damage(case.path("C") / e) for e in entries if not e.startswith(".")]
        observed = (f"a rc {a.rc} (killed), b rc {b.rc} after waiting: {'waiting for it' in b.err}; "
                    f"cache: {entries}")
    audit.row(case.key, "B builds the entry itself once A is gone; one valid entry, nothing of A's left", problems,
              observed, time.perf_counter() - t0)
    t0 = time.perf_counter()
    case = Case(audit, "A killed mid-write of an output; B writes it")
    a = case.launch(Proc("a", merge_argv("L0", "L1", str(case.path("x"))), hold="rename:.x.symmerge-tmp-"))
    problems, observed = [f"a never held: {a.err[-300:]}"], ""
    if case.wait_for(["a"], [a]):
        a.popen.send_signal(signal.SIGKILL)
        case.finish(a)
        left = left_behind(case.dir, "x")
        b = case.run(Proc("b", merge_argv("L0", "L1", str(case.path("x")))))
        notes = [line for line in b.err.splitlines() if line.startswith("note: removed")]
        problems = [succeeded(b), f"left: {left_behind(case.dir, 'x')}" if left_behind(case.dir, "x") else None,
                    None if notes else "no note of the removed folder"]
        observed = f"A left {left}; b rc {b.rc}: {short(notes[0]) if notes else '-'}"
    audit.row(case.key, "B writes it, removing A's temporary folder with one note; nothing left", problems, observed,
              time.perf_counter() - t0)


def case_single_view(audit: Audit) -> None:
    """A merges a single .safetensors file named lora-N (N the id of no running process): its folder view in TMPDIR;
    B, a merge of an adapter, cleans the temporary LoRA caches of gone processes while A is held."""
    t0 = time.perf_counter()
    case = Case(audit, "single-file input lora-N of A live; B merges an adapter")
    single = next((audit.inp / "single").glob("lora-*.safetensors"))
    first = merge_argv("L1", "L0", str(case.path("o")))
    first[1] = str(single)
    a = case.launch(Proc("a", first, hold="rename:.o.symmerge-tmp-"))
    if not case.wait_for(["a"], [a]):
        case.finish(a)
        audit.row(case.key, "", [f"a never held: {a.err[-300:]}"], "", time.perf_counter() - t0)
        return
    views = [p for p in audit.tmp.iterdir() if single.stem in p.name]
    argv = merge_argv("L0", "L1", str(case.path("x")))
    argv[1] = "in/L0+in/ad"
    b = case.run(Proc("b", argv))
    kept = [p for p in views if p.is_dir()]
    case.release(a)
    case.finish(a)
    held = views and kept == views
    problems = [succeeded(a), succeeded(b), None if held else f"A's view {[p.name for p in views]} removed by B"]
    audit.row(case.key, "A's view folder left alone; both rc 0", problems,
              f"a rc {a.rc}, b rc {b.rc}; A's view {[p.name[:24] for p in views]} "
              f"{'kept' if held else 'removed'}", time.perf_counter() - t0)


def case_stale(audit: Audit) -> None:
    """Folders of a process that is gone: removed by the next run (the next merge of an adapter; the next writer of
    that output)."""
    t0 = time.perf_counter()
    case = Case(audit, "stale folders of a gone process")
    gone = subprocess.Popen(["true"])
    gone.wait()
    pid = gone.pid
    lora = audit.tmp / f"symmerge-lora-{pid}-abcd"
    (lora / "m").mkdir(parents=True)
    out = case.path("o")
    temp = case.dir / f".o.symmerge-tmp-{pid}-wxyz"
    temp.mkdir()
    argv = merge_argv("L0", "L1", "OUT")
    argv[1] = "in/L0+in/ad"
    b = case.run(Proc("b", _sub(argv, out)))
    problems = [succeeded(b), f"{lora.name} left" if lora.exists() else None, f"{temp.name} left" if temp.exists()
                else None]
    audit.row(case.key, "both removed, the merge rc 0", problems, f"rc {b.rc}; removed: {not lora.exists()}, "
              f"{not temp.exists()}", time.perf_counter() - t0)


def case_name_cache(audit: Audit) -> None:
    t0 = time.perf_counter()
    case = Case(audit, "merge x4 --mode stream, one fresh name cache")
    root = case.path("root")
    argvs = [merge_argv("L0", f"L{1 + i % 2}", "OUT", "--mode", "stream") for i in range(4)]
    refs = [audit.lone(json.dumps(a), a) for a in argvs]
    procs = [Proc(f"p{i}", _sub(a, case.path(f"o{i}")), env={"SYMMERGE_CACHE": str(root)})
             for i, a in enumerate(argvs)]
    case.together(procs)
    problems = [succeeded(p) for p in procs]
    problems += [f"o{i} differs" for i in range(4) if digest(case.path(f"o{i}")) != refs[i]]
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    for f in files:
        try:
            assert isinstance(json.loads(f.read_text()), dict) and f.suffix == ".json"
        except (AssertionError, ValueError):
            problems.append(f"{f.name}: not a name-cache entry")
    audit.row(case.key, "all rc 0, equal to lone runs; every entry a JSON object, no temp file", problems,
              f"rc {[p.rc for p in procs]}; {len(files)} files in names/", time.perf_counter() - t0)


def case_numba(audit: Audit) -> None:
    t0 = time.perf_counter()
    case = Case(audit, "merge ties x3, one fresh NUMBA_CACHE_DIR")
    numba = case.path("numba")
    argv = ["merge", "in/L1", "in/L2", "--base", "in/L0", "--method", "ties", "--align", "none", "-o", "OUT",
            "--progress", "none", "-q"]
    ref = audit.lone("ties", argv)
    procs = case.together([Proc(f"p{i}", _sub(argv, case.path(f"o{i}")), env={"NUMBA_CACHE_DIR": str(numba)})
                           for i in range(3)])
    again = case.run(Proc("again", _sub(argv, case.path("o3")), env={"NUMBA_CACHE_DIR": str(numba)}))
    problems = [succeeded(p) for p in [*procs, again]]
    problems += [f"o{i} differs" for i in range(4) if case.path(f"o{i}").is_dir() and
                 digest(case.path(f"o{i}")) != ref]
    tmps = [p.name for p in numba.rglob("*") if "tmp" in p.name]
    problems.append(f"numba temp files left: {tmps[:3]}" if tmps else None)
    audit.row(case.key, "all rc 0, equal to a lone run's; a 4th run after them rc 0 from the cache", problems,
              f"rc {[p.rc for p in procs]} then {again.rc} ({again.seconds:.1f} s); "
              f"{sum(1 for _ in numba.rglob('*.nbi'))} index files", time.perf_counter() - t0)


def case_real(audit: Audit) -> None:
    """The cached MiniLMs (two fine-tunes of all-MiniLM-L6-v2) and the demo's cached ViTs (the user's cache root)."""
    from symmerge.io.cache import cache_root

    user = {"SYMMERGE_CACHE": os.environ.get("SYMMERGE_CACHE") or str(Path.home() / ".cache" / "symmerge")}
    root = Path(user["SYMMERGE_CACHE"])
    minilms = sorted(p for p in root.glob("minilm-*-*") if (p / "model.safetensors").is_file())
    if len(minilms) >= 2:
        argv = ["merge", str(minilms[0]), str(minilms[1]), "--method", "average", "--align", "none", "-o", "OUT",
                "--progress", "none", "-q"]
        same_output(audit, "real MiniLM merge x2, one -o", [argv, argv], "two merges of the cached MiniLMs")
    del cache_root
    t0 = time.perf_counter()
    case = Case(audit, "real demo --quick x2, one -o (cached ViTs)")
    out = case.path("demo")
    procs = case.together([Proc(f"p{i}", ["demo", "--quick", "-o", str(out), "--progress", "none"], env=user)
                           for i in range(2)])
    ok = [p for p in procs if p.rc == 0]
    problems = [succeeded(p) if p.rc != 2 else refusal(p) for p in procs]
    problems.append(None if ok else "no run succeeded")
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    problems.append(None if files == ["demo.json", "demo.png"] else f"output holds {files}")
    if "demo.json" in files:
        json.loads((out / "demo.json").read_text())
    problems.append(f"left: {left_behind(case.dir, 'demo')}" if left_behind(case.dir, "demo") else None)
    late = [p.name for p in procs if p.rc != 0 and (case.dir / f"{p.name}.out").read_text().strip()]
    problems.append(f"{late} refused only after its work (its table printed)" if late else None)
    lines = {short(error_lines(p.err)[0]) for p in procs if p.rc != 0 and error_lines(p.err)}
    audit.row(case.key, "one complete output (demo.json, demo.png); the other rc 0 or one clear refusal before "
              "its work", problems,
              f"rc {[p.rc for p in procs]}; {'; '.join(lines) or 'no error line'}; "
              f"{max(p.seconds for p in procs):.1f} s", time.perf_counter() - t0)


CASES = [case_same_output, case_new_parent, case_mid_write, case_published, case_lora_cache,
         lambda a: case_temp_cache(a, [], "LoRA temp cache of A live; B merges an adapter"),
         lambda a: case_temp_cache(a, ["unshare", "-Urpf", "--mount-proc"],
                                   "LoRA temp cache of A live; B merges an adapter in another PID namespace"),
         case_single_view, case_stale, case_killed, case_name_cache, case_numba, case_real]


def _rows(files: str) -> dict:
    """The rows of the runs ``files`` (comma-separated ``--json`` files; a later file's row replaces an earlier one's
    of the same case: a case run again), by case, in the first file's order."""
    rows = {}
    for f in files.split(","):
        rows.update({r["case"]: r for r in json.loads(Path(f).read_text())["rows"]})
    return rows


def table(before: str, after: str) -> None:
    """The rows of two runs (``--json``, each side maybe ``RUN,RERUN...``) side by side, as
    docs/results/concur_audit.md shows them."""
    rows = _rows(before)
    print("| # | case | expected | before | after |\n|---|---|---|---|---|")
    for i, r in enumerate(_rows(after).values(), 1):
        b = rows.get(r["case"])
        was = "not run" if b is None else ("held" if b["held"] else "**failed**") + f": {b['observed']}"
        now = ("held" if r["held"] else "**failed**") + f": {r['observed']}"
        print(f"| {i} | {r['case']} | {r['expected']} | {was} ({b['seconds'] if b else '-'} s) | {now} "
              f"({r['seconds']} s) |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    if len(sys.argv) == 4 and sys.argv[1] == "--table":
        return table(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run the case functions whose name holds this text")
    ap.add_argument("--no-real", action="store_true", help="leave out the real-model cases")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--package", help="a folder holding another symmerge/ (e.g. git archive of main): the processes "
                    "run it")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="concur-audit-"))
    started, load = time.perf_counter(), Path("/proc/loadavg").read_text().split()[:3]
    audit = Audit(work, not args.no_real)
    if args.package:
        audit.env["PYTHONPATH"] = f"{Path(args.package).resolve()}:{audit.env['PYTHONPATH']}"
    try:
        make_inputs(audit.inp)
        print("| # | case | expected | observed | held? | s |\n|---|---|---|---|---|---|", flush=True)
        for fn in CASES:
            name = getattr(fn, "__name__", "")
            if fn is case_real and args.no_real:
                continue
            if args.only and args.only not in name and not (name == "<lambda>" and args.only in "case_temp_cache"):
                continue
            fn(audit)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder: {work}")
    end = Path("/proc/loadavg").read_text().split()[:3]
    held = sum(r["held"] for r in audit.rows)
    print(f"\n{held} / {len(audit.rows)} held; {time.perf_counter() - started:.0f} s; load {' '.join(load)} -> "
          f"{' '.join(end)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": audit.rows, "seconds": time.perf_counter() - started,
                                               "load_start": load, "load_end": end}, indent=1) + "\n")


if __name__ == "__main__":
    main()
