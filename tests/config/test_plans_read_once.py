"""Each input read once by its plan (issue 39 item 2): ``symmerge run`` plans an aligned config once (the plan
``config/aligned.align_job`` made is the one the report records, not a second ``plan_alignment``); ``align``'s plan
keeps a pickle checkpoint it had to load (no headers) for the alignment, which does not load it again; a streamed
plan reads only the tensors per-layer binding needs (Qwen3's QK norms), not every one-dimensional tensor that the
streamed alignment then reads once more."""

from __future__ import annotations

import json

import pytest
import torch

import mergekit_oracle as mo
from conftest import run_cli
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_run_plans_an_aligned_config_once(tmp_path, monkeypatch, mode):
    from symmerge.config import aligned

    a, b = (str(mo.family(tmp_path / f"m{s}", "llama", "float32", n=0, layers=2, seed=s)[0]) for s in (0, 7))
    calls = []
    planner = aligned.plan_alignment

    def counted(job, spec):
        calls.append(job.name)
        return planner(job, spec)

    monkeypatch.setattr(aligned, "plan_alignment", counted)
    cfg = tmp_path / "aligned.yml"
    models = ", ".join(f"{{model: {m}, parameters: {{weight: {w}}}}}" for m, w in ((a, 0.3), (b, 0.7)))
    cfg.write_text(f"merge_method: linear\nmodels: [{models}]\nalign: [attn, ffn]\nmode: {mode}\n")
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none") == 0
    assert len(calls) == 1, calls
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["alignment"]["mode"] == mode and report["plan"]["frame"] == "star"  # the plan align_job made


def test_align_reads_a_pickle_checkpoint_once(tmp_path, monkeypatch):
    from symmerge.io import reader
    from symmerge.pipeline import align as align_module
    from symmerge.pipeline.options import AlignOptions
    from symmerge.pipeline.to_folder import align_to_folder

    model, anchor = (make_model("llama", head=True, dtype=torch.float32, seed=s) for s in (0, 1))
    for m, name in ((model, "pkl"), (anchor, "anchor")):
        m.save_pretrained(str(tmp_path / name))
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "pkl" / "pytorch_model.bin")
    (tmp_path / "pkl" / "model.safetensors").unlink()  # a pickle checkpoint: no headers to plan from
    loads = []
    loader = align_module.load_model

    def counted(path, *args, **kwargs):
        loads.append(str(path))
        return loader(path, *args, **kwargs)

    monkeypatch.setattr(align_module, "load_model", counted)  # the wing's loads
    monkeypatch.setattr(reader, "load_model", counted)  # the plan's (pipeline/bound.py: as_model)
    report = align_to_folder(tmp_path / "pkl", tmp_path / "anchor", tmp_path / "out",
                             AlignOptions(symmetries="attn,ffn,residual"), allow_pickle=True, progress=False)
    assert loads.count(str(tmp_path / "pkl")) == 1, loads
    assert report["distance_after"] < report["distance_before"] and report["verify_max_rel_diff"] < 1e-4


@pytest.mark.parametrize("family,needed", [("llama", 0), ("qwen3", 4)])
def test_a_streamed_plan_reads_only_what_binding_needs(tmp_path, monkeypatch, family, needed):
    """Qwen3 binds its QK norms by value (2 layers × q_norm, k_norm); a Llama reads no tensor to be planned."""
    from symmerge.io.checkpoint import LazyCheckpoint
    from symmerge.pipeline.align_plan import plan_align
    from symmerge.pipeline.options import AlignOptions

    for seed in (0, 1):
        make_model(family, head=True, dtype=torch.float32, seed=seed).save_pretrained(str(tmp_path / f"{seed}"))
    read = []
    reader = LazyCheckpoint.read

    def counted(self, keys, *args, **kwargs):
        read.extend(keys)
        return reader(self, keys, *args, **kwargs)

    monkeypatch.setattr(LazyCheckpoint, "read", counted)
    plan = plan_align(tmp_path / "0", tmp_path / "1", AlignOptions(symmetries="recommended"), stream=True)
    assert plan.instances and len(read) == needed, read
    assert all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in read)
