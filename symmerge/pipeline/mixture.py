"""The mixture weights of the joint learned alignment of N models, shared by the one-sided path
(:mod:`symmerge.pipeline.learn_joint`) and the dual frame (:mod:`symmerge.pipeline.dual`): the weights one training
step draws, and the fixed weights the objective is checked at. ``concentration``: ``LearnSettings.dirichlet`` once
chosen (a number, or :data:`~symmerge.pipeline.options.DIRICHLET_UNIFORM`: every step at the plain average)."""

from __future__ import annotations

import numpy as np
import torch

from .options import DIRICHLET_UNIFORM


def check_points(n: int, concentration=None) -> list[torch.Tensor]:
    """The fixed mixture weights a joint learning's objective is checked at: the uniform average, and for every
    model the point halfway between it and the uniform average (for N = 2: α = ½, ¾, ¼); the uniform average
    alone when every step trains there (``concentration`` :data:`~symmerge.pipeline.options.DIRICHLET_UNIFORM`)."""
    uniform = torch.full((n,), 1.0 / n, dtype=torch.float32)  # float32 whatever the caller's default dtype
    if concentration == DIRICHLET_UNIFORM:
        return [uniform]
    return [uniform] + [0.5 * uniform + 0.5 * torch.eye(n, dtype=torch.float32)[i] for i in range(n)]


def mixture_weights(n: int, concentration, rng) -> torch.Tensor:
    """One joint learning step's weights of the N models: a draw of Dirichlet(``concentration``, …) from the
    numpy generator ``rng``, or exactly 1/N each for :data:`~symmerge.pipeline.options.DIRICHLET_UNIFORM` (no
    draw)."""
    if concentration == DIRICHLET_UNIFORM:
        return torch.full((n,), 1.0 / n, dtype=torch.float32)
    return torch.as_tensor(rng.dirichlet(np.full(n, float(concentration))), dtype=torch.float32)
