"""``symmerge run`` reads each input's safetensors headers once: the plan reads them (a
:class:`~symmerge.io.checkpoint.LazyCheckpoint` per folder, :class:`symmerge.config.mergekit.Headers`) and the run
reads the inputs through the same checkpoints. Before, the run built each input's checkpoint again for the executor,
the base's twice more (the base-class check and the report's body, ``config.run.body_steps``): 2 reads of every
fine-tune's files and 4 of the base's in one ``ties`` config. Shown to fail before the fix."""

from __future__ import annotations

import collections
import json

import pytest
import yaml

from conftest import run_cli
from test_entry_equivalence import _llama

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("headers")
    folders = [_llama(root / f"m{i}", i) for i in range(3)]
    # the last one sharded: one read per file, every file
    AutoModelForCausalLM.from_pretrained(folders[2]).save_pretrained(root / "m2s", max_shard_size="4KB")
    return folders[:2] + [str(root / "m2s")]


def _counted(monkeypatch):
    """(reads per safetensors file, checkpoints built per folder), counted from here on."""
    from symmerge.io import checkpoint

    files, folders = collections.Counter(), collections.Counter()
    shapes, init = checkpoint.stored_shapes, checkpoint.LazyCheckpoint.__init__

    def stored_shapes(fs):
        files.update(str(f) for f in fs)
        return shapes(fs)

    def built(self, folder, *args, **kwargs):
        folders[str(folder)] += 1
        return init(self, folder, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "stored_shapes", stored_shapes)
    monkeypatch.setattr(checkpoint.LazyCheckpoint, "__init__", built)
    return files, folders


CONFIGS = {
    "ties": lambda b, m: {"merge_method": "ties", "base_model": b,
                          "models": [{"model": x, "parameters": {"weight": 1.0, "density": 0.5}} for x in m]},
    "slices": lambda b, m: {"merge_method": "linear", "slices": [
        {"sources": [{"model": x, "layer_range": [0, 2], "parameters": {"weight": 0.5}} for x in m]}]},
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_one_run_reads_each_input_file_once(models, tmp_path, monkeypatch, kind):
    from pathlib import Path

    base, fts = models[0], models[1:]
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(CONFIGS[kind](base, fts), sort_keys=False))
    files, folders = _counted(monkeypatch)
    assert run_cli("run", path, tmp_path / "out", "--quiet") == 0
    inputs = ([base] if kind == "ties" else []) + fts
    expected = sorted(str(f) for m in inputs for f in Path(m).glob("*.safetensors"))
    assert len(expected) > len(inputs)  # a sharded input among them
    assert sorted(files) == expected and set(files.values()) == {1}, dict(files)
    assert sorted(folders) == sorted(inputs) and set(folders.values()) == {1}, dict(folders)
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["distance_result_to_inputs"] is not None  # the body read from the same headers


def test_an_intermediate_is_read_once_too(models, tmp_path, monkeypatch):
    """A config of two merges: the first one's output (an intermediate folder) read once, by the final merge."""
    base, fts = models[0], models[1:]
    first = {"name": "first", "merge_method": "linear",
             "models": [{"model": x, "parameters": {"weight": 0.5}} for x in fts]}
    final = {"merge_method": "slerp", "base_model": base, "models": [{"model": base}, {"model": "first"}],
             "parameters": {"t": 0.5}}
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump_all([first, final], sort_keys=False))
    files, folders = _counted(monkeypatch)
    assert run_cli("run", path, tmp_path / "out", "--quiet") == 0
    assert set(folders.values()) == {1}, dict(folders)
    assert set(files.values()) == {1}, dict(files)
    assert len(folders) == 4  # the three inputs and the intermediate


def test_an_intermediate_whose_config_the_final_merge_takes_is_read_once(models, tmp_path, monkeypatch):
    """The final merge takes its config.json (and its report's head) from the intermediate (``config_from``, the first
    model without a base): the run opens the intermediate's checkpoint once and gives it to the executor and to the
    report's head entry alike. Before, the head entry's reader (``config.run.heads_at``) was given the folder, told it
    from a checkpoint by a duck test and opened it again: 2 reads of the intermediate's file."""
    base, fts = models[0], models[1:]
    first = {"name": "first", "merge_method": "linear",
             "models": [{"model": x, "parameters": {"weight": 0.5}} for x in fts]}
    final = {"merge_method": "linear", "models": [{"model": "first", "parameters": {"weight": 0.5}},
                                                  {"model": base, "parameters": {"weight": 0.5}}]}
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump_all([first, final], sort_keys=False))
    files, folders = _counted(monkeypatch)
    assert run_cli("run", path, tmp_path / "out", "--quiet") == 0
    assert len(folders) == 4 and set(folders.values()) == {1}, dict(folders)  # the three inputs, the intermediate
    assert set(files.values()) == {1}, dict(files)
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["head"]["policy"] == "merge" and report["distance_result_to_inputs"] is not None
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]
