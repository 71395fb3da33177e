"""The alignment flags ``align``, ``merge``, ``barrier`` and ``moe`` share (how scales are solved, which
residual group, untying, the coordinate-descent cap, what the elements are fitted to, the unlabeled data, the
learned alignment's settings, ``--workers``, ``--allow-tokenizer-mismatch``, ``--repair``): generated from
their declarations (:mod:`symmerge.options.declared`, the ``alignment`` and ``repair`` parts); the options
object they make: :func:`symmerge.options.build.align_options`."""

from __future__ import annotations

from ..options.build import align_options as alignment_options, learn_settings
from ..options.declared import ALIGNMENT, LEARN_FLAGS, REPAIR
from .schema_args import add_part

__all__ = ["add_alignment_arguments", "alignment_options", "learn_settings", "LEARN_FLAGS"]


def add_alignment_arguments(parser, repair: bool = True) -> None:
    add_part(parser, ALIGNMENT)
    if repair:
        add_part(parser, REPAIR)
