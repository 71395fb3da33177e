"""Streamed merges (``merge --mode stream``): bit for bit the in-memory merge for every per-tensor method
and for sharded inputs; memory bounded by the read-ahead budget on a model many times larger; an
interrupted write leaves no output folder; the chunked rules and the streamed TIES threshold agree
with their whole-tensor definitions."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from symmerge.cli import main
from symmerge.io.checkpoint import LazyCheckpoint
from symmerge.merge.base import CHUNK
from symmerge.merge.parts import dare_keep_mask, magnitude_threshold

METHODS = [("average", []), ("task_arithmetic", ["--param", "scale=0.7"]), ("ties", ["--param", "density=0.3"]),
           ("ties", ["--param", "density=0.3", "--param", "scope=tensor"]), ("dare", ["--param", "drop=0.5"]),
           ("dare_ties", ["--param", "drop=0.3", "--param", "seed=4"])]


def llama(seed: int, vocab: int = 2304, layers: int = 2):
    """A small Llama whose embedding (vocab x 32) spans several chunks of the elementwise loop."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-merge")
    base = llama(0)
    out = {"base": root / "base"}
    base.save_pretrained(str(out["base"]))
    for i in (1, 2, 3):  # fine-tunes of the base; the second one sharded
        m = llama(0)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)
        out[i] = root / f"m{i}"
        m.save_pretrained(str(out[i]), max_shard_size="100KB" if i == 2 else "1GB")
    assert (out[2] / "model.safetensors.index.json").is_file()
    return out


def run(capsys, *argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, *capsys.readouterr()


def tensors(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("method,params", METHODS, ids=[f"{m}{'-' + p[-1] if p else ''}" for m, p in METHODS])
def test_streamed_merge_equals_in_memory_merge_bit_for_bit(folders, tmp_path, capsys, method, params):
    models = [folders[1], folders[2], folders[3]]
    base = ["--base", folders["base"]] if method != "average" else []
    result = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        rc, _, err = run(capsys, "merge", *models, "--method", method, *params, *base, "--align", "none",
                         "--heads", "merge", "--mode", mode, "--progress", "none", "-o", out,
                         *(["--shard-size", "150KB"] if mode == "stream" else []))
        assert rc == 0, err
        result[mode] = tensors(out)
    assert (tmp_path / "stream" / "model.safetensors.index.json").is_file()  # the output is sharded too
    assert result["memory"].keys() == result["stream"].keys()
    for k, t in result["memory"].items():
        assert t.dtype == result["stream"][k].dtype and torch.equal(t, result["stream"][k]), k
    inputs = [tensors(f) for f in models]
    k = "model.embed_tokens.weight"
    assert all(not torch.equal(result["stream"][k], x[k]) for x in inputs)  # a real merge, not a copy


def test_auto_streams_plain_merges_and_loads_aligned_ones(folders, tmp_path, capsys):
    rc, _, err = run(capsys, "merge", folders[1], folders[2], "--method", "average", "--align", "none",
                     "--progress", "none", "-o", tmp_path / "a")
    assert rc == 0, err
    assert json.loads((tmp_path / "a" / "symmerge_report.json").read_text())["mode"] == "stream"
    rc, _, err = run(capsys, "merge", folders[1], folders[2], "--method", "average", "--align", "attn",
                     "--progress", "none", "-o", tmp_path / "b")
    assert rc == 0, err
    assert json.loads((tmp_path / "b" / "symmerge_report.json").read_text())["mode"] == "memory"


@pytest.mark.parametrize("argv,why", [(("--method", "regmean", "--align", "none", "--data", "x.txt"),
                                       "needs the models in memory"),
                                      (("--method", "fisher", "--align", "none", "--data", "x.txt"),
                                       "needs the models in memory"),
                                      (("--method", "average", "--align", "none", "--eval-data", "x.txt"),
                                       "needs it in memory")])
def test_stream_mode_refuses_what_needs_memory(folders, tmp_path, capsys, argv, why):
    (tmp_path / "x.txt").write_text("hello\n")
    argv = tuple(str(tmp_path / a) if a == "x.txt" else a for a in argv)
    rc, _, err = run(capsys, "merge", folders[1], folders[2], *argv, "--mode", "stream", "-o", tmp_path / "o")
    assert rc == 2 and why in err and "--mode memory" in err
    assert not (tmp_path / "o").exists()


def test_memory_stays_within_the_read_ahead_budget(tmp_path, capsys, monkeypatch):
    """A 'large' model (many layers) merged under a small budget: the bytes of tensors read and still
    alive at any moment (counted independently, by finalizers on every tensor read) stay within the
    budget plus one tensor set, a small fraction of the model."""
    models = []
    for seed in (0, 1):
        folder = tmp_path / f"big{seed}"
        llama(seed, vocab=256, layers=24).save_pretrained(str(folder))
        models.append(folder)
    ckpt = LazyCheckpoint(models[0], spec=False)
    total = sum(ckpt.nbytes(k) for k in ckpt.keys())
    largest = max(ckpt.nbytes(k) for k in ckpt.keys())
    budget = 3 * 2 * largest  # bytes: three tensors of both models (inputs + output accounted)
    live = {"now": 0, "peak": 0}
    original = LazyCheckpoint.read_direct

    def counted(self, key, check=True, buffer=None):
        t = original(self, key, check, buffer)
        n = t.numel() * t.element_size()
        live["now"] += n
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(t, lambda: live.__setitem__("now", live["now"] - n))
        return t

    monkeypatch.setattr(LazyCheckpoint, "read_direct", counted)
    from symmerge.merge import stream

    real = stream.merge_streaming
    monkeypatch.setattr(stream, "merge_streaming", lambda *a, **k: real(*a, **{**k, "budget": budget}))
    rc, _, err = run(capsys, "merge", *models, "--method", "average", "--align", "none", "--mode", "stream",
                     "--progress", "none", "-o", tmp_path / "out")
    assert rc == 0, err
    assert live["now"] == 0
    assert 2 * total > 8 * budget  # the inputs are much larger than the bound
    assert live["peak"] <= budget + 3 * largest, (live, budget)


def test_interrupted_write_leaves_no_output_folder(folders, tmp_path, capsys, monkeypatch):
    from symmerge.io.checkpoint import PlannedWriter

    calls = {"n": 0}
    original = PlannedWriter.add

    def failing(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return original(self, name, tensor)

    monkeypatch.setattr(PlannedWriter, "add", failing)
    out = tmp_path / "out"
    rc = main(["merge", str(folders[1]), str(folders[2]), "--method", "average", "--align", "none", "--mode", "stream",
              "--progress", "none", "-o", str(out)])
    assert rc != 0 and calls["n"] == 5
    assert "interrupted" in capsys.readouterr().err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary folder left either


def test_radix_threshold_equals_kthvalue():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(5000, generator=g), torch.randn(40, 70, generator=g).double() * 3,
             torch.zeros(300), torch.full((200,), 0.125)]  # zeros and repeated values
    flat = torch.cat([p.reshape(-1).abs().float() for p in parts])
    for density in (1e-4, 0.01, 0.2, 0.5, 0.9, 0.97, 1.0):
        k = max(1, int(round(density * flat.numel())))
        expected = flat.kthvalue(flat.numel() - k + 1).values.item()
        assert magnitude_threshold(parts, density) == expected
        assert magnitude_threshold(lambda: iter(parts), density) == expected


def test_chunked_dare_draws_the_whole_tensor_mask():
    from symmerge.merge import get_method

    n = 3 * CHUNK + 123
    base = {"w": torch.zeros(n)}
    sds = [{"w": torch.randn(n, generator=torch.Generator().manual_seed(i))} for i in (1, 2)]
    out = get_method("dare").merge(sds, base=base, drop=0.5, seed=7, rescale="inverse")["w"]  # the chunked rule
    expect = sum(torch.where(dare_keep_mask((n,), 0.5, 7, i, "w"), sd["w"].double() / 0.5, 0.0)
                 for i, sd in enumerate(sds)).float()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("n", [2, 3])
def test_aligned_streamed_merge_equals_in_memory_aligned_merge(folders, tmp_path, capsys, n):
    """Each model aligned as align --stream aligns it, then merged tensor by tensor: the same result as
    aligning and merging in memory (same groups); the temporary aligned folders are removed."""
    models = [folders[1], permuted(folders[3], tmp_path / "perm"), folders[2]][:n]
    result = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        rc, _, err = run(capsys, "merge", *models, "--method", "average", "--align", "attn,ffn", "--heads", "merge",
                         "--mode", mode, "--star", "--progress", "none", "-o", out)
        assert rc == 0, err
        result[mode] = tensors(out)
        report = json.loads((out / "symmerge_report.json").read_text())
        assert report["mode"] == mode and report["alignment"]["symmetries"] == ["attn", "ffn"]
        assert report["models"] == [str(m) for m in models]
        anchor = report["alignment"]["anchor"]
        assert anchor["rule"] == ("second of two" if n == 2 else "closest to the average"), anchor
        result[mode + "-anchor"] = anchor["index"]
    assert result["memory-anchor"] == result["stream-anchor"]
    if n == 3:  # without --star, a streamed merge of three still uses the star, and says so
        out = tmp_path / "auto"
        rc, _, err = run(capsys, "merge", *models, "--method", "average", "--align", "attn,ffn", "--heads", "merge",
                         "--mode", "stream", "--progress", "none", "-o", out)
        assert rc == 0 and "joint alignment into one frame needs the models in memory" in err
        assert torch.equal(tensors(out)[k0 := next(iter(result["stream"]))], result["stream"][k0])
        import shutil

        shutil.rmtree(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory", "perm", "stream"]  # no temporary folder left
    for k, t in result["memory"].items():
        torch.testing.assert_close(result["stream"][k], t, rtol=0, atol=1e-6, msg=k)
    plain = tensors_of_plain_merge(models, tmp_path / "plain", capsys)
    k = "model.layers.0.mlp.up_proj.weight"
    assert not torch.allclose(plain[k], result["stream"][k], atol=1e-4)  # the alignment changed the merge


def tensors_of_plain_merge(models, out, capsys):
    rc, _, err = run(capsys, "merge", *models, "--method", "average", "--align", "none", "--heads", "merge",
                     "--progress", "none", "-o", out)
    assert rc == 0, err
    return tensors(out)


def permuted(folder, out):
    """A copy of ``folder`` with every layer's FFN units permuted (the same function, other weights)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(folder, out)
    sd = load_file(out / "model.safetensors")
    for i in range(2):
        p = torch.randperm(64, generator=torch.Generator().manual_seed(10 + i))
        pre = f"model.layers.{i}.mlp."
        sd[pre + "gate_proj.weight"] = sd[pre + "gate_proj.weight"][p].contiguous()
        sd[pre + "up_proj.weight"] = sd[pre + "up_proj.weight"][p].contiguous()
        sd[pre + "down_proj.weight"] = sd[pre + "down_proj.weight"][:, p].contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_streamed_merge_keeps_a_task_head_of_another_label_space(tmp_path, capsys):
    """Classifiers with 2 and 3 labels: the bodies are merged, the head is model --head-from's, as in memory."""
    from transformers import BertConfig, BertForSequenceClassification

    folders = []
    for seed, labels in ((0, 2), (1, 3)):
        torch.manual_seed(seed)
        config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=32, num_labels=labels)
        folders.append(tmp_path / f"bert{seed}")
        BertForSequenceClassification(config).save_pretrained(str(folders[-1]))
    result = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        rc, _, err = run(capsys, "merge", *folders, "--method", "average", "--align", "none", "--head-from", "1",
                         "--mode", mode, "--progress", "none", "-o", out)
        assert rc == 0, err
        result[mode] = tensors(out)
        report = json.loads((out / "symmerge_report.json").read_text())
        assert report["head"]["policy"] == "keep" and report["head"]["from_index"] == 1
    assert result["memory"].keys() == result["stream"].keys()
    for k, t in result["memory"].items():
        assert torch.equal(t, result["stream"][k]), k
    assert torch.equal(result["stream"]["classifier.weight"], tensors(folders[1])["classifier.weight"])
    rc, _, err = run(capsys, "merge", *folders, "--method", "average", "--align", "none", "--heads", "merge",
                     "--mode", "stream", "-o", tmp_path / "bad")
    assert rc == 2 and "cannot merge task heads" in err and not (tmp_path / "bad").exists()


def test_read_ahead_ring_hands_out_disjoint_regions_in_order():
    """The streamed merge's ring buffer: regions in flight never overlap and stay inside the ring, are
    freed oldest first, wrap around, and a key larger than the ring gets fresh memory when alone."""
    import random
    import threading

    from symmerge.merge.stream import _Budget

    gate, stop, rng = _Budget(1000), threading.Event(), random.Random(0)
    live, placed_at_zero_after_wrap = [], 0
    for _ in range(3000):
        n = rng.choice([1, 7, 64, 200, 333, 999])
        while gate._place(n) is None:  # full: the writer frees the oldest region
            m, _ = live.pop(0)
            gate.give(m)
        region = gate.take(n, stop)
        start = region.data_ptr() - gate.ring.data_ptr()
        placed_at_zero_after_wrap += start == 0 and bool(live)
        assert 0 <= start and start + n <= 1000
        for m, s in live:
            assert start + n <= s or s + m <= start, (start, n, s, m)
        live.append((n, start))
    assert placed_at_zero_after_wrap > 100  # it wrapped around many times
    while live:
        gate.give(live.pop(0)[0])
    big = gate.take(5000, stop)
    assert big.numel() == 5000 and gate.regions == [(-1, 4999)]


def test_read_blocks_reads_the_sampled_entries(folders):
    """``LazyCheckpoint.read_blocks``: the entries [p, p + width) for p = first, first + stride, … (the last
    block cut at the end), read from the file, equal to slices of the tensor; a first beyond the end
    reads nothing."""
    ckpt = LazyCheckpoint(folders[2])  # sharded
    for key in ckpt.keys()[:6]:
        flat = ckpt.read([key])[key].reshape(-1)
        for first, stride, width in ((0, 7, 3), (5, 100, 100), (3, 1000, 64), (flat.numel() + 1, 10, 2)):
            want = [flat[p:p + width] for p in range(first, flat.numel(), stride)]
            got = ckpt.read_blocks(key, first, stride, width)
            assert torch.equal(got, torch.cat(want) if want else flat[:0]), (key, first, stride, width)


def test_streamed_ties_with_the_sampled_window_equals_in_memory(folders, tmp_path, capsys, monkeypatch):
    """The streamed TIES threshold through the sampled window (blocks read where they lie, one counting
    visit) gives the in-memory merge bit for bit, and the window path is the one taken."""
    from symmerge.merge import parts

    monkeypatch.setattr(parts, "_WINDOW_MIN", 0)
    monkeypatch.setattr(parts, "_SAMPLE", 1 << 12)
    found = []
    real = parts._window_thresholds
    monkeypatch.setattr(parts, "_window_thresholds", lambda *a: found.append((a[4] is not None, real(*a))) or found[-1][1])
    result = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        rc, _, err = run(capsys, "merge", folders[1], folders[2], folders[3], "--method", "ties", "--param", "density=0.2",
                         "--param", "scope=model", "--param", "normalize=count",  # symmerge's model-wide threshold
                         "--base", folders["base"], "--align", "none", "--mode", mode, "--progress", "none", "-o", out)
        assert rc == 0, err
        result[mode] = tensors(out)
    assert [(sampled, value is not None) for sampled, value in found] == [(True, True), (True, True)]
    for k, t in result["memory"].items():
        assert torch.equal(t, result["stream"][k]), k
