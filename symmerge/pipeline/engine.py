"""The solver engine: find the group elements that move model A closest (L2) to the anchor B.

One engine serves in-memory and streamed alignment:

* :func:`solve_local` — the per-layer groups of any set of layers: group by group in the spec's order
  (head permutation before the head groups it couples, then QK, VO, FFN), each group's kind solving
  all its instances at once (batched SVDs) on A moved by the groups before it. A kind whose
  instances are costly independent problems (the FFN permutation: a cost GEMM and an exact assignment
  per layer) solves them on a pool of ``Options.workers`` threads, one torch thread each
  (:func:`symmerge.core.parallel.layer_map`), bit-identical to one after another; when no earlier group
  touches its tensors it starts at once, on its own thread beside the earlier groups (the FFN layers
  while the head groups are solved; not with ``workers=1``). In-memory alignment
  hands it every layer; streaming one tensor-disjoint part of a layer (:func:`parts`), whose costly
  read-once step (:func:`prepare_costly`) may run on on-demand tensors.
* :func:`solve` — adds the model-wide groups (the residual stream), which couple every layer: they act
  on the other axis of the same tensors and commute with the per-layer groups, so they are solved by
  coordinate descent, each step exact for its group given the rest, until the objective (the squared
  distance over the matched tensors) stops decreasing — monotone by construction; a cap with a warning.
  Costly discrete groups (``Kind.lazy``: the head pairing) are held fixed between full sweeps.
* :func:`search` — the descent is exact step by step but settles in a local optimum that depends on where it
  starts: several starts (today's, the identity, both models in a canonical frame), then restarts within a
  time budget — the best solution's stream kicked by a small random rotation, two heads of a layer's pairing
  swapped or two blocks of FFN units exchanged (held while the stream is re-solved around them: a joint step
  no single group's exact solve takes), the stream drawn at random — each followed by the whole descent;
  the solution with the lowest objective is kept, and the report names every start and its objective.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..core.apply import apply
from ..core.distance import sq_distance
from ..core.parallel import pool_size, torch_threads
from ..groups import Options

DESCENT_TOL = 1e-9  # a sweep must lower the objective by more than this (relative) to continue
# the restarts the docs suggest when the search is asked for (each one descent: seconds on a small ViT, minutes on
# a large model); without --restarts the search is off: the descent alone
DEFAULT_RESTARTS = 5
# the restarts after the plain starts, in turn: the best stream kicked, a discrete group's swap, a random stream
MOVES = ("kick", "swap", "kick", "swap", "random")


@dataclass
class SolveContext:
    """What a kind may look up while solving: all instances of the solve (e.g. the head groups a head
    permutation couples) and a key restriction for the model-wide cost."""

    instances: list = field(default_factory=list)
    only_keys: set | None = None


def by_group(instances) -> dict[str, list]:
    """Instances grouped by group name, groups in first-appearance (= spec) order."""
    out: dict[str, list] = {}
    for inst in instances:
        out.setdefault(inst.group.name, []).append(inst)
    return out


def active(instances, opts: Options) -> list:
    return [i for i in instances if i.kind.active(i, opts)]


def prepare_costly(instances, sd_a, sd_b, opts: Options, ctx: SolveContext | None = None) -> dict:
    """The read-once costly step of the kinds that have one (cost matrices and their assignments),
    ``{group name: prepared}``; ``sd_a``/``sd_b`` may read tensors on demand. Only for a group whose
    tensors no group solved before it moves (the FFN inside each expert comes after the experts'
    permutation: it is prepared when solved, on the moved tensors)."""
    ctx = ctx or SolveContext(list(instances))
    out, touched = {}, set()
    for name, insts in by_group(active(instances, opts)).items():
        kind = insts[0].kind
        keys = {s.key for i in insts for s in i.slots}
        if kind.streams_costs and not keys & touched:
            out[name] = kind.prepare(insts, sd_a, sd_b, opts, ctx)
        touched |= keys
    return out


def solve_local(instances, sd_a: dict, sd_b: dict, opts: Options, progress=None, prepared: dict | None = None,
                ctx: SolveContext | None = None, timings: dict | None = None) -> dict:
    """Elements of the per-layer groups among ``instances`` (``{instance name: element}``); seconds
    per group are added to ``timings``. With several layers everything runs with one torch thread
    (restored afterwards): the batched head groups gain little from OpenMP teams, which stall on a
    shared machine (0.35 s against 6.7 s for one layer's head groups under load), and the FFN layers
    take the cores through their pool. One layer (a streamed part) keeps torch's threads."""
    ctx = ctx or SolveContext(list(instances))
    groups = list(by_group(active(instances, opts)).items())
    # several layers (in memory): one torch thread; the cores go to the FFN layers' pool
    many = len({i.layer for _, insts in groups for i in insts}) > 1
    with torch_threads(1 if many else None):
        return _solve_groups(groups, sd_a, sd_b, opts, progress, prepared, ctx, timings)


def _early_prepares(groups, prepared, sd_a, sd_b, opts, ctx, pool) -> dict:
    """``{group name: future of (prepared, seconds)}`` for the costly read-once steps that can start at
    once: a kind with one (``streams_costs``) whose tensors no earlier group touches sees ``sd_a`` as it
    is, so its cost matrices and assignments (the FFN layers, on their own pool) run while the earlier
    groups (the batched head groups) are solved — the cores are never idle waiting for one of them."""
    out, touched = {}, set()
    for name, insts in groups:
        keys = {s.key for i in insts for s in i.slots}
        kind = insts[0].kind
        if kind.streams_costs and not (prepared and name in prepared) and touched and not keys & touched:
            def run(kind=kind, insts=insts):
                t0 = time.perf_counter()
                return kind.prepare(insts, sd_a, sd_b, opts, ctx), time.perf_counter() - t0
            out[name] = pool.submit(run)
        touched |= keys
    return out


def _solve_groups(groups, sd_a, sd_b, opts, progress, prepared, ctx, timings) -> dict:
    with ThreadPoolExecutor(max_workers=1) as pool:
        overlap = len(groups) > 1 and pool_size(opts.workers) > 1  # workers=1: one thread, one thing at a time
        early = _early_prepares(groups, prepared, sd_a, sd_b, opts, ctx, pool) if overlap else {}
        try:
            return _solve_in_order(groups, sd_a, sd_b, opts, progress, prepared, ctx, timings, early)
        finally:
            for future in early.values():
                future.cancel()


def _solve_in_order(groups, sd_a, sd_b, opts, progress, prepared, ctx, timings, early) -> dict:
    elements: dict = {}
    moved = sd_a
    for k, (name, insts) in enumerate(groups):
        t0 = time.perf_counter()
        kind = insts[0].kind
        ahead = 0.0  # seconds its early prepare ran in the background
        if name in early:
            pre, ahead = early[name].result()
            t0 = time.perf_counter()
        elif prepared and name in prepared:
            pre = prepared[name]
        else:
            pre = kind.prepare(insts, moved, sd_b, opts, ctx)
        found = kind.complete(insts, pre, moved, sd_b, opts, ctx)
        elements.update(found)
        later = {s.key for _, g in groups[k + 1:] for i in g for s in i.slots}
        if later & {s.key for i in insts for s in i.slots}:  # a later group acts on these tensors too
            moved = apply(moved, insts, found)
        if timings is not None:
            timings[name] = timings.get(name, 0.0) + ahead + time.perf_counter() - t0
        if progress is not None:
            progress(name)
    return elements


def solve(instances, sd_a: dict, sd_b: dict, opts: Options, progress=None, history: list | None = None,
          max_sweeps: int = 50, init: str = "stream", start: dict | None = None, tol: float = DESCENT_TOL,
          lazy: bool = True) -> dict:
    """Group elements ``{instance name: element}`` aligning ``sd_a`` to the anchor ``sd_b``.

    Model-wide groups need both state dicts in their canonical form
    (:func:`symmerge.core.apply.canonicalize`). They and the per-layer groups are solved by
    coordinate descent; the squared distance over the matched tensors after each sweep is appended
    to ``history``, and the best sweep's elements are returned. ``init``: the first model-wide step
    uses only the tensors no per-layer group touches (``stream``: embeddings, heads, norms), or all of
    them (``all``), or follows a first per-layer solve (``local``); ``start``: elements to start from
    (the first model-wide step then uses all tensors, given the per-layer elements of ``start``).
    ``tol``: a sweep must lower the objective by more than this fraction to go on. ``lazy``: the lazy
    kinds' groups (head pairings: valuing every pairing is most of a sweep) are re-solved only on full
    sweeps — the first, and one whenever the rest has converged with them held fixed — and the descent
    ends when a full sweep gains nothing: the same stopping point as re-solving them every sweep (a full
    sweep that keeps the pairing is a sweep with it held), at a fraction of the cost per sweep."""
    local = [i for i in instances if i.kind.per_layer]
    wide = active([i for i in instances if not i.kind.per_layer], opts)
    if not wide:
        return solve_local(local, sd_a, sd_b, opts, progress)
    local_keys = {s.key for i in active(local, opts) for s in i.slots}
    pure = {s.key for i in wide for s in i.slots if s.key not in local_keys}
    matched = sorted(local_keys | {s.key for i in wide for s in i.slots})
    elements: dict = solve_local(local, sd_a, sd_b, opts) if init == "local" else {}
    if start:
        elements, init = {k: v for k, v in start.items() if k not in {i.name for i in wide}}, "all"
    # lazy groups (head pairings) are solved on full sweeps only: the first, and one after the others have
    # converged with them held fixed; the descent ends when a full sweep gains nothing
    held = [i for i in active(local, opts) if i.kind.lazy] if lazy else []
    rest = [i for i in local if i not in held]
    best, best_value, full = dict(elements), float("inf"), True
    for sweep in range(max_sweeps):
        base = apply(sd_a, local, elements)
        first = sweep == 0 and init == "stream"
        # several model-wide groups (CLIP: each tower's stream and the shared space, which meet in the
        # projections, on their two axes) are solved one after another, each given the others' current
        # elements; on the first sweep a group leaves out the tensors a later one has still to move
        wide_groups = list(by_group(wide).values())
        for k, insts in enumerate(wide_groups):
            others = [i for j, g in enumerate(wide_groups) if j != k for i in g if i.name in elements]
            moved = apply(base, others, elements) if others else base
            later = {s.key for g in wide_groups[k + 1:] for i in g for s in i.slots}
            only = (pure - later or pure or None) if first else None
            elements.update(insts[0].kind.solve(insts, moved, sd_b, opts,
                                                SolveContext(list(instances), only_keys=only)))
        moved = apply(sd_a, wide, elements)
        if full or not held:
            elements.update(solve_local(local, moved, sd_b, opts))
        else:
            elements.update(solve_local(rest, apply(moved, held, elements), sd_b, opts))
        value = sq_distance(apply(moved, local, elements), sd_b, matched)
        if history is not None:
            history.append(value)
        if progress is not None:
            progress(f"sweep {sweep + 1}")
        gained = value < best_value * (1 - tol)
        if value < best_value:  # the best sweep is kept, even one that gains too little to go on
            best, best_value = dict(elements), value
        if not gained:
            if full or not held:
                break
            full = True  # converged with the lazy groups held: re-solve them once
            continue
        full = not held
    else:
        warnings.warn(f"coordinate descent stopped at the cap of {max_sweeps} sweeps while still improving "
                      f"(last {history[-1] if history else value:.6g}); raise max_sweeps to go on", stacklevel=2)
    return best


def ends_keys(instances, opts: Options) -> set:
    """The stream's ends: the tensors of the active model-wide groups that no active per-layer group touches (the
    embeddings, the task heads, the norms, the writers' biases). Their other axis is fixed (pixels, positions,
    classes, vocabulary), so no per-layer element can bend them to fit."""
    local = {s.key for i in active([i for i in instances if i.kind.per_layer], opts) for s in i.slots}
    return {s.key for i in active([i for i in instances if not i.kind.per_layer], opts) for s in i.slots} - local


def depth_weights(instances, opts: Options, decay: float) -> dict:
    """``{key: weight}`` of the tensors the active per-layer groups move: the k-th of the n layers they lie in
    (in layer order, from the input) weighs ``decay^(-k/(n-1))``: the first layer once, the last ``1/decay`` times,
    geometric in between (one layer, or ``decay`` 1: every weight 1). Independently trained models share more near
    the input; the weighting lets the early layers, which the stream's embeddings feed, set the stream first. A
    tensor in groups of several layers takes the earliest's weight."""
    layer_of: dict = {}
    for inst in active([i for i in instances if i.kind.per_layer], opts):
        for s in inst.slots:
            layer_of[s.key] = min(layer_of.get(s.key, inst.layer), inst.layer)
    order = {layer: k for k, layer in enumerate(sorted(set(layer_of.values())))}
    n = len(order)
    return {key: (decay ** (-order[layer] / (n - 1)) if n > 1 else 1.0) for key, layer in layer_of.items()}


def objective_weights(instances, opts: Options, ends_weight: float = 1.0, depth_decay: float = 1.0) -> dict:
    """``{key: weight}`` of the tensors whose weight in the data-free objective is not 1: the stream's ends
    (:func:`ends_keys`) ``ends_weight``, the per-layer groups' tensors by depth (:func:`depth_weights`). Empty
    without an active model-wide group: every per-layer group is then solved on its own, and a group's tensors
    share one factor, so the weights change no optimum (and are not applied)."""
    if not active([i for i in instances if not i.kind.per_layer], opts):
        return {}
    weights = depth_weights(instances, opts, depth_decay) if depth_decay != 1.0 else {}
    if ends_weight != 1.0:
        weights.update(dict.fromkeys(ends_keys(instances, opts), ends_weight))
    return {k: w for k, w in weights.items() if w != 1.0}


def scaled(sd: dict, weights: dict) -> dict:
    """``sd`` with every tensor of ``weights`` times the square root of its weight (no weights: ``sd`` itself): the
    squared distance between two such copies is the weighted one (:func:`objective_weights`)."""
    if not weights:
        return sd
    return {k: (v * math.sqrt(weights[k]) if k in weights else v) for k, v in sd.items()}


def weighted(instances, sd_a: dict, sd_b: dict, opts: Options, ends_weight: float = 1.0,
             depth_decay: float = 1.0) -> tuple[dict, dict]:
    """Both state dicts with every tensor times the square root of its weight in the objective
    (:func:`objective_weights`: the stream's ends ``ends_weight``, the per-layer groups' tensors by depth, the rest 1).
    The squared distance the descent minimises on these copies is the weighted one, and solving on them solves it
    exactly: the ends are moved by the model-wide groups only, each per-layer group's tensors lie in one layer and
    share one factor (its cost is a sum of the tensors' products: the same minimiser, scaled), and the model-wide
    cost is a sum of products, so each tensor enters it with its weight. The elements found apply to the models as
    they are. Every weight 1: the inputs themselves."""
    weights = objective_weights(instances, opts, ends_weight, depth_decay)
    return scaled(sd_a, weights), scaled(sd_b, weights)


def weighted_ends(instances, sd_a: dict, sd_b: dict, opts: Options, weight: float) -> tuple[dict, dict]:
    """:func:`weighted` with the stream's ends alone weighted (``weight`` times; 1: the inputs)."""
    return weighted(instances, sd_a, sd_b, opts, ends_weight=weight)


@dataclass(frozen=True)
class Restarts:
    """The restarts of :func:`search`: ``count`` of them (None: no search at all, the ``current`` descent
    alone; :data:`DEFAULT_RESTARTS` is a sensible count), drawn from ``seed``, none begun after ``budget``
    seconds (None: no limit; 0: the ``current`` start alone), every start's objective with the stream's ends counted
    ``ends_weight`` times and the layers' tensors decaying with depth by ``depth_decay`` (:func:`weighted`). The
    alignment options' ``restarts``, ``solver_seed``, ``solver_budget``, ``ends_weight`` and ``depth_decay``."""

    count: int | None = None
    budget: float | None = None
    seed: int = 0
    ends_weight: float = 1.0
    depth_decay: float = 1.0

    @classmethod
    def of(cls, options) -> "Restarts":
        """The restarts and objective weights an alignment's options ask for (``AlignOptions``: ``restarts``,
        ``solver_budget``, ``solver_seed``, ``ends_weight``, ``depth_decay``): one reading for every caller of
        :func:`search`."""
        return cls(options.restarts, options.solver_budget, options.solver_seed, options.ends_weight,
                   options.depth_decay)


def search(instances, sd_a: dict, sd_b: dict, opts: Options, progress=None, history: list | None = None,
           max_sweeps: int = 50, tol: float = DESCENT_TOL, starts: Restarts = Restarts(),
           keep: dict | None = None) -> tuple[dict, dict | None]:
    """The elements of :func:`solve` from several starts, and the search's record (None without a model-wide
    group: the per-layer groups are then solved exactly, with nothing to search).

    Every start is followed by the whole descent (:func:`solve`, ``max_sweeps``, ``tol``); the solution with
    the lowest objective (the squared distance over the matched tensors that the descent minimises) is kept.
    The plain starts: ``current`` (the descent as it always started: the stream first from the tensors no
    per-layer group touches), ``identity`` (every element the identity: the per-layer groups solved on A as it
    is) and ``canonical`` (each model's stream in a canonical frame of its own: :meth:`Kind.spectral_start` on the
    same tensors). Then restarts, in the turn of :data:`MOVES`, from the best solution so far: ``kick`` — its
    stream moved by a small random group element (:meth:`Kind.perturb`), the per-layer groups re-solved for it;
    ``swap`` — one discrete per-layer element (two heads of the pairing, two blocks of FFN units) swapped, the
    rest of its layer re-solved around it and the stream re-solved given it (a joint step: coordinate descent
    re-solves the pairing only for the stream it has); ``random`` — a random stream. ``starts``
    (:class:`Restarts`): ``count`` of them (None: no search at all, the ``current`` descent alone;
    :data:`DEFAULT_RESTARTS` is a sensible count), drawn from ``seed``: the same result on any machine; ``budget``:
    seconds after which no further restart begins (None: no limit; a limit makes the count depend on the machine's
    speed; 0: the ``current`` start alone, the descent as it was). ``history`` receives the kept start's sweeps;
    ``keep`` (a dict), every start's elements by the start's name (benchmarks). ``starts.ends_weight``: the stream's
    ends (:func:`ends_keys`) count this many times in the objective, and ``starts.depth_decay``: the layers' tensors
    weigh less with depth, the last layer ``1/depth_decay`` of the first (:func:`weighted`; both 1: the plain
    squared distance); every objective reported is the weighted one."""
    wide = active([i for i in instances if not i.kind.per_layer], opts)
    if not wide:
        return solve(instances, sd_a, sd_b, opts, progress, history, max_sweeps, tol=tol), None
    sd_a, sd_b = weighted(instances, sd_a, sd_b, opts, starts.ends_weight, starts.depth_decay)
    restarts, budget, seed = starts.count, starts.budget, starts.seed
    local = [i for i in instances if i.kind.per_layer]
    t0 = time.perf_counter()
    runs: list[dict] = []
    best: dict = {}

    def descend(name: str, **start) -> None:
        sweeps, t = [], time.perf_counter()
        found = solve(instances, sd_a, sd_b, opts, history=sweeps, max_sweeps=max_sweeps, tol=tol, **start)
        value = min(sweeps)
        runs.append({"start": name, "objective": value, "sweeps": len(sweeps), "seconds": time.perf_counter() - t})
        if keep is not None:
            keep[name] = found
        if not best or value < best["objective"]:
            best.update(objective=value, elements=found, history=sweeps, start=name)
        if progress is not None:
            progress(f"start {name}")

    def around(stream: dict) -> dict:
        """The per-layer elements solved for the model-wide elements ``stream``: a start for :func:`solve`."""
        return solve_local(local, apply(sd_a, wide, stream), sd_b, opts)

    descend("current")  # solve's own start (the stream first; a caller's functools.partial of solve may set another)
    if restarts is None:  # no search unless asked: it lowers the weight objective, not the barrier (docs/results.md)
        restarts, budget = 0, 0
    if budget != 0:
        descend("identity", init="local")
        local_keys = {s.key for i in active(local, opts) for s in i.slots}
        pure = {s.key for i in wide for s in i.slots if s.key not in local_keys} or None
        canonical = {i.name: i.kind.spectral_start(i, sd_a, sd_b, pure) for i in wide}
        if all(e is not None for e in canonical.values()):
            descend("canonical", start=around(canonical))
    generator = torch.Generator().manual_seed(seed)
    discrete = [i for i in active(local, opts) if i.kind.discrete(i)]
    count = 0
    while budget != 0 and count < restarts and (budget is None or time.perf_counter() - t0 < budget):
        move = MOVES[count % len(MOVES)]
        count += 1
        start = _restart(move, best["elements"], wide, local, discrete, sd_a, sd_b, opts, generator, around)
        if start is not None:
            descend(f"{move} {count}", start=start)
    if history is not None:
        history.extend(best["history"])
    return best["elements"], {"starts": runs, "winner": best["start"], "objective": best["objective"],
                              "restarts": count, "budget_seconds": budget, "seed": seed,
                              "ends_weight": starts.ends_weight, "depth_decay": starts.depth_decay,
                              "seconds": time.perf_counter() - t0}


def _restart(move, incumbent, wide, local, discrete, sd_a, sd_b, opts, generator, around) -> dict | None:
    """The start of one restart of :func:`search` (per-layer elements; the descent re-solves the stream first),
    or None where the move does not apply."""
    if move == "random":
        return around({i.name: i.kind.random(i, generator) for i in wide})
    if move == "kick":
        kicked = {i.name: i.kind.perturb(i, incumbent[i.name], generator) for i in wide}
        return None if any(e is None for e in kicked.values()) else around(kicked)
    if not discrete:
        return None
    inst = discrete[int(torch.randint(len(discrete), (1,), generator=generator))]
    swapped = inst.kind.perturb(inst, incumbent[inst.name], generator)
    if swapped is None:
        return None
    start = {k: v for k, v in incumbent.items() if k not in {i.name for i in wide}}
    start[inst.name] = swapped
    # the rest of its layer (the per-head rotations of the swapped heads) re-solved around the swap
    layer = [i for i in active(local, opts) if i.layer == inst.layer and i is not inst]
    if layer:
        moved = apply(apply(sd_a, wide, incumbent), [inst], start)
        start.update(solve_local(layer, moved, sd_b, opts))
    return start


def parts(instances) -> list[list]:
    """A layer's group instances split into sets that share no tensor (attention, FFN...): each set is
    solved, applied and written on its own, so only its tensors are ever in memory."""
    parent = list(range(len(instances)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, inst in enumerate(instances):
        for s in inst.slots:
            j = owner.setdefault(s.key, i)
            parent[root(i)] = root(j)
    groups: dict[int, list] = defaultdict(list)
    for i, inst in enumerate(instances):
        groups[root(i)].append(inst)
    return list(groups.values())
