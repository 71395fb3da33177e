"""Issue 35, items 2-4: no traceback for a user's mistake (one line, exit 2, nothing written), every tensor's
shape checked against config.json in the streamed paths, nothing stale (temporary folders of dead runs
removed, the umask's permissions in every writing path)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import save_folder
from factories import make_model
from test_bad_input import assert_clean_failure, run_cli, temp_leftovers

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def berts(tmp_path_factory):
    root = tmp_path_factory.mktemp("berts")
    return [save_folder(make_model("bert", head=True, seed=s), root / f"m{s}") for s in (0, 1)]


@pytest.fixture
def out(tmp_path):
    parent = tmp_path / "outs"
    parent.mkdir()
    return parent / "merged"


# ------------------------------------------------------------------ 2. one line, no traceback


@pytest.mark.parametrize("param, needle", [
    ("density=abc", "parameter 'density' must be a number in [0.0, 1.0], got 'abc'"),
    ("density=1.5", "parameter 'density' must be a number in [0.0, 1.0]"),
    ("scale=true", "parameter 'scale' must be"),
    ("scope=3", "parameter 'scope' must be one of"),
])
def test_bad_param_values_are_one_line_before_loading(berts, out, capsys, param, needle):
    t0 = time.perf_counter()
    rc, _, err = run_cli(capsys, "merge", *berts, "--method", "ties", "--base", berts[0], "--param", param, "-o", out)
    assert rc == 2
    assert_clean_failure(rc, err, out, needle)
    assert time.perf_counter() - t0 < 5  # checked where parsed: nothing loaded


def test_dare_seed_must_be_an_integer(berts, out, capsys):
    rc, _, err = run_cli(capsys, "merge", *berts, "--method", "dare", "--base", berts[0], "--param", "seed=1.5",
                         "-o", out)
    assert rc == 2
    assert_clean_failure(rc, err, out, "parameter 'seed' must be an integer")


@pytest.mark.parametrize("command", ["merge", "align", "barrier", "demo"])
def test_an_output_under_a_file_fails_at_once(berts, tmp_path, capsys, command):
    """A file where the output's parent folder should be (real ENOTDIR, nothing simulated)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "out"
    argv = {"merge": ["merge", *berts, "--method", "average", "-o", out],
            "align": ["align", *berts, "-o", out],
            "barrier": ["barrier", *berts, "--data", tmp_path / "d.npz", "-o", out],
            "demo": ["demo", "--quick", "-o", out]}[command]
    if command == "barrier":
        from conftest import npz_file

        npz_file(tmp_path / "d.npz")
    t0 = time.perf_counter()
    rc, _, err = run_cli(capsys, *argv)
    assert time.perf_counter() - t0 < 1.0
    assert rc == 2
    assert "not a directory" in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_read_only_file_system_fails_before_loading(berts, out, capsys, monkeypatch):
    """EROFS simulated (the tests run as root, for whom a chmod'ed folder stays writable): the probe's
    mkdtemp in the output's parent raises what a read-only mount raises."""
    import symmerge.io.output as output

    real = output.tempfile.mkdtemp

    def read_only(*args, dir=None, **kw):
        if dir is not None and Path(dir) == out.parent:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*args, dir=dir, **kw)

    monkeypatch.setattr(output.tempfile, "mkdtemp", read_only)
    for argv in (["merge", *berts, "--method", "average"], ["align", *berts], ["merge", *berts, "--method", "average",
                                                                               "--mode", "stream", "--align", "none"]):
        t0 = time.perf_counter()
        rc, _, err = run_cli(capsys, *argv, "-o", out)
        assert time.perf_counter() - t0 < 1.0, argv
        assert rc == 2
        assert_clean_failure(rc, err, out, "read-only file system")


def test_an_output_under_proc_fails_at_once(berts, capsys):
    """A real failure: /proc takes no new folders."""
    out = Path("/proc/symmerge-test-out")
    rc, _, err = run_cli(capsys, "merge", *berts, "--method", "average", "-o", out)
    assert rc == 2 and err.startswith("symmerge: error:") and err.count("\n") == 1 and not out.exists()


def test_text_data_without_a_tokenizer_is_one_error(tmp_path, capsys):
    """GPT-2 folders without a tokenizer: transformers still builds an empty one, which gives no tokens."""
    models = [save_folder(make_model("gpt2", head=True, seed=s), tmp_path / f"g{s}") for s in (0, 1)]
    text = tmp_path / "t.txt"
    text.write_text("hello world\nanother line\n")
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "merge", *models, "--method", "average", "--match", "activations", "--align-data",
                         text, "-o", out)
    assert rc == 2
    assert_clean_failure(rc, err, out, "no usable tokenizer in the model folder", "tokenizer")


def test_labelled_text_for_a_classifier_without_a_tokenizer_is_one_error(tmp_path, capsys):
    """BERT folders without tokenizer files: transformers builds a BertTokenizer that knows only its special tokens,
    so every word was read as [UNK] and a merge or a barrier scored the models on nothing, with exit 0."""
    models = [save_folder(make_model("bert", head=True, seed=s), tmp_path / f"b{s}") for s in (0, 1)]
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat sat", "label": 0}\n{"text": "a dog ran", "label": 1}\n')
    for argv in (["merge", *models, "--method", "regmean", "--data", data], ["barrier", *models, "--data", data,
                                                                             "--points", "2", "--align", "none"]):
        out = tmp_path / f"out-{argv[0]}"
        rc, _, err = run_cli(capsys, *argv, "-o", out)
        assert_clean_failure(rc, err, out, "no usable tokenizer in the model folder")


def _cli(*argv, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "symmerge.cli", *map(str, argv)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_a_closed_stdout_ends_quietly():
    """``symmerge specs | head -1``: no BrokenPipeError traceback, exit 141 as other tools."""
    proc = subprocess.run(f"{sys.executable} -m symmerge.cli specs | head -1; echo \"rc=${{PIPESTATUS[0]}}\"",
                          shell=True, executable="/bin/bash", cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "rc=141"


def _with_default_sigint():
    """The child's SIGINT as a terminal's Ctrl-C finds it: the default disposition. A test run started in the
    background of a non-interactive shell (``pytest ... &``, as CI runners and ``nohup`` do) has SIGINT
    ignored, every child inherits that, and Python installs no KeyboardInterrupt handler for an ignored
    SIGINT: the command rightly keeps ignoring it (the test below) and the interrupt would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_the_imports_is_one_line():
    proc = _cli("specs", preexec_fn=_with_default_sigint)
    time.sleep(0.4)  # the package's imports (torch, transformers) take seconds
    assert proc.poll() is None, "the imports ended before the interrupt: the test measured nothing"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    text = err.decode()
    assert "Traceback" not in text, text
    assert proc.returncode == 130 and text.strip() == "symmerge: interrupted", (proc.returncode, text)



def test_an_ignored_sigint_stays_ignored():
    """Started with SIGINT ignored (a background job, ``nohup``), the command does not take Ctrl-C over: the
    interrupt changes nothing, the command ends normally."""
    def ignore():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = _cli("specs", preexec_fn=ignore)
    time.sleep(0.4)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err.decode() == "", (proc.returncode, err.decode())
    text = out.decode()
    assert text.startswith("Each group below acts on") and "llama" in text, text[:200]  # the listing, printed

# ------------------------------------------------------------------ 3. shapes against config.json


def _transposed(folder: Path, key: str) -> None:
    """The header states ``key`` transposed (the same bytes): from_pretrained would refuse the folder."""
    sd = load_file(str(folder / "model.safetensors"))
    sd[key] = sd[key].reshape(sd[key].shape[1], sd[key].shape[0]).contiguous()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("argv", [
    ["merge", "--method", "average", "--align", "none", "--mode", "stream"],
    ["merge", "--method", "task_arithmetic", "--align", "none", "--mode", "stream", "--base", "{0}"],
    ["align", "--stream"],
])
def test_a_shape_the_config_contradicts_is_one_error_in_the_streamed_paths(tmp_path, capsys, argv):
    key = "bert.encoder.layer.0.intermediate.dense.weight"
    folders = [save_folder(make_model("bert", head=True, seed=s), tmp_path / f"m{s}") for s in (0, 1)]
    for f in folders:
        _transposed(f, key)
    out = tmp_path / "out"
    argv = [a.format(folders[0]) for a in argv]
    rc, _, err = run_cli(capsys, argv[0], *folders, *argv[1:], "-o", out)
    assert rc == 2
    assert_clean_failure(rc, err, out, key, "config.json")


# ------------------------------------------------------------------ 4. nothing stale


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_stale_temporary_folder_of_a_dead_run_is_removed(berts, out, capsys, mode):
    stale = out.parent / f".{out.name}.symmerge-tmp-{_dead_pid()}-abcd1234"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    live = out.parent / f".{out.name}.symmerge-tmp-{os.getppid()}-live0000"  # a running process (pytest's parent)
    live.mkdir()
    rc, _, err = run_cli(capsys, "merge", *berts, "--method", "average", "--align", "none", "--mode", mode, "-o", out)
    assert rc == 0
    assert not stale.exists() and live.exists()
    assert sum(str(stale) in line and "removed" in line for line in err.splitlines()) == 1
    assert any(str(live) in line and "still running" in line for line in err.splitlines())
    assert temp_leftovers(out.parent) == [live.name]


def _modes(folder: Path) -> set:
    found = {(p.is_dir(), p.stat().st_mode & 0o777) for p in folder.rglob("*")}
    return found | {(True, folder.stat().st_mode & 0o777)}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_umask_permissions_in_every_path(berts, tmp_path, capsys, umask):
    old = os.umask(umask)
    try:
        outs = {}
        for name, argv in {
            "memory": ["merge", *berts, "--method", "average", "--align", "none", "--mode", "memory"],
            "stream": ["merge", *berts, "--method", "average", "--align", "none", "--mode", "stream"],
            "align": ["align", *berts, "--symmetries", "attn,ffn"],
            "align-stream": ["align", *berts, "--symmetries", "attn,ffn", "--stream"],
        }.items():
            outs[name] = tmp_path / name
            assert run_cli(capsys, *argv, "-o", outs[name])[0] == 0, name
    finally:
        os.umask(old)
    want = {(True, 0o777 & ~umask), (False, 0o666 & ~umask)}
    for name, folder in outs.items():
        assert _modes(folder) <= want, (name, sorted(_modes(folder)))
        weights = list(folder.glob("*.safetensors"))
        assert weights and all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in weights), name


def test_an_error_after_a_ctrl_c_is_reported_as_the_interrupt(monkeypatch, capsys):
    """A Ctrl-C that cuts a lazy import in half can surface as another error (a half-imported numpy.dtypes
    became a RecursionError, then transformers' ModuleNotFoundError, in a run of the test above under load):
    once a Ctrl-C was received, any error is the interrupt, one line and exit 130; without one, it propagates."""
    from symmerge import _entry, cli

    def broken_import(argv):
        raise ModuleNotFoundError("Could not import module 'BertForSequenceClassification'")

    def ctrl_c_then_broken_import(argv):
        monkeypatch.setattr(_entry, "_interrupted", True)  # the Ctrl-C, received during this command
        broken_import(argv)

    monkeypatch.setattr(cli, "_run", broken_import)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["specs"])
    monkeypatch.setattr(cli, "_run", ctrl_c_then_broken_import)
    assert cli.main(["specs"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "symmerge: interrupted"


def test_a_ctrl_c_of_an_earlier_command_in_the_process_is_not_this_ones(monkeypatch, capsys):
    """``main`` called again in one process after a command was interrupted (a test, a benchmark, a notebook): the
    next command's own error is reported as that error, not as "interrupted" (the flag stayed set for the
    process's life)."""
    from symmerge import _entry, cli

    monkeypatch.setattr(_entry, "_interrupted", True)  # an earlier command's Ctrl-C or SIGTERM
    assert cli.main(["align", "/nonexistent/a", "/nonexistent/b", "-o", "/nonexistent/out"]) == 2
    err = capsys.readouterr().err
    assert "symmerge: error:" in err and "interrupted" not in err, err


def test_a_ctrl_c_during_the_imports_waits_for_them():
    """The signal is held while the command imports (an extension's C++ initialisation, torch's, aborts the
    process with exit -6 when a KeyboardInterrupt is raised inside it): the block runs to its end, then the
    command says so in one line, exit 130. Without the deferral the interrupt lands inside the block."""
    code = ("import os, signal, sys\n"
            "sys.argv[0] = 'symmerge'\n"
            "from symmerge._entry import guarded_imports\n"
            "with guarded_imports():\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    for _ in range(10 ** 5): pass\n"
            "    print('the block ran to its end', flush=True)\n"
            "print('after the block', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_with_default_sigint)
    assert proc.stdout == "the block ran to its end\n", (proc.stdout, proc.stderr)
    assert proc.returncode == 130 and proc.stderr.strip() == "symmerge: interrupted", (proc.returncode, proc.stderr)
