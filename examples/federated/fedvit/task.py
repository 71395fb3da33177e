"""The model, the data shards, local training and evaluation of the fedvit app.

Every setting has a default here (:data:`DEFAULTS`); ``flwr run`` overrides them from
``[tool.flwr.app.config]`` in pyproject.toml (and ``--run-config``), a test from its own dict."""

from __future__ import annotations

import numpy as np
import torch

DEFAULTS = {
    "num-server-rounds": 3,
    "dataset": "fashion-mnist",  # or "synthetic": random class-coloured images (tests, no data needed)
    "examples-per-client": 2000,
    "test-examples": 2000,
    "dirichlet-alpha": 0.5,  # label skew of the shards (smaller: more skewed)
    "data-seed": 0,
    "hidden": 64,
    "layers": 4,
    "heads": 4,
    "patch": 7,
    "image-size": 28,
    "init-seed": 0,
    "local-steps": 50,
    "batch-size": 64,
    "lr": 1e-3,
    "align": "heads,attn,ffn,rescale",  # symmerge symmetries ("none": plain FedAvg with the checks)
    "aggregation": "mean",  # mean | median | trimmed_mean
    "trim": 0.2,
    "norm-factor": 10.0,  # 0: no update-norm rule
    "norm-clip": False,  # a client caught by the norm rule: kept, its update scaled to the others' median norm
    "outlier-rule": "none",  # none | distance | cosine | krum: outliers among the aligned updates left out;
    # consensus: clients whose predictions on the server's images disagree with the others' left out
    "outlier-threshold": 3.5,  # robust z-score beyond which the outlier rule leaves a client out
    "server-images": 1000,  # outlier-rule "consensus": unlabeled training images held by the server
    "min-align-gain": 0.05,  # a client whose alignment lowers its distance to the global model by less: unaligned
    "min-clients": 2,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
    "attack-partition": -1,  # a partition that misbehaves (demonstrates the server's checks; -1: none)
    "attack": "scale100",  # scale100: sends global + 100 x its update; nan: sends NaN weights; flip: trains on 9 - y
    "attack-round": 1,  # first round the attacker misbehaves in
}


def settings(*configs) -> dict:
    """:data:`DEFAULTS` updated by each of ``configs`` (unknown keys are an error: a typo is not ignored; a value of
    another kind than its default's is one error naming the setting: ``float('x')`` deep in the server app said
    neither which setting nor where it came from)."""
    out = dict(DEFAULTS)
    for c in configs:
        unknown = set(c or {}) - set(DEFAULTS)
        if unknown:
            raise KeyError(f"unknown fedvit setting(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        for key, value in (c or {}).items():
            _check_kind(key, value)
        out.update(c or {})
    return out


def _check_kind(key: str, value) -> None:
    """``value`` of the kind of ``key``'s default: a whole number, a number or a string (a switch's value is
    checked by symmerge's options, which refuse a string such as 'false')."""
    default = DEFAULTS[key]
    if isinstance(default, bool):
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int) and not (number and float(value).is_integer()):
        raise ValueError(f"fedvit setting {key!r} must be a whole number, got {value!r}")
    if isinstance(default, float) and not number:
        raise ValueError(f"fedvit setting {key!r} must be a number, got {value!r}")
    if isinstance(default, str) and not isinstance(value, str):
        raise ValueError(f"fedvit setting {key!r} must be a string, got {value!r}")


def load_model(cfg: dict):
    """A fresh ``ViTForImageClassification`` (10 classes, 1 channel), initialised from ``init-seed``."""
    from transformers import ViTForImageClassification

    from symmerge.demo.train import vit_config

    config = vit_config(hidden=int(cfg["hidden"]), layers=int(cfg["layers"]), heads=int(cfg["heads"]),
                        patch=int(cfg["patch"]), image_size=int(cfg["image-size"]))
    torch.manual_seed(int(cfg["init-seed"]))
    return ViTForImageClassification(config).float().eval()


def _synthetic(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    base = np.random.default_rng(1234).uniform(0, 255, (10, size, size))  # one pattern per class
    images = np.clip(base[labels] + rng.normal(0, 60, (n, size, size)), 0, 255).astype(np.uint8)
    return images, labels.astype(np.int64)


def _dataset(cfg: dict, split: str) -> tuple[np.ndarray, np.ndarray]:
    if cfg["dataset"] == "synthetic":
        n = 6000 if split == "train" else 1000
        return _synthetic(n, int(cfg["image-size"]), 0 if split == "train" else 1)
    if cfg["dataset"] != "fashion-mnist":
        raise ValueError(f"unknown dataset {cfg['dataset']!r}; choose fashion-mnist or synthetic")
    from symmerge.demo.datasets import fashion_mnist

    return fashion_mnist(split)


def dirichlet_shards(labels: np.ndarray, num_partitions: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Indices of ``num_partitions`` label-skewed shards: each class split by Dirichlet(``alpha``) shares."""
    rng = np.random.default_rng(seed)
    shards: list[list[int]] = [[] for _ in range(num_partitions)]
    for c in range(int(labels.max()) + 1):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet([alpha] * num_partitions)) * len(idx)).astype(int)[:-1]
        for shard, part in zip(shards, np.split(idx, cuts)):
            shard.extend(part.tolist())
    return [rng.permutation(np.asarray(s, dtype=np.int64)) for s in shards]


def load_partition(partition_id: int, num_partitions: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition_id``'s shard: at most ``examples-per-client`` images (normalised) and labels."""
    from symmerge.demo.datasets import pixel_values

    images, labels = _dataset(cfg, "train")
    idx = dirichlet_shards(labels, num_partitions, float(cfg["dirichlet-alpha"]), int(cfg["data-seed"]))[partition_id]
    idx = idx[: int(cfg["examples-per-client"])]
    return torch.from_numpy(pixel_values(images[idx])), torch.from_numpy(labels[idx])


def server_images(cfg: dict):
    """The server's unlabeled data for the consensus outlier rule: ``server-images`` training images
    picked at random (from ``data-seed``), their labels dropped, as a :class:`symmerge.io.data.Data`."""
    from symmerge.demo.datasets import pixel_values
    from symmerge.io.data import Batch, Data

    images, _ = _dataset(cfg, "train")
    pick = np.random.default_rng(int(cfg["data-seed"]) + 1).choice(len(images), int(cfg["server-images"]),
                                                                   replace=False)
    x = torch.from_numpy(pixel_values(images[pick]))
    return Data("server images", "image", [Batch({"pixel_values": x[i:i + 250]}, None) for i in range(0, len(x), 250)],
                len(x), labeled=False)


def load_test(cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    images, labels = _dataset(cfg, "test")
    return images[: int(cfg["test-examples"])], labels[: int(cfg["test-examples"])]


def train(model, x: torch.Tensor, y: torch.Tensor, cfg: dict, seed: int = 0, device=None) -> float:
    """``local-steps`` of Adam on random batches; returns the mean training loss. ``device`` (e.g.
    ``"cuda"``): the steps run there (the batches are drawn as on the CPU, from the same generator) and the
    model is moved back to the CPU afterwards; None: where the model is."""
    if len(x) == 0:
        return float("nan")
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device) if device is not None else None
    if dev is not None:
        model.to(dev)
        x, y = x.to(dev), y.to(dev)
    on_gpu = dev is not None and dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg["lr"]), weight_decay=0.0, fused=on_gpu or None)
    model.train()
    total = torch.zeros((), dtype=torch.float64, device=x.device)  # summed where the loss is: no sync per step
    for _ in range(int(cfg["local-steps"])):
        idx = torch.randint(0, len(x), (min(int(cfg["batch-size"]), len(x)),), generator=gen).to(x.device)
        loss = torch.nn.functional.cross_entropy(model(pixel_values=x[idx]).logits, y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.detach()
    model.eval()
    if dev is not None:
        model.to("cpu")
    return float(total) / int(cfg["local-steps"])


def evaluate(model, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(loss, accuracy) on uint8 images."""
    from symmerge.demo.train import accuracy

    return accuracy(model, images, labels)
