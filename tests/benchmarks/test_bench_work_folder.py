"""``--work DIR`` of ``benchmarks/bench_configs.py`` and ``benchmarks/bench_startup.py``: a folder that does not exist
yet is made (it was a FileNotFoundError traceback from ``tempfile``), the run's temporary folder goes inside it and
is removed after; a path that is a file is one clear error. The rows themselves are stood in for (their
measurements are the slow smoke tests' business: ``test_bench_configs_smoke.py``, ``test_bench_startup_smoke.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import bench_configs, bench_startup


def _configs_args(work) -> argparse.Namespace:
    return argparse.Namespace(configs="absa-ties-lambda", sizes="tiny", symmerge="symmerge", mergekit_bin="/nowhere",
                              work=str(work), json=None)


def test_bench_configs_makes_a_missing_work_folder(tmp_path, monkeypatch):
    work = tmp_path / "not" / "yet"
    seen = []

    def row(name, size, i, args, folder, *rest):
        seen.append(Path(folder))
        assert Path(folder).is_dir() and Path(folder).parent == work
        return {"config": name[:-4], "size": size}

    monkeypatch.setattr(bench_configs, "one_row", row)
    monkeypatch.setattr(bench_configs, "print_row", lambda r, log=print: None)
    result = bench_configs.run(_configs_args(work))
    assert [r["config"] for r in result["rows"]] == ["absa-ties-lambda"] and len(seen) == 1
    assert work.is_dir() and not list(work.iterdir())  # its temporary folder removed after the run


def test_bench_startup_makes_a_missing_work_folder(tmp_path, monkeypatch):
    work = tmp_path / "deeper" / "work"
    seen = []

    def rows(args, tools, folder):
        seen.append(Path(folder))
        assert Path(folder).is_dir() and Path(folder).parent == work
        return []

    monkeypatch.setattr(bench_startup, "_rows", rows)
    args = argparse.Namespace(symmerge="symmerge", before=None, mergekit_bin="/nowhere", configs="x", repeat=1,
                              work=str(work), json=None)
    assert bench_startup.run(args)["rows"] == [] and len(seen) == 1
    assert work.is_dir() and not list(work.iterdir())


@pytest.mark.parametrize("module", [bench_configs, bench_startup])
def test_a_work_path_that_is_a_file_is_one_clear_error(tmp_path, module, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as e:
        module.main(["--work", str(tmp_path / "file"), "--configs", "absa-ties-lambda"])
    assert str(e.value) == f"--work {tmp_path / 'file'}: not a folder"
