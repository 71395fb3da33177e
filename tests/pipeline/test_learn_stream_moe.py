"""``align --stream --match learned`` of mixtures of experts stored per expert (Mixtral's ``experts.0.w1``, Qwen-MoE's
and OLMoE's ``experts.0.gate_proj``, …): the files were opened without the fused view the data-free stream reads
them through, so every such checkpoint was 'lacks tensor ...experts.gate_up_proj'; with it, the replayed
activation start refused the experts group ('activation matching by layer needs per-layer groups only'), whose kind
is fitted to the router's inputs over a whole pass. The experts are now solved on the weights, in their layer, as
beside the residual stream, and the output keeps the checkpoint's own per-expert names, loads and computes A's
function."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import make_inputs, output_rel_diff, run_cli
from learned_pair import save_pair
from symmerge.io.reader import load_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _stored_names(folder) -> set:
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    return names


@pytest.mark.parametrize("family,start", [("mixtral", "activations"), ("mixtral", "weights"),
                                         ("qwen3_moe", "activations"), ("olmoe", "activations")])
def test_stream_learned_aligns_experts_stored_per_expert(tmp_path, family, start):
    a, lines = save_pair(tmp_path, family)
    stored = _stored_names(tmp_path / "a")
    assert any(".experts.0." in k for k in stored)  # per expert on disk (transformers fuses them in memory)
    out = tmp_path / "out"
    assert run_cli("align", tmp_path / "a", tmp_path / "b", "-o", out, "--stream", "--align-data", lines,
                   "--match", "learned", "--learn-steps", "2", "--learn-batch", "4", "--learn-start", start,
                   "--progress", "none") == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert "experts" in report["symmetries"]
    assert report["distance_after"] < report["distance_before"]
    assert _stored_names(out) == stored  # written back under the checkpoint's own names
    moved = load_model(out)
    assert output_rel_diff(a, moved, make_inputs(a)) <= 1e-5  # function-preserving, checked outside symmerge
    before = load_model(tmp_path / "a").state_dict()
    key = next(k for k in moved.state_dict() if "experts" in k and k.endswith("down_proj"))
    assert not torch.equal(before[key], moved.state_dict()[key])  # the experts moved
