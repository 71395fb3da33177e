"""One result however a merge is computed (benchmarks/repro_audit.py, docs/results/repro_audit.md): the same merge in
memory and streamed reports the same distances (over the body: a language model's merged head is no part of them,
in either wing) and writes the same file, byte for byte, from single-file or sharded inputs (safetensors' own
layout: by dtype, then name, the metadata first)."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from factories import make_model
from test_bad_input import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_models() -> dict:
    """A tiny Llama with its LM head (merged by the default head policy): a base and two fine-tunes."""
    out = {"base": make_model("llama", head=True, dtype=torch.float32)}
    for i in (1, 2):
        m = make_model("llama", head=True, dtype=torch.float32)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        out[i] = m
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The models saved single-file ("one") and in several shards each ("sharded": in the model's order, the
    LM head last though its name sorts first)."""
    root = tmp_path_factory.mktemp("repro")
    out = {"one": {}, "sharded": {}}
    for k, m in tiny_models().items():
        for layout, shard in (("one", {}), ("sharded", {"max_shard_size": 20_000})):
            out[layout][k] = root / layout / f"m{k}"
            m.save_pretrained(str(out[layout][k]), **shard)
    index = json.loads((out["sharded"][1] / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["lm_head.weight"] != index["model.embed_tokens.weight"]
    return out


@pytest.fixture(scope="module")
def folders(saved):
    return saved["one"]


@pytest.fixture(scope="module")
def sharded(saved):
    return saved["sharded"]


def merged(capsys, folders, out, *flags) -> dict:
    rc, _, err = run_cli(capsys, "merge", folders[1], folders[2], "--progress", "none", "-o", out, *flags)
    assert rc == 0, err
    return json.loads((out / "symmerge_report.json").read_text())


@pytest.mark.parametrize("method,flags", [("average", []), ("ties", ["--param", "density=0.5"])])
def test_memory_and_stream_report_the_same_distances_over_the_body(folders, tmp_path, capsys, method, flags):
    args = ["--method", method, "--align", "none", *flags, *(["--base", folders["base"]] if method == "ties" else [])]
    mem = merged(capsys, folders, tmp_path / "memory", *args, "--mode", "memory")
    stream = merged(capsys, folders, tmp_path / "stream", *args, "--mode", "stream")
    assert mem["head"]["policy"] == stream["head"]["policy"] == "merge"  # the LM head is merged in both
    for field in ("distance_result_to_inputs", "distances_between_inputs"):
        a, b = mem[field], stream[field]
        if field == "distances_between_inputs":
            a, b = a["after_alignment"], b["after_alignment"]
        assert a.keys() == b.keys()
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=1e-9), (field, k, a[k], b[k])


def file_bytes(folder) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("method,params", [("average", []), ("ties", ["--param", "density=0.5"]),
                                           ("ties", ["--param", "density=0.5", "--param", "scope=model"])])
def test_the_same_bytes_from_sharded_inputs_and_in_memory(folders, sharded, tmp_path, capsys, method, params):
    """The output file of one merge is the same file, byte for byte, whether its inputs were single files or
    shards, and whether it was merged streamed or in memory (one output file: the layout safetensors writes; a
    model-wide threshold, ``scope=model``, samples the tensors in that one order too)."""
    def args(where):
        return ["--method", method, *params, "--align", "none",
                *(["--base", where["base"]] if method == "ties" else [])]

    single = tmp_path / "single"
    merged(capsys, folders, single, *args(folders), "--mode", "stream")
    from_shards = tmp_path / "shards"
    rc, _, err = run_cli(capsys, "merge", sharded[1], sharded[2], "--progress", "none", "-o", from_shards,
                         *args(sharded), "--mode", "stream")
    assert rc == 0, err
    memory = tmp_path / "memory"
    merged(capsys, folders, memory, *args(folders), "--mode", "memory")
    assert file_bytes(single) == file_bytes(from_shards)
    assert file_bytes(single) == file_bytes(memory)


def test_planned_writer_writes_the_layout_safetensors_writes(tmp_path):
    """Tensors of every dtype in safetensors' own order, the metadata first: the file ``save_file`` writes."""
    from safetensors.torch import save_file

    from symmerge.io.checkpoint import PlannedWriter
    from symmerge.merge.steps import file_order

    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.int32,
              torch.float32, torch.float64, torch.int64]
    g = torch.Generator().manual_seed(0)
    tensors = {f"t.{i % 3}.{dt}".replace("torch.", ""): (torch.randn(3, 2, generator=g) * 10).to(dt)
               for i, dt in enumerate(dtypes)}
    save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    order = file_order(list(tensors), lambda k: tensors[k].dtype)
    (tmp_path / "out").mkdir()
    writer = PlannedWriter(tmp_path / "out", [(k, tensors[k].dtype, tuple(tensors[k].shape)) for k in order],
                           max_bytes=1 << 30)
    for k in order:
        writer.add(k, tensors[k])
    assert writer.close() == ["model.safetensors"]
    assert ((tmp_path / "out" / "model.safetensors").read_bytes()
            == (tmp_path / "reference.safetensors").read_bytes())


def test_a_mergekit_config_writes_the_file_the_command_line_writes(folders, tmp_path, capsys):
    """``symmerge run`` of a mergekit config and ``symmerge merge --align none`` of the same merge: one file, byte
    for byte (the config plans mergekit's order: embeddings, layers, the rest; the executor writes safetensors')."""
    config = tmp_path / "ties.yml"
    config.write_text(f"merge_method: ties\nbase_model: {folders['base']}\nmodels:\n"
                      f"  - model: {folders[1]}\n    parameters: {{weight: 1.0}}\n"
                      f"  - model: {folders[2]}\n    parameters: {{weight: 1.0}}\nparameters: {{density: 0.5}}\n")
    rc, _, err = run_cli(capsys, "run", config, tmp_path / "config", "--no-write-model-card")
    assert rc == 0, err
    merged(capsys, folders, tmp_path / "flags", "--method", "ties", "--param", "density=0.5", "--align", "none",
           "--base", folders["base"])
    assert file_bytes(tmp_path / "config") == file_bytes(tmp_path / "flags")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> dict:
    """A tiny Mixtral (transformers fuses its experts in memory; the files store one tensor per expert): a base and
    two fine-tunes."""
    root = tmp_path_factory.mktemp("repro-moe")
    out = {}
    for k in ("base", 1, 2):
        m = make_model("mixtral", head=True, dtype=torch.float32)
        if k != "base":
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
        out[k] = root / f"m{k}"
        m.save_pretrained(str(out[k]))
    return out


@pytest.mark.parametrize("method,params", [("ties", ["--param", "density=0.5"]),
                                           ("dare_ties", ["--param", "density=0.5"]), ("model_stock", [])])
def test_a_mixture_of_experts_merges_per_stored_tensor_in_memory_as_streamed(mixtral, tmp_path, capsys, method,
                                                                           params):
    """A per-tensor method reads each expert's stored tensor on its own in both wings (a TIES threshold, DARE's
    seeded mask, Model Stock's angle of one expert's ``w1``), not the fused (experts, 2·ffn, d) tensor in memory."""
    args = ["--method", method, *params, "--align", "none", "--base", mixtral["base"]]
    merged(capsys, mixtral, tmp_path / "memory", *args, "--mode", "memory")
    merged(capsys, mixtral, tmp_path / "stream", *args, "--mode", "stream")
    a, b = outputs(tmp_path / "memory"), outputs(tmp_path / "stream")
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert file_bytes(tmp_path / "memory") == file_bytes(tmp_path / "stream")


def outputs(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_auto_says_when_the_memory_free_chose_a_streamed_alignment(folders, tmp_path, capsys, monkeypatch):
    """``--mode auto`` aligns in memory when the models fit in half the memory available, else streamed (the groups
    that stream): two results for one command, chosen by the memory free at the time. The streamed one says so, and
    how to get one result."""
    from symmerge.core import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 1000)  # the models do not fit
    report = merged(capsys, folders, tmp_path / "out", "--method", "average")
    assert report["plan"]["mode"] == "stream" and report["plan"]["why"].startswith("auto:")
    assert "--mode stream or --mode memory" in report["alignment"]["note"]
    rc, _, err = run_cli(capsys, "merge", folders[1], folders[2], "--method", "average", "--progress", "none",
                         "-o", tmp_path / "again")
    assert rc == 0 and "note: --mode auto streamed this aligned merge" in err


@pytest.mark.parametrize("mode", ["auto", "memory"])
def test_one_model_is_not_aligned_against_itself(folders, tmp_path, capsys, mode):
    """``merge M --method passthrough`` (one model, no base, no anchor of its own): 'recommended' has nothing to align
    it to. Before, in memory the residual group folded the model's norms into their readers (the same function,
    other weights: 16 of 21 tensors of a tiny Llama), streamed it was copied."""
    rc, _, err = run_cli(capsys, "merge", folders[1], "--method", "passthrough", "--mode", mode, "--progress", "none",
                         "-o", tmp_path / "out")
    assert rc == 0, err
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["alignment"]["symmetries"] == []
    a, b = outputs(tmp_path / "out"), outputs(folders[1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
