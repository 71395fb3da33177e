"""One-model passthrough, one plan and one report from every entry (docs/results/entryeq_audit.md, "After tidy"):
``symmerge merge M1 --method passthrough`` (in memory and streamed), ``symmerge run`` with symmerge's keys, ``symmerge
run`` with a mergekit config (``models:`` or ``slices:``) and ``symmerge.merge()`` plan every tensor as a copy of
the one model (the method's ``copy_unless``: ``scale`` not given, or 1) and report its distance to the result, 0.0
exactly, with empty pair tables. Before, the command line planned merge steps (``{merge: 21, copy: 0}``) and a
mergekit config's report had the distances ``null`` ("not computed") for the same bits. Shown to fail before the
fix. With ``scale`` other than 1 every entry still merges (multiplies); ``scale: 1`` is a copy everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from conftest import run_cli
from test_entry_equivalence import _llama

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return _llama(tmp_path_factory.mktemp("onepass") / "m1", 1)


def _entries(m: str, tmp_path: Path, scale=None) -> dict:
    """Every entry's report of the one-model passthrough of ``m`` (``scale``: given, or not)."""
    import symmerge
    from symmerge.merge.fuse import MergeOptions

    param = ["--param", f"scale={scale}"] if scale is not None else []
    params = {"scale": scale} if scale is not None else {}
    out = {}
    for mode in ("memory", "stream"):
        assert run_cli("merge", m, "--method", "passthrough", "--align", "none", "--mode", mode, *param,
                       "-o", tmp_path / f"cli-{mode}", "--progress", "none") == 0
    own = {"method": "passthrough", "models": [m], "align": "none", "progress": "none",
           **({"parameters": params} if params else {})}
    mk = {"merge_method": "passthrough", "models": [{"model": m}], **({"parameters": params} if params else {})}
    slices = {"merge_method": "passthrough", "slices": [{"sources": [{"model": m, "layer_range": [0, 2]}]}],
              **({"parameters": params} if params else {})}
    for name, cfg in (("own", own), ("mk", mk), ("slices", slices)):
        (tmp_path / f"{name}.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        assert run_cli("run", tmp_path / f"{name}.yml", tmp_path / name, "--quiet") == 0
    symmerge.merge([m], tmp_path / "api", MergeOptions(method="passthrough", align="none", params=params,
                                                        progress=False))
    for name in ("cli-memory", "cli-stream", "own", "mk", "slices", "api"):
        out[name] = json.loads((tmp_path / name / "symmerge_report.json").read_text())
    return out


def test_every_entry_plans_copies_and_reports_distance_zero(one, tmp_path):
    reports = _entries(one, tmp_path)
    n = len(load_file(Path(one) / "model.safetensors"))
    for name, report in reports.items():
        assert report["plan"]["steps"] == {"merge": 0, "copy": n}, name
        assert report["distance_result_to_inputs"] == {one: 0.0}, name
        assert report["distances_between_inputs"] == {"before_alignment": {}, "after_alignment": {}}, name
    source = load_file(Path(one) / "model.safetensors")
    for name in reports:
        written = load_file(tmp_path / name / "model.safetensors")
        assert written.keys() == source.keys() and all(written[k].equal(source[k]) for k in source), name


def test_the_printed_plan_is_the_copies(one, tmp_path, capsys):
    assert run_cli("merge", one, "--method", "passthrough", "--align", "none", "-o", tmp_path / "o",
                   "--print-plan") == 0
    printed = json.loads(capsys.readouterr().out)
    ops = {s["op"] for s in printed["steps"]}
    assert ops == {"copy"}, ops


@pytest.mark.parametrize("scale", [1, 0.5])
def test_scale_one_is_a_copy_and_another_scale_merges_alike(one, tmp_path, scale):
    reports = _entries(one, tmp_path, scale)
    steps = {name: r["plan"]["steps"] for name, r in reports.items()}
    assert len({json.dumps(s) for s in steps.values()}) == 1, steps
    assert next(iter(steps.values()))["merge"] == (0 if scale == 1 else 21)
    first = reports["cli-stream"]
    for name, report in reports.items():  # in memory the distances are summed in another order: the last digits
        assert report["distances_between_inputs"] == first["distances_between_inputs"], name
        assert report["distance_result_to_inputs"] == pytest.approx(first["distance_result_to_inputs"], rel=1e-12), \
            name


def test_a_copy_rounded_to_another_dtype_reports_its_measured_distance(one, tmp_path):
    """The copies' distance is measured as written, not assumed: a float32 model copied into bfloat16 (mergekit's
    ``out_dtype``) is that rounding's distance from its input, not 0."""
    import torch

    cfg = {"merge_method": "passthrough", "models": [{"model": one}], "out_dtype": "bfloat16"}
    (tmp_path / "c.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert run_cli("run", tmp_path / "c.yml", tmp_path / "out", "--quiet") == 0
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    source = load_file(Path(one) / "model.safetensors")
    expected = sum(float((v.to(torch.bfloat16).double() - v.double()).square().sum())
                   for k, v in source.items() if k != "lm_head.weight") ** 0.5
    assert report["plan"]["steps"]["merge"] == 0
    assert report["distance_result_to_inputs"][one] == pytest.approx(expected, rel=1e-12) and expected > 0
