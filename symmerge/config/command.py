"""A symmerge-style config: the ``merge`` (or ``align``, ``barrier``) command line it stands for.

Keys follow mergekit's convention (``models`` with ``parameters: {weight: w}``, ``merge_method``,
``base_model``, ``parameters``) plus any option of the command by its long name (``align``, ``match``,
``align_data``, ``eval_data``, ``output``, ...). The argv is parsed by the command's own parser, so every
CLI option can be written in it and is checked the same way. Configs with symmerge's own keys go this way
(alignment, data, evaluation); a config with mergekit's keys only is planned by :mod:`.mergekit`."""

from __future__ import annotations

import argparse
import functools
import importlib

from ..errors import SymmergeError

RUNNABLE = ("merge", "align", "barrier")
# mergekit's names and their symmerge options
ALIASES = {"merge_method": "method", "base_model": "base", "out": "output", "out_path": "output"}
STRUCTURAL = {"command", "models", "parameters"}
# mergekit keys this path cannot take (they need the step plan of a mergekit config)
MERGEKIT_ONLY = ("slices", "dtype", "out_dtype", "tokenizer_source", "tokenizer", "chat_template", "name", "modules")


class _ConfigParser(argparse.ArgumentParser):
    """The command's parser, raising instead of exiting, so a bad value names its config key."""

    def error(self, message):
        raise SymmergeError(message)


def command_parser(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"symmerge.commands.{command}")
    parser = _ConfigParser(prog=f"symmerge {command}", add_help=False)
    module.add_arguments(parser)
    # the command's own builder of library options, where it has one (``symmerge merge``: MergeOptions), reached
    # through the parser as the handler is: config never imports a command module
    parser.set_defaults(handler=module.run, options_from=getattr(module, "options_from", None))
    return parser


def is_option(command: str, key: str) -> bool:
    """Whether ``key`` (a config key) names an option of ``symmerge COMMAND`` (by its long name or a mergekit
    alias); an unknown command counts as ``merge``."""
    if command not in RUNNABLE:
        command = "merge"
    return "--" + ALIASES.get(key, key).replace("_", "-") in _long_options(command)


def option_names(command: str = "merge") -> tuple:
    """The config keys of ``symmerge COMMAND``'s options (``eval_data`` for ``--eval-data``)."""
    return tuple(sorted(f[2:].replace("-", "_") for f in _long_options(command) if f.startswith("--")))


@functools.lru_cache(maxsize=None)
def _long_options(command: str) -> frozenset:
    return frozenset(f for a in command_parser(command)._actions for f in a.option_strings)


def _is_plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _models(doc, value) -> tuple[list[str], list | None]:
    """(paths, weights or None) from ``models``: paths, or mappings with ``model`` (or ``path``) and
    ``parameters: {weight: w}``."""
    if not isinstance(value, list) or not value:
        raise doc.error("'models' must be a list of model folders", "models")
    paths, weights = [], []
    for i, item in enumerate(value):
        where = ("models", i)
        if isinstance(item, str):
            paths.append(item)
            weights.append(None)
            continue
        if not isinstance(item, dict):
            raise doc.error(f"models[{i}] must be a path or a mapping with 'model'", *where)
        unknown = set(item) - {"model", "path", "parameters"}
        if unknown:
            raise doc.error(f"models[{i}] has unknown key {sorted(unknown)[0]!r} (allowed: model, parameters)",
                            *where, sorted(unknown)[0])
        path = item.get("model", item.get("path"))
        if not isinstance(path, str):
            raise doc.error(f"models[{i}] needs 'model': a folder", *where)
        params = item.get("parameters") or {}
        if not isinstance(params, dict) or set(params) - {"weight"}:
            extra = sorted(set(params) - {"weight"}) if isinstance(params, dict) else ["parameters"]
            raise doc.error(f"models[{i}].parameters: only 'weight' can be given per model with symmerge's own keys "
                            f"(got {extra[0]!r}); method parameters go in the top-level 'parameters'",
                            *where, "parameters", extra[0])
        w = params.get("weight")
        if not _is_plain(w) or isinstance(w, (bool, str)):
            raise doc.error(f"models[{i}]: with symmerge's own keys a weight is one number, got {w!r} (gradients and "
                            "filters are for mergekit configs: drop the symmerge keys, or ask for alignment with "
                            "plain numbers)", *where, "parameters", "weight")
        paths.append(path)
        weights.append(w)
    given = [w for w in weights if w is not None]
    if given and len(given) != len(weights):
        raise doc.error("give a weight to every model or to none", "models")
    return paths, (weights if given else None)


def _flag(parser, name: str):
    """The parser's action for option ``name`` (``align_data`` or ``align-data``), else None."""
    wanted = "--" + name.replace("_", "-")
    for action in parser._actions:
        if wanted in action.option_strings:
            return action
    return None


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def config_argv(doc, output=None, align=None, symmerge_key=None) -> tuple[str, list[str]]:
    """(command, argv) that the document ``doc`` stands for; ``output``/``align``: from the command line."""
    config = doc.data
    command = config.get("command", "merge")
    if command not in RUNNABLE:
        raise doc.error(f"command must be one of {', '.join(RUNNABLE)}, got {command!r}", "command")
    for key in MERGEKIT_ONLY:
        if key in config:
            why = (f"because of {symmerge_key!r} (line {doc.line(symmerge_key)})" if symmerge_key
                   else "with --align")
            raise doc.error(f"{key!r} is a mergekit key, and this config is run as a symmerge {command} {why}; "
                            "drop symmerge's own keys to merge exactly as mergekit does", key)
    parser = command_parser(command)
    if "models" not in config:
        raise doc.error("'models' is missing (the model folders)")
    paths, weights = _models(doc, config["models"])
    argv = list(paths)
    if weights is not None:
        if command != "merge":
            raise doc.error("model weights are a merge option", "models")
        argv += ["--weights", ",".join(repr(float(w)) for w in weights)]
    params = config.get("parameters") or {}
    if params:
        if command != "merge" or not isinstance(params, dict):
            raise doc.error("'parameters' is a mapping of the merge method's parameters", "parameters")
        for k, v in params.items():
            if not _is_plain(v) or v is None:
                raise doc.error(f"with symmerge's own keys a parameter is one value, got {v!r} (gradients and filters "
                                "are for mergekit configs)", "parameters", k)
            argv += ["--param", f"{k}={_scalar(v)}"]
    config = dict(config)
    if align is not None:
        config["align"] = align
    if output is not None:
        for k in ("output", "out", "out_path"):
            if k in config and str(config[k]) != str(output):
                raise doc.error(f"the config writes to {config[k]!r} and the command line to {str(output)!r}: give one", k)
            config.pop(k, None)
        config["output"] = str(output)
    return command, argv + option_argv(doc, parser, command, config)


def option_argv(doc, parser, command: str, config: dict, skip=STRUCTURAL) -> list[str]:
    """The command-line flags of the keys of ``config`` (a document's mapping) that are options of ``parser``
    (``symmerge COMMAND``'s), by their long names; every other key but ``skip`` is one error naming it."""
    argv: list[str] = []
    for raw, value in config.items():
        if raw in skip:
            continue
        key = ALIASES.get(raw, raw)
        action = _flag(parser, key)
        if action is None:
            raise doc.error(f"unknown key {raw!r} for symmerge {command} (keys are the command's long options, e.g. "
                            "method, align, match, align_data, output)", raw)
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                raise doc.error(f"{raw!r} is a switch: true or false, got {value!r}", raw)
            if value:
                argv.append(flag)
            continue
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not isinstance(action, argparse._AppendAction):
            if key in ("align", "symmetries", "layers"):
                values = [",".join(_scalar(v) for v in value)]  # a comma list
            else:
                raise doc.error(f"{raw!r} takes one value, got a list", raw)
        for v in values:
            if isinstance(v, (dict, list)) or v is None:
                raise doc.error(f"{raw!r} needs a value, got {v!r}", raw)
            argv += [flag, _scalar(v)]
    return argv
