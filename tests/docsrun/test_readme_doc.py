"""Commands of README.md run as written that did not do what the README says, each test the README's promise on
tiny real Llama checkpoints (written as strict xfails when found, turned on with their fixes)."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


def _fine_tune(base, out):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("regex", [("-i", "embed"), ("-e", "proj")])
def test_extract_lora_regexes_leaving_no_lora_module(tmp_path, capsys, regex):
    """README: extract-lora 'Writes a PEFT LoRA adapter ... (`PeftModel.from_pretrained(base, OUT)` loads it)';
    a run that cannot write one is one error line and nothing written (as for an --sv-epsilon above every
    singular value)."""
    peft = pytest.importorskip("peft")
    from test_lora import make_base
    from transformers import AutoModelForCausalLM

    base = make_base(tmp_path / "base")
    ft = _fine_tune(base, tmp_path / "ft")
    out = tmp_path / "out"
    capsys.readouterr()
    code = run_cli("extract-lora", ft, base, "-o", out, "--rank", 4, *regex, "--progress", "none")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists() and len(err) == 1, err  # it wrote target_modules [], which PEFT refuses
    assert "leave no linear layer or embedding to decompose" in err[0], err
    assert run_cli("extract-lora", ft, base, "-o", out, "--rank", 4, "--progress", "none") == 0
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(out))  # without them: loads


def test_max_sweeps_cap_warning_is_one_line(tmp_path):
    """README (Alignment flags): '--max-sweeps N ... warns at the cap'; the command's warnings are 'warning:' lines,
    as every other warning of the CLI."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import vit_folder

    a, b = vit_folder(tmp_path / "a", 0), vit_folder(tmp_path / "b", 1)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "symmerge.cli", "align", a, b, "-o", tmp_path / "out", "--max-sweeps",
                           "1", "--progress", "none"], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "stopped at the cap of 1 sweeps" in line]
    assert len(lines) == 1 and "warning:" in lines[0], proc.stderr
    assert "UserWarning" not in proc.stderr and ".py:" not in proc.stderr, proc.stderr
