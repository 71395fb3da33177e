"""Plain merges (``--align none``) of every model type transformers instantiates, with or without a
symmetry spec, in memory and streamed: the merged folder loads with ``from_pretrained`` and holds the
per-tensor mean of the two inputs. A config.json without ``architectures`` gets its class from the
checkpoint's tensor names; a family without a spec falls back to no alignment under 'recommended' and
is refused for an explicit symmetry list."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto as auto

from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")  # no thread count checked here; 2-3x faster on 2 loaded cores

TYPES = ("bert roberta distilbert gpt2 gpt_neox gpt_bigcode llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe "
         "gemma gemma2 gemma3_text phi phi3 olmo2 olmoe falcon stablelm starcoder2 cohere t5 whisper clip").split()
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
              vocab_size=128, max_position_embeddings=64, **IDS)
SPECIAL = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, **IDS),
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, **IDS),
    "distilbert": dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=128, max_position_embeddings=64,
                       pad_token_id=0),
    "t5": dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=128, decoder_start_token_id=0, **IDS),
    "whisper": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128, num_mel_bins=8,
                    max_source_positions=16, max_target_positions=16, decoder_start_token_id=1, **IDS),
    "clip": dict(text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=128, max_position_embeddings=16, **IDS),
                 vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    image_size=16, patch_size=8), projection_dim=16),
    "mixtral": dict(COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "olmoe": dict(COMMON, num_experts=4, num_experts_per_tok=2),
}
MAPPINGS = (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
            auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES, auto.MODEL_MAPPING_NAMES)


def tiny(model_type: str, seed: int):
    """A tiny random model of ``model_type`` (hidden 32, 2 layers): its LM class, else the base model;
    skipped where transformers cannot build it."""
    try:
        config = transformers.AutoConfig.for_model(model_type, **SPECIAL.get(model_type, COMMON))
    except (ValueError, KeyError) as e:  # a type this transformers does not know
        pytest.skip(f"transformers has no {model_type}: {e}")
    cls = next(getattr(transformers, m[model_type]) for m in MAPPINGS if model_type in m)
    torch.manual_seed(seed)
    return cls(config).eval()


def run(capsys, *argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, *capsys.readouterr()


def save_pair(tmp_path, model_type):
    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"{model_type}{seed}"
        tiny(model_type, seed).save_pretrained(str(folder))
        folders.append(folder)
    return folders


def assert_mean(out, folders):
    """The merged folder loads with from_pretrained and every tensor is the mean of the inputs'."""
    cls = getattr(transformers, json.loads((folders[0] / "config.json").read_text())["architectures"][0])
    merged, a, b = (cls.from_pretrained(str(f)) for f in (out, *folders))
    sa, sb = a.state_dict(), b.state_dict()
    for k, t in merged.state_dict().items():
        if not t.is_floating_point():
            assert torch.equal(t, sa[k]), k
            continue
        mean = (sa[k].double() * 0.5 + sb[k].double() * 0.5).to(t.dtype)
        assert torch.equal(t, mean), k
        if not torch.equal(sa[k], sb[k]):
            assert not torch.equal(t, sa[k]), k  # negative control: the inputs differ, so does the mean


@pytest.mark.parametrize("model_type", TYPES)
def test_plain_average_of_every_model_type(tmp_path, capsys, model_type):
    folders = save_pair(tmp_path, model_type)
    results = {}
    for mode in ("memory", "stream"):
        out = tmp_path / f"out-{mode}"
        rc, _, err = run(capsys, "merge", *folders, "--method", "average", "--align", "none", "--heads", "merge",
                         "--mode", mode, "--progress", "none", "-o", out)
        assert rc == 0, err
        assert_mean(out, folders)
        results[mode] = json.loads((out / "symmerge_report.json").read_text())
    assert results["memory"]["mode"] == "memory" and results["stream"]["mode"] == "stream"


def test_recommended_falls_back_to_no_alignment_without_a_spec(tmp_path, capsys):
    folders = save_pair(tmp_path, "whisper")
    out = tmp_path / "out"
    rc, _, err = run(capsys, "merge", *folders, "--method", "average", "--heads", "merge", "--progress", "none",
                     "-o", out)
    assert rc == 0, err
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["alignment"]["symmetries"] == [] and "no symmetry spec" in report["alignment"]["note"]
    assert "no symmetry spec for model_type 'whisper'" in err
    assert_mean(out, folders)


@pytest.mark.parametrize("argv", [("merge", "--method", "average", "--align", "attn"), ("align",)])
def test_explicit_alignment_of_a_family_without_spec_is_one_clear_error(tmp_path, capsys, argv):
    folders = save_pair(tmp_path, "whisper")
    out = tmp_path / "out"
    rc, _, err = run(capsys, argv[0], *folders, *argv[1:], "-o", out)
    assert rc == 2 and "unsupported model_type 'whisper'; supported: " in err and "llama" in err
    assert not out.exists()


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_config_without_architectures_is_inferred_from_tensor_names(tmp_path, capsys, mode):
    folders = save_pair(tmp_path, "llama")
    for f in folders:
        config = json.loads((f / "config.json").read_text())
        del config["architectures"]
        (f / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    rc, _, err = run(capsys, "merge", *folders, "--method", "average", "--align", "none", "--heads", "merge",
                     "--mode", mode, "--progress", "none", "-o", out)
    assert rc == 0, err
    for f in folders:  # inputs never modified
        assert "architectures" not in json.loads((f / "config.json").read_text())
    config = json.loads((folders[0] / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (folders[0] / "config.json").write_text(json.dumps(config))
    assert_mean(out, folders)


def test_config_without_architectures_names_what_is_missing(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folders = save_pair(tmp_path, "llama")
    for f in folders:
        config = json.loads((f / "config.json").read_text())
        del config["architectures"]
        (f / "config.json").write_text(json.dumps(config))
        tensors = load_file(f / "model.safetensors")
        del tensors["model.norm.weight"]
        save_file(tensors, str(f / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = run(capsys, "merge", *folders, "--method", "average", "--align", "none", "-o", tmp_path / "out")
    assert rc == 2 and "no architectures" in err and "model.norm.weight" in err and "LlamaForCausalLM" in err
    assert "only in anchor" not in err


def test_barrier_of_a_family_without_spec(tmp_path, capsys):
    """``barrier`` on folders of a model type without a spec: the plain curve; 'recommended' adds none."""
    from symmerge.merge.barrier import barrier_study
    from symmerge.io.data import Batch, Data

    folders = save_pair(tmp_path, "stablelm")
    ids = torch.randint(3, 128, (4, 9), generator=torch.Generator().manual_seed(0))
    data = Data("random ids", "lm", [Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids.clone(),
                                           torch.ones_like(ids, dtype=torch.bool))], n=4)
    res = barrier_study(str(folders[0]), str(folders[1]), data, points=3, progress=False)
    assert list(res["curves"]) == ["none"] and len(res["curves"]["none"]["loss"]) == 3
    assert "no symmetry spec for model_type 'stablelm'" in capsys.readouterr().err



def test_regmean_solves_conv1d_layers_found_by_module_type():
    """GPT-2's Conv1D layers (weights stored in x out) get RegMean's least-squares solution: the merged
    weight satisfies the normal equations (sum G_i) W = sum G_i W_i; before, they were only averaged."""
    from symmerge.io.data import Batch, Data
    from symmerge.merge import get_method
    from symmerge.merge.statistics import InOutGram, gram_stats

    models = [tiny("gpt2", s).double() for s in (0, 1)]
    ids = torch.randint(3, 128, (6, 10), generator=torch.Generator().manual_seed(0))
    data = Data("ids", "lm", [Batch({"input_ids": ids}, ids.clone(), torch.ones_like(ids, dtype=torch.bool))], n=6)
    stats = [gram_stats(m, data, progress=False).means() for m in models]
    key = "transformer.h.0.attn.c_attn.weight"
    assert isinstance(stats[0][key], InOutGram) and stats[0][key].shape == (32, 32)
    sds = [m.state_dict() for m in models]
    keys = [k for k in sds[0] if k != "lm_head.weight"]
    merged = get_method("regmean").merge([{k: sd[k] for k in keys} for sd in sds],
                                         stats=[{k: s[k] for k in keys if k in s} for s in stats], alpha=1.0)
    grams = [s[key].as_subclass(torch.Tensor) for s in stats]
    lhs = (grams[0] + grams[1]) @ merged[key]
    rhs = grams[0] @ sds[0][key] + grams[1] @ sds[1][key]
    torch.testing.assert_close(lhs, rhs, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(merged[key], (sds[0][key] + sds[1][key]) / 2, atol=1e-6)  # not the plain mean


def test_methods_take_the_statistics_objects_the_library_gathers():
    """``get_method(m).merge(..., stats=[Stats, Stats])``: the Stats that ``gram_stats`` / ``fisher_stats`` return
    are read as merge_models reads them (Grams per token), not an AttributeError from inside; a Stats of the wrong
    kind, or anything but a dict, is one error naming it."""
    from symmerge.errors import SymmergeError
    from symmerge.io.data import Batch, Data
    from symmerge.merge import get_method
    from symmerge.merge.statistics import fisher_stats, gram_stats

    models = [tiny("gpt2", s).double() for s in (0, 1)]
    ids = torch.randint(3, 128, (6, 10), generator=torch.Generator().manual_seed(0))
    data = Data("ids", "lm", [Batch({"input_ids": ids}, ids.clone(), torch.ones_like(ids, dtype=torch.bool))], n=6)
    sds = [m.state_dict() for m in models]
    grams = [gram_stats(m, data, progress=False) for m in models]
    assert grams[0].counts and any(c > 1 for c in grams[0].counts.values())  # per token differs from the sums
    regmean = get_method("regmean")
    got = regmean.merge(sds, stats=grams, alpha=0.5)
    want = regmean.merge(sds, stats=[g.means() for g in grams], alpha=0.5)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in got)
    fishers = [fisher_stats(m, data, progress=False) for m in models]
    got = get_method("fisher").merge(sds, stats=fishers)
    want = get_method("fisher").merge(sds, stats=[f.tensors for f in fishers])
    assert all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(SymmergeError, match=r"needs the Gram matrices of every model; stats\[0\] holds Fisher"):
        regmean.merge(sds, stats=fishers)
    with pytest.raises(SymmergeError, match=r"stats\[1\] is a list"):
        regmean.merge(sds, stats=[grams[0].means(), [1, 2]])
