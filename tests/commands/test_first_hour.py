"""A user's first hour: defaults that merge well, progress that shows in a log, checkpoint names in every
message, only model files in the output, tied weights however they are stored, the right data in the
right place."""

from __future__ import annotations

import io
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from factories import make_model
from conftest import vit_folder
from symmerge import progress
from symmerge.cli import build_parser, main
from symmerge.errors import SymmergeError
from symmerge.families import SYMMETRIES
from symmerge.io.checkpoint import LazyCheckpoint
from symmerge.io.model import load_model
from symmerge.pipeline.align import align, align_pair
from symmerge.pipeline.options import RECOMMENDED as ALL_RECOMMENDED, AlignOptions

RECOMMENDED = tuple(s for s in ALL_RECOMMENDED if s != "experts")  # what a dense model resolves it to

pytestmark = pytest.mark.usefixtures("single_thread")

PROGRESS_LINE = re.compile(r"^\[\d+\.\d s\] ")


def npz(path, n=20, shape=(1, 8, 8), labels=3):
    rng = np.random.default_rng(0)
    np.savez(path, pixel_values=rng.standard_normal((n, *shape)).astype(np.float32), labels=rng.integers(0, labels, n))
    return path


@pytest.fixture
def vits(tmp_path):
    return [vit_folder(tmp_path / f"vit{s}", s) for s in (0, 1)]


def run(capsys, *argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def progress_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if PROGRESS_LINE.match(line)]


# ------------------------------------------------------------------ 1. defaults that merge well


@pytest.mark.parametrize("family, head, expected", [
    ("vit", True, RECOMMENDED),
    ("vit", False, tuple(s for s in RECOMMENDED if s != "residual")),  # a base model's output is the stream
    ("bert", True, RECOMMENDED),  # post-LN: the stream's permutation group
    ("bert", False, tuple(s for s in RECOMMENDED if s != "residual")),
    ("llama", True, RECOMMENDED),
    ("mixtral", True, ALL_RECOMMENDED),  # a mixture of experts: experts too
])
def test_recommended_resolves_to_the_groups_the_model_has(family, head, expected):
    model = make_model(family, head=head)
    opts = AlignOptions(symmetries="recommended")
    assert opts.recommended and opts.requested == "recommended"
    resolved = opts.for_model(model)
    assert resolved.symmetries == expected and not resolved.recommended
    _, report = align(model, make_model(family, head=head, seed=1), symmetries="recommended", verify=False)
    assert tuple(report["symmetries"]) == expected and report["symmetries_requested"] == "recommended"


def test_a_named_group_the_model_lacks_stays_an_error():
    base = make_model("vit")
    with pytest.raises(SymmergeError, match="residual"):
        align(base, make_model("vit", seed=1), symmetries="attn,residual")
    with pytest.raises(SymmergeError, match="stands alone"):
        AlignOptions(symmetries="recommended,attn")


def test_merge_aligns_by_default_with_the_recommended_set(vits, tmp_path, capsys):
    out = tmp_path / "merged"
    rc, stdout, _ = run(capsys, "merge", *vits, "--method", "average", "-o", out)
    assert rc == 0
    alignment = json.loads((out / "symmerge_report.json").read_text())["alignment"]
    assert alignment["requested"] == "recommended" and tuple(alignment["symmetries"]) == RECOMMENDED
    assert "alignment: heads,attn,ffn,rescale,residual = recommended" in stdout
    none = tmp_path / "plain"
    assert run(capsys, "merge", *vits, "--method", "average", "--align", "none", "-o", none)[0] == 0
    assert json.loads((none / "symmerge_report.json").read_text())["alignment"]["symmetries"] == []
    a, b = load_model(out).state_dict(), load_model(none).state_dict()
    assert any(not torch.allclose(a[k], b[k]) for k in a)  # the default did align


def test_recommended_leaves_residual_out_when_the_heads_differ(tmp_path, capsys):
    a, b = vit_folder(tmp_path / "a", 0), vit_folder(tmp_path / "b", 1, num_labels=5)
    out = tmp_path / "merged"
    rc, _, err = run(capsys, "merge", a, b, "--method", "average", "-o", out)
    assert rc == 0
    alignment = json.loads((out / "symmerge_report.json").read_text())["alignment"]
    assert "residual" not in alignment["symmetries"] and "heads" in alignment["symmetries"]
    assert "residual left out" in alignment["note"] and "residual left out" in err
    out2 = tmp_path / "explicit"
    rc, _, err = run(capsys, "merge", a, b, "--method", "average", "--align", "attn,residual", "-o", out2)
    assert rc == 2 and "residual" in err and not out2.exists()


def test_barrier_aligns_by_default_with_the_recommended_set(vits, tmp_path, capsys):
    out = tmp_path / "study"
    rc, stdout, _ = run(capsys, "barrier", *vits, "--data", npz(tmp_path / "d.npz"), "--points", "3", "-o", out)
    assert rc == 0
    curves = json.loads((out / "barrier.json").read_text())["curves"]
    assert set(curves) == {"none", ",".join(RECOMMENDED)}
    assert re.search(r"\(alignment \d+\.\d\d s, total \d+\.\d\d s\)", stdout)


@pytest.mark.parametrize("command", ["align", "merge", "barrier"])
def test_every_symmetry_and_rescale_none_in_every_command(command, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in SYMMETRIES + ("recommended", "none"):
        assert name in text, (command, name)
    assert "Default:" in text
    args = {"align": ["m", "a", "-o", "o"], "merge": ["m", "a", "--method", "average", "-o", "o"],
            "barrier": ["m", "a", "--data", "d.npz", "-o", "o"]}[command]
    assert parser.parse_args([command, *args, "--rescale", "none"]).rescale == "none"
    assert parser.parse_args([command, *args, "--progress", "lines"]).progress == "lines"


# ------------------------------------------------------------------ 2. progress that shows in a log


def test_lines_mode_one_line_per_stage_with_counts_and_seconds():
    stream = io.StringIO()
    progress.configure("lines", stream=stream)
    try:
        for _ in progress.bar(range(5), desc="fisher statistics", unit="examples"):
            pass
        with progress.stage("wrote out"):
            pass
        quiet = progress.bar(range(3), desc="silent", enabled=False)
        list(quiet)
    finally:
        progress.configure("auto")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"\[\d+\.\d s\] fisher statistics: 5/5 examples \(\d+\.\d s\)", lines[0])
    assert re.fullmatch(r"\[\d+\.\d s\] wrote out \(\d+\.\d s\)", lines[1])


def test_lines_mode_heartbeat_for_a_long_stage():
    stream = io.StringIO()
    progress.configure("lines", stream=stream, heartbeat=0.0)
    try:
        b = progress.bar(total=3, desc="aligning layers", unit="layers")
        b.update(1)
        b.update(2)  # the last update: no interim line, the closing one says it
        b.close()
    finally:
        progress.configure("auto")
    first, last = stream.getvalue().splitlines()
    assert "aligning layers: 1/3 layers" in first and "so far" in first
    assert "aligning layers: 3/3 layers" in last and "so far" not in last


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_auto_is_bars_on_a_terminal_and_lines_otherwise():
    try:
        progress.configure("auto", stream=_Terminal())
        assert progress.mode() == "bar"
        progress.configure("auto", stream=io.StringIO())
        assert progress.mode() == "lines"
        progress.configure("none", stream=io.StringIO())
        assert progress.mode() == "none"
        with pytest.raises(SymmergeError, match="progress mode"):
            progress.configure("loud")
    finally:
        progress.configure("auto")


def test_merge_progress_lines_in_a_log(vits, tmp_path, capsys):
    data = npz(tmp_path / "d.npz")
    out = tmp_path / "merged"
    rc, stdout, err = run(capsys, "merge", *vits, "--method", "fisher", "--data", data, "--eval-data", data,
                          "--progress", "lines", "-o", out)
    assert rc == 0
    lines = progress_lines(err)
    assert any(re.search(r"aligned .*vit0 to the anchor \(\d+\.\d s\)$", ln) for ln in lines), lines
    assert sum("fisher statistics (empirical): 20/20 examples" in ln for ln in lines) == 2, lines
    assert any("evaluating merged: 1/1 batches" in ln for ln in lines), lines
    assert re.search(r"wrote .*merged \(alignment \d+\.\d\d s, statistics \d+\.\d\d s, evaluation \d+\.\d\d s, "
                     r"total \d+\.\d\d s\)", stdout)
    quiet = tmp_path / "quiet"
    rc, _, err = run(capsys, "merge", *vits, "--method", "average", "--progress", "none", "-o", quiet)
    assert rc == 0 and progress_lines(err) == []


def test_align_final_message_says_what_its_timings_cover(vits, tmp_path, capsys):
    for extra in ([], ["--stream"]):
        out = tmp_path / f"out{len(extra)}"
        rc, stdout, err = run(capsys, "align", *vits, "-o", out, "--progress", "lines", *extra)
        assert rc == 0
        assert re.search(r"wrote .*\(.*alignment.* \d+\.\d\d s, total \d+\.\d\d s\)", stdout), stdout
        assert progress_lines(err), err


# ------------------------------------------------------------------ 3. checkpoint names in messages


def test_specs_shows_on_disk_names_and_explains_its_notation(capsys):
    rc, out, _ = run(capsys, "specs")
    assert rc == 0
    assert "a^" not in out and "s^+1" in out and "s^-1" in out and "[axis N]" in out
    vit = out[out.index("\nvit "):out.index("\ngpt2 ")]
    assert "vit.encoder.layer.{i}.intermediate.dense.weight  [axis 0]" in vit
    assert "mlp.fc1" not in vit and "q_proj" not in vit  # transformers' in-memory names
    heads = vit[vit.index("  heads "):vit.index("  attn.qk ")]
    assert "s^" not in heads  # a permutation has no scale
    assert "s^+1" in vit[vit.index("  attn.qk "):vit.index("  ffn ")]


def test_errors_name_tensors_as_the_checkpoint_does(tmp_path, capsys):
    vit_folder(tmp_path / "a", 0)
    vit_folder(tmp_path / "wide", 1, intermediate_size=32)
    rc, _, err = run(capsys, "align", tmp_path / "wide", tmp_path / "a", "-o", tmp_path / "o1")
    assert rc == 2 and "shapes differ for vit.encoder.layer.0.intermediate.dense." in err, err
    rc, _, err = run(capsys, "align", tmp_path / "wide", tmp_path / "a", "-o", tmp_path / "o2", "--stream")
    assert rc == 2 and "shapes differ for vit.encoder.layer.0.intermediate.dense." in err, err
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "a", bad)
    from safetensors.torch import load_file

    sd = load_file(bad / "model.safetensors")
    sd["vit.encoder.layer.1.output.dense.weight"][0, 0] = float("nan")
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    for extra in ([], ["--stream"]):
        rc, _, err = run(capsys, "align", bad, tmp_path / "a", "-o", tmp_path / f"o3{len(extra)}", *extra)
        assert rc == 2 and "'vit.encoder.layer.1.output.dense.weight' holds NaN" in err, err


# ------------------------------------------------------------------ 4. only model files in the output

SIDE = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
        "preprocessor_config.json": "{}", "chat_template.jinja": "{{ x }}", "README.md": "# card\n"}
JUNK = {"optimizer.pt": "x", "train_report.json": "{}", "symmerge_report.json": "{}",
        "original/consolidated.00.pth": "x", "training_args.bin": "x"}


def with_side_files(folder):
    for name, text in {**SIDE, **JUNK}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def output_names(folder) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


@pytest.mark.parametrize("how", ["align", "align --stream", "merge"])
def test_only_model_files_are_copied_and_the_rest_is_listed(vits, tmp_path, capsys, how):
    with_side_files(vits[0])
    out = tmp_path / "out"
    argv = {"align": ["align", *vits], "align --stream": ["align", *vits, "--stream"],
            "merge": ["merge", *vits, "--method", "average"]}[how]
    rc, stdout, _ = run(capsys, *argv, "-o", out)
    assert rc == 0
    names = output_names(out)
    assert set(SIDE) <= names
    assert not names & {"optimizer.pt", "train_report.json", "original", "training_args.bin"}
    report = json.loads((out / "symmerge_report.json").read_text())
    # the input's model card is replaced by the output's own (symmerge.io.card), in neither list
    assert (out / "README.md").read_text() != SIDE["README.md"] and "symmerge" in (out / "README.md").read_text()
    assert sorted(report["side_files"]["copied"]) == sorted(set(SIDE) - {"README.md"})
    assert sorted(report["side_files"]["left_out"]) == sorted(["optimizer.pt", "train_report.json", "original/",
                                                               "symmerge_report.json", "training_args.bin"])
    if how.startswith("align"):
        assert "left out of the output" in stdout


# ------------------------------------------------------------------ 5. tied weights, however stored


def tied_llama():
    model = make_model("llama", head=True, dtype=torch.float32, tied=True)
    model.config.architectures = [type(model).__name__]
    return model


def store(model, folder, how: str):
    """``model`` written with its tied embeddings stored ``how``."""
    folder.mkdir()
    model.config.save_pretrained(folder)
    sd = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    meta = {"format": "pt"}
    if how == "source":  # what save_pretrained writes
        sd.pop(head)
    elif how == "alias":
        sd[head] = sd.pop(emb)
    elif how == "metadata":  # safetensors.torch.save_model: the alias kept, the source named in the metadata
        sd[head] = sd.pop(emb)
        meta[emb] = head
    save_file(sd, folder / "model.safetensors", metadata=meta)
    return folder


def saved_keys(folder) -> set[str]:
    keys = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    return keys


def save_pretrained_keys(model, tmp_path) -> set[str]:
    ref = tmp_path / "reference"
    model.save_pretrained(ref)
    return saved_keys(ref)


@pytest.mark.parametrize("how", ["source", "alias", "both", "metadata"])
def test_tied_weights_read_the_same_whatever_the_storage(how, tmp_path):
    model = tied_llama()
    ckpt = LazyCheckpoint(store(model, tmp_path / how, how))
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(ckpt.keys()) == set(want)
    got = ckpt.read(ckpt.keys())
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert {ckpt.save_name(k) for k in ckpt.keys()} == save_pretrained_keys(model, tmp_path)


@pytest.mark.parametrize("how", ["alias", "both", "metadata"])
@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_align_tied_checkpoints_writes_what_save_pretrained_writes(how, stream, tmp_path, capsys):
    model, anchor = tied_llama(), make_model("llama", head=True, dtype=torch.float32, tied=True, seed=1)
    anchor.config.architectures = model.config.architectures
    model_dir = store(model, tmp_path / "model", how)
    anchor_dir = tmp_path / "anchor"
    anchor.save_pretrained(anchor_dir)  # stored the usual way: the two used to be "different architectures"
    out = tmp_path / "out"
    rc, _, err = run(capsys, "align", model_dir, anchor_dir, "-o", out, *(["--stream"] if stream else []))
    assert rc == 0, err
    assert saved_keys(out) == save_pretrained_keys(model, tmp_path)
    reloaded = load_model(out)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


def test_an_old_smollm2_style_folder_is_rewritten_the_save_pretrained_way(tmp_path):
    from safetensors.torch import save_model

    from symmerge.demo.assets import rewrite_ties

    model = tied_llama()
    old = tmp_path / "old"
    old.mkdir()
    model.config.save_pretrained(old)
    save_model(model, str(old / "model.safetensors"))  # what the asset conversion used to write
    assert saved_keys(old) != save_pretrained_keys(model, tmp_path)
    assert rewrite_ties(old) is True
    assert saved_keys(old) == save_pretrained_keys(model, tmp_path)
    with safe_open(str(old / "model.safetensors"), "pt") as h:
        assert h.metadata() == {"format": "pt"}
    reloaded = load_model(old)
    for k, v in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v), k
    assert rewrite_ties(old) is False  # already in the usual form


def mergekit_available() -> bool:
    try:
        import mergekit.merge  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not mergekit_available(), reason="mergekit is not installed")
def test_mergekit_reads_an_aligned_tied_llama(tmp_path, capsys):
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    model = tied_llama()
    anchor = make_model("llama", head=True, dtype=torch.float32, tied=True, seed=1)
    anchor.config.architectures = model.config.architectures
    model_dir = store(model, tmp_path / "model", "metadata")
    anchor.save_pretrained(tmp_path / "anchor")
    out = tmp_path / "aligned"
    assert run(capsys, "align", model_dir, tmp_path / "anchor", "-o", out)[0] == 0
    config = {"merge_method": "linear", "dtype": "float32",
              "models": [{"model": str(out), "parameters": {"weight": 0.5}},
                         {"model": str(tmp_path / "anchor"), "parameters": {"weight": 0.5}}]}
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(yaml.safe_dump(config))), str(tmp_path / "mk"),
              options=MergeOptions(copy_tokenizer=False, lazy_unpickle=False))
    merged = load_model(tmp_path / "mk")
    assert merged.lm_head.weight.shape == model.lm_head.weight.shape


# ------------------------------------------------------------------ 6. the right data in the right place


def test_text_data_for_an_image_model_says_so(vits, tmp_path, capsys):
    data = tmp_path / "reviews.jsonl"
    data.write_text(json.dumps({"text": "a fine film", "label": 1}) + "\n")
    out = tmp_path / "study"
    rc, _, err = run(capsys, "barrier", *vits, "--data", data, "-o", out)
    assert rc == 2 and "text data (.jsonl) but the model (vit) takes images" in err, err
    assert "tokenizer" not in err and not out.exists()


@pytest.mark.parametrize("shape, needle", [
    ((8, 8, 1), "which looks like NHWC — transpose with x.transpose(0, 3, 1, 2)"),
    ((8, 8), "with no channel axis — add it with x[:, None]"),
])
def test_image_layout_errors_name_the_nchw_layout(vits, tmp_path, capsys, shape, needle):
    out = tmp_path / "study"
    rc, _, err = run(capsys, "barrier", *vits, "--data", npz(tmp_path / "d.npz", shape=shape), "-o", out)
    assert rc == 2 and "pixel_values must be (N, C, H, W) = (N, 1, 8, 8)" in err and needle in err, err


def test_merge_scores_on_eval_data_and_says_when_it_falls_back(vits, tmp_path, capsys):
    stats, held_out = npz(tmp_path / "train.npz", n=12), npz(tmp_path / "test.npz", n=20)
    out = tmp_path / "merged"
    rc, _, err = run(capsys, "merge", *vits, "--method", "fisher", "--data", stats, "--eval-data", held_out,
                     "-o", out)
    assert rc == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert [r["data"] for r in report["statistics"]["per_model"]] == [str(stats)] * 2
    assert report["evaluation"]["data_role"] == "--eval-data" and "note" not in report["evaluation"]
    assert report["evaluation"]["merged"][0]["data"] == str(held_out) and report["evaluation"]["merged"][0]["n"] == 20
    assert "warning" not in err
    out2 = tmp_path / "fallback"
    rc, _, err = run(capsys, "merge", *vits, "--method", "fisher", "--data", stats, "-o", out2)
    assert rc == 0
    evaluation = json.loads((out2 / "symmerge_report.json").read_text())["evaluation"]
    assert evaluation["data_role"] == "--data" and "statistics data" in evaluation["note"]
    assert "warning: no --eval-data given: the evaluation used the statistics data" in err


# ------------------------------------------------------------------ docs: every report field


def _documented() -> str:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return (root / "docs" / "merge.md").read_text() + (root / "README.md").read_text()


def test_every_report_field_is_documented(vits, tmp_path, capsys):
    docs = _documented()
    aligned, merged = tmp_path / "aligned", tmp_path / "merged"
    assert run(capsys, "align", *vits, "--symmetries", "recommended", "-o", aligned)[0] == 0
    assert run(capsys, "merge", *vits, "--method", "average", "--eval-data", npz(tmp_path / "d.npz"),
               "-o", merged)[0] == 0
    align_report = json.loads((aligned / "symmerge_report.json").read_text())
    merge_report = json.loads((merged / "symmerge_report.json").read_text())
    fields = set(align_report) | set(merge_report) | set(merge_report["alignment"]) | set(merge_report["head"]) \
        | set(merge_report["evaluation"]) | set(merge_report["alignment"]["models"][0])
    missing = sorted(f for f in fields if f"`{f}`" not in docs)
    assert not missing, f"report fields not documented in docs/merge.md or README.md: {missing}"


def test_align_pair_accepts_recommended_options_objects():
    model, anchor = make_model("gpt2", head=True), make_model("gpt2", head=True, seed=1)
    result = align_pair(model, anchor, AlignOptions(symmetries="recommended", verify=False))
    assert tuple(result.report["symmetries"]) == RECOMMENDED


def test_streamed_recommended_keeps_the_groups_that_stream(vits, tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, _ = run(capsys, "align", *vits, "--symmetries", "recommended", "--stream", "-o", out)
    assert rc == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["symmetries"] == ["heads", "attn", "ffn", "rescale"]  # residual couples every layer
    assert report["symmetries_requested"] == "recommended" and "(= recommended)" in stdout
    rc, _, err = run(capsys, "align", *vits, "--symmetries", "attn,residual", "--stream", "-o", tmp_path / "o2")
    assert rc == 2 and "cannot be streamed" in err


def test_merge_models_api_aligns_by_default():
    from symmerge.merge.fuse import merge_models

    a, b = make_model("vit", head=True), make_model("vit", head=True, seed=1)
    _, report = merge_models([a, b], "average", progress=False)
    assert report["alignment"]["requested"] == "recommended"
    assert tuple(report["alignment"]["symmetries"]) == RECOMMENDED
    _, plain = merge_models([a, b], "average", align="none", progress=False)
    assert plain["alignment"]["symmetries"] == [] and plain["alignment"]["requested"] == "none"


def test_solver_progress_in_lines_mode_prints_at_most_one_line_per_interval(monkeypatch):
    """A coordinate descent of hundreds of sweeps must not print hundreds of lines: the first call
    prints, then at most one line per LINE_EVERY seconds, counting the calls it stands for."""
    import io

    from symmerge import progress

    clock = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    out = io.StringIO()
    progress.configure("lines", stream=out)
    try:
        printer = progress.stage_printer(desc="solving")
        for sweep in range(1, 31):  # 30 sweeps, one every 0.5 s: 15 s in all
            clock[0] += 0.5
            printer(f"sweep {sweep}")
    finally:
        progress.configure("auto")
    lines = out.getvalue().splitlines()
    # sweep 1, then one line per 5 s (the last 9 sweeps fall inside an interval: the stage's own closing
    # line reports the end)
    assert [ln.split("solving: ")[1] for ln in lines] == [
        "sweep 1 (0.5 s)", "sweep 11 (5.0 s, 10 steps)", "sweep 21 (5.0 s, 10 steps)"]


@pytest.mark.parametrize("unit, total, shown", [("tensor", 21, "21/21 tensors"), ("tensor", 1, "1/1 tensor"),
                                                 ("batch", 4, "4/4 batches"), ("steps", 1, "1/1 steps"),
                                                 ("module", 0, "0/0 modules")])
def test_lines_mode_counts_in_the_plural(unit, total, shown):
    """'applying math: 21/21 tensor': the bars are made with a singular or a plural unit; a count says it as counted."""
    stream = io.StringIO()
    progress.configure("lines", stream=stream)
    try:
        for _ in progress.bar(range(total), total=total, desc="applying math", unit=unit):
            pass
    finally:
        progress.configure("auto")
    assert f"applying math: {shown} (" in stream.getvalue(), stream.getvalue()


def test_cli_main_leaves_pythons_warning_display_as_it_found_it(capsys):
    """symmerge.cli.main shows the library's warnings as one 'symmerge: warning:' line while it runs, and puts
    Python's display back when it returns (a caller's process keeps its own)."""
    import warnings

    from symmerge.cli import main

    before = warnings.showwarning
    assert main(["specs"]) == 0
    assert warnings.showwarning is before
