"""Learned alignment in the memory of a few layers (symmerge.pipeline.learn_layerwise, issue 42 item 6): the
working tensors built one layer at a time, and two checkpoints aligned layer by layer from their files give the
in-memory learned path's elements bit for bit, verified function-preserving; the file-backed run's peak memory
stays well below the in-memory path's, which holds both models and more (child processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_inputs, output_rel_diff, with_weights
from symmerge.core.apply import apply
from symmerge.errors import SymmergeError
from symmerge.io.data import Batch, Data
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.learn_layerwise import LayerTensors, paths_of
from symmerge.pipeline.learn_layerwise_files import learn_from_checkpoints, weightless
from symmerge.pipeline.options import AlignOptions, LearnSettings

pytestmark = pytest.mark.usefixtures("single_thread")


def _llama_pair(tmp_path, layers=3, hidden=64, inner=128, vocab=512):
    from transformers import LlamaForCausalLM

    from symmerge.demo.lm import llama_config

    cfg = llama_config(vocab, context=64, hidden=hidden, layers=layers, heads=4, kv_heads=2, inner=inner, tie=True)
    torch.manual_seed(0)
    a = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    b = LlamaForCausalLM(cfg).eval()
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    return a, b


def _tokens(vocab=512, texts=16, length=24, batch=4) -> Data:
    ids = torch.randint(1, vocab, (texts, length), generator=torch.Generator().manual_seed(2))
    return Data("memory", "lm", [Batch({"input_ids": ids[i:i + batch], "attention_mask": torch.ones_like(ids[i:i + batch])},
                                       None, torch.ones_like(ids[i:i + batch], dtype=torch.bool))
                                 for i in range(0, texts, batch)], texts, False)


@pytest.mark.parametrize("start", ["activations", "weights"])
def test_from_checkpoints_gives_the_in_memory_elements_bit_for_bit_and_verifies(tmp_path, start):
    a, b = _llama_pair(tmp_path)
    data = _tokens()
    # the paper's set: 'recommended' (the default) aligns the stream in memory and leaves it out from the files
    options = AlignOptions(symmetries="paper", match="learned", align_data=data, verify_tol=1e-5,
                           learn=LearnSettings(steps=4, batch=4, lr=0.05, check_every=2, layerwise=True, start=start))
    memory = align_pair(a, b, options)
    elements, report = learn_from_checkpoints(tmp_path / "a", tmp_path / "b", data, options)
    assert report["learned"]["steps"] == memory.report["learned"]["steps"] == 4
    assert report["learned"]["history"] == memory.report["learned"]["history"]
    assert sorted(elements) == sorted(memory.elements)
    sd = a.state_dict()
    moved, expected = apply(sd, memory.instances, elements), apply(sd, memory.instances, memory.elements)
    assert all(torch.equal(moved[k], expected[k]) for k in sd)
    assert any(not torch.equal(moved[k], sd[k]) for k in sd)  # it moved
    assert report["verify_max_rel_diff"] <= 1e-5
    assert output_rel_diff(a, with_weights(a, moved), make_inputs(a)) <= 1e-5  # function-preserving, in memory too


def test_layer_tensors_are_the_start_applied_one_layer_at_a_time(tmp_path):
    a, b = _llama_pair(tmp_path)
    data = _tokens()
    options = AlignOptions(match="learned", align_data=data,
                           learn=LearnSettings(steps=1, batch=4, layerwise=True, start="weights"))
    result = align_pair(a, b, options)
    sd = a.state_dict()
    paths = paths_of(a)
    lazy = LayerTensors(sd, list(sd), paths, result.instances, result.elements, keep=2)
    whole = apply(sd, result.instances, result.elements)
    assert lazy.reads == 0  # nothing computed before it is asked for
    for group in lazy.groups.values():  # layer by layer (and the tensors outside the layers)
        for k in group:
            assert torch.equal(lazy[k], whole[k].float()), k
            assert len(lazy.cache) <= 2
    assert lazy.reads == len(paths) + 1  # each layer computed once, when first asked for
    assert set(lazy.groups) == set(paths) | {""}


def test_weightless_skeleton_holds_no_weight_and_computes_the_model(tmp_path):
    from symmerge.io.checkpoint import LazyCheckpoint
    from symmerge.pipeline.learn_layerwise_files import CheckpointTensors, _Runner

    a, _ = _llama_pair(tmp_path)
    ckpt = LazyCheckpoint(tmp_path / "a")
    skeleton = weightless(ckpt)
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    tensors = CheckpointTensors(ckpt)
    assert "lm_head.weight" in tensors  # the tied head, read from its source
    runner = _Runner(skeleton, paths_of(skeleton), LayerTensors(tensors, list(tensors), paths_of(skeleton)))
    inputs = make_inputs(a)
    with torch.no_grad():
        expected = a(**inputs).logits
        got = runner(**inputs)
    expected = expected[:, :-1].reshape(-1, expected.shape[-1])  # every next-token position (no mask given)
    assert torch.allclose(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_from_checkpoints_refuses_other_matchers_and_different_shapes(tmp_path):
    _llama_pair(tmp_path)
    data = _tokens()
    with pytest.raises(SymmergeError, match="learned"):
        learn_from_checkpoints(tmp_path / "a", tmp_path / "b", data, AlignOptions(match="weights"))
    _llama_pair(tmp_path / "other", hidden=32)
    with pytest.raises(SymmergeError, match="shapes"):
        learn_from_checkpoints(tmp_path / "a", tmp_path / "other" / "b", data,
                               AlignOptions(match="learned", align_data=data, learn=LearnSettings(steps=1)))


# the peak memory of a learned alignment, from the files against in memory: a Llama whose weights dominate
# (LAYERS layers of width 512, FFN 1024: a layer is 9.4 MB in float32). 16 layers (38 M parameters, 152 MB a model),
# not 32 as before 2026-11-30: the checks are ratios (the in-memory rise to one model, the files' rise to the
# in-memory one), the same at both depths (in memory 3.66 models at 32 layers, 3.63 at 16; from the files 0.16 and
# 0.22 of the in-memory rise), and the two children cost half the CPU (70 s against 126 s)
LAYERS = 16
_CHILD = r"""
import json, resource, sys, torch
sys.path[:0] = [sys.argv[1]]
torch.set_num_threads(1)
from transformers import LlamaForCausalLM
from symmerge.demo.lm import llama_config
from symmerge.io.data import Batch, Data
from symmerge.pipeline.align import align_pair
from symmerge.pipeline.learn_layerwise_files import learn_from_checkpoints
from symmerge.pipeline.options import AlignOptions, LearnSettings
import safetensors.torch, scipy.optimize  # noqa: F401  (loaded before the measurement)
ids = torch.randint(1, 512, (8, 24), generator=torch.Generator().manual_seed(2))
data = Data("memory", "lm", [Batch({"input_ids": ids[i:i + 4], "attention_mask": torch.ones_like(ids[i:i + 4])},
                                   None, torch.ones_like(ids[i:i + 4], dtype=torch.bool)) for i in (0, 4)], 8, False)
options = AlignOptions(match="learned", align_data=data, verify_tol=1e-4,
                       learn=LearnSettings(steps=2, batch=4, check_every=2, layerwise=True, start="weights"))
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
def peak():  # this process's own peak RSS (VmHWM): not ru_maxrss, which a child starts at its parent's peak
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
def run(folder, **shape):
    if sys.argv[2] == "files":
        learn_from_checkpoints(folder + "/a", folder + "/b", data, options)
    else:
        cfg = llama_config(512, context=64, heads=4, kv_heads=2, tie=True, **shape)
        torch.manual_seed(0); a = LlamaForCausalLM(cfg).eval()
        torch.manual_seed(1); b = LlamaForCausalLM(cfg).eval()
        align_pair(a, b, options)
run(sys.argv[3] + "/tiny", hidden=512, layers=2, inner=1024)  # warm-up: the same code, modules and pools loaded
import gc; gc.collect()
before = rss()
run(sys.argv[3], hidden=512, layers=int(sys.argv[4]), inner=1024)
print(json.dumps({"rise": peak() - before}))
"""


def _rise(mode: str, folder: Path) -> int:
    root = Path(__file__).resolve().parents[2]
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_ARENA_MAX": "1",
           "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "SYMMERGE_CACHE_DIR": str(folder / "cache")}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(root), mode, str(folder), str(LAYERS)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["rise"]


@pytest.mark.slow  # two children, a minute or more on 2 loaded cores
def test_from_checkpoints_peak_memory_stays_below_the_in_memory_path(tmp_path):
    _llama_pair(tmp_path, layers=LAYERS, hidden=512, inner=1024)
    _llama_pair(tmp_path / "tiny", layers=2, hidden=512, inner=1024)
    model_bytes = sum(t.numel() * 4 for t in _layers_and_outer(tmp_path / "a"))
    files, memory = _rise("files", tmp_path), _rise("memory", tmp_path)
    print(f"peak above the start: from the files {files / 1e6:.0f} MB, in memory {memory / 1e6:.0f} MB "
          f"(one model {model_bytes / 1e6:.0f} MB)")
    # measured on the 2-core machine (2026-11-30): 121 MB from the files, 552 MB in memory, 152 MB a model (at 32
    # layers: 180 MB, 1108 MB, 303 MB). The in-memory path holds both models (2 × 152 MB) and more; from the files
    # the rise is not yet down to a few layers at this small width (docs/results/learned_scale.md), so the check is
    # against the in-memory path, with room
    assert memory > 3 * model_bytes, (memory, model_bytes)
    assert files < 0.7 * memory, (files, memory)


def _layers_and_outer(folder: Path):
    from safetensors.torch import load_file

    return list(load_file(folder / "model.safetensors").values())
