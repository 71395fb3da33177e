"""The guard the package's ``__init__`` puts around its heavy imports (torch, transformers: seconds) when
it runs as the ``symmerge`` command: a Ctrl-C then ends with one line and exit 130, as it does once the
command runs (:mod:`symmerge.cli`), not with a traceback through the import machinery. Imported as a
library, an interrupt propagates as usual."""

from __future__ import annotations

import contextlib
import os
import sys


def running_as_command() -> bool:
    """Whether this process is the ``symmerge`` console script or ``python -m symmerge.cli``."""
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("symmerge", "symmerge.exe"):
        return True
    argv = list(getattr(sys, "orig_argv", []) or [])
    return any(a == "-m" and i + 1 < len(argv) and argv[i + 1] in ("symmerge.cli", "symmerge")
               for i, a in enumerate(argv))


@contextlib.contextmanager
def guarded_imports():
    try:
        yield
    except KeyboardInterrupt:
        if not running_as_command():
            raise
        try:
            sys.stderr.write("symmerge: interrupted\n")
            sys.stderr.flush()
        finally:
            os._exit(130)  # nothing half-imported runs its exit hooks
