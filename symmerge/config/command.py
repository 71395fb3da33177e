"""A symmerge-style config: the ``merge`` (or ``align``, ``barrier``) it stands for, as a
:class:`SymmergeConfig` — the command, the model folders, the weights and parameters, and every other key by
its option's long name.

Keys follow mergekit's convention (``models`` with ``parameters: {weight: w}``, ``merge_method``,
``base_model``, ``parameters``) plus any option of the command by its long name (``align``, ``match``,
``align_data``, ``eval_data``, ``output``, ...). The commands declare which keys are options and turn them into
their options objects from the options' declarations (:mod:`symmerge.config.schema`): each value is checked as
the command line checks its flag, and nothing is written as a command line and parsed again. Configs with symmerge's
own keys go this way (alignment, data, evaluation); a config with mergekit's keys only is planned by
:mod:`.mergekit`."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import schema
from .schema import ALIASES, COMMANDS as RUNNABLE  # noqa: F401  (ALIASES: mergekit's names of symmerge options)

STRUCTURAL = {"command", "models", "parameters"}
# mergekit keys this path cannot take (they need the step plan of a mergekit config)
MERGEKIT_ONLY = ("slices", "dtype", "out_dtype", "tokenizer_source", "tokenizer", "chat_template", "name", "modules")


@dataclass
class SymmergeConfig:
    """What a symmerge config runs: ``command`` on ``models`` (folders) with ``weights`` (or None) and the
    method's ``params``; ``keys``: every other key (an option of the command by its long name) and its value,
    as written; ``doc``: the document (for errors naming a key's line)."""

    command: str
    models: list
    weights: list | None
    params: dict
    keys: dict = field(default_factory=dict)
    doc: object = None


def is_option(command: str, key: str) -> bool:
    """Whether ``key`` (a config key) names an option of ``symmerge COMMAND`` (by its long name or a mergekit
    alias); an unknown command counts as ``merge``."""
    return schema.is_option(command, key)


def option_names(command: str = "merge") -> tuple:
    """The config keys of ``symmerge COMMAND``'s options (``eval_data`` for ``--eval-data``)."""
    return schema.option_names(command)


def _is_plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _is_number_list(v) -> bool:
    """A per-model parameter's list (``density: [0.7, 0.4]``: ``--param density=0.7,0.4``)."""
    return isinstance(v, list) and bool(v) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


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


def symmerge_config(doc, output=None, align=None, symmerge_key=None) -> SymmergeConfig:
    """The :class:`SymmergeConfig` the document ``doc`` stands for; ``output``/``align``: from the command line.
    Every value is checked here or by the command's schema (:func:`check`), before anything runs."""
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
    if "models" not in config:
        raise doc.error("'models' is missing (the model folders)")
    paths, weights = _models(doc, config["models"])
    if weights is not None and command != "merge":
        raise doc.error("model weights are a merge option", "models")
    params = config.get("parameters") or {}
    if params:
        if command != "merge" or not isinstance(params, dict):
            raise doc.error("'parameters' is a mapping of the merge method's parameters", "parameters")
        for k, v in params.items():
            if not (_is_plain(v) and v is not None) and not _is_number_list(v):
                raise doc.error(f"with symmerge's own keys a parameter is one value or a list of numbers, one per "
                                f"model, got {v!r} (gradients and filters are for mergekit configs)", "parameters", k)
    keys = {k: v for k, v in config.items() if k not in STRUCTURAL}
    if align is not None:
        keys["align"] = align
    if output is not None:
        for k in ("output", "out", "out_path"):
            if k in keys and str(keys[k]) != str(output):
                raise doc.error(f"the config writes to {keys[k]!r} and the command line to {str(output)!r}: "
                                "give one", k)
            keys.pop(k, None)
        keys["output"] = str(output)
    out = SymmergeConfig(command, paths, weights, dict(params), keys, doc)
    check(out)
    return out


def check(config: SymmergeConfig):
    """Every key of ``config`` checked by its command's schema (the option values it makes; one error naming
    the key and its line)."""
    return schema.values(config)


def command_line(config: SymmergeConfig) -> list[str]:
    """``[COMMAND, ARG, ...]``: the command line the config stands for (what ``--print-command`` prints)."""
    return schema.command_line(config)
