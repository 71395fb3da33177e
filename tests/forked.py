"""Another process, for the tests of what two symmerge processes do at once: a forked child runs ``start()`` (taking
a lock, making a folder...), reports what it returns, and holds on until the test lets it end."""

from __future__ import annotations

import os


def holder(start, wait: bool = True, stop=None):
    """Fork a child that calls ``start()`` and sends back ``str`` of its result; returns (that text, a function that
    lets the child end, calling ``stop()`` if given, and waits for it). ``wait=False``: the child ends at once,
    without its exit's cleanup (as a killed process does), before this returns. The child never runs pytest's
    teardown nor ``atexit``."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.close(go_w)
            os.write(ready_w, str(start()).encode())
            os.close(ready_w)
            if wait:
                os.read(go_r, 1)
            if stop is not None:
                stop()
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    said = os.read(ready_r, 4096).decode()
    os.close(ready_r)

    def end():
        os.close(go_w)
        os.waitpid(pid, 0)

    if not wait:
        end()
    return said, end
