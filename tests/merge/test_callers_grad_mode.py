"""A caller's ``torch.no_grad()``, ``torch.inference_mode()`` or default dtype around a symmerge call (a service's
inference code, a notebook cell) does not change what it computes: Fisher's statistics and the learned alignment take
their gradients as without it (a RuntimeError, "element 0 of tensors does not require grad", before), and draw the
same numbers (benchmarks/procstate_audit.py)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from conftest import npz_file, run_cli, vit_folder

pytestmark = pytest.mark.usefixtures("single_thread")

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(scope="module")
def vits(tmp_path_factory):
    root = tmp_path_factory.mktemp("grad-mode")
    return vit_folder(root / "a", 1), vit_folder(root / "b", 2), npz_file(root / "data.npz", n=16)


def _bytes(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("mode", MODES)
def test_fisher_merge_under_the_callers_grad_mode(vits, mode, tmp_path, capsys):
    a, b, data = vits
    argv = ["merge", a, b, "--method", "fisher", "--data", data, "--eval-data", data, "--align", "none", "-q"]
    assert run_cli(*argv, "-o", tmp_path / "plain") == 0
    with MODES[mode]():
        assert run_cli(*argv, "-o", tmp_path / "inside") == 0, capsys.readouterr().err
    assert _bytes(tmp_path / "inside") == _bytes(tmp_path / "plain")
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


@pytest.mark.parametrize("mode", MODES)
def test_learned_alignment_under_the_callers_grad_mode(vits, mode):
    import symmerge

    a, b, data = vits
    options = symmerge.AlignOptions(symmetries="attn,ffn", match="learned", align_data=data, align_samples=16,
                                    learn=symmerge.LearnSettings(steps=2, seed=0, batch=8))
    plain = symmerge.align_pair(str(a), str(b), options).model.state_dict()
    with MODES[mode]():
        inside = symmerge.align_pair(str(a), str(b), options).model.state_dict()
        assert not torch.is_grad_enabled()  # the caller's mode, back after the call
    assert all(torch.equal(plain[k], inside[k]) for k in plain)


def test_learned_alignment_under_the_callers_default_dtype(vits):
    """A caller's ``torch.set_default_dtype(torch.float64)`` does not change the learned alignment: its random draws
    (augmentation flips and mixes, the interpolation's alpha) were made in the default dtype, float64 draws from the
    same seed, and another alignment came out."""
    import symmerge

    a, b, data = vits
    options = symmerge.AlignOptions(symmetries="attn,ffn", match="learned", align_data=data, align_samples=16,
                                    learn=symmerge.LearnSettings(steps=3, seed=0, batch=8))
    plain = symmerge.align_pair(str(a), str(b), options).model.state_dict()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        inside = symmerge.align_pair(str(a), str(b), options).model.state_dict()
    finally:
        torch.set_default_dtype(default)
    assert all(torch.equal(plain[k], inside[k]) for k in plain)
