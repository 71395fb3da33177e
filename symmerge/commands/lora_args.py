"""The flags of LoRA inputs (``BASE+ADAPTER``) for every command that takes models: mergekit's
``--lora-merge-cache`` and ``--lora-merge-dtype`` (:func:`symmerge.io.lora.merge_cache`), declared in
:mod:`symmerge.options.declared`."""

from __future__ import annotations

from .schema_args import add_part


def add_lora_arguments(parser) -> None:
    add_part(parser, "lora")
