"""Helpers of the file-based learned alignment's tests (align --stream and merge --mode stream with --match
learned): a pair of small models saved with a tokenizer beside a file of unlabeled lines, a folder's tensors, its
files' digests."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import write_tokenizer
from factories import make_model

LINES = ["the cat sat on the mat", "a dog ran fast", "the dog sat on a cat", "slow cat ran on the mat"] * 4


def save_pair(tmp_path: Path, family: str, tied: bool = False):
    """Two models of ``family`` (seeds 0 and 3) saved to ``tmp_path``/a and /b with a tokenizer, and ``LINES`` to
    ``tmp_path``/lines.txt; ``(model a, the lines' path)``."""
    models = []
    for seed, name in ((0, "a"), (3, "b")):
        model = make_model(family, head=True, seed=seed, dtype=torch.float32, tied=tied).eval()
        model.save_pretrained(tmp_path / name)
        write_tokenizer(tmp_path / name)
        models.append(model)
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(LINES) + "\n")
    return models[0], lines


def tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}
