"""The tensor-name cache (``symmerge.io.names_cache``): a checkpoint read with a cached entry knows
exactly what one read without it knows (names, ties, class, base-model prefix, head counts) for every
family; the entry is keyed by the transformers version and the config; a damaged entry is rebuilt; and
a cached streamed merge imports no transformers modeling code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from factories import FAMILIES, make_model
from symmerge.io import names_cache
from symmerge.io.checkpoint import LazyCheckpoint


def _known(ckpt: LazyCheckpoint) -> tuple:
    return (ckpt.disk_name, ckpt.save_names, ckpt.ties, ckpt.class_name, ckpt.base_model_prefix, ckpt.heads,
            ckpt.shape, ckpt.dtype)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")])
def test_a_cached_read_knows_what_a_built_one_knows(family, tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMERGE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    make_model(family, head=True, dtype=torch.float32).save_pretrained(str(folder))
    built = LazyCheckpoint(folder, spec=False)
    assert len(list((tmp_path / "cache" / "names").glob("*.json"))) == 1
    cached = LazyCheckpoint(folder, spec=False)
    assert cached._hf_config is None  # nothing built: the facts came from the cache
    assert _known(cached) == _known(built)
    monkeypatch.setenv("SYMMERGE_NAME_CACHE", "0")
    assert _known(LazyCheckpoint(folder, spec=False)) == _known(built)


def test_mixtures_of_experts_are_not_cached(tmp_path, monkeypatch):
    """Their fused experts' split does not serialise: the model is built every time, with the same result."""
    monkeypatch.setenv("SYMMERGE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    make_model("mixtral", head=True, dtype=torch.float32).save_pretrained(str(folder))
    a = LazyCheckpoint(folder, spec=False, fused=True)
    b = LazyCheckpoint(folder, spec=False, fused=True)
    names = tmp_path / "cache" / "names"
    assert not names.exists() or not list(names.glob("*.json"))
    assert _known(a) == _known(b) and a.virtual.keys() == b.virtual.keys() and a.virtual


def test_the_key_follows_the_transformers_version_and_the_config(tmp_path, monkeypatch):
    config = {"model_type": "llama", "hidden_size": 32}
    key = names_cache._key(config, False)
    assert names_cache._key(dict(config, hidden_size=64), False) != key
    assert names_cache._key(config, True) != key
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "transformers" else real(name))
    names_cache._transformers_version.cache_clear()  # read once per process: a new process sees the new version
    try:
        assert names_cache._key(config, False) != key
    finally:
        names_cache._transformers_version.cache_clear()


def test_the_transformers_version_is_read_once_per_process(monkeypatch):
    import importlib.metadata

    real, calls = importlib.metadata.version, []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: calls.append(name) or real(name))
    names_cache._transformers_version.cache_clear()
    try:
        keys = {names_cache._key({"model_type": "llama", "hidden_size": h}, False) for h in (32, 64, 96)}
    finally:
        names_cache._transformers_version.cache_clear()
    assert len(keys) == 3 and calls == ["transformers"]


def test_a_damaged_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMERGE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    make_model("llama", head=True, dtype=torch.float32).save_pretrained(str(folder))
    built = LazyCheckpoint(folder, spec=False)
    (entry,) = (tmp_path / "cache" / "names").glob("*.json")
    for damage in ("{not json", json.dumps({"rename": {}})):
        entry.write_text(damage)
        again = LazyCheckpoint(folder, spec=False)
        assert _known(again) == _known(built)
        assert json.loads(entry.read_text()).keys() >= {"rename", "ties", "class", "prefix", "heads"}  # rewritten


def test_a_cached_plain_streamed_merge_imports_no_modeling_code(tmp_path):
    for i in range(2):
        make_model("llama", head=True, dtype=torch.float32, seed=i).save_pretrained(str(tmp_path / f"m{i}"))
    code = ("import sys, os\nfrom symmerge.cli import main\n"
            f"rc = main(['merge', {str(tmp_path / 'm0')!r}, {str(tmp_path / 'm1')!r}, '--method', 'average', "
            "'--align', 'none', '--mode', 'stream', '--progress', 'none', '-o', sys.argv[1]])\n"
            "print('RESULT', rc, any(m.startswith('transformers.models.llama.modeling') for m in sys.modules))\n")
    env = {**__import__("os").environ, "SYMMERGE_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code, str(tmp_path / f"out{i}")], capture_output=True, text=True,
                           env=env, check=True).stdout.split("RESULT")[-1].split() for i in range(2)]
    assert runs[0] == ["0", "True"]  # the first merge builds the weightless model
    assert runs[1] == ["0", "False"]  # the second one finds its facts in the cache
    assert (tmp_path / "out0" / "model.safetensors").read_bytes() == (tmp_path / "out1" / "model.safetensors").read_bytes()
