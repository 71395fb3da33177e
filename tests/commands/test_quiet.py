"""``-q`` / ``--quiet`` on every command that shows progress: ``--progress none`` (align, merge, barrier, demo and
extract-lora had no such flag — ``symmerge align ... -q`` was "unrecognized arguments" — and extract-lora accepted
mergekit's ``--quiet`` as a no-op that kept its progress lines); run and moe took mergekit's ``--quiet`` only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factories import make_model
from symmerge.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("quiet")
    for name, seed in (("a", 0), ("b", 5)):
        make_model("llama", dtype=torch.float32, seed=seed).save_pretrained(root / name)
    return str(root / "a"), str(root / "b")


def _commands(a, b, out):
    config = Path(out + ".yml")
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
                      f"  - model: {b}\n    parameters: {{weight: 0.5}}\n")
    return {"run": ["run", str(config), out],
            "align": ["align", a, b, "-o", out],
            "align --stream": ["align", a, b, "-o", out, "--stream"],
            "merge": ["merge", a, b, "--method", "average", "-o", out],
            "extract-lora": ["extract-lora", a, b, "-o", out, "--rank", "2"]}


@pytest.mark.parametrize("name", ["align", "align --stream", "merge", "extract-lora", "run"])
def test_quiet_shows_no_progress(pair, tmp_path, capfd, name):
    line = _commands(*pair, str(tmp_path / "lines"))[name]
    assert main([*line, "--progress", "lines"]) == 0
    shown = capfd.readouterr().err
    assert "[" in shown and " s]" in shown, shown  # the progress lines, "[0.0 s] stage ..."
    for flag in ("-q", "--quiet"):
        quiet = _commands(*pair, str(tmp_path / flag.strip("-")))[name]
        assert main([*quiet, flag]) == 0
        err = capfd.readouterr().err
        assert " s] " not in err and "it/s" not in err, err


@pytest.mark.parametrize("name", ["align", "run"])
def test_quiet_beside_another_progress_mode_is_one_error(pair, tmp_path, capsys, name):
    """run (and moe) read mergekit's --quiet themselves, and it won over --progress lines in silence."""
    line = _commands(*pair, str(tmp_path / "o"))[name]
    with pytest.raises(SystemExit) as e:
        main([*line, "-q", "--progress", "bar"])
    assert e.value.code == 2
    assert "--quiet and --progress bar: give one" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main([*line, "-q", "--progress", "none"]) == 0
