"""``linear`` on float16/bfloat16 (and float32) inputs gives mergekit 0.1.5's bits: its float32 order (each weight in float32,
each product added in model order to a float32 accumulator by a fused multiply-add, the sum divided by the weights'
float32 sum, one rounding). symmerge computed the exact value in float64 and rounded once; with weights that do not
sum to 1 (a weight gradient beside a fixed weight) many entries lie at a rounding tie of the half dtype, and 1–3 %
of the entries of a layer came out one unit off: 1.4e-3 to 3.7e-3 of the change on tiny Llama, Qwen2, Gemma2, GPT-2
(in float32, 5e-7 of the change).

Without mergekit installed the test still asserts the properties of the rule: ``run`` and ``merge`` (memory and
stream) give one result, equal to the float32 accumulation written out below with torch's ``addcmul`` (the op mergekit uses) — and not the
float64 rounding, which differs from it on these inputs (so the test would fail on the old rule)."""

from __future__ import annotations

import pytest
import torch
import yaml

import mergekit_oracle as mo
from conftest import run_cli

GRADIENT = [0.2, 0.5, 0.9]
FIXED = 0.6


@pytest.fixture(scope="module", params=["bfloat16", "float16", "float32"])
def family(request, tmp_path_factory):
    base, fts = mo.family(tmp_path_factory.mktemp(request.param), dtype=request.param, n=2, layers=4, noise=0.01)
    return request.param, fts


def _config(path, fts, normalize=True):
    doc = {"merge_method": "linear", "parameters": {"normalize": normalize},
           "models": [{"model": str(fts[0]), "parameters": {"weight": FIXED}},
                      {"model": str(fts[1]), "parameters": {"weight": GRADIENT}}]}
    path.write_text(yaml.safe_dump(doc))
    return path


def _weight(key, layers=4):
    """The second model's weight for ``key``: mergekit's gradient at t = layer / (layers − 1), 0 outside layers."""
    import re

    m = re.search(r"layers\.(\d+)\.", key)
    t = int(m.group(1)) / (layers - 1) if m else 0.0
    x = t * (len(GRADIENT) - 1)
    i = min(int(x), len(GRADIENT) - 2)
    return GRADIENT[i] + (x - i) * (GRADIENT[i + 1] - GRADIENT[i])


def _float32_order(a, b, w, normalize):
    acc = torch.zeros(a.shape, dtype=torch.float32)
    acc.addcmul_(a, torch.tensor(FIXED, dtype=torch.float32))
    acc.addcmul_(b, torch.tensor(w, dtype=torch.float32))
    if normalize:
        acc = acc / (torch.tensor(FIXED, dtype=torch.float32) + torch.tensor(w, dtype=torch.float32))
    return acc.to(a.dtype)


@pytest.mark.parametrize("normalize", [True, False])
def test_linear_in_half_precision_is_mergekit_s_float32_order(family, tmp_path, normalize):
    dtype, fts = family
    config = _config(tmp_path / "c.yml", fts, normalize)
    assert run_cli("run", config, tmp_path / "run", "-q") == 0
    ours = mo.tensors(tmp_path / "run")
    a, b = mo.tensors(fts[0]), mo.tensors(fts[1])
    exact_differs = 0
    for k, t in ours.items():
        w = _weight(k)
        assert t.dtype == getattr(torch, dtype)
        assert torch.equal(t, _float32_order(a[k], b[k], w, normalize)), k
        exact = (a[k].double() * FIXED + b[k].double() * w) / ((FIXED + w) if normalize else 1.0)
        exact_differs += int((exact.to(t.dtype) != t).sum())
    if normalize:
        assert exact_differs > 0  # the inputs hold ties: the float64 rounding is a different result
    if mo.available():
        theirs = mo.tensors(mo.run_mergekit(config.read_text(), tmp_path / "mergekit"))
        assert sorted(theirs) == sorted(ours)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k],
                                                                                                    theirs[k])]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_the_merge_command_computes_linear_as_the_config_does(family, tmp_path, mode):
    """``merge --method linear --weights 0.6,0.2``: the same float32 order in both modes (one meaning)."""
    dtype, fts = family
    assert run_cli("merge", *fts, "--method", "linear", "--weights", f"{FIXED},0.2", "--align", "none",
                   "--mode", mode, "-o", tmp_path / mode, "-q") == 0
    ours = mo.tensors(tmp_path / mode)
    a, b = mo.tensors(fts[0]), mo.tensors(fts[1])
    for k, t in ours.items():
        assert torch.equal(t, _float32_order(a[k], b[k], 0.2, True)), k
