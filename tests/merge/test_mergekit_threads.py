"""mergekit's arithmetic in the half dtype runs with the thread count the process had before the executor pinned
its merging thread to one (``symmerge.merge.in_dtype``): bfloat16 reductions over more than 32 768 entries round
differently with torch's number of threads (on the AVX512 machine where it was found: a bfloat16 dot product of
884 736 entries summed to 644 on one thread and 640 on two — a fact of one CPU's kernels, so not a test here; the
mergekit oracle test in ``test_rules_half_dtype.py`` compares both tools at one thread count instead)."""

from __future__ import annotations

import torch

from symmerge.merge import in_dtype


def test_half_rules_run_with_the_remembered_count_and_restore_the_callers(monkeypatch):
    seen = []

    @in_dtype.in_mergekit_threads
    def probe():
        seen.append(torch.get_num_threads())

    threads = torch.get_num_threads()
    monkeypatch.setattr(in_dtype, "_THREADS", None)
    try:
        torch.set_num_threads(1)
        probe()  # nothing remembered: the count is left as it is
        in_dtype.remember_threads(3)
        probe()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 3]


def test_the_executor_remembers_the_processs_count(tmp_path, monkeypatch):
    from conftest import run_cli
    import mergekit_oracle as mo

    base, fts = mo.family(tmp_path / "m", "llama", "float32", n=2)
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: linear\nmodels:\n- model: {fts[0]}\n  parameters: {{weight: 0.5}}\n"
                      f"- model: {fts[1]}\n  parameters: {{weight: 0.5}}\ndtype: bfloat16\n")
    monkeypatch.setattr(in_dtype, "_THREADS", None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert run_cli("run", config, tmp_path / "out") == 0
        assert in_dtype._THREADS == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
