"""The command's start-up (issue 41: a tiny ``symmerge run`` is mostly start-up, and it counts against
mergekit's wall time). Guarded structurally, in child processes, not by timing: the command's imports run
without the cyclic garbage collector and their objects are frozen out of later collections
(:func:`symmerge._entry.collector_paused`), while a library import leaves the host's collector alone; and a
tiny ``run`` of a mergekit config (its tensor-name facts cached, as from its second run on) imports none of
the heavy packages it does not use."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import run_cli

# packages a mergekit config's plain merge never uses (plots, model classes, optimisers, adapters)
UNUSED = ("matplotlib", "transformers", "scipy.optimize", "peft", "sklearn", "PIL", "pandas")


def _child(code: str, argv0: str) -> dict:
    """``code`` run in a fresh interpreter whose ``sys.argv[0]`` is ``argv0`` (the console script's name or
    not); it leaves a dict in ``out``, printed as JSON on the last line."""
    script = f"import sys\nsys.argv[0] = {argv0!r}\n" + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


GC_STATE = """
import gc, json
{before}
import symmerge
out = {{"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "torch": "torch" in sys.modules}}
"""


@pytest.mark.parametrize("argv0", ["/usr/bin/symmerge", "symmerge-yaml"])
def test_the_command_imports_without_collections_then_collects_again(argv0):
    got = _child(GC_STATE.format(before=""), argv0)
    # the imports' objects frozen (torch alone makes hundreds of thousands), the collector on again
    assert got["torch"] and got["enabled"] and got["frozen"] > 100_000, got


def test_a_library_import_leaves_the_collector_alone():
    got = _child(GC_STATE.format(before=""), "my_script.py")
    assert got["torch"] and got["enabled"] and got["frozen"] == 0, got


def test_a_host_that_turned_the_collector_off_keeps_it_off():
    got = _child(GC_STATE.format(before="gc.disable()"), "symmerge")
    assert got["torch"] and not got["enabled"] and got["frozen"] == 0, got


def _llama(path, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


def test_a_tiny_run_imports_nothing_it_does_not_use(tmp_path):
    base, a, b = (_llama(tmp_path / n, s) for s, n in enumerate(("base", "a", "b")))
    cfg = tmp_path / "ties.yml"
    cfg.write_text(f"merge_method: ties\nbase_model: {base}\ndtype: bfloat16\nparameters: {{density: 0.5}}\n"
                   f"models:\n  - model: {a}\n    parameters: {{weight: 0.6}}\n"
                   f"  - model: {b}\n    parameters: {{weight: 0.4}}\n")
    # the first run of a config builds its tensor-name facts from transformers' model classes and caches them
    # (symmerge.io.names_cache; --print-plan reads headers only): the run measured is the next one. The warm-up runs
    # in this process (the cache is the session's folder, $SYMMERGE_CACHE_DIR, which the child inherits): only the
    # measured run needs a fresh interpreter
    assert run_cli("run", cfg, tmp_path / "plan", "--print-plan") == 0 and not (tmp_path / "plan").exists()
    out = tmp_path / "out"
    got = _child(f"""
        import gc, json
        from symmerge.cli import main
        rc = main(["run", {str(cfg)!r}, {str(out)!r}, "--progress", "none"])
        out = {{"rc": rc, "modules": sorted(sys.modules), "frozen": gc.get_freeze_count()}}
        """, "symmerge")
    assert got["rc"] == 0 and (out / "model.safetensors").is_file(), got["rc"]
    assert "numba" in got["modules"] and got["frozen"] > 0  # the run merged with the kernels, as a command
    loaded = [m for m in UNUSED if m in got["modules"]]
    assert not loaded, f"a tiny run imported {loaded}"


def test_numba_is_imported_at_the_first_kernel_call_and_every_kernel_then_is_its_dispatcher():
    """``symmerge.merge.kernels`` declares its kernels without importing numba (0.1–0.2 s, and its CPU target):
    the package and every kernel module import without it; the first call of any kernel imports it and puts a numba
    dispatcher in place of every declared stand-in, in every module naming one (kernels calling kernels compile);
    the results are the kernels' (the torch definition's bits: tests/merge/test_merge_kernels.py and others)."""
    got = _child("""
        import json
        import torch
        import symmerge, symmerge.merge
        from symmerge.merge import kernels, kernels_half, kernels_whole, sort_order
        from symmerge.merge.base import weighted_sum
        before = "numba" in sys.modules
        stand_ins = sorted(f"{m.__name__}.{k}" for m in (kernels, kernels_half, kernels_whole, sort_order)
                           for k, v in vars(m).items() if isinstance(v, kernels._Kernel))
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(10_007, generator=g).to(torch.bfloat16) for _ in range(3)]
        out = torch.empty(10_007, dtype=torch.bfloat16)
        kernels.average_into(xs, [0.2, 0.5, 0.3], out)
        import numba
        left = [f"{m.__name__}.{k}" for m in (kernels, kernels_half, kernels_whole, sort_order)
                for k, v in vars(m).items() if isinstance(v, kernels._Kernel)]
        dispatchers = all(isinstance(getattr(sys.modules[n.rpartition(".")[0]], n.rpartition(".")[2]),
                                     numba.core.dispatcher.Dispatcher) for n in stand_ins)
        out = {"before": before, "after": "numba" in sys.modules, "stand_ins": len(stand_ins), "left": left,
               "dispatchers": dispatchers,
               "equal": torch.equal(out, weighted_sum(xs, [0.2, 0.5, 0.3]).to(torch.bfloat16))}
        """, "my_script.py")
    assert not got["before"] and got["after"] and got["stand_ins"] > 40 and not got["left"], got
    assert got["dispatchers"] and got["equal"], got


def test_a_tiny_passthrough_run_imports_no_numba(tmp_path):
    """A merge that calls no kernel (passthrough: every tensor copied) never imports numba."""
    a = _llama(tmp_path / "a", 0)
    cfg = tmp_path / "pass.yml"
    cfg.write_text(f"merge_method: passthrough\ndtype: bfloat16\nslices:\n  - sources:\n"
                   f"    - model: {a}\n      layer_range: [0, 2]\n")
    run_cli("run", cfg, tmp_path / "plan", "--print-plan")  # the tensor-name facts cached, as for a second run (in
    # this process: the session's cache folder, which the child inherits)
    out = tmp_path / "out"
    got = _child(f"""
        import json
        from symmerge.cli import main
        rc = main(["run", {str(cfg)!r}, {str(out)!r}, "--progress", "none"])
        out = {{"rc": rc, "numba": "numba" in sys.modules}}
        """, "symmerge")
    assert got["rc"] == 0 and (out / "model.safetensors").is_file(), got
    assert not got["numba"], got
