"""What the streamed alignment of half-precision files saves in memory, checked for its results: the unit scales of
an FFN read each member as stored through :func:`symmerge.core.slots.stored` (no float32 copy; their sums are float64
either way), and :func:`symmerge.core.slots.index_axis` scales a new row-indexed tensor in place, a block of rows at
a time (:func:`symmerge.core.slots.scale_rows_`: a float32 tensor's float64 product is never whole in memory). Both
must give the values of the whole computation bit for bit and leave their inputs as they were."""

from __future__ import annotations

import pytest
import torch

from factories import make_model
from symmerge.core.instance import Slot
from symmerge.core.slots import index_axis, scale_rows_, stored
from symmerge.groups.permutation import unit_scales
from symmerge.pipeline.align import instances_for
from symmerge.pipeline.stream import Lifted


class Counting(Lifted):
    """:class:`Lifted` that counts the float32 copies it makes."""

    def __init__(self, sd):
        super().__init__(sd)
        self.copies = 0

    def __getitem__(self, key):
        self.copies += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unit_scales_read_half_members_as_stored_and_equal_the_float32_copies(dtype):
    sd_a = {k: v for k, v in make_model("llama", dtype=dtype, seed=3).state_dict().items()}
    sd_b = {k: v for k, v in make_model("llama", dtype=dtype, seed=4).state_dict().items()}
    _, instances = instances_for(make_model("llama", seed=3))
    ffn = [i for i in instances if i.kind.streams_costs and i.group.param("unit_scale")]
    assert ffn, "the Llama FFN has SwiGLU unit scales"
    perm = torch.randperm(ffn[0].size, generator=torch.Generator().manual_seed(0))
    lifted_a, lifted_b = Counting(sd_a), Counting(sd_b)
    got = unit_scales(ffn[0], lifted_a, lifted_b, perm)
    assert lifted_a.copies == lifted_b.copies == 0  # no float32 copy of a member was made
    up = lambda sd: {k: v.float() for k, v in sd.items()}  # noqa: E731: the in-memory working copies
    assert torch.equal(got, unit_scales(ffn[0], up(sd_a), up(sd_b), perm))
    key = next(s.key for s in ffn[0].slots if s.power)
    assert stored(lifted_a, key) is sd_a[key] and stored(sd_a, key) is sd_a[key]
    assert lifted_a[key].dtype == torch.float32  # the working copy itself is still float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot", [Slot("w", 0, 1), Slot("w", 1, -1), Slot("w", 0, 1, start=2, length=4)])
def test_index_axis_scaled_in_place_gives_the_product_and_keeps_its_input(dtype, slot):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(16, 12, generator=g).to(dtype)
    before = t.clone()
    n = slot.length or t.shape[slot.axis]
    index = torch.randperm(n, generator=g)
    factor = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    got = index_axis(t, slot, index, factor)
    assert torch.equal(t, before)  # the input is not scaled in place
    precise = torch.float32 if dtype in (torch.bfloat16, torch.float16) else torch.float64
    moved = t.movedim(slot.axis, 0).clone()
    rows = slice(slot.start, slot.start + n)
    shape = (n,) + (1,) * (moved.dim() - 1)
    moved[rows] = (moved[rows][index].to(precise) * factor.to(precise).reshape(shape)).to(dtype)  # out of place
    assert got.dtype == dtype
    assert torch.equal(got, moved.movedim(0, slot.axis))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", [0, 1])
def test_scale_rows_in_blocks_equals_the_whole_promoted_product(dtype, axis):
    g = torch.Generator().manual_seed(2)
    y = (torch.randn(37, 23, generator=g) * 3).to(dtype)
    shape = [1, 1]
    shape[axis] = -1
    factor = (torch.rand(y.shape[axis], generator=g, dtype=torch.float64) + 0.5).reshape(shape)
    expected = (y * factor).to(dtype)  # one float64 product of the whole tensor, rounded once
    if dtype == torch.float32:  # a product in float32 would differ: the test tells the precisions apart
        assert not torch.equal(expected, y * factor.float())
    for budget in (1, 23, 50, 1 << 22):  # one row, a few rows, the whole tensor
        got = y.clone()
        assert scale_rows_(got, factor, budget) is got
        assert torch.equal(got, expected), budget
