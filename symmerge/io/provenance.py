"""What every written report says about its making (``symmerge_report.json``, ``barrier.json``): the symmerge
version and the command line as the user gave it (``symmerge.cli.main`` records it; ``None`` when the report
comes from the Python API), so that a report is enough to reproduce its run; and its inputs as the user named them
(a ``BASE+ADAPTER`` input, not the folder it was merged into: :func:`remember`)."""

from __future__ import annotations

import contextvars
import math
import os
import re

from .._version import __version__

COMMAND_LINE: contextvars.ContextVar = contextvars.ContextVar("symmerge_command_line", default=None)
REPORT_FILES = ("symmerge_report.json", "barrier.json")


_written_as: dict[str, str] = {}  # a folder the user never named (a BASE+ADAPTER's merged folder) -> the input named


def remember(folder, named: str) -> None:
    """``folder`` (a path this process made from an input, :func:`symmerge.io.lora.resolve_input`) stands for the
    input the user wrote as ``named``: a report names ``named`` wherever it would name ``folder``."""
    _written_as[str(folder)] = str(named)
    _written_as.setdefault(os.path.realpath(folder), str(named))


def named_as(folder) -> str | None:
    """The input, as the user wrote it, that ``folder`` (a path :func:`remember` was told of, or the same folder by
    another spelling) stands for, else None: what a message names instead of a folder the user never named."""
    if not isinstance(folder, (str, os.PathLike)):
        return None
    return _written_as.get(str(folder)) or _written_as.get(os.path.realpath(folder))


def _whole_paths(folder: str) -> re.Pattern:
    # the folder as a whole path: not the start of a longer name (``…/base+ad-9ef6`` in ``…/base+ad-9ef6x``), nor the
    # tail of one (``/tmp/m`` in ``/tmp/m/x`` is whole, in ``/tmp/mx`` or ``/a/tmp/m`` it is not)
    return re.compile(r"(?<![\w./+-])" + re.escape(folder) + r"(?![\w+-])(?!\.\w)")


def _as_written(obj):
    if isinstance(obj, str):
        for folder in sorted(_written_as, key=len, reverse=True):
            if folder in obj:
                obj = _whole_paths(folder).sub(lambda _m, f=folder: _written_as[f], obj)
        return obj
    if isinstance(obj, dict):
        return {_as_written(k): _as_written(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_written(v) for v in obj]
    return obj


def stamp(report: dict) -> dict:
    """``report`` with ``symmerge_version`` and ``command_line`` (kept where already set) and every input named as
    the user wrote it, in place."""
    if _written_as:
        named = _as_written(dict(report))
        report.clear()
        report.update(named)
    report.setdefault("symmerge_version", __version__)
    line = COMMAND_LINE.get()
    report.setdefault("command_line", list(line) if line is not None else None)
    return report


def finite(obj):
    """``obj`` with every float that is not finite (NaN, ±Infinity) as ``None``: strict JSON has no such numbers,
    and ``json.dumps`` would write the non-standard ``NaN`` / ``Infinity`` that strict readers refuse."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
