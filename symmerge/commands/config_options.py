"""symmerge's own config keys as the options of its commands (``merge``, ``align``, ``barrier``): a key is an
option of ``symmerge COMMAND`` by its long name (``align_data`` for ``--align-data``; mergekit's names as aliases:
``merge_method``, ``base_model``, ``out``), its value converted and checked as the command line converts and
checks that flag (its type, its choices, a switch's true/false, a repeated flag's list), and set on the
command's namespace directly: no command line is written and parsed again. The model folders are the
command's positional arguments. Registered into :mod:`symmerge.config.schema` on import, so that the config
layer never imports a command."""

from __future__ import annotations

import argparse
import functools

from ..config import schema as registry
from ..config.command import ALIASES
from ..errors import SymmergeError
from . import align, barrier, merge

MODULES = {"merge": merge, "align": align, "barrier": barrier}
LISTS = ("align", "symmetries", "layers")  # options that take a comma list: a YAML list is joined


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


def _action(command: str, key: str):
    wanted = "--" + ALIASES.get(key, key).replace("_", "-")
    return next((a for a in parser(command)._actions if wanted in a.option_strings), None)


def is_option(command: str, key: str) -> bool:
    return _action(command if command in MODULES else "merge", key) is not None


def option_names(command: str = "merge") -> tuple:
    return tuple(sorted(f[2:].replace("-", "_") for a in parser(command)._actions for f in a.option_strings
                        if f.startswith("--")))


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _flag(action) -> str:
    return next((f for f in action.option_strings if f.startswith("--")), action.option_strings[0])


def _value(doc, raw, action, value):
    """One value of option ``action`` (config key ``raw``) as the flag's type reads it, its choices checked."""
    if isinstance(value, (dict, list)) or value is None:
        raise doc.error(f"{raw!r} needs a value, got {value!r}", raw)
    text = _scalar(value)
    try:
        out = action.type(text) if action.type is not None else text
    except SymmergeError:
        raise
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise doc.error(f"argument {_flag(action)}: invalid value {text!r} ({e})", raw) from None
    if action.choices is not None and out not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise doc.error(f"argument {_flag(action)}: invalid choice: {out!r} (choose from {choices})", raw)
    return out


def _set(doc, command, ns, raw, value) -> None:
    action = _action(command, raw)
    if action is None:
        raise doc.error(f"unknown key {raw!r} for symmerge {command} (keys are the command's long options, e.g. "
                        "method, align, match, align_data, output)", raw)
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise doc.error(f"{raw!r} is a switch: true or false, got {value!r}", raw)
        if isinstance(action, argparse.BooleanOptionalAction):
            setattr(ns, action.dest, value)
        elif value:
            setattr(ns, action.dest, action.const)
        return
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and not isinstance(action, argparse._AppendAction):
        if ALIASES.get(raw, raw) not in LISTS:
            raise doc.error(f"{raw!r} takes one value, got a list", raw)
        values = [",".join(_scalar(v) for v in value)]
    converted = [_value(doc, raw, action, v) for v in values]
    if isinstance(action, argparse._AppendAction):
        setattr(ns, action.dest, list(getattr(ns, action.dest) or []) + converted)
    else:
        setattr(ns, action.dest, converted[-1])


def _positionals(doc, command, ns, models) -> None:
    slots = [a for a in parser(command)._actions if not a.option_strings]
    rest = list(models)
    for a in slots:
        if a.nargs in ("+", "*"):
            if a.nargs == "+" and not rest:
                raise doc.error(f"'models' is missing (symmerge {command}'s {a.metavar or a.dest})", "models")
            setattr(ns, a.dest, rest)
            rest = []
        else:
            if not rest:
                raise doc.error(f"'models' needs one more model (symmerge {command}'s {a.metavar or a.dest})",
                                "models")
            setattr(ns, a.dest, rest.pop(0))
    if rest:
        raise doc.error(f"symmerge {command} takes {len(models) - len(rest)} model(s), got {len(models)}", "models")


def namespace(config) -> argparse.Namespace:
    """The namespace ``symmerge COMMAND`` gets from its command line, built from a symmerge config
    (:class:`symmerge.config.command.SymmergeConfig`): its defaults, the models, the weights and parameters,
    then every key."""
    doc, command = config.doc, config.command
    p = parser(command)
    ns = argparse.Namespace(**{a.dest: a.default for a in p._actions if a.dest != argparse.SUPPRESS})
    for k, v in p._defaults.items():
        setattr(ns, k, v)
    _positionals(doc, command, ns, config.models)
    if config.weights is not None:
        ns.weights = ",".join(repr(float(w)) for w in config.weights)
    if config.params:
        ns.param = [f"{k}={_scalar(v)}" for k, v in config.params.items()]
    for raw, value in config.keys.items():
        _set(doc, command, ns, raw, value)
    for a in p._actions:
        if a.required and a.option_strings and getattr(ns, a.dest, None) is None:
            raise doc.error(f"{_flag(a)[2:].replace('-', '_')!r} is missing (symmerge {command} needs {_flag(a)})")
    return ns


def command_line(config) -> list[str]:
    """The command line ``symmerge COMMAND ...`` a symmerge config stands for (``--print-command``; it builds
    the same namespace as :func:`namespace`, tests/test_config_options.py)."""
    argv = [config.command, *config.models]
    if config.weights is not None:
        argv += ["--weights", ",".join(repr(float(w)) for w in config.weights)]
    for k, v in (config.params or {}).items():
        argv += ["--param", f"{k}={_scalar(v)}"]
    for raw, value in config.keys.items():
        action = _action(config.command, raw)
        flag = _flag(action)
        if action.nargs == 0:
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
            continue
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not isinstance(action, argparse._AppendAction):
            values = [",".join(_scalar(v) for v in value)]
        for v in values:
            argv += [flag, _scalar(v)]
    return argv


def merge_options(doc, keys: dict):
    """The :class:`~symmerge.merge.fuse.MergeOptions` of an aligned mergekit config's alignment keys (method and
    models set per job at run time); a bad key is one error naming it and its line."""
    from ..config.command import SymmergeConfig

    config = SymmergeConfig("merge", ["<model>", "<model>"], None, {},
                            {"output": "<out>", "method": "average", **keys}, doc)
    ns = namespace(config)
    try:
        return merge.options_from(ns), ns
    except SymmergeError as e:
        raise doc.error(str(e), next(iter(keys))) from None


class _Schema:
    is_option = staticmethod(is_option)
    option_names = staticmethod(option_names)
    namespace = staticmethod(namespace)
    command_line = staticmethod(command_line)
    merge_options = staticmethod(merge_options)


registry.register(_Schema())
