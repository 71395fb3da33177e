"""The align executor runs the plan's steps (issue 39 item 1): an alignment solves the plan's bound group
instances and writes every output tensor by its step — from memory (``align_pair(..., plan=)``) and from the
files (``align_streaming(..., plan=)``) —, so a plan and its execution cannot diverge. The executor's maps are
checked against the one apply loop (``core.apply.apply``) bit for bit, for every family, and a plan edited to
copy a tensor makes both wings copy it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import folder_tensors
from factories import FAMILIES, make_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_steps_apply_random_elements_as_the_apply_loop_does(tmp_path, family):
    """For every family (task model, its tied aliases included), random group elements of every instance the plan
    binds: running the plan's steps gives the state dict ``core.apply.apply`` gives, tensor for tensor, bit for bit
    (an alias the very tensor of its source)."""
    from symmerge.core.apply import apply, canonicalize, random_elements
    from symmerge.pipeline.align_steps import execute_steps
    from symmerge.pipeline.align_steps import plan_steps
    from symmerge.pipeline.bound import bind

    model = make_model(family, head=True, dtype=torch.float64, seed=0)
    instances = bind(model).instances
    sd = canonicalize(model.state_dict(), [i for i in instances if not i.kind.per_layer])
    elements = random_elements(instances, torch.Generator().manual_seed(3))
    expected = apply(sd, instances, elements)
    got = execute_steps(plan_steps(list(sd), instances), sd, instances, elements)
    assert set(got) == set(expected)
    changed = 0
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
        changed += got[k] is not sd[k]
    assert changed
    for inst in instances:
        for slot in inst.slots:
            for alias in slot.aliases:
                assert got[alias] is got[slot.key], alias


def _without_maps(plan, tensor: str):
    """``plan`` edited so that ``tensor`` is a copy step (its maps removed)."""
    steps = tuple(dataclasses.replace(s, maps=(), folds=()) if s.tensor == tensor else s for s in plan.steps)
    return dataclasses.replace(plan, steps=steps)


@pytest.mark.parametrize("stream", [False, True], ids=["memory", "files"])
def test_both_wings_write_what_the_plan_says(tmp_path, stream):
    """A plan edited so that one transformed tensor is copied: the wing given that plan writes the tensor's input
    bits, while the other tensors of the same group instance are still transformed (the executor runs the plan's
    steps; it does not re-bind the groups)."""
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.align_plan import plan_align
    from symmerge.pipeline.options import AlignOptions
    from symmerge.pipeline.stream import align_streaming

    for seed in (0, 1):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(str(tmp_path / f"{seed}"))
    opts = AlignOptions(symmetries="attn,ffn", verify=False)
    plan = plan_align(tmp_path / "0", tmp_path / "1", opts, stream=stream)
    target, sibling = "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"
    assert {s.tensor: s.op for s in plan.steps}[target] == "transform"
    edited = _without_maps(plan, target)
    before = folder_tensors(tmp_path / "0")
    if stream:
        align_streaming(tmp_path / "0", tmp_path / "1", tmp_path / "out", plan.options, progress=False, plan=edited)
        after = folder_tensors(tmp_path / "out")
    else:
        after = align_pair(tmp_path / "0", tmp_path / "1", plan.options, plan=edited).model.state_dict()
    assert torch.equal(after[target], before[target])
    assert not torch.equal(after[sibling], before[sibling])  # the same FFN permutation, still applied
