"""T5's self-attention head permutation, tied across each stack with the relative attention bias.

The bias (``relative_attention_bias``: an embedding of shape (num_buckets, heads) in layer 0 of each stack)
is added to the scores of every layer of the stack, so the heads of all the stack's layers move by one
permutation, with the bias's columns (group ``encoder.heads`` / ``decoder.heads``, parameter ``tied``):

* a random tied element keeps the function exactly (generation and encoder models, v1.0 ReLU and v1.1
  gated GELU, fp64 and fp32), the bias moved with it;
* negative controls: the same permutation in one layer only, or without the bias, changes the function;
* alignment recovers a hidden tied permutation (with every other group), by weights and by activations;
* the solver's assignment against enumeration of every head permutation on a 4-head model;
* ``symmerge specs`` lists it; streamed alignment refuses it when asked for, and leaves it out under
  'recommended'.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
import torch

from conftest import make_inputs, output_rel_diff, run_cli, sq_dist, with_weights
from factories import disguised, make_model
from symmerge.core.apply import apply, check_elements, random_elements
from symmerge.core.distance import sq_distance
from symmerge.groups import Options
from symmerge.groups.heads import HeadPerm, Tied
from symmerge.pipeline.align import align, instances_for

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
BIAS = "{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def _tied(model):
    _, instances = instances_for(model)
    return instances, [i for i in instances if isinstance(i.info, Tied)]


def test_t5_binds_one_tied_head_group_per_stack():
    model = make_model("t5", head=True)
    instances, tied = _tied(model)
    assert [i.name for i in tied] == ["encoder.heads", "decoder.heads"]
    enc, dec = tied
    assert enc.info.layers == (0, 1) and dec.info.layers == (2, 3, 4) and enc.layer == dec.layer == -1
    assert enc.group.param("tied") == "stack"
    keys = {s.key for s in enc.slots}
    assert BIAS.format(stack="encoder") in keys
    assert keys == {f"encoder.block.{i}.layer.0.SelfAttention.{x}.weight" for i in range(2) for x in "qkvo"} | {
        BIAS.format(stack="encoder")}
    assert [s.axis for s in enc.slots if s.key == BIAS.format(stack="encoder")] == [1]
    # cross-attention keeps its per-layer head groups
    assert sorted(i.name for i in instances if i.group.name == "decoder.cross.heads") == [
        f"decoder.layer.{i}.cross.heads" for i in range(3)]
    # T5EncoderModel: the encoder's only
    assert [i.name for i in _tied(make_model("t5"))[1]] == ["encoder.heads"]


def test_tied_group_binds_only_with_every_layer_of_its_stack():
    model = make_model("t5", head=True)
    from symmerge.pipeline.bound import bind

    assert [i.name for i in bind(model, (0, 1)).instances if isinstance(i.info, Tied)] == ["encoder.heads"]
    assert not [i for i in bind(model, (0, 2, 3)).instances if isinstance(i.info, Tied)]


def _t5(family: str, cls: str, dtype):
    """A tiny random ``cls`` on the factory's ``family`` config (1-D parameters randomised as make_model does)."""
    import transformers

    from factories import _configs

    torch.manual_seed(0)
    model = getattr(transformers, cls)(_configs()[family][0]())
    g = torch.Generator().manual_seed(1000)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cls", ["T5EncoderModel", "T5ForConditionalGeneration", "T5Model"])
@pytest.mark.parametrize("family", ["t5", "t5-relu"])
def test_random_tied_element_preserves_the_function(family, cls, dtype, request):
    """v1.1 (gated GELU) and v1.0 (ReLU); T5EncoderModel, T5ForConditionalGeneration and T5Model."""
    if dtype == torch.float64:
        request.getfixturevalue("fp64_rmsnorm")
    model = _t5(family, cls, dtype)
    _, tied = _tied(model)
    assert [i.name for i in tied] == ["encoder.heads"] + ["decoder.heads"] * (cls != "T5EncoderModel")
    sd, inputs = model.state_dict(), make_inputs(model)
    for seed in range(3):
        elements = random_elements(tied, torch.Generator().manual_seed(seed))
        check_elements(tied, elements)
        new = apply(sd, tied, elements)
        for inst in tied:
            bias = next(s.key for s in inst.slots if "relative_attention_bias" in s.key)
            perm = elements[inst.name].kv
            assert torch.equal(new[bias], sd[bias][:, perm])  # the bias's columns moved with the heads
        assert output_rel_diff(model, with_weights(model, new), inputs) <= TOL[dtype]


@pytest.mark.parametrize("family", ["t5", "t5-relu"])
def test_one_layer_only_or_without_the_bias_changes_the_function(family, fp64_rmsnorm):
    """Negative controls: the tied element applied to one layer's heads only (with or without the bias),
    or to every layer but not the bias, is no symmetry (a permutation far from the identity: a cycle)."""
    model = make_model(family)
    enc = _tied(model)[1][0]
    sd, inputs = model.state_dict(), make_inputs(model)
    element = {enc.name: HeadPerm(torch.tensor([1, 2, 0]), torch.tensor([1, 2, 0]))}
    assert output_rel_diff(model, with_weights(model, apply(sd, [enc], element)), inputs) <= 1e-10
    bias = BIAS.format(stack="encoder")
    no_bias = replace(enc, slots=tuple(s for s in enc.slots if s.key != bias))
    assert output_rel_diff(model, with_weights(model, apply(sd, [no_bias], element)), inputs) > 1e-3
    for layer in enc.info.layers:
        for with_bias in (False, True):
            keep = tuple(s for s in enc.slots if f"block.{layer}." in s.key and (with_bias or s.key != bias))
            one = replace(enc, slots=keep)
            assert output_rel_diff(model, with_weights(model, apply(sd, [one], element)), inputs) > 1e-3


@pytest.mark.parametrize("head", [False, True], ids=["encoder", "generation"])
def test_alignment_recovers_a_hidden_tied_permutation(head, fp64_rmsnorm):
    """A model disguised by a random tied head permutation and every other group (residual included
    where the model has one) aligns back to the anchor, the bias included."""
    anchor = make_model("t5", head=head)
    symmetries = ("heads", "attn", "ffn", "rescale") + (("residual",) if head else ())
    model, _, canonical = disguised(anchor, symmetries, seed=4)
    bias = BIAS.format(stack="encoder")
    assert not torch.allclose(model.state_dict()[bias], canonical[bias])  # the hidden element moved it
    inputs = make_inputs(anchor)
    aligned, report = align(model, anchor, symmetries, inputs=inputs)
    assert report["distance_before"] > 10
    assert report["distance_after"] <= 1e-9 * report["distance_before"]
    assert torch.allclose(aligned.state_dict()[bias], canonical[bias], atol=1e-12, rtol=0)
    assert report["per_module"]["encoder.heads"]["after"] <= 1e-9 * report["per_module"]["encoder.heads"]["before"]
    assert output_rel_diff(anchor, aligned, inputs) <= 1e-10


def test_activation_matcher_recovers_the_tied_permutation(fp64_rmsnorm):
    """--match activations on T5EncoderModel (no residual group: every per-layer group from activations):
    the tied group is solved on the weights (an embedding column stands for no activation) and moves the
    activation statistics the rotations are then fitted to."""
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions
    from test_matchers import unlabeled

    anchor = make_model("t5")
    model, _, canonical = disguised(anchor, ("heads", "attn", "ffn"), seed=6)
    result = align_pair(model, anchor, AlignOptions(symmetries=("heads", "attn", "ffn"), match="activations",
                                                    align_data=unlabeled(anchor)), inputs=make_inputs(anchor))
    params = [n for n, _ in anchor.named_parameters()]
    assert sq_dist(result.model.state_dict(), canonical, params) ** 0.5 <= 1e-6 * result.report["distance_before"]


def _objective(tied, coupled, sd_a, sd_b, perm, opts):
    """The group's squared distance when A's heads are moved by ``perm`` in every layer (and the bias's
    columns) and every layer's QK / VO elements are then solved exactly."""
    from symmerge.pipeline.engine import solve_local

    moved = apply(sd_a, [tied], {tied.name: HeadPerm(perm, perm.clone())})
    elements = solve_local(coupled, moved, sd_b, opts)
    keys = sorted({s.key for s in tied.slots})
    return sq_distance(apply(moved, coupled, elements), sd_b, keys)


@pytest.mark.parametrize("rescale", ["none", "joint"])
def test_tied_assignment_matches_enumeration_of_every_head_permutation(rescale):
    """Two independent 4-head models: the solver's permutation attains the minimum over all 24 head
    permutations of the stack (each with its per-layer rotations and scales solved exactly)."""
    a, b = (make_model("t5-relu", num_heads=4, seed=s) for s in (0, 7))
    instances, tied = _tied(a)
    enc = tied[0]
    coupled = [i for i in instances if i.group.name in ("encoder.attn.qk", "encoder.attn.vo")]
    assert len(coupled) == 4
    opts = Options(symmetries=frozenset({"heads", "attn"} | ({"rescale"} if rescale != "none" else set())),
                   rescale=rescale)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    found = enc.kind.solve([enc], sd_a, sd_b, opts, type("Ctx", (), {"instances": instances})())[enc.name].kv
    values = {p: _objective(enc, coupled, sd_a, sd_b, torch.tensor(p), opts) for p in itertools.permutations(range(4))}
    best = min(values.values())
    assert values[tuple(found.tolist())] <= best * (1 + 1e-9)
    assert sorted(values.values())[1] > best * (1 + 1e-6)  # a unique optimum: the test can tell


def test_specs_lists_the_tied_groups(capsys):
    assert run_cli("specs") == 0
    out = capsys.readouterr().out
    t5 = out[out.index("\nt5 "):]
    t5 = t5[: t5.index("\n\n") if "\n\n" in t5 else len(t5)]
    for stack in ("encoder", "decoder"):
        assert f"{stack}.heads  (symmetry 'heads'; one permutation of the attention heads of every layer" in t5
        assert BIAS.format(stack=stack) + "  [axis 1]" in t5
    assert "decoder.cross.heads  (symmetry 'heads'; permutation of the attention heads" in t5


def test_streamed_alignment_refuses_the_tied_group_and_recommended_leaves_it_out(tmp_path, capsys):
    a, b = make_model("t5", head=True, dtype=torch.float32), make_model("t5", head=True, dtype=torch.float32, seed=3)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    out = tmp_path / "out"
    assert run_cli("align", str(tmp_path / "a"), str(tmp_path / "b"), "--stream", "--symmetries", "heads,attn",
                   "-o", str(out)) != 0
    err = capsys.readouterr().err
    assert "encoder.heads, decoder.heads: one element for every layer of a stack" in err and "--stream" in err
    assert not out.exists()
    assert run_cli("align", str(tmp_path / "a"), str(tmp_path / "b"), "--stream", "-o", str(out)) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert "heads" in report["symmetries"] and "decoder.layer.0.cross.heads" in report["per_module"]
    assert "encoder.heads" not in report["per_module"]
    # in memory, 'recommended' aligns it
    mem = tmp_path / "mem"
    assert run_cli("align", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(mem)) == 0
    assert "encoder.heads" in json.loads((mem / "symmerge_report.json").read_text())["per_module"]



def test_streamed_recommended_equals_in_memory_without_the_tied_groups(tmp_path):
    """'recommended' with --stream on T5: every per-layer group but the tied ones (cross-attention heads
    included), solved part by part, equals the in-memory engine on the same instances."""
    from symmerge.io.checkpoint import LazyCheckpoint
    from symmerge.pipeline.engine import active, solve_local
    from symmerge.pipeline.options import AlignOptions
    from symmerge.pipeline.stream import align_streaming

    anchor = make_model("t5", head=True, seed=0)
    instances, tied = _tied(anchor)
    local = [i for i in instances if i.kind.per_layer]
    sd = apply(anchor.state_dict(), local, random_elements(local, torch.Generator().manual_seed(3)))
    model = with_weights(anchor, sd)
    for m, name in ((model, "model"), (anchor, "anchor")):
        m.save_pretrained(tmp_path / name)
    report = align_streaming(tmp_path / "model", tmp_path / "anchor", tmp_path / "out", progress=False,
                             options=AlignOptions(symmetries="recommended"))
    assert report["symmetries"] == ["heads", "attn", "ffn", "rescale"]
    opts = AlignOptions(symmetries=report["symmetries"]).solver_options()
    chosen = [i for i in active(local, opts) if i not in tied]
    sd_a, sd_b = model.state_dict(), anchor.state_dict()
    want = apply(sd_a, chosen, solve_local(chosen, sd_a, sd_b, opts))
    ck = LazyCheckpoint(tmp_path / "out")
    got = ck.read(ck.keys())
    for k, t in got.items():
        torch.testing.assert_close(t, want[k], rtol=1e-9, atol=1e-12)
    assert set(report["per_module"]) == {i.name for i in chosen}


@pytest.mark.parametrize("match", ["weights", "activations"])
def test_heads_alone_without_their_coupled_groups(match, fp64_rmsnorm):
    """'heads' without 'attn' (the coupled QK/VO groups not among the activation matcher's instances): the
    pairing falls back to the plain distances of the members (was a StopIteration under activations)."""
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions
    from test_matchers import unlabeled

    anchor = make_model("t5", head=True)
    model, _, canonical = disguised(anchor, ("heads",), seed=6)
    result = align_pair(model, anchor, AlignOptions(symmetries=("heads",), match=match, align_data=unlabeled(anchor)),
                        inputs=make_inputs(anchor))
    assert result.report["distance_before"] > 1
    assert result.report["distance_after"] <= 1e-9 * result.report["distance_before"]
