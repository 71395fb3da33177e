"""Faults a hostile-input probe of ``symmerge moe`` found (2026-12-03), each reproduced first:

* a base with huge (finite) values: its router rows' float32 norm overflowed and the row was called a zero row
  ("its prompts give a zero router row"); it is now normalised in float64 and the MoE is written;
* ``experts:`` with no value said "experts_per_token 2 is more than the 0 experts: ... set experts_per_token: 0",
  a value it refuses; it is the empty list's line;
* ``residual_scale: .nan`` failed late, as an overflow blamed on a model tensor; ``noise_scale`` was read and ignored
  (never type-checked): mergekit-moe adds N(0, σ²) to the expert's weights, and so does symmerge now (seeded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mergekit_oracle as mk
from test_config_faults import causal_lm, moe_config, with_value
from test_user_audit import one_error_line, run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamas")
    return {name: causal_lm(root / name, seed) for seed, name in enumerate(("a", "b"))}


def _huge(src: Path, dst: Path, key: str) -> Path:
    """``src`` with every entry of ``key`` times 1e30 (finite in float32; its squares overflow)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[key] = tensors[key] * 1e30
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("gate_mode,key", [("cheap_embed", "model.embed_tokens.weight"),
                                           ("hidden", "model.layers.0.mlp.down_proj.weight")])
def test_a_base_with_huge_values_gives_unit_router_rows(llamas, tmp_path, capsys, gate_mode, key):
    base = _huge(llamas["a"], tmp_path / "huge", key)
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "moe", moe_config(tmp_path / "c.yml", base, llamas["a"], llamas["b"],
                                                   gate_mode=gate_mode), out, "--progress", "none")
    assert rc == 0, err
    tensors = mk.tensors(out)
    gates = [t for k, t in tensors.items() if k.endswith("block_sparse_moe.gate.weight")]
    assert gates and all(torch.isfinite(g).all() and g.abs().max() > 0 for g in gates)


def test_experts_with_no_value_is_the_empty_list_s_line(llamas, tmp_path, capsys):
    config = tmp_path / "c.yml"
    config.write_text(f"base_model: {llamas['a']}\ngate_mode: random\nexperts:\n")
    rc, _, err = run_cli(capsys, "moe", config, tmp_path / "out", "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "expected a non-empty list of experts" in line and "experts_per_token" not in line, line


@pytest.mark.parametrize("key,value", [("residual_scale", ".nan"), ("residual_scale", ".inf"),
                                       ("noise_scale", ".nan"), ("noise_scale", "x"), ("noise_scale", "-0.5")])
def test_scales_that_are_not_finite_numbers_are_refused_at_their_line(llamas, tmp_path, capsys, key, value):
    config = tmp_path / "c.yml"
    section = "shared_experts" if key == "residual_scale" else "experts"
    config.write_text(f"base_model: {llamas['a']}\ngate_mode: random\nexperts_per_token: 1\nexperts:\n"
                      f"  - source_model: {llamas['b']}\n"
                      + (f"shared_experts:\n  - source_model: {llamas['b']}\n" if section == "shared_experts" else "")
                      + f"    {key}: {value}\n")
    rc, _, err = run_cli(capsys, "moe", config, tmp_path / "out", "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and f"{section}[0].{key}" in line and "line" in line, line
    assert not (tmp_path / "out").exists()


def test_noise_scale_adds_seeded_gaussian_noise_to_that_expert_only(llamas, tmp_path, capsys):
    config = tmp_path / "c.yml"
    config.write_text(f"base_model: {llamas['a']}\ngate_mode: random\nexperts:\n"
                      f"  - source_model: {llamas['b']}\n    noise_scale: 0.5\n  - source_model: {llamas['b']}\n")
    outs = {}
    for name, seed in (("one", "0"), ("again", "0"), ("other", "1")):
        rc, _, err = run_cli(capsys, "moe", config, tmp_path / name, "--random-seed", seed, "--progress", "none")
        assert rc == 0, err
        outs[name] = mk.tensors(tmp_path / name)
    source = mk.tensors(llamas["b"])
    key = "model.layers.1.block_sparse_moe.experts.{}.w1.weight"
    noise = outs["one"][key.format(0)] - source["model.layers.1.mlp.gate_proj.weight"]
    assert abs(noise.std().item() - 0.5) < 0.05 and abs(noise.mean().item()) < 0.05
    assert torch.equal(outs["one"][key.format(1)], source["model.layers.1.mlp.gate_proj.weight"])  # no noise asked
    assert all(torch.equal(outs["one"][k], outs["again"][k]) for k in outs["one"])  # seeded: repeatable
    assert not torch.equal(outs["one"][key.format(0)], outs["other"][key.format(0)])
