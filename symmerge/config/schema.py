"""A symmerge config's keys as the options of its command (``merge``, ``align``, ``barrier``), generated from
the options' declarations (:mod:`symmerge.options.declared`), as the command line's flags are
(``symmerge/commands/schema_args.py``): a key is an option by its name (``align_data`` for ``--align-data``;
mergekit's names as aliases: ``merge_method``, ``base_model``, ``out``), its value read and checked by the same
function as the flag's (its type, choices and range; a switch's true/false; a repeatable flag's list; a comma
list's YAML list), and set directly: no command line is written and parsed again, no command is imported. A bad
value is one error naming the key and its line, in the words the flag's error has."""

from __future__ import annotations

from types import SimpleNamespace

from ..errors import SymmergeError
from ..options.declared import TABLE
from ..options.schema import OptionValueError

# mergekit's names and their symmerge options
ALIASES = {"merge_method": "method", "base_model": "base", "out": "output", "out_path": "output"}
COMMANDS = ("merge", "align", "barrier")


def _command(command: str) -> str:
    return command if command in COMMANDS else "merge"


def option(command: str, key: str):
    """The option of ``symmerge COMMAND`` a config key names (by its name or a mergekit alias), or None."""
    return TABLE.get(_command(command), ALIASES.get(key, key))


def is_option(command: str, key: str) -> bool:
    """Whether ``key`` names an option of ``symmerge COMMAND``; an unknown command counts as ``merge``."""
    found = option(command, key)
    return found is not None and found.form != "positional"


def option_names(command: str = "merge") -> tuple:
    """The config keys of ``symmerge COMMAND``'s options (``eval_data`` for ``--eval-data``)."""
    return TABLE.names(_command(command))


def scalar(v) -> str:
    """A YAML scalar as the command line writes it (a list of numbers, a per-model parameter's: comma-joined)."""
    if isinstance(v, list):
        return ",".join(scalar(x) for x in v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _texts(doc, raw, opt, value) -> list[str]:
    """The texts of the value(s) of ``opt`` given as ``value`` (a YAML list: one per repetition of a repeatable
    flag, or joined with commas for a comma list)."""
    if isinstance(value, list) and opt.form != "append":
        if not opt.joins:
            raise doc.error(f"{raw!r} takes one value, got a list", raw)
        value = [",".join(scalar(v) for v in value)]
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, (dict, list)) or v is None:
            raise doc.error(f"{raw!r} needs a value, got {v!r}", raw)
    return [scalar(v) for v in values]


def _read(doc, raw, opt, text):
    try:
        return opt.read(text)
    except OptionValueError as e:
        raise doc.error(f"argument {opt.flag}: {e}", raw) from None
    except SymmergeError as e:  # out of the option's range: the flag's own line
        raise doc.error(str(e), raw) from None


def _set(doc, command, values: dict, raw, value) -> None:
    opt = option(command, raw)
    if opt is None or opt.form == "positional":
        from ..errors import did_you_mean

        raise doc.error(f"unknown key {raw!r} for symmerge {command}{did_you_mean(raw, option_names(command))} (keys "
                        "are the command's long options, e.g. method, align, match, align_data, output)", raw)
    if not opt.takes_value:  # a switch
        if not isinstance(value, bool):
            raise doc.error(f"{raw!r} is a switch: true or false, got {value!r}", raw)
        if opt.form == "onoff" or value:
            values[opt.attr] = value
        return
    read = [_read(doc, raw, opt, t) for t in _texts(doc, raw, opt, value)]
    values[opt.attr] = list(values[opt.attr] or []) + read if opt.form == "append" else read[-1]


def _positionals(doc, command, values: dict, models) -> None:
    rest = list(models)
    for opt in (o for o in TABLE.of(command) if o.form == "positional"):
        shown = opt.metavar or opt.name
        if opt.nargs in ("+", "*"):
            if opt.nargs == "+" and not rest:
                raise doc.error(f"'models' is missing (symmerge {command}'s {shown})", "models")
            values[opt.attr], rest = rest, []
        else:
            if not rest:
                raise doc.error(f"'models' needs one more model (symmerge {command}'s {shown})", "models")
            values[opt.attr] = rest.pop(0)
    if rest:
        raise doc.error(f"symmerge {command} takes {len(models) - len(rest)} model(s), got {len(models)}", "models")


def values(config) -> SimpleNamespace:
    """The options ``symmerge COMMAND`` gets from its command line, built from a symmerge config
    (:class:`symmerge.config.command.SymmergeConfig`): the defaults, the models, the weights and parameters,
    then every key, each checked as its flag is."""
    doc, command = config.doc, config.command
    out = TABLE.defaults(command)
    _positionals(doc, command, out, config.models)
    if config.weights is not None:
        out["weights"] = ",".join(repr(float(w)) for w in config.weights)
    if config.params:
        out["param"] = [f"{k}={scalar(v)}" for k, v in config.params.items()]
    for raw, value in config.keys.items():
        _set(doc, command, out, raw, value)
    for opt in TABLE.of(command):
        if opt.required and opt.form != "positional" and out.get(opt.attr) is None:
            raise doc.error(f"{opt.name!r} is missing (symmerge {command} needs {opt.flag})")
    return SimpleNamespace(**out)


def command_line(config) -> list[str]:
    """``[COMMAND, ARG, ...]``: the command line a symmerge config stands for (``--print-command``; it parses to
    the options :func:`values` builds, tests/config/test_config_options.py)."""
    argv = [config.command, *config.models]
    if config.weights is not None:
        argv += ["--weights", ",".join(repr(float(w)) for w in config.weights)]
    for k, v in (config.params or {}).items():
        argv += ["--param", f"{k}={scalar(v)}"]
    for raw, value in config.keys.items():
        opt = option(config.command, raw)
        if opt.form == "onoff":
            argv.append(opt.flag if value else "--no-" + opt.flag[2:])
        elif not opt.takes_value:
            argv += [opt.flag] if value else []
        else:
            argv += [x for text in _texts(config.doc, raw, opt, value) for x in (opt.flag, text)]
    return argv


def merge_options(doc, keys: dict):
    """(the :class:`~symmerge.merge.fuse.MergeOptions`, the option values) of an aligned mergekit config's
    alignment keys (method and models set per job at run time); a bad key is one error naming it and its line."""
    from ..options.build import merge_options as build

    given = values(SimpleNamespace(command="merge", models=["<model>", "<model>"], weights=None, params={},
                                   keys={"output": "<out>", "method": "average", **keys}, doc=doc))
    try:
        return build(given), given
    except SymmergeError as e:
        raise doc.error(str(e), next(iter(keys))) from None
