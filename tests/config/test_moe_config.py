"""``symmerge moe CONFIG OUT``: mergekit-moe configs on tiny real Llama / Mistral / Qwen2 models.

* mergekit-moe 0.1.5 as the oracle (run where it is installed: ``/tmp/symmerge-mergekit``, built by .ci/run): for
  the deterministic gate modes every output tensor equal to mergekit's (the routers of ``cheap_embed`` within a
  few float32 roundings: mergekit sums in another order), in float32 and bfloat16;
* a MoE whose experts all equal the base computes the base's function; with ``--align``, experts that are the
  base with its residual stream rotated (the same function in other coordinates: what models trained apart look
  like to each other) are brought back into the base's frame, and the MoE computes the base's function again,
  which it does not without ``--align``;
* every error is one line, and nothing is written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mergekit_oracle as mk
from conftest import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")

HIDDEN = 64


def _model(arch: str, seed: int, **overrides):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    if arch == "qwen2":
        config = Qwen2Config(vocab_size=128, hidden_size=HIDDEN, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False)
    else:
        config = mk._config(arch, 2)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so that folding them is tested
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    return model


def _folder(model, path: Path, dtype=torch.float32) -> Path:
    model.to(dtype).save_pretrained(str(path))
    mk.save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-models")
    out = {}
    for arch in ("mistral", "llama", "qwen2"):
        for i, name in enumerate(("base", "e1", "e2")):
            out[arch, name] = _folder(_model(arch, 10 * len(out) + i), root / f"{arch}-{name}")
    return out


PROMPTS = [(["w5 w6 w7", "w9 w12"], ["w10 w11"]), (["w20 w21"], []), (["w30 w31 w32"], ["w40"])]


def _config(path: Path, base, experts, gate_mode="hidden", dtype="float32", prompts=PROMPTS, **extra) -> Path:
    import yaml

    doc = {"base_model": str(base), "gate_mode": gate_mode, **({"dtype": dtype} if dtype else {}),
           "experts": [{"source_model": str(e), "positive_prompts": prompts[i % 3][0],
                        **({"negative_prompts": prompts[i % 3][1]} if prompts[i % 3][1] else {})}
                       for i, e in enumerate(experts)], **extra}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _state(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    return model, model.state_dict()


def _mergekit_moe(config: Path, out: Path) -> None:
    exe = Path(sys.executable).parent / "mergekit-moe"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(exe), str(config), str(out)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


def _ulps(dtype) -> float:
    return {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]


needs_mergekit = pytest.mark.skipif(not mk.available(), reason="mergekit is not installed in this venv")


@needs_mergekit
@pytest.mark.parametrize("arch,gate_mode,dtype", [
    ("mistral", "hidden", "float32"), ("mistral", "cheap_embed", "float32"),
    ("llama", "hidden", "bfloat16"), ("llama", "cheap_embed", "bfloat16"), ("mistral", "hidden", None)])
def test_same_tensors_as_mergekit_moe(models, tmp_path, arch, gate_mode, dtype):
    experts = [models[arch, "e1"], models[arch, "e2"], models[arch, "base"]]
    config = _config(tmp_path / "moe.yml", models[arch, "base"], experts, gate_mode, dtype, experts_per_token=2)
    _mergekit_moe(config, tmp_path / "theirs")
    assert run_cli("moe", config, tmp_path / "ours", "--progress", "none") == 0
    theirs, t_sd = _state(tmp_path / "theirs")
    ours, o_sd = _state(tmp_path / "ours")
    assert type(ours).__name__ == type(theirs).__name__ == "MixtralForCausalLM"
    for key in ("num_local_experts", "num_experts_per_tok", "hidden_size", "num_hidden_layers", "rms_norm_eps"):
        assert getattr(ours.config, key) == getattr(theirs.config, key), key
    assert o_sd.keys() == t_sd.keys()
    routers = [k for k in o_sd if k.endswith("mlp.gate.weight")]
    assert len(routers) == 2 and len(o_sd) > 10
    for key in o_sd:
        assert o_sd[key].dtype == t_sd[key].dtype, key
        if key in routers and gate_mode == "cheap_embed":  # unit rows: a few roundings of the dtype
            diff = (o_sd[key].float() - t_sd[key].float()).abs().max().item()
            assert diff <= 2 * _ulps(o_sd[key].dtype), (key, diff)
        else:
            assert torch.equal(o_sd[key], t_sd[key]), key
    # the routers are really the prompts' (not all alike), and the output runs
    r = o_sd[routers[0]].float()
    assert (r @ r.T - torch.eye(3)).abs().max() > 0.05 and torch.allclose(r.norm(dim=1), torch.ones(3), atol=1e-2)
    with torch.no_grad():
        assert torch.isfinite(ours(torch.tensor([[1, 5, 6, 7]])).logits.float()).all()


@needs_mergekit
def test_qwen2_moe_with_a_shared_expert_as_mergekit(models, tmp_path):
    """Qwen2-MoE output (a shared expert with residual_scale): every tensor equal to mergekit-moe's, and the output
    loads as Qwen2MoeForCausalLM and runs. (transformers reads the stand-ins' WordLevel tokenizer as a
    Qwen2Tokenizer for a qwen2 model, which maps these words to no token: both tools' router rows are the BOS
    token's; the rows themselves are checked on the Mixtral outputs above.)"""
    base = models["qwen2", "base"]
    config = _config(tmp_path / "moe.yml", base, [models["qwen2", "e1"], models["qwen2", "e2"]], "cheap_embed",
                     prompts=[(["w5 w6"], []), (["w20 w21"], [])],
                     shared_experts=[{"source_model": str(base), "positive_prompts": ["w50"],
                                      "residual_scale": 0.1}])
    _mergekit_moe(config, tmp_path / "theirs")
    assert run_cli("moe", config, tmp_path / "ours", "--progress", "none") == 0
    theirs, t_sd = _state(tmp_path / "theirs")
    ours, o_sd = _state(tmp_path / "ours")
    assert type(ours).__name__ == type(theirs).__name__ == "Qwen2MoeForCausalLM"
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob"):
        assert getattr(ours.config, key) == getattr(theirs.config, key), key
    assert o_sd.keys() == t_sd.keys()
    gates = [k for k in o_sd if k.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))]
    assert len(gates) == 4
    for key in o_sd:
        if key in gates:
            assert (o_sd[key] - t_sd[key]).abs().max() <= 2 * _ulps(torch.float32), key
        else:
            assert torch.equal(o_sd[key], t_sd[key]), key
    down = "model.layers.1.mlp.shared_expert.down_proj.weight"
    assert torch.equal(o_sd[down], _state(base)[1]["model.layers.1.mlp.down_proj.weight"] * 0.1)
    with torch.no_grad():
        assert torch.isfinite(ours(torch.tensor([[1, 5, 6]])).logits).all()


# ---- exact function checks, without mergekit -------------------------------------------------------------

def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(torch.tensor(ids)).logits.double()


IDS = [[1, 5, 9, 17, 33, 64, 100, 7], [1, 99, 3, 4, 50, 21, 8, 12]]


@pytest.mark.parametrize("gate_mode", ["hidden", "cheap_embed", "random"])
def test_experts_equal_to_the_base_compute_the_base_function(models, tmp_path, gate_mode):
    base = models["llama", "base"]
    config = _config(tmp_path / "moe.yml", base, [base, base, base], gate_mode, experts_per_token=2)
    assert run_cli("moe", config, tmp_path / "out", "--progress", "none") == 0
    moe, _ = _state(tmp_path / "out")
    dense, _ = _state(base)
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.num_local_experts == 3
    a, b = _logits(moe, IDS), _logits(dense, IDS)
    assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["gate_mode"] == gate_mode and report["experts_per_token"] == 2


def _rotated_copy(model, seed: int):
    """The same function in other coordinates: the norms folded into the layers that read them (weights 1),
    then the residual stream rotated by a random orthogonal Q (embeddings and readers ·Q, writers Qᵀ·)."""
    import copy

    m = copy.deepcopy(model)
    sd = m.state_dict()
    q, _ = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64))
    q = q.float()
    layers = m.config.num_hidden_layers

    def fold(norm, readers):
        g = sd[norm].clone()
        for r in readers:
            sd[r] = sd[r] * g
        sd[norm] = torch.ones_like(g)

    for i in range(layers):
        p = f"model.layers.{i}."
        fold(p + "input_layernorm.weight", [p + f"self_attn.{x}_proj.weight" for x in "qkv"])
        fold(p + "post_attention_layernorm.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        for r in [p + f"self_attn.{x}_proj.weight" for x in "qkv"] + [p + "mlp.gate_proj.weight",
                                                                       p + "mlp.up_proj.weight"]:
            sd[r] = sd[r] @ q
        for w in (p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"):
            sd[w] = q.T @ sd[w]
    fold("model.norm.weight", ["lm_head.weight"])
    sd["lm_head.weight"] = sd["lm_head.weight"] @ q
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] @ q
    m.load_state_dict(sd)
    return m


def test_align_brings_experts_in_other_coordinates_into_the_base_frame(models, tmp_path):
    dense, _ = _state(models["llama", "base"])
    experts = []
    for i in range(2):
        rotated = _rotated_copy(dense, seed=i)
        assert (_logits(rotated, IDS) - _logits(dense, IDS)).abs().max() < 1e-4  # the same function
        experts.append(_folder(rotated, tmp_path / f"rotated{i}"))
    config = _config(tmp_path / "moe.yml", models["llama", "base"], experts, "cheap_embed")
    assert run_cli("moe", config, tmp_path / "plain", "--progress", "none") == 0
    assert run_cli("moe", config, tmp_path / "aligned", "--align", "--progress", "none") == 0
    reference = _logits(dense, IDS)
    scale = reference.abs().max().item()
    plain = (_logits(_state(tmp_path / "plain")[0], IDS) - reference).abs().max().item()
    aligned = (_logits(_state(tmp_path / "aligned")[0], IDS) - reference).abs().max().item()
    assert plain > 1e-2 * scale  # unaligned, the experts read and write the stream in their own coordinates
    assert aligned <= 1e-4 * scale, (aligned, scale)
    report = json.loads((tmp_path / "aligned" / "symmerge_report.json").read_text())
    assert report["aligned"] and all(a["aligned"] for a in report["alignment"])
    assert all(a["distance_after"] < 1e-3 * a["distance_before"] for a in report["alignment"])


def test_mergekit_moe_flags_are_accepted(models, tmp_path):
    base = models["mistral", "base"]
    config = _config(tmp_path / "moe.yml", base, [models["mistral", "e1"], base], "random")
    argv = ["--i-understand-this-is-not-useful-without-training", "--trust-remote-code", "--lazy-unpickle",
            "--low-cpu-memory", "--no-cuda", "--copy-tokenizer", "--safe-serialization", "--write-model-card",
            "-v", "--quiet", "-j", "1", "--random-seed", "3", "--out-shard-size", "100K", "--load-in-8bit",
            "--transformers-cache", str(tmp_path), "--device", "cpu"]
    assert run_cli("moe", config, tmp_path / "a", *argv) == 0
    assert run_cli("moe", config, "-o", tmp_path / "b", *argv) == 0
    _, a = _state(tmp_path / "a")
    _, b = _state(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)  # --random-seed: reproducible
    assert len(list((tmp_path / "a").glob("model-*.safetensors"))) > 1  # --out-shard-size 100K (100 kB): several shards
    assert (tmp_path / "a" / "mergekit_moe_config.yml").read_text() == config.read_text()
    assert (tmp_path / "a" / "tokenizer.json").is_file()


def test_no_copy_tokenizer_leaves_out_the_tokenizer_only(models, tmp_path):
    """As ``run --no-copy-tokenizer``: the tokenizer files stay out, generation_config.json and the report's
    ``side_files`` stay (both were dropped with the tokenizer)."""
    from symmerge.io.tokenizers import TOKENIZER_FILES

    base = models["mistral", "base"]
    config = _config(tmp_path / "moe.yml", base, [models["mistral", "e1"], base], "random")
    assert run_cli("moe", config, tmp_path / "out", "--no-copy-tokenizer", "--progress", "none") == 0
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert (base / "generation_config.json").is_file() and "generation_config.json" in names
    assert (base / "tokenizer.json").is_file() and not names & set(TOKENIZER_FILES)
    side = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())["side_files"]
    assert "generation_config.json" in side["copied"] and not set(side["copied"]) & set(TOKENIZER_FILES)


# ---- errors: one line, nothing written ----------------------------------------------------------------------

def _one_line_error(capsys, tmp_path, *argv):
    capsys.readouterr()
    rc = run_cli("moe", *argv, "--progress", "none")
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("symmerge: warning:")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("symmerge: error: "), err
    return lines[0]


def test_errors_are_one_line_and_write_nothing(models, tmp_path, capsys):
    base, e1 = models["mistral", "base"], models["mistral", "e1"]
    out = tmp_path / "out"
    wide = _folder(_model("mistral", 5, intermediate_size=96, hidden_size=HIDDEN), tmp_path / "narrow-ffn")
    deep = _folder(_model("mistral", 6, num_hidden_layers=3), tmp_path / "deep")
    other = models["qwen2", "e1"]
    cases = {
        "unknown gate_mode": (_config(tmp_path / "a.yml", base, [e1], "hiden"), "unknown gate_mode 'hiden'"),
        "missing prompts": (tmp_path / "b.yml", "needs positive_prompts"),
        "mismatched layers": (_config(tmp_path / "c.yml", base, [e1, deep], "random"), "num_hidden_layers"),
        "mismatched family": (_config(tmp_path / "d.yml", base, [e1, other], "random"), "mismatched architectures"),
        "expert sizes": (_config(tmp_path / "e.yml", base, [e1, wide], "random"), "intermediate_size"),
        "missing model": (_config(tmp_path / "f.yml", base, [tmp_path / "nowhere"], "random"), "not a model folder"),
        "too many per token": (_config(tmp_path / "g.yml", base, [e1], "random", experts_per_token=3),
                               "experts_per_token 3"),
    }
    cases["zero router row"] = (_config(tmp_path / "z.yml", base, [e1, e1], "cheap_embed",
                                         prompts=[(["w5 w6"], ["w5 w6"]), (["w7"], [])]), "zero router row")
    for who in ("expert", "base"):  # a truncated safetensors file, read by the project's one header reader
        cut = shutil.copytree(e1 if who == "expert" else base, tmp_path / f"cut-{who}")
        weights = cut / "model.safetensors"
        os.truncate(weights, weights.stat().st_size - 64)
        config = (_config(tmp_path / "t1.yml", base, [e1, cut], "random") if who == "expert"
                  else _config(tmp_path / "t2.yml", cut, [e1, e1], "random"))
        cases[f"truncated {who}"] = (config, "unreadable safetensors file, truncated or corrupt")
    (tmp_path / "b.yml").write_text(f"base_model: {base}\ngate_mode: hidden\nexperts:\n  - source_model: {e1}\n")
    for name, (config, words) in cases.items():
        line = _one_line_error(capsys, tmp_path, config, out)
        assert words in line, (name, line)
        assert not out.exists(), name
    assert "line 4" in _one_line_error(capsys, tmp_path, tmp_path / "b.yml", out)  # names the expert's line
    out.mkdir()
    (out / "stale.txt").write_text("x")
    assert "not an empty directory" in _one_line_error(capsys, tmp_path, _config(tmp_path / "h.yml", base, [e1, e1],
                                                                                   "random"), out)


def test_unknown_keys_are_one_warning_each_and_ignored(models, tmp_path, capsys):
    base = models["mistral", "base"]
    config = _config(tmp_path / "moe.yml", base, [base, base], "random", gate_mod="hidden")
    capsys.readouterr()
    assert run_cli("moe", config, tmp_path / "out", "--progress", "none") == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(warnings) == 1 and "gate_mod" in warnings[0] and "did you mean 'gate_mode'" in warnings[0]


@pytest.mark.slow
def test_benchmark_tiny_end_to_end(tmp_path, monkeypatch):
    """benchmarks/moe_build.py --tiny: every MoE built plain and aligned (data-free and from activations), the
    dense endpoints scored, each alignment closer to the base than the expert was."""
    from symmerge.demo import text
    from test_benchmark_smoke import run_tiny

    _, out, r = run_tiny(tmp_path, monkeypatch, text.python_docs_dir, "python-docs", "the Python docs corpus",
                         "moe_build", extra=("--align-examples", "20", "--curve-examples", "20"))
    rows = {(x["model"], x["aligned"]) for x in r["rows"]}
    assert rows == {("A", None), ("B", None)} | {(m, a) for m in ("A+B", "B in A")
                                                 for a in (False, "weights", "activations")}
    for x in r["rows"]:
        assert 0 < x["loss"] < 10 and 0 <= x["accuracy"] <= 1
        for a in x.get("alignment", []):
            assert not a["aligned"] or a["distance_after"] < a["distance_before"]
    assert "| B in A | `--align` (match activations) |" in (out / "tables.md").read_text()
