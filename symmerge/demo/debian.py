"""Data shipped in Debian packages: the installed package's folder, else the package fetched with
``apt-get download`` and unpacked into the cache (Fashion-MNIST, the Python docs corpus)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import SymmergeError
from .assets import cache_dir
from ..io.cache import build_lock, remove_entry


def deb_data_dir(package: str, system_dir: Path, inner: str, name: str, has, label: str, how: str,
                 fetch: bool) -> Path:
    """The data folder ``system_dir`` of the Debian package ``package`` when it is installed (``has``
    tells), else the package's folder ``inner`` unpacked below ``<cache>/name`` — fetched there with
    :func:`fetch_deb` first when ``fetch``; ``label`` and ``how`` word the error."""
    if has(system_dir):
        return system_dir
    root = cache_dir() / name
    if has(root / inner):
        return root / inner
    if not fetch:
        raise SymmergeError(f"{label} is not available; {how}")
    with build_lock(root):  # another process fetching it: wait, then use what it unpacked
        if not has(root / inner):
            fetch_deb(package, root, lambda unpacked: has(unpacked / inner), how)
    return root / inner


def fetch_deb(package: str, root: Path, check, how: str) -> None:
    """``apt-get download PACKAGE`` and ``dpkg -x`` it into ``root`` (replaced only once complete);
    ``check(unpacked folder)`` says whether the package holds the expected files; ``how``: what the
    user can do instead, for the error messages."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise SymmergeError(f"the data come from the Debian package {package}, but apt-get/dpkg are not "
                            f"available here; {how}")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{root.name}-", dir=root.parent) as tmp:
        got = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
        debs = sorted(Path(tmp).glob(f"{package}_*.deb"))
        if got.returncode != 0 or not debs:
            detail = (got.stderr or got.stdout).strip().splitlines()[-1:] or ["no .deb"]
            raise SymmergeError(f"could not fetch `apt-get download {package}` ({detail[0]}); {how}")
        unpacked = Path(tmp) / "root"
        got = subprocess.run(["dpkg", "-x", str(debs[-1]), str(unpacked)], capture_output=True, text=True)
        if got.returncode != 0:
            detail = (got.stderr or got.stdout).strip().splitlines()[-1:] or [f"exit status {got.returncode}"]
            raise SymmergeError(f"could not unpack {debs[-1].name} with `dpkg -x` ({detail[0]}); {how}")
        if not check(unpacked):
            raise SymmergeError(f"{debs[-1].name}: the package does not hold the expected files")
        remove_entry(root, "unpacked package folder")  # an interrupted earlier fetch
        os.replace(unpacked, root)
