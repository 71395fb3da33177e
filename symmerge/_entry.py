"""The guard the package's ``__init__`` puts around its heavy imports (torch, transformers: seconds) when
it runs as the ``symmerge`` command: a Ctrl-C then ends with one line and exit 130, as it does once the
command runs (:mod:`symmerge.cli`), not with a traceback through the import machinery. Imported as a
library, an interrupt propagates as usual."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

_interrupted = False


def _on_sigint(signum, frame):
    """Python's own behaviour (raise KeyboardInterrupt), remembered: an import that a Ctrl-C cut in half can
    surface later as another error (a half-imported numpy.dtypes becomes a RecursionError, then transformers'
    ModuleNotFoundError), which the command then reports as the interrupt it was."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def watch_interrupts() -> None:
    """As the command: remember a Ctrl-C (:func:`was_interrupted`) while keeping its KeyboardInterrupt. Only from
    the main thread, and only where Python's default handler is installed (a host's own handler is kept)."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def was_interrupted() -> bool:
    """Whether a Ctrl-C reached this process since :func:`watch_interrupts`."""
    return _interrupted


def interrupted_exit() -> None:
    """One line and exit 130, running nothing half-imported's exit hooks."""
    try:
        sys.stderr.write("symmerge: interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(130)


def running_as_command() -> bool:
    """Whether this process is the ``symmerge`` console script or ``python -m symmerge.cli``."""
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("symmerge", "symmerge.exe"):
        return True
    argv = list(getattr(sys, "orig_argv", []) or [])
    return any(a == "-m" and i + 1 < len(argv) and argv[i + 1] in ("symmerge.cli", "symmerge")
               for i, a in enumerate(argv))


@contextlib.contextmanager
def guarded_imports():
    command = running_as_command()
    if command:
        watch_interrupts()
    try:
        yield
    except KeyboardInterrupt:
        if not command:
            raise
        interrupted_exit()
    except Exception:
        if command and was_interrupted():  # an import the Ctrl-C cut in half, failing as something else
            interrupted_exit()
        raise
