"""``--anchor I`` is a model's 0-based index, 0..N-1, and nothing else: ``--anchor=-1`` was read as the last model
(Python's indexing, undocumented), and an index out of range was not checked at all without alignment. One rule
(:func:`symmerge.option_ranges.model_index`) for the command line, ``symmerge.merge`` / ``merge_models``, a config's
``anchor`` key and ``align_joint``; one line naming the range, exit 2, nothing written."""

from __future__ import annotations

import textwrap

import pytest

from symmerge.errors import SymmergeError
from conftest import run_cli, save_folder
from factories import make_model


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    root = tmp_path_factory.mktemp("anchor")
    return [save_folder(make_model("llama", seed=s), root / f"m{s}") for s in range(3)]


@pytest.mark.parametrize("anchor, align", [("-1", "recommended"), ("-3", "recommended"), ("3", "recommended"),
                                           ("-1", "none"), ("5", "none")])
def test_an_index_outside_the_models_is_one_line(three, tmp_path, capsys, anchor, align):
    out = tmp_path / "out"
    capsys.readouterr()
    assert run_cli("merge", *three, "-o", out, "--method", "average", f"--anchor={anchor}", "--align", align,
                   "--progress", "none") == 2
    captured = capsys.readouterr()
    if align == "none":  # nothing is aligned, so nothing would read --anchor: refused whatever its value
        assert captured.err.startswith("symmerge: error: --anchor: an alignment option, and --align none aligns "
                                       "nothing") and captured.err.count("\n") == 1, captured.err
    else:
        assert captured.err == (f"symmerge: error: anchor index {anchor} out of range for 3 models: give 0..2 "
                                "(0-based)\n")
    assert captured.out == "" and not out.exists()


@pytest.mark.parametrize("anchor", [0, 2])
def test_an_index_in_range_is_the_anchor(three, anchor):
    from symmerge.merge.fuse import MergeOptions
    from symmerge.merge.plan import plan_merge

    plan = plan_merge(three, MergeOptions(method="average", anchor=anchor))
    assert (plan.anchor_index, plan.anchor_rule, plan.frame) == (anchor, "given", "star")


@pytest.mark.parametrize("anchor", [-1, 3, True])
def test_the_library_refuses_the_same(three, tmp_path, anchor):
    import symmerge
    from symmerge.merge.fuse import MergeOptions, merge_models
    from symmerge.pipeline.joint import align_joint
    from symmerge.pipeline.options import AlignOptions

    # True: refused by the argument check first, as no index (not read as 1), where one runs before the range
    refused = r"out of range for 3 models: give 0\.\.2" + (r"|must be .*, got bool" if anchor is True else "")
    with pytest.raises(SymmergeError, match=refused):
        symmerge.merge(three, tmp_path / "out", MergeOptions(method="average", anchor=anchor))
    assert not (tmp_path / "out").exists()
    models = [make_model("llama", seed=s) for s in range(3)]
    with pytest.raises(SymmergeError, match=refused):
        merge_models(models, "average", anchor=anchor, progress=False)
    with pytest.raises(SymmergeError, match=refused):
        align_joint(models, AlignOptions(symmetries="attn,ffn"), anchor=anchor)


def test_a_configs_anchor_key_refuses_a_negative_index(three, tmp_path, capsys):
    cfg = tmp_path / "c.yml"
    cfg.write_text(textwrap.dedent(f"""\
        merge_method: linear
        models:
          - model: {three[0]}
            parameters: {{weight: 0.5}}
          - model: {three[1]}
            parameters: {{weight: 0.5}}
        dtype: float32
        align: [attn, ffn]
        anchor: -1
        """))
    capsys.readouterr()
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none") == 2
    err = capsys.readouterr().err
    assert "line 9: anchor index -1 out of range for the 2 merged model(s)" in err and "give 0..1" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_ot_fusion_refuses_a_negative_anchor():
    from symmerge.merge import get_method

    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=1)
    with pytest.raises(SymmergeError, match=r"OT fusion: anchor index -1 out of range for 2 models: give 0\.\.1"):
        get_method("ot_wts").merge([a.state_dict(), b.state_dict()], model=a, anchor=-1)


@pytest.mark.parametrize("spelling", ["same", "relative", "trailing slash"])
def test_an_anchor_folder_that_is_one_of_the_models_is_its_index(three, tmp_path, capsys, monkeypatch, spelling):
    """``--anchor models/m2`` with ``models/m2`` merged was taken as an outside anchor: every model, m2 itself, aligned
    to a copy of m2 (the rule 'outside', index None). Now it is the index, by any spelling of the folder."""
    from symmerge.merge.fuse import MergeOptions
    from symmerge.merge.plan import plan_merge

    monkeypatch.chdir(three[2].parent)
    anchor = {"same": three[2], "relative": "m2", "trailing slash": f"{three[2]}/"}[spelling]
    plan = plan_merge(three, MergeOptions(method="average", anchor=anchor))
    assert (plan.anchor_index, plan.anchor_rule, plan.frame) == (2, "given", "star")
    outs = {}
    for name, a in (("folder", str(anchor)), ("index", "2")):
        outs[name] = tmp_path / name
        assert run_cli("merge", *three, "-o", outs[name], "--method", "average", "--anchor", a,
                       "--progress", "none") == 0
    import json

    reports = {k: json.loads((v / "symmerge_report.json").read_text()) for k, v in outs.items()}
    assert reports["folder"]["alignment"]["anchor"] == reports["index"]["alignment"]["anchor"]
    from safetensors.torch import load_file

    a, b = (load_file(str(outs[k] / "model.safetensors")) for k in ("folder", "index"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_number_that_is_also_a_folder_is_one_line_unless_it_is_that_model(three, tmp_path, monkeypatch, capsys):
    """``--anchor 1`` beside a folder ``1``: the index and the folder would be two anchors (the index won, in
    silence). One line naming both, unless the folder is that model; ``./1`` is the folder."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(three[2], tmp_path / "1")
    capsys.readouterr()
    assert run_cli("merge", three[0], three[1], "-o", "out", "--method", "average", "--anchor", "1",
                   "--progress", "none") == 2
    err = capsys.readouterr().err
    assert err == (f"symmerge: error: --anchor 1 reads as both model 1 ({three[1]}) and the folder '1': write ./1 for "
                   "the folder, or rename it\n") and not (tmp_path / "out").exists()
    # the folder is model 1 itself: one meaning, accepted; ./1 names the folder
    assert run_cli("merge", three[0], "1", "-o", "out1", "--method", "average", "--anchor", "1",
                   "--progress", "none") == 0
    assert run_cli("merge", three[0], three[1], "-o", "out2", "--method", "average", "--anchor", "./1",
                   "--progress", "none") == 0
    import json

    report = json.loads((tmp_path / "out2" / "symmerge_report.json").read_text())
    assert report["alignment"]["anchor"]["index"] is None and report["alignment"]["anchor"]["name"] == "./1"


def test_the_distances_to_the_average_do_not_depend_on_the_key_order():
    """``alignment.anchor.distances_to_average`` differed in the last bit between the in-memory merge (state-dict
    order) and the streamed one (the files' order): each model's squares are now summed exactly."""
    import torch

    from symmerge.merge.plan import closest_to_average

    g = torch.Generator().manual_seed(0)
    sds = [{f"t{k}": torch.randn(7, 5, generator=g) * (10.0 ** k) for k in range(-4, 5)} for _ in range(3)]
    keys = sorted(sds[0])
    forward = closest_to_average(lambda k: [sd[k] for sd in sds], keys)
    backward = closest_to_average(lambda k: [sd[k] for sd in sds], keys[::-1])
    assert forward == backward


def test_memory_and_stream_give_the_same_distances_to_the_average(three, tmp_path):
    import json

    found = []
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert run_cli("merge", *three, "-o", out, "--method", "average", "--align", "heads,attn,ffn,rescale",
                       "--star", "--mode", mode, "--progress", "none") == 0
        found.append(json.loads((out / "symmerge_report.json").read_text())["alignment"]["anchor"])
    assert found[0]["distances_to_average"] == found[1]["distances_to_average"]
