"""Statistics for data-dependent merges, gathered with hooks on the (already aligned) models.

* :func:`gram_stats`: for every ``nn.Linear`` and ``Conv1D`` (found by module type, any architecture),
  the Gram matrix XᵀX of its inputs (RegMean; a ``Conv1D``'s as :class:`InOutGram`). Padding
  tokens are excluded using the batch's attention mask; products are formed per batch in float32
  (float64 for float64 models) and accumulated in float64. Linear layers fed the same tensor (Q, K and V) share
  one product.
* :func:`fisher_stats`: the diagonal Fisher E_x[(∂ log p(y|x)/∂θ)²] per parameter, from
  per-example gradients, with y the data's label (``empirical``) or drawn from the model's own
  predictive distribution (``sampled``); optional normalisation to mean 1.
* :func:`activation_stats`: per token (padding excluded), the outputs of every linear layer of the
  base model and the residual stream's hidden states (OT fusion's activation costs), the first
  ``max_rows`` tokens in data order.

All must run on the aligned models: a Gram matrix of rotated/permuted inputs is the rotated/permuted
Gram matrix, so statistics taken before alignment are expressed in the wrong basis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..io.data import Batch, Data, predictions
from ..io.arguments import keeps_models
from ..io.hf import is_conv1d, linear_output_axis
from ..errors import SymmergeError
from ..progress import bar

FISHER_VARIANTS = ("empirical", "sampled")


@dataclass
class Stats:
    kind: str  # "gram" | "fisher" | "activations"
    tensors: dict  # state-dict key -> Gram (in × in) of that weight's inputs, Fisher (param shape), or
    # activations (tokens × out features) of that weight's layer ("hidden_states.k": the stream, tokens × hidden)
    counts: dict = field(default_factory=dict)  # key -> rows (tokens/samples) accumulated
    examples: int = 0
    seconds: float = 0.0

    def means(self) -> dict:
        """Tensors divided by their counts (Grams per token / per sample)."""
        return {k: t / max(self.counts.get(k, 1), 1) for k, t in self.tensors.items()}


def _model_device(model):
    return next(model.parameters()).device


class InOutGram(torch.Tensor):
    """The Gram matrix of a layer whose weight is stored in × out (transformers' ``Conv1D``, GPT-2):
    a marker subclass (arithmetic and ``.to`` keep it) that tells RegMean not to transpose the weight."""


def linear_modules(model) -> dict:
    """Every linear layer, found by module type: ``nn.Linear`` and transformers' ``Conv1D``."""
    return {name: m for name, m in model.named_modules() if linear_output_axis(m) is not None}


def in_features(module) -> int:
    return module.weight.shape[0] if is_conv1d(module) else module.in_features


@keeps_models
def gram_stats(model, data: Data, device=None, modules=None, max_batches: int | None = None,
               progress: bool = True) -> Stats:
    """Gram matrices XᵀX of the inputs of every ``nn.Linear`` (or of the named ``modules``)."""
    device = device or _model_device(model)
    model = model.to(device).eval()
    mods = linear_modules(model)
    if modules is not None:
        mods = {n: m for n, m in mods.items() if n in set(modules)}
    grams = {n: torch.zeros(in_features(m), in_features(m), dtype=torch.float64, device=device)
             for n, m in mods.items()}
    counts = dict.fromkeys(mods, 0)
    state = {"mask": None, "cache": {}}

    def hook_for(name):
        def hook(module, args):
            x = args[0]
            cached = state["cache"].get(id(x))
            if cached is not None and cached[0] is x:
                gram, rows = cached[1], cached[2]
            else:
                mask = state["mask"]
                if mask is not None and x.dim() == mask.dim() + 1 and x.shape[:-1] == mask.shape:
                    flat = x[mask]
                else:
                    flat = x.reshape(-1, x.shape[-1])
                flat = flat.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32)
                gram, rows = flat.T @ flat, flat.shape[0]
                state["cache"][id(x)] = (x, gram, rows)
            grams[name].add_(gram)
            counts[name] += rows

        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in mods.items()]
    start, examples = time.perf_counter(), 0
    try:
        with torch.no_grad():
            for i, batch in enumerate(bar(data, desc="gram statistics", total=len(data), unit="batches",
                                          disable=None if progress else True)):
                if max_batches is not None and i >= max_batches:
                    break
                batch = batch.to(device)
                state["mask"], state["cache"] = batch.mask, {}
                model(**batch.inputs)
                examples += batch.size
    finally:
        for h in handles:
            h.remove()
        state["cache"] = {}
    return Stats("gram", {f"{n}.weight": g.cpu().as_subclass(InOutGram) if is_conv1d(mods[n]) else g.cpu()
                          for n, g in grams.items()},
                 {f"{n}.weight": c for n, c in counts.items()}, examples, time.perf_counter() - start)


def _single_examples(batch: Batch):
    """Split a batch into one-example batches, dropping right padding."""
    for i in range(len(batch.labels)):
        inputs = {k: v[i:i + 1] for k, v in batch.inputs.items()}
        labels, mask = batch.labels[i:i + 1], None if batch.mask is None else batch.mask[i:i + 1]
        if mask is not None:
            length = int(mask.sum())
            if bool(mask[0, :length].all()):  # right padding: cut it
                inputs = {k: v[:, :length] if v.dim() == 2 else v for k, v in inputs.items()}
                labels = labels[:, :length] if labels.dim() == 2 else labels
                mask = mask[:, :length]
        yield Batch(inputs, labels, mask)


def _label_draws(logp, targets, variant: str, samples: int, g: torch.Generator):
    """[(targets, weight)]: the true labels (weight 1), or ``samples`` draws from the model's
    distribution; for one scored item (classification) equal draws are grouped, one gradient each."""
    if variant == "empirical":
        return [(targets, 1.0)]
    probs = logp.detach().exp().cpu()
    draws = [torch.multinomial(probs, 1, generator=g).squeeze(1) for _ in range(samples)]
    if probs.shape[0] != 1:
        return [(d, 1.0 / samples) for d in draws]
    labels, counts = torch.cat(draws).unique(return_counts=True)
    return [(label.view(1), c.item() / samples) for label, c in zip(labels, counts)]


def _param_keys(model) -> dict[str, list[str]]:
    """Parameter name -> every state-dict key holding that tensor (declared ties share a Fisher)."""
    from ..core.resolve import declared_ties

    keys = {n: [n] for n, _ in model.named_parameters()}
    for alias, source in declared_ties(model).items():
        if source in keys and alias not in keys[source]:
            keys[source].append(alias)
    return keys


@keeps_models
def fisher_stats(model, data: Data, variant: str = "empirical", normalize: bool = False, samples: int = 1,
                 seed: int = 0, device=None, max_examples: int | None = None, progress: bool = True) -> Stats:
    """Diagonal Fisher from per-example gradients of log p(y|x) (summed over tokens for lm data)."""
    if variant not in FISHER_VARIANTS:
        raise SymmergeError(f"unknown Fisher variant {variant!r}; choose {' or '.join(FISHER_VARIANTS)}")
    if samples < 1:
        raise SymmergeError(f"Fisher samples must be >= 1, got {samples}")
    device = device or _model_device(model)
    model = model.to(device).eval()
    params = {n: p for n, p in model.named_parameters() if p.is_floating_point()}
    was = {n: p.requires_grad for n, p in params.items()}
    fisher = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    g = torch.Generator().manual_seed(seed)
    start, count = time.perf_counter(), 0
    total = data.n if max_examples is None else min(data.n, max_examples)
    pbar = bar(total=total, desc=f"fisher statistics ({variant})", unit="examples", disable=None if progress else True)
    try:
        for p in params.values():
            p.requires_grad_(True)
        for batch in data:
            for ex in _single_examples(batch):
                if count >= total:
                    break
                ex = ex.to(device)
                logits, targets = predictions(model, ex)
                logp = torch.log_softmax(logits.float(), dim=-1)
                for tgt, weight in _label_draws(logp, targets, variant, samples, g):
                    ll = logp.gather(1, tgt.to(device)[:, None]).sum()
                    grads = torch.autograd.grad(ll, list(params.values()), retain_graph=True, allow_unused=True)
                    for (n, _), gr in zip(params.items(), grads):
                        if gr is not None:
                            fisher[n].add_(gr.double().square(), alpha=weight)
                count += 1
                pbar.update(1)
    finally:
        pbar.close()
        for n, p in params.items():
            p.requires_grad_(was[n])
    if count == 0:
        raise SymmergeError(f"{data.path}: no examples for the Fisher")
    for f in fisher.values():
        f.div_(count)
    if normalize:
        mean = sum(f.sum() for f in fisher.values()) / sum(f.numel() for f in fisher.values())
        if mean > 0:
            for f in fisher.values():
                f.div_(mean)
    tensors, counts = {}, {}
    for name, keys in _param_keys(model).items():
        if name in fisher:
            for k in keys:
                tensors[k], counts[k] = fisher[name].cpu(), count
    return Stats("fisher", tensors, counts, count, time.perf_counter() - start)


@keeps_models
def forward_seconds(model, data: Data, device=None, max_batches: int | None = None) -> float:
    """Wall time of plain no-grad forward passes over ``data`` (the benchmark's reference)."""
    device = device or _model_device(model)
    model = model.to(device).eval()
    start = time.perf_counter()
    with torch.no_grad():
        for i, batch in enumerate(data):
            if max_batches is not None and i >= max_batches:
                break
            model(**batch.to(device).inputs)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _producers(model) -> dict:
    """Linear layers (``nn.Linear``, transformers' ``Conv1D``) of the base model (of the whole model
    when it has no base-model prefix): their outputs are the units OT fusion transports."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    mods = linear_modules(model)
    inside = {n: m for n, m in mods.items() if n.startswith(prefix)}
    return inside or mods


def _token_rows(x: torch.Tensor, mask) -> torch.Tensor:
    """(batch, tokens, features) → (real tokens, features), padding dropped."""
    if mask is not None and x.shape[:2] == mask.shape:
        return x[mask.bool()]
    return x.reshape(-1, x.shape[-1])


@keeps_models
def activation_stats(model, data: Data, device=None, max_rows: int | None = 4096, progress: bool = True) -> Stats:
    """Per token, the outputs of every linear layer of the base model (key ``<module>.weight``) and
    the hidden states the model returns with ``output_hidden_states`` (key ``hidden_states.k``; k = 0:
    the embeddings' output), for the first ``max_rows`` real tokens of ``data`` in order (None: all).
    Layers whose outputs are not per token (e.g. relative-position projections) are left out. Float32
    (float64 for float64 models), on the CPU."""
    if max_rows is not None and max_rows < 1:
        raise SymmergeError(f"activation rows must be >= 1, got {max_rows}")
    device = device or _model_device(model)
    model = model.to(device).eval()
    mods = _producers(model)
    parts: dict = {}
    seen: dict = {}  # module -> (tokens, rows) of the current batch
    state = {"mask": None}

    def hook_for(name):
        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(y) and y.dim() == 3:
                seen[name] = (y.shape[1], _token_rows(y.detach(), state["mask"]))

        return hook

    handles = [m.register_forward_hook(hook_for(n)) for n, m in mods.items()]
    start, examples, rows = time.perf_counter(), 0, 0
    try:
        with torch.no_grad():
            for batch in bar(data, desc="activations", total=len(data), unit="batch",
                             disable=None if progress else True):
                if max_rows is not None and rows >= max_rows:
                    break
                batch = batch.to(device)
                seen.clear()
                state["mask"] = batch.mask
                out = model(**batch.inputs, output_hidden_states=True)
                states = getattr(out, "hidden_states", None)
                if not states:
                    raise SymmergeError(f"{type(model).__name__} returns no hidden states: activations need them")
                tokens = states[0].shape[1]
                got = {f"hidden_states.{k}": _token_rows(h, batch.mask) for k, h in enumerate(states)}
                got.update({f"{n}.weight": r for n, (t, r) in seen.items() if t == tokens})
                take = next(iter(got.values())).shape[0]
                if max_rows is not None:
                    take = min(take, max_rows - rows)
                for k, r in got.items():
                    dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
                    parts.setdefault(k, []).append(r[:take].to("cpu", dtype))
                rows += take
                examples += batch.size
    finally:
        for h in handles:
            h.remove()
        seen.clear()
    if rows == 0:
        raise SymmergeError(f"{data.path}: no tokens for the activations")
    tensors = {k: torch.cat(v) for k, v in parts.items()}
    return Stats("activations", tensors, dict.fromkeys(tensors, rows), examples, time.perf_counter() - start)


def gather(needs: str, model, data: Data, device=None, progress: bool = True, variant: str = "empirical",
           normalize: bool = False, samples: int = 1) -> Stats:
    """The statistics a merge method ``needs`` (one of :data:`symmerge.merge.STATISTICS`), on ``model``
    (already aligned); an unknown kind is an error."""
    if needs == "activations":
        return activation_stats(model, data, device=device, progress=progress)
    if needs == "gram":
        return gram_stats(model, data, device=device, progress=progress)
    if needs == "fisher":
        return fisher_stats(model, data, variant=variant, normalize=normalize, samples=samples, device=device,
                            progress=progress)
    from .base import STATISTICS

    raise SymmergeError(f"unknown statistics {needs!r}; known: {', '.join(STATISTICS)}")
