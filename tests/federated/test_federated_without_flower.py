"""The federated options and aggregation rules need no Flower (their docstrings say so) and import without it;
only ``AlignedFedAvg`` needs it. ``import symmerge.federated.options`` raised "symmerge.federated needs Flower"
because the package imported the strategy first. Run in a subprocess with Flower hidden, so that it holds in
the Flower venv too."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_options_and_rules_import_and_validate_without_flower():
    code = textwrap.dedent("""
        import sys
        sys.modules["flwr"] = None  # as if Flower were not installed: importing it raises ImportError
        from symmerge.errors import SymmergeError
        from symmerge.federated.options import Aggregation, ClientAlignment, OutlierPolicy
        from symmerge.federated import aggregate, FEDERATED_SYMMETRIES
        assert Aggregation(rule="median").rule == "median" and FEDERATED_SYMMETRIES
        try:
            Aggregation(trim="x")
        except SymmergeError as e:
            print("refused:", e)
        try:
            from symmerge.federated import AlignedFedAvg
        except ImportError as e:
            print("strategy:", e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused: ") and "trim" in lines[0], lines
    assert lines[1] == "strategy: symmerge.federated needs Flower: pip install 'symmerge[flower]'", lines
