"""Which of a config's keys are symmerge's own options, and the options objects they make, as the commands
declare them: the commands register one schema here on import (:mod:`symmerge.commands.config_options`); the
config layer asks it and never imports a command (the registry pattern of :mod:`symmerge.core.kinds`).

The schema answers ``is_option(command, key)``, ``option_names(command)``, ``merge_options(doc, keys)`` (the
merge options an aligned mergekit config's alignment keys make) and ``command_line(config)`` (the command line
a symmerge config stands for, for ``--print-command``)."""

from __future__ import annotations

from ..errors import SymmergeError

_REGISTERED: list = []


def register(schema) -> None:
    """The commands' schema (one: a later registration replaces it)."""
    _REGISTERED[:] = [schema]


def schema():
    if not _REGISTERED:  # pragma: no cover - importing the package registers it
        raise SymmergeError("symmerge's config keys are declared by its commands: import symmerge first")
    return _REGISTERED[0]
