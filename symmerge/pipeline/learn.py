"""Learned alignment: the continuous group elements optimised on a little unlabeled data.

Start from a closed-form alignment (``LearnSettings.start``: activation matching on the same unlabeled
data — one pass, seconds — or data-free weight matching, every group iterated to convergence). Then,
keeping the permutations fixed, optimise the continuous elements of the full
symmetry group — each exactly function-preserving whatever its value:

* the residual stream: an orthogonal map through the exponential of a skew matrix — acting only on the
  complement of the all-ones direction for a folded pre-LN LayerNorm stream (O(d−1)), on the whole
  stream for RMSNorm (O(d)) — and one global scale ``c = e^γ`` of every writer (exact up to the norms'
  ε, since ``LN(c·x) = LN(x)``); post-LN streams keep their permutation;
* per attention head a general invertible map ``M = exp(A)`` on QK (``W_Q → Mᵀ W_Q``, ``W_K → M⁻¹ W_K``)
  and on VO (``W_V → Mᵀ W_V``, ``W_O → W_O M⁻ᵀ``): the full group of a head's bilinear forms, larger
  than the rotations and scales of the paper; for RoPE groups the complex scalar of each frequency pair
  (rotation and scale, the maps that commute with RoPE) and a general map on non-rotated dims; shared
  by the query heads of a KV head (GQA); Qwen3's norm-locked pairs stay as solved;
* SwiGLU unit scales ``s = e^σ`` (the sign stays as solved).

so that the interpolated model θ(α) = α·θ_A + (1 − α)·θ_B, with α drawn from U(low, high) at every
step, minimises the soft cross-entropy against α·p_A + (1 − α)·p_B (the endpoints' predictions: class
probabilities, or next-token distributions for language models; ``target="log-probabilities"``: their
normalised geometric mean softmax(α·log p_A + (1 − α)·log p_B)) on the unlabeled set — no labels.
Image batches can be augmented (``augment`` views per image: random flips and shifts; the endpoints'
predictions on each view are its target).
Adam with cosine decay, one forward and backward of the interpolated model per step, early stopping on
a held-out part of the set, a seed and an optional time budget. The result is returned as group
elements composed after the closed-form ones, so the usual validity check and verification apply;
the held-out objective is never worse than at the start (the start is kept otherwise).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..core.apply import apply, stages
from ..device import resolve_device
from ..errors import SymmergeError
from ..groups.base import Options
from ..io.data import Batch, Data
from .engine import Restarts, search
from .verify import with_state_dict


def scored_logits(logits: torch.Tensor, batch) -> torch.Tensor:
    """Logits (M, C) of the batch's scored items: every example, or every next token of a sequence
    (padding excluded)."""
    if logits.dim() == 2:
        return logits
    keep = batch.mask[:, 1:] if batch.mask is not None else torch.ones(logits.shape[:2], dtype=torch.bool)[:, 1:]
    return logits[:, :-1][keep]


def scored_positions(batch) -> torch.Tensor | None:
    """The (B, T) positions whose outputs are scored — position t predicts token t + 1, so t is scored when
    token t + 1 is —, in the order of :func:`scored_logits`; None for batches without a sequence mask."""
    if batch.mask is None or batch.mask.dim() != 2:
        return None
    return torch.cat([batch.mask[:, 1:].bool(), torch.zeros_like(batch.mask[:, :1], dtype=torch.bool)], 1)


def head_forward(model, sd: dict, batch) -> torch.Tensor:
    """The logits (M, C) of ``batch``'s scored items under the parameters ``sd`` (``functional_call``).

    For sequence batches the output layer (``get_output_embeddings()``) is fed the hidden states of the
    scored positions only, through a pre-hook: the same logits as :func:`scored_logits` of the full
    output, without the vocabulary-wide projection (and its gradient) at the positions that are not
    scored. Models whose output layer sees other shapes are run in full."""
    def call():
        # tied weights (an LM head sharing the embeddings) arrive under both names, with the same values
        out = torch.func.functional_call(model, sd, args=(), kwargs=batch.inputs, tie_weights=False)
        if getattr(out, "logits", None) is None:  # a base model (T5EncoderModel, CLIPTextModel): hidden states
            raise SymmergeError(f"learned alignment matches the models' predictions (their logits); "
                                f"{type(model).__name__} outputs none ({type(out).__name__}): use --match weights "
                                "or --match activations, or align a model with its task head")
        return out.logits

    keep = scored_positions(batch)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if keep is None or not isinstance(head, torch.nn.Module):
        return scored_logits(call(), batch)
    hit = []

    def gather(module, args):
        x = args[0]
        if x.dim() == 3 and tuple(x.shape[:2]) == tuple(keep.shape):
            hit.append(True)
            return (x[keep],) + tuple(args[1:])
        return None

    handle = head.register_forward_pre_hook(gather)
    try:
        logits = call()
    finally:
        handle.remove()
    if hit and logits.dim() == 2 and len(logits) == int(keep.sum()):
        return logits
    return scored_logits(call(), batch)


class LayerwiseForward:
    """The interpolated model's logits computed layer by layer (``LearnSettings.layerwise``): the tensors of
    a layer — the learned elements applied to A's, interpolated with B's — are built inside that layer's
    forward, under :func:`torch.utils.checkpoint.checkpoint` when gradients are recorded, so that neither
    θ(α) nor its graph exists for the whole model at once: the backward recomputes one layer at a time.
    Outside the layers (embeddings, final norm, head) the tensors are built once per call. The same values
    as the whole-model forward (the same operations per tensor); memory: a few layers' tensors and
    activations, plus the stream at every layer boundary."""

    def __init__(self, skeleton, layer_paths, keys):
        self.skeleton = skeleton
        self.layers = {p: skeleton.get_submodule(p) for p in layer_paths}
        self.keys = {p: [k for k in keys if k.startswith(p + ".")] for p in layer_paths}
        inside = {k for ks in self.keys.values() for k in ks}
        self.outer = [k for k in keys if k not in inside]
        if getattr(skeleton.config, "use_cache", None):  # a KV cache filled by the forward would be filled
            skeleton.config.use_cache = False            # again by the backward's recomputation (the skeleton's copy)

    def __call__(self, build, batch) -> torch.Tensor:
        """``build(keys)``: the tensors of θ(α) under these names (differentiable)."""
        from torch.utils.checkpoint import checkpoint

        busy = set()
        saved = {}

        def wrapped(path, layer, original):
            names = self.keys[path]
            cut = len(path) + 1

            def run(*args, **kwargs):
                busy.add(path)
                try:
                    local = {k[cut:]: v for k, v in build(names).items()}
                    return torch.func.functional_call(layer, local, args, kwargs, tie_weights=False)
                finally:
                    busy.discard(path)

            def forward(*args, **kwargs):
                if path in busy:  # inside run's functional_call: the layer itself
                    return original(*args, **kwargs)
                if torch.is_grad_enabled():
                    return checkpoint(run, *args, use_reentrant=False, **kwargs)
                return run(*args, **kwargs)
            return forward

        for path, layer in self.layers.items():
            saved[path] = layer.__dict__.get("forward")
            layer.forward = wrapped(path, layer, layer.forward)
        try:
            return head_forward(self.skeleton, build(self.outer), batch)
        finally:
            for path, layer in self.layers.items():
                if saved[path] is None:
                    del layer.forward
                else:
                    layer.forward = saved[path]


class Parameters(torch.nn.Module):
    """The learned deltas: for every active instance whose kind has continuous freedom, the kind's
    named tensors (zeros: the identity), as parameters."""

    def __init__(self, instances, opts: Options, dtype, model_facts: dict):
        super().__init__()
        self.p = torch.nn.ParameterDict()
        self.instances = []
        for inst in instances:
            values = inst.kind.learn_init(inst, opts, dtype, model_facts) if inst.kind.active(inst, opts) else None
            if values:
                for name, v in values.items():
                    self.p[self._key(inst, name)] = torch.nn.Parameter(v)
                self.instances.append((inst, tuple(values)))

    @staticmethod
    def _key(inst, name: str) -> str:
        return f"{inst.name.replace('.', '_')}__{name}"

    def values(self, inst, names) -> dict:
        return {n: self.p[self._key(inst, n)] for n in names}

    def prepare(self) -> dict:
        """Every instance's prepared element (its matrix exponentials, scales), differentiable: small."""
        return {inst.name: inst.kind.learn_prepare(inst, self.values(inst, names)) for inst, names in self.instances}

    def transform(self, sd: dict, keys=None, prepared: dict | None = None) -> dict:
        """The tensors the learned elements change, as differentiable functions of the parameters (``keys``:
        only those among these names; ``prepared``: :meth:`prepare`'s, computed here when None)."""
        out: dict = {}
        for inst, names in self.instances:
            kind = inst.kind
            slots = inst.slots if keys is None else [s for s in inst.slots
                                                     if s.key in keys or any(a in keys for a in s.aliases)]
            if not slots:
                continue
            ready = kind.learn_prepare(inst, self.values(inst, names)) if prepared is None else prepared[inst.name]
            for s in slots:
                out[s.key] = kind.learn_apply(out.get(s.key, sd[s.key]), s, inst, ready)
                for alias in s.aliases:
                    out[alias] = out[s.key]
        return out

    def elements(self) -> dict:
        """The learned deltas as group elements (float64)."""
        with torch.no_grad():
            return {inst.name: inst.kind.learn_element(inst, {n: v.detach().cpu()  # off the device: float64 there
                                                              for n, v in self.values(inst, names).items()})
                    for inst, names in self.instances}


def norm_eps(config) -> float:
    """The ε of the model's norms (its config names it one of several ways); 1.0 when unknown."""
    for name in ("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps", "norm_eps"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 1.0


SHIFT = {"flip-shift": 2, "strong": 4, "mixup": 2}  # the largest shift of a view, in pixels, by augmentation style


def _refuse_unread_augment(batches: list, settings) -> None:
    """One error when ``--learn-augment``/``--learn-augment-style`` were given (away from their defaults; views
    asked for, not 0) and the alignment data is not images: :func:`augmented` makes views of images only (text was
    accepted and left as it was)."""
    default = type(settings)()  # LearnSettings' defaults
    given = [flag for flag, name in (("--learn-augment", "augment"), ("--learn-augment-style", "augment_style"))
             if getattr(settings, name) != getattr(default, name) and settings.augment]  # 0: no views (text's)
    images = all(getattr(b.inputs.get("pixel_values"), "dim", lambda: 0)() == 4 for b in batches)
    if given and not images:
        it = "it" if len(given) == 1 else "them"
        raise SymmergeError(f"{', '.join(given)}: the augmented views of unlabeled images, and the alignment data "
                            f"here is not images (text or token ids): nothing would read {it} (leave {it} out)")


def augmented(batches: list, views: int, generator: torch.Generator, style: str = "flip-shift") -> list:
    """``views`` randomly transformed copies of every image batch (per image: a horizontal flip with probability ½
    and a shift of up to 2 pixels each way, wrapping around): more inputs for the same unlabeled images, the
    endpoints' predictions on them the targets. ``style`` (``LearnSettings.augment_style``): ``strong`` shifts by
    up to 4 pixels and, with probability ½, fills a square of a seventh to a third of the image's side with the
    image's minimum (its background); ``mixup`` mixes every flipped and shifted view with another image of the
    batch, λ·x + (1 − λ)·x', λ ~ U(½, 1). Batches without ``pixel_values`` (text) get none."""
    out = []
    for _ in range(views):
        for b in batches:
            x = b.inputs.get("pixel_values")
            if x is None or x.dim() != 4:
                continue
            flip = torch.rand(len(x), generator=generator, dtype=torch.float32) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            reach = SHIFT[style]
            shifts = torch.randint(-reach, reach + 1, (len(x), 2), generator=generator)
            x = torch.stack([torch.roll(xi, (int(dy), int(dx)), dims=(-2, -1)) for xi, (dy, dx) in zip(x, shifts)])
            if style == "strong":
                x = _cut_out(x, generator)
            elif style == "mixup":
                lam = 0.5 + 0.5 * torch.rand(len(x), generator=generator, dtype=torch.float32)[:, None, None, None]
                x = lam * x + (1 - lam) * x[torch.randperm(len(x), generator=generator)]
            out.append(Batch({**b.inputs, "pixel_values": x}, None, b.mask))
    return out


def _cut_out(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (B, C, H, W) with, in every image with probability ½, a square of side H/7 to H/3 (its centre anywhere
    in the image, clipped at the edges) set to that image's minimum."""
    n, h, w = len(x), x.shape[-2], x.shape[-1]
    on = torch.rand(n, generator=generator, dtype=torch.float32) < 0.5
    side = torch.randint(max(1, round(h / 7)), max(1, h // 3) + 1, (n,), generator=generator)[:, None, None]
    cy = torch.randint(0, h, (n,), generator=generator)[:, None, None]
    cx = torch.randint(0, w, (n,), generator=generator)[:, None, None]
    rows, cols = torch.arange(h)[None, :, None], torch.arange(w)[None, None, :]
    inside = (2 * (rows - cy).abs() < side) & (2 * (cols - cx).abs() < side) & on[:, None, None]
    return torch.where(inside[:, None], x.amin(dim=(1, 2, 3), keepdim=True), x)


EXAMPLE_WORDS = {"image": "images", "text": "texts", "lm": "texts"}  # Data.format → what its examples are


def examples_word(data: Data) -> str:
    """What ``data``'s examples are called in reports: images, or texts (``.jsonl`` / ``.txt`` lines)."""
    return EXAMPLE_WORDS.get(getattr(data, "format", None), "examples")


def subsample_positions(batch: Batch, k: int, generator: torch.Generator) -> Batch:
    """``batch`` scored on at most ``k`` of its next-token positions (drawn at random among the real
    ones): a copy whose scoring mask keeps only those (the inputs, and so the forward, are unchanged).
    Batches without a sequence mask (images) and batches with at most ``k`` positions come back as they are."""
    if k <= 0 or batch.mask is None or batch.mask.dim() != 2:
        return batch
    scored = batch.mask[:, 1:].reshape(-1)
    where = scored.nonzero().flatten()
    if len(where) <= k:
        return batch
    keep = torch.zeros_like(scored)
    keep[where[torch.randperm(len(where), generator=generator)[:k]]] = True
    mask = torch.cat([torch.zeros_like(batch.mask[:, :1]), keep.reshape(batch.mask[:, 1:].shape)], 1)
    return Batch(batch.inputs, batch.labels, mask)


def _split(data: Data, holdout: float) -> tuple[list, list]:
    batches = list(data.batches)
    n_hold = int(round(holdout * len(batches))) if len(batches) > 1 else 0
    n_hold = min(max(n_hold, 1 if holdout > 0 and len(batches) > 1 else 0), len(batches) - 1)
    return batches[: len(batches) - n_hold], batches[len(batches) - n_hold:]


def prepared_batches(predict, data: Data, settings, g: torch.Generator, device: torch.device | None = None) -> tuple:
    """Every learned path's batches (the pair, the joint one-sided and the dual frame):
    ``(train, p_train, check, p_check, held, checked_on)``. ``train``: the training batches with their augmented
    views; ``check``: the batches the objective is checked on — the held-out part, or without one the unaugmented
    training batches, at most ``settings.check_batches`` of them (the first) when it is set; positions subsampled
    (``g``'s draws: the views, then every batch's positions, training then held out); on ``device`` when given;
    ``p_*``: each batch's ``predict(batch)``, without gradients and under bf16 autocast (on ``device``'s type)
    with ``settings.precision`` ``"bfloat16"``; ``held``: whether a part is held out; ``checked_on``: the report's
    words for the check set."""
    train, held = _split(data, settings.holdout)
    n_original = len(train)
    _refuse_unread_augment(train, settings)
    views = augmented(train, settings.augment, g, settings.augment_style)

    def placed(b):
        b = subsample_positions(b, settings.positions, g)
        return b if device is None else b.to(device)

    train, held = [placed(b) for b in train + views], [placed(b) for b in held]
    with torch.no_grad(), torch.autocast("cpu" if device is None else device.type, dtype=torch.bfloat16,
                                         enabled=settings.precision == "bfloat16"):
        predictions = [predict(b) for b in train + held]
    p_train, p_held = predictions[:len(train)], predictions[len(train):]
    check, p_check = (held, p_held) if held else (train[:n_original], p_train[:n_original])
    if settings.check_batches:
        check, p_check = check[:settings.check_batches], p_check[:settings.check_batches]
    return train, p_train, check, p_check, bool(held), checked_on(data, held, train[:n_original], check)


def checked_on(data: Data, held: list, unaugmented: list, check: list) -> str:
    """The report's words for the batches the learned objective is checked on: the held-out part, or without one
    the (unaugmented) training batches; ``check`` fewer than those (``--learn-check-batches``): its first ones."""
    words = "held-out part" if held else f"training {examples_word(data)} (no held-out part: start and end only)"
    return words + (f", its first {len(check)} batches" if len(check) < len(held or unaugmented) else "")


# the relative change of a learning objective (float32 forward passes, a mean of cross-entropies) that rounding
# alone can make: about 8 float32 epsilons (2⁻²³ ≈ 1.2e-7); a change smaller than this is not an improvement
OBJECTIVE_RTOL = 1e-6


def improves(value: float, best: float) -> bool:
    """Whether the objective ``value`` is lower than ``best`` by more than float32 rounding can explain."""
    return value < best - OBJECTIVE_RTOL * abs(best)


class Checks:
    """The objective checks of a learning loop: the history (``step``, ``train``, ``held_out`` when a
    held-out part exists), the best value and the state it was reached in (``snapshot()``), early stopping
    after ``settings.patience`` checks without improvement, and — with nothing held out — the one check at
    the end, kept only if it is better than the start (shared by the pairwise and the joint learned
    alignments).

    "Better" means lower by more than :data:`OBJECTIVE_RTOL` (relative): the objective is computed in
    float32, and two states of the same function (learning that cannot help moves the elements a little
    along directions the objective does not see) give values that differ only by rounding, whose sign
    depends on the machine's kernels (summation order, vector width). Taking such a difference as an
    improvement would keep a state that is no better, on some machines and not others."""

    def __init__(self, settings, held: bool, held_out, snapshot, history: dict, info: dict):
        self.settings, self.held, self.held_out, self.snapshot = settings, held, held_out, snapshot
        self.history, self.info, self.stale = history, info, 0
        self.best_state = snapshot()
        self.best = self.start = held_out()

    def after(self, step: int, running: float) -> bool:
        """Record a check after ``step`` steps (training loss ``running``); True: stop early."""
        self.history["step"].append(step)
        self.history["train"].append(running)
        if not self.held:  # nothing held out: the history has no held-out column (not NaN)
            return False
        value = self.held_out()
        self.history.setdefault("held_out", []).append(value)
        if improves(value, self.best):
            self.best, self.stale, self.best_state = value, 0, self.snapshot()
            return False
        self.stale += 1
        if self.stale >= self.settings.patience:
            self.info["stopped"] = f"early stopping after {self.settings.patience} checks without improvement"
            return True
        return False

    def finish(self):
        """``(best value, its state)``; with nothing held out, the end's check against the start's."""
        if not self.held:
            value = self.held_out()
            if improves(value, self.best):
                self.best, self.best_state = value, self.snapshot()
        return self.best, self.best_state


def shuffled(n: int, generator: torch.Generator):
    """Batch indices for ever: each pass over ``range(n)`` in a fresh random order."""
    while True:
        yield from torch.randperm(n, generator=generator, device="cpu").tolist()


def budget_spent(settings, t0: float, info: dict) -> bool:
    """Whether ``settings.budget`` seconds have passed since ``t0`` (then ``info["stopped"]`` says so)."""
    if settings.budget is not None and time.perf_counter() - t0 > settings.budget:
        info["stopped"] = f"time budget of {settings.budget} s"
        return True
    return False


def cosine_adam(parameters, lr: float, steps: int):
    """Adam at ``lr`` with a cosine decay to 0 over ``steps``: ``(optimizer, scheduler)``."""
    opt = torch.optim.Adam(parameters, lr=lr)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def learned_entry(start: str, info: dict, history: dict, *, closed_form_seconds: float, seconds: float,
                  learned_from: str, layerwise: bool, solver: dict | None = None) -> dict:
    """The report's ``learned`` entry of a one-sided learned alignment, one form whether the models were in
    memory (:func:`learn_alignment`) or read layer by layer from their files
    (:func:`~symmerge.pipeline.learn_layerwise_files.learn_pair`); docs/merge.md lists the fields. ``start``:
    the closed form learned from (``--learn-start``'s name, or ``"given"``); ``info``: the learning round's;
    ``solver``: the data-free search's starts and winner when one ran."""
    entry = {"start": start, "learned_from": learned_from, "layerwise": layerwise,
             "closed_form_seconds": closed_form_seconds, "parameters": info.get("parameters"),
             "held_out_start": info.get("held_out_start"), "held_out_best": info.get("held_out_best"),
             "steps": info.get("steps", 0), "history": history, "seconds": seconds,
             "seconds_by_stage": dict(info.get("seconds_by_stage", {})),
             "learned_instances": info.get("learned_instances", 0), "checked_on": info.get("checked_on")}
    if solver is not None:  # which start won, and the objective's weights (as the weight matcher reports them)
        entry["solver"] = solver
    entry.update({k: info[k] for k in ("stopped", "note") if k in info})
    return entry


def learn_alignment(instances, model, anchor, ca: dict, cb: dict, data: Data, options, progress=None,
                    start: dict | None = None, on_step=None):
    """Elements aligning A (``ca``, canonical) to B (``cb``) learned on ``data``; returns
    ``(elements, report)`` (the report: :func:`learned_entry`). ``start``: closed-form elements to start from
    (default: data-free weight matching; the report names it ``"given"``, the matcher names its own);
    ``on_step(step, parameters)`` is called after every update (tests)."""
    settings = options.learn
    t0 = time.perf_counter()
    # the training steps run on ``options.device`` (cuda: the endpoints' predictions, the interpolated
    # model's forwards and backwards there; the learned elements come back to the CPU in float64)
    opts = options.solver_options(None if options.device in (None, "cpu") else resolve_device(options.device))
    given, solver = start is not None, None
    if start is None:  # the weight matcher's search, with its options (restarts, objective weights)
        start, solver = search(instances, ca, cb, opts, max_sweeps=options.max_sweeps, tol=options.descent_tol,
                               starts=Restarts.of(options))
    closed_form_seconds = time.perf_counter() - t0
    history = {"step": [], "train": []}
    # the module run by ``functional_call`` (every parameter is replaced at each call): the anchor's modules,
    # its parameters shared, not copied (a float32 anchor on the CPU costs no weight memory)
    skeleton = with_state_dict(anchor, anchor.state_dict(), share=True).to(device=opts.device or "cpu",
                                                                            dtype=torch.float32).eval()
    for p in skeleton.parameters():
        p.requires_grad_(False)
    # the budget counts the learning (its targets, checks and steps) from here, not the closed-form start: as the
    # activation start, the file path, the joint and the dual learning count it
    learning = _Learning(instances, skeleton, model, ca, cb, data, settings, opts, settings.steps, progress, on_step,
                         time.perf_counter())
    elements, info = _learn_round(learning, dict(start), history)
    return elements, learned_entry("given" if given else "weights", info, history,
                                   closed_form_seconds=closed_form_seconds, seconds=time.perf_counter() - t0,
                                   learned_from="the models in memory", layerwise=settings.layerwise, solver=solver)


@dataclass(frozen=True)
class _Learning:
    """What a round of learning (:func:`_learn_round`) learns with: the instances, the module run by
    ``functional_call`` (``skeleton``), model A, the canonical state dicts, the data, the settings
    (:class:`~symmerge.pipeline.options.LearnSettings`), the solver options, the steps, the callbacks and the
    clock's start."""

    instances: list
    skeleton: object
    model: object
    ca: dict
    cb: dict
    data: Data
    settings: object
    opts: object
    steps: int
    progress: object
    on_step: object
    t0: float


def _learn_round(learning: _Learning, start, history, offset: int = 0):
    """One round of learning from ``start``: ``(elements, info)``."""
    from ..progress import bar

    lg = learning
    instances, skeleton, model, ca, cb, data = lg.instances, lg.skeleton, lg.model, lg.ca, lg.cb, lg.data
    settings, opts, steps, progress, on_step, t0 = lg.settings, lg.opts, lg.steps, lg.progress, lg.on_step, lg.t0

    dtype, dev = torch.float32, opts.device or torch.device("cpu")
    if settings.layerwise:  # A moved by the start, and B, built one layer at a time when a layer runs
        from .learn_layerwise import paths_of, working_tensors

        work_a, work_b = working_tensors(skeleton, ca, cb, instances, start, dtype, dev)
    else:
        a0 = apply(ca, instances, start)
        work_a = {k: v.detach().to(dev, dtype) if v.is_floating_point() else v.to(dev) for k, v in a0.items()}
        work_b = {k: v.detach().to(dev, dtype) if v.is_floating_point() else v.to(dev) for k, v in cb.items()}
    params = Parameters(instances, opts, dtype, {"norm_eps": norm_eps(model.config)}).to(dev)
    g = torch.Generator().manual_seed(settings.seed + offset)  # on the CPU whatever the device: the same draws

    layerwise = LayerwiseForward(skeleton, paths_of(skeleton), list(work_a)) if settings.layerwise else None

    def forward(sd, batch):
        if layerwise is not None:
            return layerwise(lambda keys: {k: sd[k] for k in keys}, batch)
        return head_forward(skeleton, sd, batch)

    clock = {"targets": 0.0, "checks": 0.0, "steps": 0.0}  # wall seconds by stage
    tick = time.perf_counter()
    fast = settings.precision == "bfloat16"  # the training steps (and the targets) under bf16 autocast
    norm = torch.softmax if settings.target == "probabilities" else torch.log_softmax

    def targets(b):  # the endpoints' predictions: fixed, alignment does not change them
        return norm(forward(work_a, b).float(), -1), norm(forward(work_b, b).float(), -1)

    train, t_train, check, t_check, held, checked = prepared_batches(targets, data, settings, g, dev)
    clock["targets"] = time.perf_counter() - tick

    def interpolated(alpha: float, changed: dict, keys=None) -> dict:
        return {k: alpha * changed.get(k, work_a[k]) + (1 - alpha) * work_b[k] if work_a[k].is_floating_point()
                else work_b[k] for k in (work_a if keys is None else keys)}


    def objective(alpha, batch, target, sd=None, step: bool = False) -> torch.Tensor:
        """The soft cross-entropy at ``alpha`` on ``batch`` (``sd``: θ(α) already built); ``step``: a
        training step, whose transform and forward run in ``settings.precision``; the checks: float32.
        Layer-wise (``settings.layerwise``): θ(α) built one layer at a time inside the forward."""
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=step and fast):
            if layerwise is not None and sd is None:
                prepared = params.prepare()
                logits = layerwise(lambda keys: interpolated(alpha, params.transform(work_a, keys, prepared), keys),
                                   batch)
            else:
                sd = interpolated(alpha, params.transform(work_a)) if sd is None else sd
                logits = forward(sd, batch)
        logp = torch.log_softmax(logits.float(), -1)
        t = alpha * target[0] + (1 - alpha) * target[1]
        if settings.target != "probabilities":  # the normalised geometric mean of the endpoints' predictions
            t = torch.softmax(t, -1)
        return -(t * logp).sum(-1).mean()

    # the objective at α = ¼, ½, ¾ on the held-out batches (checked every ``check_every`` steps), or without
    # a held-out part on the (unaugmented) training batches, at the start and the end only
    def held_out() -> float:
        tick = time.perf_counter()
        with torch.no_grad():
            values = []
            if layerwise is not None:  # layer by layer, as the steps
                for al in (0.25, 0.5, 0.75):
                    values += [objective(al, b, t).item() for b, t in zip(check, t_check)]
            else:
                moved = params.transform(work_a)  # the same for every batch and α of the check: built once
                for al in (0.25, 0.5, 0.75):
                    sd = interpolated(al, moved)
                    values += [objective(al, b, t, sd).item() for b, t in zip(check, t_check)]
        clock["checks"] += time.perf_counter() - tick
        return sum(values) / len(values)

    info = {"parameters": sum(p.numel() for p in params.parameters())}
    checks = Checks(settings, held, held_out,
                    lambda: {k: v.detach().clone() for k, v in params.state_dict().items()}, history, info)
    info.update(held_out_start=checks.start, checked_on=checked)
    if not params.p:
        info.update(steps=0, note="no continuous group elements to learn")
        return start, info
    opt, sched = cosine_adam(params.parameters(), settings.lr, steps)
    order, done, running = shuffled(len(train), g), 0, None  # done: the steps taken (a budget spent stops before one)
    pbar = bar(range(steps), desc="learned alignment", unit="step", disable=None if progress else True)
    for step in pbar:
        if budget_spent(settings, t0, info):
            break
        i = next(order)
        alpha = settings.draw_alpha(g)
        tick = time.perf_counter()
        loss = objective(alpha, train[i], t_train[i], step=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        clock["steps"] += time.perf_counter() - tick
        done = step + 1
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        pbar.set_postfix(loss=f"{running:.4f}", refresh=False)
        if on_step is not None:
            on_step(offset + step, params)
        if ((step + 1) % settings.check_every == 0 or step + 1 == steps) and checks.after(offset + step + 1, running):
            break
    pbar.close()
    best, best_state = checks.finish()  # never worse than the start on the objective
    params.load_state_dict(best_state)
    learned = params.elements()
    elements = dict(start)
    for name, el in learned.items():
        elements[name] = (*stages(start[name]), el) if name in start else el
    info.update(steps=done, held_out_best=best, learned_instances=len(learned), seconds_by_stage=clock)
    return elements, info
