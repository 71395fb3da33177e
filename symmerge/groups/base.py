"""What a group kind is: one class per kind, one module per class, one registry.

A kind owns everything that depends on what its group *does*:

* its element type (a small dataclass in the kind's module) and :meth:`Kind.identity`;
* :meth:`Kind.bind` — how a :class:`~symmerge.core.spec.Group` binds to a concrete state dict
  (slots, head blocks, kind-specific facts such as RoPE pairs or which norms fold);
* :meth:`Kind.active` — whether the chosen options (``--symmetries``, ``--rescale``) ask for it;
* :meth:`Kind.prepare` / :meth:`Kind.complete` — its cost and exact solver, batched over instances.
  ``prepare`` does the costly, read-once part (for a permutation: the cost matrix and its
  assignment; it may be handed on-demand mappings that read a tensor each time it is asked for),
  ``complete`` the rest (unit scales) with the tensors in memory;
* :meth:`Kind.transform` — how an element changes one member tensor;
* :meth:`Kind.random` and :meth:`Kind.check` — a random element (tests) and a validity check (a valid
  element preserves the function exactly; the tests prove it for every family);
* :meth:`Kind.canonicalize` — a function-preserving change of parameterisation done before solving
  (the residual stream folds its norms);
* optionally :meth:`Kind.block_costs` — for head kinds, the exact optimum of the group for any pairing
  of a head of the moved model with a head of the anchor (used to pair heads: the ``heads`` kind);
* its *matcher capabilities* — what the activation matcher (:mod:`symmerge.pipeline.activations`) and
  the learned alignment (:mod:`symmerge.pipeline.learn`) may do with it: the activation sites it reads
  (:attr:`Kind.activation_sites`), the statistic its solver sees (:attr:`Kind.activation_statistic`),
  its own solve from activations (:meth:`Kind.fit_activations`), its scales fitted in the weights
  after an activation fit (:meth:`Kind.weight_scales`), whether it moves before those scales
  (:attr:`Kind.moves_before_scales`) and its continuous parameterisation (``learn_*``). The matchers read these,
  never a kind's name; a kind that lacks a capability a matcher needs is refused by name.

The loops over kinds (:mod:`symmerge.core.resolve`, :mod:`symmerge.core.apply`,
:mod:`symmerge.pipeline.engine`) know no kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

RESCALE_MODES = ("joint", "sequential", "none")


@dataclass(frozen=True)
class Options:
    """What the solvers need to know: the user-facing symmetries turned on, the rescale mode (``none``
    unless ``rescale`` is among the symmetries), where cost GEMMs run, and how many layers' costly
    problems (FFN cost + assignment) are solved at once (``workers``: None = one per core, 1 = one
    layer after another; the results are the same)."""

    symmetries: frozenset = field(default_factory=frozenset)
    rescale: str = "none"
    device: object = None
    workers: int | None = None

    @property
    def rotate(self) -> bool:
        return "attn" in self.symmetries


class Kind:
    name = ""
    per_layer = True  # False: one model-wide instance (the residual stream); such a kind never streams
    # its elements move the input of the task heads (they are matched too, so the heads must agree)
    moves_heads_input = False
    # its elements move the coordinates of the model's output (a base model's, or an embedding pipeline's)
    moves_output_frame = False
    blocked = False  # the group is split into per-head blocks (blocks = the group's head count)
    description = ""  # what an element does, in words (``symmerge specs``)
    # a costly discrete choice the descent over coupled groups (:func:`symmerge.pipeline.engine.solve`)
    # re-solves only on its first sweep and once the other groups have converged with it held fixed
    lazy = False

    def scale_text(self, group) -> str | None:
        """With ``rescale``: the scale the group's elements carry, in words (``symmerge specs``), or None."""
        return None

    # ------------------------------------------------------------------ binding
    def bind(self, group, ctx, layer):
        """The instance of ``group`` in ``layer`` (or model-wide when not ``per_layer``), or None when
        the group does not apply to this checkpoint, or a list of instances (a group of stacked members:
        one per expert). ``ctx`` is a :class:`symmerge.core.resolve.Binding`."""
        if any(m.stacked for m in group.members):
            return ctx.stacked_instances(group, layer)
        return ctx.instance(group, layer, blocked=self.blocked)

    def active(self, inst, opts: Options) -> bool:
        return inst.group.symmetry in opts.symmetries

    # ------------------------------------------------------------------ solving
    def prepare(self, insts, sd_a, sd_b, opts: Options, ctx=None):
        """Costly part of the solve (default: nothing)."""
        return None

    def complete(self, insts, prepared, sd_a, sd_b, opts: Options, ctx=None) -> dict:
        """``{instance name: element}`` moving ``sd_a`` closest (L2) to ``sd_b``."""
        raise NotImplementedError

    def solve(self, insts, sd_a, sd_b, opts: Options, ctx=None) -> dict:
        return self.complete(insts, self.prepare(insts, sd_a, sd_b, opts, ctx), sd_a, sd_b, opts, ctx)

    streams_costs = False  # prepare() reads each member once and may be given on-demand mappings

    # ------------------------------------------------------------------ elements
    def identity(self, inst):
        raise NotImplementedError

    def random(self, inst, generator: torch.Generator, scale: bool = True):
        raise NotImplementedError

    def check(self, inst, element, tol: float = 1e-6) -> None:
        """Raise :class:`~symmerge.errors.SymmergeError` unless ``element`` is a valid element."""

    def transform(self, t: torch.Tensor, slot, inst, element) -> torch.Tensor:
        raise NotImplementedError

    def canonicalize(self, state_dict: dict, inst) -> dict:
        return state_dict

    def canonical_changes(self, inst, keys) -> dict:
        """{tensor key: why} of the tensors among ``keys`` that :meth:`canonicalize` changes besides the group's
        own slots (an alignment plan's steps name them): none by default."""
        return {}

    # ------------------------------------------------------------------ matchers' capabilities
    # ``activation_sites``: which activations stand for the group's tensors under ``--match activations``
    #   "slots" — each weight slot's activation (a Linear's output for a slot on its output axis, its
    #   input for one on its input axis); "units" — only the hidden units (the input of the module that
    #   consumes them); "stream" — the hidden states at every block boundary (a model-wide group);
    #   "inputs" — the input of one module per instance (:meth:`Kind.activation_input`: the tokens' hidden
    #   states where the group's tensors read them), from which the kind computes statistics of its own
    #   (:meth:`Kind.observe`, batch by batch) and solves on them (:meth:`Kind.fit_observed`);
    #   "weights" — none, and the activation matcher solves the kind on the weights instead (exactly, given
    #   the groups before it); "" — none: the activation matcher refuses the kind by name.
    activation_sites = "slots"
    # ``activation_statistic``: what the kind's solver sees of the activations: "gram" (joint second
    # moments, factored into pseudo-tensors) or "correlation" (the Gram standardised first)
    activation_statistic = "gram"
    # ``moves_before_scales``: after an activation fit, its element is applied before the other kinds'
    # scales are fitted in the weights (head pairing: the scales are those of the paired heads)
    moves_before_scales = False

    def fit_activations(self, insts, act_a: dict, act_b: dict, opts: Options) -> dict | None:
        """``{instance name: element}`` from the activation pseudo-tensors ``act_a``/``act_b`` (the instances'
        slots address them) by a solver of the kind's own; None (default): the matcher runs the kind's
        weight solver on them unchanged."""
        return None

    def activation_input(self, inst) -> str:
        """``activation_sites == "inputs"``: the module whose input (tokens × features) :meth:`observe` reads."""
        raise NotImplementedError

    def observe(self, inst, stats, x_a: torch.Tensor, x_b: torch.Tensor, model_a, model_b):
        """``activation_sites == "inputs"``: one batch added to the instance's statistics ``stats`` (None at
        the first batch; returned): ``x_a``/``x_b`` the two models' inputs of :meth:`activation_input` on
        the same tokens (tokens × features, padding dropped), the models to read their own tensors from."""
        raise NotImplementedError

    def fit_observed(self, insts, stats: dict, opts: Options) -> dict:
        """``activation_sites == "inputs"``: ``{instance name: element}`` from ``stats`` ``{instance name: the
        statistics of :meth:`observe`}``. It may hold the elements of instances of other groups solved
        jointly with these (the FFN inside each expert): the matcher takes them as they are, in their
        group's turn, and fits their scales in the weights afterwards."""
        raise NotImplementedError

    def weight_scales(self, insts, elements: dict, sd_a: dict, sd_b: dict, opts: Options,
                      scales_fitted: bool) -> None:
        """After an activation fit of ``insts``: replace their ``elements`` by the same rotations or
        permutations with the scales closest in the weights (``sd_a`` already moved by the kinds that
        ``moves_before_scales``). ``scales_fitted``: the activation fit already solved the scales the
        activations determine. Default: nothing to do."""

    # ------------------------------------------------------------------ the multi-start search
    # (:func:`symmerge.pipeline.engine.search`): moves that leave the basin the coordinate descent settled in
    def perturb(self, inst, element, generator: torch.Generator):
        """A random neighbour of ``element`` (a valid element of the same group) the search restarts the
        descent from: a small random rotation of a dense element, swapped blocks of a permutation; None (the
        default): the kind has no such move."""
        return None

    def spectral_start(self, inst, sd_a: dict, sd_b: dict, keys=None):
        """A model-wide kind's start from both models put in a canonical frame (their weights' principal axes,
        or the coordinates ordered by their norms), over the tensors ``keys`` (None: every member); None (the
        default): no such start."""
        return None

    def discrete(self, inst) -> bool:
        """Whether the instance's elements form a finite set (permutations, signed permutations): the joint
        alignment's rounds re-solve only these with ``refine="discrete"``, keeping the continuous elements
        the star found (:mod:`symmerge.pipeline.joint`)."""
        return False

    # ------------------------------------------------------------------ learned alignment
    # A kind with continuous freedom beyond its closed-form solution exposes it here (see
    # symmerge.pipeline.learn): named parameter tensors (zeros = the identity), a differentiable
    # ``learn_prepare`` computing the element's matrices once per step, ``learn_apply`` on one slot of a
    # tensor, and ``learn_element`` turning the values into a group element of the kind.
    def learn_init(self, inst, opts: Options, dtype, model_facts: dict) -> dict | None:
        """``model_facts``: e.g. ``norm_eps`` (the model's norm epsilon)."""
        return None

    def learn_prepare(self, inst, values: dict):
        return values

    def learn_apply(self, t: torch.Tensor, slot, inst, prepared) -> torch.Tensor:
        return t

    def learn_element(self, inst, values: dict):
        raise NotImplementedError

    def sides(self, inst) -> list[tuple]:
        """The slots grouped by the role they play (e.g. Q side / K side): applying an element to
        some sides only must break the function (the tests' generic negative control)."""
        keys = sorted({(s.power, s.diag) for s in inst.slots})
        return [tuple(s for s in inst.slots if (s.power, s.diag) == k) for k in keys]


def segment_update(t: torch.Tensor, slot, fn) -> torch.Tensor:
    """``t`` with ``fn`` applied to the slot's segment (axis first), differentiably (learned alignment)."""
    if slot.index is not None:  # one sub-tensor of a stacked tensor (an expert of fused experts)
        from dataclasses import replace

        subs = list(t.unbind(0))
        subs[slot.index] = segment_update(subs[slot.index], replace(slot, index=None, axis=slot.axis - 1), fn)
        return torch.stack(subs)
    x = t.movedim(slot.axis, 0)
    if slot.length is None:
        new = fn(x)
    elif slot.period is not None:  # strided: the slice in every period of the axis
        y = x.unflatten(0, (-1, slot.period))
        mid = fn(y[:, slot.start: slot.start + slot.length].flatten(0, 1)).unflatten(0, (-1, slot.length))
        new = torch.cat([y[:, :slot.start], mid, y[:, slot.start + slot.length:]], dim=1).flatten(0, 1)
    else:
        new = torch.cat([x[:slot.start], fn(x[slot.start: slot.start + slot.length]), x[slot.start + slot.length:]])
    return new.movedim(0, slot.axis)


def scales(n, generator, scale: bool, *shape) -> torch.Tensor:
    """Log-normal random scales (ones when ``scale`` is False)."""
    if not scale:
        return torch.ones(n, *shape, dtype=torch.float64)
    return torch.exp(0.3 * torch.randn(n, *shape, dtype=torch.float64, generator=generator))


def haar(n: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` Haar-random orthogonal d × d matrices."""
    g = torch.randn(n, d, d, dtype=torch.float64, generator=generator)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]


def orthogonality_error(R: torch.Tensor) -> float:
    R = R.double()
    if not R.numel():
        return 0.0
    eye = torch.eye(R.shape[-1], dtype=torch.float64)
    return (R.mT @ R - eye).abs().max().item()


def swap_blocks(n: int, block: int, generator: torch.Generator) -> torch.Tensor:
    """An index (n,) exchanging two random disjoint blocks of ``block`` consecutive positions (new position j
    holds old position ``index[j]``); ``block`` is capped at ``n // 2`` (at least 1)."""
    block = max(1, min(block, n // 2))
    index = torch.arange(n)
    if n < 2:
        return index
    slots = n // block
    i, j = torch.randperm(slots, generator=generator)[:2].tolist()
    a, b = torch.arange(i * block, (i + 1) * block), torch.arange(j * block, (j + 1) * block)
    index[a], index[b] = b, a
    return index


def small_rotation(d: int, strength: float, generator: torch.Generator) -> torch.Tensor:
    """A random rotation (d × d) ``exp(A − Aᵀ)``, ``A`` Gaussian with standard deviation ``strength / √d``."""
    A = torch.randn(d, d, dtype=torch.float64, generator=generator) * (strength / max(d, 1) ** 0.5)
    return torch.linalg.matrix_exp(A - A.T)


def is_permutation(p: torch.Tensor, n: int) -> bool:
    return p.dim() == 1 and len(p) == n and torch.equal(torch.sort(p).values, torch.arange(n))
