"""The unit both execution wings run: one output tensor, where its inputs come from, and the method's
arguments for it.

A merge plan (:mod:`symmerge.merge.plan`) resolves, once, a list of :class:`TensorStep`. The in-memory
wing reads each step's sources from state dicts, the streamed wing from safetensors files; both call
:func:`step_arguments` and then :func:`symmerge.merge.base.merge_tensor`, so they give the same bits.

* A plain merge of N models with the same tensors has one step per tensor, its sources the N models'
  tensors of the same name, with the same arguments everywhere.
* A mergekit config may vary the arguments per tensor (gradients over the layers, filters on the tensor
  names, per-model parameters such as ``density``) and may take a tensor from another name or another
  model (``slices``: the output's layer 12 from layer 20 of model B): the step carries the tensor's own
  arguments and its own sources.

Parameter values in ``TensorStep.params`` are already evaluated for the tensor: a scalar for a global
parameter, a tuple of one value per merged model for a parameter the method declares per model
(:attr:`symmerge.merge.base.Method.per_model`). ``weights`` are the raw per-model weights (``None``:
uniform); :func:`step_arguments` normalises them as the method asks and checks the parameters and the
number of models (:meth:`symmerge.merge.base.Method.check_inputs`).

Which inputs are sources and which is the base: a method with ``needs_base`` or ``accepts_base`` gets the
base model in ``TensorStep.base`` and the *other* models in ``sources`` (a mergekit config that lists its
``base_model`` among ``models`` too does not merge it twice: slerp's and nearswap's two models are the base
plus one source, nuslerp's are two sources plus an optional base). A method whose base policy is ``ignored``
(``linear``, ``karcher``, ``passthrough``: :attr:`~symmerge.merge.base.Method.base_policy`) merges every listed
model, the config's ``base_model`` included (mergekit's ``linear`` treats it as one more input). A method's
defaults are mergekit's, the same from a config and from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


# safetensors' order of dtypes in a file (its ``Dtype`` enum, largest first: ``save_file`` sorts by dtype, then name)
_FILE_DTYPES = ("uint64", "int64", "float64", "float32", "uint32", "int32", "bfloat16", "float16", "uint16", "int16",
                "float8_e8m0fnu", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "bool")


def file_order(names, dtype_of, save_name=lambda k: k) -> list:
    """``names`` (or any items: ``dtype_of`` and ``save_name`` read them) in the order ``safetensors.save_file``
    lays a file out — by dtype (its enum, largest first), then by the name written (``save_name``) — so that a
    streamed output does not depend on how its inputs were sharded, and a one-file output is the file the
    in-memory wing (``save_pretrained``) writes."""
    rank = {d: i for i, d in enumerate(_FILE_DTYPES)}
    return sorted(names, key=lambda k: (rank.get(str(dtype_of(k)).removeprefix("torch."), len(rank)), save_name(k)))


@dataclass(frozen=True)
class TensorSource:
    """A tensor of one input: ``model`` indexes the plan's inputs, ``key`` is the tensor's in-memory name
    (``state_dict`` naming) in that input."""

    model: int
    key: str


@dataclass(frozen=True)
class TensorStep:
    """One output tensor ``name`` (in-memory naming): merged from ``sources`` (one per merged model, in
    model order; the base model's tensor in ``base``), or copied from ``sources[0]`` when ``merge`` is
    false (a task head kept from one model, a passthrough slice)."""

    name: str
    sources: tuple[TensorSource, ...]
    base: TensorSource | None = None
    weights: tuple[float, ...] | None = None
    params: Mapping = field(default_factory=lambda: MappingProxyType({}))
    merge: bool = True


def describe_step(step: TensorStep) -> dict:
    """One step as the printed plan shows it (``--print-plan``)."""
    out = {"tensor": step.name, "op": "merge" if step.merge else "copy",
           "sources": [[s.model, s.key] for s in step.sources]}
    if step.merge:
        out.update(base=[step.base.model, step.base.key] if step.base is not None else None,
                   weights=list(step.weights) if step.weights is not None else None, params=dict(step.params))
    return out


def uniform_steps(keys, n: int, base: int | None = None, weights=None, params=None, copy_from: dict | None = None):
    """Steps of a plain merge: every key of ``keys`` merged from models ``0 … n-1`` under the same name (the
    base, when given, is input ``base``), the same arguments everywhere; ``copy_from``: key → the model a
    kept tensor is copied from (not merged)."""
    params = MappingProxyType(dict(params or {}))
    if weights is not None:  # checked as the method will check them (numbers, one per model), before any work
        from .base import normalized_weights

        weights = tuple(normalized_weights(weights, n, normalize=False))
    copy_from = copy_from or {}
    steps = []
    for k in keys:
        if k in copy_from:
            steps.append(TensorStep(k, (TensorSource(copy_from[k], k),), merge=False))
            continue
        steps.append(TensorStep(k, tuple(TensorSource(i, k) for i in range(n)),
                                None if base is None else TensorSource(base, k), weights, params))
    return steps


def copies(method, value) -> bool:
    """Whether a step of ``method`` is a plain copy of its one input, its ``copy_unless`` parameter being ``value``
    (None: not given; a per-model list: its values): passthrough's tensor is its model's unless ``scale`` is given
    other than 1. The one rule of every entry (a plain merge's steps, a mergekit config's planner)."""
    if method is None or method.copy_unless is None:
        return False
    return all(v is None or v == 1 for v in (value if isinstance(value, (list, tuple)) else [value]))


def plain_merge_steps(order, merged, n: int, *, base: int | None = None, weights=None, params=None,
                      head_from: int = 0, method=None):
    """The steps of a plain merge, in memory and streamed alike: every key of ``order`` (the tensors of the
    input the output is named after, ``head_from``, in its order) merged from models ``0 … n-1`` when it is in
    ``merged`` (the body, and the heads when they are merged), else copied from ``head_from`` (its task head,
    a base model's missing head); every key copied from the one model when ``method`` copies (:func:`copies`:
    a one-model passthrough without ``scale``), as a mergekit config plans the same merge."""
    merged = set(merged)
    if n == 1 and base is None and copies(method, (params or {}).get(method.copy_unless)):
        merged = set()
    return uniform_steps(order, n, base=base, weights=weights, params=params,
                         copy_from={k: head_from for k in order if k not in merged})


def measured_steps(steps, heads) -> set:
    """The output tensors the report's distances sum, in every entry: the body (every step but the tensors of
    ``heads``, the language-model or task head; docs/merge.md, "Two distances"), its merged steps — and its copies
    when every step copies from one and the same input (a one-model passthrough: each copy's distance to that input,
    measured as written, 0 unless the output's dtype rounds it)."""
    heads = set(heads)
    one = one_input_copies(steps)
    return {st.name for st in steps if (st.merge or one) and st.name not in heads}


def one_input_copies(steps) -> bool:
    """Whether every step of ``steps`` copies from one and the same input (a one-model passthrough)."""
    return bool(steps) and not any(st.merge for st in steps) and len({st.sources[0].model for st in steps}) == 1


def step_arguments(method, step: TensorStep, n: int, cache: dict | None = None):
    """(weights, params) of ``method`` for ``step``: the weights normalised as the method asks
    (:func:`symmerge.merge.base.normalized_weights`), the parameters checked with defaults filled in
    (:meth:`symmerge.merge.base.Method.check_params`). ``cache``: a dict kept across the steps of one merge,
    so identical arguments are checked once."""
    from .base import normalized_weights

    token = (step.weights, tuple(sorted((k, _hashable(v)) for k, v in step.params.items())))
    if cache is not None and token in cache:
        return cache[token]
    method.check_inputs(n, step.base is not None)
    weights = normalized_weights(step.weights, n, normalize=method.normalize_weights)
    params = method.check_params(dict(step.params), n=n)
    if method.check_weights is not None:
        method.check_weights(step.weights, params)
    if cache is not None:
        cache[token] = (weights, params)
    return weights, params


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v
