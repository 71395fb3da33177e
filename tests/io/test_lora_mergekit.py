"""mergekit 0.1.5 as the oracle of symmerge's LoRA tools: a config with ``model: base+adapter`` inputs merged by
``symmerge run`` and by mergekit (``--lora-merge-cache``), and ``symmerge extract-lora`` against
``mergekit-extract-lora`` at the same rank. Runs in the venv that has mergekit (``.ci/run``); skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mergekit_oracle as mo
from test_lora import LLAMA_ALL, make_adapter

pytestmark = pytest.mark.skipif(not mo.available(), reason="mergekit is not installed (see .ci/run)")


def _merged_models(cache) -> dict:
    """{(base name, adapter name): tensors} of the models a LoRA merge cache holds (the names of either tool)."""
    out = {}
    for folder in Path(cache).iterdir():
        base, _, rest = folder.name.replace("+", "_").partition("_")
        adapter = next(p for p in rest.split("_") if p.startswith("a") and p[1:].split("-")[0].isdigit())
        out[(base, adapter.split("-")[0])] = mo.tensors(folder)
    return out


@pytest.mark.parametrize("method,dtype", [("ties", "float32"), ("linear", "bfloat16")])
def test_config_with_lora_inputs_equals_mergekit(tmp_path, method, dtype):
    """A config whose inputs are base+adapter (one DoRA, one rsLoRA) beside a plain one: the models merged from the
    adapters equal mergekit's bit for bit (its --lora-merge-cache against ours), and the config's result equals
    mergekit's (TIES in float32 within its rounding; linear in bfloat16 within 1e-3: half-precision TIES differs from
    mergekit's where selections tie, issue 41 item 4, whatever the inputs)."""
    from symmerge.cli import main

    base, fts = mo.family(tmp_path / "m", "llama", dtype, n=2)
    a1 = make_adapter(base, tmp_path / "a1", r=4, lora_alpha=8, target_modules=LLAMA_ALL, use_dora=True)
    a2 = make_adapter(base, tmp_path / "a2", seed=2, r=2, lora_alpha=4, use_rslora=True,
                      target_modules=["q_proj", "v_proj", "up_proj"])
    density = ", density: 0.5" if method == "ties" else ""
    config = (f"merge_method: {method}\n" + (f"base_model: {base}\n" if method == "ties" else "") + "models:\n"
              f"  - model: {fts[0]}+{a1}\n    parameters: {{weight: 0.6{density}}}\n"
              f"  - model: {base}+{a2}\n    parameters: {{weight: 0.4{density}}}\n"
              f"  - model: {fts[1]}\n    parameters: {{weight: 0.3{density}}}\n"
              f"dtype: {dtype}\n")
    cfg = tmp_path / "c.yml"
    cfg.write_text(config)
    assert main(["run", str(cfg), str(tmp_path / "ours"), "--lora-merge-cache", str(tmp_path / "c1"),
                 "--progress", "none"]) == 0
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    run_merge(MergeConfiguration.model_validate(yaml.safe_load(config)), str(tmp_path / "theirs"),
              options=MergeOptions(copy_tokenizer=True, lazy_unpickle=False, quiet=True,
                                   lora_merge_cache=str(tmp_path / "c2")))
    mine, theirs = _merged_models(tmp_path / "c1"), _merged_models(tmp_path / "c2")
    assert set(mine) == set(theirs) == {("ft1", "a1"), ("base", "a2")}
    for key, t in theirs.items():
        assert set(mine[key]) == set(t) and all(torch.equal(mine[key][k], v) for k, v in t.items()), key
    gap = mo.relative_gap(mo.tensors(tmp_path / "ours"), mo.tensors(tmp_path / "theirs"), mo.tensors(base))
    assert gap <= (1e-5 if dtype == "float32" else 1e-3), gap


def _mergekit_extract(ft, base, out, *flags):
    from mergekit.scripts.extract_lora import main as mk_main

    mk_main.main(["--model", str(ft), "--base-model", str(base), "--out-path", str(out), *flags],
                 standalone_mode=False)


@pytest.mark.parametrize("flags", [["--max-rank", "4"], ["--max-rank", "3", "--no-distribute-scale", "--embed-lora",
                                                          "-e", "layers\\.0\\.mlp", "--sv-epsilon", "0.001"]])
def test_extract_lora_equals_mergekit(tmp_path, flags):
    """symmerge extract-lora and mergekit-extract-lora with the same flags write the same adapter: the same tensors
    (factors equal to float32 rounding, whole modules bit for bit), the same r, rank pattern and modules_to_save."""
    import json

    from safetensors.torch import load_file

    from symmerge.cli import main
    from test_extract_lora import make_finetune
    from test_lora import make_base

    base = make_base(tmp_path / "base")
    ft = make_finetune(base, tmp_path / "ft", ranks=[1, 2, 8], embed_rank=6)
    assert main(["extract-lora", str(ft), str(base), "-o", str(tmp_path / "ours"), *flags, "--progress", "none"]) == 0
    _mergekit_extract(ft, base, tmp_path / "theirs", *flags)
    ours, theirs = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("ours", "theirs"))
    assert set(ours) == set(theirs)
    for k, t in theirs.items():
        scale = float(t.abs().max()) or 1.0
        assert torch.allclose(ours[k], t, atol=2e-5 * scale, rtol=0), k
        if "lora_" not in k:
            assert torch.equal(ours[k], t), k
    c_ours, c_theirs = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "theirs"))
    for key in ("r", "lora_alpha", "rank_pattern", "alpha_pattern"):
        assert c_ours[key] == c_theirs[key], key
    assert sorted(c_ours["modules_to_save"] or []) == sorted(c_theirs["modules_to_save"] or [])
