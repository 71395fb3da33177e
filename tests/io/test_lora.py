"""LoRA inputs (symmerge.io.lora): ``BASE+ADAPTER`` merged tensor by tensor equals PEFT's own ``merge_and_unload`` on
real transformers classes (Llama: linear layers, embeddings, LM head, modules_to_save; GPT-2: Conv1D, biases), for
LoRA, rsLoRA with rank/alpha patterns, DoRA and lora_bias, in float32 and half precision; the cache; the one-line
refusals; ``run`` and ``merge`` with ``BASE+ADAPTER`` inputs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from symmerge.errors import SymmergeError  # noqa: E402
from symmerge.io import lora  # noqa: E402

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny(arch: str):
    from transformers import GPT2Config, LlamaConfig

    if arch == "llama":
        return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           tie_word_embeddings=False)
    return GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32)


def make_base(folder, arch="llama", dtype="float32", seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny(arch), dtype=torch.float32)
    model.to(DT[dtype]).save_pretrained(str(folder))
    return Path(folder)


def make_adapter(base, folder, seed=1, noise=0.05, **config):
    """A PEFT adapter of ``base`` (a folder) with every trainable tensor of the adapter moved off its initial
    value (LoRA factors, DoRA magnitudes, modules_to_save), saved by PEFT itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base))
    pm = get_peft_model(model, LoraConfig(init_lora_weights=False, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(noise * torch.randn(p.shape, generator=g).to(p.dtype))
    pm.save_pretrained(str(folder))
    return Path(folder)


def peft_merged(base, adapter) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base))
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def ours(folder) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = {
    "lora": ("llama", dict(r=4, lora_alpha=8, target_modules=LLAMA_ALL)),
    "rslora-patterns": ("llama", dict(r=4, lora_alpha=16, use_rslora=True, target_modules=LLAMA_ALL,
                                      rank_pattern={"layers.1.self_attn.q_proj": 2, "down_proj": 3},
                                      alpha_pattern={"v_proj": 5})),
    "embeddings-head-modules_to_save": ("llama", dict(r=3, lora_alpha=6, target_modules=["q_proj", "embed_tokens",
                                                                                         "lm_head"],
                                                      modules_to_save=["input_layernorm"])),
    "dora": ("llama", dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj",
                                                                              "embed_tokens", "lm_head"])),
    "gpt2-conv1d-bias": ("gpt2", dict(r=4, lora_alpha=4, lora_bias=True, target_modules=["c_attn", "c_proj", "c_fc"],
                                      fan_in_fan_out=True)),
    "gpt2-dora": ("gpt2", dict(r=2, lora_alpha=4, use_dora=True, target_modules=["c_attn", "c_proj"],
                               fan_in_fan_out=True)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_merged_equals_peft_merge_and_unload(tmp_path, variant, dtype):
    """Every tensor of the streamed merge equals PEFT's merge_and_unload of the same adapter on the loaded model
    (the same arithmetic: exact, in float32, bfloat16 and float16), and the adapter changed the model."""
    arch, config = VARIANTS[variant]
    base = make_base(tmp_path / "base", arch, dtype)
    adapter = make_adapter(base, tmp_path / "adapter", **config)
    record = lora.apply_adapter(base, adapter, tmp_path / "merged", progress=False)
    theirs, mine, before = peft_merged(base, adapter), ours(tmp_path / "merged"), ours(base)
    assert set(mine) == set(theirs)
    changed = 0
    for k, t in theirs.items():
        assert mine[k].dtype == t.dtype == DT[dtype], k
        assert torch.equal(mine[k], t), (k, (mine[k].float() - t.float()).abs().max().item())
        changed += not torch.equal(t, before[k])
    assert changed >= 4 and record["changed"] >= 4
    if "dora" in variant:
        assert record["variant"].startswith("DoRA")


def test_resolve_input_caches_and_reuses(tmp_path):
    """--lora-merge-cache: the merged model is written once under a name of its inputs and reused (not rewritten)
    by a later resolve; a changed adapter is merged again under another name; a plain folder is returned as is."""
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "ad", r=2, lora_alpha=2, target_modules=["q_proj"])
    cache = tmp_path / "cache"
    spec = f"{base}+{adapter}"
    first = Path(lora.resolve_input(spec, cache))
    assert first.parent == cache and (first / "config.json").is_file()
    stamp = {f.name: f.stat().st_mtime_ns for f in first.iterdir()}
    with lora.merge_cache(cache):
        again = Path(lora.resolve_input(spec))
    assert again == first and {f.name: f.stat().st_mtime_ns for f in first.iterdir()} == stamp
    make_adapter(base, adapter, seed=5, r=2, lora_alpha=2, target_modules=["q_proj"])
    other = Path(lora.resolve_input(spec, cache))
    assert other != first and not torch.equal(ours(other)["model.layers.0.self_attn.q_proj.weight"],
                                              ours(first)["model.layers.0.self_attn.q_proj.weight"])
    assert lora.resolve_input(str(base), cache) == str(base)
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, other.name])  # nothing else left


def test_without_a_cache_the_temporary_folder_is_removed_at_exit(tmp_path):
    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "ad", r=2, lora_alpha=2, target_modules=["v_proj"])
    code = ("from symmerge.io.lora import resolve_input; from pathlib import Path; "
            f"p = Path(resolve_input({str(base) + '+' + str(adapter)!r})); assert (p / 'config.json').is_file(); "
            "print(p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    merged = Path(out.stdout.strip().splitlines()[-1])
    assert merged.name.startswith("base+ad-") and not merged.exists() and not merged.parent.exists()


def test_lora_merge_dtype(tmp_path):
    """--lora-merge-dtype: the base's tensors in that dtype, the adapter applied in it (PEFT on the model loaded
    in that dtype)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "ad", r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    merged = Path(lora.resolve_input(f"{base}+{adapter}", tmp_path / "c", dtype="bfloat16"))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    theirs = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().state_dict()
    mine = ours(merged)
    assert all(torch.equal(mine[k], v) for k, v in theirs.items())
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"


def _adapter_with(tmp_path, base, edit=None, tensors=None):
    adapter = make_adapter(base, tmp_path / "ad", r=2, lora_alpha=2, target_modules=["q_proj"])
    if edit:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        cfg.update(edit)
        (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors:
        from safetensors.torch import load_file, save_file

        sd = load_file(str(adapter / "adapter_model.safetensors"))
        sd = tensors(sd)
        save_file(sd, str(adapter / "adapter_model.safetensors"))
    return adapter


BAD = {
    "ia3": (dict(peft_type="IA3"), None, "a IA3 adapter"),
    "pissa": (dict(init_lora_weights="pissa"), None, "init_lora_weights='pissa'"),
    "replication": (dict(layer_replication=[[0, 2]]), None, "layer replication"),
    "tokens": (dict(trainable_token_indices=[1, 2]), None, "trainable tokens"),
    "rank": (dict(r=3), None, "has rank 2 but the config says r=3"),
    "missing-factor": (None, lambda sd: {k: v for k, v in sd.items() if "lora_B" not in k}, "only one of its two"),
    "elsewhere": (dict(target_modules=["x_proj"]), lambda sd: {k.replace("q_proj", "x_proj"): v for k, v in sd.items()},
                  "does not have"),
    # the config and the weights disagree: PEFT would not put the weights where they are (they were merged there)
    "untargeted": (dict(target_modules=["v_proj"]), None, "target_modules (['v_proj']) does not name it"),
    "regex": (dict(target_modules=r".*\.k_proj"), None, "does not name it"),
    "excluded": (dict(exclude_modules=["q_proj"]), None, "exclude_modules (['q_proj']) names it"),
    "layers": (dict(layers_to_transform=[5]), None, "layers_to_transform ([5]) leaves out its layer 0"),
    # values PEFT's scaling divides by: a string was a TypeError traceback
    "alpha-string": (dict(lora_alpha="eight"), None, "lora_alpha must be a positive number, got 'eight'"),
    "rank-float": (dict(r=2.5), None, "r must be a positive whole number, got 2.5"),
    "pattern": (dict(alpha_pattern={"q_proj": None}), None, "alpha_pattern['q_proj'] must be a positive number"),
    "shape": (None, lambda sd: {k: (torch.zeros(v.shape[0], 7) if "lora_A" in k else v) for k, v in sd.items()},
              "its update is"),
    "conv": (None, lambda sd: {k: v[..., None, None] for k, v in sd.items()}, "convolution"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_refusals_are_one_line_and_write_nothing(tmp_path, case, capsys):
    from symmerge.cli import main

    edit, tensors, message = BAD[case]
    base = make_base(tmp_path / "base")
    adapter = _adapter_with(tmp_path, base, edit, tensors)
    cache = tmp_path / "cache"
    with pytest.raises(SymmergeError, match=re.escape(message)):
        lora.resolve_input(f"{base}+{adapter}", cache)
    assert not cache.exists() or not any(cache.iterdir())
    capsys.readouterr()
    code = main(["merge", f"{base}+{adapter}", str(base), "-o", str(tmp_path / "out"), "--method", "average",
                 "--align", "none", "--lora-merge-cache", str(cache)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("symmerge: error:") and message in err[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_pickled_adapter_is_refused_unless_allowed(tmp_path, capsys):
    """An adapter stored only as ``adapter_model.bin`` was unpickled without ``--allow-pickle`` (a pickle checkpoint
    is refused): it is now one line naming the file, with nothing cached or written; with the flag it merges as its
    safetensors does."""
    from safetensors.torch import load_file

    from symmerge.cli import main

    base = make_base(tmp_path / "base")
    adapter = _adapter_with(tmp_path, base)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    torch.save(load_file(str(adapter / "adapter_model.safetensors")), str(pickled / "adapter_model.bin"))
    cache = tmp_path / "cache"
    with pytest.raises(SymmergeError, match="adapter_model.bin: the adapter's weights are a pickle"):
        lora.resolve_input(f"{base}+{pickled}", cache)
    with pytest.raises(SymmergeError, match="is a pickle|are a pickle"):
        lora.resolve_input(f"{base}+{pickled}", cache, merge=False)  # planning refuses it too
    assert not cache.exists() or not any(cache.iterdir())
    argv = ["merge", f"{base}+{pickled}", str(base), "--method", "average", "--align", "none", "-q"]
    capsys.readouterr()
    assert main([*argv, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allow-pickle" in err[0] and not (tmp_path / "out").exists()
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"merge_method: linear\nmodels:\n  - model: {base}+{pickled}\n    parameters: {{weight: 0.5}}\n"
                   f"  - model: {base}\n    parameters: {{weight: 0.5}}\ndtype: float32\n")
    assert main(["run", str(cfg), str(tmp_path / "run_out"), "-q"]) == 2
    assert "are a pickle" in capsys.readouterr().err and not (tmp_path / "run_out").exists()
    assert main([*argv, "--allow-pickle", "-o", str(tmp_path / "allowed")]) == 0
    assert main(["merge", f"{base}+{adapter}", str(base), "--method", "average", "--align", "none", "-q", "-o",
                 str(tmp_path / "safe")]) == 0
    got, expected = load_file(str(tmp_path / "allowed" / "model.safetensors")), \
        load_file(str(tmp_path / "safe" / "model.safetensors"))
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in got)


def test_spec_forms(tmp_path):
    assert lora.split_spec("a+b") == ("a", "b")
    assert lora.split_spec("plain") == ("plain", None)
    odd = tmp_path / "x+y"
    odd.mkdir()
    assert lora.split_spec(str(odd)) == (str(odd), None)  # an existing folder whose name has a '+'
    with pytest.raises(SymmergeError, match="one '\\+'"):
        lora.split_spec("a+b+c")
    with pytest.raises(SymmergeError, match="is not a folder here"):
        lora.resolve_input(f"{tmp_path}/nope+{tmp_path}", tmp_path / "c")


def test_run_config_and_merge_command_take_base_plus_adapter(tmp_path, capsys):
    """A mergekit config with ``model: base+adapter`` and ``symmerge merge BASE+ADAPTER ...`` merge the adapted model:
    the result equals the same merge of the folder PEFT's merge_and_unload writes; the cache holds the merged model."""
    from safetensors.torch import load_file

    from symmerge.cli import main

    base = make_base(tmp_path / "base")
    other = make_base(tmp_path / "other", seed=3)
    adapter = make_adapter(base, tmp_path / "ad", r=4, lora_alpha=8, target_modules=LLAMA_ALL)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)).merge_and_unload()
    pm.save_pretrained(str(tmp_path / "peft_merged"))
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"merge_method: linear\nmodels:\n  - model: {base}+{adapter}\n    parameters: {{weight: 0.3}}\n"
                   f"  - model: {other}\n    parameters: {{weight: 0.7}}\ndtype: float32\n")
    ref_cfg = tmp_path / "r.yml"
    ref_cfg.write_text(cfg.read_text().replace(f"{base}+{adapter}", str(tmp_path / "peft_merged")))
    cache = tmp_path / "cache"
    assert main(["run", str(cfg), str(tmp_path / "run"), "--lora-merge-cache", str(cache), "--progress", "none"]) == 0
    assert main(["run", str(ref_cfg), str(tmp_path / "ref"), "--progress", "none"]) == 0
    got, want = load_file(str(tmp_path / "run/model.safetensors")), load_file(str(tmp_path / "ref/model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert len(list(cache.iterdir())) == 1
    assert main(["merge", f"{base}+{adapter}", str(other), "-o", str(tmp_path / "m"), "--method", "average",
                 "--align", "none", "--lora-merge-cache", str(cache), "--progress", "none"]) == 0
    assert main(["merge", str(tmp_path / "peft_merged"), str(other), "-o", str(tmp_path / "mref"), "--method",
                 "average", "--align", "none", "--progress", "none"]) == 0
    got, want = load_file(str(tmp_path / "m/model.safetensors")), load_file(str(tmp_path / "mref/model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(list(cache.iterdir())) == 1  # the run's merged model reused
    capsys.readouterr()


def test_an_aligned_merge_names_a_lora_input_as_written(tmp_path, capsys):
    """The data-free solver's line of ``merge BASE+ADAPTER OTHER`` names the input as the user wrote it, not the
    folder the adapter was merged into (a temporary one, gone when the command ends)."""
    from symmerge.cli import main

    base = make_base(tmp_path / "base")
    other = make_base(tmp_path / "other", seed=3)
    adapter = make_adapter(base, tmp_path / "ad", r=4, lora_alpha=8, target_modules=LLAMA_ALL)
    spec = f"{base}+{adapter}"
    capsys.readouterr()
    assert main(["merge", spec, str(other), "-o", str(tmp_path / "m"), "--method", "average", "--anchor", "1",
                 "--progress", "none"]) == 0
    solver = [line for line in capsys.readouterr().out.splitlines() if "data-free solver" in line]
    assert solver and all(line.startswith(f"{spec}: ") for line in solver), solver
