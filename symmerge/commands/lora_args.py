"""The flags of LoRA inputs (``BASE+ADAPTER``), declared once for every command that takes models: mergekit's
``--lora-merge-cache`` and ``--lora-merge-dtype`` (:func:`symmerge.io.lora.merge_cache`)."""

from __future__ import annotations


def add_lora_arguments(parser) -> None:
    parser.add_argument("--lora-merge-cache", default=None, metavar="DIR",
                        help="merge models given as BASE+ADAPTER (a PEFT LoRA adapter) into DIR and reuse them on a "
                             "later run (as mergekit; default: a temporary folder removed at exit)")
    parser.add_argument("--lora-merge-dtype", default=None, metavar="DTYPE",
                        help="dtype of the models merged from BASE+ADAPTER inputs (default: the base's)")
