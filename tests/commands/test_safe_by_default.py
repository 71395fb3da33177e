"""Safe by default (issue 40): no code from a model folder runs unless asked, a hostile YAML is refused in
milliseconds, and every operating-system fault (a full disk, a file-size limit, a read-only file system, a
symlinked or raced output, SIGTERM) is one ``symmerge: error:`` line with nothing left behind.

Every case asserts the exit code, the one line, no output folder, no temporary folder (nor lock file) and
the inputs unchanged by hash. Models are tiny random Llamas (two layers, hidden 32)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import symmerge
from symmerge.cli import main
from symmerge.errors import OutputError, RemoteCodeError, SymmergeError

pytestmark = pytest.mark.usefixtures("single_thread")

PROGRESS_LINE = re.compile(r"^\[\d+\.\d s\] ")
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ helpers


def llama_folder(path: Path, seed: int = 0, layers: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


@pytest.fixture
def pair(tmp_path):
    return llama_folder(tmp_path / "a", 0), llama_folder(tmp_path / "b", 1)


def tree_hash(*folders: Path) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    """Temporary folders, probes and lock files symmerge makes beside an output."""
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if ".symmerge-" in p.name or ".intermediates-" in p.name)


def cli(capsys, *argv, stdin: str | None = None):
    capsys.readouterr()
    old = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        rc = main([str(a) for a in argv])
    finally:
        sys.stdin = old
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]


def assert_refused(rc, out_text, err, out: Path, hashes: dict, *needles, code=2):
    """The contract of every case: the exit code, one error line, nothing on stdout, no output, nothing
    left beside it, inputs unchanged."""
    lines = error_lines(err)
    assert rc == code, (rc, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("symmerge: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert out_text == "", out_text
    assert not out.exists() or (out.is_dir() and not out.is_symlink() and not any(out.iterdir())), out
    assert leftovers(out.parent) == []
    assert tree_hash(*{Path(k).parent for k in hashes}) == hashes if hashes else True


def subprocess_cli(*argv, cwd=None, stdin: str = "", preexec_fn=None, timeout=180):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "symmerge.cli", *map(str, argv)], input=stdin, text=True,
                          capture_output=True, cwd=cwd, env=env, preexec_fn=preexec_fn, timeout=timeout)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str, readonly: bool = False):
    """A tmpfs of ``size`` at ``path`` (CI runs as root); skipped where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if readonly else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'mount failed'}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ------------------------------------------------------------------ 1. code from a model folder


def custom_code_folder(path: Path, marker: Path, seed: int) -> Path:
    """A Llama whose config.json asks for the folder's own code (auto_map, an unknown model_type); importing
    evil.py writes ``marker``."""
    llama_folder(path, seed)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="evil_llama", architectures=["EvilForCausalLM"],
               auto_map={"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                         "AutoModelForCausalLM": "evil.EvilModel"})
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "evil.py").write_text(textwrap.dedent(f"""\
        open({str(marker)!r}, "w").write("ran")
        from transformers import LlamaConfig, LlamaForCausalLM
        class EvilConfig(LlamaConfig):
            model_type = "evil_llama"
        class EvilModel(LlamaForCausalLM):
            config_class = EvilConfig
        """))
    return path


@pytest.mark.parametrize("command", ["merge-memory", "merge-stream", "barrier", "align", "run"])
def test_a_folder_with_custom_code_is_refused_without_a_prompt(tmp_path, capsys, command):
    marker = tmp_path / "MARKER"
    a = custom_code_folder(tmp_path / "a", marker, 0)
    b = custom_code_folder(tmp_path / "b", marker, 1)
    (tmp_path / "text.txt").write_text("hello world, some text\nmore text on a line\n")
    (tmp_path / "c.yml").write_text(f"models:\n  - model: {a}\n  - model: {b}\nmerge_method: linear\n"
                                    "parameters: {weight: 0.5}\n")
    out = tmp_path / "out"
    argv = {"merge-memory": ["merge", a, b, "-o", out, "--method", "linear", "--mode", "memory"],
            "merge-stream": ["merge", a, b, "-o", out, "--method", "linear", "--mode", "stream"],
            "barrier": ["barrier", a, b, "-o", out, "--data", tmp_path / "text.txt", "--align", "none"],
            "align": ["align", a, b, "-o", out],
            "run": ["run", tmp_path / "c.yml", out]}[command]
    hashes = tree_hash(a, b)
    rc, stdout, err = cli(capsys, *argv, "--progress", "none", stdin="y\ny\ny\n")
    assert_refused(rc, stdout, err, out, hashes, "--trust-remote-code", "evil.py")
    assert not marker.exists(), "the folder's code ran"


def test_the_refusal_holds_in_a_fresh_process_answering_yes(tmp_path):
    """As a user would run it: a real process whose stdin answers 'y' to any prompt."""
    marker = tmp_path / "MARKER"
    a, b = (custom_code_folder(tmp_path / n, marker, i) for i, n in enumerate("ab"))
    hashes = tree_hash(a, b)
    r = subprocess_cli("merge", a, b, "-o", tmp_path / "out", "--method", "linear", "--mode", "memory",
                       stdin="y\n" * 5)
    assert_refused(r.returncode, r.stdout, r.stderr, tmp_path / "out", hashes, "--trust-remote-code")
    assert not marker.exists()


def test_trust_remote_code_is_what_lets_it_run(tmp_path, capsys):
    """The flag does what it says (the contrast that shows the refusal is the flag's, not an accident)."""
    marker = tmp_path / "MARKER"
    a, b = (custom_code_folder(tmp_path / n, marker, i) for i, n in enumerate("ab"))
    rc, _, err = cli(capsys, "merge", a, b, "-o", tmp_path / "out", "--method", "linear", "--mode", "memory",
                     "--trust-remote-code", "--progress", "none")
    assert rc == 0, err
    assert marker.exists() and (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "evil.py").read_text() == (a / "evil.py").read_text()  # the output needs it too
    assert not symmerge.io.hf.remote_code_allowed()  # the command's permission ends with the command


@pytest.mark.parametrize("command", ["align", "merge-memory", "merge-stream"])
def test_code_beside_a_model_type_transformers_knows_is_copied_never_run(tmp_path, capsys, command):
    """An ``auto_map`` for a model type transformers has: read with transformers' class, without the flag; the
    output keeps the input's config.json, auto_map included, so the folder's .py files come along (copied, not
    imported): the output loads as its input did, never with an auto_map naming a file it lacks."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    marker = tmp_path / "MARKER"
    a, b = (custom_code_folder(tmp_path / n, marker, i) for i, n in enumerate("ab"))
    for folder in (a, b):
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
        (folder / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    argv = {"align": ["align", a, b, "-o", out],
            "merge-memory": ["merge", a, b, "-o", out, "--method", "average", "--mode", "memory"],
            "merge-stream": ["merge", a, b, "-o", out, "--method", "average", "--mode", "stream"]}[command]
    rc, _, err = cli(capsys, *argv, "--progress", "none")
    assert rc == 0, err
    assert not marker.exists(), "the folder's code ran"
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModel"] == "evil.EvilModel"
    assert (out / "evil.py").read_text() == (a / "evil.py").read_text()
    report = json.loads((out / "symmerge_report.json").read_text())
    assert "evil.py" in report["side_files"]["copied"] and "evil.py" not in report["side_files"]["left_out"]
    assert type(AutoModelForCausalLM.from_pretrained(out)) is LlamaForCausalLM and not marker.exists()


def test_a_tokenizer_with_custom_code_is_refused(tmp_path):
    from symmerge.io.hf import auto_tokenizer, trust_remote_code

    marker = tmp_path / "MARKER"
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}}))
    (folder / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(RemoteCodeError, match="--trust-remote-code"):
        auto_tokenizer(folder)
    with trust_remote_code(False), pytest.raises(RemoteCodeError):
        auto_tokenizer(folder)
    assert not marker.exists()


# ------------------------------------------------------------------ 2. bounded YAML


def alias_bomb(levels: int = 9) -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    prev = "a"
    for name in "bcdefghijk"[: levels - 1]:
        text += f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]\n"
        prev = name
    return text + "merge_method: linear\n"


def test_an_alias_bomb_is_refused_in_milliseconds_and_little_memory(tmp_path):
    """The 9-level 'billion laughs' (under 600 bytes; 9^9 strings expanded) is refused in under a second, the
    peak memory of the reading process growing by less than 200 MB (today's code grew past 3.9 GB)."""
    config = tmp_path / "bomb.yml"
    config.write_text(alias_bomb())
    assert config.stat().st_size < 700
    probe = textwrap.dedent(f"""\
        import time
        from symmerge.config.source import read_documents
        from symmerge.errors import SymmergeError
        def peak_kb():  # this process's own peak (VmHWM): a child's ru_maxrss starts at its parent's peak
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
        before = peak_kb()
        t = time.perf_counter()
        try:
            read_documents({str(config)!r})
            print("READ")
        except SymmergeError as e:
            print("REFUSED", e)
        print(time.perf_counter() - t, peak_kb() - before)
        """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    verdict, figures = r.stdout.strip().splitlines()
    seconds, grown_kb = figures.split()
    assert verdict.startswith("REFUSED") and "aliases" in verdict, r.stdout + r.stderr
    assert float(seconds) < 1.0
    assert int(grown_kb) < 200 * 1024


def test_an_alias_bomb_through_the_command_is_one_line(tmp_path, capsys):
    config = tmp_path / "bomb.yml"
    config.write_text(alias_bomb())
    hashes = tree_hash(tmp_path)
    t = time.perf_counter()
    rc, out, err = cli(capsys, "run", config, tmp_path / "out")
    assert time.perf_counter() - t < 1.0
    assert_refused(rc, out, err, tmp_path / "out", hashes, "bomb.yml line", "aliases")


def test_a_key_given_twice_names_both_lines(tmp_path, capsys, pair):
    a, b = pair
    config = tmp_path / "dup.yml"
    config.write_text(f"models:\n  - model: {a}\n  - model: {b}\nmerge_method: ties\nbase_model: {a}\n"
                      "merge_method: linear\n")
    hashes = tree_hash(a, b)
    rc, out, err = cli(capsys, "run", config, tmp_path / "out")
    assert_refused(rc, out, err, tmp_path / "out", hashes, "dup.yml line 6", "'merge_method' given twice",
                   "first on line 4")


def test_nesting_size_and_tags_are_bounded(tmp_path):
    from symmerge.config.source import read_documents
    from symmerge.io.yaml_bounded import MAX_BYTES, MAX_DEPTH

    deep = tmp_path / "deep.yml"
    deep.write_text("a: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "\n")
    with pytest.raises(SymmergeError, match="nested more than"):
        read_documents(deep)
    deeper = tmp_path / "deeper.yml"  # past libyaml's own limit: still one error, no RecursionError
    deeper.write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(SymmergeError, match="deeper.yml line 1"):
        read_documents(deeper)
    big = tmp_path / "big.yml"
    big.write_text("models: []\n" + "# " + "x" * MAX_BYTES + "\n")
    with pytest.raises(SymmergeError, match="over 2 MiB"):
        read_documents(big)
    tag = tmp_path / "tag.yml"
    tag.write_text(f"models: !!python/object/apply:os.system ['touch {tmp_path}/PWNED']\n")
    with pytest.raises(SymmergeError, match="tag.yml line 1"):
        read_documents(tag)
    assert not (tmp_path / "PWNED").exists()
    recursive = tmp_path / "recursive.yml"
    recursive.write_text("a: &a [*a]\n")
    with pytest.raises(SymmergeError):
        read_documents(recursive)


def test_aliases_and_merge_keys_within_the_bounds_still_read(tmp_path):
    from symmerge.config.source import read_documents

    config = tmp_path / "ok.yml"
    config.write_text("common: &p {weight: 0.5, density: 0.3}\nmodels:\n  - model: a\n    parameters: *p\n"
                      "  - model: b\n    parameters:\n      <<: *p\n      weight: 0.7\nmerge_method: ties\n")
    (doc,) = read_documents(config)
    assert doc.data["models"][0]["parameters"] == {"weight": 0.5, "density": 0.3}
    assert doc.data["models"][1]["parameters"] == {"weight": 0.7, "density": 0.3}
    assert doc.line("models", 1, "parameters") == 6 and doc.line("models", 1, "parameters", "weight") == 8


# ------------------------------------------------------------------ 3. operating-system faults


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_full_disk_is_one_line(tmp_path, capsys, pair, monkeypatch, mode, when):
    """A disk too small for the output is refused before the work (the plan's output size against the free
    space); ENOSPC while the shards are written (the early check passed, as when another program fills the
    disk meanwhile) is one line too, with nothing left on the disk."""
    import symmerge.io.model
    import symmerge.merge.executor

    if when == "during":
        monkeypatch.setattr(symmerge.io.model, "check_free_space", lambda out, n: None)
        monkeypatch.setattr(symmerge.merge.executor, "check_free_space", lambda out, n: None)
    a, b = pair
    hashes = tree_hash(a, b)
    with small_tmpfs(tmp_path / "disk", "24k") as disk:
        out = disk / "out"
        rc, stdout, err = cli(capsys, "merge", a, b, "-o", out, "--method", "linear", "--mode", mode,
                              "--progress", "none")
        expected = "not enough free space" if when == "before" else "no space left on the device"
        assert_refused(rc, stdout, err, out, hashes, expected)
        assert list(disk.iterdir()) == []


def test_a_read_only_file_system_is_refused_before_the_work(tmp_path, capsys, pair):
    a, b = pair
    hashes = tree_hash(a, b)
    with small_tmpfs(tmp_path / "ro", "1m", readonly=True) as disk:
        rc, stdout, err = cli(capsys, "merge", a, b, "-o", disk / "out", "--method", "linear", "--progress", "none")
        assert_refused(rc, stdout, err, disk / "out", hashes, "read-only file system")


def _limit_file_size():
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_file_size_limit_is_one_line(tmp_path, pair, mode):
    """``ulimit -f``: the kernel refuses the write with EFBIG (Python ignores SIGXFSZ)."""
    a, b = pair
    hashes = tree_hash(a, b)
    out = tmp_path / "out"
    r = subprocess_cli("merge", a, b, "-o", out, "--method", "linear", "--mode", mode, "--progress", "none",
                       preexec_fn=_limit_file_size)
    assert_refused(r.returncode, r.stdout, r.stderr, out, hashes, "file too large")


def test_a_symlinked_output_is_refused_before_the_work(tmp_path, capsys, pair):
    a, b = pair
    target = tmp_path / "empty"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    hashes = tree_hash(a, b)
    t = time.perf_counter()
    rc, stdout, err = cli(capsys, "merge", a, b, "-o", link, "--method", "linear", "--progress", "none")
    assert time.perf_counter() - t < 5
    assert_refused(rc, stdout, err, target, hashes, "symbolic link")
    assert link.is_symlink() and list(target.iterdir()) == []


def test_a_second_run_on_the_same_output_fails_at_once(tmp_path, capsys, pair):
    """A first run holds the output (a real process that claimed it as a run does, at its start); a second
    run with the same -o fails within a second, naming the first, before any work; the first is unharmed."""
    a, b = pair
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom symmerge.io.model import ensure_output_dir\n"
         f"ensure_output_dir({str(out)!r}); print('claimed', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        hashes = tree_hash(a, b)
        t = time.perf_counter()
        rc, stdout, err = cli(capsys, "merge", a, b, "-o", out, "--method", "linear", "--progress", "none")
        assert time.perf_counter() - t < 1.0
        lines = error_lines(err)
        assert rc == 2 and len(lines) == 1 and "another symmerge run" in lines[0] and str(holder.pid) in lines[0]
        assert tree_hash(a, b) == hashes and not out.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert leftovers(tmp_path) == []  # the holder's lock file went with it
    rc, _, err = cli(capsys, "merge", a, b, "-o", out, "--method", "linear", "--progress", "none")
    assert rc == 0, err  # the output is free again
    assert leftovers(tmp_path) == []


def test_two_real_runs_race_for_one_output(tmp_path, pair):
    """Two real processes started together: one writes, the other fails in one line; never two outputs, never
    a traceback."""
    a, b = pair
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "symmerge.cli", "merge", str(a), str(b), "-o", str(out), "--method", "linear",
            "--progress", "none"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [(p.wait(timeout=180), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    assert len(error_lines(loser)) == 1 and "Traceback" not in loser
    assert (out / "model.safetensors").is_file() and leftovers(tmp_path) == []


SLOW_WRITE = """\
import signal, sys, time
# the signals at their defaults, as in a shell: under nohup (SIGHUP ignored, inherited through exec) symmerge rightly
# keeps ignoring SIGHUP, and the test would wait in vain
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
import symmerge.io.checkpoint as checkpoint, symmerge.io.model as model
def announce():
    print("WRITING", file=sys.stderr, flush=True)
    time.sleep(60)
add = checkpoint.PlannedWriter.add
def slow_add(self, name, tensor):  # streamed: the first tensor is in the shard, then a long pause
    add(self, name, tensor)
    announce()
checkpoint.PlannedWriter.add = slow_add
copy = model.copy_side_files
def slow_copy(*args, **kwargs):  # in memory: the weights are written in the temporary folder, then a pause
    announce()
    return copy(*args, **kwargs)
model.copy_side_files = slow_copy
from symmerge.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("mode, signum", [("memory", signal.SIGTERM), ("stream", signal.SIGTERM),
                                          ("stream", signal.SIGHUP)])
def test_sigterm_mid_write_leaves_nothing(tmp_path, pair, mode, signum):
    a, b = pair
    hashes = tree_hash(a, b)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, "merge", str(a), str(b), "-o", str(out), "--method",
                             "linear", "--mode", mode, "--progress", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stderr.readline()
        assert line.strip() == "WRITING", line + proc.stderr.read()
        partial = [p for p in tmp_path.iterdir() if ".symmerge-tmp-" in p.name]
        assert partial and any(partial[0].iterdir())  # a partial output exists at the moment of the signal
        proc.send_signal(signum)
        rc = proc.wait(timeout=60)
        stdout, err = proc.stdout.read(), proc.stderr.read()
    finally:
        proc.kill()
    assert_refused(rc, stdout, err, out, hashes, "terminated", signal.Signals(signum).name, code=128 + signum)


# ------------------------------------------------------------------ 4. the library raises SymmergeError


def test_the_library_raises_symmerge_errors_only(tmp_path, pair):
    a, b = pair
    listed = llama_folder(tmp_path / "listed", 2)
    (listed / "config.json").write_text("[1, 2, 3]")
    number = llama_folder(tmp_path / "number", 3)
    (number / "config.json").write_text("7")
    hashes = tree_hash(a, b)
    cases = [
        lambda: symmerge.MergeOptions(align="none"),  # was an AttributeError
        lambda: symmerge.merge([a, listed], tmp_path / "o1", method="linear"),
        lambda: symmerge.merge([a, number], tmp_path / "o2", method="linear"),
        lambda: symmerge.merge([a, b], tmp_path / "o3", method="linear", weights="ab"),
        lambda: symmerge.merge([a, b], tmp_path / "o4", method="linear", no_such_option=1),
        lambda: symmerge.merge([a, b], tmp_path / "link", method="linear"),
        lambda: symmerge.align_to_folder(a, b, tmp_path / "link"),
    ]
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    for i, case in enumerate(cases):
        try:
            case()
        except SymmergeError:
            pass
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {i}: {type(e).__name__}: {e}")
    assert tree_hash(a, b) == hashes
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5)) and leftovers(tmp_path) == []


def test_an_os_error_from_the_library_is_an_output_error(tmp_path, pair, monkeypatch):
    """An operating-system failure inside the library's writing entry is a SymmergeError subclass (and the
    claim on the output ends with the call)."""
    import errno

    import symmerge.io.card

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(symmerge.io.card, "write_card", full)
    a, b = pair
    with pytest.raises(OutputError, match="no space left"):
        symmerge.merge([a, b], tmp_path / "out", method="linear", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
