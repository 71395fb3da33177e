"""The cache of trained demo models (``symmerge.demo.train.cached_build``, used by ``train_vit`` and ``train_lm``) as a
user meets it: damaged weights are trained again, never reused; an entry another process is building is waited for
and reused; a damaged entry that cannot be removed is one line; the entries of earlier versions (no digests) are
reused as they are, and nothing is written into them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cache_helpers import hold_and_publish
from symmerge.demo.train import TrainSettings, train_vit, vit_config
from symmerge.errors import SymmergeError
from symmerge.io.cache import DIGESTS

CONFIG = dict(hidden=16, layers=1, heads=2, intermediate=32, patch=4, image_size=8, num_labels=4)
SETTINGS = TrainSettings(steps=5, batch_size=16, seed=0)


def _data():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (64, 8, 8), dtype=np.uint8), rng.integers(0, 4, 64).astype(np.int64)


def _train(root, logs=None):
    x, y = _data()
    return train_vit(vit_config(**CONFIG), x, y, SETTINGS, name="t", root=root, progress=False,
                     log=(logs.append if logs is not None else lambda *_: None))


@pytest.mark.parametrize("how", ["bytes", "header", "empty"])
def test_damaged_weights_are_trained_again_not_reused(how, tmp_path):
    folder = _train(tmp_path)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    assert json.loads((folder / DIGESTS).read_text()).keys() == {"model.safetensors"}
    if how == "bytes":  # the header intact, some weights changed: it still loads
        with open(weights, "r+b") as f:
            f.seek(len(good) - 400)
            f.write(b"\x11" * 200)
    elif how == "header":
        weights.write_bytes(b"junk" * 100)
    else:
        weights.write_bytes(b"")
    logs = []
    assert _train(tmp_path, logs) == folder
    assert weights.read_bytes() == good  # the same deterministic training, again
    assert any(line.startswith("note: ") and str(weights) in line and "training t again" in line for line in logs)
    assert not any("reusing" in line for line in logs)


def test_an_entry_of_an_earlier_version_is_reused_and_checked_from_then_on(tmp_path, monkeypatch):
    folder = _train(tmp_path)
    (folder / DIGESTS).unlink()
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    logs = []
    assert _train(tmp_path, logs) == folder and "reusing" in logs[-1]
    assert weights.stat().st_mtime_ns == stamp and (folder / DIGESTS).is_file()  # digests of it as it is now
    good = weights.read_bytes()
    weights.write_bytes(good[:-8] + b"\x11" * 8)
    logs = []
    assert _train(tmp_path, logs) == folder and weights.read_bytes() == good and "training t again" in logs[-2]
    # a read-only cache: the entry without digests is still reused
    (folder / DIGESTS).unlink()
    monkeypatch.setattr("symmerge.io.cache.os.replace", lambda *a: (_ for _ in ()).throw(PermissionError(13, "no")))
    assert _train(tmp_path, logs) == folder and "reusing" in logs[-1] and not (folder / DIGESTS).exists()


def test_a_damaged_entry_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch):
    folder = _train(tmp_path)
    (folder / "model.safetensors").write_bytes(b"junk")

    def refuse(*_, **__):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(shutil, "rmtree", refuse)  # the one remover of entries (io.cache.remove_entry)
    with pytest.raises(SymmergeError, match="cannot replace this cached model .*delete the folder") as info:
        _train(tmp_path)
    assert "\n" not in str(info.value) and str(folder) in str(info.value)


def test_a_model_another_process_is_building_is_waited_for_and_reused(tmp_path):
    first = _train(tmp_path / "one")
    out = tmp_path / "two" / first.name
    out.parent.mkdir()
    holder = hold_and_publish(first, out)
    try:
        logs = []
        assert _train(tmp_path / "two", logs) == out
    finally:
        holder.wait(timeout=60)
    assert holder.returncode == 0
    assert any("another process is building" in line for line in logs) and "reusing" in logs[-1]
    assert (out / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()


_TRAINER = """
import sys
import numpy as np
from pathlib import Path
from symmerge.demo.train import TrainSettings, train_vit, vit_config
rng = np.random.default_rng(0)
x, y = rng.integers(0, 256, (64, 8, 8), dtype=np.uint8), rng.integers(0, 4, 64).astype(np.int64)
config = vit_config(hidden=16, layers=1, heads=2, intermediate=32, patch=4, image_size=8, num_labels=4)
print(train_vit(config, x, y, TrainSettings(steps=300, batch_size=16, seed=0), name="t", root=Path(sys.argv[1]),
                progress=False))
"""


def test_two_processes_training_one_model_at_once_both_get_it(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _TRAINER, str(tmp_path / "root")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    folders = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(folders) == 1
    assert sum("reusing" in o[0] for o in outs) == 1  # one trained it, the other waited and reused it
    (folder,) = folders
    assert not [p for p in (tmp_path / "root").iterdir() if p.name.startswith(".t-") and "tmp" in p.name]
    shutil.rmtree(folder)
