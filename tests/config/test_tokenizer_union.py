"""``tokenizer_source: union`` / ``tokenizer: {source, tokens, pad_to_multiple_of}``: the output vocabulary and
every model's embedding rows mapped to it (symmerge.config.vocab), by mergekit's rule, compared with mergekit
0.1.5 token by token (its ids of added tokens follow a hash-map order that changes from run to run)."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

import mergekit_oracle as mo
from conftest import run_cli


def _other_tokenizer(folder: Path, dtype: str, seed: int = 5) -> None:
    """Rewrite the model at ``folder`` for another tokenizer: w100 … w127 gone, n0 … n39 new, the ids shuffled,
    an added special token <|im_start|> (vocab_size 141); the shared tokens keep their rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    g = torch.Generator().manual_seed(seed)
    old = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    toks = [t for t in old if not (t.startswith("w") and int(t[1:]) >= 100)] + [f"n{i}" for i in range(40)]
    order = [0, 1, 2] + (3 + torch.randperm(len(toks) - 3, generator=g)).tolist()
    vocab = {toks[j]: i for i, j in enumerate(order)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sd = m.state_dict()
    m.config.vocab_size = len(vocab) + 1
    new = AutoModelForCausalLM.from_config(m.config, dtype=torch.float32)
    nsd = dict(sd)
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = torch.randn(len(vocab) + 1, sd[k].shape[1], generator=g) * 0.02
        for t, i in vocab.items():
            if t in old:
                rows[i] = sd[k][old[t]]
        nsd[k] = rows
    new.load_state_dict(nsd)
    shutil.rmtree(folder)
    new.to(mo.DTYPES[dtype]).save_pretrained(str(folder))
    fast.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("union")
    base, (ft1, ft2) = mo.family(root, "llama", "float32", n=2, layers=2)
    _other_tokenizer(ft2, "float32")
    return str(base), str(ft1), str(ft2)


def _vocab(folder):
    return json.loads((Path(folder) / "tokenizer.json").read_text())


def _ids(folder) -> dict:
    t = _vocab(folder)
    return {**t["model"]["vocab"], **{a["content"]: a["id"] for a in t["added_tokens"]}}


def _by_token(tensors, ids, names=("model.embed_tokens.weight", "lm_head.weight")):
    """The vocabulary tensors' rows keyed by token (the other tensors as they are)."""
    out = {}
    for k, t in tensors.items():
        if k in names:
            for tok, i in ids.items():
                out[(k, tok)] = t[i]
        else:
            out[k] = t
    return out


LINEAR = """
    merge_method: linear
    base_model: {base}
    models:
      - model: {ft1}
        parameters: {{weight: 0.5}}
      - model: {ft2}
        parameters: {{weight: 0.3}}
      - model: {base}
        parameters: {{weight: 0.2}}
    """

CONFIGS = {
    "linear-union": LINEAR + "tokenizer_source: union\n",
    "ties-union": """
        merge_method: ties
        base_model: {base}
        models:
          - model: {ft1}
            parameters: {{weight: 1, density: 0.5}}
          - model: {ft2}
            parameters: {{weight: [0.2, 1], density: 0.7}}
        tokenizer_source: union
        """,
    "tokens-and-padding": LINEAR + """
    tokenizer:
      source: union
      pad_to_multiple_of: 16
      tokens:
        n3: {{source: {ft2}, force: true}}
        w5: {{source: {{kind: zero}}, force: true}}
        <extra>: {{source: {{kind: model_token, model: {ft1}, token: w7}}}}
    """,
    "base-source": LINEAR + "tokenizer_source: base\n",
    "model-source": LINEAR + "tokenizer_source: {ft2}\n",
    "slices": """
        slices:
          - sources: [{{model: {ft2}, layer_range: [0, 1]}}]
          - sources: [{{model: {ft1}, layer_range: [1, 2]}}]
        merge_method: passthrough
        tokenizer_source: union
        """,
}


def _run_ours(text, out):
    cfg = out.parent / f"{out.name}.yml"
    cfg.write_text(textwrap.dedent(text))
    assert run_cli("run", cfg, out, "--progress", "none") == 0
    return out


@pytest.mark.skipif(not mo.available(), reason="needs mergekit (the oracle venv)")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_vocabularies_equal_mergekit_token_by_token(models, tmp_path, name):
    base, ft1, ft2 = models
    text = textwrap.dedent(CONFIGS[name]).format(base=base, ft1=ft1, ft2=ft2)
    ours = _run_ours(text, tmp_path / "ours")
    theirs = mo.run_mergekit(text, tmp_path / "theirs")
    ids_o, ids_t = _ids(ours), _ids(theirs)
    assert set(ids_o) == set(ids_t)
    assert mo.config_of(ours)["vocab_size"] == mo.config_of(theirs)["vocab_size"]
    # the special tokens agree (which plain tokens are 'added' depends, without a base model, on which model
    # mergekit starts the union from: the first of a Python set of models, an order that changes between runs)
    specials = {a["content"] for a in _vocab(theirs)["added_tokens"] if a["special"]}
    assert {a["content"] for a in _vocab(ours)["added_tokens"] if a["special"]} == specials
    a, b = _by_token(mo.tensors(ours), ids_o), _by_token(mo.tensors(theirs), ids_t)
    base_rows = _by_token(mo.tensors(base), {t: i for t, i in _ids(base).items() if t in ids_t})
    gap = mo.relative_gap(a, b, {k: v for k, v in base_rows.items() if k in b})
    assert gap < 1e-5, gap
    size = mo.config_of(theirs)["vocab_size"]
    if size > len(ids_t):  # the padding rows: the mean of the vocabulary's rows
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.allclose(mo.tensors(ours)[k][len(ids_t):], mo.tensors(theirs)[k][len(ids_t):], atol=1e-6)


def test_rows_a_model_lacks_follow_mergekits_rule(models, tmp_path):
    """A token only one model has: every model takes that row; a token the base has: the base's row."""
    base, ft1, ft2 = models
    out = _run_ours(textwrap.dedent(LINEAR).format(base=base, ft1=ft1, ft2=ft2) + "tokenizer_source: union\n",
                    tmp_path / "u")
    ids = _ids(out)
    assert mo.config_of(out)["vocab_size"] == len(ids) == 169 and (out / "tokenizer.json").is_file()
    t = mo.tensors(out)["model.embed_tokens.weight"]
    e = {n: mo.tensors(f)["model.embed_tokens.weight"] for n, f in (("base", base), ("ft1", ft1), ("ft2", ft2))}
    i2 = _ids(ft2)
    assert torch.allclose(t[ids["n0"]], e["ft2"][i2["n0"]], atol=1e-6)  # ft2 alone has n0
    w = ids["w100"]  # ft2 lacks w100: it takes the base's row
    assert torch.allclose(t[w], 0.5 * e["ft1"][w] + 0.3 * e["base"][w] + 0.2 * e["base"][w], atol=1e-6)
    assert [i for tok, i in ids.items() if tok.startswith("w") or tok in ("<unk>", "<s>", "</s>")] == list(range(128))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_ids_to_tokens(tok("w5 n0 <|im_start|>")["input_ids"]) == ["w5", "n0", "<|im_start|>"]


@pytest.mark.parametrize("extra,message", [
    ("tokenizer:\n  source: union\n  tokens:\n    n1: {{source: {{kind: nothing}}}}\n",
     "line 14: tokenizer.tokens.n1.source: 'source' is a model"),
    ("tokenizer:\n  source: union\n  tokens:\n    n1: {{source: {ft1}, force: 2}}\n",
     "line 14: tokenizer.tokens.n1.force: 'force' is true or false"),
    ("tokenizer:\n  source: union\n  pad_to_multiple_of: -3\n", "line 13: tokenizer.pad_to_multiple_of: 'pad_to_multiple_of'"),
    ("tokenizer:\n  source: union\n  tokens:\n    n1: {{source: /no/model}}\n", "is not a folder here"),
])
def test_bad_tokenizer_keys_are_one_error(models, tmp_path, capsys, extra, message):
    base, ft1, ft2 = models
    cfg = tmp_path / "c.yml"
    cfg.write_text(textwrap.dedent(LINEAR).format(base=base, ft1=ft1, ft2=ft2) + extra.format(ft1=ft1))
    assert run_cli("run", cfg, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_padding_rows_beyond_the_tokenizer_are_cut_as_mergekit_does(tmp_path):
    """One vocabulary for all, but embeddings padded beyond the tokenizer's 120 tokens: with a tokenizer source
    the output has one row per token and vocab_size 120 (mergekit's meaning); the rows are the models'."""
    base, fts = mo.family(tmp_path / "fam", "llama", "float32", n=2, layers=2)
    for f in (base, *fts):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (f / name).unlink(missing_ok=True)
        mo.save_tokenizer(f, vocab_size=120)
    text = textwrap.dedent(LINEAR).format(base=base, ft1=fts[0], ft2=fts[1]) + "tokenizer_source: base\n"
    out = _run_ours(text, tmp_path / "ours")
    assert mo.config_of(out)["vocab_size"] == 120
    got = mo.tensors(out)["lm_head.weight"]
    rows = [mo.tensors(f)["lm_head.weight"][:120] for f in (fts[0], fts[1], base)]
    assert got.shape[0] == 120 and torch.allclose(got, 0.5 * rows[0] + 0.3 * rows[1] + 0.2 * rows[2], atol=1e-6)
    if mo.available():
        theirs = mo.run_mergekit(text, tmp_path / "theirs")
        assert mo.config_of(theirs)["vocab_size"] == 120
        assert mo.relative_gap(mo.tensors(out), mo.tensors(theirs), None) < 1e-6
