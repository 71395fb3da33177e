"""Direct I/O (``O_DIRECT``, :mod:`symmerge.io.direct`) on the streamed merge's reads and writes: the
same bytes as buffered I/O, whatever the alignment of the tensor, the buffer or the file's end; one
clear error on a truncated file; the streamed merge bit for bit the same with it on and off, and its
report saying which was used; ``auto`` reads directly only what is not in the page cache."""

from __future__ import annotations

import json
import os

import pytest
import torch

from symmerge.cli import main
from symmerge.errors import SymmergeError
from symmerge.io import direct
from symmerge.io.checkpoint import LazyCheckpoint, _offsets as direct_offsets

from test_stream_merge import llama, tensors


def _supported(folder) -> bool:
    probe = folder / "probe.bin"
    probe.write_bytes(b"x" * direct.BLOCK)
    return direct.supported(probe)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def checkpoint(tmp_path, request):
    """A real checkpoint whose tensors start and end at every kind of offset (an odd vocabulary: 509 rows)."""
    folder = tmp_path / "ckpt"
    llama(0, vocab=509).to(request.param).save_pretrained(str(folder))
    return folder, tensors(folder)


def test_direct_reads_equal_buffered_reads_at_every_alignment(checkpoint, monkeypatch):
    folder, ts = checkpoint
    if not _supported(folder):
        pytest.skip("this file system does not support O_DIRECT (buffered reads are used there)")
    ckpt = LazyCheckpoint(folder, spec=False)
    monkeypatch.setenv("SYMMERGE_DIRECT_IO", "on")
    assert {ckpt.disk_name[k] for k in ckpt.keys()} == set(ts)
    for key in ckpt.keys():
        t = ts[ckpt.disk_name[key]]
        room = ckpt.room(key)
        assert room == ckpt.nbytes(key) + direct.SLACK
        for shift in (0, 1, 64, 4095):  # the buffer's own misalignment
            buffer = torch.full((room + shift,), 0xAB, dtype=torch.uint8)[shift:]
            out = ckpt.read_direct(key, buffer=buffer)
            assert out.dtype == t.dtype and torch.equal(out, t), (key, shift)
            assert out.data_ptr() >= buffer.data_ptr() and \
                out.data_ptr() + ckpt.nbytes(key) <= buffer.data_ptr() + buffer.numel()  # a view of the buffer
    monkeypatch.setenv("SYMMERGE_DIRECT_IO", "off")
    assert ckpt.room(key) == ckpt.nbytes(key)


def test_direct_read_of_a_truncated_file_is_one_clear_error(checkpoint, monkeypatch):
    folder, _ = checkpoint
    if not _supported(folder):
        pytest.skip("this file system does not support O_DIRECT")
    ckpt = LazyCheckpoint(folder, spec=False)
    f = folder / "model.safetensors"
    last = max(ckpt.keys(), key=lambda k: direct_offsets(f)[ckpt.disk_name[k]][1])
    os.truncate(f, os.path.getsize(f) - 5)  # cuts into the last tensor
    monkeypatch.setenv("SYMMERGE_DIRECT_IO", "on")
    with pytest.raises(SymmergeError, match="truncated"):
        ckpt.read_direct(last, buffer=torch.empty(ckpt.room(last), dtype=torch.uint8))


def test_direct_read_refuses_nan(tmp_path, monkeypatch):
    m = llama(0, vocab=509)
    with torch.no_grad():
        m.model.embed_tokens.weight[123, 7] = float("nan")
    m.save_pretrained(str(tmp_path))
    if not _supported(tmp_path):
        pytest.skip("this file system does not support O_DIRECT")
    monkeypatch.setenv("SYMMERGE_DIRECT_IO", "on")
    ckpt = LazyCheckpoint(tmp_path, spec=False)
    key = "model.embed_tokens.weight"
    with pytest.raises(SymmergeError, match="NaN or Inf"):
        ckpt.read_direct(key, buffer=torch.empty(ckpt.room(key), dtype=torch.uint8))


@pytest.mark.parametrize("chunks", [[1], [4096], [5, 4091, 8192, 3], [direct.STAGING_BYTES + 7, 11], [0, 100]])
def test_direct_output_writes_exactly_the_bytes_given(tmp_path, chunks):
    data = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(chunks)]
    path = tmp_path / "out.bin"
    out = direct.Output(path, direct=True)
    for d in data:
        out.write(d)
    out.close()
    assert path.read_bytes() == b"".join(data)
    if _supported(tmp_path):
        assert out.direct


def test_mode_is_validated(monkeypatch):
    monkeypatch.setenv("SYMMERGE_DIRECT_IO", "sometimes")
    with pytest.raises(SymmergeError, match="SYMMERGE_DIRECT_IO"):
        direct.mode()


def test_auto_reads_directly_only_what_is_not_cached(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * direct.BLOCK))
    if not _supported(tmp_path):
        pytest.skip("this file system does not support O_DIRECT")
    path.read_bytes()
    assert direct.resident_fraction(path) > 0.9  # just written and read: cached
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if direct.resident_fraction(path) > 0.1:
        pytest.skip("the kernel kept the pages despite POSIX_FADV_DONTNEED")
    monkeypatch.setenv("SYMMERGE_DIRECT_IO", "auto")
    assert direct.reads_directly(path)
    monkeypatch.setenv("SYMMERGE_DIRECT_IO", "off")
    assert not direct.reads_directly(path)


@pytest.mark.parametrize("method,params", [("average", []), ("ties", ["--param", "density=0.3"])])
def test_streamed_merge_is_the_same_with_direct_io_on_and_off(tmp_path, capsys, monkeypatch, method, params):
    folders = []
    for i in range(3):
        m = llama(i, vocab=512)
        folders.append(tmp_path / f"m{i}")
        m.save_pretrained(str(folders[-1]), max_shard_size="60KB" if i == 1 else "1GB")  # one model sharded
    if not _supported(tmp_path):
        pytest.skip("this file system does not support O_DIRECT")
    base = ["--base", folders[0]] if method != "average" else []
    result, reports = {}, {}
    for mode in ("off", "on"):
        monkeypatch.setenv("SYMMERGE_DIRECT_IO", mode)
        out = tmp_path / f"out-{mode}"
        capsys.readouterr()
        rc = main([str(a) for a in ("merge", *folders[1:], "--method", method, *params, *base, "--align", "none",
                                    "--mode", "stream", "--progress", "none", "--shard-size", "70KB", "-o", out)])
        assert rc == 0, capsys.readouterr().err
        result[mode] = tensors(out)
        reports[mode] = json.loads((out / "symmerge_report.json").read_text())["stream"]["direct_io"]
        assert sorted(p.name for p in out.glob("*.safetensors*")) == \
            sorted(p.name for p in (tmp_path / "out-off").glob("*.safetensors*"))
    assert reports["off"] == {"reads": 0, "writes": False}
    assert reports["on"] == {"reads": 3 if base else 2, "writes": True}
    assert result["off"].keys() == result["on"].keys()
    for k, t in result["off"].items():
        assert torch.equal(t, result["on"][k]), k
