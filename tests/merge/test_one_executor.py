"""The in-memory merge is the executor with memory sources: for every method family, a merge in memory and the
same merge streamed run the same steps (:attr:`MergePlan.steps`, one :class:`~symmerge.merge.steps.TensorStep`
per output tensor: copy, or merge with which inputs and arguments) through the one executor and write the
same tensors bit for bit. And results are checked before they are written: a non-finite result is one error
naming the tensor and the parameter, in both modes, with nothing written; an all-zero result or one far
outside its inputs' range is a warning in the log and the report's ``result_warnings``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from symmerge.merge import api, executor
from symmerge.merge.plan import plan_merge
from test_bad_input import assert_clean_failure, run_cli, tree_hash
from test_stream_merge import llama

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-executor")
    out = {"base": root / "base"}
    llama(0, vocab=1100).save_pretrained(str(out["base"]))
    for i in (1, 2):  # fine-tunes of the base
        m = llama(0, vocab=1100)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)
        out[i] = root / f"m{i}"
        m.save_pretrained(str(out[i]))
    return out


# (method, its parameters, models, whether it takes the base): one per family
FAMILIES = [("average", [], 2, False), ("linear", ["--weights", "0.3,0.7"], 2, False),
            ("task_arithmetic", ["--param", "scale=0.7"], 2, True), ("ties", ["--param", "density=0.3"], 2, True),
            ("dare", ["--param", "drop=0.5", "--param", "seed=7"], 2, True), ("slerp", ["--param", "t=0.3"], 1, True),
            ("model_stock", [], 2, True), ("passthrough", [], 1, False)]


def tensors(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("method,params,n,base", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_memory_and_stream_run_the_same_steps_and_write_the_same_bits(folders, tmp_path, capsys, monkeypatch,
                                                                    method, params, n, base):
    plans, executed = {}, {}
    plan_merge_ = api.plan_merge
    run_ = executor.StreamExecutor.run

    def recording_plan(models, options, mode="auto"):
        plans[mode] = plan_merge_(models, options, mode=mode)
        return plans[mode]

    def recording_run(self, folder=None, target=None):
        executed[type(self.ckpts[0]).__name__] = list(self.steps)
        return run_(self, folder, target)

    monkeypatch.setattr(api, "plan_merge", recording_plan)
    monkeypatch.setattr(executor.StreamExecutor, "run", recording_run)
    models = [folders[i] for i in (1, 2)[:n]]
    result, reports = {}, {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        rc, _, err = run_cli(capsys, "merge", *models, "--method", method, *params, "--align", "none",
                             *(["--base", folders["base"]] if base else []), "--mode", mode, "--progress", "none",
                             "-o", out)
        assert rc == 0, err
        result[mode] = tensors(out)
        reports[mode] = json.loads((out / "symmerge_report.json").read_text())
    # the memory wing ran the executor on state dicts, the streamed one on the files: the plan's steps, both
    assert set(executed) == {"MemorySource", "LazyCheckpoint"}
    steps = {mode: sorted(plans[mode].steps, key=lambda s: s.name) for mode in ("memory", "stream")}
    assert steps["memory"] == steps["stream"]
    assert sorted(executed["MemorySource"], key=lambda s: s.name) == steps["memory"]
    assert sorted(executed["LazyCheckpoint"], key=lambda s: s.name) == steps["stream"]
    # LM head merged too, nothing copied; a one-model passthrough copies every tensor (its copy_unless, as a config)
    merged = 0 if method == "passthrough" else len(steps["memory"])
    assert sum(s.merge for s in steps["memory"]) == merged
    assert result["memory"].keys() == result["stream"].keys() == {s.name for s in steps["memory"]}
    for k, t in result["memory"].items():
        assert t.dtype == result["stream"][k].dtype and torch.equal(t, result["stream"][k]), k
    if method != "passthrough":  # a real merge, not a copy of an input
        k = "model.embed_tokens.weight"
        assert all(not torch.equal(result["memory"][k], tensors(f)[k]) for f in models)
    assert reports["memory"]["plan"]["steps"] == reports["stream"]["plan"]["steps"] == {
        "merge": merged, "copy": len(steps["memory"]) - merged}
    # the reports agree but for the mode-specific entries; the distances (over the body in both: the LM head is no
    # part of them) bit for bit: one per-tensor function, the values summed exactly (merge/distances.py)
    drop = ("timings", "mode", "plan", "stream", "device", "side_files", "command_line", "distances_between_inputs",
            "distance_result_to_inputs")
    assert ({k: v for k, v in reports["memory"].items() if k not in drop} ==
            {k: v for k, v in reports["stream"].items() if k not in drop})
    distances = [{**r["distance_result_to_inputs"], **r["distances_between_inputs"]["after_alignment"]}
                 for r in (reports["memory"], reports["stream"])]
    assert distances[0].keys() == distances[1].keys()
    assert distances[0] == distances[1]


def test_a_task_head_kept_from_one_model_is_a_copy_step(tmp_path, capsys, monkeypatch):
    """A classifier's head (another label count per model) is copied from --head-from in both modes."""
    from conftest import vit_folder

    a, b = vit_folder(tmp_path / "a", 0), vit_folder(tmp_path / "b", 1, num_labels=5)
    plans = {}
    plan_merge_ = api.plan_merge
    monkeypatch.setattr(api, "plan_merge", lambda models, options, mode="auto":
                        plans.setdefault(mode, plan_merge_(models, options, mode=mode)))
    for mode in ("memory", "stream"):
        rc, _, err = run_cli(capsys, "merge", a, b, "--method", "average", "--align", "none", "--head-from", "1",
                             "--mode", mode, "--progress", "none", "-o", tmp_path / mode)
        assert rc == 0, err
    steps = {m: sorted(plans[m].steps, key=lambda s: s.name) for m in plans}
    assert steps["memory"] == steps["stream"]
    copied = {s.name: s.sources[0].model for s in steps["memory"] if not s.merge}
    assert copied == {"classifier.weight": 1, "classifier.bias": 1}
    mem, st = tensors(tmp_path / "memory"), tensors(tmp_path / "stream")
    assert all(torch.equal(mem[k], st[k]) for k in mem) and torch.equal(mem["classifier.weight"],
                                                                         tensors(b)["classifier.weight"])


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_non_finite_result_is_one_line_naming_tensor_and_parameter(folders, tmp_path, capsys, mode):
    before = tree_hash(folders[1])
    out = tmp_path / "outs" / "o"
    out.parent.mkdir()
    rc, _, err = run_cli(capsys, "merge", folders[1], folders[2], "--base", folders["base"], "--method",
                         "task_arithmetic", "--param", "lambda=1e300", "--align", "none", "--mode", mode,
                         "--progress", "none", "-o", out)
    assert rc == 2
    assert_clean_failure(rc, err, out, "merged tensor", "holds inf", "with scale=1e+300)",
                        "nothing was written")  # lambda is an alias of scale
    assert tree_hash(folders[1]) == before


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_degenerate_results_are_warned_about_in_log_and_report(folders, tmp_path, capsys, mode):
    # weights that cancel: the same model minus itself is a model of zeros
    rc, _, err = run_cli(capsys, "merge", folders[1], folders[1], "--method", "linear", "--weights", "1,-1",
                         "--param", "normalize=false", "--align", "none", "--mode", mode, "--progress", "none",
                         "-o", tmp_path / "zeros")
    assert rc == 0, err
    report = json.loads((tmp_path / "zeros" / "symmerge_report.json").read_text())
    zeros = {w["tensor"] for w in report["result_warnings"] if w["warning"].startswith("all zeros")}
    assert "model.embed_tokens.weight" in zeros and len(zeros) == len(tensors(tmp_path / "zeros"))
    assert "warning: merged tensor 'model.embed_tokens.weight': all zeros" in err
    # a task vector scaled a million times: far outside the inputs' range
    rc, _, err = run_cli(capsys, "merge", folders[1], folders[2], "--base", folders["base"], "--method",
                         "task_arithmetic", "--param", "scale=1e6", "--align", "none", "--mode", mode,
                         "--progress", "none", "-o", tmp_path / "far")
    assert rc == 0, err
    report = json.loads((tmp_path / "far" / "symmerge_report.json").read_text())
    assert any(w["tensor"] == "model.embed_tokens.weight" and "far outside" in w["warning"]
               for w in report["result_warnings"])
    # control: an ordinary merge warns about nothing
    rc, _, err = run_cli(capsys, "merge", folders[1], folders[2], "--method", "average", "--align", "none",
                         "--mode", mode, "--progress", "none", "-o", tmp_path / "plain")
    assert rc == 0 and "warning" not in err
    assert json.loads((tmp_path / "plain" / "symmerge_report.json").read_text())["result_warnings"] == []


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_print_plan_prints_the_steps_the_merge_runs_and_writes_nothing(folders, tmp_path, capsys, monkeypatch, mode):
    from symmerge.merge.steps import describe_step

    argv = ["merge", folders[1], folders[2], "--base", folders["base"], "--method", "ties", "--param", "density=0.4",
            "--align", "none", "--mode", mode, "--progress", "none", "-o", tmp_path / "out"]
    rc, out, err = run_cli(capsys, *argv, "--print-plan")
    assert rc == 0, err
    printed = json.loads(out)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []
    assert printed["plan"]["mode"] == mode and printed["params"]["density"] == 0.4
    plans = {}
    plan_merge_ = api.plan_merge
    monkeypatch.setattr(api, "plan_merge", lambda models, options, mode="auto":
                        plans.setdefault(mode, plan_merge_(models, options, mode=mode)))
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0, err
    ran = sorted((describe_step(s) for s in plans[mode].steps), key=lambda d: d["tensor"])
    assert sorted(printed["steps"], key=lambda d: d["tensor"]) == json.loads(json.dumps(ran))
    assert all(s["op"] == "merge" and s["base"] == [2, s["tensor"]] for s in printed["steps"])


def test_result_checks_take_every_floating_dtype():
    from symmerge.merge.outputs import check_result
    from symmerge.merge.registry import get_method

    m = get_method("average")
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(300, 7, dtype=torch.float64).to(dtype)
        assert check_result("w", x, [x, x], m, {}) is None
        assert check_result("w", torch.zeros_like(x), [x, x], m, {})["warning"].startswith("all zeros")
        assert "far outside" in check_result("w", x * 1000, [x, x], m, {})["warning"]
        with pytest.raises(Exception, match="holds NaN"):
            check_result("w", torch.full_like(x, float("nan")), [x, x], m, {})
