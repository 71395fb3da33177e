"""The flag ``merge``, ``align``, ``barrier`` and ``run`` share for code shipped in model folders
(mergekit's name for it): off by default, a folder that needs its own code is refused in one line."""

from __future__ import annotations


def add_trust_remote_code(parser) -> None:
    import argparse

    parser.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                        help="let transformers import Python code shipped in a model or tokenizer folder (auto_map "
                             "in config.json): only for folders you trust. Without it such a folder is refused; "
                             "symmerge never runs a folder's code otherwise (see SECURITY.md)")
