"""``LazyCheckpoint.read`` reads through the direct reads' path: each tensor at the byte offsets known since the
checkpoint was opened (its header parsed once, ``io.model.safetensors_headers``), no ``safe_open`` (which parsed the
header again at every call); NaN/Inf refused with the same message as ``read_direct``; a file cut short after the
checkpoint was opened one error line. Shown to fail before the change (the header counts)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from symmerge.errors import SymmergeError
from symmerge.io import checkpoint
from test_headers_read_once import _counted, sharded  # noqa: F401 - the fixture


def test_read_parses_no_header_again(sharded, monkeypatch):
    files = sorted(str(f) for f in sharded.glob("*.safetensors"))
    reads = _counted(monkeypatch)
    ck = checkpoint.LazyCheckpoint(sharded, spec=False)
    assert dict(reads) == dict.fromkeys(files, 1), reads
    for _ in range(3):  # a streamed align reads a layer's tensors at a time, every file again and again
        got = ck.read(ck.keys())
    assert dict(reads) == dict.fromkeys(files, 1), reads  # before: one more safe_open per file and call
    stored = {}
    for f in files:
        stored.update(load_file(f))
    assert list(got) == ck.keys()
    assert all(torch.equal(got[k], stored[ck.disk_name[k]]) for k in got)
    one = ck.keys()[3]
    assert torch.equal(ck.read([one])[one], ck.read_direct(one))


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_read_refuses_nan_as_read_direct_does(sharded, tmp_path):
    folder = _copy(sharded, tmp_path / "m")
    ck = checkpoint.LazyCheckpoint(folder, spec=False)
    key = "model.layers.0.mlp.up_proj.weight"
    f = ck.file_of[key]
    sd = load_file(str(f))
    sd[ck.disk_name[key]][1, 2] = float("nan")
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(SymmergeError) as direct:
        ck.read_direct(key)
    with pytest.raises(SymmergeError) as read:
        ck.read([key])
    assert str(read.value) == str(direct.value) and "NaN" in str(read.value) and ck.disk_name[key] in str(read.value)


def test_a_file_cut_short_after_opening_is_one_error_line(sharded, tmp_path):
    folder = _copy(sharded, tmp_path / "m")
    ck = checkpoint.LazyCheckpoint(folder, spec=False)
    f = ck.file_of[ck.keys()[0]]
    key = next(k for k in ck.keys() if ck.file_of[k] == f and checkpoint._offsets(f)[ck.disk_name[k]][1] ==
               f.stat().st_size)  # the file's last tensor
    data = f.read_bytes()
    for cut in (len(data) - 5, 60):  # the tensor's last bytes gone; the header itself cut
        f.write_bytes(data[:cut])
        with pytest.raises(SymmergeError) as e:
            ck.read([key])
        assert "\n" not in str(e.value) and str(f) in str(e.value)
        assert "truncated" in str(e.value), str(e.value)
