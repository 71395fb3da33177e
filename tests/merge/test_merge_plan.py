"""One merge plan, one library entry: ``symmerge.merge(models, out, options)`` writes what ``symmerge merge``
writes (bit for bit, the report aside from its timings) in both modes; a matcher that cannot stream is
refused by the plan (merge and align, library and CLI) or, with ``--mode auto``, sends the merge to memory;
no code compares a matcher's name outside ``pipeline/matchers.py`` or special-cases a symmetry's name outside
``groups/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import symmerge
from conftest import npz_file, run_cli, vit_folder
from symmerge.errors import SymmergeError
from symmerge.merge.fuse import MergeOptions
from symmerge.merge.plan import plan_merge
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.stream import align_streaming



@pytest.fixture
def vits(tmp_path):
    return [str(vit_folder(tmp_path / f"vit{s}", s)) for s in (0, 1, 2)]


def _without_timings(x):
    if isinstance(x, dict):
        # timings, the read-ahead ring's peak (how far the reader got ahead: thread timing), the command line
        # (the library's report has none)
        return {k: _without_timings(v) for k, v in x.items()
                if k not in ("timings", "read_ahead_peak_bytes", "command_line") and "seconds" not in k}
    if isinstance(x, list):
        return [_without_timings(v) for v in x]
    return x


def _same_folder(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name == "symmerge_report.json":
            ra, rb = (json.loads((f / name).read_text()) for f in (a, b))
            assert _without_timings(ra) == _without_timings(rb)
        elif name != "README.md":  # the model card quotes the timings
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_library_entry_writes_what_the_cli_writes(vits, tmp_path, mode):
    assert run_cli("merge", *vits[:2], "--method", "average", "--align", "attn,ffn", "--mode", mode,
                   "-o", tmp_path / "cli") == 0
    options = MergeOptions(method="average", align=AlignOptions(symmetries="attn,ffn"), mode=mode, progress=False)
    report = symmerge.merge(vits[:2], tmp_path / "lib", options)
    assert report["mode"] == mode and report["plan"]["mode"] == mode
    assert report["plan"]["frame"] == "star" and report["plan"]["match"] == "weights"
    _same_folder(tmp_path / "cli", tmp_path / "lib")


def test_align_to_folder_writes_what_the_cli_writes(vits, tmp_path):
    for stream in (False, True):
        out_cli, out_lib = tmp_path / f"cli{stream}", tmp_path / f"lib{stream}"
        assert run_cli("align", vits[0], vits[1], "--symmetries", "attn,ffn", *(["--stream"] if stream else []),
                       "-o", out_cli) == 0
        symmerge.align_to_folder(vits[0], vits[1], out_lib, AlignOptions(symmetries="attn,ffn"), stream=stream,
                                 progress=False, **({"shard_size": "1GB"} if stream else {}))
        _same_folder(out_cli, out_lib)


@pytest.mark.parametrize("match", ["activations", "learned"])
def test_a_matcher_that_cannot_stream_is_refused_when_streaming(vits, tmp_path, capsys, match):
    data = npz_file(tmp_path / "d.npz")
    argv = ["--align", "attn,ffn", "--match", match, "--align-data", data]
    capsys.readouterr()
    if match != "learned":  # merge --mode stream --match learned learns from the files: test_merge_stream_learned.py
        assert run_cli("merge", *vits[:2], "--method", "average", *argv, "--mode", "stream", "-o", tmp_path / "m") != 0
        err = capsys.readouterr().err
        assert f"--match {match}" in err and "--mode" in err, err
        assert not (tmp_path / "m").exists()
        options = MergeOptions(align=AlignOptions(symmetries="attn,ffn", match=match, align_data=data), mode="stream",
                               progress=False)
        with pytest.raises(SymmergeError, match=f"--match {match}.*--mode"):
            symmerge.merge(vits[:2], tmp_path / "m", options)
    # align: the CLI's --stream, the library entry and the data-free streamed engine itself (``align --stream
    # --match learned`` learns from the files layer by layer instead: tests/pipeline/test_learn_layerwise_write.py)
    align = AlignOptions(symmetries="attn,ffn", match=match, align_data=data)
    if match != "learned":
        assert run_cli("align", vits[0], vits[1], "--symmetries", "attn,ffn", "--match", match, "--align-data", data,
                       "--stream", "-o", tmp_path / "a") != 0
        assert f"--match {match}" in capsys.readouterr().err
        with pytest.raises(SymmergeError, match=f"--match {match}"):
            symmerge.align_to_folder(vits[0], vits[1], tmp_path / "a", align, stream=True, progress=False)
    with pytest.raises(SymmergeError, match=f"--match {match}"):
        align_streaming(vits[0], vits[1], tmp_path / "a", align, progress=False)
    assert not (tmp_path / "a").exists()


def test_weights_streams_and_auto_loads_a_matcher_that_cannot(vits, tmp_path, monkeypatch):
    weights = plan_merge(vits[:2], MergeOptions(align=AlignOptions(symmetries="attn,ffn")), mode="stream")
    assert weights.mode == "stream" and weights.aligns
    data = npz_file(tmp_path / "d.npz")
    opts = MergeOptions(align=AlignOptions(symmetries="attn,ffn", match="activations", align_data=data))
    plan = plan_merge(vits[:2], opts, mode="auto")
    assert plan.mode == "memory" and "--match activations" in plan.why
    monkeypatch.setattr("symmerge.core.memory.available_memory", lambda: 1000)  # the models do not fit
    with pytest.raises(SymmergeError, match="--mode auto.*would not fit.*--match activations"):
        plan_merge(vits[:2], opts, mode="auto")
    monkeypatch.undo()
    # the learned matcher streams from the files (pipeline/learn_layerwise_write.py): loaded when the models fit,
    # streamed when they do not, as the data-free matcher
    opts = MergeOptions(align=AlignOptions(symmetries="attn,ffn", match="learned", align_data=data))
    assert plan_merge(vits[:2], opts, mode="auto").mode == "memory"
    monkeypatch.setattr("symmerge.core.memory.available_memory", lambda: 1000)
    assert plan_merge(vits[:2], opts, mode="auto").mode == "stream"
    monkeypatch.undo()
    # nothing aligned: the matcher does not matter
    none = plan_merge(vits[:2], MergeOptions(align=AlignOptions(symmetries="none", match="activations",
                                                                align_data=data)), mode="stream")
    assert none.mode == "stream" and not none.aligns


@pytest.mark.parametrize("flag", [("--untie",), ("--residual", "permutation")])
def test_streamed_merges_refuse_what_align_stream_refuses(vits, tmp_path, capsys, flag):
    """``--untie`` and ``--residual`` change what the in-memory alignment gives, and the streamed engine aligns no
    residual stream: ``align --stream`` refused them while ``merge --mode stream`` (each model aligned by the same
    engine) left them out and wrote a merge without them, exit 0. One rule now (``AlignOptions.streamed_refusal``):
    refused by the merge plan (command and library), by the engine itself, and ``--mode auto`` loads the models."""
    text = "streaming does not align the residual stream; --untie and --residual do not apply"
    capsys.readouterr()
    assert run_cli("merge", *vits[:2], "--method", "average", "--align", "attn,ffn", *flag, "--mode", "stream",
                   "--progress", "none", "-o", tmp_path / "m") == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"symmerge: error: --mode stream: {text}; use --mode memory"], err
    assert not out and not (tmp_path / "m").exists()
    align = AlignOptions(symmetries="attn,ffn", **({"untie": True} if flag == ("--untie",) else {"residual": flag[1]}))
    with pytest.raises(SymmergeError, match=f"^--mode stream: {text}"):
        symmerge.merge(vits[:2], tmp_path / "m", MergeOptions(align=align, mode="stream", progress=False))
    plan = plan_merge(vits[:2], MergeOptions(align=align), mode="auto")
    assert plan.mode == "memory" and plan.why == f"auto: {text}"
    with pytest.raises(SymmergeError, match=f"^{text}$"):
        align_streaming(vits[0], vits[1], tmp_path / "a", align, progress=False)
    assert run_cli("align", vits[0], vits[1], "--symmetries", "attn,ffn", *flag, "--stream", "--progress", "none",
                   "-o", tmp_path / "a") == 2
    assert "--stream does not align the residual stream" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "a").exists()


def test_the_plan_resolves_frame_and_anchor_once(vits):
    three = plan_merge(vits, MergeOptions(align=AlignOptions(symmetries="attn,ffn")), mode="memory")
    assert three.frame == "joint" and three.anchor_rule == "closest to the average"
    star = plan_merge(vits, MergeOptions(align=AlignOptions(symmetries="attn,ffn"), anchor=0), mode="memory")
    assert star.frame == "star" and star.anchor_index == 0 and star.anchor_rule == "given"
    streamed = plan_merge(vits, MergeOptions(align=AlignOptions(symmetries="attn,ffn")), mode="stream")
    assert streamed.frame == "star"  # joint alignment needs the models in memory
    two = plan_merge(vits[:2], MergeOptions(), mode="memory")
    assert two.anchor_index == 1 and two.anchor_rule == "second of two" and two.requested == "recommended"


# other vocabularies that spell some words as the matchers do: what a comparison of them reads from
NOT_MATCHERS = {
    "needs": "the statistics a merge method needs (merge/base.py STATISTICS: gram, fisher, activations)",
    "rescale_from": "where the activation matcher's scales come from (pipeline/activations.py SCALE_SOURCES)",
    "activation_sites": "which activations stand for a kind's tensors (groups/base.py: slots, ..., weights)",
}


def test_no_code_outside_the_matchers_compares_a_matcher_name():
    """No module outside ``pipeline/matchers.py`` branches on a matcher's name (``weights``, ``activations``,
    ``learned``: the keys of ``MATCHERS``), the start of a learned alignment (a matcher too) included: it reads
    what the matcher declares (:class:`~symmerge.pipeline.matchers.Matcher`: ``streams``, ``joint``,
    ``needs_data``, ``learns``; ``DEFAULT_MATCHER``). The checker (tests/guards.py) is first shown to catch the
    planted comparisons, of the forms the regular expression it replaces let through, and to pass declarations
    and the other vocabularies of :data:`NOT_MATCHERS`."""
    from guards import leaks, name_comparisons
    from symmerge.merge.base import STATISTICS
    from symmerge.pipeline.activations import SCALE_SOURCES
    from symmerge.pipeline.matchers import MATCHERS

    planted = ('closed = data if settings.start != "weights" else None\n'  # 1: the start, not a .match
               'extra = [v for v in values if v not in (None, "weights")]\n'  # 2: a tuple, no "match" in sight
               'if "learned" == mode:\n    pass\n'  # 3: the literal on the left
               'match options.match:\n    case "activations" | "learned":\n        pass\n'  # 6: a case
               'if m.needs == "activations" or rescale_from == "activations":\n    pass\n'  # other vocabularies
               'Matcher("weights", match_weights)\nmode = report.get("match", "weights")\n')  # declarations
    assert name_comparisons(planted, set(MATCHERS), NOT_MATCHERS) == [1, 2, 3, 6]
    assert {"activations"} <= set(STATISTICS) and {"weights", "activations"} <= set(SCALE_SOURCES)
    assert not leaks(set(MATCHERS), lambda rel: rel.as_posix() == "pipeline/matchers.py", NOT_MATCHERS)


def test_no_code_outside_groups_special_cases_a_symmetry_name():
    """No module outside ``symmerge/groups/`` branches on a symmetry's name (any of ``SYMMETRIES``, and
    ``SCALES``): it asks a kind's declared capability (``families.symmetries_whose``, the rules of
    ``pipeline/recommend.py``) or reads a group's declared role (``families/roles.py``: ``role``, ``FFN``, ``QK``...).

    What counts: a comparison (``==``, ``!=``, ``in``, ``not in``) with a symmetry's name written out as a
    string literal. What does not: *declaring* — a family naming the symmetry of a group it builds
    (``Group("ffn", "permutation", "ffn", ...)``), the tuples that list the names (``SYMMETRIES``,
    ``RECOMMENDED``), the word tables of other vocabularies that happen to share a spelling (OT fusion's
    ``units`` parameter, the norms' ``FEEDS``), keys of reports and parameters — none of which compares. A name
    compared through a constant declared for it (``SCALES``, the roles' ``FFN``) is reading that declaration."""
    from guards import leaks, name_comparisons
    from symmerge.families import SCALES, SYMMETRIES

    names = set(SYMMETRIES) | {SCALES}
    planted = 'if inst.group.symmetry == "ffn":\n    pass\nok = "heads" not in options.symmetries\n' \
              'x = s in ("attn", "mlp")\nGroup("residual", "residual", "residual", ())\nblock = "mlp"\n'
    assert name_comparisons(planted, names) == [1, 3, 4]  # the test can fail: declarations are not flagged
    assert not leaks(names, lambda rel: rel.parts[0] == "groups")


def test_evaluation_rows_say_whether_they_score_the_saved_model_and_when_max_examples_cut(vits, tmp_path):
    files = [npz_file(tmp_path / f"e{i}.npz", seed=i) for i in (0, 1)]
    out = tmp_path / "m"
    assert run_cli("merge", *vits[:2], "--method", "average", "--align", "none", "--eval-data", files[0],
                   "--eval-data", files[1], "--max-examples", "5", "--mode", "memory", "-o", out) == 0
    ev = json.loads((out / "symmerge_report.json").read_text())["evaluation"]
    rows = ev["merged"]
    assert [r["as_saved"] for r in rows] == [True, False]  # file 1 is scored with model 1's head: not saved
    assert rows[1]["head_from"] == vits[1]
    assert ev["max_examples"]["limit"] == 5 and len(ev["max_examples"]["cut"]) == 2
    assert "--max-examples 5" in ev["max_examples"]["note"]


def test_one_recommended_function_holds_every_narrowing_rule():
    """'recommended' is narrowed (with a note) and an explicit list refused by one function, from facts alone: the
    groups the anchor binds, heads that differ, a reader of the output frame, a streamed alignment."""
    from symmerge.pipeline.recommend import moves_heads_input, moves_output_frame, model_wide, moving, recommended

    asked = AlignOptions(symmetries="recommended")
    available = ("heads", "attn", "ffn", "residual")

    def differ(why):
        raise SymmergeError(f"heads differ ({why})")

    full, note = recommended(asked, available=available)
    assert note is None and "residual" in full.symmetries and not full.recommended
    for facts, capability in ((dict(heads_check=differ), moves_heads_input),
                              (dict(output_reader="a pipeline reads it"), moves_output_frame),
                              (dict(streamed=True), model_wide)):
        gone = moving(full, capability)
        assert gone == ["residual"]
        narrowed, note = recommended(asked, available=available, **facts)
        assert set(narrowed.symmetries) == set(full.symmetries) - set(gone)
        assert (note is None) == ("streamed" in facts) and (note is None or "residual left out of 'recommended'" in note)
        with pytest.raises(SymmergeError):
            recommended(AlignOptions(symmetries="attn,residual"), available=available, **facts)
    base, note = recommended(asked, model_type="vit", base_given=True)
    assert base.symmetries == () and "--base" in note
    kept, note = recommended(AlignOptions(symmetries="attn"), available=available, heads_check=differ,
                             output_reader="a pipeline reads it", streamed=True)
    assert kept.symmetries == ("attn",) and note is None


def test_both_wings_choose_the_anchor_closest_to_the_average_by_one_rule(tmp_path):
    """One distance to the average (``plan.closest_to_average`` over ``plan.average_keys``: the body's floating-point
    tensors) in both wings: the in-memory and the streamed merge pick the same anchor with the same distances, on
    three models whose task heads would pick another anchor than their bodies (the streamed rule counted the heads
    before)."""
    from safetensors.torch import load_file, save_file

    from symmerge.merge.plan import closest

    base = load_file(str(vit_folder(tmp_path / "base", 0) / "model.safetensors"))
    step = load_file(str(vit_folder(tmp_path / "step", 1) / "model.safetensors"))
    folders = []
    for i, shift in enumerate((0.0, 0.5, 1.0)):  # bodies on a line: the middle one is the closest to the average
        folder = vit_folder(tmp_path / f"m{i}", 0)
        sd = {k: (v + shift * (step[k] - v)) if not k.startswith("classifier") else v.clone() for k, v in base.items()}
        if i == 1:  # ... and its head far from the others
            sd = {k: v + 100.0 if k.startswith("classifier") else v for k, v in sd.items()}
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        folders.append(str(folder))
    # the old streamed rule (every floating-point tensor, heads included) would choose another model
    sds = [load_file(f"{f}/model.safetensors") for f in folders]
    everything = [sum(float((sd[k].double() - sum(x[k].double() for x in sds) / 3).square().sum()) for k in sd)
                  for sd in sds]
    assert closest(everything) != 1
    anchors = {}
    for mode in ("memory", "stream"):
        options = MergeOptions(align=AlignOptions(symmetries="attn,ffn"), joint=False, progress=False, evaluate=False,
                               mode=mode)
        report = symmerge.merge(folders, tmp_path / f"out-{mode}", options)
        anchors[mode] = report["alignment"]["anchor"]
        assert report["mode"] == mode
    assert anchors["memory"]["index"] == anchors["stream"]["index"] == 1
    assert anchors["memory"]["distances_to_average"] == pytest.approx(anchors["stream"]["distances_to_average"],
                                                                      rel=1e-12)
