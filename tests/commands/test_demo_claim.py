"""``symmerge demo`` claims its output at its start, as every other writing command does: a second demo given the
same ``-o`` while the first runs fails at once in one line. Before, it trained and evaluated its models (20 s with
the cached ViTs, minutes without), then was refused at the end (docs/results/concur_audit.md)."""

from __future__ import annotations

import pytest

from forked import holder
from symmerge.demo import demo
from symmerge.errors import OutputError
from symmerge.io.output import claim_output, lock_path


def _holder(out):
    """A process holding the claim on ``out`` (as a running demo); returns a function that ends it."""
    return holder(lambda: claim_output(out))[1]


def test_a_second_demo_on_the_same_output_fails_before_its_work(tmp_path, monkeypatch):
    out = tmp_path / "demo"
    worked = []
    monkeypatch.setattr(demo, "_run", lambda *a, **k: worked.append(1) or {})
    end = _holder(out)
    try:
        with pytest.raises(OutputError, match="another symmerge run"):
            demo.run_demo(out, quick=True, progress=False, log=lambda *a: None)
    finally:
        end()
    assert worked == [] and not out.exists()


def test_a_demo_that_fails_leaves_no_claim(tmp_path, monkeypatch):
    out = tmp_path / "demo"

    def fail(*a, **k):
        assert lock_path(out).is_file()  # claimed while it works
        raise RuntimeError("stop")

    monkeypatch.setattr(demo, "_run", fail)
    with pytest.raises(RuntimeError):
        demo.run_demo(out, quick=True, progress=False, log=lambda *a: None)
    assert not lock_path(out).exists() and list(tmp_path.iterdir()) == []
