"""One reader, one set of checks, in memory and streamed: a checkpoint missing a tensor its config.json's class
has, or holding one the class has no place for, is refused with the same one line by every path of ``merge``
(memory, stream), ``align`` (memory, ``--stream``) and ``barrier`` — never filled at random, never dropped
silently; declared ties are not "missing". config.json is cross-checked against the stored tensors before a
model is built from it, and a shard index may not name files outside the model's folder."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import npz_file, save_folder, vit_folder
from factories import make_model
from symmerge.errors import SymmergeError
from symmerge.io.checkpoint import LazyCheckpoint
from symmerge.io.reader import load_model
from test_bad_input import assert_clean_failure, run_cli, tree_hash

pytestmark = pytest.mark.usefixtures("single_thread")

MISSING = "vit.encoder.layer.0.intermediate.dense.weight"
EXTRA = "vit.encoder.layer.0.attention.attention.extra.weight"


def edit_weights(folder, drop=(), add=None):
    """The folder's model.safetensors rewritten without ``drop`` and with ``add`` ({name: tensor})."""
    sd = load_file(folder / "model.safetensors")
    for k in drop:
        del sd[k]
    sd.update(add or {})
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture
def inputs(tmp_path):
    good = vit_folder(tmp_path / "good", 0)
    missing = edit_weights(vit_folder(tmp_path / "missing", 1), drop=[MISSING])
    extra = edit_weights(vit_folder(tmp_path / "extra", 2), add={EXTRA: torch.ones(16, 16)})
    return {"good": good, "missing": missing, "extra": extra, "data": npz_file(tmp_path / "d.npz")}


PATHS = {
    "merge-memory-plain": lambda a, b, d: ["merge", a, b, "--method", "average", "--mode", "memory", "--align", "none"],
    "merge-memory-aligned": lambda a, b, d: ["merge", a, b, "--method", "average", "--mode", "memory"],
    "merge-stream": lambda a, b, d: ["merge", a, b, "--method", "average", "--mode", "stream"],
    "merge-stream-ties": lambda a, b, d: ["merge", a, b, "--method", "ties", "--base", a, "--mode", "stream",
                                          "--align", "none"],
    "align-memory": lambda a, b, d: ["align", b, a],
    "align-stream": lambda a, b, d: ["align", b, a, "--stream"],
    "barrier": lambda a, b, d: ["barrier", a, b, "--data", d, "--points", "3"],
}


@pytest.mark.parametrize("bad,needles", [("missing", ["lacks 1 tensor", MISSING, "never fills"]),
                                         ("extra", ["has no place for", EXTRA, "never drops"])])
def test_missing_or_extra_tensor_is_one_line_on_every_path(tmp_path, capsys, inputs, bad, needles):
    before = {k: tree_hash(inputs[k]) for k in ("good", bad)}
    lines = {}
    for name, argv in PATHS.items():
        out = tmp_path / "outs" / name
        out.parent.mkdir(exist_ok=True)
        rc, _, err = run_cli(capsys, *argv(inputs["good"], inputs[bad], inputs["data"]), "-o", out,
                             "--progress", "none")
        assert rc == 2, (name, err)
        assert_clean_failure(rc, err, out, *needles)
        lines[name] = [ln for ln in err.splitlines() if ln.startswith("symmerge")][0]
    assert len(set(lines.values())) == 1, lines  # the same line, in memory and streamed
    assert {k: tree_hash(inputs[k]) for k in ("good", bad)} == before


def test_the_api_raises_the_same_error_in_memory_and_lazily(inputs):
    for bad in ("missing", "extra"):
        with pytest.raises(SymmergeError) as memory:
            load_model(inputs[bad], spec=False)
        with pytest.raises(SymmergeError) as lazy:
            LazyCheckpoint(inputs[bad], spec=False)
        assert str(memory.value) == str(lazy.value)


def test_a_pickle_checkpoint_is_checked_by_what_transformers_reports(tmp_path):
    """No headers to read first: transformers' own loading info, refused with the same error."""
    from transformers import ViTForImageClassification

    folder = vit_folder(tmp_path / "p", 3)
    sd = load_file(folder / "model.safetensors")
    del sd[MISSING]
    torch.save(sd, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(SymmergeError, match="lacks 1 tensor.*intermediate.dense.weight.*never fills"):
        load_model(folder, allow_pickle=True, spec=False)
    # control: the same file whole loads, and transformers alone would have filled the tensor at random
    _, info = ViTForImageClassification.from_pretrained(str(folder), output_loading_info=True, use_safetensors=False)
    assert info["missing_keys"]


def test_declared_ties_are_not_missing(tmp_path, capsys):
    """A Llama with tied embeddings stores lm_head.weight once (as the embedding): every path loads it."""
    a = save_folder(make_model("llama", head=True, tied=True, seed=0), tmp_path / "a")
    b = save_folder(make_model("llama", head=True, tied=True, seed=1), tmp_path / "b")
    assert "lm_head.weight" not in load_file(a / "model.safetensors")
    for mode in ("memory", "stream"):
        rc, _, err = run_cli(capsys, "merge", a, b, "--method", "average", "--mode", mode, "--align", "none",
                             "-o", tmp_path / mode, "--progress", "none")
        assert rc == 0, err
    ours = load_file(tmp_path / "memory" / "model.safetensors")
    streamed = load_file(tmp_path / "stream" / "model.safetensors")
    assert ours.keys() == streamed.keys() and all(torch.equal(ours[k], streamed[k]) for k in ours)


def test_a_shape_that_differs_from_the_config_is_one_line_in_memory_too(tmp_path):
    folder = vit_folder(tmp_path / "s", 4)
    edit_weights(folder, add={MISSING: torch.ones(24, 8)})  # (intermediate, hidden) would be (24, 16)
    errors = set()
    for read in (lambda: load_model(folder, spec=False), lambda: LazyCheckpoint(folder, spec=False)):
        with pytest.raises(SymmergeError, match="config.json .* makes it") as e:
            read()
        errors.add(str(e.value))
    assert len(errors) == 1


def _lying_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("key,value,needle", [("num_hidden_layers", 10_000_000, "stores 2 layer"),
                                              ("hidden_size", 4096, "no tensor")])
def test_a_config_json_that_lies_about_the_tensors_is_refused_at_once(tmp_path, capsys, key, value, needle):
    good = vit_folder(tmp_path / "good", 0)
    liar = _lying_config(vit_folder(tmp_path / "liar", 1), **{key: value})
    for mode in ("memory", "stream"):
        out = tmp_path / "outs" / mode
        out.parent.mkdir(exist_ok=True)
        t = time.perf_counter()
        rc, _, err = run_cli(capsys, "merge", good, liar, "--method", "average", "--mode", mode, "--align", "none",
                             "-o", out, "--progress", "none")
        assert time.perf_counter() - t < 5.0  # minutes before (a 10-million-layer model built on 'meta')
        assert_clean_failure(rc, err, out, f"{key}={value}", needle)
    t = time.perf_counter()
    with pytest.raises(SymmergeError, match=f"{key}={value}"):
        LazyCheckpoint(liar, spec=False)
    assert time.perf_counter() - t < 1.0


def test_a_config_with_fewer_layers_than_stored_is_refused_as_extra_tensors(tmp_path):
    liar = _lying_config(vit_folder(tmp_path / "liar", 1), num_hidden_layers=1)
    for read in (lambda: load_model(liar, spec=False), lambda: LazyCheckpoint(liar, spec=False)):
        with pytest.raises(SymmergeError, match="has no place for.*layer.1"):
            read()


def _sharded(folder):
    """The folder's single file turned into a one-shard index."""
    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in sd}}))
    return folder


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_shard_index_is_confined_to_the_model_folder(tmp_path, capsys, where):
    good = vit_folder(tmp_path / "good", 0)
    other = _sharded(vit_folder(tmp_path / "other", 1))
    victim = _sharded(vit_folder(tmp_path / "victim", 2))
    shard = other / "model-00001-of-00001.safetensors"
    name = str(shard) if where == "absolute" else "../other/model-00001-of-00001.safetensors"
    index = json.loads((victim / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: name for k in index["weight_map"]}
    (victim / "model.safetensors.index.json").write_text(json.dumps(index))
    for mode in ("memory", "stream"):
        out = tmp_path / "outs" / mode
        out.parent.mkdir(exist_ok=True)
        rc, _, err = run_cli(capsys, "merge", good, victim, "--method", "average", "--mode", mode, "--align", "none",
                             "-o", out, "--progress", "none")
        assert_clean_failure(rc, err, out, "outside the model's folder")
    # control: the same index naming its own shard loads
    assert LazyCheckpoint(other, spec=False).keys()


def test_a_shard_index_naming_a_number_is_one_line_naming_the_entry(tmp_path, capsys):
    """``weight_map`` values that are not file names: it said "'<' not supported between instances of 'str' and
    'int'" (the sort of the names)."""
    good = vit_folder(tmp_path / "good", 0)
    bad = _sharded(vit_folder(tmp_path / "bad", 1))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = 5
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "merge", good, bad, "--method", "average", "--align", "none", "-o", out,
                         "--progress", "none")
    assert_clean_failure(rc, err, out, f"weight_map[{key!r}] is 5, not a shard file name")


def test_a_mixture_of_experts_missing_one_experts_tensor_is_the_same_line_everywhere(tmp_path, capsys):
    """transformers fuses the experts in memory from per-expert tensors: one of them missing is named, in memory,
    streamed, and read fused (align --stream) alike."""
    a = save_folder(make_model("mixtral", head=True, dtype=torch.float32, seed=0), tmp_path / "a")
    bad = save_folder(make_model("mixtral", head=True, dtype=torch.float32, seed=1), tmp_path / "bad")
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"  # a part of the fused mlp.experts.gate_up_proj
    edit_weights(bad, drop=[gone])
    lines = set()
    for argv in (["merge", a, bad, "--method", "average", "--align", "none", "--mode", "memory"],
                 ["merge", a, bad, "--method", "average", "--align", "none", "--mode", "stream"],
                 ["align", bad, a, "--stream"]):
        out = tmp_path / "outs" / f"{argv[0]}-{argv[-1]}"
        out.parent.mkdir(exist_ok=True)
        rc, _, err = run_cli(capsys, *argv, "-o", out, "--progress", "none")
        assert_clean_failure(rc, err, out, "lacks 1 tensor", gone)
        lines.add(err.strip())
    assert len(lines) == 1, lines
