"""The bound model: one object per model with its spec, instances, layers and the output axes of its linear
weights, for every family."""

from __future__ import annotations

import pytest
import torch

from factories import FAMILIES, make_model
from symmerge.pipeline.bound import bind, instances_for


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_and_output_axes_of_every_family(family):
    model = make_model(family, head=True)
    bound = bind(model)
    paths = bound.layer_paths()
    assert len(paths) == bound.num_layers == 1 + max(i.layer for i in bound.instances)  # every stack's layers
    assert len(set(paths)) == len(paths)
    modules = dict(model.named_modules())
    assert all(p in modules for p in paths), paths
    # every tensor below a layer's module belongs to that layer, the rest (embeddings, final norm, head) to none
    for key in model.state_dict():
        owner = [i for i, p in enumerate(paths) if key.startswith(p + ".")]
        assert bound.layer_of(key) == (owner[0] if owner else None), key
    assert {bound.layer_of(k) for k in model.state_dict()} >= set(range(bound.num_layers))
    # output axes by module type: Linear 0, GPT-2's Conv1D 1 (stored in x out), anything else None
    for name, module in modules.items():
        if getattr(module, "weight", None) is None or not isinstance(module.weight, torch.Tensor):
            continue
        expect = 0 if isinstance(module, torch.nn.Linear) else 1 if type(module).__name__ == "Conv1D" else None
        assert bound.output_axis(name + ".weight") == expect, name
    assert bound.output_axis(paths[0] + ".no_such.weight") is None
    # the instances are resolve's, and instances_for is the shortcut to them
    spec, instances = instances_for(model)
    assert spec is bound.spec and [i.name for i in instances] == [i.name for i in bound.instances]
    assert bound.symmetries == {i.group.symmetry for i in instances}


def test_layer_of_does_not_guess_from_names():
    """A key that merely looks like a layer ("...layers.0..." outside the layer modules) is in no layer;
    the old name-pattern rule counted it."""
    model = make_model("llama", head=True)
    bound = bind(model)
    assert bound.layer_of("lm_head.layers.0.weight") is None
    assert bound.layer_of(bound.layer_paths()[1] + ".mlp.up_proj.weight") == 1
    assert bound.layer_of(bound.layer_paths()[1]) is None  # a module path, not a tensor below it
