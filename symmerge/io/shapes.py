"""Every tensor's shape checked against the model class ``config.json`` names, in the streamed paths too.

A loaded model is checked by transformers itself (``from_pretrained`` refuses a tensor of the wrong shape);
a streamed merge or alignment never builds the model, so a checkpoint whose safetensors headers state a
wrong shape (two inputs transposed the same way merge without complaint) would be written as a folder
``from_pretrained`` rejects. :func:`expected_shapes` builds the config's class on the ``meta`` device (no
memory, no weights) and reads its state dict's shapes; the facts of a config are cached with its tensor
names (:mod:`symmerge.io.names_cache`), so a cached read builds nothing. :func:`check_shapes` compares a
:class:`~symmerge.io.checkpoint.LazyCheckpoint` against them: a difference is one error naming the tensor
as the checkpoint does.
"""

from __future__ import annotations

import torch

from ..errors import SymmergeError
from .hf import model_class, quiet_transformers


def expected_shapes(config: dict, cfg) -> dict[str, list[int]]:
    """{state-dict name: shape} of the model ``config`` describes (``cfg``: its transformers config)."""
    import transformers

    cls = model_class(config)
    try:
        with quiet_transformers(), torch.device("meta"):
            model = cls(cfg) if cls is not transformers.AutoModel else transformers.AutoModel.from_config(cfg)
    except Exception as e:
        raise SymmergeError(f"transformers cannot build a {config.get('model_type')} model from this config "
                            f"({type(e).__name__}: {e})") from None
    return {k: [int(d) for d in v.shape] for k, v in model.state_dict().items()}


def check_shapes(ckpt, expected: dict) -> None:
    """Every tensor of ``ckpt`` the config's class has is of the class's shape, else one error."""
    if not expected:
        return
    for key, shape in ckpt.shape.items():
        want = expected.get(key)
        if want is not None and tuple(want) != tuple(shape):
            name = ckpt.disk_name.get(key, key)
            raise SymmergeError(f"{ckpt.folder}: tensor {name!r} is {tuple(shape)} in the checkpoint, but its "
                                f"config.json ({ckpt.class_name}) makes it {tuple(want)}: a mismatched or corrupt "
                                "checkpoint (transformers would refuse to load it)")
