"""``symmerge barrier``'s final line names every file it wrote (``subsets.png`` with ``--subsets``)."""

from __future__ import annotations

import pytest

from conftest import npz_file, run_cli, vit_folder


@pytest.mark.parametrize("subsets", [None, "single"])
def test_the_final_line_lists_every_file_written(tmp_path, subsets, capsys):
    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (str(vit_folder(tmp_path / f"v{s}", s)) for s in range(2))
    out = tmp_path / "out"
    extra = ["--subsets", subsets] if subsets else []
    assert run_cli("barrier", a, b, "--data", npz, "--align", "attn,ffn", "--points", "3", "--progress", "none",
                   *extra, "-o", out) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(["barrier.json", "barrier.png"] + (["subsets.png"] if subsets else []))
    for name in written:
        assert str(out / name) in last, (name, last)
