"""A config with thousands of ignored keys stays readable: warnings were checked for repeats in a list (60 000 keys:
159 s) and every one printed, and an error named every ignored key in its one line (2.3 MB). Now 50 warning lines and
a count (the report keeps them all), and an error names the first 10 and counts the rest."""

from __future__ import annotations

import json

import torch

from conftest import run_cli
from factories import make_model

KEYS = 300


def _config(tmp_path, folder) -> str:
    extra = "".join(f"k{i}: 1\n" for i in range(KEYS))
    return f"models:\n  - model: {folder}\n    parameters: {{weight: 1.0}}\nmerge_method: linear\n{extra}"


def test_warnings_are_capped_on_stderr_and_kept_in_the_report(tmp_path, capsys):
    make_model("llama", head=True, dtype=torch.float32, seed=0).save_pretrained(tmp_path / "a")
    (tmp_path / "c.yml").write_text(_config(tmp_path, tmp_path / "a"))
    capsys.readouterr()
    assert run_cli("run", tmp_path / "c.yml", tmp_path / "out", "-q") == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("symmerge: warning: ")]
    assert len(warnings) == 51 and warnings[-1].startswith(f"symmerge: warning: and {KEYS - 50} more"), warnings[-1]
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert len(report["config"]["warnings"]) == KEYS


def test_an_error_names_ten_ignored_keys_and_counts_the_rest(tmp_path, capsys):
    (tmp_path / "c.yml").write_text(_config(tmp_path, tmp_path / "missing"))
    assert run_cli("run", tmp_path / "c.yml", tmp_path / "out", "-q") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "k9: not a mergekit key" in err and "k10:" not in err
    assert err.rstrip().endswith(f"and {KEYS - 10} more")
