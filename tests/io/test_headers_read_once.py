"""A :class:`~symmerge.io.checkpoint.LazyCheckpoint` reads each safetensors file's header once: safetensors' own
``safe_open`` reads and checks it (a truncated file, a bad header, overlapping offsets: the one message of
``check_safetensors``), and the names, dtypes, shapes, metadata, the config's cross-check and the byte offsets of
the direct reads all come from that one read (``io.model.safetensors_headers``). Before, 3 reads per file at open
(``check_safetensors``' ``safe_open``, ``stored_shapes``, the ``safe_open`` loop) and a 4th at a file's first direct
read (``_offsets``). Shown to fail before the fix."""

from __future__ import annotations

import builtins
import collections
import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from symmerge.io import checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                         max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("sharded") / "m"
    LlamaForCausalLM(config).save_pretrained(str(folder), max_shard_size="8KB")
    return folder


def _counted(monkeypatch) -> collections.Counter:
    """Header reads per file from here on: ``safe_open`` calls, and the module's own parses (``json.loads`` of what
    it read from a file it opened)."""
    import safetensors

    reads, opened = collections.Counter(), []
    real_open = safetensors.safe_open

    def safe_open(f, *args, **kwargs):
        reads[str(f)] += 1
        return real_open(f, *args, **kwargs)

    def opening(f, *args, **kwargs):
        opened.append(str(f))
        return builtins.open(f, *args, **kwargs)

    def loads(text, *args, **kwargs):
        reads[opened[-1]] += 1
        return json.loads(text, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", safe_open)
    monkeypatch.setattr(checkpoint, "open", opening, raising=False)
    monkeypatch.setattr(checkpoint, "json", types.SimpleNamespace(loads=loads, dumps=json.dumps))
    monkeypatch.setattr(checkpoint, "_OFFSETS", {})  # no offsets left by an earlier test
    return reads


def test_each_header_is_read_once_to_open_and_read(sharded, monkeypatch):
    files = sorted(str(f) for f in sharded.glob("*.safetensors"))
    assert len(files) > 3
    reads = _counted(monkeypatch)
    ck = checkpoint.LazyCheckpoint(sharded, spec=False)
    assert dict(reads) == dict.fromkeys(files, 1), reads
    key = "model.layers.1.mlp.down_proj.weight"
    got = ck.read_direct(key)
    assert dict(reads) == dict.fromkeys(files, 1), reads
    stored = load_file(str(ck.file_of[key]))[ck.disk_name[key]]
    assert torch.equal(got, stored) and torch.equal(ck.map_direct(key), stored)
    assert torch.equal(ck.read_blocks(key, 3, 10, 4), checkpoint.blocks_of(stored, 3, 10, 4))


def _parsed(f) -> dict:
    """The byte ranges as the header says them (read here, independently)."""
    with open(f, "rb") as handle:
        n = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(n))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__"}


def test_the_offsets_from_the_one_read_are_the_header_s(tmp_path):
    """Mixed dtypes (largest first in the file), an empty tensor, a padded header, metadata: the ranges the direct
    reads use are the ones the header states, and each direct read gives the tensor stored."""
    folder = tmp_path / "m"
    folder.mkdir()
    torch.manual_seed(1)
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6, dtype=torch.int64),
               "d": torch.zeros(0, 4), "e": torch.tensor([True, False, True]), "f": torch.randn(2, 3).double(),
               "g": torch.randint(0, 9, (5,), dtype=torch.uint8)}
    f = folder / "model.safetensors"
    save_file(tensors, str(f), metadata={"format": "pt", "note": "x" * 13})
    headers = checkpoint.safetensors_headers([f])
    checkpoint._remember_offsets(f, headers[f])
    assert checkpoint._offsets(f) == _parsed(f)
    for k, t in tensors.items():
        start, end = checkpoint._offsets(f)[k]
        raw = torch.frombuffer(bytearray(f.read_bytes()[start:end]), dtype=torch.uint8) if end > start else None
        assert raw is None or torch.equal(raw.view(t.dtype).view(t.shape), t), k


def test_a_file_rewritten_after_open_is_read_from_its_new_header(sharded, tmp_path):
    """The offsets are kept under the file's size and modification time when it was read: a file rewritten since
    (another layout) is read again, as before."""
    import shutil

    copy = tmp_path / "m"
    shutil.copytree(sharded, copy)
    ck = checkpoint.LazyCheckpoint(copy, spec=False)
    key = "model.layers.0.self_attn.q_proj.weight"
    f = ck.file_of[key]
    sd = load_file(str(f))
    extra = {"aaa_pad": torch.zeros(3)}  # a new first tensor (by dtype, then name): every offset moves
    save_file({**extra, **sd}, str(f), metadata={"format": "pt"})
    assert torch.equal(ck.read_direct(key), sd[ck.disk_name[key]])


def test_a_safetensors_without_offset_keys_reads_the_offsets_at_the_first_direct_read(sharded, monkeypatch):
    """A safetensors without ``offset_keys`` (added in 2025; ``pyproject`` asks 0.4 or later): the offsets are not
    derived at open; a file's first direct read parses its header for them, as before (one more read of that file,
    none of the others)."""
    import safetensors

    class Older:
        def __init__(self, opener, *args, **kwargs):
            self._handle = opener(*args, **kwargs)

        def __enter__(self):
            self._inside = self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def __getattr__(self, name):
            if name == "offset_keys":
                raise AttributeError(name)
            return getattr(self._inside, name)

    reads = _counted(monkeypatch)
    counting = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: Older(counting, *a, **k))
    ck = checkpoint.LazyCheckpoint(sharded, spec=False)
    files = sorted(str(f) for f in sharded.glob("*.safetensors"))
    assert dict(reads) == dict.fromkeys(files, 1), reads
    key = "model.layers.1.mlp.down_proj.weight"
    got = ck.read_direct(key)
    assert torch.equal(got, load_file(str(ck.file_of[key]))[ck.disk_name[key]])
    assert reads[str(ck.file_of[key])] == 2 and sum(reads.values()) == len(files) + 1, reads
