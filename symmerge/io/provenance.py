"""What every written report says about its making (``symmerge_report.json``, ``barrier.json``): the symmerge
version and the command line as the user gave it (``symmerge.cli.main`` records it; ``None`` when the report
comes from the Python API), so that a report is enough to reproduce its run."""

from __future__ import annotations

import contextvars
import math

from .._version import __version__

COMMAND_LINE: contextvars.ContextVar = contextvars.ContextVar("symmerge_command_line", default=None)
REPORT_FILES = ("symmerge_report.json", "barrier.json")


def stamp(report: dict) -> dict:
    """``report`` with ``symmerge_version`` and ``command_line`` (kept where already set), in place."""
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
