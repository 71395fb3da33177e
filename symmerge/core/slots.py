"""Tensor views of a slot (the part of a tensor a group acts on) and the working precisions.

Two precision rules, written once:

* :func:`precise_dtype` — for group elements and transforms: float64, except for checkpoints held
  in 16 bits (float32 there: the result is rounded to 8 or 11 mantissa bits anyway, and a float64
  copy of a large layer would double its memory).
* :func:`fast_dtype` — for cost matrices whose optimum only needs the order of the costs
  (assignments, the residual stream's direction): float64 if any operand is float64, else float32.

Both take the operands' tensors or their dtypes (:func:`working_dtype`: a view's dtype without its copy).
"""

from __future__ import annotations

import torch

from .instance import Slot

HALF = (torch.float16, torch.bfloat16)


def stored(sd, key: str) -> torch.Tensor:
    """``sd[key]`` as stored, where ``sd`` is a view of working copies that offers it (``sd.stored(key)``:
    :class:`~symmerge.pipeline.stream.Lifted`, whose float16/bfloat16 tensors read as float32 copies), else
    ``sd[key]``. For readers that convert to float64 themselves: a 16-bit tensor and its float32 copy give the same
    float64 values, and the stored one takes half the memory of the copy, which is never made."""
    get = getattr(sd, "stored", None)
    return sd[key] if get is None else get(key)


def working_dtype(sd, key: str) -> torch.dtype:
    """The dtype of ``sd[key]`` without making it, where ``sd`` is a view of working copies that offers it
    (``sd.working_dtype(key)``: :class:`~symmerge.pipeline.stream.Lifted`, float32 for a float16/bfloat16 tensor,
    whose float32 copy reading ``sd[key]`` would make), else ``sd[key].dtype``. For readers that only need the
    working precision (:func:`precise_dtype`, :func:`fast_dtype` take these dtypes as they take tensors)."""
    get = getattr(sd, "working_dtype", None)
    return sd[key].dtype if get is None else get(key)


def _dtypes(operands) -> list:
    """The dtypes of ``operands``: tensors, or dtypes (:func:`working_dtype`) as they are."""
    return [x if isinstance(x, torch.dtype) else x.dtype for x in operands]


def precise_dtype(*tensors) -> torch.dtype:
    return torch.float32 if tensors and all(d in HALF for d in _dtypes(tensors)) else torch.float64


def fast_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(d == torch.float64 for d in _dtypes(tensors)) else torch.float32


def sub_tensor(t: torch.Tensor, slot: Slot) -> tuple[torch.Tensor, int]:
    """(the tensor the slot lies in, the slot's axis there): ``t[index]`` of a stacked tensor (one expert
    of fused experts) and the axis one lower, else ``t`` itself (a view either way)."""
    return (t, slot.axis) if slot.index is None else (t[slot.index], slot.axis - 1)


def segment(t: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The slot's slice of its axis, moved first (a view; a copy for a strided slot)."""
    sub, axis = sub_tensor(t.detach(), slot)
    x = sub.movedim(axis, 0)
    if slot.length is None:
        return x
    if slot.period is not None:
        return x.unflatten(0, (-1, slot.period))[:, slot.start: slot.start + slot.length].flatten(0, 1)
    return x[slot.start: slot.start + slot.length]


def slot_length(t: torch.Tensor, slot: Slot) -> int:
    if slot.length is None:
        return t.shape[slot.axis]
    return slot.length * (t.shape[slot.axis] // slot.period if slot.period is not None else 1)


def slot_blocks(t: torch.Tensor, slot: Slot, blocks: int, dtype=torch.float64) -> torch.Tensor:
    """The slot as (blocks, block_size, rest) in ``dtype``; with ``repeat`` r > 1 the r member heads of
    a group head are stacked along ``rest`` (GQA: query heads sharing a KV head's element)."""
    x = segment(t, slot).to(dtype)
    r = slot.repeat
    x = x.reshape(blocks, r, x.shape[0] // (blocks * r), -1)
    return x.transpose(1, 2).reshape(blocks, x.shape[2], -1)


def unit_matrix(t: torch.Tensor, slot: Slot, dtype=None) -> torch.Tensor:
    """The slot's units as rows (n, rest), converted to ``dtype`` (None: as stored, a view if it can)."""
    x = segment(t, slot)
    x = x.reshape(x.shape[0], -1)
    return x if dtype is None else x.to(dtype)


def with_segment(t: torch.Tensor, slot: Slot, new: torch.Tensor) -> torch.Tensor:
    """A new tensor: ``t`` with the slot's segment replaced by ``new`` (axis first, any dtype)."""
    new = new.to(t.dtype)
    if slot.index is not None:  # written through a view of a copy of the whole stacked tensor
        out = t.detach().clone()
        segment(out, slot).copy_(new)
        return out
    if slot.length is None:
        return new.movedim(0, slot.axis).contiguous()
    out = t.detach().movedim(slot.axis, 0).clone()
    if slot.period is not None:
        out.unflatten(0, (-1, slot.period))[:, slot.start: slot.start + slot.length] = \
            new.unflatten(0, (-1, slot.length))
    else:
        out[slot.start: slot.start + slot.length] = new
    return out.movedim(0, slot.axis).contiguous()


def index_axis(t: torch.Tensor, slot: Slot, index: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of the slot's axis re-indexed (``new[j] = old[index[j]]``), optionally times ``factor[j]``:
    exact (no arithmetic unless a factor is given; the product in :func:`precise_dtype`, rounded once to ``t``'s
    dtype), and without transposed copies of whole tensors."""
    if slot.length is None and slot.index is None:
        y = t.detach().index_select(slot.axis, index.to(t.device))
        if factor is not None:
            shape = [1] * y.dim()
            shape[slot.axis] = -1
            scale_rows_(y, factor.to(device=y.device, dtype=precise_dtype(t)).reshape(shape))
        return y.contiguous()
    seg = segment(t, slot).index_select(0, index.to(t.device))
    if factor is not None:
        scale_rows_(seg, factor.to(device=seg.device, dtype=precise_dtype(t)).reshape(-1, *([1] * (seg.dim() - 1))))
    return with_segment(t, slot, seg)


def scale_rows_(y: torch.Tensor, factor: torch.Tensor, budget: int = 1 << 22) -> torch.Tensor:
    """``y`` ← ``(y * factor).to(y.dtype)`` (``factor`` broadcast to ``y``; the product in the promoted dtype, e.g.
    float64 for float32 ``y``), in place and a block of about ``budget`` entries of ``y``'s first axis at a time:
    the same values as the whole product, without a promoted copy of ``y`` (twice its size for float32 rows)."""
    if y.dim() == 0 or y.numel() == 0:
        return y.copy_(y * factor)
    step = max(1, budget // max(1, y[0].numel()))
    for i in range(0, y.shape[0], step):
        block = y[i:i + step]
        block.copy_(block * (factor[i:i + step] if factor.shape[0] > 1 else factor))
    return y


def block_index(perm: torch.Tensor, block: int) -> torch.Tensor:
    """Row index that moves whole blocks of ``block`` rows: new block j = old block ``perm[j]``."""
    return (perm[:, None] * block + torch.arange(block)[None]).reshape(-1)
