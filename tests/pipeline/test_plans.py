"""One plan per operation (issue 39, items 1–2): ``align``, ``barrier`` and each document of a ``run`` config are
resolved from the headers and the options into a plan with its steps, printed by ``--print-plan`` without reading
a weight or writing anything, and every command's report is built from its plan by the one report builder
(``plan`` entry, the decided fields) — the plan's steps are what the executor did: a tensor the plan copies is
written bit for bit, every tensor the alignment changed is one the plan transforms."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from conftest import folder_tensors, npz_file, run_cli, vit_folder
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _printed(capsys, *argv) -> dict:
    capsys.readouterr()
    assert run_cli(*argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("plans")
    out = []
    for seed in (0, 1):
        m = make_model("llama", head=True, dtype=torch.float32, seed=seed)
        m.save_pretrained(str(root / f"llama{seed}"))
        out.append(root / f"llama{seed}")
    return out


def forbid_weights(m):
    """Make the test fail if a tensor of more than one dimension is read, or if anything aligns (``m``: a
    monkeypatch or one of its contexts)."""
    # the modules that import align_pair by name, imported before it is patched: first imported inside the context
    # they kept the patch for the rest of the session (the test failed when run alone: its own study then raised)
    import symmerge.merge.barrier  # noqa: F401
    import symmerge.merge.fuse  # noqa: F401
    from symmerge.io import checkpoint
    from symmerge.pipeline import align

    read = checkpoint.LazyCheckpoint.read

    def reading(self, keys):
        big = [k for k in keys if len(self.shape.get(k, ())) > 1]
        assert not big, f"the plan read weights: {big[:3]}"
        return read(self, keys)

    def aligning(*a, **k):
        raise AssertionError("the plan aligned")

    m.setattr(checkpoint.LazyCheckpoint, "read", reading)
    m.setattr(align, "align_pair", aligning)


@pytest.fixture
def headers_only(monkeypatch):
    forbid_weights(monkeypatch)


# -- align --------------------------------------------------------------------------------------------------------

def test_align_print_plan_lists_every_tensor_from_the_headers_and_writes_nothing(llamas, tmp_path, capsys,
                                                                              headers_only):
    out = tmp_path / "out"
    plan = _printed(capsys, "align", llamas[0], llamas[1], "-o", out, "--print-plan")
    assert not out.exists()
    assert plan["symmetries_requested"] == "recommended"
    assert plan["symmetries"] == ["heads", "attn", "ffn", "rescale", "residual"]
    assert plan["plan"]["residual_variant"] == "orthogonal" and plan["plan"]["match"] == "weights"
    assert plan["plan"]["verify"]["outputs"] is True
    stored = set(load_file(str(llamas[0] / "model.safetensors")))
    assert {s["tensor"] for s in plan["steps"]} == stored
    q = next(s for s in plan["steps"] if s["tensor"] == "model.layers.0.self_attn.q_proj.weight")
    assert {m["symmetry"] for m in q["maps"]} == {"heads", "attn", "residual"}  # rescale: in attn's element
    assert plan["rescale"] == "joint"
    assert {m["axis"] for m in q["maps"] if m["symmetry"] == "residual"} == {1}
    assert plan["plan"]["steps"]["transform"] + plan["plan"]["steps"]["copy"] == len(stored)


@pytest.mark.parametrize("symmetries,stream", [("attn,ffn", False), ("recommended", False), ("recommended", True)])
def test_the_plan_is_what_align_runs_and_its_report(llamas, tmp_path, capsys, symmetries, stream):
    flags = ["--symmetries", symmetries] + (["--stream"] if stream else [])
    plan = _printed(capsys, "align", llamas[0], llamas[1], "-o", tmp_path / "x", "--print-plan", *flags)
    out = tmp_path / "out"
    assert run_cli("align", llamas[0], llamas[1], "-o", out, *flags) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert "\n# out\n" in (out / "README.md").read_text()  # titled by the output folder, not its temporary name
    # the report is built from the plan: its decided fields and the plan entry
    for key in ("symmetries", "symmetries_requested", "family", "model_type", "rescale", "layers"):
        assert report[key] == plan[key], key
    assert report["plan"] == plan["plan"]
    assert report["plan"]["mode"] == ("low-memory" if stream else "in-memory")
    assert set(report["per_module"]) == set(plan["instances"])
    if stream:
        assert "residual" not in plan["symmetries"]
    # the steps are what ran: copied tensors are the input's bits, changed tensors are planned transforms
    before, after = folder_tensors(llamas[0]), folder_tensors(out)
    steps = {s["tensor"]: s for s in plan["steps"]}
    assert set(after) == set(steps)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    copied = {k for k, s in steps.items() if s["op"] == "copy"}
    assert changed and not changed & copied
    assert changed <= {k for k, s in steps.items() if s["op"] == "transform"}
    if symmetries == "attn,ffn":
        assert "model.embed_tokens.weight" in copied and "lm_head.weight" in copied


def test_recommended_is_resolved_once_as_the_in_memory_alignment_resolves_it(llamas):
    """The plan's 'recommended' against a base model (no residual group: its output is the stream) is what
    ``align_pair`` resolves by itself."""
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.align_plan import plan_align
    from symmerge.pipeline.options import AlignOptions

    base_a, base_b = (make_model("bert", head=False, dtype=torch.float32, seed=s) for s in (0, 1))
    opts = AlignOptions(symmetries="recommended")
    plan = plan_align(base_a, base_b, opts)
    assert "residual" not in plan.symmetries and plan.symmetries
    assert list(plan.symmetries) == align_pair(base_a, base_b, opts).report["symmetries"]


def test_align_print_plan_refuses_bad_input_in_one_line(llamas, tmp_path, capsys):
    capsys.readouterr()
    rc = run_cli("align", llamas[0], llamas[1], "-o", tmp_path / "o", "--print-plan", "--stream", "--symmetries",
                 "attn,residual")
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("symmerge: error:") and len(err.strip().splitlines()) == 1
    assert "residual symmetry couples every layer" in err
    assert not (tmp_path / "o").exists()


# -- barrier ------------------------------------------------------------------------------------------------------

@pytest.fixture
def vits(tmp_path):
    return [str(vit_folder(tmp_path / f"vit{s}", s)) for s in range(3)]


def test_barrier_print_plan_and_the_study_built_from_it(vits, tmp_path, capsys, monkeypatch):
    data = npz_file(tmp_path / "d.npz")
    argv = ["barrier", vits[0], vits[1], "--data", data, "--align", "recommended", "--align", "attn,ffn",
            "--points", "3"]
    with monkeypatch.context() as m:
        forbid_weights(m)
        plan = _printed(capsys, *argv, "-o", tmp_path / "p", "--print-plan")
    assert not (tmp_path / "p").exists()
    assert plan["alphas"] == [0.0, 0.5, 1.0] and plan["plan"]["frame"] == "pair"
    arms = {a["name"]: a for a in plan["plan"]["arms"]}
    assert list(arms) == ["none", "heads,attn,ffn,rescale,residual", "attn,ffn"]
    assert arms["heads,attn,ffn,rescale,residual"]["requested"] == "recommended"
    assert arms["attn,ffn"]["alignment"]["steps"]  # each arm's alignment steps, printed
    assert run_cli(*argv, "-o", tmp_path / "b") == 0
    result = json.loads((tmp_path / "b" / "barrier.json").read_text())
    assert list(result["curves"]) == plan["plan"]["curves"]
    assert result["plan"]["arms"][2]["alignment"]["steps"] == arms["attn,ffn"]["alignment"]["plan"]["steps"]
    assert result["alphas"] == plan["alphas"] and result["model_a"] == vits[0]
    assert result["convention"] == plan["plan"]["interpolation"]


def test_barrier_of_three_models_plans_a_joint_frame(vits, tmp_path, capsys):
    plan = _printed(capsys, "barrier", *vits, "--data", npz_file(tmp_path / "d.npz"), "--align", "attn",
                    "-o", tmp_path / "p", "--print-plan")
    assert plan["models"] == vits and plan["plan"]["frame"] == "joint"
    assert plan["plan"]["joint"]["rounds"] == 10 and plan["plan"]["curves"] == ["none", "attn"]


def test_barrier_print_plan_refuses_repair_without_data(vits, tmp_path, capsys):
    capsys.readouterr()
    rc = run_cli("barrier", vits[0], vits[1], "--data", npz_file(tmp_path / "d.npz"), "--repair", "-o",
                 tmp_path / "p", "--print-plan")
    err = capsys.readouterr().err
    assert rc == 2 and "needs unlabeled data" in err and len(err.strip().splitlines()) == 1


# -- run ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def family(tmp_path_factory):
    import mergekit_oracle as mo

    base, fts = mo.family(tmp_path_factory.mktemp("run-plans"), "llama", "float32", n=2, layers=2)
    return [str(base)] + [str(f) for f in fts]


def _config(tmp_path, text, name="c.yml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_run_print_plan_prints_every_document_and_the_report_has_its_plan(family, tmp_path, capsys, monkeypatch):
    base, a, b = family
    cfg = _config(tmp_path, f"""
        name: first
        merge_method: ties
        base_model: {base}
        models:
          - model: {a}
            parameters: {{weight: 1.0, density: 0.5}}
          - model: {b}
            parameters: {{weight: 0.5, density: 0.7}}
        ---
        name: second
        merge_method: slerp
        base_model: {base}
        models:
          - model: first
          - model: {base}
        parameters:
          t: [0.0, 1.0]
        """)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        forbid_weights(m)
        printed = _printed(capsys, "run", cfg, out, "--print-plan")
    assert not out.exists()
    docs = printed["documents"]
    assert [d["name"] for d in docs] == ["first", "second"]
    assert docs[0]["output"] == "<intermediate first>" and docs[1]["output"] == str(out)
    first = docs[0]
    stored = set(load_file(str(next(iter(__import__("pathlib").Path(a).glob("*.safetensors"))))))
    assert {s["tensor"] for s in first["steps"]} == stored
    step = next(s for s in first["steps"] if s["tensor"] == "model.layers.0.mlp.up_proj.weight")
    assert step["op"] == "merge" and step["params"]["density"] == [0.5, 0.7] and step["weights"] == [1.0, 0.5]
    ts = [s["params"]["t"] for s in docs[1]["steps"] if s["tensor"].startswith("model.layers.")]
    assert min(ts) == 0.0 and max(ts) == 1.0  # the gradient, evaluated per tensor
    assert run_cli("run", cfg, out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert "\n# out\n" in (out / "README.md").read_text() and (out / "mergekit_config.yml").is_file()
    assert report["plan"] == docs[1]["plan"] and report["method"] == "slerp"
    assert report["plan"]["steps"] == {"merge": sum(s["op"] == "merge" for s in docs[1]["steps"]),
                                       "copy": sum(s["op"] == "copy" for s in docs[1]["steps"])}


def test_run_print_plan_of_an_aligned_config_and_of_a_command_config(family, tmp_path, capsys):
    base, a, b = family
    cfg = _config(tmp_path, f"""
        merge_method: linear
        models:
          - model: {a}
            parameters: {{weight: 0.5}}
          - model: {b}
            parameters: {{weight: 0.5}}
        align: attn,ffn
        """)
    printed = _printed(capsys, "run", cfg, tmp_path / "o", "--print-plan")
    (doc,) = printed["documents"]
    assert doc["alignment"]["symmetries"] == ["attn", "ffn"] and doc["alignment"]["frame"] == "star"
    assert doc["alignment"]["anchor_rule"] == "second of two"
    assert doc["plan"]["frame"] == "star" and doc["plan"]["match"] == "weights"
    assert run_cli("run", cfg, tmp_path / "o") == 0
    report = json.loads((tmp_path / "o" / "symmerge_report.json").read_text())
    assert report["plan"] == doc["plan"] and report["alignment"]["symmetries"] == ["attn", "ffn"]
    cfg = _config(tmp_path, f"""
        command: align
        models: [{a}, {b}]
        symmetries: attn
        output: {tmp_path / 'aligned'}
        """, "align.yml")
    plan = _printed(capsys, "run", cfg, "--print-plan")
    assert plan["symmetries"] == ["attn"] and plan["plan"]["operation"] == "align" and plan["steps"]
    assert not (tmp_path / "aligned").exists()


# -- one report builder -------------------------------------------------------------------------------------------

def test_the_report_builder_keeps_the_plans_decisions():
    from symmerge.pipeline.report import build_report

    class Plan:
        def fields(self):
            return {"symmetries": ["attn"], "model": "a"}

        def describe(self):
            return {"operation": "x"}

    report = build_report(Plan(), {"symmetries": ["ffn"], "distance_after": 1.0})
    assert report == {"symmetries": ["attn"], "model": "a", "distance_after": 1.0, "plan": {"operation": "x"}}


# -- one model card -----------------------------------------------------------------------------------------------

def test_moe_and_extract_lora_cards_come_from_the_one_writer(tmp_path):
    """``moe`` and ``extract-lora`` get their card (README.md) from :func:`symmerge.io.card.write_card`, from
    the report they write; ``--no-write-model-card`` leaves it out."""
    import yaml

    import mergekit_oracle as mk
    from test_extract_lora import make_base, make_finetune
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(mk._config("mistral", 2), dtype=torch.float32).save_pretrained(str(base))
    mk.save_tokenizer(base)
    cfg = tmp_path / "moe.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(base), "gate_mode": "random",
                                   "experts": [{"source_model": str(base)}, {"source_model": str(base)}]}))
    assert run_cli("moe", cfg, tmp_path / "moe", "--progress", "none") == 0
    card = (tmp_path / "moe" / "README.md").read_text()
    report = json.loads((tmp_path / "moe" / "symmerge_report.json").read_text())
    assert card.startswith("---\nlibrary_name: transformers") and report["architecture"] in card
    assert "\n# moe\n" in card
    assert "| experts | 2 |" in card and "| gate mode | random |" in card
    assert run_cli("moe", cfg, tmp_path / "moe2", "--progress", "none", "--no-write-model-card") == 0
    assert not (tmp_path / "moe2" / "README.md").exists()
    assert (tmp_path / "moe2" / "symmerge_report.json").is_file()

    lb = make_base(tmp_path / "lbase")
    ft = make_finetune(lb, tmp_path / "ft", ranks=[2])
    assert run_cli("extract-lora", ft, lb, "-o", tmp_path / "ad", "--max-rank", "2", "--progress", "none") == 0
    card = (tmp_path / "ad" / "README.md").read_text()
    report = json.loads((tmp_path / "ad" / "symmerge_report.json").read_text())
    assert card.startswith("---\nlibrary_name: peft") and f"rank {report['r']}" in card
    assert f"{len(report['modules'])} modules" in card


# -- the plan against the alignment it describes, family by family -----------------------------------------------

def _every_family():
    from factories import FAMILIES

    return FAMILIES


@pytest.mark.parametrize("family", _every_family())
@pytest.mark.parametrize("head", [True, False], ids=["task", "base"])
def test_the_plan_from_the_headers_is_the_alignment_that_runs(tmp_path, family, head):
    """For every family, a task model and a base model: the plan made from the saved folders' headers names the
    symmetries, the group instances and the residual stream's group that the in-memory alignment then solves; a
    tensor it copies comes out bit for bit, and every tensor the alignment changes is one it transforms."""
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.align_plan import plan_align
    from symmerge.pipeline.options import AlignOptions

    dtype = torch.float32
    folders = []
    for seed in (0, 1):
        m = make_model(family, head=head, dtype=dtype, seed=seed)
        m.save_pretrained(str(tmp_path / f"m{seed}"))
        folders.append(tmp_path / f"m{seed}")
    plan = plan_align(folders[0], folders[1], AlignOptions(symmetries="recommended", verify=False))
    result = align_pair(folders[0], folders[1], plan.options)
    report = result.report
    assert list(plan.symmetries) == report["symmetries"]
    assert set(plan.instances) == set(report["per_module"])
    assert plan.residual_variant == report.get("residual_variant")
    before = make_model(family, head=head, dtype=dtype, seed=0).state_dict()
    after = result.model.state_dict()
    steps = {s.tensor: s for s in plan.steps}
    assert set(steps) <= set(after)
    for key, step in steps.items():
        if step.op == "copy":
            assert torch.equal(after[key], before[key]), key
    changed = {k for k in steps if not torch.equal(after[k], before[k])}
    assert changed <= {k for k, s in steps.items() if s.op == "transform"}


@pytest.mark.parametrize("untie", [False, True])
def test_the_plan_of_a_tied_head_with_and_without_untie(tmp_path, untie):
    """A tied LM head: the final norm cannot fold into it (a signed permutation of the stream), unless ``--untie``
    gives the head a tensor of its own (then the full group): the plan says which, as the alignment finds it."""
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.align_plan import plan_align
    from symmerge.pipeline.options import AlignOptions

    for seed in (0, 1):
        make_model("llama", head=True, dtype=torch.float32, seed=seed, tied=True).save_pretrained(str(tmp_path / f"{seed}"))
    opts = AlignOptions(symmetries="recommended", untie=untie, verify=False)
    plan = plan_align(tmp_path / "0", tmp_path / "1", opts)
    report = align_pair(tmp_path / "0", tmp_path / "1", plan.options).report
    assert plan.residual_variant == report["residual_variant"] == ("orthogonal" if untie else "signed_permutation")
    assert set(plan.instances) == set(report["per_module"])
    assert ("lm_head.weight" in {s.tensor for s in plan.steps}) == untie  # untied: a tensor of its own


@pytest.mark.parametrize("family", ["bert", "gpt2", "qwen3", "mixtral", "t5", "deberta-v2"])
def test_the_streamed_plan_is_the_streamed_alignment(tmp_path, family):
    """Streamed (``align --stream``): the plan binds the per-layer groups from the headers (fused experts under
    their in-memory names, a stack-tied group left out by 'recommended'); the streamed alignment solves exactly
    its instances, copies its copied tensors bit for bit and changes only tensors it transforms."""
    from symmerge.pipeline.align_plan import plan_align
    from symmerge.pipeline.options import AlignOptions
    from symmerge.pipeline.to_folder import align_to_folder

    for seed in (0, 1):
        make_model(family, head=True, dtype=torch.float32, seed=seed).save_pretrained(str(tmp_path / f"{seed}"))
    opts = AlignOptions(symmetries="recommended")
    plan = plan_align(tmp_path / "0", tmp_path / "1", opts, stream=True)
    report = align_to_folder(tmp_path / "0", tmp_path / "1", tmp_path / "out", opts, stream=True, progress=False)
    assert set(plan.instances) == set(report["per_module"]) and plan.instances
    assert report["plan"] == plan.describe() and report["symmetries"] == list(plan.symmetries)
    before, after = folder_tensors(tmp_path / "0"), folder_tensors(tmp_path / "out")
    assert set(before) == set(after)
    from symmerge.io.checkpoint import LazyCheckpoint

    ckpt = LazyCheckpoint(tmp_path / "0", fused=True)

    def unchanged(key):  # a fused tensor (a mixture's experts) is stored as several
        stored = ckpt.to_disk(key, torch.zeros(ckpt.shape[key], dtype=ckpt.dtype[key]))
        return all(torch.equal(before[name], after[name]) for name, _ in stored)

    steps = {s.tensor: s for s in plan.steps}
    changed = {k for k in steps if not unchanged(k)}
    assert changed and not changed & {k for k, s in steps.items() if s.op == "copy"}
    assert changed <= {k for k, s in steps.items() if s.op == "transform"}


def test_a_config_whose_model_type_contradicts_its_class_is_planned_as_the_class(llamas, tmp_path, capsys):
    """config.json says ``model_type: t5`` beside a Llama's ``architectures`` and tensors (the fuzz of issue 40 found
    it): transformers builds a LlamaConfig, so the plan binds the Llama family, as the loaded model is bound — the
    plan printed, and the alignment refused in one line (its model type is not the anchor's), never a traceback."""
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(llamas[0], odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "t5"}))
    plan = _printed(capsys, "align", odd, llamas[1], "-o", tmp_path / "p", "--print-plan")
    assert plan["family"] == _printed(capsys, "align", llamas[0], llamas[1], "-o", tmp_path / "q",
                                      "--print-plan")["family"]
    assert run_cli("align", odd, llamas[1], "-o", tmp_path / "out", "--progress", "none") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("symmerge: error:") and "Traceback" not in err[0], err
    assert not (tmp_path / "out").exists()
