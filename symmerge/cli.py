"""Command-line entry point: ``symmerge <command> ...``. Each command lives in symmerge/commands/."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import SymmergeError
from .progress import configure

# command name -> module in symmerge.commands defining add_arguments(parser) and run(args)
COMMANDS = {
    "align": "align",
    "barrier": "barrier",
    "demo": "demo",
    "merge": "merge",
    "run": "run",
    "specs": "specs",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="symmerge", description="Symmetry-aware fusion of transformer models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"symmerge.commands.{module_name}")
        p = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0], description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configure(getattr(args, "progress", "auto"))  # also starts the clock of progress lines and final timings
        return args.handler(args) or 0
    except SymmergeError as e:
        print(f"symmerge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("symmerge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
