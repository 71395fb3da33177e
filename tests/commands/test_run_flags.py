"""mergekit-yaml's whole command line on ``symmerge run`` (symmerge/commands/run.py): every flag of
``mergekit-yaml --help`` (0.1.5) is accepted, each with its effect or as the no-op docs/configs.md says (then
the output is bit for bit the one without it); a usage error is one line naming ``run``. ``run`` writes the
model card, ``mergekit_config.yml`` and ``symmerge_report.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    base, fts = mo.family(tmp_path_factory.mktemp("flags"), "llama", "float32", n=2, layers=2)
    return str(base), str(fts[0]), str(fts[1])


@pytest.fixture(scope="module")
def config(fam, tmp_path_factory):
    base, a, b = fam
    path = tmp_path_factory.mktemp("cfg") / "dare.yml"
    path.write_text(f"merge_method: dare_ties\nbase_model: {base}\nmodels:\n  - model: {a}\n    parameters: "
                    f"{{weight: 0.6, density: 0.5}}\n  - model: {b}\n    parameters: {{weight: 0.4, density: 0.7}}\n"
                    "dtype: float32\n")
    return path


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    assert run_cli("run", config, out, "--progress", "none") == 0
    return out


def _same(a, b):
    ta, tb = mo.tensors(a), mo.tensors(b)
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


NO_OPS = [["--lazy-unpickle"], ["--no-lazy-unpickle"], ["--low-cpu-memory"], ["--read-to-gpu"], ["--multi-gpu"],
          ["--no-multi-gpu"], ["--async-write"], ["--no-async-write"], ["--write-threads", "3"], ["--clone-tensors"],
          ["--no-clone-tensors"], ["--safe-serialization"], ["--allow-crimes"], ["--no-allow-crimes"],
          ["--no-cuda"], ["--no-unsafe-truncate-embeddings"], ["--trust-remote-code"], ["--no-trust-remote-code"],
          ["--no-quiet"],
          ["--lora-merge-cache", "LORA"], ["--lora-merge-dtype", "bfloat16"], ["--copy-tokenizer"],
          ["--write-model-card"], ["--transformers-cache", "CACHE"]]


@pytest.mark.parametrize("flags", NO_OPS, ids=[" ".join(f) for f in NO_OPS])
def test_flags_that_change_nothing(config, reference, tmp_path, flags):
    flags = [str(tmp_path / f) if f in ("LORA", "CACHE") else f for f in flags]
    out = tmp_path / "out"
    assert run_cli("run", config, out, "--progress", "none", *flags) == 0
    _same(out, reference)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no cache or LoRA folder made


def test_the_model_card_the_config_and_the_report(config, reference, tmp_path):
    """By default (--write-model-card) README.md and mergekit_config.yml, as mergekit; the report always."""
    names = {p.name for p in reference.iterdir()}
    assert {"README.md", "mergekit_config.yml", "symmerge_report.json", "config.json", "tokenizer.json"} <= names
    assert (reference / "mergekit_config.yml").read_text() == Path(config).read_text()
    report = json.loads((reference / "symmerge_report.json").read_text())
    assert report["config"]["merge_method"] == "dare_ties" and report["config"]["tensors"] == 21
    assert report["method"] == "dare_ties" and report["mode"] == "stream" and report["base"].endswith("base")
    assert len(report["models"]) == 2 and set(report["distance_result_to_inputs"]) == set(report["models"])
    card = (reference / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "`merge_method: dare_ties`" in card
    assert "symmerge_report.json" in card
    out = tmp_path / "out"
    assert run_cli("run", config, out, "--progress", "none", "--no-write-model-card") == 0
    names = {p.name for p in out.iterdir()}
    assert "README.md" not in names and "mergekit_config.yml" not in names and "symmerge_report.json" in names
    _same(out, reference)


def test_no_copy_tokenizer(config, reference, tmp_path):
    out = tmp_path / "out"
    assert run_cli("run", config, out, "--progress", "none", "--no-copy-tokenizer") == 0
    names = {p.name for p in out.iterdir()}
    assert not names & {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    _same(out, reference)
    from symmerge.io.tokenizers import TOKENIZER_FILES

    assert names == {p.name for p in reference.iterdir()} - set(TOKENIZER_FILES)  # every other side file stays
    copied = json.loads((out / "symmerge_report.json").read_text())["side_files"]["copied"]
    assert copied and not set(copied) & set(TOKENIZER_FILES)  # the report names only what the output has


def test_out_shard_size(config, reference, tmp_path):
    out = tmp_path / "out"
    assert run_cli("run", config, out, "--progress", "none", "--out-shard-size", "100K") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    for s in shards:  # mergekit's K: 1000 bytes; a shard holds one tensor when that alone is larger
        from safetensors import safe_open

        with safe_open(str(out / s), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        assert len(sizes) == 1 or (out / s).stat().st_size <= 100_000 + 10_000
    _same(out, reference)


def test_random_seed(config, reference, tmp_path):
    outs = []
    for i, seed in enumerate(("1", "1", "2")):
        out = tmp_path / f"out{i}"
        assert run_cli("run", config, out, "--progress", "none", "--random-seed", seed) == 0
        outs.append(mo.tensors(out))
    k = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(outs[0][k], outs[1][k]) and not torch.equal(outs[0][k], outs[2][k])


def test_random_seed_beside_a_config_seed_says_the_config_wins(config, tmp_path, capsys):
    """The config's own 'seed' is the more specific setting and wins, as before; the flag it overrides is one
    warning line naming the file, not silence."""
    seeded = tmp_path / "seeded.yml"
    seeded.write_text(config.read_text() + "parameters: {seed: 5}\n")
    outs = []
    for flags in ([], ["--random-seed", "7"], ["--random-seed", "5"]):
        capsys.readouterr()
        assert run_cli("run", seeded, tmp_path / f"o{len(outs)}", "--progress", "none", *flags) == 0
        outs.append(mo.tensors(tmp_path / f"o{len(outs)}"))
        warned = [x for x in capsys.readouterr().err.splitlines() if "--random-seed" in x]
        assert warned == ([f"symmerge: warning: {seeded} line 1: --random-seed 7 is not used for 'dare_ties': the "
                           "config sets its 'seed' (5), which wins; the flag seeds only a merge whose config sets none"]
                          if flags[1:] == ["7"] else []), warned
    assert all(torch.equal(outs[0][k], o[k]) for o in outs[1:] for k in outs[0])


@pytest.mark.parametrize("flags", [["--cuda"], ["--gpu-rich"], ["--device", "cpu"], ["--device", "cpu:0"]])
def test_cuda_and_device(config, reference, tmp_path, capsys, flags):
    """The GPU when there is one (the result then within float32's rounding of the CPU's); without one,
    --cuda warns and merges on the CPU (bit for bit). ``--device cpu:0`` runs the arithmetic through the same
    device wrapper as the GPU (config/run.py: computing_on), on the CPU: bit for bit the plain merge."""
    out = tmp_path / "out"
    assert run_cli("run", config, out, "--progress", "none", *flags) == 0
    err = capsys.readouterr().err
    if torch.cuda.is_available() and flags[0] != "--device":
        gap = mo.relative_gap(mo.tensors(out), mo.tensors(reference))
        assert gap < 1e-6, gap
    else:
        _same(out, reference)
        assert ("no CUDA device here" in err) == (flags[0] != "--device")
        if flags[0] != "--device":  # the warning names the flag given (--gpu-rich was named --cuda)
            assert f"symmerge: warning: {flags[0]}: no CUDA device here" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_device_cuda_without_a_gpu_is_one_error(config, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # read by the flag: argparse's line, naming the command and the flag
        run_cli("run", config, tmp_path / "o", "--device", "cuda")
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "no CUDA device is available" in err and err.count("\n") == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", ["-j", "--num-threads"])
def test_num_threads(config, reference, tmp_path, flag, monkeypatch):
    """The merge runs on the threads asked for, and the caller's thread count is back after it (``main`` in a
    caller's process: symmerge.core.parallel.threads_kept). It asserted 1 after the call, which held only when an
    earlier test had left torch on one thread."""
    restore = torch.get_num_threads()
    real = torch.set_num_threads
    real(2)  # the caller's count, other than the one asked for
    before, seen = torch.get_num_threads(), []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    try:
        out = tmp_path / "out"
        assert run_cli("run", config, out, "--progress", "none", flag, "1") == 0
        assert 1 in seen and torch.get_num_threads() == before, (seen, before)
        _same(out, reference)
    finally:
        real(restore)


def test_quiet_and_verbose(config, tmp_path, capfd):
    assert run_cli("run", config, tmp_path / "q", "--quiet") == 0
    assert capfd.readouterr().err == ""
    assert run_cli("run", config, tmp_path / "v", "-v") == 0
    err = capfd.readouterr().err
    assert err and "\r" not in err  # progress as lines


def test_no_safe_serialization_warns_and_writes_safetensors(config, reference, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli("run", config, out, "--progress", "none", "--no-safe-serialization") == 0
    assert "symmerge writes safetensors only" in capsys.readouterr().err
    _same(out, reference)


def test_bad_flag_values_are_one_line(config, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # the flag's declared range: argparse's line
        run_cli("run", config, tmp_path / "o", "--num-threads", "0")
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1
    assert err.startswith("symmerge run: error: argument -j/--num-threads: must be >= 1, got 0"), err
    assert not (tmp_path / "o").exists()


def test_unsafe_truncate_embeddings(fam, tmp_path):
    """Models whose vocabulary tensors have more rows than the smallest one's are cut to it (the first rows,
    the same token ids assumed); without the flag, one error naming the shapes."""
    from transformers import AutoModelForCausalLM

    base, a, b = fam
    big = tmp_path / "big"
    m = AutoModelForCausalLM.from_pretrained(b)
    m.resize_token_embeddings(136)
    m.save_pretrained(str(big))
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"merge_method: linear\nmodels: [{{model: {a}}}, {{model: {big}}}]\nparameters: {{weight: 0.5}}\n")
    assert run_cli("run", cfg, tmp_path / "refused", "--progress", "none") == 2
    out = tmp_path / "out"
    assert run_cli("run", cfg, out, "--progress", "none", "--unsafe-truncate-embeddings") == 0
    ours, ta, tb = mo.tensors(out), mo.tensors(a), mo.tensors(big)
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        assert ours[k].shape[0] == 128 and torch.allclose(ours[k], 0.5 * ta[k] + 0.5 * tb[k][:128], atol=1e-7)
    assert mo.config_of(out)["vocab_size"] == 128


def test_a_usage_error_is_one_line_naming_run(capsys):
    with pytest.raises(SystemExit) as e:
        run_cli("run", "x.yml", "out", "--no-such-flag")
    assert e.value.code == 2
    assert capsys.readouterr().err == ("symmerge run: error: unrecognized arguments: --no-such-flag "
                                       "(see symmerge run --help)\n")


def test_every_flag_of_mergekit_yaml_is_a_flag_of_run():
    """The flags mergekit-yaml 0.1.5's --help lists (written out here; the mergekit venv checks the list against
    mergekit's own parser: tests/config/test_published_configs.py)."""
    from symmerge.cli import build_parser

    run = build_parser().parse_args(["run", "c.yml"]).subparsers["run"]
    ours = {f for a in run._actions for f in a.option_strings}
    assert not set(MERGEKIT_YAML_FLAGS) - ours, sorted(set(MERGEKIT_YAML_FLAGS) - ours)


MERGEKIT_YAML_FLAGS = (
    "--allow-crimes", "--no-allow-crimes", "--unsafe-truncate-embeddings", "--no-unsafe-truncate-embeddings",
    "--trust-remote-code", "--no-trust-remote-code", "--transformers-cache", "--lora-merge-cache",
    "--lora-merge-dtype", "--random-seed", "-v", "--quiet", "--no-quiet", "--cuda", "--no-cuda", "--device",
    "--low-cpu-memory", "--no-low-cpu-memory", "--lazy-unpickle", "--no-lazy-unpickle", "--read-to-gpu",
    "--no-read-to-gpu", "--multi-gpu", "--no-multi-gpu", "-j", "--num-threads", "--gpu-rich", "--async-write",
    "--no-async-write", "--write-threads", "--out-shard-size", "--copy-tokenizer", "--no-copy-tokenizer",
    "--clone-tensors", "--no-clone-tensors", "--write-model-card", "--no-write-model-card", "--safe-serialization",
    "--no-safe-serialization", "--help")


def test_symmerge_yaml_is_mergekit_yamls_command_line(config, reference, tmp_path):
    from symmerge.commands.run import yaml_main

    out = tmp_path / "out"
    assert yaml_main([str(config), str(out), "--copy-tokenizer", "--lazy-unpickle", "--quiet"]) == 0
    _same(out, reference)
