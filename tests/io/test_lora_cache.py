"""The LoRA merge cache (``--lora-merge-cache``: ``symmerge.io.lora.resolve_input``) as a user meets it: a merged model
whose weights were damaged is merged again, never reused; a merge another process is writing is waited for and reused
(two merges started together with one cache both succeed); a damaged one that cannot be removed is one line; a folder
merged by an earlier version (no digests) is reused and checked from then on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

from symmerge.errors import SymmergeError  # noqa: E402
from symmerge.io import lora  # noqa: E402
from symmerge.io.cache import DIGESTS  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from cache_helpers import hold_and_publish  # noqa: E402
from test_lora import make_adapter, make_base  # noqa: E402


@pytest.fixture()
def spec(tmp_path):
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "ad", r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"])
    return f"{base}+{adapter}"


@pytest.mark.parametrize("how", ["bytes", "header", "truncated"])
def test_a_damaged_merged_model_is_merged_again(how, spec, tmp_path, capsys):
    cache = tmp_path / "cache"
    folder = Path(lora.resolve_input(spec, cache))
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    assert (folder / DIGESTS).is_file()
    damaged = {"bytes": good[:-300] + b"\x11" * 300, "header": b"junk" * 64, "truncated": good[:len(good) // 2]}[how]
    weights.write_bytes(damaged)
    capsys.readouterr()
    assert Path(lora.resolve_input(spec, cache)) == folder
    assert weights.read_bytes() == good
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and str(weights) in notes[0] and "merging" in notes[0]


def test_a_folder_merged_by_an_earlier_version_is_reused_then_checked(spec, tmp_path, capsys):
    cache = tmp_path / "cache"
    folder = Path(lora.resolve_input(spec, cache))
    (folder / DIGESTS).unlink()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert Path(lora.resolve_input(spec, cache)) == folder and (folder / DIGESTS).is_file()
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]  # no lock file left beside it


def test_a_damaged_merged_model_that_cannot_be_removed_is_one_line(spec, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    folder = Path(lora.resolve_input(spec, cache))
    (folder / "model.safetensors").write_bytes(b"junk")

    def refuse(*_, **__):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(lora.shutil, "rmtree", refuse)
    with pytest.raises(SymmergeError, match="cannot replace this damaged merged model .*delete the folder") as info:
        lora.resolve_input(spec, cache)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)


def test_a_merge_another_process_is_writing_is_waited_for_and_reused(spec, tmp_path, capsys):
    first = Path(lora.resolve_input(spec, tmp_path / "one"))
    out = tmp_path / "two" / first.name
    out.parent.mkdir()
    holder = hold_and_publish(first, out)
    try:
        capsys.readouterr()
        assert Path(lora.resolve_input(spec, tmp_path / "two")) == out
    finally:
        holder.wait(timeout=60)
    assert holder.returncode == 0 and "another process is building" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()


_RESOLVE = """
import sys
from symmerge.io.lora import resolve_input
print(resolve_input(sys.argv[1], sys.argv[2]))
"""


def test_two_processes_merging_one_adapter_at_once_both_get_it(spec, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _RESOLVE, spec, str(tmp_path / "cache")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    assert len({o[0].strip().splitlines()[-1] for o in outs}) == 1
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_the_digests_of_a_cached_folder_are_no_side_file_of_an_output(spec, tmp_path):
    from symmerge.io.model import copy_side_files

    folder = Path(lora.resolve_input(spec, tmp_path / "cache"))
    (tmp_path / "out").mkdir()
    side = copy_side_files(folder, tmp_path / "out")
    assert DIGESTS not in side["left_out"] + side["copied"] and not (tmp_path / "out" / DIGESTS).exists()
