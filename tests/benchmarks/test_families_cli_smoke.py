"""Smoke test of ``python -m benchmarks.families_cli``: one family in one dtype through the five commands, every
row checked and printed, the rows written; and a row the checks must call a failure is called one."""

from __future__ import annotations

import json

from benchmarks import families_cli


def test_one_family_passes_every_check(tmp_path, capsys):
    assert families_cli.main(["--families", "gpt2", "--dtypes", "bfloat16", "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.strip().endswith("0 failing row(s)")
    rows = json.loads((tmp_path / "r.json").read_text())["bfloat16"]["gpt2"]
    assert set(rows) == {"align", "align --stream", "merge (memory)", "merge --mode stream", "run (mergekit config)"}
    assert all(r["dtypes"] == ["BF16"] and r["config_dtype"] == "bfloat16" for r in rows.values())
    assert rows["align"]["rel"] < 5e-2 and rows["merge (memory)"]["finite"]


def test_the_checks_can_fail():
    ok = {"dtypes": ["F32"], "config_dtype": "float32", "tensors": 3, "meta": ['{"format": "pt"}'], "loading": None,
          "transformers_said": None, "side_missing": None, "tokenizer_differs": None,
          "input": {"dtypes": ["F32"], "config_dtype": "float32", "tensors": 3}}
    assert families_cli.problems(ok) == []
    for change in ({"dtypes": ["BF16"]}, {"tensors": 4}, {"loading": {"missing_keys": ["x"]}}, {"meta": []},
                   {"side_missing": ["vocab.txt"]}, {"generation_config_same": False}, {"finite": False}):
        assert families_cli.problems({**ok, **change}), change
    assert families_cli.problems({"rc": 2, "error": "symmerge: error: x"})
