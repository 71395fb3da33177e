"""``symmerge extract-lora``: a PEFT adapter of the task vector. PEFT loads it on the base and reproduces the fine-tune
exactly when every layer's task vector has rank <= R (Llama, and GPT-2 with its Conv1D layers and biases; embeddings
as LoRA with --embed-lora); the error of a full-rank task vector falls with the rank and is the Eckart–Young tail of
its singular values; mergekit-extract-lora's flags; one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from symmerge.cli import main  # noqa: E402
from symmerge.errors import SymmergeError  # noqa: E402
from symmerge.merge.extract_lora import ExtractOptions, extract_lora  # noqa: E402
from test_lora import make_base, ours  # noqa: E402


def make_finetune(base, folder, ranks, embed_rank=None, noise=0.02, seed=7):
    """The base with a task vector of rank ``ranks[i % len(ranks)]`` on the i-th linear layer (and of rank
    ``embed_rank`` on the embeddings, else a full-rank change), its norms and biases changed too."""
    from transformers import AutoModelForCausalLM

    from symmerge.io.hf import linear_output_axis

    model = AutoModelForCausalLM.from_pretrained(str(base))
    g = torch.Generator().manual_seed(seed)
    i = 0
    with torch.no_grad():
        emb = model.get_input_embeddings()
        for name, module in model.named_modules():
            w = getattr(module, "weight", None)
            if not isinstance(w, torch.Tensor) or not isinstance(w, torch.nn.Parameter):
                continue
            if module is emb or isinstance(module, torch.nn.Embedding):
                r = embed_rank
            elif linear_output_axis(module) is not None:
                r = ranks[i % len(ranks)]
                i += 1
            else:
                r = None
            if w.dim() == 2 and r is not None:
                delta = torch.randn(w.shape[0], r, generator=g) @ torch.randn(r, w.shape[1], generator=g)
                w.add_(noise * delta / max(r, 1) ** 0.5)
            else:
                w.add_(noise * torch.randn(w.shape, generator=g))
            b = getattr(module, "bias", None)
            if isinstance(b, torch.Tensor):
                b.add_(noise * torch.randn(b.shape, generator=g))
    model.save_pretrained(str(folder))
    return Path(folder)


def peft_loaded(base, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)).eval()


@pytest.mark.parametrize("arch,embed_lora", [("llama", False), ("llama", True), ("gpt2", False)])
def test_peft_reproduces_the_finetune_when_its_rank_fits(tmp_path, arch, embed_lora):
    """Task vectors of ranks 1..3 per layer, R = 3: PEFT's model (base + adapter, unmerged and merged) computes the
    fine-tune's logits, and every merged tensor is the fine-tune's (float32 rounding); layers of lower rank get it in
    rank_pattern with --sv-epsilon; GPT-2's Conv1D layers and bias changes (lora_bias) are kept exactly."""
    from transformers import AutoModelForCausalLM

    base = make_base(tmp_path / "base", arch)
    ft = make_finetune(base, tmp_path / "ft", ranks=[1, 2, 3], embed_rank=2 if embed_lora else None)
    report = extract_lora(ft, base, tmp_path / "ad", ExtractOptions(rank=3, embed_lora=embed_lora, sv_epsilon=1e-5,
                                                                     progress=False))
    cfg = json.loads((tmp_path / "ad/adapter_config.json").read_text())
    assert cfg["r"] == 3 and sorted(set(cfg["rank_pattern"].values())) == [1, 2]
    assert cfg["lora_bias"] == (arch == "gpt2")
    assert max(r["relative_error"] for r in report["modules"]) < 1e-5
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    want = AutoModelForCausalLM.from_pretrained(str(ft)).eval()
    pm = peft_loaded(base, tmp_path / "ad")
    with torch.no_grad():
        ref = want(ids).logits
        assert torch.allclose(pm(ids).logits, ref, atol=1e-4, rtol=1e-4)
        merged = pm.merge_and_unload()
        assert torch.allclose(merged(ids).logits, ref, atol=1e-4, rtol=1e-4)
    sd, ft_sd = merged.state_dict(), ours(ft)
    for k, v in ft_sd.items():
        assert torch.allclose(sd[k], v, atol=2e-6, rtol=1e-5), k
    if embed_lora:
        assert any("lora_embedding_A" in k for k in _keys(tmp_path / "ad"))
        assert "embed_tokens" not in (cfg["modules_to_save"] or [])


def _keys(folder):
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "adapter_model.safetensors"), "pt") as f:
        return list(f.keys())


def test_error_falls_with_rank_as_eckart_young(tmp_path):
    """A full-rank task vector: each layer's relative error is √(Σ_{i>r} s_i² / Σ s_i²) of its own singular values
    (computed here independently), strictly smaller at each larger rank, 0 at full rank."""
    from safetensors.torch import load_file

    base = make_base(tmp_path / "base")
    ft = make_finetune(base, tmp_path / "ft", ranks=[32])
    b, f = load_file(str(base / "model.safetensors")), load_file(str(ft / "model.safetensors"))
    previous = None
    for rank in (1, 4, 16, 64):
        report = extract_lora(ft, base, tmp_path / f"r{rank}", ExtractOptions(rank=rank, progress=False))
        errors = {r["module"]: r["relative_error"] for r in report["modules"]}
        for name, err in errors.items():
            s = torch.linalg.svdvals((f[name + ".weight"] - b[name + ".weight"]).double())
            tail = float((s[rank:] ** 2).sum() / (s ** 2).sum()) ** 0.5
            assert err == pytest.approx(tail, abs=1e-5), (name, rank)
        if previous is not None:
            assert all(errors[n] < previous[n] or previous[n] < 1e-5 for n in errors)
        previous = errors
    assert max(previous.values()) < 1e-5  # rank 64 >= every layer's full rank


def test_cli_flags_and_report(tmp_path, capsys):
    """mergekit-extract-lora's spelling (--model, --base-model, --out-path, --max-rank, -e, -i, --save-module,
    --no-distribute-scale, --skip-undecomposable, no-op flags) works; the table is printed; the report has every
    module's error; include/exclude regexes choose the modules."""
    base = make_base(tmp_path / "base")
    ft = make_finetune(base, tmp_path / "ft", ranks=[2])
    out = tmp_path / "ad"
    assert main(["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out),
                 "--max-rank", "2", "-i", r"self_attn", "-e", r"layers\.1\.", "--save-module", "lm_head",
                 "--no-distribute-scale", "--skip-undecomposable", "--lazy-unpickle", "--random-seed", "3",
                 "--out-shard-size", "5B", "--no-copy-tokenizer", "-j", "1", "--progress", "none"]) == 0
    printed = capsys.readouterr().out
    assert "q_proj" in printed and "mean error" in printed and "wrote" in printed
    report = json.loads((out / "symmerge_report.json").read_text())
    names = [r["module"] for r in report["modules"]]
    assert names and all("self_attn" in n and "layers.0." in n for n in names)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["embed_tokens", "lm_head"]  # embeddings whole, norms skipped
    assert "model.layers.0.self_attn.q_proj" in cfg["target_modules"]  # layers.1's q_proj left out: full names
    keys = _keys(out)
    assert not any("layernorm" in k for k in keys)
    from safetensors.torch import load_file

    t = load_file(str(out / "adapter_model.safetensors"))
    B = t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.allclose(B.T @ B, torch.eye(2), atol=1e-5)  # --no-distribute-scale: B = U, orthonormal columns
    pm = peft_loaded(base, out)  # loads
    assert pm is not None
    assert (out / "README.md").is_file()


@pytest.mark.parametrize("argv,message", [
    (["--rank", "0"], "argument --rank/--max-rank: must be >= 1, got 0"),  # the flags' ranges: argparse's lines
    (["--rank", "-3"], "argument --rank/--max-rank: must be >= 1, got -3"),
    (["--sv-epsilon", "-1"], "argument --sv-epsilon: must be >= 0, got -1"),
    (["-e", "("], "not a regular expression"),
    (["--allow-crimes"], "--allow-crimes"),
    (["--no-safe-serialization"], "safetensors only"),
])
def test_bad_flags_one_line(tmp_path, capsys, argv, message):
    base = make_base(tmp_path / "base")
    capsys.readouterr()
    try:
        rc = main(["extract-lora", str(base), str(base), "-o", str(tmp_path / "o"), *argv, "--progress", "none"])
    except SystemExit as e:  # argparse's refusal of a flag's value
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    heading = "symmerge extract-lora: error: " if message.startswith("argument ") else "symmerge: error:"
    assert rc == 2 and len(err) == 1 and err[0].startswith(heading) and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_mismatched_models_and_outputs_are_refused(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = make_base(tmp_path / "base")
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "wide"))
    gpt2 = make_base(tmp_path / "gpt2", "gpt2")
    capsys.readouterr()
    for other, message in ((tmp_path / "wide", "mismatched shapes"), (gpt2, "one architecture")):
        assert main(["extract-lora", str(other), str(base), "-o", str(tmp_path / "o"), "--progress", "none"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "o").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SymmergeError, match="refusing to overwrite"):
        extract_lora(base, base, tmp_path / "full", ExtractOptions(progress=False))
    assert main(["extract-lora", str(base), "-o", str(tmp_path / "o")]) == 2
    assert "give the fine-tuned model and its base" in capsys.readouterr().err


def test_finetune_given_as_base_plus_adapter_round_trips(tmp_path):
    """extract-lora of BASE+ADAPTER against BASE recovers the adapter's update: a LoRA of rank 2 extracted at rank 2
    reproduces the merged model."""
    from test_lora import make_adapter

    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "lora", r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    report = extract_lora(f"{base}+{adapter}", base, tmp_path / "ad", ExtractOptions(rank=2, progress=False))
    assert max(r["relative_error"] for r in report["modules"]) < 1e-5
    changed = [r for r in report["modules"] if r["task_vector_norm"] > 0]
    assert sorted({r["module"].split(".")[-1] for r in changed}) == ["down_proj", "q_proj"]


def test_lowrank_svd_is_exact_on_low_rank_and_near_optimal_otherwise(tmp_path):
    """--svd lowrank: a task vector of rank <= R is recovered exactly; a full-rank one within 5 % of the optimal
    (Eckart–Young) error, never below it; a seed gives the same adapter again."""
    from safetensors.torch import load_file

    base = make_base(tmp_path / "base")
    low = make_finetune(base, tmp_path / "low", ranks=[1, 2])
    report = extract_lora(low, base, tmp_path / "a", ExtractOptions(rank=4, svd="lowrank", progress=False))
    assert max(r["relative_error"] for r in report["modules"]) < 1e-5
    full = make_finetune(base, tmp_path / "full", ranks=[64])
    b, f = load_file(str(base / "model.safetensors")), load_file(str(full / "model.safetensors"))
    for seed, out in ((0, "b"), (0, "c")):
        report = extract_lora(full, base, tmp_path / out, ExtractOptions(rank=4, svd="lowrank", seed=seed,
                                                                          progress=False))
        for r in report["modules"]:
            s = torch.linalg.svdvals((f[r["module"] + ".weight"] - b[r["module"] + ".weight"]).double())
            tail = float((s[4:] ** 2).sum() / (s ** 2).sum()) ** 0.5
            assert tail - 1e-5 <= r["relative_error"] <= 1.05 * tail, r["module"]
    same = [load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in "bc"]
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[0])


def test_regexes_that_match_no_module(tmp_path, capsys):
    """``-i bogus`` (the only include pattern) matches no module: one line, nothing written (it wrote an adapter of
    the embeddings alone, '0/0 module', exit 0); an include or exclude pattern that matches nothing beside others that
    do is a warning in the report and printed."""
    base = make_base(tmp_path / "base")
    ft = make_finetune(base, tmp_path / "ft", ranks=[2])
    capsys.readouterr()
    rc = main(["extract-lora", str(ft), str(base), "-o", str(tmp_path / "o"), "--rank", "2", "-i", "bogus",
               "--progress", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--include-regex 'bogus' matches no module" in err[0], err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SymmergeError, match="matches no module"):
        extract_lora(ft, base, tmp_path / "o", ExtractOptions(rank=2, include_regexes=("bogus", "nada"),
                                                              progress=False))
    report = extract_lora(ft, base, tmp_path / "o", ExtractOptions(rank=2, include_regexes=("q_proj", "bogus"),
                                                                   exclude_regexes=("nada",), progress=False))
    assert report["modules"] and all("q_proj" in r["module"] for r in report["modules"])
    assert [w.split(":")[0] for w in report["warnings"]] == ["--include-regex 'bogus'", "--exclude-regex 'nada'"]


@pytest.mark.parametrize("device, message", [("bogus", "unknown device 'bogus'"), (3.5, "unknown device 3.5"),
                                             ("meta", "unknown device 'meta'")])  # meta holds no values: was taken
def test_a_device_torch_cannot_name_is_one_error_when_the_options_are_made(device, message):
    """``ExtractOptions(device="bogus")`` was torch's ``RuntimeError`` from inside the first SVD batch."""
    with pytest.raises(SymmergeError, match=message):
        ExtractOptions(device=device)


def test_the_final_line_names_what_was_saved_whole(tmp_path, capsys):
    """``--save-module lm_haed`` (a misspelling): a warning, and the final line's "saved whole (...)" lists the modules
    saved (embed_tokens), not the misspelt name modules_to_save keeps as mergekit keeps it."""
    base = make_base(tmp_path / "base")
    ft = make_finetune(base, tmp_path / "ft", ranks=[2])
    capsys.readouterr()
    assert main(["extract-lora", str(ft), str(base), "-o", str(tmp_path / "o"), "--rank", "2", "--save-module",
                 "lm_haed", "--progress", "none"]) == 0
    captured = capsys.readouterr()
    assert "--save-module lm_haed: no module of the fine-tune is named so" in captured.err
    last = captured.out.strip().splitlines()[-1]
    assert "saved whole (" in last and "lm_haed" not in last, last
    assert "lm_haed" in json.loads((tmp_path / "o" / "adapter_config.json").read_text())["modules_to_save"]
