"""One merge, one report from every entry (benchmarks/entryeq_audit.py, docs/results/entryeq_audit.md): the report's
``params`` of a mergekit config's run are the method's parameters after defaults (aliases under their parameter's
name), as ``symmerge merge`` and ``symmerge.merge()`` report them for the same merge, not only the keys the config
wrote (before: ``{"density": 0.5}`` against the command's six parameters). Shown to fail before the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from test_entry_equivalence import _config, llamas  # noqa: F401  (the fixture)


def _report(folder: Path) -> dict:
    return json.loads((folder / "symmerge_report.json").read_text())


@pytest.mark.parametrize("method, params, base", [
    ("ties", {}, True), ("ties", {"density": 0.5, "lambda": 0.8}, True), ("dare_linear", {"density": 0.6}, True),
    ("linear", {}, False), ("karcher", {"max_iter": 3}, False), ("slerp", {"t": 0.3}, True),
])
def test_the_report_params_of_a_mergekit_config_are_the_commands(method, params, base, llamas, tmp_path):
    b, fts = llamas[0], llamas[1:] if method != "slerp" else llamas[1:2]
    argv = ["merge", *fts, "--method", method, "--align", "none", "-o", tmp_path / "cli", "--progress", "none"]
    argv += ["--base", b] if base else []
    argv += ["--weights", ",".join(["1.0"] * len(fts))]
    for k, v in params.items():
        argv += ["--param", f"{k}={v}"]
    assert run_cli(*argv) == 0
    path = _config(tmp_path, method, fts, b if base else None, params, weights=[1.0] * len(fts))
    assert run_cli("run", path, tmp_path / "run", "--quiet") == 0
    cli, run = _report(tmp_path / "cli"), _report(tmp_path / "run")
    assert run["params"] == cli["params"]
    assert run["weights"] == cli["weights"]


def test_per_model_values_in_a_mergekit_config_are_reported_per_model(llamas, tmp_path):
    """A per-model parameter every model sets to one value: the list in model order, as ``symmerge.merge(...,
    params={'density': [0.7, 0.4]})`` reports it; a parameter given as a gradient stays as written."""
    import symmerge
    from symmerge.merge.fuse import MergeOptions

    base, fts = llamas[0], llamas[1:]
    cfg = {"merge_method": "ties", "base_model": base,
           "models": [{"model": m, "parameters": {"weight": 1.0, "density": d}} for m, d in zip(fts, (0.7, 0.4))],
           "parameters": {"lambda": [0.5, 1.0]}}
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert run_cli("run", path, tmp_path / "run", "--quiet") == 0
    api = symmerge.merge(fts, tmp_path / "api", MergeOptions(method="ties", base=base, params={"density": [0.7, 0.4]},
                                                             weights=[1.0, 1.0], align="none", progress=False))
    run = _report(tmp_path / "run")
    assert run["params"]["density"] == api["params"]["density"] == [0.7, 0.4]
    assert run["params"]["scale"] == [0.5, 1.0]  # a gradient, as written (under the parameter's name)
    assert {k: v for k, v in run["params"].items() if k not in ("density", "scale")} == \
        {k: v for k, v in api["params"].items() if k not in ("density", "scale")}


@pytest.mark.parametrize("method", ["ties", "linear"])
def test_the_distances_of_a_mergekit_config_are_over_the_body_as_the_commands(method, llamas, tmp_path):
    """``distances_between_inputs`` and ``distance_result_to_inputs`` are over the body (the language model's head
    left out, docs/merge.md "Two distances"), in a mergekit config's report as in ``symmerge merge``'s: before, the
    config's summed every merged tensor, ``lm_head`` too, so the same merge reported other distances."""
    base, fts = llamas[0], llamas[1:]
    uses_base = method == "ties"
    argv = ["merge", *fts, "--method", method, "--align", "none", "-o", tmp_path / "cli", "--progress", "none",
            "--weights", "1.0,1.0", *(["--base", base] if uses_base else [])]
    assert run_cli(*argv) == 0
    path = _config(tmp_path, method, fts, base if uses_base else None, {})
    assert run_cli("run", path, tmp_path / "run", "--quiet") == 0
    cli, run = _report(tmp_path / "cli"), _report(tmp_path / "run")
    for field in ("distances_between_inputs", "distance_result_to_inputs"):
        assert run[field] == cli[field], field


def test_the_stream_entry_of_a_mergekit_config_has_the_commands_fields(llamas, tmp_path):
    """The report's ``stream`` entry (docs/merge.md: shards, bytes written, largest tensor, read-ahead budget and peak,
    direct I/O, the threads' seconds) has the same fields after a config's merge as after ``symmerge merge``'s
    streamed one; before, a config's had the first two only."""
    base, fts = llamas[0], llamas[1:]
    assert run_cli("merge", *fts, "--method", "ties", "--base", base, "--align", "none", "--weights", "1,1",
                   "-o", tmp_path / "cli", "--progress", "none") == 0
    assert run_cli("run", _config(tmp_path, "ties", fts, base, {}), tmp_path / "run", "--quiet") == 0
    cli, run = _report(tmp_path / "cli")["stream"], _report(tmp_path / "run")["stream"]
    assert set(run) == set(cli) and set(run["seconds"]) == set(cli["seconds"])
    same = ("shards", "bytes_written", "largest_tensor_bytes", "read_ahead_budget_bytes", "direct_io")
    assert {k: run[k] for k in same} == {k: cli[k] for k in same}
