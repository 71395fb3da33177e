"""A symmerge config as its command's arguments: the option values :mod:`symmerge.config.schema` builds from
the config's keys (generated, as the flags are, from :mod:`symmerge.options.declared`), as the namespace
``symmerge COMMAND`` would have parsed, with the command's handler. No command line is written and parsed
again; :func:`parser` (the command's own parser) is only for the test that both give the same namespace."""

from __future__ import annotations

import argparse
import functools

from ..config.schema import command_line, values
from ..errors import SymmergeError
from . import align, barrier, merge
from ..options.paths import expand_home

MODULES = {"merge": merge, "align": align, "barrier": barrier}
__all__ = ["command_line", "namespace", "parser"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise SymmergeError(message)


@functools.lru_cache(maxsize=None)
def parser(command: str) -> argparse.ArgumentParser:
    """``symmerge COMMAND``'s own parser (its ``add_arguments``), raising instead of exiting."""
    p = _Parser(prog=f"symmerge {command}", add_help=False)
    MODULES[command].add_arguments(p)
    p.set_defaults(handler=MODULES[command].run)
    return p


def namespace(config) -> argparse.Namespace:
    """The namespace ``symmerge COMMAND`` gets from its command line, built from a symmerge config
    (:class:`symmerge.config.command.SymmergeConfig`) directly; a path's leading ``~`` is the home folder, as on
    the command line (:func:`symmerge.options.paths.expand_home`)."""
    return expand_home(argparse.Namespace(**vars(values(config)), handler=MODULES[config.command].run), config.command)
