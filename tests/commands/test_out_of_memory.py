"""Running out of memory on the command line: one ``symmerge: error:`` line (not torch's, numpy's or Python's
traceback), exit 2, how much was asked for and the command's way out (a streamed mode, a smaller shard...), no
output and no temporary folder left, inputs untouched. The failure is injected (torch's own text, ``MemoryError``,
numpy's), raised inside the output's temporary folder after a file was written there; benchmarks/mem_audit.py runs
the real commands under memory caps (docs/results/mem_audit.md)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mergekit_oracle as mk
from commands.test_user_audit import one_error_line

TORCH_TEXT = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
              "to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")


def numpy_error():
    try:
        np.empty(2 ** 62, np.uint8)
    except MemoryError as e:  # numpy's _ArrayMemoryError: "Unable to allocate 4.00 EiB for an array ..."
        return e
    raise AssertionError("numpy allocated 4 EiB")


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("oom")
    folders = {}
    for seed, name in enumerate("ab"):
        torch.manual_seed(seed)
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(mk._config("llama", 2), dtype=torch.float32).save_pretrained(str(root / name))
        mk.save_tokenizer(root / name)
        folders[name] = root / name
    (root / "linear.yml").write_text("merge_method: linear\ndtype: float32\nmodels:\n" + "".join(
        f"  - model: {folders[n]}\n    parameters: {{weight: 0.5}}\n" for n in "ab"))
    (root / "moe.yml").write_text(f"base_model: {folders['a']}\ngate_mode: random\nexperts:\n" + "".join(
        f"  - source_model: {folders[n]}\n    positive_prompts: [w{5 + i}]\n" for i, n in enumerate("ab")))
    (root / "lines.txt").write_text("w5 w6 w7 w8 w9 w10\nw11 w12 w13 w14\n")
    folders["root"] = root
    return folders


def commands(m, out) -> dict[str, tuple[list, str]]:
    """name -> (command line, the way out its error line names)."""
    a, b, root = str(m["a"]), str(m["b"]), m["root"]
    quiet = ["--progress", "none"]
    return {
        "merge-memory": (["merge", a, b, "--method", "average", "--align", "none", "--mode", "memory", *quiet,
                          "-o", out], "--mode stream"),
        "merge-stream": (["merge", a, b, "--method", "average", "--align", "none", "--mode", "stream", *quiet,
                          "-o", out], "a smaller --shard-size"),
        "merge-aligned": (["merge", a, b, "--method", "average", "--workers", "1", *quiet, "-o", out],
                          "align first with symmerge align --stream"),
        "align-memory": (["align", b, a, "--workers", "1", *quiet, "-o", out], "align with --stream"),
        "align-stream": (["align", b, a, "--stream", *quiet, "-o", out], "a smaller --shard-size"),
        "run": (["run", root / "linear.yml", out, "-q"], "--out-shard-size"),
        "moe": (["moe", root / "moe.yml", out, "-q"], "--align-stream"),
        "extract-lora": (["extract-lora", b, a, "--rank", "2", *quiet, "-o", out], "--svd lowrank"),
        "barrier": (["barrier", a, b, "--data", root / "lines.txt", "--align", "none", "--points", "3", *quiet,
                     "-o", out], "--max-examples"),
    }


def fail_inside_output(monkeypatch, error) -> None:
    """Every writer's temporary output folder (:func:`symmerge.io.model.atomic_dir`, wherever a module imported it)
    gets a half-written file, then ``error`` is raised inside it: as an allocation failing while the output is
    written."""
    import importlib

    for name in ("symmerge.io.model", "symmerge.merge.executor", "symmerge.pipeline.stream",
                 "symmerge.config.moe_build", "symmerge.merge.extract_lora", "symmerge.merge.barrier"):
        importlib.import_module(name)
    import symmerge.io.model as io_model

    real = io_model.atomic_dir

    @contextlib.contextmanager
    def failing(out, *args, **kwargs):
        with real(out, *args, **kwargs) as tmp:
            yield tmp
            (Path(tmp) / "half.safetensors").write_bytes(b"\0" * 64)
            raise error

    for name, module in list(sys.modules.items()):
        if name.startswith("symmerge") and getattr(module, "atomic_dir", None) is real:
            monkeypatch.setattr(module, "atomic_dir", failing)


def files(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).rglob("*")}


@pytest.mark.parametrize("name", ["merge-memory", "merge-stream", "merge-aligned", "align-memory", "align-stream",
                                  "run", "moe", "extract-lora", "barrier"])
def test_torch_running_out_of_memory_is_one_line_naming_the_size_and_the_way_out(llamas, tmp_path, capsys,
                                                                                  monkeypatch, name):
    from symmerge.cli import main

    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    argv, way_out = commands(llamas, out)[name]
    before = files(llamas["root"])
    fail_inside_output(monkeypatch, RuntimeError(TORCH_TEXT))
    rc = main([str(a) for a in argv])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and line.startswith("symmerge: error: out of memory (an allocation of 68.7 GB failed)"), line
    assert way_out in line and "nothing was written" in line, line
    assert list(out.parent.iterdir()) == []  # no output, no temporary folder, no lock file
    assert files(llamas["root"]) == before


@pytest.mark.parametrize("error, words", [
    (MemoryError(), "out of memory;"),
    (numpy_error(), "out of memory (an allocation of 4.00 EiB failed)"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.7 GiB total capacity)"),
     "out of memory (an allocation of 2.00 GiB failed)")])
def test_python_numpy_and_cuda_running_out_of_memory_are_one_line_too(llamas, tmp_path, capsys, monkeypatch, error,
                                                                      words):
    from symmerge.cli import main

    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    argv, way_out = commands(llamas, out)["merge-memory"]
    fail_inside_output(monkeypatch, error)
    rc = main([str(a) for a in argv])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and line.startswith(f"symmerge: error: {words}") and way_out in line, line
    assert list(out.parent.iterdir()) == []


def test_memory_fault_recognises_the_allocators_and_nothing_else():
    from symmerge.io.output import memory_fault

    assert memory_fault(RuntimeError(TORCH_TEXT)) == "out of memory (an allocation of 68.7 GB failed)"
    assert memory_fault(MemoryError()) == "out of memory"
    try:  # raised while an allocation's failure was handled (a library's own error around it)
        try:
            raise MemoryError()
        except MemoryError:
            raise ValueError("could not convert")
    except ValueError as e:
        assert memory_fault(e) == "out of memory"
    assert memory_fault(OSError(12, "Cannot allocate memory")).startswith("out of memory")
    for other in (RuntimeError("shape mismatch"), ValueError("you tried to allocate 12 bytes"), KeyError("x"),
                  OSError(28, "No space left on device")):
        assert memory_fault(other) is None, other


MMAP_TEXT = "unable to mmap 276884560 bytes from file <{}>: Cannot allocate memory (12)"


@pytest.mark.parametrize("name", ["merge-memory", "merge-stream", "extract-lora"])
def test_an_input_that_cannot_be_mapped_for_lack_of_memory_is_not_called_corrupt(llamas, tmp_path, capsys,
                                                                                 monkeypatch, name):
    """Under a memory cap, mapping an input's weights fails with ENOMEM: it was 'model.safetensors: unreadable
    safetensors file, truncated or corrupt (unable to mmap ...)', which sends the user after a good file."""
    import safetensors

    from symmerge.cli import main

    def refused(path, *args, **kwargs):
        raise RuntimeError(MMAP_TEXT.format(path))

    monkeypatch.setattr(safetensors, "safe_open", refused)
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    argv, way_out = commands(llamas, out)[name]
    rc = main([str(a) for a in argv])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and line.startswith("symmerge: error: out of memory (mapping 276.9 MB of "), line
    assert "model.safetensors failed: the memory limit, ulimit -v or ulimit -d, counts a mapped input whole)" in line
    assert "corrupt" not in line and way_out in line, line
    assert list(out.parent.iterdir()) == []


def test_too_little_memory_to_load_torch_is_one_line_at_start_up(tmp_path):
    """Under ``ulimit -v`` too small for torch's libraries the loader refuses to map them: it was an ImportError's
    traceback (14 lines; numpy's, 54). A stand-in torch raising the loader's own text, first on the path."""
    import os
    import subprocess

    (tmp_path / "torch.py").write_text(
        "raise ImportError('libtorch_cpu.so: failed to map segment from shared object')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "symmerge.cli", "specs"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    line = one_error_line(p.stderr)
    assert p.returncode == 2, p.stderr
    assert line.startswith("symmerge: error: out of memory (a library could not be mapped: libtorch_cpu.so) while "
                           "starting"), line
