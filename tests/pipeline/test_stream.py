"""Streaming alignment (``align --stream``): layer by layer from safetensors shards.

It must give the same aligned weights as the in-memory alignment (same solvers, same elements), keep
the function, write valid sharded HF folders, and refuse what it cannot do with one clear error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import add_noise, make_inputs, output_rel_diff, sq_dist, with_weights
from factories import DECODERS, DENSE, RMSNORM, STACKS, make_model
from symmerge.pipeline.align import align, instances_for
from symmerge.core.apply import apply, random_elements
from symmerge.io.checkpoint import LazyCheckpoint, ShardWriter, parse_size
from symmerge.cli import main
from symmerge.errors import SymmergeError
from symmerge.io.model import load_model
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.stream import align_streaming

pytestmark = pytest.mark.usefixtures("single_thread")


def _save(model, folder, shard="20KB"):
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size=shard)
    return folder


def _pair(kind, dtype, tmp_path, symmetries=("attn", "ffn", "rescale")):
    """A model and a disguised noisy copy (hidden group element + noise), saved sharded."""
    decoder = kind in DECODERS
    anchor = make_model(kind, head=decoder or kind in STACKS, dtype=dtype, seed=0,
                        tied=kind == "gpt2" if decoder else None)
    _, insts = instances_for(anchor)
    local = [i for i in insts if i.group.symmetry in symmetries and i.kind.per_layer]
    sd = apply(anchor.state_dict(), local, random_elements(local, torch.Generator().manual_seed(3)))
    model = with_weights(anchor, add_noise(sd, 0.01, seed=4)[0])
    return _save(model, tmp_path / "model"), _save(anchor, tmp_path / "anchor"), model, anchor


def _state(folder):
    ck = LazyCheckpoint(folder)
    return ck.read(ck.keys())


@pytest.mark.parametrize("pipeline", [False, True], ids=["low-memory", "pipeline"])
@pytest.mark.parametrize("kind", ["llama", "bert", "vit", "gpt2", "qwen3", *DENSE, *STACKS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stream_equals_in_memory_alignment(kind, dtype, pipeline, tmp_path):
    model_dir, anchor_dir, model, anchor = _pair(kind, dtype, tmp_path)
    expected, rep_mem = align(model, anchor, ("attn", "ffn", "rescale"))
    report = align_streaming(model_dir, anchor_dir, tmp_path / "out", shard_size="30KB", progress=False,
                             pipeline=pipeline)
    assert report["mode"] == ("pipeline" if pipeline else "low-memory")
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").is_file() and len(report["shards"]) > 1
    got = _state(out)
    want = expected.state_dict()
    for k, t in got.items():
        torch.testing.assert_close(t, want[k], rtol=1e-9 if dtype == torch.float64 else 1e-5,
                                   atol=1e-12 if dtype == torch.float64 else 1e-6)
    assert report["distance_after"] == pytest.approx(rep_mem["distance_after"], rel=1e-6)
    assert report["distance_after"] < 0.2 * report["distance_before"]
    reloaded = load_model(out)  # a valid HF folder of the same class
    assert type(reloaded) is type(model)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    if kind not in RMSNORM or dtype == torch.float32:  # RMSNorm computes in fp32 even in fp64 models
        assert output_rel_diff(model, reloaded, make_inputs(model)) < tol
    assert json.loads((out / "symmerge_report.json").read_text())["streamed"] is True


@pytest.mark.parametrize("heads", [False, True], ids=["paper", "heads"])
@pytest.mark.parametrize("kind", ["llama", "bert", "gpt2"])
def test_parts_split_a_layer_into_tensor_disjoint_parts(kind, heads, tmp_path):
    from symmerge.pipeline.engine import parts
    from symmerge.pipeline.options import AlignOptions
    from symmerge.pipeline.stream import layer_instances

    model_dir, _, _, _ = _pair(kind, torch.float32, tmp_path)
    opts = AlignOptions(symmetries=("heads", "attn", "ffn", "rescale") if heads else ("attn", "ffn", "rescale"))
    for insts in layer_instances(LazyCheckpoint(model_dir), opts=opts.solver_options())[1].values():
        split = parts(insts)
        keys = [{s.key for i in part for s in i.slots} for part in split]
        assert sorted(i.name for p in split for i in p) == sorted(i.name for i in insts)
        assert all(not (keys[i] & keys[j]) for i in range(len(keys)) for j in range(i + 1, len(keys)))
        # a part is connected: no split of it is tensor-disjoint
        for part in split:
            for cut in range(1, len(part)):
                left = {s.key for i in part[:cut] for s in i.slots}
                assert left & {s.key for i in part[cut:] for s in i.slots}
        # separate QK / VO / FFN parts, except where the head permutation couples QK and VO or GPT-2's
        # fused c_attn does
        assert len(split) == (2 if kind == "gpt2" or heads else 3)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # T5 (its tied self-attention heads): test_t5_tied_heads.py
def test_stream_with_head_permutation_equals_in_memory(kind, tmp_path):
    syms = ("heads", "attn", "ffn", "rescale")
    model_dir, anchor_dir, model, anchor = _pair(kind, torch.float64, tmp_path, symmetries=syms)
    expected, rep_mem = align(model, anchor, syms)
    report = align_streaming(model_dir, anchor_dir, tmp_path / "out", AlignOptions(symmetries=syms), shard_size="30KB",
                             progress=False)
    got, want = _state(tmp_path / "out"), expected.state_dict()
    for k, t in got.items():
        torch.testing.assert_close(t, want[k], rtol=1e-9, atol=1e-12)
    assert report["distance_after"] == pytest.approx(rep_mem["distance_after"], rel=1e-6)
    assert report["distance_after"] < 0.2 * report["distance_before"]


def test_stream_and_in_memory_reports_share_one_schema(tmp_path):
    model_dir, anchor_dir, model, anchor = _pair("bert", torch.float32, tmp_path)
    _, mem = align(model, anchor)
    streamed = align_streaming(model_dir, anchor_dir, tmp_path / "out", progress=False)
    common = {"family", "model_type", "symmetries", "rescale", "layers", "distance_before", "distance_after",
              "per_module", "per_layer", "streamed", "mode", "verify", "match_seconds", "seconds"}
    assert common <= set(mem) and common <= set(streamed)
    assert mem["streamed"] is False and streamed["streamed"] is True
    assert set(mem["per_module"]) == set(streamed["per_module"]) and set(mem["per_layer"]) == set(streamed["per_layer"])
    for name, d in mem["per_module"].items():
        assert streamed["per_module"][name]["after"] == pytest.approx(d["after"], rel=1e-5), name


def test_stream_layers_subset_and_passthrough(tmp_path):
    model_dir, anchor_dir, model, _ = _pair("bert", torch.float64, tmp_path)
    align_streaming(model_dir, anchor_dir, tmp_path / "out", AlignOptions(layers=[1]), progress=False)
    got, orig = _state(tmp_path / "out"), model.state_dict()
    assert torch.equal(got["encoder.layer.0.attention.self.query.weight"], orig["encoder.layer.0.attention.self.query.weight"])
    assert not torch.equal(got["encoder.layer.1.attention.self.query.weight"], orig["encoder.layer.1.attention.self.query.weight"])
    assert torch.equal(got["embeddings.word_embeddings.weight"], orig["embeddings.word_embeddings.weight"])


def test_stream_cli_and_bf16(tmp_path):
    model_dir, anchor_dir, model, anchor = _pair("llama", torch.float32, tmp_path)
    bf = {}
    for name, folder in (("m16", model_dir), ("a16", anchor_dir)):
        m = load_model(folder).to(torch.bfloat16)
        bf[name] = _save(m, tmp_path / name, shard="50KB")
    assert main(["align", str(bf["m16"]), str(bf["a16"]), "-o", str(tmp_path / "o16"), "--stream",
                 "--shard-size", "40KB", "--verify-forward", "--verify-tol", "5e-2"]) == 0
    out = _state(tmp_path / "o16")
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    rep = json.loads((tmp_path / "o16" / "symmerge_report.json").read_text())
    assert rep["distance_after"] < 0.5 * rep["distance_before"]
    assert rep["verify_max_rel_diff"] < 5e-2


def test_stream_refuses_bad_input(tmp_path):
    model_dir, anchor_dir, model, _ = _pair("bert", torch.float32, tmp_path)
    with pytest.raises(SymmergeError, match="residual"):
        align_streaming(model_dir, anchor_dir, tmp_path / "o1", AlignOptions(symmetries="attn,residual"), progress=False)
    assert not (tmp_path / "o1").exists()
    other = _save(make_model("bert", dtype=torch.float32, intermediate_size=48), tmp_path / "other")
    with pytest.raises(SymmergeError, match="shapes differ"):
        align_streaming(model_dir, other, tmp_path / "o2", progress=False)
    # a NaN in one shard: one clear error, no output folder left behind
    bad = tmp_path / "bad"
    _save(model, bad, shard="20KB")
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    sd = load_file(str(shard))
    k = next(iter(sd))
    sd[k] = sd[k].clone()
    sd[k].view(-1)[0] = float("nan")
    save_file(sd, str(shard), metadata={"format": "pt"})
    with pytest.raises(SymmergeError, match="NaN"):
        align_streaming(bad, anchor_dir, tmp_path / "o3", progress=False)
    assert not (tmp_path / "o3").exists() and not list(tmp_path.glob(".o3*"))
    # a truncated shard
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(SymmergeError, match="truncated or corrupt"):
        align_streaming(bad, anchor_dir, tmp_path / "o4", progress=False)
    with pytest.raises(SymmergeError, match="not an empty directory"):
        align_streaming(model_dir, anchor_dir, anchor_dir, progress=False)


def test_shard_writer_and_sizes(tmp_path):
    assert parse_size("500MB") == 500 * 10 ** 6 and parse_size("1GiB") == 2 ** 30 and parse_size(123) == 123
    for bad in ("lots", "nanGB", "infGB", "-infMB", "1e400GB"):  # 'inf' was an OverflowError traceback
        with pytest.raises(SymmergeError, match="cannot read size"):
            parse_size(bad)
    w = ShardWriter(tmp_path, max_bytes=1000)
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    for k, t in tensors.items():
        w.add(k, t)
    names = w.close()
    assert len(names) == 3  # 2 + 2 + 1 tensors
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2000 and set(index["weight_map"]) == set(tensors)
    got = {k: v for n in names for k, v in load_file(str(tmp_path / n)).items()}
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    # make_room flushes before data that would not fit is even read, and only then
    w2 = ShardWriter(tmp_path / "w2", max_bytes=1000)
    (tmp_path / "w2").mkdir()
    w2.add("a", tensors["t0"])
    w2.make_room(600)
    assert w2.pending_bytes == 400 and not w2.shards
    w2.make_room(601)
    assert w2.pending_bytes == 0 and len(w2.shards) == 1


@pytest.mark.slow  # the benchmark whole: five child processes, each importing torch to measure its peak RSS
def test_bench_streaming_small_end_to_end(tmp_path, capsys):
    """The streaming benchmark's whole pipeline (generate, read+write floor, compute floor, streamed
    alignment in a child process with its peak RSS) on its 2-layer toy."""
    from benchmarks import bench_streaming

    out = tmp_path / "figures.json"
    assert bench_streaming.main(["--small", "--dir", str(tmp_path / "ckpt"), "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert fig["model"]["num_hidden_layers"] == 2 and fig["shards"] >= 1
    assert fig["read_write_s"] > 0 and fig["compute_s"] > 0
    assert fig["distance_after"] < fig["distance_before"]
    # the generated checkpoints, read back independently: layer sizes and the distance A-B
    ckpt = tmp_path / "ckpt" / "small"
    sd_a, sd_b = ({k: v for f in sorted((ckpt / m).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
                  for m in ("a", "b"))
    layer_bytes = [{k: v.numel() * v.element_size() for k, v in sd_a.items() if k.startswith(f"model.layers.{i}.")}
                   for i in range(2)]
    # the aligned part of a layer: the attention and MLP projections (norms may or may not count)
    projections = max(sum(n for k, n in lb.items() if "_proj." in k) for lb in layer_bytes)
    assert projections <= fig["largest_layer_gb"] * 1e9 <= max(sum(lb.values()) for lb in layer_bytes)
    assert fig["distance_before"] == pytest.approx(sq_dist(sd_a, sd_b) ** 0.5, rel=1e-6)
    # peak RSS of the streamed alignment: at least the interpreter with its imports (measured alone),
    # within the benchmark's goal (2 x largest layer + 1 GB), so well under 2 GB for this toy
    for mode in fig["modes"].values():
        assert 0.9 * fig["python_torch_import_rss_gb"] <= mode["peak_rss_gb"] <= fig["rss_goal_gb"] < 2
        assert mode["distance_before"] == pytest.approx(fig["distance_before"], rel=1e-9)
    assert fig["rss_goal_gb"] == pytest.approx(2 * fig["largest_layer_gb"] + 1)
    assert fig["python_torch_import_rss_gb"] > 0.05  # torch alone maps more than 50 MB
    assert set(fig["stream_stage_s"]) >= {"read", "write", "costs_and_assignments", "solve attn.qk",
                                          "check_apply_distances"}
    assert "peak_rss_gb" in capsys.readouterr().out


def test_stream_refuses_head_count_mismatch_under_config_aliases(tmp_path):
    """GPT-2 spells the head count ``n_head``: a pair with the same shapes but different head counts
    is refused (one error, no output), not aligned with the wrong head blocks."""
    a = make_model("gpt2", head=True, dtype=torch.float32, tied=True)
    cfg = a.config.to_dict()
    cfg["n_head"] = a.config.n_head // 2
    b_dir = _save(a, tmp_path / "b")
    (b_dir / "config.json").write_text(json.dumps(cfg))
    a_dir = _save(a, tmp_path / "a")
    with pytest.raises(SymmergeError, match="head"):
        align_streaming(a_dir, b_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_align_streaming_without_a_plan_reports_as_the_cli(tmp_path):
    """Called without a plan (as the streamed aligned merge calls it), ``align_streaming`` plans from the headers and
    builds its report from that plan, as ``symmerge align --stream`` does: it had no ``plan`` entry."""
    model_dir, anchor_dir, _, _ = _pair("llama", torch.float32, tmp_path)
    api = align_streaming(model_dir, anchor_dir, tmp_path / "api", AlignOptions(symmetries="recommended"),
                          progress=False)  # the CLI's default symmetries
    assert main(["align", str(model_dir), str(anchor_dir), "-o", str(tmp_path / "cli"), "--stream", "-q"]) == 0
    cli = json.loads((tmp_path / "cli" / "symmerge_report.json").read_text())
    assert json.loads((tmp_path / "api" / "symmerge_report.json").read_text())["plan"] == api["plan"] == cli["plan"]
    timed = {"seconds", "match_seconds", "timings"}
    assert set(api) - timed == set(cli) - timed
