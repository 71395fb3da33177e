"""The data-driven matchers on the multi-stack families, from the CLI with data files:

* T5 (``T5ForConditionalGeneration``) under ``--match activations`` with unlabeled text: the decoder reads
  the text as reconstruction (``decoder_input_ids``: the text shifted right), so both stacks run;
* CLIP's single towers (``CLIPTextModel`` with text, ``CLIPVisionModel`` with images) under
  ``--match activations``;
* ``--match learned`` on T5 (the decoder's predictions of the reconstructed text scored);
* what stays refused, with one clear error each: ``--match learned`` on a model whose output has no logits
  (a base model, a CLIP tower) and on an encoder-decoder given data without decoder inputs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_cli, write_tokenizer
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")

LINES = "the cat sat on the mat\nthe dog ran fast\na cat ran\n" * 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stacks")
    for family, head in (("t5", True), ("t5", False), ("clip_text", False), ("clip_vision", False)):
        for seed in (0, 5):
            path = root / f"{family}-{'task' if head else 'base'}-{seed}"
            make_model(family, head=head, seed=seed, dtype=torch.float32).save_pretrained(path)
            if family != "clip_vision":
                write_tokenizer(path)
    (root / "lines.txt").write_text(LINES)
    np.savez(root / "images.npz", pixel_values=np.random.default_rng(0).random((12, 3, 8, 8), dtype=np.float32))
    return root


def _align(root, name, data, match, out, *extra):
    return run_cli("align", root / f"{name}-0", root / f"{name}-5", "--match", match, "--align-data", root / data,
                   "--progress", "none", "-o", out, *extra)


def test_unlabeled_text_feeds_an_encoder_decoder_as_reconstruction(folders):
    from transformers import T5ForConditionalGeneration

    from symmerge.io.data import load_data

    model = T5ForConditionalGeneration.from_pretrained(folders / "t5-task-0")
    data = load_data(folders / "lines.txt", model, labels=False, batch_size=4)
    for b in data.batches:
        ids, dec = b.inputs["input_ids"], b.inputs["decoder_input_ids"]
        assert dec.shape == ids.shape and bool((dec[:, 0] == model.config.decoder_start_token_id).all())
        assert torch.equal(dec[:, 1:][b.mask[:, :-1]], ids[:, :-1][b.mask[:, :-1]])
    labeled = load_data(folders / "lines.txt", model, batch_size=4)  # scored with labels: the model shifts them
    assert "decoder_input_ids" not in labeled.batches[0].inputs


@pytest.mark.parametrize("name,data", [("t5-task", "lines.txt"), ("t5-base", "lines.txt"),
                                       ("clip_text-base", "lines.txt"), ("clip_vision-base", "images.npz")])
def test_activation_matching_from_the_cli(folders, tmp_path, name, data):
    out = tmp_path / "out"
    assert _align(folders, name, data, "activations", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["match"] == "activations" and report["align_samples_used"] == 12
    assert report["distance_after"] < report["distance_before"]
    assert report["verify_max_rel_diff"] <= 1e-5
    if name.startswith("t5"):
        assert "encoder.heads" in report["per_module"]  # the tied group, solved on the weights


@pytest.mark.parametrize("name,data,message", [
    ("t5-base", "lines.txt", "learned alignment matches the models' predictions (their logits); T5EncoderModel outputs none"),
    ("clip_text-base", "lines.txt", "CLIPTextModel outputs none"),
    ("clip_vision-base", "images.npz", "CLIPVisionModel outputs none")])
def test_learned_alignment_is_refused_by_name(folders, tmp_path, capsys, name, data, message):
    out = tmp_path / "out"
    assert _align(folders, name, data, "learned", out) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_learned_alignment_on_t5_scores_the_decoder(folders, tmp_path):
    out = tmp_path / "out"
    assert _align(folders, "t5-task", "lines.txt", "learned", out, "--learn-steps", "6", "--learn-batch", "4") == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["match"] == "learned" and report["learned"]["steps"] == 6
    assert report["verify_max_rel_diff"] <= 1e-5 and report["distance_after"] < report["distance_before"]


def test_learned_alignment_on_an_encoder_decoder_needs_decoder_inputs(fp64_rmsnorm):
    from symmerge.errors import SymmergeError
    from symmerge.io.data import Batch, Data
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions

    a, b = make_model("t5", head=True, seed=0), make_model("t5", head=True, seed=5)
    ids = torch.randint(2, 60, (4, 7))
    data = Data("memory", "text", [Batch({"input_ids": ids}, None, torch.ones_like(ids, dtype=torch.bool))], 4,
                labeled=False)
    with pytest.raises(SymmergeError, match="carries no decoder inputs"):
        align_pair(a, b, AlignOptions(symmetries="recommended", match="learned", align_data=data))
