"""The alignment flags shared by ``align``, ``merge`` and ``barrier`` (contracts): ``--residual``,
``--untie``, ``--max-sweeps``, ``--match``, ``--align-data``, ``--align-samples``, ``--learn-*`` and
``--repair`` — what each does to the output and the report, and one clear error for misuse."""

import json

import numpy as np
import pytest
import torch

from conftest import hf_load, npz_eval, npz_file, output_rel_diff, run_cli, save_folder, vit_folder

pytestmark = pytest.mark.usefixtures("single_thread")  # no thread count checked here; 2-3x faster on 2 loaded cores


@pytest.fixture
def pair(tmp_path):
    return vit_folder(tmp_path / "a", 0), vit_folder(tmp_path / "b", 1)


def report_of(folder):
    return json.loads((folder / "symmerge_report.json").read_text())


def pixels(n=4, seed=5):
    rng = np.random.default_rng(seed)
    return {"pixel_values": torch.tensor(rng.standard_normal((n, 1, 8, 8)), dtype=torch.float32)}


def test_align_defaults_to_the_recommended_set_with_the_largest_residual_group(pair, tmp_path):
    a, b = pair
    assert run_cli("align", a, b, "-o", tmp_path / "out") == 0
    rep = report_of(tmp_path / "out")
    assert rep["symmetries_requested"] == "recommended"
    assert rep["symmetries"] == ["heads", "attn", "ffn", "rescale", "residual"]
    assert rep["residual_variant"] == "centered"  # pre-LN LayerNorm, norms folded: O(d-1)
    assert rep["match"] == "weights" and 1 <= rep["sweeps"] <= 200
    assert rep["distance_after"] < rep["distance_before"]
    assert output_rel_diff(hf_load(a), hf_load(tmp_path / "out"), pixels()) < 1e-4


def test_residual_permutation_flag_restricts_the_stream_group(pair, tmp_path):
    a, b = pair
    assert run_cli("align", a, b, "-o", tmp_path / "big", "--symmetries", "attn,ffn,residual") == 0
    assert run_cli("align", a, b, "-o", tmp_path / "perm", "--symmetries", "attn,ffn,residual",
                   "--residual", "permutation") == 0
    big, perm = report_of(tmp_path / "big"), report_of(tmp_path / "perm")
    assert (big["residual_variant"], perm["residual_variant"]) == ("centered", "permutation")
    assert big["norms_folded"] and not perm["norms_folded"]
    for rep in (big, perm):
        assert rep["distance_after"] < rep["distance_before"]
    for out in ("big", "perm"):
        assert output_rel_diff(hf_load(a), hf_load(tmp_path / out), pixels()) < 1e-4


def test_max_sweeps_caps_the_descent(pair, tmp_path, recwarn):
    a, b = pair
    assert run_cli("align", a, b, "-o", tmp_path / "out", "--symmetries", "attn,ffn,residual",
                   "--max-sweeps", "1") == 0
    rep = report_of(tmp_path / "out")
    assert rep["sweeps"] == 1 and len(rep["residual_sweeps_sq_distance"]) == 1


def test_untie_gives_a_tied_gpt2_the_full_stream_group(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, initializer_range=0.3)
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(cfg)
        with torch.no_grad():  # a trained final norm (a fresh one, γ = 1 and β = 0, would fold into anything)
            model.transformer.ln_f.weight.uniform_(0.5, 1.5)
            model.transformer.ln_f.bias.normal_(0, 0.1)
        folders.append(save_folder(model, tmp_path / "ab"[seed]))
    a, b = folders
    assert run_cli("align", a, b, "-o", tmp_path / "tied", "--symmetries", "attn,ffn,residual") == 0
    assert run_cli("align", a, b, "-o", tmp_path / "free", "--symmetries", "attn,ffn,residual", "--untie") == 0
    tied, free = report_of(tmp_path / "tied"), report_of(tmp_path / "free")
    assert tied["residual_variant"] == "permutation" and not tied["untied"]
    assert free["residual_variant"] == "centered" and free["untied"] is True
    ids = {"input_ids": torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(3))}
    for out in ("tied", "free"):
        assert output_rel_diff(hf_load(a), hf_load(tmp_path / out), ids) < 1e-4
    aligned = hf_load(tmp_path / "free")
    assert aligned.lm_head.weight.data_ptr() != aligned.transformer.wte.weight.data_ptr()


def test_match_activations_and_learned_use_the_align_data_only(pair, tmp_path):
    a, b = pair
    data = npz_file(tmp_path / "unlabeled.npz", n=30, seed=4)
    assert run_cli("align", a, b, "-o", tmp_path / "act", "--match", "activations", "--align-data", data,
                   "--align-samples", "12") == 0
    rep = report_of(tmp_path / "act")
    assert rep["match"] == "activations" and rep["align_samples_used"] == 12
    assert run_cli("align", a, b, "-o", tmp_path / "learn", "--match", "learned", "--align-data", data,
                   "--learn-steps", "3", "--learn-seed", "1") == 0
    rep = report_of(tmp_path / "learn")
    assert rep["match"] == "learned" and rep["align_samples_used"] == 30
    assert rep["learned"]["steps"] <= 3
    for out in ("act", "learn"):
        assert output_rel_diff(hf_load(a), hf_load(tmp_path / out), pixels()) < 1e-4


def test_merge_with_activations_and_repair(pair, tmp_path):
    a, b = pair
    data = npz_file(tmp_path / "unlabeled.npz", n=24, seed=4)
    held_out = npz_file(tmp_path / "test.npz", n=16, seed=9)
    assert run_cli("merge", a, b, "--method", "average", "--match", "activations", "--align-data", data,
                   "--repair", "--eval-data", held_out, "-o", tmp_path / "m") == 0
    rep = report_of(tmp_path / "m")
    assert rep["alignment"]["models"][0]["match"] == "activations"
    assert rep["repair"] and rep["repair"]["examples"] == 24
    loss, acc = npz_eval(hf_load(tmp_path / "m"), held_out)
    assert rep["evaluation"]["merged"][0]["loss"] == pytest.approx(loss, rel=1e-4)
    # without REPAIR the merge differs (REPAIR changed weights and biases)
    assert run_cli("merge", a, b, "--method", "average", "--match", "activations", "--align-data", data,
                   "-o", tmp_path / "plain") == 0
    plain, repaired = hf_load(tmp_path / "plain").state_dict(), hf_load(tmp_path / "m").state_dict()
    assert any(not torch.equal(plain[k], repaired[k]) for k in plain)


def test_barrier_repair_curves_and_the_evaluation_data_kept_apart(pair, tmp_path):
    a, b = pair
    data = npz_file(tmp_path / "unlabeled.npz", n=24, seed=4)
    held_out = npz_file(tmp_path / "test.npz", n=16, seed=9)
    assert run_cli("barrier", a, b, "--data", held_out, "--align", "attn,ffn", "--match", "activations",
                   "--align-data", data, "--repair", "--points", "3", "-o", tmp_path / "s") == 0
    study = json.loads((tmp_path / "s" / "barrier.json").read_text())
    assert set(study["curves"]) == {"none", "attn,ffn", "none+repair", "attn,ffn+repair"}
    assert study["curves"]["attn,ffn"]["match"] == "activations"
    assert study["curves"]["attn,ffn"]["align_samples_used"] == 24
    assert study["examples"] == 16


@pytest.mark.parametrize("argv, message", [
    (["--match", "learned"], "--align-data"),
    (["--match", "activations"], "--align-data"),
    (["--learn-steps", "5"], "--match learned only"),
    (["--align-data", "missing.npz", "--match", "activations"], "not found"),
    (["--residual", "rotation"], "invalid choice"),
    (["--stream", "--match", "activations", "--align-data", "X.npz"], "--stream matches weights only"),
])
def test_misuse_is_one_clear_error_and_no_output(pair, tmp_path, capsys, argv, message):
    a, b = pair
    if "X.npz" in argv:
        argv = [npz_file(tmp_path / "X.npz") if x == "X.npz" else x for x in argv]
    out = tmp_path / "out"
    try:
        code = run_cli("align", a, b, "-o", out, *argv)
    except SystemExit as e:  # argparse's choices
        code = e.code
    assert code != 0
    err = capsys.readouterr().err
    assert message in err
    assert not out.exists() or not any(out.iterdir())


def test_merge_repair_needs_align_data(pair, tmp_path, capsys):
    a, b = pair
    assert run_cli("merge", a, b, "--method", "average", "--repair", "-o", tmp_path / "m") != 0
    assert "--repair needs unlabeled data" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() or not any((tmp_path / "m").iterdir())


def test_workers_flag_on_merge_and_barrier_changes_nothing_but_the_threads(pair, tmp_path, capsys):
    """``--workers`` (shared by align, merge and barrier): one thread or a pool, the same merged weights
    and the same barrier; a count below 1 is one clear error."""
    from safetensors.torch import load_file

    a, b = pair
    for w in ("1", "3"):
        assert run_cli("merge", a, b, "--method", "average", "--workers", w, "-o", tmp_path / f"m{w}") == 0
    one, three = (load_file(str(tmp_path / f"m{w}" / "model.safetensors")) for w in ("1", "3"))
    assert one.keys() == three.keys() and all(torch.equal(one[k], three[k]) for k in one)
    data = npz_file(tmp_path / "eval.npz", n=16)
    curves = {}
    for w in ("1", "2"):
        out = tmp_path / f"b{w}"
        assert run_cli("barrier", a, b, "--data", data, "--points", "3", "--workers", w, "-o", out) == 0
        curves[w] = json.loads((out / "barrier.json").read_text())
    assert set(curves["1"]["curves"]) == set(curves["2"]["curves"]) == {"none", "heads,attn,ffn,rescale,residual"}
    for name in curves["1"]["curves"]:
        c1, c2 = curves["1"]["curves"][name], curves["2"]["curves"][name]
        assert c1["loss"] == c2["loss"] and c1["barrier"] == c2["barrier"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # the flag's declared range: argparse's line
        run_cli("merge", a, b, "--method", "average", "--workers", "0", "-o", tmp_path / "bad")
    assert refused.value.code == 2 and "argument --workers: must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_learn_flags_map_to_learn_settings_with_the_same_defaults(tmp_path):
    """Every ``--learn-*`` flag sets its LearnSettings field; left out, the field keeps its Python default;
    given without ``--match learned`` it is one clear error naming the flag."""
    import argparse
    import dataclasses

    from symmerge.commands.alignment_args import LEARN_FLAGS, add_alignment_arguments, alignment_options
    from symmerge.errors import SymmergeError
    from symmerge.pipeline.options import LearnSettings

    parser = argparse.ArgumentParser()
    add_alignment_arguments(parser)
    lines = tmp_path / "lines.txt"
    lines.write_text("some text\n")
    assert alignment_options(parser.parse_args(["--match", "learned", "--align-data", str(lines)]),
                             "recommended").learn == LearnSettings()
    values = {"steps": "7", "budget": "9.5", "seed": "3", "batch": "5", "positions": "11", "max_length": "33",
              "precision": "bfloat16", "check_batches": "2", "dirichlet": "2.5", "frame": "dual", "alpha_low": "0.3", "alpha_high": "0.7",
              "start": "weights", "augment": "2", "augment_style": "mixup", "lr": "0.02"}
    assert set(values) == set(LEARN_FLAGS) and set(LEARN_FLAGS) <= {f.name for f in dataclasses.fields(LearnSettings)}
    argv = [x for k, v in values.items() for x in (LEARN_FLAGS[k], v)]
    learn = alignment_options(parser.parse_args(["--match", "learned", "--align-data", str(lines), *argv]),
                              "recommended").learn
    for k, v in values.items():
        assert str(getattr(learn, k)) == v, k
    with pytest.raises(SymmergeError, match="--learn-positions"):
        alignment_options(parser.parse_args(["--learn-positions", "4"]), "recommended")
