"""``benchmarks/procstate_audit.py``'s checker sees what it audits: a changed thread count, an added environment
variable, a replaced signal handler, a consumed draw of the global generator, a model put in training mode."""

import os
import signal

import torch

from benchmarks import procstate_audit as audit


def test_the_snapshot_sees_each_kind_of_change():
    model = torch.nn.Linear(2, 2).eval()
    model.config = type("Config", (), {"to_json_string": lambda self: "{}"})()
    threads, handler = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    before = audit.snapshot([model])
    assert audit.diff(before, audit.snapshot([model])) == []
    try:
        torch.set_num_threads(threads + 1)
        os.environ["SYMMERGE_PROCSTATE_TEST"] = "1"
        signal.signal(signal.SIGTERM, lambda *_: None)
        torch.rand(1)
        model.train()
        changed = " ".join(audit.diff(before, audit.snapshot([model])))
    finally:
        torch.set_num_threads(threads)
        os.environ.pop("SYMMERGE_PROCSTATE_TEST")
        signal.signal(signal.SIGTERM, handler)
    for key in ("torch.num_threads", "SYMMERGE_PROCSTATE_TEST", "SIGTERM", "torch.rng", "models"):
        assert key in changed, key
