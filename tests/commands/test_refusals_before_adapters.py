"""A refusal that needs no merge comes before any ``BASE+ADAPTER`` input is merged (docs/lora.md): ``symmerge run``
of a mergekit config planned its inputs, merging each adapter into the cache (``--lora-merge-cache``) or a
temporary folder, and only then refused an output inside an input folder; ``symmerge merge`` merged them before
its options' checks (``--head-from 5``, a method's parameter). Now: one line, exit 2, no cache folder, no
temporary folder, nothing written; and the same config with a good output still merges the adapter and runs."""

from __future__ import annotations

import tempfile

import pytest

from conftest import run_cli, save_folder
from factories import make_model

peft = pytest.importorskip("peft")

LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama base, a LoRA adapter of it (saved by PEFT), and another Llama."""
    import torch
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    base = save_folder(make_model("llama", head=True, seed=0), root / "base")
    other = save_folder(make_model("llama", head=True, seed=1), root / "other")
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                           LoraConfig(r=2, lora_alpha=4, target_modules=LLAMA, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(root / "ad"))
    return base, root / "ad", other


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """Python's temporary folder for this test (a temporary merge cache is made there), with no cache made yet."""
    from symmerge.io import lora

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setitem(lora._cache, "temp", None)  # noqa: SLF001 - an earlier test's temporary cache
    return tmp


def _config(tmp_path, base, ad, other):
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"merge_method: linear\nmodels:\n  - model: {base}+{ad}\n    parameters: {{weight: 0.5}}\n"
                   f"  - model: {other}\n    parameters: {{weight: 0.5}}\ndtype: float32\n")
    return cfg


@pytest.mark.parametrize("cache", [True, False], ids=["lora-merge-cache", "temporary"])
def test_run_refuses_an_output_inside_an_input_before_merging_an_adapter(folders, tmp_path, temp_dir, capsys, cache):
    base, ad, other = folders
    cfg = _config(tmp_path, base, ad, other)
    flags = ["--lora-merge-cache", str(tmp_path / "cache")] if cache else []
    for out in (base / "out", ad / "out", other / "out"):  # inside the base, the adapter, the other input
        before = sorted(p.name for p in out.parent.iterdir())
        capsys.readouterr()
        assert run_cli("run", cfg, out, "--progress", "none", *flags) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"symmerge: error: output {out}: the output is inside the input folder")
        assert len(err.splitlines()) == 1, err
        assert sorted(p.name for p in out.parent.iterdir()) == before  # nothing written, no lock left
        assert not (tmp_path / "cache").exists() and list(temp_dir.iterdir()) == []  # no adapter merged


def test_run_refuses_a_bad_parameter_before_merging_an_adapter(folders, tmp_path, temp_dir, capsys):
    base, ad, other = folders
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"merge_method: ties\nbase_model: {other}\nmodels:\n  - model: {base}+{ad}\n"
                   "    parameters: {weight: 1, density: 5}\ndtype: float32\n")
    capsys.readouterr()
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none", "--lora-merge-cache", tmp_path / "cache") == 2
    err = capsys.readouterr().err
    assert "density" in err.splitlines()[-1] and "symmerge: error:" in err.splitlines()[-1], err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists() and list(temp_dir.iterdir()) == []


def test_run_with_a_good_output_merges_the_adapter_and_runs(folders, tmp_path, temp_dir, capsys):
    base, ad, other = folders
    cfg = _config(tmp_path, base, ad, other)
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none", "--lora-merge-cache", tmp_path / "cache") == 0
    assert len(list((tmp_path / "cache").iterdir())) == 1 and (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("flags, words", [(["--method", "average", "--head-from", "5"], "--head-from index 5"),
                                          (["--method", "ties", "--param", "density=5"], "'density'")])
def test_merge_refuses_its_options_before_merging_an_adapter(folders, tmp_path, temp_dir, capsys, flags, words):
    base, ad, other = folders
    capsys.readouterr()
    assert run_cli("merge", f"{base}+{ad}", other, *flags, "--align", "none", "-o", tmp_path / "out",
                   "--progress", "none", "--lora-merge-cache", tmp_path / "cache") == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists() and list(temp_dir.iterdir()) == []
