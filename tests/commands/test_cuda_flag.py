"""mergekit's ``--cuda`` / ``--gpu-rich`` have one meaning in ``run``, ``moe`` and ``extract-lora``: the GPU when
there is one; without one, one warning line naming the flag and the same result as on the CPU. ``run`` warned,
``moe`` failed at its hidden-state pass (only with ``gate_mode: hidden``; other gate modes ignored the flag in
silence) and ``extract-lora`` refused, each in its own words. ``--device cuda`` without a GPU stays one error."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli
from factories import make_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the flags use it")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-flag")
    for name, seed in (("base", 0), ("ft", 3)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(root / name)
    (root / "moe.yml").write_text(f"base_model: {root / 'base'}\ngate_mode: random\ndtype: float32\nexperts:\n"
                                  f"  - source_model: {root / 'base'}\n  - source_model: {root / 'ft'}\n")
    (root / "run.yml").write_text(f"merge_method: task_arithmetic\nbase_model: {root / 'base'}\nmodels:\n"
                                  f"  - model: {root / 'ft'}\n    parameters: {{weight: 0.5}}\n")
    return root


def _argv(command, root, out):
    return {"run": ["run", root / "run.yml", out],
            "moe": ["moe", root / "moe.yml", out],
            "extract-lora": ["extract-lora", root / "ft", root / "base", "-o", out, "--rank", "2"]}[command]


def _tensors(out):
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("command", ["run", "moe", "extract-lora"])
@pytest.mark.parametrize("flag", ["--cuda", "--gpu-rich"])
def test_a_gpu_flag_without_a_gpu_warns_once_and_gives_the_cpu_result(folders, tmp_path, capsys, command, flag):
    assert run_cli(*_argv(command, folders, tmp_path / "cpu"), "--progress", "none") == 0
    capsys.readouterr()
    assert run_cli(*_argv(command, folders, tmp_path / "flag"), flag, "--progress", "none") == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if "CUDA" in x]
    assert warned == [f"symmerge: warning: {flag}: no CUDA device here; running on the CPU"], warned
    cpu, flagged = _tensors(tmp_path / "cpu"), _tensors(tmp_path / "flag")
    assert cpu and cpu.keys() == flagged.keys() and all(torch.equal(cpu[k], flagged[k]) for k in cpu)


@pytest.mark.parametrize("command", ["run", "moe", "extract-lora"])
def test_device_cuda_without_a_gpu_is_one_error(folders, tmp_path, capsys, command):
    with pytest.raises(SystemExit) as refused:
        run_cli(*_argv(command, folders, tmp_path / "o"), "--device", "cuda")
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "no CUDA device is available" in err and err.count("\n") == 1 and not (tmp_path / "o").exists(), err
