"""One result however a merge is computed (benchmarks/repro_audit.py, docs/results/repro_audit.md): the same merge in
memory and streamed reports the same distances (over the body: a language model's merged head is no part of them,
in either wing)."""

from __future__ import annotations

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
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    out = {}
    for k, m in tiny_models().items():
        out[k] = root / f"m{k}"
        m.save_pretrained(str(out[k]))
    return out


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

