"""The written reports keep their documented contracts: every field README.md and docs/ name for a command's
``symmerge_report.json`` (or ``barrier.json``) is in the report that command writes, on tiny real models, in each
mode the docs name (align in memory and ``--stream``; merge in memory and streamed; a mergekit config run by
``run``, plain and aligned; barrier of two and of three models; moe; extract-lora); every report is strict JSON
(no NaN / Infinity) and holds what reproduces it: the symmerge version and the command line as given."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import npz_file, run_cli, vit_folder

ROOT = Path(__file__).resolve().parents[2]


def documented(*docs: str) -> str:
    return "".join((ROOT / d).read_text(encoding="utf-8") for d in docs)


def strict_json(path: Path):
    def refuse(constant):
        raise ValueError(f"{path.name} holds {constant}, which strict JSON readers refuse")

    return json.loads(path.read_text(), parse_constant=refuse)


PROVENANCE = ("symmerge_version", "command_line")

ALIGN = ("family", "model_type", "symmetries", "rescale", "layers", "model", "anchor", "symmetries_requested",
         "distance_before", "distance_after", "per_module", "per_layer", "verify", "seconds", "match_seconds",
         "match", "streamed", "mode", "side_files", "tokenizer", "plan")
ALIGN_RESIDUAL = ("residual_variant", "residual_group", "sweeps", "solver", "residual_sweeps_sq_distance",
                  "norms_folded", "distance_before_unfolded", "verify_max_abs_diff", "verify_max_rel_diff",
                  "verify_tolerance")
ALIGN_STREAM = ("device", "shards", "bytes_written", "largest_layer_bytes", "timings")
MERGE = ("method", "params", "weights", "models", "base", "model_type", "device", "alignment", "head", "statistics",
         "distances_between_inputs", "distance_result_to_inputs", "timings", "side_files", "mode", "plan",
         "result_warnings", "tokenizer")
BARRIER = ("alphas", "curves", "endpoints", "distances", "model_a", "model_b", "data", "examples", "seconds",
           "tokenizer")
BARRIER_N = ("models", "alphas", "endpoints", "endpoints_mean", "ensemble", "variants")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every command's output folder, made once on tiny models."""
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("reports")
    vits = [str(vit_folder(root / f"vit{s}", s)) for s in (0, 1, 2)]
    data = npz_file(root / "d.npz", n=12)
    llamas = []
    for s in (0, 1, 2):
        torch.manual_seed(s)
        AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)).save_pretrained(root / f"ll{s}")
        llamas.append(str(root / f"ll{s}"))
    (root / "mk.yml").write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {llamas[0]}\n"
                                 f"    parameters: {{weight: 0.5}}\n  - model: {llamas[1]}\n    parameters: {{weight: 0.5}}\n")
    (root / "moe.yml").write_text(f"base_model: {llamas[0]}\ngate_mode: random\ndtype: float32\nexperts:\n"
                                  f"  - source_model: {llamas[1]}\n  - source_model: {llamas[2]}\n")
    quiet = ("--progress", "none")
    commands = {
        "align": ("align", *vits[:2], "-o", root / "align", *quiet),
        "align_stream": ("align", *vits[:2], "--stream", "-o", root / "align_stream", *quiet),
        "merge_memory": ("merge", *vits[:2], "--method", "average", "--eval-data", data, "-o", root / "merge_memory",
                         *quiet),
        "merge_stream": ("merge", *vits[:2], "--method", "average", "--align", "none", "--mode", "stream",
                         "-o", root / "merge_stream", *quiet),
        "merge_joint": ("merge", *vits, "--method", "average", "-o", root / "merge_joint", *quiet),
        "run": ("run", root / "mk.yml", root / "run", *quiet),
        "run_aligned": ("run", root / "mk.yml", root / "run_aligned", "--align", "recommended", *quiet),
        "barrier": ("barrier", *vits[:2], "--data", data, "--points", "3", "-o", root / "barrier", *quiet),
        "barrier_n": ("barrier", *vits, "--data", data, "--points", "3", "-o", root / "barrier_n", *quiet),
        "moe": ("moe", root / "moe.yml", root / "moe", *quiet),
        "extract_lora": ("extract-lora", llamas[1], llamas[0], "-o", root / "lora", "--rank", "4"),
    }
    made = {}
    for name, argv in commands.items():
        assert run_cli(*argv) == 0, name
        out = Path(argv[argv.index("-o") + 1]) if "-o" in argv else Path(argv[2])
        made[name] = (out, [str(a) for a in argv])
    return made


def report_of(outputs, name):
    out, argv = outputs[name]
    path = out / ("barrier.json" if name.startswith("barrier") else "symmerge_report.json")
    return strict_json(path), argv


CASES = {
    "align": (ALIGN + ALIGN_RESIDUAL, ("README.md",)),
    "align_stream": (ALIGN + ALIGN_STREAM, ("README.md",)),
    "merge_memory": (MERGE + ("evaluation",), ("docs/merge.md",)),
    "merge_stream": (MERGE + ("stream",), ("docs/merge.md",)),
    "merge_joint": (MERGE, ("docs/merge.md",)),
    "run": (MERGE + ("config",), ("docs/merge.md", "docs/configs.md")),
    "run_aligned": (MERGE + ("config",), ("docs/merge.md", "docs/configs.md")),
    "barrier": (BARRIER, ("docs/merge.md",)),
    "barrier_n": (BARRIER_N, ("docs/merge.md",)),
    "moe": ((), ()),
    "extract_lora": (("modules", "relative_error"), ()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_documented_field_is_written(outputs, name):
    fields, docs = CASES[name]
    text = documented(*docs) if docs else ""
    undocumented = [f for f in fields if f"`{f}`" not in text and f'"{f}"' not in text] if docs else []
    assert not undocumented, f"the test's list names fields the docs do not: {undocumented}"
    report, _ = report_of(outputs, name)
    missing = [f for f in fields if f not in report]
    assert not missing, f"{name}: documented report fields missing from the written report: {missing}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_report_says_what_made_it(outputs, name):
    """The version and the command line as given (the inputs as the user wrote them, not temporary folders)."""
    from symmerge import __version__

    report, argv = report_of(outputs, name)
    assert report.get("symmerge_version") == __version__, name
    assert report.get("command_line") == ["symmerge", *argv], name
    text = documented("docs/merge.md")
    assert all(f"`{f}`" in text for f in PROVENANCE)
    card = outputs[name][0] / "README.md"
    if card.exists():  # the model card names the command too
        import shlex

        assert f"## Command\n\n```\n{shlex.join(['symmerge', *argv])}\n```" in card.read_text(), name


def test_reports_are_written_as_strict_json(tmp_path):
    """A figure that is not finite (a diverged loss, 0/0) is written as null, never as NaN / Infinity."""
    from symmerge.io.model import write_json

    path = tmp_path / "symmerge_report.json"
    write_json(path, {"loss": math.inf, "nested": [{"x": math.nan}, -math.inf], "ok": 1.5})
    written = strict_json(path)
    assert {k: written[k] for k in ("loss", "nested", "ok")} == {"loss": None, "nested": [{"x": None}, None], "ok": 1.5}


def test_the_merge_report_keeps_its_documented_timings_in_every_mode(outputs):
    for name in ("merge_memory", "merge_stream", "run", "run_aligned"):
        timings = report_of(outputs, name)[0]["timings"]
        assert set(timings) >= {"load", "align", "statistics", "merge", "evaluate", "total"}, name
        assert all(isinstance(v, float) and v >= 0 for v in timings.values()), name
        assert not re.search(r"symmerge-tmp|intermediates", json.dumps(report_of(outputs, name)[0]["models"]))


def _lora_helpers():
    import importlib.util

    pytest.importorskip("peft")
    spec = importlib.util.spec_from_file_location("lora_helpers", ROOT / "tests" / "io" / "test_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("command", ["merge", "merge --align", "run", "run --align"])
def test_a_base_adapter_input_is_named_as_written_in_the_report_and_the_card(tmp_path, command):
    """``BASE+ADAPTER`` is merged into a temporary folder the user never named (gone when the command ends): the
    report and the model card name the input as the user wrote it, as the printed lines do."""
    helpers = _lora_helpers()
    base, other = helpers.make_base(tmp_path / "base"), helpers.make_base(tmp_path / "other", seed=1)
    adapter = helpers.make_adapter(base, tmp_path / "adapter", target_modules=["q_proj", "v_proj"])
    spec = f"{base}+{adapter}"
    out = tmp_path / "out"
    align = ["--align", "recommended"] if command.endswith("--align") else ["--align", "none"]
    if command.startswith("merge"):
        argv = ["merge", spec, other, "--method", "average", *align, "-o", out]
    else:
        config = tmp_path / "mk.yml"
        config.write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {spec}\n"
                          f"    parameters: {{weight: 0.5}}\n  - model: {other}\n    parameters: {{weight: 0.5}}\n")
        argv = ["run", config, out, *(align if command.endswith("--align") else [])]
    assert run_cli(*argv, "--progress", "none") == 0
    report = strict_json(out / "symmerge_report.json")
    assert report["models"][0] == spec
    for models in (report["alignment"].get("models") or []):
        assert models["model"] in (spec, str(other))
    for text in ((out / "symmerge_report.json").read_text(), (out / "README.md").read_text()):
        assert "symmerge-lora-" not in text and spec in text


def test_no_verify_writes_the_three_verification_fields_as_null(tmp_path):
    """README: `verify_max_abs_diff`, `verify_max_rel_diff`, `verify_tolerance` are `null` with --no-verify."""
    vits = [vit_folder(tmp_path / f"vit{s}", s) for s in (0, 1)]
    assert run_cli("align", *vits, "--no-verify", "-o", tmp_path / "out", "--progress", "none") == 0
    report = strict_json(tmp_path / "out" / "symmerge_report.json")
    assert {k: report.get(k, "absent") for k in ("verify_max_abs_diff", "verify_max_rel_diff", "verify_tolerance")} \
        == dict.fromkeys(("verify_max_abs_diff", "verify_max_rel_diff", "verify_tolerance"))


def _rows(doc: str) -> dict[str, str]:
    """A report table's rows: each field named first in a row (`| `field`, ... | meaning |`) -> the row."""
    rows = {}
    for line in documented(doc).splitlines():
        m = re.match(r"\| `([a-z_]+)`", line)
        if m:
            rows.setdefault(m.group(1), line)
    return rows


def test_a_field_written_as_null_is_not_documented_as_absent(outputs):
    rows = _rows("docs/merge.md")
    for name in ("merge_memory", "merge_stream", "merge_joint"):
        report = report_of(outputs, name)[0]
        wrong = [f for f, v in report.items() if v is None and f in rows and "absent otherwise" in rows[f]]
        assert not wrong, f"{name}: written as null but documented as absent: {wrong}"


def test_a_streamed_aligned_merge_reports_each_model_as_the_in_memory_merge_does(tmp_path):
    """docs/merge.md: per aligned model `distance_before`/`distance_after` over the body (the anchor carries the
    model's own head), `match` and the `distances` tables; the streamed merge compared the anchor's own head too,
    and wrote neither `match` nor `distances`."""
    vits = [vit_folder(tmp_path / f"vit{s}", s) for s in (0, 1)]
    rows = {}
    for mode in ("memory", "stream"):
        assert run_cli("merge", *vits, "--method", "average", "--align", "attn,ffn,rescale", "--mode", mode,
                       "-o", tmp_path / mode, "--progress", "none") == 0
        rows[mode] = strict_json(tmp_path / mode / "symmerge_report.json")["alignment"]["models"][0]
    memory, stream = rows["memory"], rows["stream"]
    assert set(memory) - {"residual_group", "sweeps", "solver"} <= set(stream), set(memory) - set(stream)
    for key in ("distance_before", "distance_after"):
        assert stream[key] == pytest.approx(memory[key], rel=1e-6), key
    for side in ("before", "after"):
        assert stream["distances"][side]["whole"] == pytest.approx(memory["distances"][side]["whole"], rel=1e-6)
        assert stream["distances"][side]["per_layer"] == pytest.approx(memory["distances"][side]["per_layer"], rel=1e-6)
    assert stream["match"] == memory["match"] == "weights"
