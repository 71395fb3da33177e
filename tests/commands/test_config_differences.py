"""Inputs whose config.json differ in what the weights compute (an activation, rope settings, a norm's epsilon,
routing) were merged in silence, the output taking one input's settings. ``merge`` now names every such field and
each input's value: one warning line, and ``config_differences`` in the report (both modes, and the Python API)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from factories import make_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("config-differences")
    make_model("llama", head=True, dtype=torch.float32, seed=0).save_pretrained(root / "a")
    make_model("llama", head=True, dtype=torch.float32, seed=1).save_pretrained(root / "b")
    make_model("llama", head=True, dtype=torch.float32, seed=2, hidden_act="gelu",
               rms_norm_eps=1e-3).save_pretrained(root / "c")
    return root


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_differing_behaviour_fields_are_one_warning_and_reported(folders, tmp_path, capsys, mode):
    out = tmp_path / "o"
    argv = ["merge", folders / "a", folders / "c", "--method", "average", "--align", "none", "--mode", mode]
    assert run_cli(*argv, "--progress", "none", "-o", out) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if "configs differ" in x]
    assert len(warned) == 1 and warned[0].startswith("warning: "), warned
    assert "hidden_act 'silu' (" in warned[0] and "'gelu' (" in warned[0] and "rms_norm_eps" in warned[0], warned
    assert f"config.json is {folders / 'a'}'s" in warned[0], warned
    report = json.loads((out / "symmerge_report.json").read_text())
    found = {d["field"]: d["values"] for d in report["config_differences"]}
    assert set(found) == {"hidden_act", "rms_norm_eps"}, found
    assert found["hidden_act"] == {str(folders / "a"): "silu", str(folders / "c"): "gelu"}
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "silu"


def test_the_same_settings_warn_nothing(folders, tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["merge", folders / "a", folders / "b", "--method", "average", "--align", "none", "--progress", "none"]
    assert run_cli(*argv, "-o", out) == 0
    assert "configs differ" not in capsys.readouterr().err
    assert json.loads((out / "symmerge_report.json").read_text())["config_differences"] == []


def test_a_base_that_differs_is_named_and_the_api_reports_it(folders):
    from symmerge.merge.fuse import merge_models

    _, report = merge_models([str(folders / "a"), str(folders / "b")], method="task_arithmetic", align="none",
                             base=str(folders / "c"), progress=False)
    fields = [d["field"] for d in report["config_differences"]]
    assert fields == ["hidden_act", "rms_norm_eps"], report["config_differences"]
    assert set(report["config_differences"][0]["values"]) == {str(folders / x) for x in "abc"}


def test_two_spellings_of_one_setting_agree(folders, tmp_path):
    """A config.json of transformers 4 (``rope_theta`` at the top) and one of transformers 5 (``rope_parameters``)
    holding the same value are read alike; a different value in either spelling is named."""
    import shutil

    from symmerge.merge.plan import config_differences, config_or_none

    old = tmp_path / "old"
    shutil.copytree(folders / "b", old)
    config = json.loads((old / "config.json").read_text())
    theta = (config.pop("rope_parameters", None) or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_theta"] = theta
    (old / "config.json").write_text(json.dumps(config))
    assert config_differences({"a": config_or_none(folders / "a"), "old": config_or_none(old)}) == []
    config["rope_theta"] = theta * 50
    (old / "config.json").write_text(json.dumps(config))
    found = config_differences({"a": config_or_none(folders / "a"), "old": config_or_none(old)})
    assert [d["field"] for d in found] == ["rope_parameters"], found
    assert found[0]["values"]["old"]["rope_theta"] == theta * 50


def test_a_config_transformers_refuses_is_still_one_error(folders, tmp_path, capsys):
    """The comparison reads config.json through transformers' config class, whose validators raise their own
    error types (a bool field holding a dict): read as written there, and the loading's one error line stays."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folders / "a", bad)
    config = json.loads((bad / "config.json").read_text())
    config["mlp_bias"] = {"x": False}
    (bad / "config.json").write_text(json.dumps(config))
    rc = run_cli("merge", bad, folders / "b", "--method", "average", "--progress", "none", "-o", tmp_path / "o")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("symmerge: error: ") and "mlp_bias" in err, err
    assert not (tmp_path / "o").exists()
