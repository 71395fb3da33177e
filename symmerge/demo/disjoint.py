"""Two ViTs trained apart: each on a disjoint half of the classes (issue 42 item 5).

Model A sees only the images of classes ``0..4``, model B only those of ``5..9``; both have a 10-way
head (the output layer covers every class, each model only ever saw its half) and start from different
seeds. :func:`class_subset` selects the images of some classes; :func:`train_disjoint_pair` trains (or
reuses from the cache, keyed like every trained ViT by the hash of the config, data, seed and settings)
the two models with :func:`~symmerge.demo.train.train_vit` and returns their folders.

:data:`RECIPE` is the B1 architecture (hidden 128, 6 layers, 4 heads, FFN 256, patch 7) with a shorter
schedule: 1 500 steps of 128 images (6.4 epochs of a 30 000-image half), measured at ~0.14 s/step on
one CPU thread, so the pair costs a few minutes per model instead of B1's 5 000 steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SymmergeError
from .datasets import FASHION_CLASSES, fashion_mnist
from .train import TrainSettings, train_vit, vit_config

HALVES = ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))  # the classes model A, model B train on


@dataclass(frozen=True)
class DisjointRecipe:
    hidden: int = 128
    layers: int = 6
    heads: int = 4
    intermediate: int = 256
    patch: int = 7
    steps: int = 1500
    batch_size: int = 128
    lr: float = 1e-3
    seeds: tuple[int, int] = (0, 1)
    halves: tuple = HALVES  # the classes model A, model B train on

    def config(self):
        return vit_config(self.hidden, self.layers, self.heads, self.intermediate, self.patch,
                          labels=FASHION_CLASSES)

    def settings(self, seed: int) -> TrainSettings:
        return TrainSettings(steps=self.steps, batch_size=self.batch_size, lr=self.lr, seed=seed)


RECIPE = DisjointRecipe()
TINY = DisjointRecipe(hidden=16, layers=1, heads=2, intermediate=32, steps=30, batch_size=64)


def class_subset(images: np.ndarray, labels: np.ndarray, classes) -> tuple[np.ndarray, np.ndarray]:
    """The images (and labels) whose label is in ``classes``, in their original order."""
    labels = np.asarray(labels)
    classes = np.asarray(sorted(set(int(c) for c in classes)), dtype=labels.dtype)
    if len(classes) == 0:
        raise SymmergeError("class_subset needs at least one class")
    keep = np.isin(labels, classes)
    if not keep.any():
        raise SymmergeError(f"no example has a label in {classes.tolist()}")
    return np.asarray(images)[keep], labels[keep]


def train_disjoint_pair(recipe: DisjointRecipe = RECIPE, images=None, labels=None, eval_images=None,
                        eval_labels=None, train_examples: int | None = None, root=None,
                        log=print, progress: bool = True, only: str | None = None) -> list[Path]:
    """Train (or reuse) model A on the classes ``recipe.halves[0]`` and model B on ``recipe.halves[1]`` of the
    training images (Fashion-MNIST's 60 000 by default; the first ``train_examples`` of them when given),
    from ``recipe.seeds``. Each is scored after training on the test images of its own half. Returns
    the two cached folders (``only="A"`` or ``"B"``: train or find that one alone, and return it alone)."""
    if images is None:
        images, labels = fashion_mnist("train")
        eval_images, eval_labels = fashion_mnist("test")
    if train_examples:
        images, labels = images[:train_examples], labels[:train_examples]
    halves = recipe.halves
    if set(halves[0]) & set(halves[1]):
        raise SymmergeError(f"the halves {list(halves[0])} and {list(halves[1])} overlap")
    config = recipe.config()
    folders = []
    for name, classes, seed in zip("AB", halves, recipe.seeds):
        if only not in (None, name):
            continue
        x, y = class_subset(images, labels, classes)
        ex, ey = (None, None) if eval_images is None else class_subset(eval_images, eval_labels, classes)
        tag = "-".join(str(c) for c in sorted(classes))
        folders.append(train_vit(config, x, y, recipe.settings(seed), name=f"fmnist-classes{tag}-{name}",
                                 eval_images=ex, eval_labels=ey, root=root, log=log, progress=progress))
    return folders
