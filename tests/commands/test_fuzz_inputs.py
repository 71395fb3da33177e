"""A seeded fuzz of what symmerge reads (issue 40): bytes and lengths flipped in safetensors headers, in
``config.json`` and in YAML configs, each case run through the command in this process. Every case must end
in exit 0 (a mutation that left a valid input) or 2 with one ``symmerge: error:`` line — never a traceback —
and a refused case leaves no output folder and no temporary folder; the inputs are never modified.

Bounded in time: ``SYMMERGE_FUZZ_SECONDS`` (default 90 when run with ``-m slow``, 15 in a run that does not
select the slow tests) and ``SYMMERGE_FUZZ_SEED`` (default 0); a failing
case is reported with its seed, its number and the mutation, to be replayed alone. ``.ci/run`` runs it in
a step of its own; locally::

    SYMMERGE_FUZZ_SECONDS=60 .venv/bin/python -m pytest -q -m slow tests/commands/test_fuzz_inputs.py
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import struct
import time
import traceback
from pathlib import Path

import pytest
import torch
import yaml

from symmerge.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

BUDGET = os.environ.get("SYMMERGE_FUZZ_SECONDS")  # seconds; default 90 under -m slow, else 15 (a default run)
SEED = int(os.environ.get("SYMMERGE_FUZZ_SEED", "0"))
CASE_SECONDS = 30  # one case over this is a failure too (work out of proportion to a few kilobytes of input)


def llama_folder(path: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


def tree_hash(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ mutations (each returns its description)


def flip_bytes(rng: random.Random, data: bytes, start: int, end: int, count: int) -> bytes:
    out = bytearray(data)
    for _ in range(count):
        i = rng.randrange(start, max(start + 1, min(end, len(out))))
        if i < len(out):
            out[i] = rng.randrange(256) if rng.random() < 0.5 else out[i] ^ (1 << rng.randrange(8))
    return bytes(out)


def mutate_safetensors(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    n = struct.unpack("<Q", data[:8])[0]
    kind = rng.choice(["length", "length-small", "header-bytes", "header-json", "truncate", "extend"])
    if kind == "length":
        new = rng.choice([0, 1, 7, n - 1, n + 1, n * 2, len(data), len(data) + 1, 2 ** 31, 2 ** 63, 2 ** 64 - 1])
        return struct.pack("<Q", max(0, new) % 2 ** 64) + data[8:], f"header length {n} -> {new}"
    if kind == "length-small":
        new = max(0, n + rng.randint(-16, 16))
        return struct.pack("<Q", new) + data[8:], f"header length {n} -> {new}"
    if kind == "header-bytes":
        count = rng.randint(1, 4)
        return flip_bytes(rng, data, 8, 8 + n, count), f"{count} byte(s) flipped in the header"
    if kind == "header-json":
        header = json.loads(data[8:8 + n])
        name = rng.choice(sorted(k for k in header if k != "__metadata__"))
        entry = header[name]
        field = rng.choice(["dtype", "shape", "data_offsets", "drop", "extra"])
        if field == "dtype":
            entry["dtype"] = rng.choice(["F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "X9", 3, None])
        elif field == "shape":
            entry["shape"] = rng.choice([[], [0], [1], entry["shape"][::-1], [-1, 4], [2 ** 40, 2 ** 40],
                                         entry["shape"] + [1], "32", None])
        elif field == "data_offsets":
            a, b = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[b, a], [a, a], [0, b], [a, b + 4], [a - 4, b], [a, 2 ** 62], [-1, b],
                                                [a], None])
        elif field == "drop":
            del header[name]
        else:
            header[name + ".extra"] = dict(entry)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text + data[8 + n:], f"{name}: {field} changed in the header"
    if kind == "truncate":
        cut = rng.randrange(0, len(data))
        return data[:cut], f"truncated to {cut} bytes"
    extra = rng.randint(1, 4096)
    return data + bytes(rng.randrange(256) for _ in range(extra)), f"{extra} bytes appended"


def mutate_value(rng: random.Random, value):
    """A replacement for one config.json value: bounded numbers (never a size that would allocate gigabytes
    in memory: that is the config cross-check's case, tested on its own), wrong types, nesting."""
    choices = [None, True, False, "", "abc", [], {}, [value], {"x": value}, -1, 0, 1, 2, 0.5, float("nan"),
               "NaN", "1e309", [1, 2, 3], "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]
    if isinstance(value, int) and not isinstance(value, bool):
        choices += [value + 1, value - 1, value * 2, -value, str(value), float(value)]
    return rng.choice(choices)


def mutate_config_json(rng: random.Random, text: str) -> tuple[str, str]:
    kind = rng.choice(["bytes", "truncate", "value", "drop", "type", "top", "deep"])
    if kind == "bytes":
        count = rng.randint(1, 4)
        return flip_bytes(rng, text.encode(), 0, len(text), count).decode("utf-8", "replace"), f"{count} byte(s)"
    if kind == "truncate":
        cut = rng.randrange(0, len(text))
        return text[:cut], f"truncated to {cut} characters"
    config = json.loads(text)
    key = rng.choice(sorted(config))
    if kind == "value":
        config[key] = mutate_value(rng, config[key])
        return json.dumps(config), f"{key} = {config[key]!r}"
    if kind == "drop":
        del config[key]
        return json.dumps(config), f"{key} removed"
    if kind == "type":
        config["model_type"] = rng.choice(["bert", "gpt2", "t5", "mixtral", "nope", "", None, 3, ["llama"], "LLAMA"])
        return json.dumps(config), f"model_type = {config['model_type']!r}"
    if kind == "top":
        top = rng.choice([[], [config], "llama", 3, None, True])
        return json.dumps(top), f"the whole file is {type(top).__name__}"
    depth = rng.choice([100, 10_000, 100_000])
    return "[" * depth + "]" * depth, f"nested {depth} deep"


SNIPPETS = ["&x ", "*x", "*nope", "!!python/object/apply:os.system ['true']", "!!binary AAAA", "<<: *x", "{", "}",
            "[", "]", "- ", ": ", "\t", "~", "null", "1e309", "-.inf", "'", '"', "---\n", "...\n", "%YAML 1.1\n",
            "? ", "|", ">", "#", ",", "\\x00", "\u2028", "0x1F", "0o17", "2001-12-14", "=", "!!set {a, b}",
            "!custom 1", "&a [*a]"]


def mutate_yaml(rng: random.Random, text: str) -> tuple[str, str]:
    lines = text.splitlines(keepends=True)
    kind = rng.choice(["bytes", "lines", "snippet", "value", "duplicate-key", "indent"])
    if kind == "bytes":
        count = rng.randint(1, 4)
        return flip_bytes(rng, text.encode(), 0, len(text), count).decode("utf-8", "replace"), f"{count} byte(s)"
    if kind == "lines":
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        op = rng.choice(["delete", "duplicate", "swap"])
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(j, lines[i])
        else:
            lines[i], lines[j] = lines[j], lines[i]
        return "".join(lines), f"line {i + 1}: {op}"
    if kind == "snippet":
        at = rng.randrange(len(text) + 1)
        snippet = rng.choice(SNIPPETS)
        return text[:at] + snippet + text[at:], f"{snippet!r} inserted at {at}"
    if kind == "indent":
        i = rng.randrange(len(lines))
        lines[i] = rng.choice(["  ", "\t", " "]) + lines[i] if rng.random() < 0.5 else lines[i].lstrip()
        return "".join(lines), f"line {i + 1} re-indented"
    data = yaml.safe_load(text)
    if kind == "duplicate-key":
        key = rng.choice(sorted(data))
        return text + f"{key}: {json.dumps(data[key])}\n", f"{key} given twice"
    path, node = [], data
    while isinstance(node, (dict, list)) and node and rng.random() < 0.8:
        k = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(k)
        if not isinstance(node[k], (dict, list)) or rng.random() < 0.3:
            node[k] = mutate_value(rng, node[k])
            break
        node = node[k]
    return yaml.safe_dump(data, sort_keys=False), f"value at {path} changed"


# ------------------------------------------------------------------ the run


def run_case(argv) -> tuple[int | None, str, str]:
    """(exit code or None for an escaped exception, stderr, the traceback)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([str(a) for a in argv])
        return rc, err.getvalue(), ""
    except SystemExit as e:  # argparse on a mutated argument: its one error line, exit 2
        return e.code if isinstance(e.code, int) else 1, err.getvalue(), ""
    except BaseException:  # noqa: BLE001 - the point of the test
        return None, err.getvalue(), traceback.format_exc()


def _short(trace: str) -> str:
    """The traceback's last three frames and its exception line."""
    lines = trace.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith("File ")]
    return "\n".join([lines[i] for i in frames[-3:]] + [lines[-1]])


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".symmerge-" in p.name or ".intermediates-" in p.name)


def test_fuzz_inputs(tmp_path, request):
    budget = float(BUDGET) if BUDGET else 90.0 if "slow" in (request.config.getoption("markexpr") or "") else 15.0
    rng = random.Random(SEED)
    clean = {name: llama_folder(tmp_path / "clean" / name, i) for i, name in enumerate("ab")}
    work = tmp_path / "work"
    failures, counts, t0, case = [], {"ok": 0, "refused": 0}, time.perf_counter(), 0
    while time.perf_counter() - t0 < budget and len(failures) < 40:
        case += 1
        if work.exists():
            shutil.rmtree(work)
        a, b = (shutil.copytree(clean[n], work / n) for n in "ab")
        target = rng.choice(["safetensors", "config.json", "yaml"])
        out = work / "out"
        if target == "safetensors":
            f = a / "model.safetensors"
            data, what = mutate_safetensors(rng, f.read_bytes())
            f.write_bytes(data)
        elif target == "config.json":
            f = a / "config.json"
            text, what = mutate_config_json(rng, f.read_text())
            f.write_text(text, encoding="utf-8", errors="surrogateescape")
        if target == "yaml":
            config = work / "merge.yml"
            base = (f"models:\n  - model: {a}\n    parameters:\n      weight: 0.6\n      density: 0.5\n"
                    f"  - model: {b}\n    parameters:\n      weight: 0.4\n      density: 0.5\n"
                    f"merge_method: {rng.choice(['linear', 'ties', 'slerp', 'task_arithmetic'])}\n"
                    f"base_model: {a}\nparameters:\n  t: 0.5\n  normalize: true\ndtype: float32\n")
            text, what = mutate_yaml(rng, base)
            config.write_text(text, encoding="utf-8", errors="surrogateescape")
            argv = ["run", config, out]
        else:
            argv = rng.choice([["merge", a, b, "-o", out, "--method", "linear", "--mode", "memory"],
                               ["merge", a, b, "-o", out, "--method", "linear", "--mode", "stream"],
                               ["merge", a, b, "-o", out, "--method", "ties", "--base", b, "--mode", "stream"],
                               ["align", a, b, "-o", out]])
        argv = [*argv, "--progress", "none"]
        before = {n: tree_hash(work / n) for n in "ab"}
        t = time.perf_counter()
        rc, err, trace = run_case(argv)
        seconds = time.perf_counter() - t
        label = f"seed {SEED} case {case}: {target}: {what}: symmerge {' '.join(map(str, argv[:2]))}"
        problem = None
        if trace:
            problem = f"traceback:\n{_short(trace)}"
        elif rc not in (0, 2):
            problem = f"exit {rc}: {err[-2000:]}"
        elif rc == 2:
            errors = [line for line in err.splitlines() if line.startswith("symmerge: error:")
                      or line.startswith(f"symmerge {argv[0]}: error:")]
            if not errors or "Traceback" in err:
                problem = f"no one-line error: {err[-2000:]}"
            elif out.exists():
                problem = "refused, yet an output folder exists"
        if problem is None and leftovers(work):
            problem = f"left behind: {leftovers(work)}"
        if problem is None and {n: tree_hash(work / n) for n in "ab"} != before:
            problem = "an input was modified"
        if problem is None and seconds > CASE_SECONDS:
            problem = f"took {seconds:.0f} s"
        if problem:
            failures.append(f"{label}: {problem}")
        else:
            counts["ok" if rc == 0 else "refused"] += 1
    print(f"fuzz: {case} cases in {time.perf_counter() - t0:.0f} s (seed {SEED}): {counts['ok']} accepted, "
          f"{counts['refused']} refused, {len(failures)} failed")
    assert case >= 10, "the budget ran out before ten cases"
    assert not failures, "\n\n".join(failures)
