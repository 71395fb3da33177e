"""``symmerge run CONFIG.yml``: a config runs exactly the command line it stands for, and a bad config
gets one clear error naming its key and line, with nothing written."""

from __future__ import annotations

import json
import shlex
import textwrap

import pytest
from safetensors.torch import load_file

from conftest import npz_file, run_cli, vit_folder


@pytest.fixture
def vits(tmp_path):
    return [str(vit_folder(tmp_path / f"vit{s}", s)) for s in range(3)]


def _write(tmp_path, text: str, name="merge.yml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _same_outputs(a, b):
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys() and all((ta[k] == tb[k]).all() for k in ta)
    ra, rb = (json.loads((p / "symmerge_report.json").read_text()) for p in (a, b))
    for r in (ra, rb):
        r.pop("timings")
        for m in r["alignment"]["models"]:
            m.pop("seconds", None)
        r.get("alignment", {}).get("joint", {}).pop("seconds", None)
    assert ra == rb


def test_config_runs_the_same_merge_as_the_command_line(vits, tmp_path, capsys):
    data = npz_file(tmp_path / "eval.npz")
    out_cfg, out_cli = tmp_path / "from_config", tmp_path / "from_cli"
    cfg = _write(tmp_path, f"""
        # three models, mergekit style
        merge_method: average
        models:
          - model: {vits[0]}
            parameters: {{weight: 0.5}}
          - model: {vits[1]}
            parameters: {{weight: 0.3}}
          - model: {vits[2]}
            parameters: {{weight: 0.2}}
        align: [attn, ffn]
        rescale: joint
        joint_rounds: 2
        eval_data: {data}
        no_verify: false
        progress: none
        output: {out_cfg}
        """)
    assert run_cli("run", cfg, "--print-command") == 0
    printed = capsys.readouterr().out.strip()
    argv = shlex.split(printed)
    assert argv[:2] == ["symmerge", "merge"] and argv[2:5] == vits
    assert "--weights" in argv and argv[argv.index("--weights") + 1] == "0.5,0.3,0.2"
    assert argv[argv.index("--align") + 1] == "attn,ffn"
    assert not out_cfg.exists()  # --print-command runs nothing
    assert run_cli("run", cfg) == 0
    cli = [a if a != str(out_cfg) else str(out_cli) for a in argv[1:]]
    assert run_cli(*cli) == 0
    _same_outputs(out_cfg, out_cli)
    report = json.loads((out_cfg / "symmerge_report.json").read_text())
    assert report["weights"] == [0.5, 0.3, 0.2] and report["alignment"]["symmetries"] == ["attn", "ffn"]
    assert report["alignment"]["joint"]["rounds"] <= 2


def test_method_parameters_base_and_switches(vits, tmp_path, capsys):
    cfg = _write(tmp_path, f"""
        merge_method: ties
        base_model: {vits[2]}
        models: [{vits[0]}, {vits[1]}]
        parameters:
          density: 0.5
          scale: 0.8
        align: none
        star: true
        output: {tmp_path / 'ties'}
        """)
    assert run_cli("run", cfg, "--print-command") == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[argv.index("--method") + 1] == "ties" and argv[argv.index("--base") + 1] == vits[2]
    assert ["--param", "density=0.5"] == argv[argv.index("--param"):argv.index("--param") + 2]
    assert "--star" in argv
    assert run_cli("run", cfg) == 0
    report = json.loads((tmp_path / "ties" / "symmerge_report.json").read_text())
    assert report["method"] == "ties" and report["params"]["density"] == 0.5 and report["params"]["scale"] == 0.8


def test_align_and_barrier_configs(vits, tmp_path):
    aligned = tmp_path / "aligned"
    cfg = _write(tmp_path, f"""
        command: align
        models: [{vits[0]}, {vits[1]}]
        symmetries: attn,ffn
        output: {aligned}
        """, "align.yml")
    assert run_cli("run", cfg) == 0 and (aligned / "symmerge_report.json").exists()
    bar = tmp_path / "barrier"
    cfg = _write(tmp_path, f"""
        command: barrier
        models: [{vits[0]}, {vits[1]}]
        data: {npz_file(tmp_path / 'd.npz')}
        align: [attn, ffn]
        points: 3
        output: {bar}
        """, "barrier.yml")
    assert run_cli("run", cfg) == 0
    assert len(json.loads((bar / "barrier.json").read_text())["alphas"]) == 3


BAD = [
    ("merge_method: average\nmodels: [a, b]\nfoo: 1\noutput: o\n", "line 3: unknown key 'foo'"),
    ("merge_method: average\nmodels: [a, b\noutput: o\n", "not valid YAML"),
    ("merge_method: average\noutput: o\n", "'models' is missing"),
    ("merge_method: average\nmodels:\n  - model: a\n    parameters: {density: 0.2}\n  - b\noutput: o\n",
     "line 4: models[0].parameters.density: method 'average' has no parameter 'density'"),
    ("merge_method: average\nmodels:\n  - model: a\n    parameters: {density: 0.2}\n  - b\nalign: recommended\n"
     "output: o\n", "only 'weight' can be given per model"),
    ("merge_method: average\nmodels:\n  - model: a\n    parameters: {weight: 1}\n  - b\noutput: o\n",
     "every model or to none"),
    ("merge_method: average\nmodels: [a, b]\nstar: maybe\noutput: o\n", "line 3: 'star' is a switch"),
    ("merge_method: average\nmodels: [a, b]\nrescale: wobbly\noutput: o\n", "invalid choice"),
    ("command: split\nmodels: [a, b]\n", "line 1: command must be one of"),
    ("- a\n- b\n", "a config is a mapping"),
    ("merge_method: average\nmodels: [a, b]\nmethod_params: {x: 1}\noutput: o\n", "unknown key 'method_params'"),
    ("command: align\nmodels: [a, b]\nweights: 1,2\noutput: o\n", "line 3: unknown key 'weights' for symmerge align"),
    ("command: align\nmodels: [a, b]\nmerge_method: average\noutput: o\n", "unknown key 'merge_method'"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_configs_get_one_clear_error(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.yml"
    cfg.write_text(text)
    assert run_cli("run", cfg) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("symmerge: error:") == 1
    assert not (tmp_path / "o").exists()


def test_missing_config_file(tmp_path, capsys):
    assert run_cli("run", tmp_path / "nope.yml") == 2
    assert "config file not found" in capsys.readouterr().err


def test_the_example_configs_parse(capsys):
    from pathlib import Path

    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.yml"))
    assert len(examples) >= 3
    for cfg in examples:
        assert run_cli("run", cfg, "--print-command") == 0, cfg
        assert capsys.readouterr().out.startswith("symmerge ")
