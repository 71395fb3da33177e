"""What the streamed alignment of half-precision files saves in memory, checked for its results: the unit scales of
an FFN read each member as stored through :func:`symmerge.core.slots.stored` (no float32 copy; their sums are float64
either way), the head and residual solvers learn the working precision by :func:`symmerge.core.slots.working_dtype`
(no float32 copy made for it), and :func:`symmerge.core.slots.index_axis` scales a new row-indexed tensor in place, a block of rows at
a time (:func:`symmerge.core.slots.scale_rows_`: a float32 tensor's float64 product is never whole in memory). Both
must give the values of the whole computation bit for bit and leave their inputs as they were."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from factories import make_model
from symmerge.core.instance import Slot
from symmerge.core.slots import index_axis, scale_rows_, stored, working_dtype
from symmerge.groups import Options
from symmerge.groups.permutation import unit_scales
from symmerge.pipeline.align import instances_for
from symmerge.pipeline.engine import solve_local
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


def _float32(sd: dict) -> dict:
    """The in-memory working copies (:func:`symmerge.pipeline.verify.working_copies`) of half tensors."""
    return {k: v.float() for k, v in sd.items()}


def _same(found: dict, expected: dict) -> bool:
    """The same elements, bit for bit (their tensor fields)."""
    return found.keys() == expected.keys() and all(
        all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(vars(found[n]).values(),
                                                                             vars(expected[n]).values()))
        for n in found)


# the most float32 copies of A and B one layer's attention solve makes, (attn, rescale) and (heads, attn, rescale):
# only A's, for the elements applied to it between the solves (core.apply writes the values); the head permutation
# reads every member as stored. Before, Llama's GQA head permutation made 26 and 2 (its reordered query blocks and
# query pairing read the float32 copies), Qwen2's 36 and 3; BERT's (no GQA) 39 and 0, as now.
_HEAD_COPIES = {"llama": ((0, 0), (20, 0)), "qwen2": ((0, 0), (26, 0)), "bert": ((0, 0), (39, 0))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", sorted(_HEAD_COPIES))
def test_a_head_solve_reads_half_members_as_stored(family, dtype):
    """One layer's attention solved on :class:`Lifted` views of half tensors, as ``align --stream`` solves it:
    the rotations and scales (``head_orthogonal``'s ``stacked``, the RoPE pairs) make no float32 copy — they learned
    the working dtype by reading every slot, twice (one per scale power), before :func:`working_dtype` — and the head
    permutation (GQA's reordered query blocks and query pairing, the plain block distances) reads the members as
    stored (:func:`stored`), float32 or float64 from there: the copies left are A's, of the elements applied
    (:data:`_HEAD_COPIES`); the elements are those of the float32 working copies, bit for bit."""
    sd_a = make_model(family, dtype=torch.float32, seed=6).to(dtype).state_dict()
    sd_b = make_model(family, dtype=torch.float32, seed=7).to(dtype).state_dict()
    _, instances = instances_for(make_model(family, seed=6))
    attention = [i for i in instances if i.layer == 0 and i.kind.name in ("heads", "head_orthogonal", "rope_pairs")]
    assert {"heads", "head_orthogonal"} <= {i.kind.name for i in attention}
    key = attention[0].slots[0].key
    assert working_dtype(Lifted(sd_a), key) == torch.float32 and working_dtype(sd_a, key) == dtype
    for symmetries, most in zip((("attn", "rescale"), ("heads", "attn", "rescale")), _HEAD_COPIES[family]):
        opts = Options(frozenset(symmetries), "joint")
        insts = [i for i in attention if "heads" in symmetries or i.kind.name != "heads"]
        lifted_a, lifted_b = Counting(sd_a), Counting(sd_b)
        found = solve_local(insts, lifted_a, lifted_b, opts)
        assert lifted_a.copies <= most[0] and lifted_b.copies <= most[1], (symmetries, lifted_a.copies,
                                                                           lifted_b.copies)
        assert _same(found, solve_local(insts, _float32(sd_a), _float32(sd_b), opts)), symmetries


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gqa_head_costs_read_half_members_as_stored(dtype):
    """Llama's GQA head permutation (two query heads per KV head): its query pairing and its pair costs (A's query
    heads reordered for every B group) read no float32 copy of A or B (they read 6 and 2 before), and equal those
    of the float32 working copies, bit for bit."""
    sd_a = make_model("llama", dtype=torch.float32, seed=6).to(dtype).state_dict()
    sd_b = make_model("llama", dtype=torch.float32, seed=7).to(dtype).state_dict()
    model = make_model("llama", seed=6)
    _, instances = instances_for(model)
    inst = next(i for i in instances if i.layer == 0 and i.kind.name == "heads")
    rep = max(s.repeat for s in inst.slots)
    assert rep > 1, "the factory's Llama has grouped query heads"
    opts = Options(frozenset(("heads", "attn", "rescale")), "joint")
    sibs = inst.kind.siblings(inst, SimpleNamespace(instances=instances))  # the coupled groups: q/k, v/o
    assert sibs
    lifted_a, lifted_b = Counting(sd_a), Counting(sd_b)
    sub = inst.kind._query_pairing(inst, sibs, lifted_a, lifted_b, opts, rep)
    costs = [inst.kind._cost(sib, lifted_a, lifted_b, opts, sub) for sib in sibs]
    assert lifted_a.copies == lifted_b.copies == 0, (lifted_a.copies, lifted_b.copies)
    a32, b32 = _float32(sd_a), _float32(sd_b)
    sub32 = inst.kind._query_pairing(inst, sibs, a32, b32, opts, rep)
    assert torch.equal(sub, sub32)
    assert all(torch.equal(c, inst.kind._cost(sib, a32, b32, opts, sub32)) for c, sib in zip(costs, sibs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_residual_cost_and_start_read_no_float32_copy(dtype):
    """The residual stream's cost and its spectral start (ViT, LayerNorm) on :class:`Lifted` half views: no float32
    copy of a member (31 of each model's for the cost before, for its values, and 62 before :func:`working_dtype`; 57
    for the start), and the values of the float32 working copies, bit for bit."""
    sd_a = make_model("vit", head=True, dtype=torch.float32, seed=3).to(dtype).state_dict()
    sd_b = make_model("vit", head=True, dtype=torch.float32, seed=4).to(dtype).state_dict()
    _, instances = instances_for(make_model("vit", head=True, seed=3), residual="largest")
    stream = next(i for i in instances if i.kind.name == "residual")
    lifted_a, lifted_b = Counting(sd_a), Counting(sd_b)
    C, D = stream.kind.cost(stream, lifted_a, lifted_b)
    start = stream.kind.spectral_start(stream, lifted_a, lifted_b)
    assert lifted_a.copies == lifted_b.copies == 0, (lifted_a.copies, lifted_b.copies)
    C32, D32 = stream.kind.cost(stream, _float32(sd_a), _float32(sd_b))
    assert torch.equal(C, C32) and torch.equal(D, D32)
    assert _same({"s": start}, {"s": stream.kind.spectral_start(stream, _float32(sd_a), _float32(sd_b))})


class _Keys(Lifted):
    """:class:`Lifted` that records the keys of the float32 copies it makes."""

    def __init__(self, sd):
        super().__init__(sd)
        self.copied = []

    def __getitem__(self, key):
        self.copied.append(key)
        return super().__getitem__(key)


@pytest.mark.parametrize("inner", [False, True])
def test_the_expert_scores_read_the_router_as_stored(inner):
    """A tiny bfloat16 Mixtral's expert permutation: its scores read the router's rows as stored (:func:`stored`; they
    read a float32 copy of A's and B's router each before, then widened it to float64), the same scores as the
    float32 working copies', bit for bit. ``inner``: with the experts' inner FFN permutation, whose costs still read
    the experts' float32 copies (their cost runs in the working precision), without it the router alone."""
    from symmerge.groups.experts import expert_scores

    sd_a = make_model("mixtral", dtype=torch.float32, seed=6).to(torch.bfloat16).state_dict()
    sd_b = make_model("mixtral", dtype=torch.float32, seed=7).to(torch.bfloat16).state_dict()
    _, instances = instances_for(make_model("mixtral", seed=6))
    inst = next(i for i in instances if i.layer == 0 and i.kind.name == "experts")
    router = "layers.0.mlp.gate.weight"
    assert router in {s.key for s in inst.slots} and sd_a[router].dtype == torch.bfloat16
    inst = inst if inner else replace(inst, info=replace(inst.info, inner=()))
    opts = Options(frozenset(("experts", "ffn")), "joint")
    lifted_a, lifted_b = _Keys(sd_a), _Keys(sd_b)
    S = expert_scores(inst, lifted_a, lifted_b, opts)
    assert router not in lifted_a.copied and router not in lifted_b.copied, (lifted_a.copied, lifted_b.copied)
    if not inner:
        assert lifted_a.copied == lifted_b.copied == []  # no float32 copy at all
    assert S.shape == (4, 4) and S.dtype == torch.float64 and S.abs().sum() > 0
    assert torch.equal(S, expert_scores(inst, _float32(sd_a), _float32(sd_b), opts))
