"""One rule for the ``head`` entry of a one-model passthrough (every step copies from one input): it carries
:data:`~symmerge.merge.heads.COPIED_NOTE` whatever head policy was asked. Before, ``symmerge merge`` (in memory and
``--stream``) wrote the note only where the policy resolved to ``merge``; a policy resolved to ``keep`` (``--heads
keep``, or a task head under ``auto``) gave the entry without it, while a config's report of the same merge carried it.
Checked on a LlamaForCausalLM (``--heads keep``) and a BertForSequenceClassification (``--heads auto``, which keeps a
task head): the same entry from every entry point, a mergekit config's without ``requested`` and ``keys``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_cli
from factories import make_model
from test_entry_equivalence import _llama

from symmerge.merge.heads import COPIED_NOTE

pytestmark = pytest.mark.usefixtures("single_thread")


def _reports(m: str, tmp_path: Path, heads: str) -> dict:
    """The reports of the one-model passthrough of ``m`` with ``--heads heads``: ``symmerge merge`` in memory and
    streamed, ``symmerge run`` with symmerge's keys and with a mergekit config."""
    for mode in ("memory", "stream"):
        assert run_cli("merge", m, "--method", "passthrough", "--align", "none", "--heads", heads, "--mode", mode,
                       "-o", tmp_path / mode, "--progress", "none") == 0
    own = {"method": "passthrough", "models": [m], "align": "none", "heads": heads, "progress": "none"}
    mk = {"merge_method": "passthrough", "models": [{"model": m}]}
    for name, cfg in (("own", own), ("mk", mk)):
        (tmp_path / f"{name}.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        assert run_cli("run", tmp_path / f"{name}.yml", tmp_path / name, "--quiet") == 0
    return {name: json.loads((tmp_path / name / "symmerge_report.json").read_text())
            for name in ("memory", "stream", "own", "mk")}


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_a_kept_head_of_a_one_model_passthrough_carries_the_note_from_every_entry(family, tmp_path):
    if family == "llama":
        m, heads, keys = _llama(tmp_path / "m", 1), "keep", ["lm_head.weight"]
    else:
        model = make_model("bert", head=True, dtype=torch.float32)
        assert type(model).__name__ == "BertForSequenceClassification"
        model.save_pretrained(tmp_path / "m")
        m, heads, keys = str(tmp_path / "m"), "auto", ["classifier.bias", "classifier.weight"]
    reports = _reports(m, tmp_path, heads)
    want = {"policy": "keep", "from_index": 0, "from": m, "note": COPIED_NOTE}
    for name, report in reports.items():
        head = report["head"]
        assert report["plan"]["steps"]["merge"] == 0, name
        if name != "mk":  # symmerge merge's entry (a config of symmerge's keys runs it) also says what was asked and
            # the kept tensors; a mergekit config's asks for no head policy
            assert head.pop("requested") == heads and head.pop("keys") == keys, (name, head)
        assert head == want, (name, head)

