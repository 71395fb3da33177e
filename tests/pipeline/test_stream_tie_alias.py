"""A declared tie's alias never reaches ``align --stream``'s solve-and-write job (:class:`symmerge.pipeline.stream._Job`).

``LazyCheckpoint`` folds an alias stored beside its source (``save_pretrained`` writes the source alone; other
writers store both names), the prefix view has no ties and ``--stream --untie`` is refused, so every tensor a job
gets is its own maps' source. The job's branch that ran an alias through its source's step, and kept the source
until its aliases were written, was dead and is gone; an alias reaching a job is one error."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from factories import make_model
from symmerge.errors import SymmergeError
from symmerge.io.checkpoint import LazyCheckpoint
from symmerge.pipeline import stream
from symmerge.pipeline.options import AlignOptions

pytestmark = pytest.mark.usefixtures("single_thread")

ALIAS = {"llama": "lm_head.weight", "gpt2": "lm_head.weight"}


def _both_names(model, folder):
    """``model`` saved with the tie's alias stored beside its source (its own copy of the values)."""
    model.save_pretrained(folder)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("family", sorted(ALIAS))
def test_a_checkpoint_stored_with_both_names_hands_no_alias_to_a_job(family, tmp_path, monkeypatch):
    alias = ALIAS[family]
    model, anchor = (make_model(family, head=True, tied=True, dtype=torch.float32, seed=s) for s in (0, 1))
    assert model.config.tie_word_embeddings
    folders = {"both": _both_names(model, tmp_path / "both"), "once": tmp_path / "once"}
    model.save_pretrained(folders["once"])
    anchor.save_pretrained(tmp_path / "anchor")
    stored = json.loads((folders["both"] / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (folders["both"] / "model.safetensors").read_bytes()[:8], "little")])
    assert alias in stored  # the file holds both names
    assert alias not in LazyCheckpoint(folders["both"], fused=True).keys()  # folded into its source
    seen, call = [], stream._Job.__call__

    def spy(self, part, sd_a, sd_b, prepared=None):
        seen.append(set(sd_a))
        return call(self, part, sd_a, sd_b, prepared)

    monkeypatch.setattr(stream._Job, "__call__", spy)
    written = {}
    for name, folder in folders.items():
        out = tmp_path / f"out-{name}"
        stream.align_streaming(folder, tmp_path / "anchor", out, AlignOptions(symmetries="heads,attn,ffn,rescale"),
                               progress=False)
        ck = LazyCheckpoint(out)
        written[name] = ck.read(ck.keys())
    assert len(seen) >= 8 and all(alias not in keys for keys in seen)
    assert written["both"].keys() == written["once"].keys()
    assert all(torch.equal(t, written["once"][k]) for k, t in written["both"].items())


def test_an_alias_reaching_a_job_is_one_error():
    """A part holding an alias whose step maps its source (as a tied head's would): refused before solving."""
    step = SimpleNamespace(tensor="lm_head.weight", maps=(SimpleNamespace(slot=SimpleNamespace(key="embed.weight")),))
    job = stream._Job(SimpleNamespace(disk_name={"lm_head.weight": "lm_head.weight"}), None, {}, None, None,
                      {"lm_head.weight": step})
    t = torch.ones(2, 2)
    with pytest.raises(SymmergeError, match="lm_head.weight reached a part as a tie's alias \\(of embed.weight\\)"):
        job([], {"lm_head.weight": t}, {"lm_head.weight": t})
