"""Learned alignment of two checkpoints read layer by layer from their safetensors, neither model ever in
memory (issue 42, item 6).

:func:`learn_from_checkpoints` — two safetensors folders aligned by the learned matcher without loading either:
a weightless skeleton of the class (``meta`` parameters; only the non-persistent buffers, such as RoPE's
frequencies, real), the activation start by layer (:class:`~symmerge.pipeline.activations.LayerReplay` over
both checkpoints, each layer's statistics freed once solved) or the data-free start layer by layer, then the
layer-wise learned steps reading each layer's tensors from the files
(:class:`~symmerge.pipeline.learn_layerwise.LayerTensors`), and the verification: every element valid, and A's
logits against A aligned, both run layer by layer from the files. Per-layer groups only (the residual stream
couples every layer's tensors: refused, as in streamed alignment).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

import torch

from ..errors import SymmergeError
from .learn_layerwise import LayerTensors, paths_of


# ---------------------------------------------------------------------------- two checkpoints, layer by layer


class CheckpointTensors(Mapping):
    """A :class:`~symmerge.io.checkpoint.LazyCheckpoint`'s tensors under their in-memory names, its declared
    ties included (an alias reads its source: the same tensor when read together), read when asked, none kept."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.alias = {a: s for a, s in ckpt.ties.items() if s in ckpt.file_of and a not in ckpt.file_of}
        self.names = list(ckpt.keys()) + list(self.alias)

    def read(self, keys) -> dict:
        sources = list(dict.fromkeys(self.alias.get(k, k) for k in keys))
        got = self.ckpt.read(sources)
        return {k: got[self.alias.get(k, k)] for k in keys}

    def __getitem__(self, key):
        if key not in self.alias and key not in self.ckpt.file_of:
            raise KeyError(key)
        return self.read([key])[key]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


class ProxyTensors(Mapping):
    """The anchor's tensors (a :class:`CheckpointTensors`) with the model's own for ``own`` (its tensors outside the
    base model: a task or LM head) — the in-memory merge's anchor proxy (``merge.heads.anchor_proxy``: the model
    carrying the anchor's body), so that models whose heads differ are aligned by their bodies."""

    def __init__(self, anchor, model, own):
        self.anchor, self.model, self.own, self.names = anchor, model, set(own), anchor.names

    def read(self, keys) -> dict:
        got = self.anchor.read([k for k in keys if k not in self.own])
        got.update(self.model.read([k for k in keys if k in self.own]))
        return {k: got[k] for k in keys}

    def __getitem__(self, key):
        return self.read([key])[key]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def weightless(ckpt):
    """A model of the checkpoint's class and config with ``meta`` parameters (no memory): the module every
    layer-wise forward runs with ``functional_call``; its non-persistent buffers (RoPE's frequencies), which no
    checkpoint holds, are real: copied from a one-layer model of the same config."""
    import copy

    from ..io.hf import model_class, quiet_transformers

    cls, cfg = model_class(ckpt.config), ckpt.hf_config
    with quiet_transformers(), torch.device("meta"):
        model = cls(cfg).eval()
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    model.name_or_path = str(ckpt.folder)  # its tokenizer's folder, as a loaded model's (alignment data)
    persistent = set(model.state_dict())
    loose = [n for n, _ in model.named_buffers() if n not in persistent]
    if loose:
        if not hasattr(cfg, "num_hidden_layers"):
            raise SymmergeError(f"{ckpt.folder}: cannot build a weightless {cls.__name__} (its config names no "
                                "num_hidden_layers)")
        small_cfg = copy.deepcopy(cfg)
        small_cfg.num_hidden_layers = 1
        with quiet_transformers():
            small = cls(small_cfg)
        paths = paths_of(model)
        own = dict(small.named_buffers())
        for name in loose:
            layer = next((p for p in paths if name.startswith(p + ".")), None)
            source = paths[0] + name[len(layer):] if layer is not None else name
            if source not in own:
                raise SymmergeError(f"{ckpt.folder}: cannot build a weightless {cls.__name__} (buffer {name})")
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = own[source].clone()
        del small, own
    return model


class _Runner:
    """One model run by a skeleton's layer-wise forward from its tensors (``tensors``: a mapping), as
    :meth:`~symmerge.pipeline.activations.LayerReplay.of_forwards` calls a model; ``layer(i)``: its layer ``i``."""

    def __init__(self, skeleton, paths, tensors):
        from .learn import LayerwiseForward

        self.module, self.paths, self.tensors = skeleton, paths, tensors
        self.forward = LayerwiseForward(skeleton, paths, list(tensors))
        self.cut = {p: len(p) + 1 for p in paths}

    def __call__(self, **inputs):
        from ..io.data import Batch

        return self.forward(lambda keys: {k: self.tensors[k] for k in keys}, Batch(inputs, None, None))

    def eval(self):
        return self

    def layer(self, i: int):
        path = self.paths[i]
        module, names = self.forward.layers[path], self.forward.keys[path]

        def run(*args, **kwargs):
            local = {k[self.cut[path]:]: self.tensors[k] for k in names}
            return torch.func.functional_call(module, local, args, kwargs, tie_weights=False)
        return run


def _logit_difference(skeleton, paths, a, b, batches) -> tuple[float, float]:
    """Max absolute and relative (to the largest logit) difference of the logits under the tensors ``a`` and
    ``b``, both run layer by layer, on ``batches``."""
    from .learn import LayerwiseForward

    forward = LayerwiseForward(skeleton, paths, list(a))
    max_abs = scale = 0.0
    with torch.no_grad():
        for batch in batches:
            la = forward(lambda keys: {k: a[k] for k in keys}, batch).double()
            lb = forward(lambda keys: {k: b[k] for k in keys}, batch).double()
            max_abs = max(max_abs, (la - lb).abs().max().item())
            scale = max(scale, la.abs().max().item())
    return max_abs, (max_abs / scale if scale else max_abs)


class CheckpointPair:
    """Two checkpoint folders opened for learning layer by layer: their lazy checkpoints, the streamed
    spec and its per-layer instances (``options`` resolved against them: 'recommended' keeps the symmetries
    that stream), the weightless skeleton and its layer paths, and both models' tensors by in-memory name
    (``model_heads``: names the anchor takes from the model, :class:`ProxyTensors`)."""

    def __init__(self, model, anchor, options, model_heads=()):
        from ..io.checkpoint import LazyCheckpoint
        from .matchers import matcher
        from .stream import layer_instances

        if not matcher(options.match).learns:  # the learned matcher's settings, whatever its name
            raise SymmergeError(f"learning from checkpoints runs a learned matcher (--match learned), not "
                                f"{options.match!r}")
        self.ckpt_a, self.ckpt_b = LazyCheckpoint(model, fused=True), LazyCheckpoint(anchor, fused=True)
        if getattr(self.ckpt_a.hf_config, "is_encoder_decoder", False):  # two stacks, cross-attention between them
            raise SymmergeError(f"{model}: learning from the files runs one stack of layers; an encoder-decoder "
                                f"({self.ckpt_a.config.get('model_type')}) is learned in memory: leave out --stream")
        if self.ckpt_a.shape != self.ckpt_b.shape:
            raise SymmergeError(f"{model} and {anchor}: different tensor names or shapes")
        self.spec, by_layer, self.options = layer_instances(self.ckpt_a, options.layers, options=options)
        self.instances = [i for insts in by_layer.values() for i in insts]
        self.skeleton = weightless(self.ckpt_a)
        self.paths = paths_of(self.skeleton)
        self.tensors_a, self.tensors_b = CheckpointTensors(self.ckpt_a), CheckpointTensors(self.ckpt_b)
        if model_heads:  # the anchor as the merge's proxy: the model's own heads on the anchor's body
            self.tensors_b = ProxyTensors(self.tensors_b, self.tensors_a, model_heads)

    def plain(self, tensors) -> LayerTensors:
        """A model's tensors as they are, one layer at a time (float32)."""
        return LayerTensors(tensors, list(tensors), self.paths)


def _closed_form(pair: CheckpointPair, data, opts, progress, timings: dict) -> dict:
    """The learned path's closed-form start, one layer at a time: activation matching over both checkpoints
    (each layer's statistics freed once solved), or the data-free solve of each layer's groups on its weights."""
    from .activations import LayerReplay, match_replayed
    from .engine import solve_local
    from .matchers import MATCHERS

    plain_a, plain_b = pair.plain(pair.tensors_a), pair.plain(pair.tensors_b)
    if MATCHERS[pair.options.learn.start].needs_data:
        runners = [_Runner(pair.skeleton, pair.paths, t) for t in (plain_a, plain_b)]
        replay = LayerReplay.of_forwards(runners, [r.layer for r in runners], pair.paths, data.batches,
                                         progress is not None)
        if replay is None:
            raise SymmergeError(f"{pair.ckpt_a.folder}: its layers do not feed each other; learn in memory "
                                "(align_pair)")
        return match_replayed(pair.instances, pair.skeleton, replay, pair.paths,
                              lambda path: (plain_a.group(path), plain_b.group(path)), opts, timings=timings)
    start = {}
    for path in pair.paths:
        insts = [i for i in pair.instances if plain_a.group_of.get(i.slots[0].key) == path]
        if insts:
            start.update(solve_local(insts, plain_a.group(path), plain_b.group(path), opts))
    return start


def learn_pair(pair: CheckpointPair, data, progress=None, start: dict | None = None) -> tuple[dict, dict]:
    """``(elements, report)``: the learned alignment of ``pair`` (its closed-form start, then the layer-wise
    learned steps), every element checked valid; not yet verified on outputs (see :func:`learn_from_checkpoints`)."""
    from .learn import _Learning, _learn_round, learned_entry
    from .verify import verify_elements

    t0 = time.perf_counter()
    options = pair.options
    opts = options.solver_options(None)
    timings: dict = {}
    given = "given" if start is not None else options.learn.start
    start = dict(start) if start is not None else _closed_form(pair, data, opts, progress, timings)
    closed_form_seconds = time.perf_counter() - t0
    settings = replace(options.learn, layerwise=True)
    history = {"step": [], "train": []}
    learning = _Learning(pair.instances, pair.skeleton, pair.skeleton, pair.tensors_a, pair.tensors_b, data, settings,
                         opts, settings.steps, progress, None, time.perf_counter())
    elements, info = _learn_round(learning, start, history)
    report = {**({"activation_seconds": timings} if timings else {}),  # as in memory: an activation start's
              "learned": learned_entry(given, info, history, closed_form_seconds=closed_form_seconds,
                                       seconds=time.perf_counter() - t0, learned_from="the checkpoints, layer by layer",
                                       layerwise=True)}
    verify_elements(pair.instances, elements)
    return elements, report


def verified(pair: CheckpointPair, moved, batches, tol) -> dict:
    """The verification fields of A moved (``moved``: a mapping of its tensors, e.g. the written output read
    back) against A, both run layer by layer on ``batches``; one clear error when they differ beyond ``tol``."""
    max_abs, max_rel = _logit_difference(pair.skeleton, pair.paths, pair.plain(pair.tensors_a), moved, batches)
    if not max_rel <= tol:
        raise SymmergeError(f"aligned model is not equivalent: max relative output difference {max_rel:.3g} "
                            f"> {tol:.3g}")
    return {"verify_max_abs_diff": max_abs, "verify_max_rel_diff": max_rel, "verify_tolerance": tol}


def learn_from_checkpoints(model, anchor, data, options, progress=None, start: dict | None = None) -> tuple[dict, dict]:
    """``(elements, report)``: the learned alignment of the checkpoint folder ``model`` (A, moved) to
    ``anchor`` (B) on the unlabeled ``data`` (:class:`~symmerge.io.data.Data`), with neither model in memory
    (see the module text). ``options``: :class:`~symmerge.pipeline.options.AlignOptions` with ``match="learned"``;
    the learned steps run layer-wise whatever ``options.learn.layerwise`` says. The report: the start's and the
    learning's fields, the verification (``verify_max_rel_diff`` of the logits on the first batches, against
    ``options.verify_tol``, default 1e-4) and ``seconds``. ``start``: closed-form elements to learn from instead
    of ``options.learn.start``'s (``{}``: the identity; benchmarks of the learned steps alone). Writing the
    aligned model: :func:`symmerge.pipeline.learn_layerwise_write.align_learned_streaming`."""
    from .stream import _bound_malloc

    t0 = time.perf_counter()
    _bound_malloc(1 << 20)  # freed layer tensors go back to the OS (glibc), not into a heap that only grows
    pair = CheckpointPair(model, anchor, options)
    open_seconds = time.perf_counter() - t0
    elements, report = learn_pair(pair, data, progress, start)
    tol = 1e-4 if options.verify_tol is None else options.verify_tol
    aligned = LayerTensors(pair.tensors_a, list(pair.tensors_a), pair.paths, pair.instances, elements)
    report.update(verified(pair, aligned, list(data.batches)[:2], tol))
    report.update(open_seconds=open_seconds, seconds=time.perf_counter() - t0)
    return elements, report
