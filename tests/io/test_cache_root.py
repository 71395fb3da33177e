"""The one cache root (``symmerge.io.cache``: ``$SYMMERGE_CACHE``, else ``~/.cache/symmerge``) as every part of
symmerge finds it, and the tensor-name cache (``symmerge.io.names_cache``) as a user meets it: a malformed entry, no
home folder, a root that is a file, two processes writing one entry at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from symmerge.demo import assets
from symmerge.errors import SymmergeError
from symmerge.io import cache, names_cache

FACTS = {"rename": {}, "ties": {}, "class": "LlamaForCausalLM", "prefix": "model", "heads": 4, "shapes": {},
         "tensors": {}, "parts": {}}


def _no_home(monkeypatch):
    def fail(*_):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(fail))


def test_one_variable_names_the_root_of_every_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("SYMMERGE_CACHE_DIR", raising=False)  # the tests' hook for the name cache alone
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path))
    assert cache.cache_root() == tmp_path == assets.cache_dir()
    assert names_cache.cache_dir() == tmp_path / "names"
    names_cache.facts({"model_type": "llama", "hidden_size": 8}, False, lambda: dict(FACTS))
    assert len(list((tmp_path / "names").glob("*.json"))) == 1


def test_the_default_root_is_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv("SYMMERGE_CACHE", raising=False)
    monkeypatch.delenv("SYMMERGE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.cache_root() == tmp_path / ".cache" / "symmerge"
    assert names_cache.cache_dir() == tmp_path / ".cache" / "symmerge" / "names"


def test_without_a_home_folder_the_root_is_one_line_and_the_name_cache_is_off(monkeypatch):
    monkeypatch.delenv("SYMMERGE_CACHE", raising=False)
    monkeypatch.delenv("SYMMERGE_CACHE_DIR", raising=False)
    _no_home(monkeypatch)
    with pytest.raises(SymmergeError, match="set SYMMERGE_CACHE"):
        cache.cache_root()
    assert names_cache.cache_dir() is None
    got = names_cache.facts({"model_type": "llama", "hidden_size": 8}, False, lambda: dict(FACTS))
    assert got["cached"] is False and got["class"] == "LlamaForCausalLM"


@pytest.mark.parametrize("junk", ["5", "null", "[]", '"text"', "", "{\"rename\": {}"])
def test_a_malformed_entry_is_rebuilt_and_rewritten(junk, tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMERGE_CACHE_DIR", str(tmp_path))
    config = {"model_type": "llama", "hidden_size": 8}
    names_cache.facts(config, False, lambda: dict(FACTS))
    (entry,) = (tmp_path / "names").glob("*.json")
    entry.write_text(junk)
    got = names_cache.facts(config, False, lambda: dict(FACTS))
    assert got["cached"] is False and got["class"] == "LlamaForCausalLM"
    assert json.loads(entry.read_text())["class"] == "LlamaForCausalLM"


def test_a_root_that_is_a_file_is_no_cache(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("SYMMERGE_CACHE_DIR", str(tmp_path / "file"))
    config = {"model_type": "llama", "hidden_size": 8}
    for _ in range(2):
        assert names_cache.facts(config, False, lambda: dict(FACTS))["cached"] is False
    assert (tmp_path / "file").read_text() == "x"


def test_an_entry_that_cannot_be_written_is_still_read(tmp_path, monkeypatch):
    """A read-only cache that holds the entry: read; writing a new one fails quietly (no cache)."""
    monkeypatch.setenv("SYMMERGE_CACHE_DIR", str(tmp_path))
    config = {"model_type": "llama", "hidden_size": 8}
    names_cache.facts(config, False, lambda: dict(FACTS))

    def refuse(*_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(names_cache.os, "replace", refuse)
    assert names_cache.facts(config, False, lambda: dict(FACTS))["cached"] is True
    assert names_cache.facts(dict(config, hidden_size=16), False, lambda: dict(FACTS))["cached"] is False
    assert not [p for p in (tmp_path / "names").iterdir() if p.name.endswith(".tmp")]


_WRITER = """
import json, sys
from symmerge.io import names_cache
facts = {"rename": {f"n{i}": f"m{i}" for i in range(2000)}, "ties": {}, "class": sys.argv[1], "prefix": "model",
         "heads": 4, "shapes": {}, "tensors": {}}
for _ in range(200):
    names_cache.write_entry("shared.json", facts)
    entry = names_cache.read_entry("shared.json")
    assert entry is not None and len(entry["rename"]) == 2000, entry
print("ok")
"""


def test_two_processes_writing_one_entry_never_leave_half_of_it(tmp_path):
    env = {"SYMMERGE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, name], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("A", "B")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1000:] for o in outs]
    assert json.loads((tmp_path / "names" / "shared.json").read_text())["class"] in ("A", "B")
    assert sorted(p.name for p in (tmp_path / "names").iterdir()) == ["shared.json"]


_COUNTER = """
import sys
from pathlib import Path
from symmerge.io.cache import build_lock
out = Path(sys.argv[1])
for _ in range(40):
    with build_lock(out, say=lambda text: None):
        count = out.parent / "count"
        n = int(count.read_text()) if count.exists() else 0
        count.write_text(str(n + 1))
"""


def test_the_build_lock_excludes_other_processes_and_leaves_no_file(tmp_path):
    """Three processes each add 1 to a counter 40 times under the lock of one entry: 120, none lost (the lock file is
    removed at each release while held: a process that waited on the removed file takes the lock again on a new
    one), and no lock file is left."""
    procs = [subprocess.Popen([sys.executable, "-c", _COUNTER, str(tmp_path / "entry")], stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-1000:] for e in errs]
    assert (tmp_path / "count").read_text() == "120"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["count"]


def test_the_build_lock_of_an_unwritable_folder_is_no_lock(tmp_path):
    (tmp_path / "file").write_text("x")
    with cache.build_lock(tmp_path / "file" / "entry"):
        pass
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("home", ["", "relative/home"])
def test_an_empty_or_relative_home_is_one_line_not_a_cache_in_the_root_folder(home, monkeypatch):
    monkeypatch.delenv("SYMMERGE_CACHE", raising=False)
    monkeypatch.delenv("SYMMERGE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", home)
    with pytest.raises(SymmergeError, match="HOME is .*set SYMMERGE_CACHE"):
        cache.cache_root()
    assert names_cache.cache_dir() is None


def test_a_root_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path / "file"))
    with pytest.raises(SymmergeError, match="is a file, not a folder; set SYMMERGE_CACHE"):
        assets.cache_dir()


def test_digests_above_the_hashed_size_are_sizes_checked_by_size(tmp_path, monkeypatch):
    """A folder of more than HASHED bytes records sizes only (no hour of hashing a large merged model): a changed
    size is damage, changed bytes of the same size are not seen (docs/results/cache_audit.md says so)."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(cache, "HASHED", 10)
    assert cache.record_digests(tmp_path)
    assert json.loads((tmp_path / cache.DIGESTS).read_text())["model.safetensors"].keys() == {"size"}
    assert cache.damage(tmp_path) is None
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-4] + b"\x11" * 4)
    assert cache.damage(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(data + b"\x00")
    assert str(tmp_path / "model.safetensors") in (cache.damage(tmp_path) or "")
