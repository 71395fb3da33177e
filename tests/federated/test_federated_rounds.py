"""benchmarks.federated_rounds' drivers: clients trained in worker processes (``--workers``) or with a
``device`` give the same rounds as the in-process CPU loop (the fedvit app's synthetic data, a tiny ViT)."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("flwr")

from benchmarks import federated_rounds as fr  # noqa: E402
from benchmarks.bench_federated import EXAMPLE  # noqa: E402

CFG = {"dataset": "synthetic", "hidden": 16, "layers": 1, "heads": 2, "local-steps": 3, "batch-size": 16,
       "examples-per-client": 64, "test-examples": 64}


@pytest.fixture(scope="module")
def task():
    sys.path.insert(0, str(EXAMPLE))
    from fedvit import task

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: the same arithmetic
    yield task
    torch.set_num_threads(threads)


def _rounds(task, cfg, **kw):
    fr.TRAINED.clear()  # no reuse between the compared runs
    test = task.load_test(cfg)
    return fr.run_one(task, cfg, "flip", "mean", 2, 3, test, log=lambda *a, **k: None, **kw)


def test_workers_and_device_give_the_in_process_rounds(task, tmp_path):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    cfg = task.settings(CFG)
    base = _rounds(task, cfg)
    on_cpu = _rounds(task, cfg, device="cpu", partial=tmp_path / "run.partial.json")
    assert on_cpu["accuracy"] == base["accuracy"] and on_cpu["distance_after"] == base["distance_after"]
    assert (tmp_path / "run.partial.json").is_file()
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), initializer=fr._worker_init,
                             initargs=(str(EXAMPLE), cfg, 3, 1)) as pool:
        pooled = _rounds(task, cfg, pool=pool)
    assert pooled["accuracy"] == base["accuracy"]
    assert pooled["distance_before"] == pytest.approx(base["distance_before"], rel=1e-6)


def test_train_on_a_device_moves_the_model_back(task):
    cfg = task.settings(CFG)
    x, y = task.load_partition(0, 3, cfg)
    a, b = task.load_model(cfg), task.load_model(cfg)
    la = task.train(a, x, y, cfg, seed=5)
    lb = task.train(b, x, y, cfg, seed=5, device="cpu")
    assert la == pytest.approx(lb, rel=1e-6)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert vb.device.type == "cpu" and torch.equal(va, vb), k
    assert not torch.equal(a.state_dict()["classifier.weight"], task.load_model(cfg).state_dict()["classifier.weight"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_train_on_cuda_returns_a_cpu_model(task):
    cfg = task.settings(CFG)
    x, y = task.load_partition(0, 3, cfg)
    m = task.load_model(cfg)
    assert task.train(m, x, y, cfg, device="cuda") > 0
    assert {v.device.type for v in m.state_dict().values()} == {"cpu"}
