"""``symmerge.cli.main([...])`` called inside someone else's process (a notebook, a service, a training script)
leaves that process as it found it: its signal handlers (benchmarks/procstate_audit.py,
docs/results/procstate_audit.md)."""

from __future__ import annotations

import signal

import pytest

from conftest import run_cli

SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


def _handlers() -> dict:
    return {s: signal.getsignal(s) for s in SIGNALS}


@pytest.mark.parametrize("argv", [["specs"], ["align", "/nonexistent/a", "/nonexistent/b", "-o", "/nonexistent/o"]],
                         ids=["ok", "error"])
def test_main_puts_the_callers_signal_handlers_back(argv, capsys):
    """The command turns SIGTERM and SIGHUP into a clean-up and an exit line while it runs; after it, a SIGTERM to the
    caller's process (a service's) ends it as it did before (the handlers stayed symmerge's: a later SIGTERM raised
    ``Terminated`` inside the caller's code), and a host's own handler is untouched."""
    saved = _handlers()
    try:
        for s in SIGNALS:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        before = _handlers()
        run_cli(*argv)
        assert _handlers() == before

        def host(signum, frame):  # a host's own handler: kept during the command and after it
            pass

        signal.signal(signal.SIGTERM, host)
        run_cli(*argv)
        assert signal.getsignal(signal.SIGTERM) is host
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    capsys.readouterr()
