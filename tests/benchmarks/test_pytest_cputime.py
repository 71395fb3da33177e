"""benchmarks/pytest_cputime.py: a planted test run (one test burning CPU itself, one in a child process, one idle)
is recorded test by test with its own and its children's CPU apart, and the summary ranks files and tests by CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import pytest_cputime

ROOT = Path(__file__).resolve().parents[2]

PLANTED = '''
import subprocess, sys, time

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_burns_itself():
    burn(0.3)

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.3\\nwhile time.process_time() < end: pass"], check=True)

def test_sleeps():
    time.sleep(0.2)
'''


def test_each_test_gets_its_own_and_its_childrens_cpu(tmp_path):
    (tmp_path / "test_planted.py").write_text(PLANTED)
    out = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CPUTIME_OUT": str(out)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.pytest_cputime",
                           "test_planted.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(out.read_text())
    rows = {k.split("::")[1]: v for k, v in record["tests"].items()}
    assert set(rows) == {"test_burns_itself", "test_burns_in_a_child", "test_sleeps"}
    wall, own, children = rows["test_burns_itself"]
    assert own >= 0.25 and children == 0 and wall >= own * 0.9
    wall, own, children = rows["test_burns_in_a_child"]
    assert children >= 0.25 and own < 0.25
    wall, own, children = rows["test_sleeps"]
    assert wall >= 0.2 and own + children < 0.1
    session_wall, session_own, session_children = record["session"]
    assert session_wall >= sum(r[0] for r in rows.values()) and session_children >= 0.25

    meta = tmp_path / "meta.txt"
    meta.write_text("a date\nload 1.0\n")
    figures = tmp_path / "figures.json"
    assert pytest_cputime.main([str(out), str(meta), str(figures), "planted"]) == 0
    s = json.loads(figures.read_text())["planted"]
    assert s["meta"] == ["a date", "load 1.0"] and s["tests"] == 3
    assert [row[0].split("::")[1] for row in s["slowest_40_cpu_wall"]][2] == "test_sleeps"
    assert list(s["files_cpu_wall_n"]) == ["test_planted.py"] and s["files_cpu_wall_n"]["test_planted.py"][2] == 3
    assert s["sum_test_cpu_s"] == round(sum(sum(r[1:]) for r in rows.values()), 1)
