"""``--align-data generate[:N[:LEN[:SEED]]]``: alignment data sampled from the causal LMs themselves
(:mod:`symmerge.io.generate`). The spec's parsing, determinism and shapes, the round-robin share between
the models, the KV-cache loop against a full recompute, one clear error for models without an LM head,
and the sequences feeding activation matching, the learned alignment, REPAIR and the CLI's checks. Tiny
random Llamas: seconds."""

from __future__ import annotations

import argparse

import pytest
import torch

from factories import make_model
from symmerge.errors import SymmergeError
from symmerge.io.generate import draw, generate_data, is_generate, parse_generate, sample

pytestmark = pytest.mark.usefixtures("single_thread")


def _pair():
    return tuple(make_model("llama", head=True, seed=s, dtype=torch.float32) for s in (0, 1))


def test_parse_generate_defaults_values_and_errors():
    assert parse_generate("generate") == (256, 16, 0)
    assert parse_generate("generate:10") == (10, 16, 0)
    assert parse_generate("generate:10:5:7") == (10, 5, 7)
    assert is_generate("generate:3") and is_generate("generate")
    assert not is_generate("generated.txt") and not is_generate("data.txt") and not is_generate(None)
    for bad, msg in (("generate:x", "whole number"), ("generate:0", "N must be >= 1"),
                     ("generate:4:1", "LEN must be >= 2"), ("generate:4:4:-1", "SEED"),
                     ("generate:1:2:3:4", "expected generate")):
        with pytest.raises(SymmergeError, match=msg):
            parse_generate(bad)


def test_generated_data_is_deterministic_shaped_and_shared_out():
    a, b = _pair()
    d = generate_data([a, b], n=7, length=6, seed=3, batch_size=4)
    ids = torch.cat([x.inputs["input_ids"] for x in d.batches])
    assert d.format == "lm" and not d.labeled and d.n == 7 and [x.size for x in d.batches] == [4, 3]
    assert ids.shape == (7, 6) and ids.dtype == torch.long and int(ids.max()) < a.config.vocab_size
    assert all(x.mask.all() and x.labels is None and x.inputs["attention_mask"].all() for x in d.batches)
    assert (ids[:, 0] == a.config.bos_token_id).all()  # every sequence starts from BOS
    again = torch.cat([x.inputs["input_ids"] for x in generate_data([a, b], 7, 6, seed=3).batches])
    assert torch.equal(ids, again)
    other = torch.cat([x.inputs["input_ids"] for x in generate_data([a, b], 7, 6, seed=4).batches])
    assert not torch.equal(ids, other)
    # round-robin: sequences 0, 2, 4, 6 from A (drawn first), 1, 3, 5 from B, from one generator
    g = torch.Generator().manual_seed(3)
    from_a, from_b = sample(a, 4, 6, g), sample(b, 3, 6, g)
    assert torch.equal(ids[0::2], from_a) and torch.equal(ids[1::2], from_b)
    # the models' own distributions: A's sequences are likelier under A than B's are (temperature 1)
    big = generate_data([a, b], 40, 12, seed=0)
    x = torch.cat([t.inputs["input_ids"] for t in big.batches])
    with torch.no_grad():
        logp = torch.log_softmax(a(input_ids=x).logits[:, :-1].double(), -1).gather(-1, x[:, 1:, None])[..., 0]
    assert logp[0::2].mean() > logp[1::2].mean()


def test_the_kv_cache_loop_draws_what_a_full_recompute_draws():
    a, _ = _pair()
    ids = sample(a, 5, 9, torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    ref = torch.full((5, 1), a.config.bos_token_id, dtype=torch.long)
    with torch.no_grad():
        for _ in range(8):  # no cache: the whole prefix every step
            ref = torch.cat([ref, draw(a(input_ids=ref).logits[:, -1], g)], 1)
    assert torch.equal(ids, ref)


def test_the_gumbel_max_draw_follows_the_softmax():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]]).repeat(20000, 1)
    ids = draw(logits, torch.Generator().manual_seed(0))[:, 0]
    freq = torch.bincount(ids, minlength=4).double() / len(ids)
    p = torch.softmax(logits[0].double(), -1)
    assert (freq - p).abs().max() < 0.01  # 20 000 draws: standard error <= 0.0035
    assert not torch.allclose(freq, torch.full((4,), 0.25, dtype=torch.float64), atol=0.05)  # not uniform
    # a tiny vocabulary drawn at its mode only when one logit dominates
    assert (draw(torch.tensor([[0.0, 60.0, 0.0]]).repeat(50, 1), torch.Generator().manual_seed(1)) == 1).all()


def test_models_without_a_causal_lm_head_are_one_error():
    a, _ = _pair()
    with pytest.raises(SymmergeError, match="causal language models.*LlamaModel"):
        generate_data([a, make_model("llama", head=False, dtype=torch.float32)], 4, 4)
    with pytest.raises(SymmergeError, match="causal language models.*BertForSequenceClassification"):
        generate_data([make_model("bert", head=True, dtype=torch.float32)], 4, 4)
    with pytest.raises(SymmergeError, match="exceeds the model's context"):
        generate_data([a], 2, a.config.max_position_embeddings + 1)


def test_generated_sequences_feed_activations_learned_and_repair():
    from symmerge.merge.barrier import barrier_study
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    a, b = _pair()
    for match, learn in (("activations", None), ("learned", LearnSettings(steps=2, batch=4, check_batches=1))):
        res = align_pair(a, b, AlignOptions(symmetries="recommended", match=match, align_data="generate:8:6",
                                            learn=learn))
        assert res.report["align_samples_used"] == 8 and res.report["align_data"] == "generate:8:6:0"
        assert res.report["verify_max_abs_diff"] < 1e-3  # A's function kept (float32)
        if match == "learned":
            assert res.report["learned"]["steps"] == 2
    ids = torch.randint(3, a.config.vocab_size, (6, 8), generator=torch.Generator().manual_seed(0))
    from symmerge.io.data import Batch, Data

    held_out = Data("held-out", "lm", [Batch({"input_ids": ids}, ids, torch.ones_like(ids, dtype=torch.bool))], 6)
    study = barrier_study(a, b, held_out, aligns=("recommended",), points=3, progress=False, repair=True,
                          align=AlignOptions(match="activations", align_data="generate:8:6"))
    assert any(k.endswith("+repair") for k in study["curves"])


def test_the_cli_checks_the_spec_before_loading_any_model():
    from symmerge.commands.alignment_args import add_alignment_arguments, alignment_options

    p = argparse.ArgumentParser()
    add_alignment_arguments(p)
    args = p.parse_args(["--match", "activations", "--align-data", "generate:16:8"])
    assert alignment_options(args, "recommended").align_data == "generate:16:8"
    with pytest.raises(SymmergeError, match="LEN must be >= 2"):
        alignment_options(p.parse_args(["--match", "learned", "--align-data", "generate:16:1"]), "recommended")
    with pytest.raises(SymmergeError, match="--align-data generate"):
        alignment_options(p.parse_args(["--match", "activations"]), "recommended")


def test_merge_samples_once_from_every_model_and_repairs_on_it(monkeypatch):
    from symmerge.io import generate
    from symmerge.merge.fuse import merge_models
    from symmerge.pipeline.options import AlignOptions

    a, b = _pair()
    calls = []
    real = generate.generate_data

    def counted(models, *args, **kw):
        calls.append(len(models))
        return real(models, *args, **kw)

    monkeypatch.setattr(generate, "generate_data", counted)
    monkeypatch.setattr("symmerge.pipeline.data.generate_data", counted)
    merged, rep = merge_models([a, b], "average", evaluate_result=False, progress=False, repair=True,
                               align=AlignOptions(symmetries="recommended", match="activations",
                                                  align_data="generate:6:5:2"))
    assert calls == [2]  # sampled once, from both models, for the alignment and REPAIR alike
    assert rep["repair"]["modules"] > 0
    assert any(m.get("align_data") == "generate:6:5:2" for m in rep["alignment"]["models"])


def test_benchmark_rows_parse_or_fail_before_any_work():
    from benchmarks.llama_generated import parse_args, parse_row

    assert parse_row("activations@64:32") == ("activations", 64, 32, None)
    assert parse_row("learned@64:32:40") == ("learned", 64, 32, 40)
    for bad in ("activations@64", "learned@64:32", "activations@64:32:5", "weights@8:8", "learned"):
        with pytest.raises(SystemExit):
            parse_row(bad)
    assert parse_args(["--rows", "activations@8:4"]).rows == ["activations@8:4"]


def test_the_repair_flags_reach_merge_and_barrier(capsys):
    """``--repair-channels`` and ``--repair-samples`` (the corpus-free recipe's REPAIR: ffn, norm and qk on
    the first sequences): parsed and checked on the CLI, and what merge_models and barrier_study run."""
    from symmerge.cli import build_parser
    from symmerge.commands.merge import options_from
    from symmerge.merge.barrier import barrier_study
    from symmerge.merge.fuse import merge_models
    from symmerge.pipeline.options import AlignOptions

    base = ["merge", "x", "y", "-o", "out", "--method", "average", "--match", "activations", "--align-data", "generate:8:6", "--repair"]
    opts = options_from(build_parser().parse_args(base + ["--repair-channels", "ffn,norm,qk", "--repair-samples", "4"]))
    assert opts.repair_channels == ("ffn", "norm", "qk") and opts.repair_samples == 4
    with pytest.raises(SystemExit):  # read by the flag: argparse's line, naming the command and the flag
        options_from(build_parser().parse_args(base + ["--repair-channels", "ffn,attn"]))
    assert "argument --repair-channels: unknown REPAIR channels 'attn'" in capsys.readouterr().err
    a, b = _pair()
    align = AlignOptions(symmetries="recommended", match="activations", align_data="generate:8:6")
    _, rep = merge_models([a, b], "average", evaluate_result=False, progress=False, repair=True, align=align,
                          repair_channels=("ffn", "norm", "qk"), repair_samples=4)
    assert rep["repair"]["channels"] == ["ffn", "norm", "qk"] and rep["repair"]["examples"] == 4
    assert set(rep["repair"]["std_ratio_before"]) == {"ffn", "norm", "qk"}
    with pytest.raises(SymmergeError, match="REPAIR samples must be >= 1"):
        merge_models([a, b], "average", evaluate_result=False, progress=False, repair=True, align=align,
                     repair_samples=0)
    ids = torch.randint(3, a.config.vocab_size, (6, 8), generator=torch.Generator().manual_seed(0))
    from symmerge.io.data import Batch, Data

    held_out = Data("held-out", "lm", [Batch({"input_ids": ids}, ids, torch.ones_like(ids, dtype=torch.bool))], 6)
    curves = {}
    for channels in (None, ("ffn", "norm", "qk")):
        study = barrier_study(a, b, held_out, aligns=("recommended",), points=3, progress=False, repair=True,
                              align=align, repair_channels=channels, repair_samples=4)
        name = next(k for k in study["curves"] if k.endswith("+repair") and not k.startswith("none"))
        curves[channels] = study["curves"][name]["loss"][1]
    assert curves[None] != pytest.approx(curves[("ffn", "norm", "qk")], rel=1e-9)  # qk changed the midpoint
