"""OT fusion (Imfeld et al., ICLR 2024, after Singh & Jaggi, 2020): soft-align each model to the anchor
with optimal transport, layer by layer, then average.

For a set of n units (FFN hidden units, the query / key / value dims of the attention heads, the
dims of the residual stream) a transport plan T (n × n, uniform marginals) between the units of the
moved model A (rows) and of the anchor B (columns) is computed from a cost between their feature
vectors, and normalised by its column sums: M = T diag(1/colsum T), so that column j holds the convex
weights with which A's units make up B's unit j. Every tensor axis carrying these units is then
transported, producers and consumers alike: along that axis, X ← Mᵀ X (rows of W_in and b_in, columns
of W_out: W_out ← W_out M). With an exact plan (EMD) on equal uniform marginals M is a permutation
matrix and the transport is symmerge's own permutation alignment (applied as an exact re-indexing);
an entropic plan (Sinkhorn) mixes units. The aligned models are then averaged with the weights.

Features of a unit (the cost is the Euclidean — or squared Euclidean — distance between them, divided
by its maximum):

* ``ot_wts`` — weights: the unit's entries in every tensor the unit set transports (the members of
  symmerge's symmetry group for these units: rows and bias of the producers, columns of the
  consumers), read from A *after* the transports of the earlier steps (the inputs of a layer are
  transported before its outputs are matched), optionally scaled to unit length;
* ``ot_acts`` / ``ot_acts_emd`` — activations on data (statistics kind ``activations``, gathered on
  the aligned models): the outputs of the producing linear layers (pre-activation for the FFN), the
  embeddings' output for the residual stream, per token; optionally standardised per unit.

Units, in data-flow order (``units``): ``ffn`` — the hidden units of each FFN; ``attn`` — Q, K and V
dims of each attention layer, one plan over all heads (``cross_heads=True``, Imfeld et al.'s
cross-head alignment) or one per head pair (``False``: head i of A with head i of B), Q and K with
separate plans (``qk="separate"``, Imfeld et al.'s default) or one joint plan (``"joint"``: keeps QKᵀ
intact under an exact plan), W_O's input columns with V's plan; ``residual`` — the residual stream, where the model
has a residual group (a task head reading the stream): ``residual="auto"`` (default) is ``mean`` for pre-norm families
with sequential blocks and ``single`` otherwise; ``residual="mean"`` (Imfeld et al.): the embeddings get a
plan, every block writer (attention output, FFN output) gets its own plan for its output rows, and
the stream after the residual addition carries the mean of the incoming map and the writer's map;
LayerNorms, the next block's readers and the task head's input columns are transported with the map
of the stream they read (pre-norm families); ``residual="single"``: one plan for the whole stream from
all its members (the transport counterpart of symmerge's ``residual`` permutation; any family with
a residual group). Everything not transported (classifier rows, biases of untouched units, …) is
simply averaged.

Two models: the first is transported to the second (the anchor). More: each model is transported to
the anchor — the alignment's anchor when :func:`symmerge.merge.fuse.merge_models` aligned them, else
the last model — and all are averaged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..core.slots import index_axis, precise_dtype, segment, unit_matrix, with_segment
from ..core.solvers.transport import METRICS, as_permutation, check_reg, column_map, ground_cost, transport_plan
from ..errors import SymmergeError
from ..option_ranges import model_index
from ..families.roles import FFN, HEADS, QK, VO, role
from ..pipeline.bound import bind
from .base import Method, weighted_sum

# the unit sets a user names (``--param units=ffn,attn,residual``) and what each transports
UNITS = {"ffn": "hidden_units", "attn": "head_dims", "residual": "stream"}
QK_MODES = ("separate", "joint")
BLOCKS = ("attn", "mlp")  # a layer's blocks in data-flow order (its residual-stream states 2i and 2i + 1)
RESIDUAL_POLICIES = ("auto", "mean", "single")
COMMON = {"units": "ffn,attn,residual", "qk": "separate", "cross_heads": True, "residual": "auto",
          "cost": "euclidean", "normalize": True}


# ------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class Settings:
    reg: float
    units: frozenset  # what is transported: values of UNITS
    qk: str
    cross_heads: bool
    residual: str
    cost: str
    normalize: bool
    activations: bool


def _choice(name: str, value, choices) -> str:
    if value not in choices:
        raise SymmergeError(f"OT fusion: {name} must be {' or '.join(choices)}, got {value!r}")
    return value


def parse_units(value) -> frozenset:
    names = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if names is None:
        raise SymmergeError(f"OT fusion: units must be a comma list of {', '.join(UNITS)}, got {value!r}")
    names = [n.strip() for n in names if n.strip()]
    bad = [n for n in names if n not in UNITS]
    if bad or not names:
        raise SymmergeError(f"OT fusion: units must be a non-empty comma list of {', '.join(UNITS)}, got {value!r}")
    return frozenset(UNITS[n] for n in names)


def settings(params: dict, activations: bool, reg=None) -> Settings:
    """Validated parameters (``reg``: a fixed regularisation overriding ``params``, e.g. 0 for EMD)."""
    for name in ("normalize", "cross_heads"):
        if not isinstance(params[name], bool):
            raise SymmergeError(f"OT fusion: {name} must be true or false, got {params[name]!r}")
    return Settings(check_reg(params["reg"] if reg is None else reg), parse_units(params["units"]),
                    _choice("qk", params["qk"], QK_MODES), params["cross_heads"],
                    _choice("residual", params["residual"], RESIDUAL_POLICIES),
                    _choice("cost", params["cost"], METRICS),
                    params["normalize"], activations)


# ------------------------------------------------------------------ the flow: unit sets in data-flow order


@dataclass(frozen=True)
class Units:
    """A set of units solved by one plan (``blocks`` plans for head-wise transport): ``slots`` are
    every tensor axis carrying them (transported with the map, and the weight features), ``sources``
    the activation columns describing them (key, start, length); ``state``: the residual-stream state
    whose map this plan defines (the embeddings, a block writer), else None."""

    name: str
    slots: tuple
    sources: tuple
    blocks: int = 1
    state: int | None = None


@dataclass(frozen=True)
class Carry:
    """Slots transported with the map of stream ``state`` (LayerNorms, readers' inputs, task heads)."""

    state: int
    slots: tuple


def _module(key: str) -> str:
    return key.rsplit(".", 1)[0]


def _sources(bound, slots) -> tuple:
    """Activation columns of the producing layers among ``slots`` (weights on their output axis)."""
    return tuple((s.key, s.start, s.length) for s in slots if bound.output_axis(s.key) == s.axis)


def _block_units(bound, layer: dict, s: Settings) -> dict:
    """The unit sets of one layer, per block: the attention's head dims, the MLP's hidden units."""
    ffn = layer.get(FFN)
    return {BLOCKS[0]: _attention(bound, layer, s) if "head_dims" in s.units else [],
            BLOCKS[1]: [Units(ffn.name, ffn.slots, _sources(bound, ffn.slots))]
            if "hidden_units" in s.units and ffn is not None else []}


def _attention(bound, layer: dict, s: Settings) -> list:
    qk, vo = layer.get(QK), layer.get(VO)
    if qk is None or vo is None:
        return []
    if getattr(qk.info, "rotary", None):  # RoPE pairs
        raise SymmergeError("OT fusion cannot transport the attention of RoPE models (a query/key dim belongs to a "
                            "frequency pair); leave attn out: --param units=ffn,residual")
    if any(sl.repeat != 1 for sl in qk.slots + vo.slots):
        raise SymmergeError("OT fusion does not transport grouped-query attention (fewer key/value heads than query "
                            "heads); leave attn out: --param units=ffn,residual")
    blocks = 1 if s.cross_heads else qk.blocks
    if s.qk == "joint":
        sets = [(qk.name, qk.slots)]
    else:
        sets = [(qk.name + ".q", tuple(sl for sl in qk.slots if sl.power > 0)),
                (qk.name + ".k", tuple(sl for sl in qk.slots if sl.power < 0))]
    sets.append((vo.name, vo.slots))
    return [Units(name, slots, _sources(bound, slots), blocks) for name, slots in sets]


def _block_of(layers: dict) -> dict:
    """``{module: (layer i, block)}`` of every module the layers' groups touch: the FFN's in the layer's MLP
    block, the attention groups' in its attention block (:data:`BLOCKS`)."""
    return {_module(sl.key): (i, BLOCKS[1] if role(inst.group.name) == FFN else BLOCKS[0])
            for i, groups in layers.items() for inst in groups.values() for sl in inst.slots}


def _fold_places(bound, block_of: dict, fold, i) -> set:
    """The blocks (or ``"final"``: the task heads) reading the norm ``fold`` of layer ``i``."""
    fill = (lambda t: t.format(i=i) if "{i}" in t else t)
    places = {"final" if m.root else block_of.get(_module(bound.prefix + fill(m.name))) for m in fold.readers}
    places.discard(None)
    return places


def _stream_layout(bound, layers: dict, stream) -> dict:
    """Where each slot of the residual stream sits in a pre-norm flow: ``embeddings`` (writing state
    0), per block (layer i, "attn"|"mlp") its ``readers`` (with the norm it reads) and ``writers``,
    and ``final`` (the final norm and the task heads)."""
    spec, prefix = bound.spec, bound.prefix
    block_of = _block_of(layers)
    norm_place = {}
    for fold in spec.folds:
        for i in (sorted(layers) if "{i}" in fold.weight else [None]):
            fill = (lambda t, i=i: t.format(i=i) if "{i}" in t else t)
            places = _fold_places(bound, block_of, fold, i)
            if len(places) != 1:
                raise SymmergeError(f"OT fusion: {prefix + fill(fold.weight)} feeds {len(places)} blocks (parallel "
                                    "attention and MLP); use --param residual=single")
            place = places.pop()
            norm_place[prefix + fill(fold.weight)] = place
            if fold.bias:
                norm_place[prefix + fill(fold.bias)] = place
    out = {"embeddings": [], "readers": {}, "writers": {}, "final": []}
    for sl in stream.slots:
        place = norm_place.get(sl.key)
        if place is None and _module(sl.key) in block_of:
            place = block_of[_module(sl.key)]
            if sl.power != 0:
                out["writers"].setdefault(place, []).append(sl)
                continue
        if place == "final" or (place is None and not sl.key.startswith(prefix)):
            out["final"].append(sl)
        elif place is not None:
            out["readers"].setdefault(place, []).append(sl)
        elif sl.diag or not spec.folds:
            raise SymmergeError(f"OT fusion cannot place {sl.key} in the residual stream's flow (the mean policy "
                                "needs a pre-norm family); use --param residual=single")
        else:
            out["embeddings"].append(sl)
    return out


def _parallel_blocks(bound, layers: dict) -> bool:
    """One norm feeding attention and MLP together (Phi): no sequential flow for the mean policy."""
    block_of = _block_of(layers)
    return any(len({place for place in _fold_places(bound, block_of, f, i) if place != "final"}) > 1
               for f in bound.spec.folds for i in (sorted(layers) if "{i}" in f.weight else [None]))


def build_flow(model, s: Settings) -> list:
    """The unit sets to solve and the stream maps to carry, in data-flow order."""
    bound = bind(model)
    spec, instances = bound.spec, bound.instances
    if spec.stacks:
        raise SymmergeError(f"OT fusion transports one layer stack; {spec.family} models have "
                            f"{len(spec.stacks)} ({', '.join(s.name for s in spec.stacks)}); merge with --method "
                            "average, task arithmetic, TIES or DARE after --align recommended")
    if any(m.stacked for g in spec.groups for m in g.members):
        raise SymmergeError(f"OT fusion does not transport mixtures of experts ({spec.family}: the experts' fused FFN "
                            "tensors and their router would need a plan of their own); merge with --method average, "
                            "task arithmetic, TIES or DARE after --align recommended, whose experts group matches "
                            "the experts")
    layers: dict = {}
    for inst in instances:  # the head dims and hidden units; the head permutation is subsumed by the head dims
        if inst.layer >= 0 and role(inst.group.name) != HEADS:
            layers.setdefault(inst.layer, {})[role(inst.group.name)] = inst
    stream = next((i for i in instances if not i.kind.per_layer), None) if "stream" in s.units else None
    policy = s.residual
    if policy == "auto":  # Imfeld et al.'s mean policy where the stream is pre-norm, else one plan for it all
        pre = stream is not None and stream.group.param("placement") == "pre" and not _parallel_blocks(bound, layers)
        policy = "mean" if pre else "single"
    n_states = len(layers) + 1
    flow: list = []
    if stream is not None and policy == "single":
        flow.append(Units("residual", stream.slots, tuple((f"hidden_states.{k}", 0, None) for k in range(n_states))))
    layout = _stream_layout(bound, layers, stream) if stream is not None and policy == "mean" else None
    if layout is not None:
        flow.append(Units("embeddings", tuple(layout["embeddings"]), (("hidden_states.0", 0, None),), state=0))
    for i in sorted(layers):
        units = _block_units(bound, layers[i], s)
        for k, block in enumerate(BLOCKS):
            state = 2 * i + k
            if layout is not None:
                flow.append(Carry(state, tuple(layout["readers"].get((i, block), ()))))
            flow += units[block]
            writers = tuple(layout["writers"].get((i, block), ())) if layout is not None else ()
            if writers:
                flow.append(Units(f"layer.{i}.{block}.out", writers, _sources(bound, writers), state=state + 1))
    if layout is not None:
        flow.append(Carry(2 * len(layers), tuple(layout["final"])))
    return flow


# ------------------------------------------------------------------ features, plans, transport


def _standardized(x: torch.Tensor) -> torch.Tensor:
    """Each row (a unit's activations) centred and scaled to unit standard deviation (constant rows: centred)."""
    x = x - x.mean(1, keepdim=True)
    std = x.std(1, keepdim=True)
    return x / torch.where(std > 0, std, torch.ones_like(std))


def _features(step: Units, work: dict, anchor: dict, acts, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """(A's, B's) features of ``step``'s units, (units × features), float64."""
    if acts is None:
        xa = torch.cat([unit_matrix(work[sl.key], sl, torch.float64) for sl in step.slots], 1)
        xb = torch.cat([unit_matrix(anchor[sl.key], sl, torch.float64) for sl in step.slots], 1)
        if s.normalize:
            xa = xa / xa.norm(dim=1, keepdim=True).clamp_min(1e-30)
            xb = xb / xb.norm(dim=1, keepdim=True).clamp_min(1e-30)
        return xa, xb
    if not step.sources:
        raise SymmergeError(f"OT fusion: no activations describe {step.name}")
    parts = ([], [])
    for key, start, length in step.sources:
        pair = [a.get(key) for a in acts]
        if any(p is None for p in pair):
            raise SymmergeError(f"OT fusion: the activations lack {key} (gather them with the 'activations' "
                                "statistics)")
        if pair[0].shape != pair[1].shape:
            raise SymmergeError(f"OT fusion: activations of {key} have shapes {tuple(pair[0].shape)} and "
                                f"{tuple(pair[1].shape)}: they must come from the same inputs")
        for out, a in zip(parts, pair):
            x = a[:, start: None if length is None else start + length].double().T
            out.append(_standardized(x) if s.normalize else x)
    return torch.cat(parts[0], 1), torch.cat(parts[1], 1)


def unit_map(xa: torch.Tensor, xb: torch.Tensor, blocks: int, s: Settings) -> torch.Tensor:
    """The normalised map M (n × n) from the features: one plan, or one per block on the diagonal."""
    n = xa.shape[0]
    if xb.shape[0] != n or n % blocks:
        raise SymmergeError(f"OT fusion: {n} and {xb.shape[0]} units do not split into {blocks} equal blocks")
    d = n // blocks
    M = torch.zeros(n, n, dtype=torch.float64)
    for b in range(blocks):
        r = slice(b * d, (b + 1) * d)
        M[r, r] = column_map(transport_plan(ground_cost(xa[r], xb[r], s.cost), s.reg))
    return M


def move(t: torch.Tensor, slot, M: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` with the slot's axis transported by M (new unit j = Σ_i M_ij old unit i); an exact
    re-indexing when ``perm`` (M is that permutation)."""
    if perm is not None:
        return index_axis(t, slot, perm)
    seg = segment(t, slot)
    dtype = precise_dtype(t)
    new = M.to(device=seg.device, dtype=dtype).T @ seg.reshape(seg.shape[0], -1).to(dtype)
    return with_segment(t, slot, new.reshape(seg.shape))


def _apply(work: dict, slots, M: torch.Tensor) -> None:
    perm = as_permutation(M)
    for sl in slots:
        new = move(work[sl.key], sl, M, perm)
        work[sl.key] = new
        for alias in sl.aliases:
            if alias in work:
                work[alias] = new


def transport(state_dict: dict, anchor: dict, flow: list, s: Settings, acts=None) -> dict:
    """``state_dict`` transported onto ``anchor`` along ``flow``; ``acts``: (model's, anchor's)
    activation statistics for the activation cost (None: weights)."""
    work = dict(state_dict)
    states: dict = {}
    for step in flow:
        if isinstance(step, Carry):
            if step.slots:
                _apply(work, step.slots, states[step.state])
            continue
        M = unit_map(*_features(step, work, anchor, acts, s), step.blocks, s)
        _apply(work, step.slots, M)
        if step.state is not None:  # the stream after a writer: the mean of the incoming map and the writer's
            prev = states.get(step.state - 1)
            states[step.state] = M if prev is None else 0.5 * (prev + M)
    return work


def _check_keys(flow: list, keys) -> None:
    keys = set(keys)
    for step in flow:
        for sl in step.slots:
            if sl.key not in keys:
                hint = (" (the task head reads the residual stream: merge the heads too, --heads merge, or leave "
                        "the stream out, --param units=ffn,attn)" if isinstance(step, Carry) else "")
                raise SymmergeError(f"OT fusion must transport {sl.key}, which is not among the merged tensors{hint}")


def transport_models(state_dicts, model, params: dict, activations: bool = False, stats=None, anchor=None,
                     reg=None) -> list[dict]:
    """Every state dict transported onto the anchor (``anchor``: index, None: the last); the anchor's
    own is returned unchanged. ``params``: the method's parameters (defaults filled in)."""
    s = settings(params, activations, reg)
    n = len(state_dicts)
    k = n - 1 if anchor is None else model_index(anchor, n, "OT fusion: anchor index")
    if activations and (stats is None or len(stats) != n):
        raise SymmergeError("OT fusion from activations needs the activations of every model (--data)")
    flow = build_flow(model, s)
    _check_keys(flow, state_dicts[k].keys())
    return [sd if i == k else transport(sd, state_dicts[k], flow, s,
                                        (stats[i], stats[k]) if activations else None)
            for i, sd in enumerate(state_dicts)]


def _prepare(state_dicts, base, weights, params, stats=None, model=None, anchor=None, *, activations: bool,
             reg=None):
    return transport_models(state_dicts, model, params, activations, stats, anchor, reg)


def transported(method, state_dicts, model, stats=None, anchor=None, **params) -> list[dict]:
    """The state dicts as OT fusion ``method`` (a name or Method of :data:`METHODS`) aligns them onto the
    anchor, before averaging (e.g. to measure the distance the alignment leaves)."""
    from .registry import get_method

    m = get_method(method) if isinstance(method, str) else method
    if m.name not in {x.name for x in METHODS}:
        raise SymmergeError(f"{m.name!r} is not an OT fusion method")
    return m.prepare(state_dicts, None, None, m.check_params(params), stats=stats, model=model, anchor=anchor)


def tensor(key, tensors, weights, stats, base, params, context):
    return weighted_sum([sd[key] for sd in context], weights)


def _method(name: str, doc: str, activations: bool, defaults: dict, reg=None) -> Method:
    return Method(name, tensor, needs="activations" if activations else None, params={**defaults, **COMMON}, doc=doc,
                  prepare=partial(_prepare, activations=activations, reg=reg), needs_model=True)


OT_WTS = _method("ot_wts", "OT-WTS (Imfeld et al., 2024): units soft-aligned to the anchor by optimal transport on "
                 "weights (Sinkhorn), then averaged.", False, {"reg": 0.06})
OT_ACTS = _method("ot_acts", "OT-ACTS (Imfeld et al., 2024): units soft-aligned to the anchor by optimal transport "
                  "on activations (Sinkhorn), then averaged.", True, {"reg": 0.08})
OT_ACTS_EMD = _method("ot_acts_emd", "OT-ACTS-EMD (Imfeld et al., 2024): units aligned to the anchor by exact optimal "
                      "transport (EMD) on activations, then averaged.", True, {}, reg=0.0)
METHODS = (OT_WTS, OT_ACTS, OT_ACTS_EMD)
