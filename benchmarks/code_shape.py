"""The code's shape (issue 39, item 5): how many functions of ``symmerge/`` are over 80 lines and how many take
more than 10 parameters, by the syntax tree (tests/guards.py's helpers, the ones tests/project/test_code_shape.py guards
with), and which.

    python benchmarks/code_shape.py            # the counts and the lists
    python benchmarks/code_shape.py --counts   # the two counts only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from guards import MAX_LINES, MAX_PARAMETERS, bags, shape  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", action="store_true", help="print the counts only")
    args = p.parse_args(argv)
    long, wide = shape()
    found = bags()
    print(f"functions over {MAX_LINES} lines: {len(long)}")
    print(f"functions over {MAX_PARAMETERS} parameters: {len(wide)}")
    print(f"functions with attribute bags: {len(found)}")
    if not args.counts:
        for title, table in ((f"over {MAX_LINES} lines", long), (f"over {MAX_PARAMETERS} parameters", wide)):
            print(f"\n{title}:")
            for name, n in sorted(table.items(), key=lambda kv: -kv[1]):
                print(f"  {n:4d}  {name}")
        print("\nattribute bags:")
        for name in found:
            print(f"        {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
