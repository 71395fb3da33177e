"""Smoke test of ``python -m benchmarks.yaml_bounds``: a config of the size asked for (never more), both loaders
measured, the bounded reader's values those of PyYAML's plain safe load (the benchmark stops otherwise)."""

from __future__ import annotations

import json

import yaml

from benchmarks import yaml_bounds


def test_config_text_is_the_size_asked_and_valid():
    for nbytes in (300, 4096, 20_000):
        text = yaml_bounds.config_text(nbytes)
        assert nbytes - 200 < len(text.encode()) <= nbytes
        value = yaml.safe_load(text)
        assert value["merge_method"] == "ties" and len(value["models"]) >= 2


def test_rows_for_both_loaders(tmp_path, capsys):
    out = tmp_path / "rows.json"
    result = yaml_bounds.main(["--sizes", "2048", "--repeat", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    loaders = [r["loader"] for r in result["rows"]]
    assert "SafeLoader" in loaders
    for r in result["rows"]:
        assert r["yaml_load_s"] > 0 and r["parse_bounded_s"] > 0 and r["ratio"] > 0
        assert r["depth_pass_used"] == (r["loader"] != "SafeLoader")  # the pure-Python loader bounds as it composes
    assert "ratio" in capsys.readouterr().out
