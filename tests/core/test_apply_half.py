"""``symmerge.core.apply.apply`` on float16/bfloat16 weights (the in-memory alignment of a half-precision model):
every element of every instance acts on the float32 upcast of the stored values (exact), and each tensor is rounded
to its stored dtype once, at the end — it used to be rounded after every instance and stage (the head rotations,
then the stream's rotation, then the scales: each a rounding of the weights). Checked on the real model classes
against the float32 computation, bit for bit, and tied weights kept one tensor."""

from __future__ import annotations

import pytest
import torch

from factories import make_model
from symmerge.core.apply import apply, canonicalize, random_elements
from symmerge.pipeline.align import instances_for


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_half_weights_take_every_element_in_float32_and_round_once(family, dtype):
    model = make_model(family, head=True, dtype=dtype, seed=1)
    _, instances = instances_for(model)
    stored = canonicalize(model.state_dict(), instances)  # the norms folded, as the alignment does first
    upcast = {k: v.float() if v.is_floating_point() else v for k, v in stored.items()}
    elements = random_elements(instances, torch.Generator().manual_seed(5))
    once = apply(stored, instances, elements)
    expected = apply(upcast, instances, elements)  # float32 throughout
    moved = [k for k in stored if not torch.equal(once[k], stored[k])]
    assert len(moved) > 10
    for k, v in stored.items():
        assert once[k].dtype == v.dtype, k  # the stored dtype kept
        assert torch.equal(once[k], expected[k].to(v.dtype)), k  # one rounding of the float32 result
    # the old way (each instance applied, then rounded) differs: the test can tell the two apart
    stepwise = dict(stored)
    for inst in instances:
        stepwise = {k: (v.to(stored[k].dtype) if v.is_floating_point() else v)
                    for k, v in apply({k: x.float() if x.is_floating_point() else x for k, x in stepwise.items()},
                                      [inst], elements).items()}
    assert any(not torch.equal(stepwise[k], once[k]) for k in moved)


def test_tied_weights_stay_one_tensor_after_the_rounding():
    model = make_model("llama", head=True, dtype=torch.bfloat16, seed=2, tied=True)
    _, instances = instances_for(model)
    stored = canonicalize(model.state_dict(), instances)
    aliases = {(s.key, a) for i in instances for s in i.slots for a in s.aliases}
    if not aliases:
        pytest.skip("no tied tensors declared for this stand-in")
    out = apply(stored, instances, random_elements(instances, torch.Generator().manual_seed(6)))
    for key, alias in aliases:
        assert out[alias] is out[key] and out[key].dtype == torch.bfloat16
