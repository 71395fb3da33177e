"""Activation matching one layer at a time (``match_activations(by_layer=...)``, issue 42 item 6): the layers
replayed on the previous layer's outputs give the whole pass's statistics, hence the same elements, bit for
bit; the result is function-preserving; and the peak memory of the start stays at one layer's statistics,
measured in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_inputs, output_rel_diff, with_weights
from factories import make_model
from symmerge.core.apply import apply
from symmerge.errors import SymmergeError
from symmerge.pipeline import activations
from symmerge.pipeline.activations import LayerReplay, match_activations
from symmerge.pipeline.align import instances_for
from symmerge.pipeline.bound import bind
from symmerge.pipeline.options import AlignOptions
from test_activations import canonical_pair, unlabeled

pytestmark = pytest.mark.usefixtures("single_thread")

LOCAL = ("heads", "attn", "ffn", "rescale")  # every per-layer group: nothing model-wide, so by layer applies


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "vit", "bert"])
def test_by_layer_gives_the_whole_pass_elements_bit_for_bit(family):
    a = make_model(family, head=True, seed=0, dtype=torch.float32)
    b = make_model(family, head=True, seed=3, dtype=torch.float32)
    _, instances = instances_for(a)
    opts = AlignOptions(symmetries=LOCAL).solver_options()
    data = unlabeled(a)
    whole = match_activations(instances, a, b, data, opts, by_layer=False)
    calls = []
    real = activations.layer_statistics

    def counted(replay, i, sites):
        calls.append(i)
        return real(replay, i, sites)
    activations.layer_statistics = counted
    try:
        layered = match_activations(instances, a, b, data, opts, by_layer=True)
    finally:
        activations.layer_statistics = real
    assert calls == list(range(len(bind(a).layer_paths())))  # one layer's statistics at a time, in order
    assert sorted(whole) == sorted(layered)
    sd = a.state_dict()
    out_w, out_l = apply(sd, instances, whole), apply(sd, instances, layered)
    assert all(torch.equal(out_w[k], out_l[k]) for k in out_w)
    # and the default (None) takes the layer path here
    assert all(torch.equal(out_l[k], v) for k, v in apply(sd, instances, match_activations(
        instances, a, b, data, opts)).items())
    inputs = make_inputs(a)
    assert output_rel_diff(a, with_weights(a, out_l), inputs) <= 1e-5  # function-preserving


def test_replayed_layers_give_the_models_own_hidden_states():
    a, b = (make_model("llama", head=True, seed=s, dtype=torch.float32) for s in (0, 3))
    paths = bind(a).layer_paths()
    data = unlabeled(a, batches=2)
    replay = LayerReplay.of_models(a, b, paths, data)
    assert replay is not None
    for i in range(len(paths)):
        for _ in replay.run(i):
            pass
    for k, model in enumerate((a, b)):
        for bi, batch in enumerate(data.batches):
            with torch.no_grad():
                hidden = model.model(**batch.inputs).last_hidden_state  # after the final norm
            last = model.model.norm(replay.inputs[k][bi][0])
            assert torch.equal(last, hidden)


def test_by_layer_refused_where_a_group_spans_the_layers():
    a, b = (make_model("llama", head=True, seed=s, dtype=torch.float32) for s in (0, 3))
    instances, opts, _, _, ma, mb = canonical_pair(a, b, LOCAL + ("residual",))  # the stream: model-wide
    with pytest.raises(SymmergeError, match="by layer"):
        match_activations(instances, ma, mb, unlabeled(a), opts, by_layer=True)
    assert match_activations(instances, ma, mb, unlabeled(a), opts)  # the default: the whole pass


# the peak-memory check: a Llama whose FFN statistics dominate (32 layers, FFN width 384: each layer's FFN joint
# Gram is (2·384)² float64 = 4.7 MB; the whole pass holds all 32 of them, 151 MB, and then their factors)
_CHILD = r"""
import json, resource, sys, torch
sys.path[:0] = [sys.argv[1]]
torch.set_num_threads(1)
from transformers import LlamaForCausalLM
from symmerge.demo.lm import llama_config
from symmerge.io.data import Batch, Data
from symmerge.pipeline.activations import match_activations
from symmerge.pipeline.align import instances_for
from symmerge.pipeline.options import AlignOptions
cfg = llama_config(64, context=64, hidden=32, layers=32, heads=4, inner=384)
torch.manual_seed(0); a = LlamaForCausalLM(cfg).eval()
torch.manual_seed(1); b = LlamaForCausalLM(cfg).eval()
ids = torch.randint(1, 64, (8, 48), generator=torch.Generator().manual_seed(2))
data = Data("memory", "lm", [Batch({"input_ids": ids[i:i + 4], "attention_mask": torch.ones_like(ids[i:i + 4])},
                                   None, torch.ones_like(ids[i:i + 4], dtype=torch.bool)) for i in (0, 4)], 8, False)
_, instances = instances_for(a)
opts = AlignOptions(symmetries=("heads", "attn", "ffn", "rescale")).solver_options()
import scipy.optimize  # noqa: F401  (loaded before the measurement, in both modes)
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
def peak():  # this process's own peak RSS (VmHWM): not ru_maxrss, which a child starts at its parent's peak
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
import gc
rises = {}
for mode in ("layer", "whole"):  # by layer first: the whole pass's higher peak then shows in VmHWM as well
    gc.collect()
    before = rss()  # the peak above the resident set of this point
    match_activations(instances, a, b, data, opts, by_layer=mode == "layer")
    rises[mode] = peak() - before
print(json.dumps(rises))
"""


def _peak_rises() -> dict:
    root = Path(__file__).resolve().parents[2]
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_ARENA_MAX": "1",
           "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(root)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a child matching a 32-layer pair twice (15 s at load 2): with the other peak-memory tests in the
# side chain of .ci/run, which the README command's run outlasted
def test_by_layer_peak_memory_stays_at_one_layer_of_statistics():
    gram = (2 * 384) ** 2 * 8  # one layer's FFN joint Gram, float64
    bound = 16 * gram  # half of all the layers' Grams: the whole pass holds them all at once
    rises = _peak_rises()
    by_layer, whole = rises["layer"], rises["whole"]
    print(f"peak above the start: by layer {by_layer / 1e6:.0f} MB, whole pass {whole / 1e6:.0f} MB")
    assert by_layer < bound, (by_layer, bound)
    assert whole > bound, (whole, bound)
