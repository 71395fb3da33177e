"""A model bound to its symmetry spec, built once: what the matchers, REPAIR, OT fusion, the statistics and
the distance tables used to rediscover each on their own.

:func:`bind` reads a transformers model's family spec, finds the base model's prefix, binds every group
(:func:`symmerge.core.resolve.resolve`, ties as the model class declares them) and keeps:

* ``spec``, ``prefix``, ``instances``, ``ties`` and the layer count;
* the layers' module paths (:meth:`BoundModel.layer_paths`, from the spec's ``layer`` template) and the
  layer a tensor belongs to (:meth:`BoundModel.layer_of`, by those paths: no guessing from names such as
  ``layer``/``layers``/``h``);
* the output axis of every linear weight (:meth:`BoundModel.output_axis`: 0 for ``nn.Linear``, 1 for
  GPT-2's ``Conv1D``, which stores in × out), found by module type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..core.resolve import config_sizes, declared_ties, find_prefix, layer_paths, resolve
from ..errors import SymmergeError
from ..families import spec_for
from ..io.hf import DiskNames, linear_output_axis


@dataclass(eq=False)
class BoundModel:
    model: object  # the transformers model the spec is bound to
    spec: object  # its family's Spec
    prefix: str  # the base model inside the state dict ('' or 'bert.' ...)
    instances: list  # every group instance (per-layer first, model-wide last)
    ties: dict = field(default_factory=dict)  # declared {alias: source}
    sizes: dict = field(default_factory=dict)  # config_sizes: layer and head counts (per stack where several)

    @property
    def num_layers(self) -> int:
        """Every stack's layers (T5: the encoder's, then the decoder's)."""
        return self.sizes["num_layers"]

    @property
    def symmetries(self) -> set:
        """The symmetries whose groups this model binds."""
        return {i.group.symmetry for i in self.instances}

    def layer_paths(self) -> list[str]:
        """Module paths of the layers, in the order the instances number them (several stacks: T5's
        encoder layers, then its decoder's); their outputs are the stream at every block boundary."""
        if self._paths is None:
            raise SymmergeError(f"the {self.spec.family} spec names no layer module")
        return list(self._paths)

    @cached_property
    def _paths(self) -> tuple | None:
        if not self.spec.layer and not self.spec.stacks:
            return None
        return tuple(layer_paths(self.spec, self.model.state_dict().keys(), self.sizes))

    @cached_property
    def _layer_index(self) -> dict:
        return {path + ".": i for i, path in enumerate(self._paths or ())}

    def layer_of(self, key: str) -> int | None:
        """The layer whose module holds the tensor ``key``, else None (embeddings, final norm, heads)."""
        head = key
        while "." in head:
            head = head.rsplit(".", 1)[0]
            i = self._layer_index.get(head + ".")
            if i is not None:
                return i
        return None

    @cached_property
    def _modules(self) -> dict:
        return dict(self.model.named_modules())

    def output_axis(self, key: str) -> int | None:
        """The output axis of the linear layer whose weight is ``key`` (``nn.Linear``: 0, ``Conv1D``: 1),
        else None (biases, norms, embeddings, anything else)."""
        if not key.endswith(".weight"):
            return None
        module = self._modules.get(key[: -len(".weight")])
        return linear_output_axis(module)


def bind(model, layers=None, residual: str = "largest", instances=None) -> BoundModel:
    """The :class:`BoundModel` of a transformers model (``layers``: only these layer indices;
    ``residual``: the residual stream's group for LayerNorm models, ``largest`` or ``permutation``;
    ``instances``: the group instances already bound — an alignment plan's, made from the headers —, else
    bound here)."""
    spec = spec_for(model.config.model_type)
    sizes = config_sizes(spec, model.config)
    rest = dict(sizes)
    num_layers = rest.pop("num_layers")
    ties = declared_ties(model)
    sd = model.state_dict()
    if instances is None:
        instances = resolve(spec, sd, num_layers, rest.pop("num_heads"), layers, ties=ties, residual=residual,
                            architecture=type(model).__name__, disk_names=DiskNames(model), **rest)
    return BoundModel(model, spec, find_prefix(spec, sd.keys()), list(instances), ties, sizes)


def instances_for(model, layers=None, residual: str = "largest"):
    """``(spec, instances)`` of a transformers model: the shortcut to :func:`bind`'s two most used parts."""
    bound = bind(model, layers, residual)
    return bound.spec, bound.instances


def as_model(model, allow_pickle: bool = False, spec: bool = True):
    """A folder loaded (``spec=False``: any model type, for plain merges and curves), or the model given."""
    from ..io.reader import load_model

    return load_model(model, allow_pickle=allow_pickle, spec=spec) if isinstance(model, (str, Path)) else model


def untied(model):
    """``model`` itself, or — when its class ties weights (an LM head sharing the embeddings) — an equal
    copy of a class instance built with ``tie_word_embeddings=False``, every alias a tensor of its own."""
    if not declared_ties(model):
        return model
    import copy

    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    clone = type(model)(config).to(next(model.parameters()).dtype)
    clone.load_state_dict(model.state_dict())
    return clone.eval()
