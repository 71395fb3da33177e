"""A demanding user's bad input, found in an audit of the README's commands: each is one clear
'symmerge: error:' line (or one warning where mergekit goes on), exit 2, before any work, nothing written."""

from __future__ import annotations

import pytest

from conftest import save_folder
from factories import make_model
from symmerge.cli import main
from symmerge.errors import SymmergeError
from symmerge.pipeline.options import AlignOptions

pytestmark = pytest.mark.usefixtures("single_thread")


def run_cli(capsys, *argv):
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's refusal (a value the flag's reader refuses)
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    assert lines[0].startswith(("symmerge: error:", f"symmerge {lines[0].split()[1].rstrip(':')}: error: argument ")), \
        lines[0]
    return lines[0]


# ------------------------------------------------------------------ --verify-tol


@pytest.mark.parametrize("tol", ["-1", "nan", "inf", "-inf"])
def test_a_verify_tolerance_out_of_range_is_refused_before_any_work(tmp_path, capsys, tol):
    """A negative or NaN tolerance used to run the whole alignment, then claim 'aligned model is not equivalent'
    (an infinite one silently turned the check off); now the flag's own line before any model is read."""
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "align", tmp_path / "no-model", tmp_path / "no-anchor", "-o", out,
                         f"--verify-tol={tol}", "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "--verify-tol" in line and "no-model" not in line, line
    assert not out.exists()


@pytest.mark.parametrize("tol", [-1e-3, float("nan"), float("inf"), "1e-3", True])
def test_align_options_refuse_a_bad_verify_tolerance(tol):
    with pytest.raises(SymmergeError, match="verify-tol"):
        AlignOptions(verify_tol=tol)


@pytest.mark.parametrize("tol", [None, 0, 0.0, 1e-4, 1])
def test_align_options_keep_a_good_verify_tolerance(tol):
    assert AlignOptions(verify_tol=tol).verify_tol == tol


# ------------------------------------------------------------------ one line, whatever the message


def test_a_causal_lm_folder_without_a_tokenizer_is_one_line(tmp_path, capsys):
    """transformers' own message (several lines) used to be quoted as it is: five lines on stderr."""
    models = [save_folder(make_model("llama", seed=s), tmp_path / f"l{s}") for s in (0, 1)]
    text = tmp_path / "t.txt"
    text.write_text("hello world\nanother line\n")
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "barrier", *models, "--data", text, "--align", "none", "--points", "2", "-o", out,
                         "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "tokenizer" in line
    assert not out.exists()


def test_an_error_message_of_several_lines_is_printed_on_one(monkeypatch, capsys):
    import symmerge.commands.specs as specs

    def fail(args):
        raise SymmergeError("first part\n  (1) a detail \n\n(2) another\n")

    monkeypatch.setattr(specs, "run", fail)
    rc, _, err = run_cli(capsys, "specs")
    assert rc == 2
    assert one_error_line(err) == "symmerge: error: first part (1) a detail (2) another"


# ------------------------------------------------------------------ extract-lora --save-module


def test_a_save_module_that_names_no_module_is_a_warning(tmp_path, capsys):
    """A misspelt --save-module (lm_haed) matched nothing and was dropped in silence; it stays in the adapter's
    modules_to_save as mergekit-extract-lora keeps it, with one warning line naming it and the name it is close to."""
    import json

    base = save_folder(make_model("llama", head=True, seed=0), tmp_path / "base")
    ft = save_folder(make_model("llama", head=True, seed=1), tmp_path / "ft")
    out = tmp_path / "adapter"
    rc, _, err = run_cli(capsys, "extract-lora", ft, base, "-o", out, "--rank", "2", "--save-module", "lm_haed",
                         "--save-module", "lm_head", "--progress", "none")
    assert rc == 0
    warnings = [line for line in err.splitlines() if line.startswith("symmerge: warning:")]
    assert len(warnings) == 1, err
    assert "--save-module lm_haed" in warnings[0] and "'lm_head'" in warnings[0], warnings[0]
    config = json.loads((out / "adapter_config.json").read_text())
    assert "lm_haed" in config["modules_to_save"] and "lm_head" in config["modules_to_save"]
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["warnings"] == [warnings[0].removeprefix("symmerge: warning: ")]


# ------------------------------------------------------------------ a folder where a file is expected


@pytest.mark.parametrize("name", ["eval.npz", "eval.txt", "eval.jsonl"])
def test_a_folder_given_as_the_data_file_says_it_is_a_folder(tmp_path, capsys, name):
    """It said 'data file not found' of a folder that is there."""
    (tmp_path / name).mkdir()
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "barrier", tmp_path / "a", tmp_path / "b", "--data", tmp_path / name, "-o", out)
    line = one_error_line(err)
    assert rc == 2 and "is a directory" in line and "not found" not in line, line
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "moe"])
def test_a_folder_given_as_the_config_says_it_is_a_folder(tmp_path, capsys, command):
    (tmp_path / "merge.yml").mkdir()
    rc, _, err = run_cli(capsys, command, tmp_path / "merge.yml", tmp_path / "out")
    line = one_error_line(err)
    assert rc == 2 and "is a directory" in line and "not found" not in line, line


def test_an_npz_that_is_no_zip_archive_says_so(tmp_path, capsys):
    """numpy's message for a file that is no zip archive spoke of pickled data, which the file did not hold."""
    from symmerge.io.data import load_data

    bad = tmp_path / "eval.npz"
    bad.write_text("pixel_values,labels\n0.1,1\n")
    with pytest.raises(SymmergeError) as e:
        load_data(bad)
    assert "not an .npz file" in str(e.value) and "numpy.savez" in str(e.value) and "pickle" not in str(e.value)


# ------------------------------------------------------------------ --version


def test_version_prints_the_version(capsys):
    """`symmerge --version` said 'the following arguments are required: COMMAND' (exit 2)."""
    from symmerge import __version__

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"symmerge {__version__}"


# ------------------------------------------------------------------ a misspelt mergekit key


def _config(tmp_path, text: str):
    for s in (0, 1):
        save_folder(make_model("llama", seed=s), tmp_path / f"m{s}")
    path = tmp_path / "merge.yml"
    path.write_text(text.format(a=tmp_path / "m0", b=tmp_path / "m1"))
    return path


@pytest.mark.parametrize("text,needles", [
    ("models:\n  - model: {a}\n  - model: {b}\nmerge_methd: linear\n", ["merge_methd", "did you mean 'merge_method'"]),
    ("models:\n  - model: {a}\n  - model: {b}\nmerge_method: slerp\nbase_model: {a}\nparameter:\n  t: 0.5\n",
     ["line 6", "parameter:", "did you mean 'parameters'"]),
])
def test_an_error_names_the_misspelt_key_that_was_ignored_before_it(tmp_path, capsys, text, needles):
    """The ignored key's warning was lost when the config then failed ("'merge_method' is missing", "no 't' for
    embed_tokens.weight"), though it is why: the one error line now names it."""
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "run", _config(tmp_path, text), out, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2
    for needle in needles:
        assert needle in line, (needle, line)
    assert not out.exists()


# ------------------------------------------------------------------ --align-data that nothing reads


@pytest.mark.parametrize("command", [
    ["align", "a", "b"],
    ["merge", "a", "b", "--method", "average"],
    ["barrier", "a", "b", "--data", "eval.npz"],
])
def test_align_data_that_nothing_reads_is_refused(tmp_path, capsys, command):
    """With the default --match weights (and no --repair, --distill, --temperature) --align-data was read by nothing:
    the alignment was data-free while the user thought it used the data, as the --learn-* flags without --match
    learned are refused."""
    from conftest import npz_file

    npz_file(tmp_path / "eval.npz")
    npz_file(tmp_path / "unlabeled.npz")
    out = tmp_path / "out"
    argv = [tmp_path / a if a in ("a", "b", "eval.npz") else a for a in command]
    rc, _, err = run_cli(capsys, *argv, "--align-data", tmp_path / "unlabeled.npz", "-o", out, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "--align-data" in line and "--match" in line and "a: not a directory" not in line, line
    assert not out.exists()


# ------------------------------------------------------------------ --help


def test_the_symmetries_help_names_every_symmetry():
    """--symmetries / --align's help listed heads, attn, ffn, rescale, residual: not experts, which it takes."""
    import re

    from symmerge.families import SYMMETRIES
    from symmerge.pipeline.options import describe_symmetries

    listed = describe_symmetries("x").split("; or none")[0]
    for name in SYMMETRIES:
        assert re.search(rf"\b{name} \(", listed), name


def test_a_shard_size_without_stream_is_refused_as_pipeline_is(tmp_path, capsys):
    """align's --shard-size shapes --stream's shards only: without --stream it was dropped in silence."""
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "align", tmp_path / "a", tmp_path / "b", "-o", out, "--shard-size", "1MB",
                         "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "--shard-size applies to --stream only" in line, line
    assert not out.exists()


def test_an_unknown_key_of_symmerge_s_own_config_says_which_key_is_close(tmp_path, capsys):
    """A mergekit key that is misspelt gets a 'did you mean'; a key of symmerge's own configs did not."""
    path = tmp_path / "merge.yml"
    path.write_text(f"models: [{tmp_path / 'a'}, {tmp_path / 'b'}]\nmethod: average\neval_data: e.npz\nanchro: 0\n"
                    f"output: {tmp_path / 'out'}\n")
    rc, _, err = run_cli(capsys, "run", path, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "unknown key 'anchro'" in line and "did you mean 'anchor'?" in line, line


def test_a_misspelt_flag_says_which_flag_is_close(capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["align", "a", "b", "-o", "out", "--symetries", "attn"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == ("symmerge align: error: unrecognized arguments: --symetries attn (did you mean --symmetries?) "
                   "(see symmerge align --help)\n"), err


# ------------------------------------------------------------------ demo


def test_demo_refuses_a_negative_thread_count_in_one_line(tmp_path, capsys):
    """--threads -1 was torch's RuntimeError traceback (set_num_threads expects a positive integer)."""
    out = tmp_path / "demo"
    rc, _, err = run_cli(capsys, "demo", "--threads", "-1", "-o", out, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "--threads" in line, line
    assert not out.exists()


# ------------------------------------------------------------------ LoRA inputs


def test_a_lora_merge_cache_that_is_a_file_says_so(tmp_path, capsys):
    """It said 'FILE: File exists' (the operating system's refusal to make the folder)."""
    base = save_folder(make_model("llama", head=True, seed=0), tmp_path / "base")
    ft = save_folder(make_model("llama", head=True, seed=1), tmp_path / "ft")
    adapter = tmp_path / "adapter"
    assert run_cli(capsys, "extract-lora", ft, base, "-o", adapter, "--rank", "2", "--progress", "none")[0] == 0
    cache = tmp_path / "cache.txt"
    cache.write_text("not a folder")
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "merge", f"{base}+{adapter}", ft, "--method", "linear", "--align", "none", "-o", out,
                         "--lora-merge-cache", cache, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "--lora-merge-cache" in line and "not a directory" in line, line
    assert not out.exists() and cache.read_text() == "not a folder"


# ------------------------------------------------------------------ barrier on mismatched models


@pytest.mark.parametrize("extra", [[], ["third"]])
def test_barrier_on_models_of_other_widths_names_them_and_not_label_spaces(tmp_path, capsys, extra):
    """Two ViTs of hidden 16 and 32 were 'shapes differ for vit.embeddings.cls_token: ... in model A, ... in model B
    (different label spaces cannot be interpolated)': the wrong reason, and with three models 'A' and 'B' named no
    folder given."""
    from conftest import npz_file, vit_folder

    a, b = vit_folder(tmp_path / "a", seed=0), vit_folder(tmp_path / "wide", seed=1, hidden_size=32)
    models = [a, vit_folder(tmp_path / "third", seed=2), b] if extra else [a, b]
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "barrier", *models, "--data", npz_file(tmp_path / "eval.npz"), "--align", "none",
                         "-o", out, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "label spaces" not in line and str(b) in line and str(a) in line, line
    assert "model A" not in line and "model B" not in line, line
    assert not out.exists()


# ------------------------------------------------------------------ align --print-plan


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", ["architecture", "width"])
def test_print_plan_refuses_what_the_alignment_refuses(tmp_path, capsys, stream, case):
    """align --print-plan printed a plan and exited 0 for a BERT model and a Llama anchor (or two ViTs of other
    widths), which the alignment itself refuses in one line; merge --print-plan refused them already."""
    from conftest import vit_folder

    if case == "architecture":
        model = save_folder(make_model("bert", seed=0), tmp_path / "model")
        anchor = save_folder(make_model("llama", seed=0), tmp_path / "anchor")
        needle = "architectures differ"
    else:
        model, anchor = vit_folder(tmp_path / "model", seed=0), vit_folder(tmp_path / "anchor", seed=1, hidden_size=32)
        needle = "shapes differ"
    rc, out, err = run_cli(capsys, "align", model, anchor, "-o", tmp_path / "out", "--print-plan",
                           *(["--stream"] if stream else []), "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and needle in line and out == "", line


# ------------------------------------------------------------------ moe


def test_one_expert_and_the_default_experts_per_token_says_it_is_the_default(tmp_path, capsys):
    """A config without experts_per_token and one expert was 'experts_per_token 2 is more than the 1 experts' at
    line 1, naming a key the file does not have."""
    for name, seed in (("base", 0), ("e", 1)):
        save_folder(make_model("llama", head=True, seed=seed), tmp_path / name)
    path = tmp_path / "moe.yml"
    path.write_text(f"base_model: {tmp_path / 'base'}\nexperts:\n  - source_model: {tmp_path / 'e'}\n"
                    "    positive_prompts: [hi]\ngate_mode: random\n")
    rc, _, err = run_cli(capsys, "moe", path, tmp_path / "out", "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "default" in line and "experts_per_token: 1" in line, line


# ------------------------------------------------------------------ --layers


@pytest.mark.parametrize("value", ["", " ", ",", " , "])
def test_an_empty_layer_list_is_refused(tmp_path, capsys, value):
    """--layers "" (an empty shell variable) aligned no layer and wrote an unaligned copy, exit 0."""
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "align", tmp_path / "a", tmp_path / "b", "-o", out, f"--layers={value}",
                         "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "--layers" in line, line
    assert not out.exists()


# ------------------------------------------------------------------ empty paths


@pytest.mark.parametrize("argv,flag", [
    (["align", "a", "b", "-o", ""], "--output"),
    (["merge", "a", "b", "--method", "average", "-o", ""], "--output"),
    (["barrier", "a", "b", "--data", "", "-o", "out"], "--data"),
    (["merge", "a", "b", "--method", "average", "--eval-data", "", "-o", "out"], "--eval-data"),
    (["align", "", "b", "-o", "out"], "model"),
    (["extract-lora", "a", "b", "-o", "", "--rank", "2"], "--output"),
    (["run", "c.yml", ""], "out"),
])
def test_an_empty_path_is_refused(tmp_path, capsys, monkeypatch, argv, flag):
    """-o "" (an empty shell variable) was the current folder: refused there only because it was not empty, and
    written into when it was; --data "" was '.: is a directory'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yml").write_text("models: [a, b]\nmerge_method: linear\n")
    rc, _, err = run_cli(capsys, *argv, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "empty path" in line and flag in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yml"]


@pytest.mark.parametrize("command", [["align", "a", "b"], ["merge", "a", "b", "--method", "average"],
                                     ["run", "c.yml"]])
def test_the_current_folder_as_the_output_says_so(tmp_path, capsys, monkeypatch, command):
    """-o . in an empty folder was 'output exists and is not an empty directory' (the run's lock file was made in it):
    the written folder would replace the current one."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (tmp_path / "c.yml").write_text("models: [a, b]\nmerge_method: linear\n")
    argv = [str(tmp_path / a) if a == "c.yml" else a for a in command]
    rc, _, err = run_cli(capsys, *argv, "-o", ".", "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "current folder" in line, line
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("align", [["--align", "none"], []])
def test_barrier_print_plan_refuses_models_of_other_shapes(tmp_path, capsys, align):
    """barrier --align none --print-plan printed a plan and exited 0 for ViTs of hidden 16 and 32, which the study
    refuses."""
    from conftest import npz_file, vit_folder

    a, b = vit_folder(tmp_path / "a", seed=0), vit_folder(tmp_path / "wide", seed=1, hidden_size=32)
    rc, out, err = run_cli(capsys, "barrier", a, b, "--data", npz_file(tmp_path / "eval.npz"), *align, "-o",
                           tmp_path / "out", "--print-plan", "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "shapes differ" in line and str(b) in line and out == "", line


# ------------------------------------------------------------------ the output inside an input folder


@pytest.mark.parametrize("command,inside", [
    (["align", "a", "b"], "a/aligned"),
    (["align", "a", "b"], "b/sub/aligned"),
    (["merge", "a", "b", "--method", "average", "--align", "none"], "b/merged"),
    (["extract-lora", "a", "b", "--rank", "2"], "b/adapter"),
    (["barrier", "a", "b", "--data", "eval.npz", "--align", "none"], "a/study"),
])
def test_an_output_inside_an_input_folder_is_refused(tmp_path, capsys, monkeypatch, command, inside):
    """-o model_a/merged wrote the output (and its lock file) into an input's folder: an input changed."""
    from conftest import npz_file, vit_folder

    monkeypatch.chdir(tmp_path)
    for name, seed in (("a", 0), ("b", 1)):
        vit_folder(tmp_path / name, seed)
    npz_file(tmp_path / "eval.npz")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    rc, _, err = run_cli(capsys, *command, "-o", inside, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "inside the input folder" in line and "change an input" in line, line
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_an_output_beside_the_inputs_is_written(tmp_path, capsys, monkeypatch):
    """The check above compares folders, not names: 'a-aligned' beside 'a' is no folder of 'a'."""
    from conftest import vit_folder

    monkeypatch.chdir(tmp_path)
    for name, seed in (("a", 0), ("b", 1)):
        vit_folder(tmp_path / name, seed)
    rc, _, err = run_cli(capsys, "align", "a", "b", "-o", "a-aligned", "--progress", "none")
    assert rc == 0, err
    assert (tmp_path / "a-aligned" / "config.json").is_file()


@pytest.mark.parametrize("flags,named", [
    (["--align-data", "unlabeled.npz"], "--align-data"),
    (["--match", "learned", "--learn-steps", "5"], "--match, --learn-steps"),
    (["--rescale", "none"], "--rescale"),
    (["--symmetries", "attn,ffn"], "--symmetries"),  # moe's own flag: accepted without --align, and nothing read it
])
def test_moe_alignment_flags_without_align_are_refused(tmp_path, capsys, flags, named):
    """moe read the alignment flags only with --align: without it they were dropped in silence (the experts were
    not aligned), as --align-stream without --align is refused."""
    path = tmp_path / "moe.yml"
    path.write_text("base_model: base\nexperts:\n  - source_model: e\n    positive_prompts: [hi]\ngate_mode: random\n")
    rc, _, err = run_cli(capsys, "moe", path, tmp_path / "out", *flags, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and line.startswith(f"symmerge: error: {named}:") and "--align only" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry", ["align_to_folder", "merge", "extract_lora"])
def test_the_library_refuses_an_output_inside_an_input_too(tmp_path, entry):
    """The library entries check what the CLI checks, before the output's claim (its lock file would be the first
    thing written into the input)."""
    import symmerge
    from conftest import vit_folder
    from symmerge.merge.extract_lora import ExtractOptions, extract_lora

    a, b = vit_folder(tmp_path / "a", 0), vit_folder(tmp_path / "b", 1)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(SymmergeError, match="inside the input folder"):
        if entry == "align_to_folder":
            symmerge.align_to_folder(str(a), str(b), tmp_path / "b" / "out", progress=False)
        elif entry == "merge":
            symmerge.merge([str(a), str(b)], tmp_path / "a" / "deep" / "out", method="average", align="none",
                           progress=False)
        else:
            extract_lora(str(a), str(b), tmp_path / "a" / "lora", ExtractOptions(rank=2))
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_a_command_run_in_process_leaves_the_progress_setting_as_it_was(tmp_path, capsys):
    """``symmerge.cli.main([... '--progress', 'none'])`` in a caller's process (a notebook, a test) used to leave
    progress off for every later library call of that process."""
    from symmerge import progress
    from symmerge.cli import main

    progress.configure("lines")
    try:
        assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "m"), "--method",
                     "average", "--progress", "none"]) == 2
        assert progress._state["mode"] == "lines"
    finally:
        progress.configure("auto")
