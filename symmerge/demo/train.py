"""Train small ``transformers`` ViT image classifiers from scratch, reproducibly, with a cache.

:func:`train_vit` trains a ``ViTForImageClassification`` built from a small :class:`ViTConfig`
(:func:`vit_config`) on numpy arrays (uint8 images (N, H, W) or normalised float32 (N, C, H, W), int64
labels): fixed seed for the initialisation and the batch order, AdamW with linear warm-up then cosine
decay, gradient clipping, a tqdm progress bar. The result is an HF folder (``save_model``, atomic) with
``train_report.json`` and a ``preprocessor_config.json`` describing the pixel normalisation; it is
cached under ``<cache>/vit/<name>-<hash>`` where the hash covers the config, the data, the seed and
every training setting, and reused on the next call with the same inputs: the sha256 of its weights is
recorded beside them, and weights that no longer match (or no longer read) are trained again, with a note; a
second process that wants the same model while one trains it waits for it (:mod:`symmerge.io.cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .datasets import PIXEL_MEAN, PIXEL_STD, cache_dir, pixel_values
from ..errors import SymmergeError
from ..io.model import load_model, save_model
from ..progress import bar

CACHE_FORMAT = 1  # bump when the training procedure changes in a way the settings do not capture


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup: float = 0.05  # fraction of the steps with a linear warm-up
    min_lr: float = 0.0  # fraction of lr at the end of the cosine decay
    clip: float = 1.0  # gradient-norm clipping (0: none)
    label_smoothing: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise SymmergeError(f"training needs steps >= 1 and batch_size >= 1, got {self.steps}, {self.batch_size}")


def vit_config(hidden: int = 128, layers: int = 6, heads: int = 4, intermediate: int | None = None,
               patch: int = 4, image_size: int = 28, channels: int = 1, num_labels: int = 10,
               labels: tuple[str, ...] | None = None, initializer_range: float = 0.02, dropout: float = 0.0):
    """A small ``ViTConfig`` for ``ViTForImageClassification`` (FFN width 4·hidden unless given)."""
    from transformers import ViTConfig

    if hidden % heads:
        raise SymmergeError(f"hidden size {hidden} is not divisible by {heads} heads")
    if image_size % patch:
        raise SymmergeError(f"image size {image_size} is not divisible by the patch size {patch}")
    names = list(labels) if labels is not None else [str(i) for i in range(num_labels)]
    return ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=intermediate or 4 * hidden, image_size=image_size, patch_size=patch,
                     num_channels=channels, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                     initializer_range=initializer_range, num_labels=len(names),
                     id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
                     architectures=["ViTForImageClassification"])


def _as_pixels(images) -> np.ndarray:
    images = np.asarray(images)
    return pixel_values(images) if images.dtype == np.uint8 else np.asarray(images, np.float32)


def _config_dict(config) -> dict:
    d = config.to_dict()
    for k in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "output_hidden_states",
              "output_attentions", "return_dict"):
        d.pop(k, None)
    return d


def inputs_key(config, settings, arrays, extra: dict | None = None) -> str:
    """sha256 over (cache format, config, every setting, ``extra``), the first array's shape, and the
    bytes of every array: the cache key of a training run."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    h = hashlib.sha256()
    h.update(json.dumps({"format": CACHE_FORMAT, "config": _config_dict(config),
                         "settings": dataclasses.asdict(settings), **(extra or {})},
                        sort_keys=True, default=str).encode())
    h.update(str(arrays[0].shape).encode())
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


def cache_key(config, images, labels, settings: TrainSettings) -> str:
    """sha256 over (config, data, seed and every setting, cache format)."""
    return inputs_key(config, settings, [_as_pixels(images), np.asarray(labels, np.int64)])


def lr_factor(step: int, settings: TrainSettings) -> float:
    """Linear warm-up over ``warmup·steps``, then cosine decay to ``min_lr`` (step counts from 0)."""
    warm = max(1, round(settings.warmup * settings.steps)) if settings.warmup > 0 else 0
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, settings.steps - warm)
    return settings.min_lr + (1 - settings.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def accuracy(model, images, labels, batch_size: int = 500) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on arrays (eval mode, no grad)."""
    x, y = torch.from_numpy(_as_pixels(images)), torch.from_numpy(np.asarray(labels, np.int64))
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = model(pixel_values=x[i:i + batch_size]).logits
            loss += torch.nn.functional.cross_entropy(logits.double(), y[i:i + batch_size], reduction="sum").item()
            correct += (logits.argmax(-1) == y[i:i + batch_size]).sum().item()
    return loss / len(x), correct / len(x)


def cached_folder(root, subdir: str, name: str, key: str, cache: bool, log=print) -> tuple[Path, bool]:
    """``(<root or cache_dir()/subdir>/<name>-<key[:12]>, found)``: ``found`` when a complete earlier run
    is there, its weights intact (:func:`symmerge.io.cache.damage`), and ``cache`` is on; otherwise an incomplete
    or damaged folder (or one to replace) is removed, a damaged one with a note."""
    from ..io.cache import damage, remove_entry

    out = (Path(root) if root is not None else cache_dir() / subdir) / f"{name}-{key[:12]}"
    if (out / "model.safetensors").is_file() and (out / "train_report.json").is_file() and cache:
        reason = damage(out)
        if reason is None:
            log(f"reusing cached {name} ({out})")
            return out, True
        log(f"note: {reason}; training {name} again")
    remove_entry(out, "cached model")  # an incomplete or damaged earlier run, or cache=False
    return out, False


@contextlib.contextmanager
def cached_build(root, subdir: str, name: str, key: str, cache: bool, log=print):
    """:func:`cached_folder` under the entry's build lock (:func:`symmerge.io.cache.build_lock`: a second process
    training the same model waits, then reuses it); yields ``(out, found)``. A folder built in the block gets its
    weights' digests recorded, and so does a reused one of an earlier version that has none (its headers read: it is
    trusted as it is now, and checked against these digests from then on)."""
    from ..io.cache import DIGESTS, build_lock, record_digests

    out = (Path(root) if root is not None else cache_dir() / subdir) / f"{name}-{key[:12]}"
    with build_lock(out, say=log):
        out, found = cached_folder(root, subdir, name, key, cache, log)
        yield out, found
        if (out / "model.safetensors").is_file() and not (out / DIGESTS).is_file():
            record_digests(out)


def _decays(name: str, p) -> bool:
    return p.dim() >= 2 and not any(e in name for e in ("embeddings", "wte", "wpe"))


def fit(model, settings: TrainSettings, n: int, batch_loss, name: str, evaluate=None, eval_every: int = 0,
        progress: bool = True, log=print) -> dict:
    """The shared training loop: ``batch_loss(indices)`` → scalar loss over training examples
    ``indices`` (a fresh seeded permutation of ``range(n)`` per epoch, last partial batch dropped;
    the order generator is seeded with ``settings.seed + 1``); AdamW (no weight decay on biases,
    norms and embeddings), :func:`lr_factor` schedule, gradient clipping. ``evaluate()`` → dict with
    ``loss`` (and more), called every ``eval_every`` steps (the training is unaffected: the model is
    put back into train mode). Returns the report fields: seconds, losses, ``eval_curve``."""
    model.train()
    order = torch.Generator().manual_seed(settings.seed + 1)
    params = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for k, p in params if _decays(k, p)], "weight_decay": settings.weight_decay},
                             {"params": [p for k, p in params if not _decays(k, p)], "weight_decay": 0.0}],
                            lr=settings.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, settings))
    perm, pos = torch.randperm(n, generator=order), 0
    losses, start = [], time.perf_counter()
    pbar = bar(range(settings.steps), desc=f"training {name}", unit="steps", disable=None if progress else True)
    running, curve = None, []
    for step in pbar:
        if pos + settings.batch_size > n:  # a fresh permutation per epoch; the last partial batch is dropped
            perm, pos = torch.randperm(n, generator=order), 0
        idx = perm[pos:pos + min(settings.batch_size, n)]
        pos += len(idx)
        loss = batch_loss(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if settings.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
        opt.step()
        sched.step()
        value = loss.item()
        if not math.isfinite(value):
            raise SymmergeError(f"training {name} diverged at step {step} (loss {value}); lower the learning rate")
        losses.append(value)
        running = value if running is None else 0.95 * running + 0.05 * value
        pbar.set_postfix(loss=f"{running:.3f}", refresh=False)
        if eval_every and evaluate is not None and (step + 1) % eval_every == 0 and step + 1 < settings.steps:
            point = {"step": step + 1, "seconds": time.perf_counter() - start, **evaluate()}
            curve.append(point)
            log(f"  {name} step {step + 1}: " + ", ".join(f"eval {k} {v:.4f}" for k, v in point.items()
                                                          if k not in ("step", "seconds"))
                + f" ({point['seconds']:.0f} s)")
            model.train()
    pbar.close()
    seconds = time.perf_counter() - start
    model.eval()
    report = {"name": name, "settings": dataclasses.asdict(settings), "train_examples": n,
              "epochs": settings.steps * settings.batch_size / n, "seconds": seconds,
              "seconds_per_step": seconds / settings.steps, "loss_first": losses[0],
              "loss_last_50": float(np.mean(losses[-50:])), "losses": losses[:: max(1, len(losses) // 200)]}
    if curve:
        report["eval_curve"] = curve
    return report


def callers_rng_kept():
    """A block that seeds torch's global generator (a training's initialisation and dropout) leaves the caller's as it
    was: the demo and the benchmarks train inside a caller's process, whose next ``torch.rand`` must not depend on
    whether a model was trained (or found in the cache). The CPU generator: the demos train on the CPU."""
    return torch.random.fork_rng(devices=[])


def train_vit(config, images, labels, settings: TrainSettings, name: str = "vit", eval_images=None,
              eval_labels=None, cache: bool = True, root=None, progress: bool = True, log=print,
              eval_every: int = 0) -> Path:
    """Train (or reuse from the cache) a ViT classifier; returns its HF folder.

    ``images``: uint8 (N, H, W) / (N, C, H, W) or normalised float32 (N, C, H, W); ``labels``: (N,) ints
    in ``0..num_labels-1``. ``eval_images``/``eval_labels``: scored after training (report only), and
    every ``eval_every`` steps when that is > 0 (on at most 2 000 of them; the training is unaffected).
    ``root``: cache root (default ``<cache_dir()>/vit``); with ``cache=False`` an existing folder is
    replaced.
    """
    from transformers import ViTForImageClassification

    x = torch.from_numpy(np.ascontiguousarray(_as_pixels(images)))
    if x.ndim == 3:
        x = x[:, None]
    y = torch.from_numpy(np.asarray(labels).astype(np.int64))
    if len(x) != len(y) or len(y) == 0:
        raise SymmergeError(f"{len(x)} images but {len(y)} labels")
    if int(y.min()) < 0 or int(y.max()) >= config.num_labels:
        raise SymmergeError(f"labels must lie in 0..{config.num_labels - 1}, got {int(y.min())}..{int(y.max())}")
    if tuple(x.shape[1:]) != (config.num_channels, config.image_size, config.image_size):
        raise SymmergeError(f"images are {tuple(x.shape[1:])}, the config expects "
                            f"{(config.num_channels, config.image_size, config.image_size)}")
    key = cache_key(config, images, labels, settings)
    with cached_build(root, "vit", name, key, cache, log) as (out, found), callers_rng_kept():
        if found:
            return out
        torch.manual_seed(settings.seed)
        model = ViTForImageClassification(config).float().train()

        def batch_loss(idx):
            logits = model(pixel_values=x[idx]).logits
            return torch.nn.functional.cross_entropy(logits, y[idx], label_smoothing=settings.label_smoothing)

        def evaluate():
            loss, acc = accuracy(model, eval_images[:2000], eval_labels[:2000])
            return {"loss": loss, "accuracy": acc}

        report = fit(model, settings, len(x), batch_loss, name, evaluate if eval_images is not None else None,
                     eval_every, progress, log)
        report = {"name": name, "key": key, **report, "pixel_normalisation": {"mean": PIXEL_MEAN, "std": PIXEL_STD}}
        if eval_images is not None:
            report["eval_loss"], report["eval_accuracy"] = accuracy(model, eval_images, eval_labels)
        with tempfile.TemporaryDirectory() as side:  # written inside the atomic save, beside the weights
            (Path(side) / "preprocessor_config.json").write_text(json.dumps({
                "image_processor_type": "ViTImageProcessor", "do_resize": False, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [PIXEL_MEAN] * config.num_channels,
                "image_std": [PIXEL_STD] * config.num_channels,
                "size": {"height": config.image_size, "width": config.image_size}}, indent=2) + "\n")
            save_model(model, out, src=side, report=report, report_name="train_report.json")
        extra = f", eval accuracy {report['eval_accuracy']:.4f}" if "eval_accuracy" in report else ""
        log(f"trained {name} in {report['seconds']:.0f} s ({report['seconds_per_step']:.3f} s/step){extra} -> {out}")
    return out


def load_report(folder) -> dict:
    """The ``train_report.json`` of a trained folder."""
    return json.loads((Path(folder) / "train_report.json").read_text())


def load_trained(folder):
    """The trained model (validated loading, eval mode)."""
    return load_model(folder)
