"""extract-lora on models holding parameters of no linear layer or embedding (transformers 5's fused MoE experts,
CLIP's class embedding and logit scale): one error line naming them (before, their change was silently left out of
the adapter: a Mixtral's at full rank was 0.26 of the logits away from the fine-tune), or with
``--skip-undecomposable`` an adapter and a note; CLIPModel (which names no input embeddings) no traceback."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from conftest import add_noise  # noqa: E402
from factories import make_model  # noqa: E402

from symmerge.cli import main  # noqa: E402


def _pair(tmp_path, family):
    base = make_model(family, head=True, dtype=torch.float32, seed=0)
    ft = make_model(family, head=True, dtype=torch.float32, seed=0)
    ft.load_state_dict(add_noise(base.state_dict(), 0.05, seed=1)[0])
    base.save_pretrained(str(tmp_path / "base"))
    ft.save_pretrained(str(tmp_path / "ft"))


@pytest.mark.parametrize("family, named", [("mixtral", "model.layers.0.mlp.experts (MixtralExperts: gate_up_proj"),
                                           ("clip_vision", "vision_model.embeddings (CLIPVisionEmbeddings: "
                                                           "class_embedding)"),
                                           ("clip", "(the model) (CLIPModel: logit_scale)")])
def test_loose_parameters_are_one_error_or_left_out_on_request(tmp_path, capsys, family, named):
    _pair(tmp_path, family)
    capsys.readouterr()
    argv = ["extract-lora", str(tmp_path / "ft"), str(tmp_path / "base"), "--rank", "4", "--no-write-model-card"]
    assert main(argv + ["-o", str(tmp_path / "out")]) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "extracting" not in x]
    assert len(err) == 1 and err[0].startswith("symmerge: error: cannot extract ") and named in err[0], err
    assert not (tmp_path / "out").exists()
    assert main(argv + ["-o", str(tmp_path / "skip"), "--skip-undecomposable"]) == 0
    report = json.loads((tmp_path / "skip" / "symmerge_report.json").read_text())
    assert any(n.startswith("left out (--skip-undecomposable): ") and named in n for n in report["notes"])
