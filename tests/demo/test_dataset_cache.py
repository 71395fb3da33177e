"""The image data sets kept in the cache (``symmerge.demo.datasets``, ``symmerge.demo.debian``) as a user meets them:
a damaged gzip stream in a cached IDX file is one line naming the file and the folder to delete (it was zlib.error's
traceback); a fetch another process is making is waited for and used, not fetched again."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from cache_helpers import hold_and_publish
from symmerge.demo import datasets, debian
from symmerge.errors import SymmergeError
from test_datasets_train import fake_fashion


def _cached_fashion(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "FASHION_SYSTEM_DIR", tmp_path / "nowhere")
    folder = tmp_path / "cache" / "fashion-mnist" / "usr" / "share" / "datasets" / "fashion-mnist"
    fake_fashion(folder)
    return folder


@pytest.mark.parametrize("damage", ["stream", "truncated", "junk"])
def test_a_damaged_cached_idx_file_is_one_line_naming_what_to_delete(damage, tmp_path, monkeypatch):
    folder = _cached_fashion(tmp_path, monkeypatch)
    path = folder / datasets.FASHION_FILES["test"][0]
    good = path.read_bytes()
    path.write_bytes({"stream": good[:12] + bytes(range(40)) + good[52:], "truncated": good[: len(good) // 2],
                      "junk": b"junk" * 10}[damage])
    with pytest.raises(SymmergeError) as info:
        datasets.fashion_mnist("test", fetch=False)
    text = str(info.value)
    assert "\n" not in text and str(path) in text and f"delete {tmp_path / 'cache' / 'fashion-mnist'}" in text


def test_a_damaged_gzip_stream_in_the_mnist_csv_is_one_line():
    good = gzip.compress(b"1,2\n" * 100)
    with pytest.raises(SymmergeError, match="MNIST csv: cannot decompress"):
        datasets.read_mnist_csv(good[:12] + bytes(range(40)) + good[52:])


def test_a_fetch_another_process_is_making_is_waited_for(tmp_path, monkeypatch):
    """The holder publishes the unpacked package while holding the fetch's lock; this process, finding no data at
    first, waits for it and uses it instead of fetching it again."""
    src = tmp_path / "made"
    fake_fashion(src / "usr" / "share" / "datasets" / "fashion-mnist")
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "FASHION_SYSTEM_DIR", tmp_path / "nowhere")
    monkeypatch.setattr(debian, "fetch_deb", lambda *a: pytest.fail("fetched again"))
    (tmp_path / "cache").mkdir()
    holder = hold_and_publish(src, tmp_path / "cache" / "fashion-mnist")
    try:
        x, y = datasets.fashion_mnist("test", fetch=True)
    finally:
        holder.wait(timeout=60)
    assert holder.returncode == 0 and x.shape[1:] == (28, 28) and len(x) == len(y)
    assert np.array_equal(datasets.fashion_mnist("test", fetch=False)[1], y)


def _fake_tools(tmp_path, monkeypatch, dpkg: str):
    """``apt-get download`` that writes a .deb, and ``dpkg`` running the shell line ``dpkg``, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text('#!/bin/sh\ntouch "pkg_1.0_all.deb"\n')
    (bin_dir / "dpkg").write_text(f"#!/bin/sh\n{dpkg}\n")
    for tool in ("apt-get", "dpkg"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_a_package_dpkg_cannot_unpack_is_one_line(tmp_path, monkeypatch):
    """``dpkg -x`` failing was subprocess's CalledProcessError and its traceback."""
    _fake_tools(tmp_path, monkeypatch, 'echo "dpkg-deb: error: archive has premature member" >&2; exit 2')
    root = tmp_path / "cache" / "pkg"
    with pytest.raises(SymmergeError) as info:
        debian.fetch_deb("pkg", root, lambda unpacked: True, "install pkg")
    text = str(info.value)
    assert "\n" not in text and "dpkg -x" in text and "premature member" in text and "install pkg" in text
    assert not root.exists() and list((tmp_path / "cache").iterdir()) == []


def test_an_earlier_fetch_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch):
    """An interrupted earlier fetch that cannot be removed (a folder of another user): one line naming it (it was
    rmtree's PermissionError); nothing is left in a temporary folder."""
    from symmerge.io import cache

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    _fake_tools(tmp_path, monkeypatch, 'mkdir -p "$3/data"')
    root = tmp_path / "cache" / "pkg"
    (root / "old").mkdir(parents=True)
    monkeypatch.setattr(cache, "shutil", type("S", (), {"rmtree": staticmethod(refuse)}))
    with pytest.raises(SymmergeError) as info:
        debian.fetch_deb("pkg", root, lambda unpacked: (unpacked / "data").is_dir(), "install pkg")
    text = str(info.value)
    assert "\n" not in text and str(root) in text and "cannot replace this unpacked package folder" in text
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["pkg"]
