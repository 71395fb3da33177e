"""Progress reporting, in one place for every long step (loading, solving, statistics, evaluation,
interpolation, training, streaming), on stderr.

Four modes (``--progress`` on every long command; :func:`configure`):

* ``bar``: tqdm bars (also when stderr is not a terminal);
* ``lines``: plain lines that read well in a log or a pipe — one line when a stage ends, with its
  counts and its own duration, prefixed by the time since the command started::

      [12.3 s] fisher statistics: 500/500 examples (108.2 s)

  and, while a stage or a bar runs, never more than :data:`HEARTBEAT` seconds without a line: a bar
  whose count moves prints an interim line of the same form (``... 120/500 examples (30.0 s so far)``),
  and a daemon thread prints a heartbeat for whatever is still running when nothing else has been
  printed for :data:`HEARTBEAT` seconds — a stage (``[42.0 s] loading m1 (30.0 s so far)``), a bar whose
  one step is long, a solver between two groups;
* ``none``: nothing;
* ``auto`` (default): ``bar`` when stderr is a terminal, ``lines`` otherwise.

Library code asks for a :func:`bar` (a loop with a count) or a :func:`stage` (a step without one);
both follow the configured mode. ``enabled=False`` (a function's ``progress=False``) silences one.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref

MODES = ("auto", "bar", "lines", "none")
HEARTBEAT = 30.0  # lines mode: seconds between interim lines of a running stage

_state = {"mode": "auto", "start": time.perf_counter(), "stream": None, "heartbeat": HEARTBEAT,
          "last_line": time.perf_counter()}
_lock = threading.RLock()  # one line at a time, from the command's threads and the heartbeat's


def configure(mode: str = "auto", stream=None, heartbeat: float | None = None) -> None:
    """Choose the mode (one of :data:`MODES`) and restart the command clock (the ``[t]`` of lines)."""
    from .errors import SymmergeError

    if mode not in MODES:
        raise SymmergeError(f"unknown progress mode {mode!r}; choose one of {', '.join(MODES)}")
    with _lock:
        now = time.perf_counter()
        _state.update(mode=mode, start=now, stream=stream, last_line=now,
                      heartbeat=HEARTBEAT if heartbeat is None else heartbeat)
    _wake.set()


@contextlib.contextmanager
def kept():
    """The progress mode, stream and clock as they were before the block, restored after it: a command run in a
    caller's process (``symmerge.cli.main([...])``) leaves the caller's progress setting as it found it."""
    with _lock:
        saved = dict(_state)
    try:
        yield
    finally:
        with _lock:
            _state.update(saved)


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
        with _lock:
            print(f"[{elapsed():.1f} s] {message}", file=_stream(), flush=True)
            _state["last_line"] = time.perf_counter()


# ---------------------------------------------------------------- the heartbeat

# What is running now (innermost last): weak references to objects with ``t0`` and ``running_text(seconds)``
# — a stage, a LineBar, a solver's progress callback. A bar that is never closed is forgotten when it is
# garbage-collected, so it cannot keep the heartbeat going.
_running: list = []
_wake = threading.Event()
_thread: list = []

# a stage is named by what it has done when it ends ("loaded m1"); its heartbeat says what it is doing
_PRESENT = {"loaded": "loading", "aligned": "aligning", "verified": "verifying", "wrote": "writing",
            "merged": "merging", "read": "reading", "chose": "choosing", "generated": "generating",
            "computed": "computing", "copied": "copying", "trained": "training", "solved": "solving",
            "checked": "checking"}


def _present(desc: str) -> str:
    """``loaded and checked the data`` → ``loading and checking the data``: the leading verbs only."""
    words = desc.split(" ")
    if words[0] in _PRESENT:
        words[0] = _PRESENT[words[0]]
        if len(words) > 2 and words[1] == "and" and words[2] in _PRESENT:
            words[2] = _PRESENT[words[2]]
    return " ".join(words)


class _Running:
    """A stage (or a solver's callback) for the heartbeat: its description and start."""

    def __init__(self, desc: str):
        self.desc, self.t0 = desc, time.perf_counter()

    def running_text(self, seconds: float) -> str:
        return f"{_present(self.desc)} ({seconds:.1f} s so far)"


def _register(item) -> None:
    """``item`` runs from now until :func:`_unregister` (or until it is garbage-collected): the heartbeat
    speaks for it when nothing else is printed for the heartbeat interval (lines mode only)."""
    if mode() != "lines":
        return
    with _lock:
        _running.append(weakref.ref(item))
        if not _thread or not _thread[0].is_alive():
            t = threading.Thread(target=_beat, name="symmerge-progress-heartbeat", daemon=True)
            _thread[:] = [t]
            t.start()
    _wake.set()


def _unregister(item) -> None:
    with _lock:
        _running[:] = [r for r in _running if r() is not None and r() is not item]


def _innermost():
    """The innermost running item still alive, or None (dead references dropped)."""
    with _lock:
        _running[:] = [r for r in _running if r() is not None]
        return _running[-1]() if _running else None


def _beat() -> None:
    """The heartbeat thread: whenever something runs and no line has been printed for the heartbeat
    interval, one line for the innermost running item, ``[t] <what> (<its seconds> so far)``."""
    while True:
        item = _innermost()
        every = _state["heartbeat"]
        if item is None or every <= 0 or mode() != "lines":  # nothing to speak for (0: bars' own lines only)
            _wake.wait()
            _wake.clear()
            continue
        quiet = time.perf_counter() - _state["last_line"]
        if quiet < every:
            _wake.wait(every - quiet)
            _wake.clear()
            continue
        with _lock:
            if _innermost() is item and time.perf_counter() - _state["last_line"] >= every:
                now = time.perf_counter()
                try:
                    line(item.running_text(now - item.t0))
                except (ValueError, OSError):  # the stream was closed under us (a test's capture): stay alive
                    _state["last_line"] = now
                if isinstance(item, LineBar):
                    item.last = now
        del item


@contextlib.contextmanager
def running(desc: str, enabled: bool = True):
    """A step that prints no line of its own, but whose heartbeat speaks while it runs (lines mode):
    ``[t] desc (seconds so far)`` whenever nothing has been printed for the heartbeat interval."""
    item = _Running(desc) if enabled else None
    if item is not None:
        _register(item)
    try:
        yield
    finally:
        if item is not None:
            _unregister(item)


def _plural(unit: str, count) -> str:
    """``unit`` as many ``count`` are named: ``21/21 tensors``, ``1/1 tensor`` (the bars are made with either form)."""
    if not unit or count == 1 or unit.endswith("s"):
        return unit
    return unit + ("es" if unit.endswith(("ch", "sh", "x")) else "s")


def _count(n, total, unit: str) -> str:
    n = int(n) if float(n).is_integer() else n
    unit = _plural(unit, total if total is not None else n)
    units = f" {unit}" if unit else ""
    return f"{n}/{total}{units}" if total is not None else f"{n}{units}"


class LineBar:
    """The ``lines`` mode's stand-in for a tqdm bar: the same calls (iteration, ``update``,
    ``set_postfix``/``set_postfix_str``, ``close``, context manager); one line when it closes, interim
    lines for a long stage."""

    heartbeat = True  # spoken for by the heartbeat thread while it runs

    def __init__(self, iterable=None, desc: str = "", total=None, unit: str = "", **_):
        self.iterable, self.desc, self.unit = iterable, desc or "working", "" if unit == "it" else unit
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.n, self.postfix = total, 0, ""
        self.t0 = self.last = time.perf_counter()
        self.closed = False
        if self.heartbeat:
            _register(self)

    def running_text(self, seconds: float) -> str:
        return self._text(seconds, running=True)

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
            _unregister(self)
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
    heartbeat = False

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
    ``[t] desc (seconds)``, and while it runs a heartbeat whenever nothing has been printed for the
    heartbeat interval (``[t] desc in the present tense (seconds so far)``, see :func:`running`);
    nothing in the other modes."""
    t0 = time.perf_counter()
    with running(desc, enabled):
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
        progress_line.desc = desc
        return progress_line
    pbar = bar(total=total, desc=desc, unit="group")

    def progress(name: str) -> None:
        pbar.set_postfix_str(name)
        pbar.update(1)

    progress.desc = desc
    return progress


