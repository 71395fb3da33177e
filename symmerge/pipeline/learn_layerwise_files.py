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


def learn_from_checkpoints(model, anchor, data, options, progress=None, start: dict | None = None) -> tuple[dict, dict]:
    """``(elements, report)``: the learned alignment of the checkpoint folder ``model`` (A, moved) to
    ``anchor`` (B) on the unlabeled ``data`` (:class:`~symmerge.io.data.Data`), with neither model in memory
    (see the module text). ``options``: :class:`~symmerge.pipeline.options.AlignOptions` with ``match="learned"``;
    the learned steps run layer-wise whatever ``options.learn.layerwise`` says. The report: the start's and the
    learning's fields, the verification (``verify_max_rel_diff`` of the logits on the first batches, against
    ``options.verify_tol``, default 1e-4) and ``seconds``. ``start``: closed-form elements to learn from instead
    of ``options.learn.start``'s (``{}``: the identity; benchmarks of the learned steps alone)."""
    from ..io.checkpoint import LazyCheckpoint
    from .activations import LayerReplay, match_replayed
    from .engine import solve_local
    from .learn import _Learning, _learn_round
    from .matchers import MATCHERS, matcher
    from .stream import _bound_malloc, layer_instances
    from .verify import verify_elements

    t0 = time.perf_counter()
    _bound_malloc(1 << 20)  # freed layer tensors go back to the OS (glibc), not into a heap that only grows
    if not matcher(options.match).learns:  # the learned matcher's settings, whatever its name
        raise SymmergeError(f"learning from checkpoints runs a learned matcher (--match learned), not "
                            f"{options.match!r}")
    ckpt_a, ckpt_b = LazyCheckpoint(model), LazyCheckpoint(anchor)
    if ckpt_a.shape != ckpt_b.shape:
        raise SymmergeError(f"{model} and {anchor}: different tensor names or shapes")
    _, by_layer, options = layer_instances(ckpt_a, options.layers, options=options)
    instances = [i for insts in by_layer.values() for i in insts]
    opts = options.solver_options(None)
    skeleton = weightless(ckpt_a)
    paths = paths_of(skeleton)
    tensors_a, tensors_b = CheckpointTensors(ckpt_a), CheckpointTensors(ckpt_b)
    plain_a, plain_b = (LayerTensors(t, list(t), paths) for t in (tensors_a, tensors_b))
    t_open = time.perf_counter()
    report: dict = {"mode": "layer by layer from the checkpoints",
                    "start": options.learn.start if start is None else "given"}
    timings: dict = {}
    if start is not None:
        start = dict(start)
    elif MATCHERS[options.learn.start].needs_data:  # the activation start: statistics and solve one layer at a time
        runners = [_Runner(skeleton, paths, t) for t in (plain_a, plain_b)]
        replay = LayerReplay.of_forwards(runners, [r.layer for r in runners], paths, data.batches,
                                         progress is not None)
        if replay is None:
            raise SymmergeError(f"{model}: its layers do not feed each other; learn in memory (align_pair)")
        start = match_replayed(instances, skeleton, replay, paths,
                               lambda path: (plain_a.group(path), plain_b.group(path)), opts, timings=timings)
        del replay, runners
    else:  # data-free: each layer's groups solved exactly on its weights
        start = {}
        for path in paths:
            insts = [i for i in instances if plain_a.group_of.get(i.slots[0].key) == path]
            if insts:
                start.update(solve_local(insts, plain_a.group(path), plain_b.group(path), opts))
    report.update(open_seconds=t_open - t0, closed_form_seconds=time.perf_counter() - t_open)
    settings = replace(options.learn, layerwise=True)
    history = {"step": [], "train": []}
    learning = _Learning(instances, skeleton, skeleton, tensors_a, tensors_b, data, settings, opts, settings.steps,
                         progress, None, time.perf_counter())
    elements, info = _learn_round(learning, start, history)
    report.update(learned={"steps": info.get("steps", 0), "history": history, "parameters": info.get("parameters"),
                           "held_out_start": info.get("held_out_start"), "held_out_best": info.get("held_out_best"),
                           "seconds_by_stage": dict(info.get("seconds_by_stage", {})),
                           **{k: info[k] for k in ("stopped", "note") if k in info}})
    verify_elements(instances, elements)
    tol = 1e-4 if options.verify_tol is None else options.verify_tol
    aligned = LayerTensors(tensors_a, list(tensors_a), paths, instances, elements)
    max_abs, max_rel = _logit_difference(skeleton, paths, plain_a, aligned, list(data.batches)[:2])
    if not max_rel <= tol:
        raise SymmergeError(f"aligned model is not equivalent: max relative output difference {max_rel:.3g} > {tol:.3g}")
    report.update(verify_max_abs_diff=max_abs, verify_max_rel_diff=max_rel, verify_tolerance=tol,
                  activation_seconds=timings, seconds=time.perf_counter() - t0)
    return elements, report
