"""docs/transcript.md shows what ``merge``, ``barrier`` and ``align`` (in memory and ``--stream``) print: the same
commands, run on tiny ViTs, print the same result lines (stdout; progress lines on stderr are timing-dependent and
not compared), with paths and figures read as placeholders. A line the transcript shows that is no longer printed,
or reads differently, fails here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import npz_file, vit_folder  # noqa: E402

TRANSCRIPT = Path(__file__).resolve().parents[2] / "docs" / "transcript.md"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def shape(line: str) -> str:
    """A printed line with every path (a word holding ``/``) as ``P`` and every number as ``N``."""
    words = ["P" if "/" in w else w for w in line.split()]
    return NUMBER.sub("N", " ".join(words))


def logs() -> dict[str, list[list[str]]]:
    """The recorded logs (code blocks ending in ``exit status``) of each ``## `` section, by the section's command."""
    sections: dict[str, list[list[str]]] = {}
    current, block, inside = None, [], False
    for line in TRANSCRIPT.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = line[3:].split("`")[1] if "`" in line else line[3:]
        elif line.startswith("```"):
            if inside and block and block[-1].startswith("exit status"):
                sections.setdefault(current, []).append(block)
            inside, block = not inside, []
        elif inside:
            block.append(line)
    return sections


def printed(block: list[str]) -> list[str]:
    """The stdout lines of a recorded log: not the progress lines (``[12.3 s] ...``), the notes and warnings (stderr,
    interleaved with stdout as the buffers flushed) nor the exit status."""
    return [shape(x) for x in block if x.strip() and not x.startswith(("[", "exit status", "note:", "warning:"))]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The transcript's commands on tiny ViTs (a ``train_report.json`` beside the weights, as the demo's trained
    folders have), from a working folder, with outputs named as the transcript names them."""
    import contextlib
    import io
    import os

    from symmerge.cli import main

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("transcript")
    for name, seed in (("A", 0), ("B", 1)):
        (vit_folder(root / name, seed) / "train_report.json").write_text("{}\n")
    npz_file(root / "train.npz", n=16), npz_file(root / "test.npz", n=12, seed=1)
    a, b, train, test = (str(root / x) for x in ("A", "B", "train.npz", "test.npz"))  # paths, as the transcript's
    commands = {
        "merge": ["merge", a, b, "--method", "fisher", "--data", train, "--max-examples", "8", "--eval-data", test,
                  "-o", "merged"],
        "barrier": ["barrier", a, b, "--data", test, "--points", "3", "-o", "study"],
        "align": ["align", a, b, "-o", "aligned"],
        "align --stream": ["align", a, b, "-o", "aligned-stream", "--stream"],
    }
    out = {}
    cwd = os.getcwd()
    os.chdir(root)
    try:
        for name, argv in commands.items():
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
                assert main([str(x) for x in argv] + ["--progress", "none"]) == 0, name
            out[name] = [shape(x) for x in stdout.getvalue().splitlines() if x.strip()]
    finally:
        os.chdir(cwd)
    return out


def test_the_transcript_has_the_logs_compared_here():
    sections = logs()
    assert [len(sections.get(k, [])) for k in ("merge", "barrier", "align")] == [1, 1, 2], sorted(sections)


@pytest.mark.parametrize("command, section, index", [
    ("merge", "merge", 0), ("barrier", "barrier", 0), ("align", "align", 0), ("align --stream", "align", 1)])
def test_every_result_line_of_the_transcript_is_printed_as_recorded(recorded, command, section, index):
    assert printed(logs()[section][index]) == recorded[command], \
        f"docs/transcript.md's `{command}` log no longer matches what the command prints"
