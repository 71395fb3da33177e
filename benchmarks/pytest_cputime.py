"""Where a test run spends its CPU, test by test: a pytest plugin and its summary (docs/testing.md, What .ci/run costs).

On a shared machine a test's wall time says as much about the others' work as about the test; its CPU seconds (user +
system of the pytest process and of the child processes it waited for) do not. As a plugin::

    PYTHONPATH=. CPUTIME_OUT=/tmp/run.json .venv/bin/python -m pytest -q -p benchmarks.pytest_cputime

writes ``{"session": [wall, cpu, children's cpu], "load_end": ..., "tests": {nodeid: [wall, cpu, children's cpu]}}``
(each test's setup, call and teardown together; the session's from its start, collection included). Its summary::

    .venv/bin/python -m benchmarks.pytest_cputime /tmp/run.json META.txt OUT.json KEY

adds to ``OUT.json`` under ``KEY`` the session's figures, the 60 files and the 40 tests with the most CPU, and the
lines of ``META.txt`` (the date, the load, the commit).
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

import pytest

_ROWS: dict = {}
_START: dict = {}


def _cpu() -> tuple[float, float]:
    """CPU seconds so far: this process's, its waited-for children's."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """One test's wall and CPU seconds, its fixtures' setup and teardown included."""
    wall, (own, children) = time.perf_counter(), _cpu()
    yield
    own2, children2 = _cpu()
    _ROWS[item.nodeid] = [round(time.perf_counter() - wall, 3), round(own2 - own, 3), round(children2 - children, 3)]


def pytest_sessionstart(session):
    """The session's start (before the collection)."""
    _START["wall"], _START["cpu"] = time.perf_counter(), _cpu()


def pytest_sessionfinish(session, exitstatus):
    """Every test's figures and the session's, to ``$CPUTIME_OUT`` (nothing when it is not set)."""
    out = os.environ.get("CPUTIME_OUT")
    if not out:
        return
    (own, children), (own0, children0) = _cpu(), _START["cpu"]
    with open(out, "w") as f:
        json.dump({"session": [round(time.perf_counter() - _START["wall"], 3), round(own - own0, 3),
                               round(children - children0, 3)],
                   "load_end": open("/proc/loadavg").read().strip(), "tests": _ROWS}, f)


def summary(record: dict, meta: list[str]) -> dict:
    """The session's figures, the 60 files and the 40 tests with the most CPU (seconds, rounded)."""
    tests = record["tests"]
    files = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, (wall, own, children) in tests.items():
        row = files[nodeid.split("::")[0]]
        row[0], row[1], row[2] = row[0] + own + children, row[1] + wall, row[2] + 1
    wall, own, children = record["session"]
    return {"meta": meta, "session_wall_s": wall, "session_cpu_s": round(own + children, 1),
            "session_children_cpu_s": children, "load_at_end": record["load_end"], "tests": len(tests),
            "sum_test_cpu_s": round(sum(own + ch for _, own, ch in tests.values()), 1),
            "files_cpu_wall_n": {name: [round(cpu, 2), round(w, 2), n]
                                 for name, (cpu, w, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:60]},
            "slowest_40_cpu_wall": [[nodeid, round(own + ch, 2), w]
                                    for nodeid, (w, own, ch) in sorted(tests.items(), key=lambda kv: -sum(kv[1][1:]))[:40]]}


def main(argv=None) -> int:
    """``RUN.json META.txt OUT.json KEY``: the summary of RUN.json added to OUT.json under KEY."""
    run, meta, out, key = argv if argv is not None else sys.argv[1:]
    figures = json.load(open(out)) if os.path.exists(out) else {}
    figures[key] = summary(json.load(open(run)), open(meta).read().strip().splitlines())
    with open(out, "w") as f:
        json.dump(figures, f, indent=1)
    print(f"{key}: {figures[key]['tests']} tests, {figures[key]['session_cpu_s']} s of CPU, "
          f"{figures[key]['session_wall_s']} s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
