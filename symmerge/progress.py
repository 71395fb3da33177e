"""Progress reporting, in one place for every long step (loading, solving, statistics, evaluation,
interpolation, training, streaming), on stderr.

Four modes (``--progress`` on every long command; :func:`configure`):

* ``bar``: tqdm bars (also when stderr is not a terminal);
* ``lines``: plain lines that read well in a log or a pipe — one line when a stage ends, with its
  counts and its own duration, prefixed by the time since the command started::

      [12.3 s] fisher statistics: 500/500 examples (108.2 s)

  and, for a stage still running after :data:`HEARTBEAT` seconds, an interim line of the same form
  at most every :data:`HEARTBEAT` seconds (``... 120/500 examples (30.0 s so far)``);
* ``none``: nothing;
* ``auto`` (default): ``bar`` when stderr is a terminal, ``lines`` otherwise.

Library code asks for a :func:`bar` (a loop with a count) or a :func:`stage` (a step without one);
both follow the configured mode. ``enabled=False`` (a function's ``progress=False``) silences one.
"""

from __future__ import annotations

import contextlib
import sys
import time

MODES = ("auto", "bar", "lines", "none")
HEARTBEAT = 30.0  # lines mode: seconds between interim lines of a running stage

_state = {"mode": "auto", "start": time.perf_counter(), "stream": None, "heartbeat": HEARTBEAT}


def configure(mode: str = "auto", stream=None, heartbeat: float | None = None) -> None:
    """Choose the mode (one of :data:`MODES`) and restart the command clock (the ``[t]`` of lines)."""
    from .errors import SymmergeError

    if mode not in MODES:
        raise SymmergeError(f"unknown progress mode {mode!r}; choose one of {', '.join(MODES)}")
    _state.update(mode=mode, start=time.perf_counter(), stream=stream,
                  heartbeat=HEARTBEAT if heartbeat is None else heartbeat)


def elapsed() -> float:
    """Seconds since the command started (since the last :func:`configure`)."""
    return time.perf_counter() - _state["start"]


def _stream():
    return _state["stream"] or sys.stderr


def mode() -> str:
    """The effective mode: ``bar``, ``lines`` or ``none`` (``auto`` resolved against stderr)."""
    m = _state["mode"]
    if m != "auto":
        return m
    isatty = getattr(_stream(), "isatty", None)
    return "bar" if isatty is not None and isatty() else "lines"


def line(message: str) -> None:
    """One progress line (lines mode only): ``[t] message``."""
    if mode() == "lines":
        print(f"[{elapsed():.1f} s] {message}", file=_stream(), flush=True)


def _count(n, total, unit: str) -> str:
    n = int(n) if float(n).is_integer() else n
    units = f" {unit}" if unit else ""
    return f"{n}/{total}{units}" if total is not None else f"{n}{units}"


class LineBar:
    """The ``lines`` mode's stand-in for a tqdm bar: the same calls (iteration, ``update``,
    ``set_postfix``/``set_postfix_str``, ``close``, context manager); one line when it closes, interim
    lines for a long stage."""

    def __init__(self, iterable=None, desc: str = "", total=None, unit: str = "", **_):
        self.iterable, self.desc, self.unit = iterable, desc or "working", "" if unit == "it" else unit
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.n, self.postfix = total, 0, ""
        self.t0 = self.last = time.perf_counter()
        self.closed = False

    def _text(self, seconds: float, running: bool) -> str:
        extra = f", {self.postfix}" if self.postfix else ""
        when = f"{seconds:.1f} s so far" if running else f"{seconds:.1f} s"
        return f"{self.desc}: {_count(self.n, self.total, self.unit)}{extra} ({when})"

    def update(self, n=1) -> None:
        self.n += n
        now = time.perf_counter()
        done = self.total is not None and self.n >= self.total  # close() says it
        if not done and now - self.last >= _state["heartbeat"]:
            self.last = now
            line(self._text(now - self.t0, running=True))

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = dict(ordered_dict or {}, **kwargs)
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            line(self._text(time.perf_counter() - self.t0, running=False))

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self):
        return self.total or 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _Silent(LineBar):
    def update(self, n=1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


def bar(iterable=None, enabled: bool = True, **kwargs):
    """A progress bar for a loop with a count, in the configured mode: a tqdm bar, a :class:`LineBar`,
    or a silent stand-in (mode ``none``, ``enabled=False`` or ``disable=True``). Takes tqdm's keywords
    (``desc``, ``total``, ``unit``...)."""
    disable = kwargs.pop("disable", None)
    m = mode()
    if not enabled or disable is True or m == "none":
        return _Silent(iterable, **kwargs)
    if m == "lines":
        return LineBar(iterable, **kwargs)
    from tqdm.auto import tqdm

    kwargs.setdefault("file", _stream())
    kwargs.setdefault("leave", False)
    return tqdm(iterable, disable=False, **kwargs)


@contextlib.contextmanager
def stage(desc: str, enabled: bool = True):
    """A step without a count (loading, verifying, writing): in lines mode one line when it ends,
    ``[t] desc (seconds)``; nothing in the other modes."""
    t0 = time.perf_counter()
    yield
    if enabled:
        line(f"{desc} ({time.perf_counter() - t0:.1f} s)")


LINE_EVERY = 5.0  # seconds between two lines of a stage_printer in lines mode


def stage_printer(total: int | None = None, desc: str = "solving"):
    """A callback ``progress(stage_name)`` for the solver engine, called after each group is solved
    (and after each coordinate-descent sweep): a bar ticking once per call, or in lines mode a line
    for the first call and then at most one every :data:`LINE_EVERY` seconds, with the seconds and
    the calls since the previous line (the first: since ``progress.start()``, which the caller calls
    when solving begins, else since the callback was made)."""
    if mode() == "lines":
        last, calls = [time.perf_counter(), None], [0]

        def progress_line(name: str) -> None:
            now = time.perf_counter()
            calls[0] += 1
            if last[1] is not None and now - last[1] < LINE_EVERY:  # at most one line every LINE_EVERY s
                return
            steps = f", {calls[0]} steps" if calls[0] > 1 else ""
            line(f"{desc}: {name} ({now - last[0]:.1f} s{steps})")
            last[0], last[1], calls[0] = now, now, 0

        progress_line.start = lambda: last.__setitem__(0, time.perf_counter())
        return progress_line
    pbar = bar(total=total, desc=desc, unit="group")

    def progress(name: str) -> None:
        pbar.set_postfix_str(name)
        pbar.update(1)

    return progress


def add_argument(parser) -> None:
    """The ``--progress`` option of the long commands."""
    parser.add_argument("--progress", choices=MODES, default="auto",
                        help="how progress is shown on stderr: auto (default: bars on a terminal, plain lines "
                             "otherwise, e.g. in a log or a pipe), bar, lines (one line per stage with counts "
                             "and seconds) or none")
