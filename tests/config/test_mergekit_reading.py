"""A mergekit config is read as mergekit reads it (symmerge/config/lenient.py, config/mergekit.py): a stray key
or an unknown method parameter is one warning line and changes nothing (the merge is bit for bit the one
without it); numbers written as YAML-1.1 strings, truthy numbers, ``modules: {default: ...}``, built-in chat
templates by name and an earlier merge with another vocabulary as input all run. (mergekit's own results on
the same configs: tests/config/test_published_configs.py, in the venv that has mergekit.)"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    base, fts = mo.family(tmp_path_factory.mktemp("reading"), "llama", "float32", n=2, layers=4)
    return str(base), str(fts[0]), str(fts[1])


def _run(tmp_path, text, name, *flags, code=0):
    cfg = tmp_path / f"{name}.yml"
    cfg.write_text(textwrap.dedent(text))
    out = tmp_path / name
    assert run_cli("run", cfg, out, "--progress", "none", *flags) == code
    return out


def _same(a, b):
    ta, tb = mo.tensors(a), mo.tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


TIES = """
    merge_method: ties
    base_model: {base}
    models:
      - model: {a}
        parameters: {{weight: 1.0, density: 0.5{extra_model}}}
      - model: {b}
        parameters: {{weight: 0.5, density: {density}}}
    parameters:
      normalize: {normalize}
      {extra_top}
    dtype: bfloat16
    """


def _ties(fam, density="0.7", normalize="true", extra_model="", extra_top=""):
    base, a, b = fam
    return TIES.format(base=base, a=a, b=b, density=density, normalize=normalize, extra_model=extra_model,
                       extra_top=extra_top)


def test_a_stray_key_is_one_warning_and_changes_nothing(fam, tmp_path, capsys):
    plain = _run(tmp_path, _ties(fam), "plain")
    capsys.readouterr()
    text = _ties(fam) + "tokenzer_source: base\n"
    typo = _run(tmp_path, text, "typo")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("symmerge: warning: ") and "line 13: tokenzer_source: not a mergekit key (did you mean " \
        "'tokenizer_source'?); ignored, as mergekit ignores it" in err[0], err
    _same(plain, typo)


def test_unknown_method_parameters_are_warnings_and_ignored(fam, tmp_path, capsys):
    plain = _run(tmp_path, _ties(fam), "plain")
    capsys.readouterr()
    text = _ties(fam, extra_model=", normalise: true, lambda: 2", extra_top="embed_slerp: true")
    odd = _run(tmp_path, text, "odd")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("symmerge: warning: ") for e in err), err
    assert any("models[0].parameters.normalise: not a parameter of method 'ties' (did you mean 'normalize'?)" in e
               for e in err), err
    assert any("parameters.embed_slerp: not a parameter of method 'ties'; ignored" in e for e in err), err
    assert any("models[0].parameters.lambda: 'lambda' is one value for the whole merge" in e for e in err), err
    _same(plain, odd)


def test_embed_slerp_on_slerp(fam, tmp_path, capsys):
    base, a, _ = fam
    text = f"merge_method: slerp\nbase_model: {base}\nmodels: [{{model: {base}}}, {{model: {a}}}]\n" \
           "parameters: {t: [0, 0.5, 1]}\ndtype: float16\n"
    plain = _run(tmp_path, text, "plain")
    odd = _run(tmp_path, text.replace("{t: [0, 0.5, 1]}", "{t: [0, 0.5, 1], embed_slerp: true}"), "odd")
    assert "embed_slerp: not a parameter of method 'slerp'" in capsys.readouterr().err
    _same(plain, odd)


@pytest.mark.parametrize("written,meant", [
    (dict(density='"7e-1"'), dict(density="0.7")),       # YAML 1.1: PyYAML reads 7e-1 as a string
    (dict(density="7e-1"), dict(density="0.7")),
    (dict(normalize="1.0"), dict(normalize="true")),     # truthy numbers, as a lax validator reads a bool
    (dict(normalize="0"), dict(normalize="false")),
    (dict(normalize='"yes"'), dict(normalize="true")),
])
def test_values_read_by_the_parameters_type(fam, tmp_path, capsys, written, meant):
    ours = _run(tmp_path, _ties(fam, **written), "written")
    want = _run(tmp_path, _ties(fam, **meant), "meant")
    assert "warning" not in capsys.readouterr().err
    _same(ours, want)


def test_a_float_written_1e_minus_10_is_a_number(fam, tmp_path):
    base, a, b = fam
    text = f"merge_method: nearswap\nbase_model: {base}\nmodels: [{{model: {base}}}, {{model: {a}}}]\n" \
           "parameters: {t: T}\n"
    _same(_run(tmp_path, text.replace("T", "1e-10"), "string"), _run(tmp_path, text.replace("T", "1.0e-10"), "float"))


def test_a_value_that_is_no_number_is_still_an_error(fam, tmp_path, capsys):
    base, a, b = fam
    cfg = tmp_path / "bad.yml"
    cfg.write_text(_ties(fam, density='"dense"'))
    assert run_cli("run", cfg, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "models[1].parameters.density" in err and err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_modules_default_is_the_top_level_form(fam, tmp_path):
    """``modules: {default: {slices, parameters}}``: the same merge as ``slices`` at the top, the module's
    parameters between a slice's and the top level's."""
    base, a, b = fam
    top = ("merge_method: linear\nslices:\n  - sources:\n"
           f"      - {{model: {a}, layer_range: [0, 4]}}\n      - {{model: {b}, layer_range: [0, 4]}}\n"
           "parameters:\n  weight: [{filter: mlp, value: 0.3}, {value: 0.6}]\n")
    mod = ("merge_method: linear\nmodules:\n  default:\n    slices:\n      - sources:\n"
           f"          - {{model: {a}, layer_range: [0, 4]}}\n          - {{model: {b}, layer_range: [0, 4]}}\n"
           "    parameters:\n      weight: [{filter: mlp, value: 0.3}]\nparameters:\n  weight: 0.6\n")
    _same(_run(tmp_path, top, "top"), _run(tmp_path, mod, "module"))


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral", "alpaca", "exaone"])
def test_built_in_chat_templates_by_name(fam, tmp_path, name):
    from transformers import AutoTokenizer

    base, a, b = fam
    out = _run(tmp_path, f"merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 0.5}}\n"
                         f"chat_template: {name}\n", name)
    tok = AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    expected = {
        "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                  "Yo<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
        "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
                  "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant"
                  "<|end_header_id|>\n\n",
        "mistral": "<s>[INST] Be brief.\n\nHi [/INST]Yo</s>[INST] 2+2? [/INST]",
        "alpaca": "Be brief.\n\n### Instruction:\nHi\n\n### Response:\nYo</s>\n\n### Instruction:\n2+2?\n\n"
                  "### Response:\n",
        "exaone": "[|system|]Be brief.[|endofturn|]\n[|user|]Hi\n[|assistant|]Yo[|endofturn|]\n[|user|]2+2?\n"
                  "[|assistant|]",
    }[name]
    assert text == expected


def test_an_earlier_merge_with_another_vocabulary_as_input(fam, tmp_path):
    """A later merge takes an earlier one (union vocabulary) as input and maps it back to the base's
    vocabulary: the same model as running the two configs one after the other."""
    from test_tokenizer_union import _other_tokenizer

    import shutil

    base, a, b = fam
    other = tmp_path / "other"
    shutil.copytree(b, other)
    _other_tokenizer(other, "float32")
    first = (f"name: first\nmerge_method: linear\nmodels: [{{model: {a}}}, {{model: {other}}}]\n"
             "parameters: {weight: 0.5}\ntokenizer_source: union\n")
    final = (f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n  - model: first\n    parameters: "
             f"{{weight: 0.7}}\n  - model: {a}\n    parameters: {{weight: 0.3}}\ntokenizer_source: base\n")
    both = _run(tmp_path, first + "---\n" + final, "both")
    one = _run(tmp_path, first.replace("name: first\n", ""), "first")
    two = _run(tmp_path, final.replace("model: first", f"model: {one}"), "second")
    _same(both, two)
    assert mo.config_of(both)["vocab_size"] == 128 and mo.config_of(one)["vocab_size"] > 128


def test_a_mergekit_moe_config_points_to_symmerge_moe(fam, tmp_path, capsys):
    base, a, b = fam
    cfg = tmp_path / "moe.yml"
    cfg.write_text(f"base_model: {base}\ngate_mode: hidden\ndtype: bfloat16\nexperts:\n  - source_model: {a}\n"
                   "    positive_prompts: [code]\n")
    assert run_cli("run", cfg, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "line 2: a mergekit-moe config (gate_mode, experts)" in err and "symmerge moe CONFIG OUT" in err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_symmerge_keys_still_make_a_symmerge_config(fam, tmp_path):
    """What a file is comes from what it holds: symmerge's own option (eval_data) makes it symmerge's; a typo
    does not."""
    from symmerge.config import describe

    base, a, b = fam
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"merge_method: linear\nmodels: [{a}, {b}]\nparameters: {{weight: 1}}\nevl_data: x.npz\n")
    desc = describe(cfg, output=tmp_path / "o")
    assert desc.mergekit and "did you mean 'eval_data'" in desc.warnings[0]
    cfg.write_text(f"merge_method: linear\nmodels: [{a}, {b}]\neval_data: x.npz\n")
    assert not describe(cfg, output=tmp_path / "o").mergekit
