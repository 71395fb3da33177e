"""A trained ViT (MNIST-5k digits, the demo's quick setup, cached) disguised by a hidden element of the
largest residual group of a pre-LN LayerNorm model — an orthogonal map of the folded stream fixing the
all-ones direction (O(d−1)) — plus head permutations, per-head rotations and scales, FFN permutations
and noise, is brought back to the noise level by data-free alignment."""

from __future__ import annotations

import pytest
import torch

from conftest import add_noise, one_thread, output_rel_diff, sq_dist, with_weights
from symmerge.core.apply import apply, canonicalize, random_elements
from symmerge.errors import SymmergeError
from symmerge.pipeline.align import align, instances_for

pytestmark = pytest.mark.usefixtures("single_thread")
FULL = ("heads", "attn", "ffn", "rescale", "residual")


@pytest.fixture(scope="module")
def trained_vit():
    from symmerge.demo import datasets
    from symmerge.demo.demo import QUICK
    from symmerge.demo.train import TrainSettings, train_vit, vit_config
    from symmerge.io.model import load_model

    try:
        x_tr, y_tr, x_te, y_te = datasets.mnist_5k_split(n_test=1000, seed=0, fetch=False)
    except SymmergeError:
        pytest.skip("MNIST-5k not cached (run: python -m symmerge.demo.datasets mnist-5k)")
    config = vit_config(QUICK.hidden, QUICK.layers, QUICK.heads, QUICK.intermediate, QUICK.patch,
                        labels=tuple(str(d) for d in range(10)))
    settings = TrainSettings(steps=QUICK.steps, batch_size=QUICK.batch_size, lr=QUICK.lr, seed=0)
    with one_thread():
        folder = train_vit(config, x_tr, y_tr, settings, name="demo-mnist5k-A", progress=False, log=lambda *_: None)
    x = torch.from_numpy(datasets.pixel_values(x_te[:64]))
    return load_model(folder).double(), {"pixel_values": x.double()}


def test_trained_vit_hidden_layernorm_rotation_is_undone(trained_vit):
    anchor, inputs = trained_vit
    _, instances = instances_for(anchor)
    (res,) = [i for i in instances if not i.kind.per_layer]
    assert res.info.variant == "centered"
    canonical = canonicalize(anchor.state_dict(), [res])
    keys = sorted({s.key for i in instances for s in i.slots if not s.diag})
    noisy, noise = add_noise(canonical, 0.01, seed=3, keys=keys)
    hidden = random_elements(instances, torch.Generator().manual_seed(11))
    model = with_weights(anchor, apply(noisy, instances, hidden))
    exact = with_weights(anchor, apply(canonical, instances, hidden))
    assert output_rel_diff(anchor, exact, inputs) <= 1e-10  # the hidden element alone is a symmetry
    aligned, report = align(model, anchor, FULL, inputs=inputs)
    assert report["residual_variant"] == "centered" and report["norms_folded"]
    assert report["distance_before"] > 20 * noise
    assert report["distance_after"] <= 1.02 * noise
    params = [n for n, _ in anchor.named_parameters()]
    assert sq_dist(aligned.state_dict(), canonical, params) ** 0.5 == pytest.approx(report["distance_after"], rel=1e-9)
    assert output_rel_diff(model, aligned, inputs) <= 1e-10
    # the permutation group of the stream cannot undo a rotation
    _, perm = align(model, anchor, FULL, residual="permutation", inputs=inputs)
    assert perm["distance_after"] > 3 * report["distance_after"]
