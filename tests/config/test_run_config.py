"""``symmerge run CONFIG.yml``: a config runs exactly the command line it stands for, and a bad config
gets one clear error naming its key and line, with nothing written."""

from __future__ import annotations

import json
import shlex
import textwrap

import pytest
import torch
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
        r.pop("command_line")  # `symmerge run CONFIG` and the `symmerge merge ...` it stands for
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
        allow_tokenizer_mismatch: true
        output: {tmp_path / 'ties'}
        """)
    assert run_cli("run", cfg, "--print-command") == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[argv.index("--method") + 1] == "ties" and argv[argv.index("--base") + 1] == vits[2]
    assert ["--param", "density=0.5"] == argv[argv.index("--param"):argv.index("--param") + 2]
    assert "--allow-tokenizer-mismatch" in argv
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



@pytest.mark.parametrize("command", ["merge", "align", "barrier"])
def test_a_symmerge_config_is_copied_into_its_output_as_symmerge_config_yml(vits, tmp_path, capsys, command):
    """A config with symmerge's keys wrote no copy of itself (README and docs/plans.md said every run writes one, as
    mergekit_config.yml): the output now holds it as symmerge_config.yml (mergekit-yaml could not run it), named on the
    last line; mergekit_config.yml stays for configs of mergekit's keys only; --no-write-model-card: no copy."""
    out = tmp_path / "out"
    keys = {"merge": "merge_method: average\nalign: none\n", "align": "command: align\nsymmetries: attn,ffn\n",
            "barrier": f"command: barrier\ndata: {npz_file(tmp_path / 'd.npz')}\npoints: 3\nalign: [attn, ffn]\n"}
    cfg = _write(tmp_path, f"models: [{vits[0]}, {vits[1]}]\n{keys[command]}progress: none\n", f"{command}.yml")
    capsys.readouterr()
    assert run_cli("run", cfg, out) == 0
    assert (out / "symmerge_config.yml").read_text() == cfg.read_text()
    assert not (out / "mergekit_config.yml").exists()
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"wrote {out / 'symmerge_config.yml'}")
    assert run_cli("run", cfg, tmp_path / "bare", "--no-write-model-card") == 0
    assert not (tmp_path / "bare" / "symmerge_config.yml").exists()


def test_a_mergekit_config_is_copied_as_mergekit_config_yml(vits, tmp_path):
    cfg = _write(tmp_path, f"merge_method: linear\nmodels: [{vits[0]}, {vits[1]}]\nparameters: {{weight: 0.5}}\n")
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none") == 0
    assert (tmp_path / "out" / "mergekit_config.yml").read_text() == cfg.read_text()
    assert not (tmp_path / "out" / "symmerge_config.yml").exists()


BAD = [
    ("merge_method: average\nmodels: [a, b\noutput: o\n", "not valid YAML"),
    ("merge_method: average\noutput: o\n", "'models' is missing"),
    ("merge_method: average\nmodels:\n  - model: a\n    parameters: {density: 0.2}\n  - b\nalign: recommended\n"
     "eval_data: x.npz\noutput: o\n", "only 'weight' can be given per model"),
    ("merge_method: average\nmodels:\n  - model: a\n    parameters: {weight: 1}\n  - b\noutput: o\n",
     "every model or to none"),
    ("merge_method: average\nmodels: [a, b]\nstar: maybe\noutput: o\n", "line 3: 'star' is a switch"),
    ("merge_method: average\nmodels: [a, b]\nrescale: wobbly\noutput: o\n", "invalid choice"),
    ("command: split\nmodels: [a, b]\n", "line 1: command must be one of"),
    ("- a\n- b\n", "a config is a mapping"),
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

    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yml"))
    assert len(examples) >= 3
    for cfg in examples:
        assert run_cli("run", cfg, "--print-command") == 0, cfg
        assert capsys.readouterr().out.startswith("symmerge ")


# -- mergekit configs: the plan (no mergekit needed), and bad configs ---------------------------------------------

@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    import mergekit_oracle as mo

    base, fts = mo.family(tmp_path_factory.mktemp("llamas"), "llama", "float32", n=2, layers=4)
    return [str(base)] + [str(f) for f in fts]


def _steps_by_name(desc, job=-1):
    return {s.name: s for s in desc.jobs[job].steps}


def test_gradients_filters_and_precedence_per_tensor(llamas, tmp_path):
    """A gradient over 4 layers gives layer i the position i/3; tensors outside the layers take its first value;
    filters match the tensor's name; a model's own value wins over the global one."""
    from symmerge.config import describe

    base, a, b = llamas
    cfg = _write(tmp_path, f"""
        merge_method: task_arithmetic
        base_model: {base}
        models:
          - model: {a}
            parameters: {{weight: [0, 0.3, 0.7, 1]}}
          - model: {b}
            parameters:
              weight: [{{filter: mlp, value: [1, 0]}}, {{filter: self_attn, value: 0.5}}]
        parameters: {{weight: 0.25}}
        """)
    steps = _steps_by_name(describe(cfg, output=tmp_path / "o"))
    w = {name: s.weights for name, s in steps.items()}
    assert w["model.layers.0.mlp.up_proj.weight"] == (0.0, 1.0)
    assert w["model.layers.1.mlp.up_proj.weight"] == pytest.approx((0.3, 2 / 3))
    assert w["model.layers.2.self_attn.q_proj.weight"] == pytest.approx((0.7, 0.5))
    assert w["model.layers.3.input_layernorm.weight"] == pytest.approx((1.0, 0.25))  # no filter matches: global
    assert w["model.embed_tokens.weight"] == (0.0, 0.25) and w["lm_head.weight"] == (0.0, 0.25)
    s = steps["model.layers.1.mlp.up_proj.weight"]
    assert s.base.model == 0 and [src.model for src in s.sources] == [1, 2]
    assert not (tmp_path / "o").exists()


def test_slices_take_layers_from_other_models(llamas, tmp_path):
    from symmerge.config import describe

    base, a, b = llamas
    cfg = _write(tmp_path, f"""
        slices:
          - sources: [{{model: {a}, layer_range: [0, 3]}}]
          - sources: [{{model: {b}, layer_range: [1, 4]}}]
        merge_method: passthrough
        dtype: bfloat16
        """)
    desc = describe(cfg, output=tmp_path / "o")
    job = desc.jobs[0]
    steps = _steps_by_name(desc)
    src = steps["model.layers.4.self_attn.k_proj.weight"].sources[0]
    assert (job.inputs[src.model].folder, src.key) == (b, "model.layers.2.self_attn.k_proj.weight")
    assert job.inputs[steps["model.embed_tokens.weight"].sources[0].model].folder == a
    assert job.inputs[steps["lm_head.weight"].sources[0].model].folder == b
    assert job.config_edits == {"num_hidden_layers": 6, "dtype": "bfloat16"} and job.layers == 6


def test_positional_output_and_no_silent_alignment(llamas, tmp_path, capsys):
    """``run CONFIG OUT`` writes OUT; a mergekit config merges without alignment; ``--align`` asks for it."""
    from safetensors.torch import load_file

    base, a, b = llamas
    cfg = _write(tmp_path, f"""
        merge_method: linear
        models:
          - model: {a}
            parameters: {{weight: 0.25}}
          - model: {b}
            parameters: {{weight: 0.75}}
        """)
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none") == 0
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    ta, tb = (load_file(str(__import__("pathlib").Path(p) / "model.safetensors")) for p in (a, b))
    k = "model.layers.2.mlp.down_proj.weight"
    assert torch.allclose(ours[k], 0.25 * ta[k] + 0.75 * tb[k], atol=1e-7)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert run_cli("run", cfg, tmp_path / "out2", "--align", "recommended", "--print-command") == 0
    lines = capsys.readouterr().out.strip().splitlines()  # aligned first, then the same merge (config.aligned)
    assert lines[0].startswith("align recommended: every model into one frame") and lines[1].startswith("merge linear")


MK_BAD = [
    ("merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: []}}\n  - model: {b}\n",
     "line 4: models[0].parameters.weight: an empty list"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: [0, x]}}\n  - model: {b}\n",
     "line 4: models[0].parameters.weight: a gradient is a list of numbers, got 'x'"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\nparameters:\n  weight:\n    - filter: mlp\n"
     "    - value: 1\n", "line 7: parameters.weight[0]: a filter needs 'value'"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\nparameters:\n  weight:\n    - {{filter: mlp, "
     "valu: 1}}\n", "line 7: parameters.weight[0]: unknown key 'valu' in a filter"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\nparameters:\n  weight: [1, {{value: 2}}]\n",
     "line 6: parameters.weight: mixes plain values and filters"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\nparameters:\n  weight:\n    - {{filter: 3, "
     "value: 1}}\n", "line 7: parameters.weight[0].filter: 'filter' is a part of a tensor name"),
    ("slices:\n  - sources:\n      - model: {a}\n        layer_range: [0, 9]\nmerge_method: passthrough\n",
     "line 4: slices[0].sources[0].layer_range: layer_range [0, 9] is not within the model's 4 layers"),
    ("slices:\n  - sources:\n      - model: {a}\n        layer_range: [2, 2]\nmerge_method: passthrough\n",
     "line 4: slices[0].sources[0].layer_range: layer_range [2, 2]"),
    ("slices:\n  - sources:\n      - model: {a}\n        layer_range: 3\nmerge_method: passthrough\n",
     "line 4: slices[0].sources[0].layer_range: 'layer_range' is [a, b]"),
    ("slices:\n  - sources:\n      - {{model: {a}, layer_range: [0, 2]}}\n      - {{model: {b}, layer_range: [0, 3]}}\n"
     "merge_method: linear\nparameters: {{weight: 1}}\n", "line 2: slices[0].sources: the sources of a slice must have"),
    ("slices:\n  - sources:\n      - {{model: {a}, layer_range: [0, 2]}}\n      - {{model: {b}, layer_range: [0, 2]}}\n"
     "merge_method: passthrough\n", "line 2: slices[0]: method 'passthrough' merges exactly 1 model"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: /no/such/model\n",
     "line 4: models[1].model: model '/no/such/model' is not a folder here"),
    ("merge_method: linear\nmodels:\n  - model: {a}+my/lora\n  - model: {b}\nparameters: {{weight: 1}}\n",
     "line 3: models[0].model: {a}+my/lora: the LoRA adapter 'my/lora' is not a folder here"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\nparameters: {{weight: 1}}\n"
     "tokenizer_source: 7\n", "line 6: the tokenizer's source is 'union', 'base' or a model, got 7"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\nparameters: {{weight: 1}}\ndtype: float8\n",
     "line 6: 'dtype' is one of float32, float16, bfloat16, float64"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\nparameters: {{weight: 1}}\ndtype: 2001-12-14\n",
     "line 6: 'dtype' is one of float32, float16, bfloat16, float64, got a YAML date"),
    ("merge_method: linear\nmodels:\n  - model: {a}\nslices:\n  - sources: [{{model: {a}, layer_range: [0, 1]}}]\n",
     "line 4: give 'models' (whole models) or 'slices'"),
    ("merge_method: frobnicate\nmodels:\n  - model: {a}\n  - model: {b}\n", "line 1: unknown merge method 'frobnicate'"),
    ("merge_method: slrep\nmodels:\n  - model: {a}\n  - model: {b}\n",
     "line 1: unknown merge method 'slrep' (did you mean 'slerp'?)"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\n",
     "no 'weight' for model.embed_tokens.weight (method 'linear' needs one per model"),
    ("merge_method: ties\nmodels:\n  - model: {a}\n  - model: {b}\nparameters: {{weight: 1}}\n",
     "line 1: method 'ties' needs 'base_model'"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 1}}\n  - model: {b}\n",
     "line 2: give a weight to every model or to none"),
    ("merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\nmodules: {{default: {{models: [{a}]}}}}\n",
     "line 4: give one of 'models', 'slices' or 'modules'"),
    ("merge_method: linear\nparameters: {{weight: 1}}\nmodules: {{text_decoder: {{models: [{a}]}}}}\n",
     "line 3: modules.text_decoder: module 'text_decoder'"),
    ("merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\nchat_template: chatmx\n",
     "line 4: invalid chat template 'chatmx'"),
    ("merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\n---\nmerge_method: linear\n"
     "models: [{a}, {b}]\nparameters: {{weight: 1}}\n", "line 5 (document 2): more than one merge without 'name'"),
    ("name: x\nmerge_method: linear\nmodels: [y, {b}]\nparameters: {{weight: 1}}\n---\nname: y\nmerge_method: linear\n"
     "models: [x, {b}]\nparameters: {{weight: 1}}\n", "in a cycle"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: [0, 1]}}\n  - model: {b}\n"
     "    parameters: {{weight: 1}}\nalign: recommended\neval_data: x.npz\n",
     "line 4: models[0].parameters.weight: models[0]: with symmerge's own keys a weight is one number"),
    ("merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: [0, 1]}}\n  - model: {b}\n"
     "    parameters: {{weight: 1}}\nalign: recommended\nanchor: 7\n", "line 8: anchor index 7 out of range"),
    ("merge_method: linear\nmodels: 3\n", "line 2: 'models' is a list of models"),
    ("merge_method: linear\nmodels: [{a}, {b}]\nparameters: 5\n", "line 3: 'parameters' is a mapping"),
    ("merge_method: ties\nbase_model: [{a}]\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\n",
     "line 2: expected a model folder"),
    ("merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1, normalize: 3}}\n",
     "line 3: parameters.normalize: true or false expected, got 3"),
    ("merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1, normalize: [true, 0.5]}}\n",
     "line 3: parameters.normalize: a list of true/false expected"),
    ("merge_method: slerp\nbase_model: {a}\nmodels: [{a}, {b}]\n", "no 't' for model.embed_tokens.weight"),
    ("slices:\n  - sources: [{{model: {a}, layer_range: [0, 2]}}]\nmerge_method: passthrough\neval_data: x.npz\n",
     "line 1: 'slices' is a mergekit key, and this config is run as a symmerge merge because of 'eval_data' (line 4)"),
]


@pytest.mark.parametrize("text,message", MK_BAD, ids=[str(i) for i in range(len(MK_BAD))])
def test_bad_mergekit_configs_one_line_exit_2_nothing_written(llamas, tmp_path, capsys, text, message):
    base, a, b = llamas
    cfg = tmp_path / "bad.yml"
    cfg.write_text(text.format(a=a, b=b, base=base))
    out = tmp_path / "out"
    assert run_cli("run", cfg, out) == 2
    err = capsys.readouterr().err
    assert message.format(a=a, b=b) in err, err
    assert err.count("symmerge: error:") == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{cfg} line" in err or "cycle" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.yml"]


def test_no_output_folder_is_one_error(llamas, tmp_path, capsys):
    base, a, b = llamas
    cfg = _write(tmp_path, f"merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\n")
    assert run_cli("run", cfg) == 2
    assert "no output folder: symmerge run CONFIG.yml OUT" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [(["-o", "elsewhere"], "two output folders"),
                                           (["-j", "-1"], "argument -j/--num-threads: must be >= 1, got -1")])
def test_mergekit_flags_refused_in_one_line(llamas, tmp_path, capsys, flags, message):
    base, a, b = llamas
    cfg = _write(tmp_path, f"merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\n")
    try:
        rc = run_cli("run", cfg, tmp_path / "o", *flags)
    except SystemExit as e:  # a flag's declared range: argparse's line
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_mergekit_flags_accepted(llamas, tmp_path):
    base, a, b = llamas
    cfg = _write(tmp_path, f"merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\n")
    assert run_cli("run", cfg, tmp_path / "o", "--copy-tokenizer", "--lazy-unpickle", "--out-shard-size", "100K",
                   "--random-seed", "3", "--progress", "none") == 0
    import json as _json

    index = _json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_align_none_keeps_the_mergekit_meaning(llamas, tmp_path):
    from symmerge.config import describe

    base, a, b = llamas
    cfg = _write(tmp_path, f"merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\nalign: none\n")
    assert describe(cfg, output=tmp_path / "o").mergekit
    assert describe(cfg, output=tmp_path / "o").alignment is None
    cfg = _write(tmp_path, f"merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\nalign: recommended\n")
    desc = describe(cfg, output=tmp_path / "o")  # the same merge, on the models aligned first
    assert desc.mergekit and desc.alignment.options.align.recommended and desc.jobs[0].method in ("linear", "average")
    cfg = _write(tmp_path, f"merge_method: linear\nmodels: [{a}, {b}]\nalign: recommended\neval_data: x.npz\n")
    desc = describe(cfg, output=tmp_path / "o")  # symmerge's own keys: the merge command
    assert not desc.mergekit and desc.argv[desc.argv.index("--align") + 1] == "recommended"


@pytest.mark.parametrize("align", [None, "recommended"])
def test_a_mergekit_config_prints_its_plan_without_an_output_folder(vits, tmp_path, capsys, align):
    """``symmerge run CONFIG --print-plan`` (docs/plans.md: ``[OUT]``) stopped at 'no output folder' although it
    writes nothing; so did ``--print-command``. Both now plan with no output (``output: null``, ``-> OUT``); a run
    without one is still that error."""
    cfg = _write(tmp_path, f"""\
        merge_method: linear
        models:
          - model: {vits[0]}
            parameters: {{weight: 0.5}}
          - model: {vits[1]}
            parameters: {{weight: 0.5}}
        """ + (f"align: {align}\n" if align else ""))
    capsys.readouterr()
    assert run_cli("run", cfg, "--print-plan") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["output"] is None
    assert run_cli("run", cfg, "--print-command") == 0
    assert capsys.readouterr().out.strip().endswith("-> OUT")
    assert run_cli("run", cfg) == 2
    assert "no output folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merge.yml", "vit0", "vit1", "vit2"]
