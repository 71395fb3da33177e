"""Layer-wise learned alignment (``LearnSettings.layerwise``): θ(α) built and differentiated one layer at a
time under gradient checkpointing gives the whole-model path's logits and gradient (float64), and the
whole alignment the same result, verified function-preserving."""

from __future__ import annotations

import pytest
import torch

from conftest import make_inputs, output_rel_diff, with_weights
from factories import make_model
from symmerge.core.apply import apply, canonicalize
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.bound import bind
from symmerge.pipeline.learn import LayerwiseForward, Parameters, head_forward, norm_eps
from symmerge.pipeline.options import AlignOptions, LearnSettings
from symmerge.pipeline.verify import with_state_dict
from test_learn import FULL, unlabeled

pytestmark = pytest.mark.usefixtures("single_thread")


def _interpolated(alpha, moved, work_a, work_b, keys=None):
    return {k: alpha * moved.get(k, work_a[k]) + (1 - alpha) * work_b[k] if work_a[k].is_floating_point()
            else work_b[k] for k in (work_a if keys is None else keys)}


@pytest.mark.parametrize("family", ["llama", "vit", "gpt2"])
def test_layerwise_logits_and_gradient_equal_the_whole_models(family, request):
    request.getfixturevalue("fp64_rmsnorm")
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=3)  # float64
    _, instances = instances_for(a)
    opts = AlignOptions(symmetries=FULL).solver_options()
    active = [i for i in instances if i.kind.active(i, opts)]
    wide = [i for i in active if not i.kind.per_layer]
    work_a, work_b = canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)
    params = Parameters(active, opts, torch.float64, {"norm_eps": norm_eps(a.config)})
    assert params.p
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params.parameters():  # away from the identity, so that every map's gradient is generic
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    skeleton = with_state_dict(b, b.state_dict(), share=True)
    for p in skeleton.parameters():
        p.requires_grad_(False)
    batch = unlabeled(a, n_batches=1, batch=4).batches[0]
    alpha = 0.37

    params.zero_grad()
    whole = head_forward(skeleton, _interpolated(alpha, params.transform(work_a), work_a, work_b), batch)
    whole.square().mean().backward()
    g_whole = {k: v.grad.clone() for k, v in params.p.items()}

    layerwise = LayerwiseForward(skeleton, bind(skeleton).layer_paths(), list(work_a))
    assert layerwise.outer and all(layerwise.keys.values())
    params.zero_grad()
    prepared = params.prepare()
    by_layer = layerwise(lambda keys: _interpolated(alpha, params.transform(work_a, keys, prepared), work_a,
                                                    work_b, keys), batch)
    by_layer.square().mean().backward()
    assert torch.allclose(by_layer, whole, rtol=0, atol=1e-12 * whole.abs().max().item())
    for k, v in params.p.items():
        scale = g_whole[k].abs().max().item()
        assert scale > 0, k
        assert (v.grad - g_whole[k]).abs().max().item() <= 1e-10 * scale, k
    # the layers are back as they were: a plain call runs the whole model again
    assert all("forward" not in layer.__dict__ for layer in layerwise.layers.values())


@pytest.mark.parametrize("family", ["llama", "vit"])
def test_layerwise_alignment_matches_the_whole_model_path_and_verifies(family):
    a = make_model(family, head=True, seed=0, dtype=torch.float32)
    b = make_model(family, head=True, seed=3, dtype=torch.float32)
    data = unlabeled(a)
    results = []
    for layerwise in (False, True):
        options = AlignOptions(symmetries=FULL, match="learned", align_data=data, verify_tol=1e-5,
                               learn=LearnSettings(steps=4, batch=8, lr=0.05, check_every=2, layerwise=layerwise))
        results.append(align_pair(a, b, options))
    whole, by_layer = results
    assert by_layer.report["verify_max_rel_diff"] <= 1e-5
    assert by_layer.report["learned"]["steps"] == whole.report["learned"]["steps"] == 4
    hist_w, hist_l = whole.report["learned"]["history"], by_layer.report["learned"]["history"]
    assert hist_w["step"] == hist_l["step"]
    assert hist_l["train"] == pytest.approx(hist_w["train"], rel=1e-5)
    inputs = make_inputs(a)
    # the same elements up to float32 rounding of the gradients' sums: the same function, nearly the same weights
    assert output_rel_diff(whole.model, by_layer.model, inputs) <= 1e-5
    sd_w, sd_l = whole.model.state_dict(), by_layer.model.state_dict()
    for k in sd_w:
        assert (sd_w[k] - sd_l[k]).abs().max().item() <= 1e-4 * max(sd_w[k].abs().max().item(), 1e-6), k
    moved = apply(canonicalize(a.state_dict(), [i for i in by_layer.instances if not i.kind.per_layer]),
                  by_layer.instances, by_layer.elements)
    assert output_rel_diff(a, with_weights(a, moved), inputs) <= 1e-5



def test_learn_layerwise_flag_sets_the_setting_and_needs_match_learned(tmp_path):
    import argparse

    from symmerge.commands.alignment_args import add_alignment_arguments, alignment_options
    from symmerge.errors import SymmergeError

    parser = argparse.ArgumentParser()
    add_alignment_arguments(parser)
    lines = tmp_path / "lines.txt"
    lines.write_text("some text\n")
    base = ["--match", "learned", "--align-data", str(lines)]
    assert not alignment_options(parser.parse_args(base), "recommended").learn.layerwise
    assert alignment_options(parser.parse_args([*base, "--learn-layerwise"]), "recommended").learn.layerwise
    with pytest.raises(SymmergeError, match="--learn-layerwise"):
        alignment_options(parser.parse_args(["--learn-layerwise"]), "recommended")
