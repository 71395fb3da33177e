"""Progress reporting: tqdm bars on stderr for long loops."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def bar(iterable=None, **kwargs):
    """A tqdm bar on stderr, hidden when stderr is not a terminal unless forced."""
    kwargs.setdefault("disable", None)  # None: auto-disable on non-TTY
    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("leave", False)
    return tqdm(iterable, **kwargs)


def stage_printer(total: int | None = None, desc: str = "solving"):
    """A callback ``progress(stage_name)`` that advances a bar, one tick per solved group kind."""
    pbar = bar(total=total, desc=desc, unit="group")

    def progress(name: str) -> None:
        pbar.set_postfix_str(name)
        pbar.update(1)

    return progress
