"""``symmerge merge B F1 ... --base B``: the base listed among the models is the base, not one more model with a
zero task vector, for a method that merges task vectors from it — as a mergekit config reads ``base_model`` listed
among ``models`` (:func:`symmerge.merge.plan.base_among_models`). Before, ``--method slerp`` was refused ("merges
exactly 1 model besides the base model, got 2") where the config is accepted, and model_stock merged the base as a
third model (0.0078 off the config's result on a tiny Llama): two meanings of one merge."""

from __future__ import annotations

import pytest
import torch
import yaml

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return mo.family(tmp_path_factory.mktemp("bam"), dtype="float32", n=3, layers=2, noise=0.01)


def _same(a, b):
    x, y = mo.tensors(a), mo.tensors(b)
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def _config(path, method, base, models, params):
    path.write_text(yaml.safe_dump({"merge_method": method, "base_model": str(base), "parameters": params,
                                    "models": [{"model": str(m)} for m in models]}))
    return path


@pytest.mark.parametrize("method,params,n", [("slerp", {"t": 0.3}, 1), ("model_stock", {}, 2),
                                             ("model_stock", {}, 3)])
def test_the_base_among_the_models_is_the_config_s_base(family, tmp_path, method, params, n):
    base, fts = family
    flags = [x for k, v in params.items() for x in ("--param", f"{k}={v}")]
    assert run_cli("merge", base, *fts[:n], "--base", base, "--method", method, *flags, "--align", "none",
                   "-o", tmp_path / "cli", "-q") == 0
    assert run_cli("run", _config(tmp_path / "c.yml", method, base, [base, *fts[:n]], params), tmp_path / "run",
                   "-q") == 0
    assert _same(tmp_path / "cli", tmp_path / "run")
    assert run_cli("merge", *fts[:n], "--base", base, "--method", method, *flags, "--align", "none",
                   "-o", tmp_path / "without", "-q") == 0
    assert _same(tmp_path / "cli", tmp_path / "without")
    report = yaml.safe_load((tmp_path / "cli" / "symmerge_report.json").read_text())
    assert len(report["models"]) == n


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_the_base_s_weight_goes_with_it(family, tmp_path, mode):
    base, fts = family
    common = ["--base", base, "--method", "task_arithmetic", "--align", "none", "--mode", mode, "-q"]
    assert run_cli("merge", fts[0], base, fts[1], "--weights", "0.7,5.0,0.4", *common, "-o", tmp_path / "a") == 0
    assert run_cli("merge", fts[0], fts[1], "--weights", "0.7,0.4", *common, "-o", tmp_path / "b") == 0
    assert _same(tmp_path / "a", tmp_path / "b")


def test_print_plan_lists_the_merged_models_only(family, capsys):
    import json

    base, fts = family
    assert run_cli("merge", base, fts[0], "--base", base, "--method", "slerp", "--param", "t=0.5", "--align", "none",
                   "--print-plan", "-o", "/nonexistent/never-written") == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["models"]) == 1 and all(s["op"] == "merge" for s in plan["steps"])
