"""The report's ``head`` entry of a one-model passthrough says what its steps do: every tensor, the language-model
head included, is copied from the one model (``steps.copies``), so the head is ``keep`` from that model, with a note
— in memory, streamed, through ``symmerge run`` (symmerge's keys, a mergekit config's ``models`` or ``slices``) and
``symmerge.merge``. Before, every entry but a config said ``policy: merge`` (from ``--heads auto`` and the class) and
a config said ``merge`` "as its steps say". With ``scale`` other than 1 the steps merge, and the entry says
``merge`` as before. Shown to fail before the fix."""

from __future__ import annotations

import pytest

from test_one_model_passthrough import _entries, one  # noqa: F401 (the module's fixture)

from symmerge.merge.heads import COPIED_NOTE, NO_HEAD_NOTE

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_head_entry_of_a_one_model_passthrough_is_the_copy(one, tmp_path):  # noqa: F811
    reports = _entries(one, tmp_path)
    for name, report in reports.items():
        head = report["head"]
        assert report["plan"]["steps"]["merge"] == 0, name
        assert head["policy"] == "keep" and head["from_index"] == 0 and head["from"] == one, (name, head)
        assert head["note"] == COPIED_NOTE, (name, head)
        if name not in ("own", "mk", "slices"):  # a config's entry names no keys (its steps do)
            assert head["keys"] == ["lm_head.weight"] and head["requested"] == "auto", (name, head)


def test_a_scaled_one_model_passthrough_still_reports_its_head_merged(one, tmp_path):  # noqa: F811
    reports = _entries(one, tmp_path, 0.5)
    for name, report in reports.items():
        assert report["plan"]["steps"]["copy"] == 0, name
        assert report["head"]["policy"] == "merge" and "from_index" not in report["head"], (name, report["head"])


def test_a_one_model_passthrough_of_a_base_model_reports_no_head_everywhere(tmp_path):
    """A base model (``LlamaModel``: no head) copied whole: ``none`` from every entry, a config's included (its entry
    reads the head from the input's headers, as ``symmerge merge`` does)."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    LlamaModel(cfg).save_pretrained(tmp_path / "base")
    reports = _entries(str(tmp_path / "base"), tmp_path)
    for name, report in reports.items():
        assert report["plan"]["steps"]["merge"] == 0, name
        assert report["head"] == {"policy": "none", "note": NO_HEAD_NOTE}, (name, report["head"])


def test_the_config_and_symmerge_merge_take_the_head_entry_from_one_rule(one, tmp_path, monkeypatch):  # noqa: F811
    """One rule for the head entry of a one-model passthrough (``merge.heads.passthrough_head``, its ``none`` from
    ``merge.heads.no_head``): changing it changes ``symmerge merge``'s entry (in memory and streamed) and a config's
    (symmerge's keys and a mergekit config) alike. Before, ``config.run.config_head`` wrote its own copy of the
    ``keep`` branch and of the ``none`` entry, which a change of the merge's rule left as it was."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    import symmerge.merge.heads as heads

    rule, none = heads.passthrough_head, heads.no_head

    def marked(*args, **kwargs):
        entry = rule(*args, **kwargs)
        return entry if entry is None else {"rule": "passthrough_head"} | entry  # no_head's mark wins

    monkeypatch.setattr(heads, "passthrough_head", marked, raising=False)
    monkeypatch.setattr(heads, "no_head", lambda: none() | {"rule": "no_head"}, raising=False)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    LlamaModel(cfg).save_pretrained(tmp_path / "base")
    for model, policy, mark in ((one, "keep", "passthrough_head"), (str(tmp_path / "base"), "none", "no_head")):
        reports = _entries(model, tmp_path / policy)
        assert len(reports) == 6, reports.keys()
        for name, report in reports.items():
            head = report["head"]
            assert head["policy"] == policy and head["rule"] == mark, (name, head)
            if policy == "keep":  # a mergekit config's entry (config_head) asks for no policy; the others' do
                assert ("requested" in head) == (name not in ("mk", "slices")), (name, head)
