"""The guard the package's ``__init__`` puts around its heavy imports (torch, transformers: seconds) when
it runs as the ``symmerge`` command: a Ctrl-C then ends with one line and exit 130, as it does once the
command runs (:mod:`symmerge.cli`), not with a traceback through the import machinery. Imported as a
library, an interrupt propagates as usual."""

from __future__ import annotations

import contextlib
import gc
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


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread is, as a Ctrl-C is: every ``finally`` and every
    temporary folder's cleanup runs (:func:`symmerge.io.model.atomic_dir`); the command then says so in one
    line and exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _on_termination(signum, frame):
    global _interrupted
    _interrupted = True
    raise Terminated(signum)


def watch_interrupts() -> dict:
    """As the command: remember a Ctrl-C (:func:`was_interrupted`) while keeping its KeyboardInterrupt, and
    turn SIGTERM and SIGHUP into :class:`Terminated` (their default would end the process at once, leaving
    its temporary folder). Only from the main thread, and only where Python's default handlers are installed
    (a host's own handlers are kept). A new command starts uninterrupted: an earlier command's Ctrl-C or SIGTERM in
    the same process (``main`` called again by a caller) made every later error read as "interrupted". Returns the
    handlers it replaced, for :func:`restore_interrupts` when the command ends."""
    global _interrupted
    _interrupted = False
    replaced = {}
    if threading.current_thread() is not threading.main_thread():
        return replaced
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        replaced[signal.SIGINT] = signal.signal(signal.SIGINT, _on_sigint)
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
            replaced[sig] = signal.signal(sig, _on_termination)
    return replaced


def restore_interrupts(replaced: dict) -> None:
    """The handlers :func:`watch_interrupts` replaced, put back: ``main`` called in a caller's process (a service's,
    a notebook's) leaves its SIGTERM ending it as before, not raising :class:`Terminated` in its own code later."""
    if threading.current_thread() is threading.main_thread():
        for sig, handler in replaced.items():
            signal.signal(sig, handler)


def was_interrupted() -> bool:
    """Whether a Ctrl-C reached this process since :func:`watch_interrupts`."""
    return _interrupted


def interrupted_exit(signum: int | None = None) -> None:
    """One line and exit 130 (128 + ``signum`` for SIGTERM, SIGHUP), running nothing half-imported's exit
    hooks."""
    try:
        sys.stderr.write(interrupted_line(signum) + "\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + (signum or signal.SIGINT))


def interrupted_line(signum: int | None = None) -> str:
    if signum is None or signum == signal.SIGINT:
        return "symmerge: interrupted"
    return f"symmerge: terminated ({signal.Signals(signum).name}); nothing was written"


def running_as_command() -> bool:
    """Whether this process is the ``symmerge`` (or ``symmerge-yaml``) console script or ``python -m
    symmerge.cli``."""
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("symmerge", "symmerge.exe", "symmerge-yaml",
                                                            "symmerge-yaml.exe"):
        return True
    argv = list(getattr(sys, "orig_argv", []) or [])
    return any(a == "-m" and i + 1 < len(argv) and argv[i + 1] in ("symmerge.cli", "symmerge")
               for i, a in enumerate(argv))


@contextlib.contextmanager
def collector_paused():
    """The command's start-up without the cyclic garbage collector: importing torch, numba and symmerge makes
    about a million objects that live until the process ends, and the collections their allocation sets off
    (each full one walks all of them) were a fifth of a tiny ``symmerge run``'s CPU time (1.76–1.94 s of user
    time against 1.46–1.51 s: docs/results/bench_configs.md, ``benchmarks/bench_startup.py``). On leaving, the
    objects made so far are frozen (:func:`gc.freeze`: kept out of every later collection, as they would
    survive each one anyway) and the collector runs again as before. Nothing is paused where it was off
    already (a host's choice)."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.freeze()
            gc.enable()


_DEFERRED = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


@contextlib.contextmanager
def signals_deferred():
    """The command's imports with SIGINT, SIGTERM and SIGHUP blocked, so a Ctrl-C never lands inside an extension
    module's initialisation (torch's, in C++: a KeyboardInterrupt raised there aborts the process, exit -6, with a
    C++ message instead of one line); a signal that arrived meanwhile is taken when the outermost block ends, and
    the command then says so in one line (:func:`interrupted_exit`). Threads started during the imports keep the
    signals blocked, so they reach the main thread, which handles them. Nothing is blocked off the main thread or
    where the platform has no ``pthread_sigmask``."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)
    try:
        yield
    finally:
        if signal.SIGINT in before:  # a block further out takes the signals
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        else:
            pending = [s for s in _DEFERRED if s in signal.sigpending()
                       and signal.getsignal(s) not in (signal.SIG_IGN, None)]
            signal.pthread_sigmask(signal.SIG_SETMASK, before)  # any pending signal is delivered now
            if pending:  # (the handler may have raised already: guarded_imports then ends the same way)
                interrupted_exit(None if pending[0] == signal.SIGINT else pending[0])


@contextlib.contextmanager
def guarded_imports():
    command = running_as_command()
    if command:
        watch_interrupts()
    try:
        with collector_paused() if command else contextlib.nullcontext(), \
                signals_deferred() if command else contextlib.nullcontext():
            yield
    except KeyboardInterrupt as e:
        if not command:
            raise
        interrupted_exit(getattr(e, "signum", None))
    except Exception as e:
        if command and was_interrupted():  # an import the Ctrl-C cut in half, failing as something else
            interrupted_exit()
        if command:
            _start_failed(e)
        raise


def _start_failed(e: BaseException) -> None:
    """Under a memory limit too small to load torch, numpy and their libraries (``ulimit -v``: the system refuses to
    map a library, "libtorch_cpu.so: failed to map segment from shared object", an ``ImportError`` of 14 to 54
    traceback lines): one ``symmerge: error:`` line and exit 2, running nothing half-imported's exit hooks. Any other
    error is left to propagate."""
    from .io.output import memory_fault

    words = memory_fault(e)
    if words is None:
        return
    try:
        sys.stderr.write(f"symmerge: error: {words} while starting (loading torch and numpy); nothing was written; "
                         "raise the memory limit (ulimit -v, ulimit -d) or free memory\n")
        sys.stderr.flush()
    finally:
        os._exit(2)
