"""A mergekit config with ``align:`` (or ``symmerge run --align``): the models aligned into one frame first, then
the whole config language (gradients, filters, per-model parameters, slices) on the aligned models — the same
tensors as ``symmerge align`` followed by the plain config on the aligned folders, in memory and streamed."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def strangers(tmp_path_factory):
    """Two tiny Llamas of different seeds (alignment moves them) and a third, as folders."""
    root = tmp_path_factory.mktemp("strangers")
    return [str(mo.family(root / f"m{s}", "llama", "float32", n=0, layers=4, seed=s)[0]) for s in (0, 7, 11)]


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


GRADIENT = textwrap.dedent("""
    merge_method: linear
    models:
      - model: {a}
        parameters: {{weight: [0, 0.3, 0.7, 1]}}
      - model: {b}
        parameters:
          weight: [{{filter: mlp, value: 0.8}}, {{value: 0.4}}]
    """)


def _same(x, y):
    tx, ty = mo.tensors(x), mo.tensors(y)
    assert tx.keys() == ty.keys()
    for k in tx:
        assert torch.equal(tx[k], ty[k]), k


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_aligned_gradient_and_filter_equal_align_then_plain_config(strangers, tmp_path, mode):
    a, b, _ = strangers
    cfg = _write(tmp_path / "aligned.yml", GRADIENT.format(a=a, b=b) + f"align: [attn, ffn]\nmode: {mode}\n")
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none") == 0
    # the expectation: a aligned to b (the anchor of two) by symmerge align, then the plain config
    extra = ["--stream"] if mode == "stream" else []
    assert run_cli("align", a, b, "-o", tmp_path / "a-aligned", "--symmetries", "attn,ffn", "--progress", "none",
                   *extra) == 0
    plain = _write(tmp_path / "plain.yml", GRADIENT.format(a=tmp_path / "a-aligned", b=b))
    assert run_cli("run", plain, tmp_path / "expected", "--progress", "none") == 0
    _same(tmp_path / "out", tmp_path / "expected")
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["alignment"]["symmetries"] == ["attn", "ffn"] and report["alignment"]["mode"] == mode
    assert report["alignment"]["anchor"]["rule"] == "second of two"
    # alignment moved a: the result differs from the unaligned config's
    assert run_cli("run", _write(tmp_path / "u.yml", GRADIENT.format(a=a, b=b)), tmp_path / "unaligned",
                   "--progress", "none") == 0
    assert mo.relative_gap(mo.tensors(tmp_path / "out"), mo.tensors(tmp_path / "unaligned")) > 1e-2
    assert not [p.name for p in tmp_path.iterdir() if ".symmerge-tmp-" in p.name]  # temporary folders removed


def test_align_flag_and_slices_keep_each_models_function(strangers, tmp_path):
    """A frankenmerge of aligned models: whole models aligned before slicing; a slice of all of a's layers
    (with a's embeddings and head) computes a's function, though its tensors moved."""
    from transformers import AutoModelForCausalLM

    a, b, _ = strangers
    cfg = _write(tmp_path / "slices.yml", f"""
        slices:
          - sources: [{{model: {a}, layer_range: [0, 4]}}]
        merge_method: passthrough
        """)
    # one model: nothing to align
    assert run_cli("run", cfg, tmp_path / "one", "--align", "attn,ffn", "--progress", "none") == 0
    both = _write(tmp_path / "both.yml", f"""
        slices:
          - sources: [{{model: {a}, layer_range: [0, 4]}}]
          - sources: [{{model: {b}, layer_range: [4, 4]}}]
        merge_method: passthrough
        """)
    both.write_text(both.read_text().replace("[4, 4]", "[3, 4]"))
    assert run_cli("run", both, tmp_path / "franken", "--align", "attn,ffn", "--progress", "none") == 0
    cfgd = json.loads((tmp_path / "franken" / "config.json").read_text())
    assert cfgd["num_hidden_layers"] == 5
    # b is the anchor (second of two); a was moved: its layers in the output differ from a's, its function not
    ta, tf = mo.tensors(a), mo.tensors(tmp_path / "franken")
    k = "model.layers.1.mlp.up_proj.weight"
    assert not torch.equal(ta[k], tf[k])
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100]])
    m_a = AutoModelForCausalLM.from_pretrained(a).eval()
    m_f = AutoModelForCausalLM.from_pretrained(tmp_path / "franken").eval()
    first4 = AutoModelForCausalLM.from_pretrained(tmp_path / "one").eval()
    with torch.no_grad():
        ref = m_a(ids).logits
        assert torch.allclose(first4(ids).logits, ref)  # nothing aligned: a's copy
        # the franken model's embeddings and first four layers are a's, aligned: with a's final norm and head
        # (the last slice's, b's, in the output) they compute a's function
        sd = {k: v for k, v in m_f.state_dict().items() if not k.startswith("model.layers.4.")}
        sd.update({k: v for k, v in m_a.state_dict().items() if k.startswith(("model.norm.", "lm_head."))})
        m_a.load_state_dict(sd)
        assert torch.allclose(m_a(ids).logits, ref, atol=1e-4, rtol=1e-4)


def test_slices_of_models_of_two_shapes_are_one_error(strangers, tmp_path, capsys):
    a = strangers[0]
    deep = str(mo.family(tmp_path / "deep", "llama", "float32", n=0, layers=6, seed=3)[0])
    cfg = _write(tmp_path / "c.yml", f"""
        slices:
          - sources: [{{model: {a}, layer_range: [0, 2]}}]
          - sources: [{{model: {deep}, layer_range: [2, 6]}}]
        merge_method: passthrough
        align: recommended
        """)
    capsys.readouterr()
    assert run_cli("run", cfg, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "line 6: 'align' brings whole models into one frame" in err and "one architecture" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,message", [
    ("align: [attn, ffn]\nanchor: 5\n", "line 10: anchor index 5 out of range for the 2 merged model(s)"),
    ("align: [attn, ffn]\nrescale: wobbly\n", "line 10: argument --rescale: invalid choice"),
    ("align: [wobble]\n", "line 9: "),
    ("align: [attn, ffn]\nstar: maybe\n", "line 10: 'star' is a switch"),
    # the alignment keys follow the options schema: the data-free search's and learn_layerwise are keys too
    ("align: [attn, ffn]\nrestarts: -1\n", "line 10: --restarts must be >= 0, got -1"),
    ("align: [attn, ffn]\nsolver_budget: soon\n", "line 10: "),
])
def test_bad_alignment_keys_name_their_line(strangers, tmp_path, capsys, text, message):
    a, b, _ = strangers
    cfg = _write(tmp_path / "c.yml", GRADIENT.format(a=a, b=b) + text)
    assert run_cli("run", cfg, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


TIES = textwrap.dedent("""
    merge_method: ties
    base_model: {base}
    models:
      - model: {a}
        parameters: {{weight: 1.0, density: [1, 0.7, 0.1]}}
      - model: {b}
        parameters: {{weight: [{{filter: self_attn, value: 0.5}}, {{value: 1}}], density: 0.5}}
    parameters: {{normalize: true}}
    """)


def test_with_a_base_every_model_is_aligned_to_it(strangers, tmp_path, capsys):
    """A base model is the frame (as symmerge merge's): each fine-tune aligned to it, then TIES with per-model
    density gradients and a filtered weight; 'recommended' with a base aligns nothing (one line says why)."""
    a, b, base = strangers
    cfg = _write(tmp_path / "ties.yml", TIES.format(base=base, a=a, b=b) + "align: [attn, ffn]\n")
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none") == 0
    for name, m in (("a", a), ("b", b)):
        assert run_cli("align", m, base, "-o", tmp_path / name, "--symmetries", "attn,ffn", "--progress", "none") == 0
    plain = _write(tmp_path / "plain.yml", TIES.format(base=base, a=tmp_path / "a", b=tmp_path / "b"))
    assert run_cli("run", plain, tmp_path / "expected", "--progress", "none") == 0
    _same(tmp_path / "out", tmp_path / "expected")
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["alignment"]["anchor"]["rule"] == "base model"
    capsys.readouterr()
    cfg = _write(tmp_path / "rec.yml", TIES.format(base=base, a=a, b=b) + "align: recommended\n")
    assert run_cli("run", cfg, tmp_path / "rec", "--progress", "none") == 0
    assert "nothing aligned (note: 'recommended' aligns nothing when a --base is given" in capsys.readouterr().out
    assert run_cli("run", _write(tmp_path / "u.yml", TIES.format(base=base, a=a, b=b)), tmp_path / "u",
                   "--progress", "none") == 0
    _same(tmp_path / "rec", tmp_path / "u")

