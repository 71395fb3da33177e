"""The flag ``merge``, ``align``, ``barrier``, ``run`` and ``moe`` share for code shipped in model folders
(mergekit's name for it, declared in :mod:`symmerge.options.declared`): off by default, a folder that needs
its own code is refused in one line."""

from __future__ import annotations

from ..options.declared import TABLE
from .schema_args import add_option


def add_trust_remote_code(parser) -> None:
    add_option(parser, TABLE.get("run", "trust_remote_code"))
