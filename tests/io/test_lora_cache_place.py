"""``--lora-merge-cache`` where the merged models would change an input (benchmarks/paths_audit.py found it): the
folder of an input (the adapter's own folder), or a folder inside one, was filled with merged models, exit 0; it is
refused in one line on merge, run and extract-lora, before anything is merged, every input left as it was; and one
inside the output."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

from symmerge.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_lora import make_adapter, make_base  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    base = make_base(root / "base")
    make_base(root / "other", seed=3)
    make_adapter(base, root / "ad", r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"])
    return root


def _argv(command, root, out, cache):
    spec = f"{root / 'base'}+{root / 'ad'}"
    if command == "merge":
        return ["merge", spec, root / "other", "--method", "average", "--align", "none", "-o", out,
                "--lora-merge-cache", cache]
    if command == "extract-lora":
        return ["extract-lora", spec, root / "other", "-o", out, "--rank", "2", "--lora-merge-cache", cache]
    if command == "run-own":  # a config of symmerge's own keys, the cache given on run's command line
        config = out.parent / "own.yml"
        config.write_text(f"method: average\nalign: none\nmodels: [{spec}, {root / 'other'}]\noutput: {out}\n")
        return ["run", config, "--lora-merge-cache", cache]
    config = out.parent / "merge.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {spec}\n    parameters: {{weight: 1}}\n"
                      f"  - model: {root / 'other'}\n    parameters: {{weight: 1}}\n")
    return ["run", config, out, "--lora-merge-cache", cache]


def refusal(capsys, argv) -> str:
    """The one error line of ``symmerge ARGV``, which must exit 2 without a traceback."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if " error: " in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", ["merge", "run", "run-own", "extract-lora"])
@pytest.mark.parametrize("where", ["ad", "other/cache", "base/sub/cache"])
def test_a_lora_merge_cache_in_an_input_folder_is_refused(inputs, tmp_path, capsys, command, where):
    before = tree(inputs)
    out = tmp_path / "out"
    line = refusal(capsys, _argv(command, inputs, out, inputs / where))
    assert "--lora-merge-cache" in line and "would change an input" in line, line
    assert tree(inputs) == before
    assert not out.exists()


@pytest.mark.parametrize("command", ["merge", "run", "run-own", "extract-lora"])
@pytest.mark.parametrize("where", ["out", "out/cache"])
def test_a_lora_merge_cache_in_the_output_is_refused_before_any_merge(inputs, tmp_path, capsys, command, where):
    """The cache inside the output was filled first, then the output refused as 'not an empty directory' after the
    merges, the cache left in its place."""
    out = tmp_path / "out"
    line = refusal(capsys, _argv(command, inputs, out, tmp_path / where))
    assert "--lora-merge-cache" in line and "output" in line, line
    assert not out.exists()


@pytest.mark.parametrize("where", ["other/cache", "base/sub/cache", "out", "out/cache"])
def test_run_refuses_the_same_places_without_an_adapter(inputs, tmp_path, capsys, where):
    """A config with no BASE+ADAPTER input ran with the cache inside an input or the output, exit 0 (merge and
    extract-lora refuse it whatever their inputs)."""
    config = tmp_path / "plain.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {inputs / 'base'}\n    parameters: {{weight: 1}}\n"
                      f"  - model: {inputs / 'other'}\n    parameters: {{weight: 1}}\n")
    before, out = tree(inputs), tmp_path / "out"
    cache = (tmp_path if where.startswith("out") else inputs) / where
    line = refusal(capsys, ["run", config, out, "--lora-merge-cache", cache])
    assert "--lora-merge-cache" in line, line
    assert tree(inputs) == before and not out.exists()


def test_a_base_and_an_adapter_with_long_names_are_merged(tmp_path, capsys):
    """Two folders of 150 characters (legal) made a cached merge's name of 314: 'file name too long'. A name that
    fits is kept as it was (earlier caches are found again)."""
    from symmerge.io.lora import cache_name

    base = make_base(tmp_path / ("b" * 150))
    adapter = make_adapter(base, tmp_path / ("é" * 75), r=2, lora_alpha=2, target_modules=["q_proj"])
    make_base(tmp_path / "other", seed=3)
    rc = main([str(a) for a in ["merge", f"{base}+{adapter}", tmp_path / "other", "--method", "average", "--align",
                                "none", "-o", tmp_path / "out", "--lora-merge-cache", tmp_path / "cache",
                                "--progress", "none"]])
    assert rc == 0, capsys.readouterr().err
    (entry,) = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert len(entry.encode()) <= 200 and entry.startswith("b" * 80 + "+" + "é" * 40 + "-")
    short = make_base(tmp_path / "base")
    assert cache_name(short, adapter).startswith(f"base+{adapter.name}-")
