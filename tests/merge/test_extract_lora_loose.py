"""extract-lora on models holding parameters of no linear layer or embedding (transformers 5's fused MoE experts,
CLIP's class embedding and logit scale): one error line naming them (before, their change was silently left out of
the adapter: a Mixtral's at full rank was 0.26 of the logits away from the fine-tune), or with
``--skip-undecomposable`` an adapter and a note, or with ``--save-module MODULE`` their module saved whole; CLIPModel
(which names no input embeddings) no traceback."""

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
                                           # its logit_scale, a 0-d tensor add_noise leaves as it is: unchanged,
                                           # so nothing is lost there (a note); the class embedding is named
                                           ("clip", "vision_model.embeddings (CLIPVisionEmbeddings: class_embedding)")])
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


@pytest.mark.parametrize("changed", [False, True])
def test_a_vit_fine_tune_whose_class_token_is_unchanged_extracts(tmp_path, capsys, changed):
    """ViT's cls_token and position_embeddings belong to no linear layer: a fine-tune that left them as the base had
    them loses nothing (an adapter, with a note); one that changed them is still one error naming them."""
    from safetensors.torch import load_file

    base = make_model("vit", head=True, dtype=torch.float32, seed=0)
    ft = make_model("vit", head=True, dtype=torch.float32, seed=0)
    noisy = add_noise(base.state_dict(), 0.05, seed=1)[0]
    loose = ("vit.embeddings.cls_token", "vit.embeddings.position_embeddings")
    ft.load_state_dict({k: (v if changed or k not in loose else base.state_dict()[k]) for k, v in noisy.items()})
    base.save_pretrained(str(tmp_path / "base"))
    ft.save_pretrained(str(tmp_path / "ft"))
    capsys.readouterr()
    argv = ["extract-lora", str(tmp_path / "ft"), str(tmp_path / "base"), "--rank", "4", "--no-write-model-card",
            "-o", str(tmp_path / "out")]
    if changed:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "cannot extract vit.embeddings (ViTEmbeddings: cls_token, position_embeddings)" in err
        assert "save the module whole with --save-module vit.embeddings" in err
        assert not (tmp_path / "out").exists()
        return
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert any(n.startswith("unchanged by the fine-tune, so nothing is lost: vit.embeddings.cls_token")
               for n in report["notes"]), report["notes"]
    assert load_file(str(tmp_path / "out" / "adapter_model.safetensors"))  # an adapter was written


@pytest.mark.parametrize("family, name", [("vit", "embeddings"), ("vit", "vit.embeddings"),
                                          ("clip_vision", "vision_model.embeddings"),
                                          ("clip", "vision_model.embeddings")])
def test_save_module_carries_a_module_of_loose_parameters_whole(tmp_path, family, name):
    """``--save-module`` naming the module of changed loose parameters (ViT's class token and position embeddings,
    CLIP's class embedding) saves it whole, with the modules inside it, under its full name in modules_to_save (PEFT
    matches suffixes: ``embeddings`` would wrap ViT's ``patch_embeddings`` too, and CLIP's ``position_embedding``
    inside it twice): PEFT's model is the fine-tune (full rank). Before, one error whatever the flags."""
    from peft import PeftModel

    from conftest import make_inputs

    _pair(tmp_path, family)
    out = tmp_path / "out"
    assert main(["extract-lora", str(tmp_path / "ft"), str(tmp_path / "base"), "--rank", "64", "-q",
                 "--no-write-model-card", "--save-module", name, "-o", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    whole = name if "." in name else "vit.embeddings"
    assert whole in config["modules_to_save"] and "embeddings" not in config["modules_to_save"], config
    ft = make_model(family, head=True, dtype=torch.float32, seed=0)
    ft = type(ft).from_pretrained(str(tmp_path / "ft")).eval()
    peft = PeftModel.from_pretrained(type(ft).from_pretrained(str(tmp_path / "base")), str(out)).eval()
    wrapped = [n for n, m in peft.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"]
    assert not any(a != b and b.startswith(a + ".") for a in wrapped for b in wrapped), wrapped  # none nested
    x = make_inputs(ft)
    with torch.no_grad():
        want = [v for v in ft(**x).values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        got = [v for v in peft(**x).values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert want and max(float((w - g).norm() / w.norm()) for w, g in zip(want, got)) < 1e-5


def test_save_module_of_fused_experts_is_one_error(tmp_path, capsys):
    """transformers' fused experts are stored per expert: PEFT could not load the module saved whole; one error, and
    the error without the flag does not suggest it."""
    _pair(tmp_path, "mixtral")
    argv = ["extract-lora", str(tmp_path / "ft"), str(tmp_path / "base"), "--rank", "4", "--no-write-model-card", "-q"]
    capsys.readouterr()
    assert main(argv + ["--save-module", "model.layers.0.mlp.experts", "-o", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--save-module model.layers.0.mlp.experts: its parameter" in err[0], err
    assert main(argv + ["-o", str(tmp_path / "b")]) == 2
    assert "--save-module" not in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
