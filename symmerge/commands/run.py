"""Run a merge (or an alignment, or a barrier study) written as a YAML config, in the convention mergekit
users know: ``models`` (each a path, or ``model:`` with ``parameters: {weight: ...}``), ``merge_method``,
``base_model``, ``parameters`` (the method's), plus any option of the command by its long name
(``align: recommended``, ``match: activations``, ``align_data: unlabeled.npz``, ``output: merged``).

The config is turned into the command's own arguments and parsed by the command's own parser, so every
CLI option can be written in it and is checked the same way; ``--print-command`` shows the command line
it stands for. A bad config gets one clear error naming the key and its line."""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

from ..errors import SymmergeError

RUNNABLE = ("merge", "align", "barrier")
# mergekit's names and their symmerge options
ALIASES = {"merge_method": "method", "base_model": "base", "out": "output", "out_path": "output"}
STRUCTURAL = {"command", "models", "parameters"}


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML file: models, merge_method (or method), parameters, base_model, and any "
                                       "option of the command by its long name (see docs/merge.md, Merge configs)")
    parser.add_argument("--print-command", action="store_true",
                        help="print the equivalent symmerge command line and exit without running it")
    parser.add_argument("--progress", choices=["auto", "bar", "lines", "none"], default="auto",
                        help="progress on stderr, unless the config sets its own 'progress'")


class _ConfigParser(argparse.ArgumentParser):
    """The command's parser, raising instead of exiting, so a bad value names its config key."""

    def error(self, message):
        raise SymmergeError(message)


def command_parser(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"symmerge.commands.{command}")
    parser = _ConfigParser(prog=f"symmerge {command}", add_help=False)
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)
    return parser


def _lines(text: str) -> dict[str, int]:
    """Top-level key -> its 1-based line in the YAML text."""
    import yaml

    node = yaml.compose(text)
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def load_config(path) -> tuple[dict, dict[str, int]]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise SymmergeError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        config = yaml.safe_load(text)
        lines = _lines(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SymmergeError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(config, dict):
        raise SymmergeError(f"{path}: a config is a mapping of keys (models, merge_method, ...), got "
                            f"{type(config).__name__}")
    return config, lines


def _models(value, where) -> tuple[list[str], list | None]:
    """(paths, weights or None) from ``models``: paths, or mappings with ``model`` (or ``path``) and
    ``parameters: {weight: w}``."""
    if not isinstance(value, list) or not value:
        raise SymmergeError(f"{where('models')}: 'models' must be a list of model folders")
    paths, weights = [], []
    for i, item in enumerate(value):
        if isinstance(item, (str, Path)):
            paths.append(str(item))
            weights.append(None)
            continue
        if not isinstance(item, dict):
            raise SymmergeError(f"{where('models')}: models[{i}] must be a path or a mapping with 'model'")
        unknown = set(item) - {"model", "path", "parameters"}
        if unknown:
            raise SymmergeError(f"{where('models')}: models[{i}] has unknown key {sorted(unknown)[0]!r} "
                                "(allowed: model, parameters)")
        path = item.get("model", item.get("path"))
        if not isinstance(path, (str, Path)):
            raise SymmergeError(f"{where('models')}: models[{i}] needs 'model': a folder")
        params = item.get("parameters") or {}
        if not isinstance(params, dict) or set(params) - {"weight"}:
            extra = sorted(set(params) - {"weight"}) if isinstance(params, dict) else ["parameters"]
            raise SymmergeError(f"{where('models')}: models[{i}].parameters: only 'weight' can be given per model "
                                f"(got {extra[0]!r}); method parameters go in the top-level 'parameters'")
        paths.append(str(path))
        weights.append(params.get("weight"))
    given = [w for w in weights if w is not None]
    if given and len(given) != len(weights):
        raise SymmergeError(f"{where('models')}: give a weight to every model or to none")
    return paths, (weights if given else None)


def _flag(parser, name: str):
    """The parser's action for option ``name`` (``align_data`` or ``align-data``), else None."""
    wanted = "--" + name.replace("_", "-")
    for action in parser._actions:
        if wanted in action.option_strings:
            return action
    return None


def config_argv(config: dict, lines: dict[str, int], path) -> tuple[str, list[str]]:
    """(command, argv) that the config stands for."""
    def where(key):
        return f"{path} line {lines[key]}" if key in lines else str(path)

    command = config.get("command", "merge")
    if command not in RUNNABLE:
        raise SymmergeError(f"{where('command')}: command must be one of {', '.join(RUNNABLE)}, got {command!r}")
    parser = command_parser(command)
    if "models" not in config:
        raise SymmergeError(f"{path}: 'models' is missing (the model folders)")
    paths, weights = _models(config["models"], where)
    argv = list(paths)
    if weights is not None:
        if command != "merge":
            raise SymmergeError(f"{where('models')}: model weights are a merge option")
        argv += ["--weights", ",".join(repr(float(w)) for w in weights)]
    params = config.get("parameters") or {}
    if params:
        if command != "merge" or not isinstance(params, dict):
            raise SymmergeError(f"{where('parameters')}: 'parameters' is a mapping of the merge method's parameters")
        for k, v in params.items():
            argv += ["--param", f"{k}={_scalar(v)}"]
    for raw, value in config.items():
        if raw in STRUCTURAL:
            continue
        key = ALIASES.get(raw, raw)
        action = _flag(parser, key if key != "output" else "output")
        if action is None:
            raise SymmergeError(f"{where(raw)}: unknown key {raw!r} for symmerge {command} (keys are the command's "
                                f"long options, e.g. method, align, match, align_data, output)")
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                raise SymmergeError(f"{where(raw)}: {raw!r} is a switch: true or false, got {value!r}")
            if value:
                argv.append(flag)
            continue
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not isinstance(action, argparse._AppendAction):
            if key in ("align", "symmetries", "layers"):
                values = [",".join(_scalar(v) for v in value)]  # a comma list
            else:
                raise SymmergeError(f"{where(raw)}: {raw!r} takes one value, got a list")
        for v in values:
            if isinstance(v, (dict, list)) or v is None:
                raise SymmergeError(f"{where(raw)}: {raw!r} needs a value, got {v!r}")
            argv += [flag, _scalar(v)]
    return command, argv


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def run(args) -> int:
    from ..progress import configure

    config, lines = load_config(args.config)
    command, argv = config_argv(config, lines, args.config)
    if args.print_command:
        print(shlex.join(["symmerge", command, *argv]))
        return 0
    parsed = command_parser(command).parse_args(argv)
    if "progress" not in config:
        parsed.progress = args.progress
    configure(parsed.progress)
    print(f"running: {shlex.join(['symmerge', command, *argv])}", file=sys.stderr)
    return parsed.handler(parsed) or 0
