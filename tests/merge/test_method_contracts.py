"""Methods own their contracts and have one meaning.

* No code outside the methods' home compares a method's name (an AST guard, first shown to fail on a planted
  case): callers read what a method declares (:class:`symmerge.merge.base.Method`: ``base_policy``, ``models``,
  ``weight_required``, ``other_names``, ``copy_unless``, ``needs``).
* A name means one method with one set of defaults: ``symmerge merge --method X --param ...`` and a config with
  ``merge_method: X`` and the same parameters write the same tensors, for every method the command runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from guards import name_comparisons
from symmerge.merge import MERGEKIT_METHODS, METHODS, get_method

ROOT = Path(__file__).resolve().parents[2] / "symmerge"
# the methods' home: the method modules, their parts and kernels, the registry
HOME = {"average.py", "breadcrumbs.py", "dare.py", "dare_ties.py", "della.py", "fisher.py", "ot_fusion.py",
        "regmean.py", "specialized.py", "spherical.py", "task_arithmetic.py", "ties.py", "parts.py", "combination.py",
        "kernels.py", "kernels_whole.py", "kernels_half.py", "sort_order.py", "in_dtype.py", "registry.py", "base.py",
        "__init__.py"}


def _method_name_comparisons(source: str, names) -> list[int]:
    """Lines of ``source`` comparing something with a method's name written out (the guards' one checker,
    :func:`guards.name_comparisons`); a comparison with a statistics' name (``needs == "fisher"``: ``Method.needs``
    reads the statistics vocabulary, which shares that word), nor one with a module's kind (``kind in ("linear",
    "conv1d")``: extract-lora's layer kinds, where "linear" is nn.Linear)."""
    return name_comparisons(source, names, others=("needs", "kind"))


def test_no_code_outside_the_methods_home_compares_a_method_name():
    names = set(METHODS)
    planted = ('if mk_name == "passthrough":\n    pass\nx = name in ("linear", "karcher")\n'
               'ok = m.needs == "fisher"\nMethod("ties", rule)\nif method != "average":\n    pass\n')
    assert _method_name_comparisons(planted, names) == [1, 3, 6]  # the guard can fail; declarations pass
    leaks = [f"{path.relative_to(ROOT)}:{n}" for path in sorted(ROOT.rglob("*.py"))
             if not (path.parent.name == "merge" and path.name in HOME)
             for n in _method_name_comparisons(path.read_text(), names)]
    assert not leaks


def test_contracts_are_declared_on_the_methods():
    policies = {name: get_method(name).base_policy for name in MERGEKIT_METHODS}
    assert {n for n, p in policies.items() if p == "ignored"} == {"linear", "karcher", "passthrough"}
    assert {n for n, p in policies.items() if p == "optional"} == {"nuslerp", "multislerp"}
    assert get_method("average").base_policy == "refused"
    assert get_method("passthrough").models == (1, 1) and get_method("passthrough").copy_unless == "scale"
    assert get_method("dare").params == get_method("dare_linear").params and get_method("dare").name == "dare"
    required = {n for n in MERGEKIT_METHODS if get_method(n).weight_required}
    assert required == {"linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs",
                        "breadcrumbs_ties", "della", "della_linear", "multislerp", "nuslerp"}


def _model(seed: int, folder: Path, base=None) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    if seed:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("contracts")
    return [_model(i, root / f"m{i}") for i in range(3)]  # m0 the base, m1 and m2 fine-tunes of it


# method -> (--param values, uses the base); three models merged where the method takes any number
CASES = {
    "linear": ({}, False), "average": ({}, False), "task_arithmetic": ({"lambda": 0.8}, True),
    "ties": ({"density": 0.5}, True), "dare_ties": ({"density": 0.6, "seed": 3}, True),
    "dare_linear": ({"density": 0.6}, True), "dare": ({"density": 0.6, "rescale": "inverse"}, True),
    "breadcrumbs": ({"density": 0.8, "gamma": 0.05}, True), "breadcrumbs_ties": ({"density": 0.8}, True),
    "della": ({"density": 0.5, "epsilon": 0.1}, True), "della_linear": ({"density": 0.5, "epsilon": 0.1}, True),
    "sce": ({"select_topk": 0.5}, True), "model_stock": ({}, True), "ram": ({"epsilon": 0.001}, True),
    "ramplus_tl": ({}, True), "nuslerp": ({}, False), "multislerp": ({}, True), "karcher": ({}, False),
}


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_command_and_a_config_mean_the_same_method(name, llamas, tmp_path):
    from symmerge.cli import main

    params, uses_base = CASES[name]
    base, fts = llamas[0], llamas[1:]
    cli = tmp_path / "cli"
    argv = ["merge", *fts, "--method", name, "--align", "none", "--weights", "0.6,0.4", "-o", str(cli),
            "--progress", "none"]
    if uses_base:
        argv += ["--base", base]
    for k, v in params.items():
        argv += ["--param", f"{k}={v}"]
    assert main(argv) == 0
    config = {"merge_method": name, "dtype": "float32",
              "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(fts, (0.6, 0.4))],
              **({"base_model": base} if uses_base else {}), **({"parameters": params} if params else {})}
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    assert main(["run", str(path), str(run), "--progress", "none"]) == 0
    ours, theirs = _tensors(cli), _tensors(run)
    assert set(ours) == set(theirs)
    before = _tensors(Path(base))
    assert any(not torch.equal(ours[k], before[k]) for k in ours)  # a merge, not a copy of the base
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    report = json.loads((cli / "symmerge_report.json").read_text())
    assert report["method"] == name
