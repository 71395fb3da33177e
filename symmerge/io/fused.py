"""Fused in-memory tensors made of several checkpoint tensors (virtual tensors for streaming).

transformers 5 builds some tensors on load from several stored ones and splits them again on save:
a mixture of experts' ``mlp.experts.gate_up_proj`` (E, 2I, d) is the experts' gate and up projections
(``experts.{e}.gate_proj.weight`` / Mixtral's ``experts.{e}.w1.weight`` and ``w3``) stacked over the
experts and concatenated, ``down_proj`` (E, d, I) the stacked down projections. The symmetry specs name
the in-memory tensors; a streamed alignment reads a checkpoint lazily, so it needs to know which box of
the fused tensor each stored tensor is.

:func:`fused_parts` asks transformers itself: its reverse conversion (the one ``save_pretrained`` runs)
is applied to a small stand-in of each fused tensor holding the flat index of every element, and the
indices each stored tensor receives give its box. The stand-in keeps every axis of up to
:data:`KEEP` elements (the expert axis: split into one tensor per expert) and shrinks a longer one to
its greatest common divisor with 720720 (= lcm(1..16), so a split into up to 16 equal chunks, as a
concatenation of gate and up is, lands on the same fractions); the boxes found are scaled back, and each
is checked against the shape and name the reverse conversion gives the real (weightless) tensor. A
conversion that is not a split into boxes (a transpose, an interleave) gives no virtual tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import SymmergeError

KEEP = 256  # axes up to this length keep their length in the stand-in (expert counts)
DIVISORS = 720720  # lcm(1, ..., 16)


@dataclass(frozen=True)
class Part:
    name: str  # the stored tensor's name (as save_pretrained writes it)
    box: tuple  # one slice per axis of the fused tensor
    shape: tuple  # the stored tensor's shape (the box's, without the axes it was split along)


@dataclass(frozen=True)
class Fused:
    key: str  # the in-memory name
    shape: tuple
    parts: tuple  # Part, in the order save_pretrained writes them

    def split(self, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The stored tensors of ``tensor`` (a value of this fused tensor)."""
        return [(p.name, tensor[p.box].reshape(p.shape).contiguous()) for p in self.parts]

    def stack(self, parts: dict, dtype) -> torch.Tensor:
        """The fused tensor from its stored tensors ``{name: tensor}``."""
        out = torch.empty(self.shape, dtype=dtype)
        for p in self.parts:
            out[p.box] = parts[p.name].reshape(out[p.box].shape)
        return out


def _stand_in_shape(shape) -> tuple:
    return tuple(n if n <= KEEP else math.gcd(n, DIVISORS) for n in shape)


def _revert(model, key: str, tensor: torch.Tensor) -> dict:
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, {key: tensor})
    return {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}


def _trace(model, key: str, shape: tuple, real: dict) -> Fused:
    small = _stand_in_shape(shape)
    index = torch.arange(math.prod(small), dtype=torch.int64).reshape(small)
    traced = _revert(model, key, index)
    if set(traced) != set(real):
        raise SymmergeError(f"cannot map the fused tensor {key!r} {tuple(shape)} to its stored tensors "
                            f"(transformers splits it into {sorted(real)[:3]}…)")
    factor = [n // s for n, s in zip(shape, small)]
    parts = []
    for name, t in traced.items():
        coords = torch.unravel_index(t.reshape(-1), small) if t.numel() else ()
        lo = [int(c.min()) for c in coords]
        hi = [int(c.max()) + 1 for c in coords]
        box_small = tuple(slice(a, b) for a, b in zip(lo, hi))
        if not t.numel() or not torch.equal(index[box_small].reshape(-1), t.reshape(-1)):
            raise SymmergeError(f"cannot map the fused tensor {key!r} to its stored tensors: {name!r} is not "
                                "a box of it (a conversion other than stacking and concatenating)")
        box = tuple(slice(a * f, b * f) for a, b, f in zip(lo, hi, factor))
        sizes = [b.stop - b.start for b in box]
        kept = [n for n, b, s in zip(sizes, box_small, small) if not (b.stop - b.start == 1 and t.dim() < len(small))]
        shape_real = tuple(real[name].shape)
        if math.prod(sizes) != math.prod(shape_real) or (tuple(kept) != shape_real and tuple(sizes) != shape_real):
            raise SymmergeError(f"cannot map the fused tensor {key!r} to its stored tensors: {name!r} would be "
                                f"{tuple(sizes)}, transformers writes {shape_real}")
        parts.append(Part(name, box, shape_real))
    if sum(math.prod(p.shape) for p in parts) != math.prod(shape):
        raise SymmergeError(f"cannot map the fused tensor {key!r}: its stored tensors do not cover it")
    return Fused(key, tuple(shape), tuple(parts))


def fused_parts(model, mapped) -> dict[str, Fused]:
    """``{in-memory name: Fused}`` for each tensor of the (weightless) transformers ``model`` that its
    checkpoints store as several tensors; ``mapped``: the in-memory names stored as one tensor each."""
    mapped, out = set(mapped), {}
    for k, t in model.state_dict().items():
        if k in mapped:
            continue
        real = _revert(model, k, torch.empty(t.shape, device="meta"))
        if set(real) == {k}:
            continue
        try:  # stored as other tensors
            out[k] = _trace(model, k, tuple(t.shape), real)
        except SymmergeError:  # not a split into boxes: not virtual (a spec naming it fails to resolve)
            continue
    return out
