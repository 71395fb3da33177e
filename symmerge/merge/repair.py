"""REPAIR (Jordan et al., ICLR 2023) for transformers: undo the variance collapse of a merged model.

Interpolating two networks shrinks the spread of their channels (averaged neurons that are not
perfectly correlated cancel in part). REPAIR resets, channel by channel, the merged model's mean and
standard deviation over data to the interpolation of the endpoints' — ``μ* = Σ w_k μ_k``,
``σ* = Σ w_k σ_k`` with the merge weights ``w`` — by an affine map ``y → (y − μ) σ*/σ + μ*`` folded into
the parameters that produce ``y``, so the architecture is unchanged. Which channels (``channels``):

* ``ffn`` — the FFN pre-activations: the outputs of the FFN input modules (``fc1``; SwiGLU's ``gate`` and
  ``up``), folded into their weight rows and biases (the channels before the non-linearity: the
  closest analogue of the paper's pre-BN channels);
* ``attn_out`` — the attention output per stream channel: the O projection's outputs (its rows + bias);
* ``mlp_out`` — the FFN output per stream channel: the output module's outputs (rows + bias);
* ``norm`` — the outputs of every LayerNorm / RMSNorm of the layers and the final norm (what the
  next block and the head read): an affine map after the norm folds into its weight and bias;
* ``qk`` — the attention logits' scale: per head, the root mean square of the query and of the key
  projection's outputs (the QK group's members) set to the interpolation of the endpoints', a scale only
  (rows and bias of ``q`` and ``k`` multiplied by one factor per head, so RoPE pairs and the softmax's
  shape are kept). Interpolating two heads that agree only in part shrinks q and k, and the logits with
  their product: the softmax flattens. Not corrected where q or k is a slice of a fused projection.

Default ``ffn`` and ``norm``: they help after activation matching and after weight matching; the stream
writers (``attn_out``, ``mlp_out``) help only where the stream channels correspond well, and ``qk`` is not a
default (docs/merge.md has the measurements).

Not corrected, and why: the residual stream itself (a norm's input) — a per-channel affine map of the
stream cannot be folded (the identity path carries every earlier term uncorrected; the writers and the
norms' outputs above are the foldable places on it); queries, keys and values (the softmax and the
per-head products are not per-channel); the embeddings and the task head. A module without a bias
(``bias=False``; RMSNorm) gets the scale only (the mean cannot be moved without a bias); the report
lists them.

Statistics (per channel over the unlabeled data's tokens, padding excluded): the endpoints once each;
the merged model ``remeasure``\\ d: ``none`` — one pass, every channel corrected from it; ``layer`` — the
channels of one layer at a time, measured after the corrections of the layers before; ``site`` — each
module in forward order, after all corrections before it (each pass stops once its modules ran).
"""

from __future__ import annotations

import copy
import time

import torch

from ..errors import SymmergeError
from ..families.roles import FFN, QK, VO, role
from ..groups import get_kind
from ..io.hf import linear_output_axis
from ..pipeline.bound import bind
from .base import normalized_weights

CHANNELS = ("ffn", "attn_out", "mlp_out", "norm", "qk")
DEFAULT_CHANNELS = ("ffn", "norm")  # the channels that helped after every alignment measured (docs/merge.md)
REMEASURE = ("none", "layer", "site")


def _head_sizes(bound) -> dict[str, int]:
    """``{module path: head size}`` of the query and key projections whose whole output is the QK group's
    slot (channel ``qk``; slices of a fused projection are left out)."""
    from ..pipeline.activations import activation_slot

    out: dict[str, int] = {}
    for inst in bound.instances:
        if role(inst.group.name) != QK:
            continue
        for slot in inst.slots:
            found = activation_slot(bound.model, slot)
            if found is None or found[0].side != "out" or slot.start or slot.length is not None or slot.period:
                continue
            out[found[0].module] = inst.size
    return out


def _sites(bound) -> dict[str, str]:
    """``{module path: channel kind}`` of the modules whose outputs REPAIR may correct (``bound``: the
    model's :class:`~symmerge.pipeline.bound.BoundModel`)."""
    from ..pipeline.activations import activation_slot

    model, spec = bound.model, bound.spec
    out: dict[str, str] = {n: "qk" for n in _head_sizes(bound)}
    for inst in bound.instances:
        for slot in inst.slots:
            part = role(inst.group.name)
            if part not in (FFN, VO) or (found := activation_slot(model, slot)) is None:
                continue
            site, _ = found
            if part == FFN:
                out[site.module] = "ffn" if site.side == "out" else "mlp_out"
            elif site.side == "in":
                out[site.module] = "attn_out"
    modules = dict(model.named_modules())
    for g in spec.groups:  # the stream's norms (not the task heads' own): the residual group's norm weights
        for m in g.members:
            if get_kind(g.kind).per_layer or not m.diag or m.root:
                continue
            for name in [m.name.format(i=i) for i in range(bound.num_layers)] if "{i}" in m.name else [m.name]:
                path = bound.prefix + name[: -len(".weight")]
                if path in modules:
                    out[path] = "norm"
    return out


def _norm_offset(spec) -> float:
    """What the family's stream norms add to their weight before multiplying (Gemma: 1; else 0)."""
    return next((g.param("norm_offset") for g in spec.groups
                 if g.param("norm_offset") is not None), 0.0)


def _order(model, data, modules) -> list[str]:
    """``modules`` in the order one forward pass calls them."""
    seen: list[str] = []
    handles = [model.get_submodule(n).register_forward_hook(lambda mod, a, o, n=n: seen.append(n) if n not in seen
                                                            else None) for n in modules]
    try:
        with torch.no_grad():
            batch = next(iter(data)).to(next(model.parameters()).device)
            model.eval()(**batch.inputs)
    finally:
        for h in handles:
            h.remove()
    return seen + [n for n in modules if n not in seen]


class _Stop(Exception):
    pass


def channel_stats(model, data, modules, progress: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (mean, std)}`` of every output channel over the data's tokens (padding excluded), in
    one pass that stops each forward once all ``modules`` ran."""
    from ..pipeline.activations import _first, _tokens, batches_on

    sums: dict = {}
    state = {"mask": None, "left": 0}

    def hook(name):
        def fn(mod, args, output):
            x = _tokens(_first(output).detach(), state["mask"]).double()
            s = sums.setdefault(name, [0, torch.zeros(x.shape[1], dtype=torch.float64),
                                       torch.zeros(x.shape[1], dtype=torch.float64)])
            s[0] += x.shape[0]
            s[1] += x.sum(0).cpu()
            s[2] += x.square().sum(0).cpu()
            state["left"] -= 1
            if state["left"] == 0:
                raise _Stop
        return fn

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in modules]
    try:
        with torch.no_grad():
            for batch in batches_on(model, data, "REPAIR statistics", progress):
                state["mask"], state["left"] = batch.mask, len(modules)
                try:
                    model.eval()(**batch.inputs)
                except _Stop:
                    pass
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, (n, s1, s2) in sums.items():
        mean = s1 / max(n, 1)
        out[name] = (mean, (s2 / max(n, 1) - mean.square()).clamp_min(0).sqrt())
    missing = [n for n in modules if n not in out]
    if missing:
        raise SymmergeError(f"REPAIR: module {missing[0]} did not run on the data")
    return out


def _ratio(target: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``target / current``, 1 where ``current`` is (numerically) zero."""
    return torch.where(current > 1e-12 * current.max().clamp_min(1e-300), target / current, torch.ones_like(current))


def _head_rms(stat: tuple[torch.Tensor, torch.Tensor], size: int) -> torch.Tensor:
    """Per head (``size`` consecutive channels) the root mean square over tokens and channels, from the
    channels' (mean, std)."""
    mean, std = stat
    return (mean.square() + std.square()).view(-1, size).mean(1).sqrt()


def _scale_rows(module, s: torch.Tensor) -> None:
    """Multiply a linear module's outputs by ``s`` (per output channel): its weight rows and bias."""
    axis = linear_output_axis(module)
    with torch.no_grad():
        w = module.weight.double()
        module.weight.copy_((w * (s[:, None] if axis == 0 else s[None, :])).to(module.weight.dtype))
        if getattr(module, "bias", None) is not None:
            module.bias.copy_((module.bias.double() * s).to(module.bias.dtype))


def _fold(module, mean, std, target_mean, target_std, kind: str, offset: float = 0.0) -> bool:
    """Fold ``y → (y − mean)·s + target_mean``, ``s = target_std / std``, into the module's parameters;
    False when only the scale could be folded (no bias). ``offset``: a norm multiplies by ``offset + w``
    (Gemma's ``1 + w``), so its scaled weight is ``(offset + w)·s − offset``."""
    s = _ratio(target_std, std)
    weight = module.weight
    bias = getattr(module, "bias", None)
    with torch.no_grad():
        w = weight.double()
        if kind == "norm" or weight.dim() == 1:
            w = (w + offset) * s - offset if kind == "norm" else w * s
        else:
            axis = linear_output_axis(module)
            w = w * (s[:, None] if axis == 0 else s[None, :])
        weight.copy_(w.to(weight.dtype))
        if bias is None:
            return False
        bias.copy_(((bias.double() - mean) * s + target_mean).to(bias.dtype))
    return True


def parse_channels(text) -> tuple[str, ...]:
    """``ffn,norm,qk`` (or a sequence of names) → the channel tuple, else one clear error."""
    if not isinstance(text, (str, list, tuple)) or not all(isinstance(x, str) for x in text):
        raise SymmergeError(f"REPAIR channels are a comma list such as 'ffn,norm' or a list of names; choose from "
                            f"{', '.join(CHANNELS)}, got {text!r}")
    names = tuple(x.strip() for x in (text.split(",") if isinstance(text, str) else text) if x.strip())
    unknown = [c for c in names if c not in CHANNELS]
    if unknown or not names:
        raise SymmergeError(f"unknown REPAIR channels {unknown[0]!r}; choose from {', '.join(CHANNELS)}" if unknown
                            else f"no REPAIR channels given; choose from {', '.join(CHANNELS)}")
    return names


def statistics_data(data, samples: int | None):
    """The part of the unlabeled ``data`` REPAIR measures on: its first ``samples`` examples (None: all)."""
    from ..io.data import take

    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int)):
        raise SymmergeError(f"REPAIR samples must be a whole number >= 1, got {samples!r}")
    if samples is not None and samples < 1:
        raise SymmergeError(f"REPAIR samples must be >= 1, got {samples}")
    return data if samples is None or data is None else take(data, samples, limit="--repair-samples")


def endpoint_stats(endpoints, data, modules=None, progress: bool = False) -> list[dict]:
    """Per endpoint the channel statistics REPAIR needs (compute once, reuse along a curve)."""
    modules = list(_sites(bind(endpoints[0]))) if modules is None else modules
    return [channel_stats(m, data, modules, progress) for m in endpoints]


def repair(merged, endpoints, weights=None, data=None, channels=DEFAULT_CHANNELS, remeasure: str = "layer",
           stats: list | None = None, progress: bool = False):
    """``(model, report)``: a copy of ``merged`` whose channels (``channels``, see the module text) have
    the interpolation (``weights``: the merge weights, normalised; uniform when None) of the
    ``endpoints``' means and standard deviations on ``data`` (unlabeled), folded into its weights and
    biases. ``endpoints``: the aligned input models, in the merged model's parameterisation;
    ``stats``: their :func:`endpoint_stats` (computed when None)."""
    if data is None:
        raise SymmergeError("REPAIR needs unlabeled data for its statistics (align_data)")
    channels = parse_channels(channels)
    if remeasure not in REMEASURE:
        raise SymmergeError(f"unknown REPAIR remeasure {remeasure!r}; choose one of {', '.join(REMEASURE)}")
    t0 = time.perf_counter()
    w = normalized_weights(weights, len(endpoints))
    model = copy.deepcopy(merged).eval()
    bound = bind(model)
    kinds = {n: k for n, k in _sites(bound).items() if k in channels}
    offset = _norm_offset(bound.spec)
    order = _order(model, data, list(kinds))
    stats = stats or endpoint_stats(endpoints, data, order, progress)
    if remeasure == "none":
        stages = [order]
    elif remeasure == "site":
        stages = [[n] for n in order]
    else:
        layers = bound.layer_paths()
        index = {n: next((i for i, b in enumerate(layers) if n.startswith(b + ".")), len(layers)) for n in order}
        stages = [[n for n in order if index[n] == i] for i in sorted(set(index.values()))]
    ratios: dict = {k: [] for k in channels}
    scale_only = []
    heads = _head_sizes(bound) if "qk" in channels else {}
    for stage in stages:
        current = channel_stats(model, data, stage)
        for name in stage:
            if kinds[name] == "qk":  # one scale per head: the RMS of its channels
                rms, t_rms = _head_rms(current[name], heads[name]), sum(wk * _head_rms(s[name], heads[name])
                                                                         for wk, s in zip(w, stats))
                ratios["qk"].append((rms / t_rms.clamp_min(1e-300)).mean().item())
                _scale_rows(model.get_submodule(name), _ratio(t_rms, rms).repeat_interleave(heads[name]))
                continue
            mean, std = current[name]
            t_mean = sum(wk * s[name][0] for wk, s in zip(w, stats))
            t_std = sum(wk * s[name][1] for wk, s in zip(w, stats))
            ratios[kinds[name]].append((std / t_std.clamp_min(1e-300)).mean().item())
            if not _fold(model.get_submodule(name), mean, std, t_mean, t_std, kinds[name], offset):
                scale_only.append(name)
    report = {"channels": list(channels), "remeasure": remeasure, "modules": len(order), "passes": len(stages),
              "examples": data.n, "weights": w, "scale_only": scale_only,
              "std_ratio_before": {k: sum(v) / len(v) for k, v in ratios.items() if v},
              "seconds": time.perf_counter() - t0}
    return model, report
