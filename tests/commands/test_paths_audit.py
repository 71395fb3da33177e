"""The paths users give (benchmarks/paths_audit.py found these): a quoted ``~`` on the command line, ``~`` in a moe
config and in a config of symmerge's own keys, a FIFO or a device given as a data file or a config, a PEFT adapter
folder or a Hugging Face cache's model folder where a model goes, weights under other names, config.json or weights
that are no regular file, an output name of 240 bytes, a path that is no UTF-8."""

from __future__ import annotations

import os
import threading

import pytest

from conftest import npz_file, save_folder, vit_folder
from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def run_cli(capsys, *argv):
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if " error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME in tmp_path/home holding two tiny ViTs A and B and data.npz; the working folder tmp_path/work."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    vit_folder(home / "A", seed=0)
    vit_folder(home / "B", seed=1)
    npz_file(home / "data.npz", n=6)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home


def test_a_quoted_tilde_in_a_path_argument_is_the_home_folder(home, capsys):
    """``-o '~/out'`` wrote a folder named '~' into the current folder, and '~/A' as a model was 'not a directory'
    (the shell leaves ~ alone when quoted, and after a flag's '=')."""
    rc, err = run_cli(capsys, "align", "~/A", "~/B", "-o=~/out", "--progress", "none")
    assert rc == 0, err
    assert (home / "out" / "config.json").is_file()
    assert not (home.parent / "work" / "~").exists()


def test_a_tilde_after_a_data_flags_equals_sign_is_the_home_folder(home, capsys):
    rc, err = run_cli(capsys, "barrier", "~/A", "~/B", "--data=~/data.npz", "--points", "3", "--align", "none",
                      "-o", "~/bar", "--progress", "none")
    assert rc == 0, err
    assert (home / "bar").is_dir() and not (home.parent / "work" / "~").exists()


def test_a_tilde_in_a_moe_config_is_the_home_folder_as_in_a_run_config(home, capsys):
    """moe read ``source_model: ~/e`` relative to the working folder ('not a model folder'); run expands it."""
    for name, seed in (("base", 0), ("e1", 1)):
        save_folder(make_model("llama", head=True, seed=seed), home / name)
    config = home / "moe.yml"
    config.write_text("base_model: ~/base\nexperts:\n  - source_model: ~/base\n    positive_prompts: [hi]\n"
                      "  - source_model: ~/e1\n    positive_prompts: [yo]\ngate_mode: random\n")
    rc, err = run_cli(capsys, "moe", config, home / "moe", "--progress", "none")
    assert rc == 0, err
    assert (home / "moe" / "config.json").is_file()


def test_a_tilde_in_a_config_of_symmerges_own_keys_is_the_home_folder(home, capsys):
    """A config of symmerge's own keys (``command: barrier``, ``data:``) read ``~/...`` relative to the working
    folder ('data file not found'), while a mergekit config's ``model: ~/x`` is the home folder."""
    config = home / "barrier.yml"
    config.write_text("command: barrier\nmodels: [~/A, ~/B]\ndata: ~/data.npz\nalign: none\npoints: 3\n"
                      "output: ~/bar\nprogress: none\n")
    rc, err = run_cli(capsys, "run", config)
    assert rc == 0, err
    assert (home / "bar" / "barrier.json").is_file() and not (home.parent / "work" / "~").exists()


def _no_writer_guard(path):
    """Open the FIFO for writing a moment later if nothing else has, so that a reader that opened it is freed and the
    test fails instead of hanging."""
    def free():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    timer = threading.Timer(3.0, free)
    timer.daemon = True
    timer.start()
    return timer


@pytest.mark.parametrize("argv, name", [
    (("barrier", "A", "B", "--data", "{fifo}", "-o", "out", "--align", "none"), "d.npz"),
    (("run", "{fifo}", "out"), "c.yml"),
])
def test_a_fifo_is_refused_as_not_a_regular_file_without_opening_it(tmp_path, capsys, monkeypatch, argv, name):
    """A FIFO given as a data file or a config was 'not found' (it is there), which sends the user looking for a
    typo; it is never opened (no writer: a read would block forever)."""
    monkeypatch.chdir(tmp_path)
    vit_folder(tmp_path / "A", seed=0)
    vit_folder(tmp_path / "B", seed=1)
    fifo = tmp_path / name
    os.mkfifo(fifo)
    timer = _no_writer_guard(fifo)
    rc, err = run_cli(capsys, *(a.format(fifo=fifo) for a in argv), "--progress", "none")
    timer.cancel()
    line = error_line(err)
    assert rc == 2 and "not a regular file" in line and "not found" not in line, line
    assert not (tmp_path / "out").exists()


def test_a_peft_adapter_folder_where_a_model_goes_says_what_it_is(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    vit_folder(tmp_path / "B", seed=1)
    rc, err = run_cli(capsys, "align", adapter, tmp_path / "B", "-o", tmp_path / "out", "--progress", "none")
    line = error_line(err)
    assert rc == 2 and "PEFT adapter" in line and "BASE+ADAPTER" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["align", "merge"])
def test_an_output_name_of_240_characters_is_written(tmp_path, capsys, command):
    """A legal folder name (a file system takes 255 bytes) was 'file name too long': the temporary folder, the lock
    and the probe beside the output add their suffixes to its name."""
    vit_folder(tmp_path / "A", seed=0)
    vit_folder(tmp_path / "B", seed=1)
    out = tmp_path / ("é" * 20 + "x" * 200)  # 220 characters, 240 bytes
    extra = ["--method", "average", "--align", "none"] if command == "merge" else []
    rc, err = run_cli(capsys, command, tmp_path / "A", tmp_path / "B", "-o", out, *extra, "--progress", "none")
    assert rc == 0, err
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["A", "B", out.name])


def test_a_hub_cache_folder_and_weights_under_other_names_say_where_the_model_is(tmp_path, capsys):
    """A Hugging Face cache's ``models--org--name`` given instead of its snapshot, and ``MODEL.SAFETENSORS``, were a
    bare 'no config.json' and 'no weights'."""
    vit_folder(tmp_path / "B", seed=1)
    snapshot = tmp_path / "models--org--a" / "snapshots" / "abc123"
    vit_folder(snapshot, seed=0)
    rc, err = run_cli(capsys, "align", snapshot.parent.parent, tmp_path / "B", "-o", tmp_path / "o1", "--progress",
                      "none")
    line = error_line(err)
    assert rc == 2 and str(snapshot) in line, line
    (snapshot / "model.safetensors").rename(snapshot / "MODEL.SAFETENSORS")
    rc, err = run_cli(capsys, "align", snapshot, tmp_path / "B", "-o", tmp_path / "o2", "--progress", "none")
    line = error_line(err)
    assert rc == 2 and "MODEL.SAFETENSORS" in line and "case-sensitive" in line, line


@pytest.mark.parametrize("name, kind, needle", [
    ("config.json", "fifo", "not a regular file"), ("config.json", "loop", "looping symbolic link"),
    ("model.safetensors", "fifo", "model.safetensors is not a regular file"),
    ("model.safetensors", "loop", "model.safetensors is a broken or looping symbolic link")])
def test_a_model_file_that_is_no_regular_file_is_named_as_such(tmp_path, capsys, name, kind, needle):
    """config.json or model.safetensors a FIFO or a link to itself was 'no config.json' / 'no weights' (of a name that
    is there); never opened."""
    model = vit_folder(tmp_path / "A", seed=0)
    vit_folder(tmp_path / "B", seed=1)
    (model / name).unlink()
    os.mkfifo(model / name) if kind == "fifo" else os.symlink(name, model / name)
    timer = _no_writer_guard(model / name) if kind == "fifo" else None
    rc, err = run_cli(capsys, "align", model, tmp_path / "B", "-o", tmp_path / "out", "--progress", "none")
    if timer is not None:
        timer.cancel()
    line = error_line(err)
    assert rc == 2 and needle in line, line


@pytest.mark.parametrize("which", ["model", "output"])
def test_a_path_that_is_no_utf8_is_one_line_before_any_work(tmp_path, capsys, which):
    """A folder name with a byte that is no UTF-8 (0xfe): as the output, a traceback from the model card's writer
    after the whole alignment; as the model, 'unreadable safetensors file, truncated or corrupt'."""
    vit_folder(tmp_path / "A", seed=0)
    vit_folder(tmp_path / "B", seed=1)
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/odd\xfe")
    model, out = (odd, tmp_path / "out") if which == "model" else (tmp_path / "A", odd)
    if which == "model":
        os.rename(tmp_path / "A", odd)
    rc, err = run_cli(capsys, "align", model, tmp_path / "B", "-o", out, "--progress", "none")
    line = error_line(err)
    assert rc == 2 and "not valid UTF-8" in line, line
    assert sorted(os.listdir(os.fsencode(str(tmp_path)))) == sorted([b"B", b"odd\xfe" if which == "model" else b"A"])


def test_side_name_of_a_long_name_that_is_no_utf8():
    """The library's writers take any path: a long name with a byte that is no UTF-8 was a UnicodeEncodeError."""
    from symmerge.io.output import side_name

    name = os.fsdecode(b"x" * 230 + b"\xfe")
    short = side_name(f"/tmp/{name}")
    assert len(os.fsencode(short)) <= 180 and short != side_name(f"/tmp/{name[:-1]}y")


@pytest.mark.parametrize("argv", [("align", "-lead", "B", "-o", "out"), ("align", "A", "-lead", "-o", "out")])
def test_a_model_named_with_a_leading_dash_is_named_with_how_to_give_it(tmp_path, capsys, monkeypatch, argv):
    """``symmerge align -lead B -o out`` said 'the following arguments are required: anchor', naming neither the
    folder nor the way to give it (./-lead, or after --)."""
    monkeypatch.chdir(tmp_path)
    rc, err = run_cli(capsys, *argv)
    line = error_line(err)
    assert rc == 2 and "-lead" in line and "./-lead" in line, line
