"""The arguments of a command that name a file or a folder, and their leading ``~``: the home folder, whether they
came from the command line (the shell leaves ``~`` alone when quoted and after a flag's ``=``: ``--data=~/d.npz``)
or from a config of symmerge's own keys (``data: ~/d.npz``), as in a mergekit config's paths."""

from __future__ import annotations

import os

# the arguments that name a file or a folder: an empty one ("" from an empty shell variable) is the current folder
PATHS = frozenset({"model", "anchor", "models", "output", "out", "config", "data", "eval_data", "align_data", "base",
                   "finetune", "model_flag", "base_flag", "lora_merge_cache"})


def _expanded(value):
    if isinstance(value, str):
        return os.path.expanduser(value)
    if isinstance(value, list):
        return [os.path.expanduser(v) if isinstance(v, str) else v for v in value]
    return value


def expand_home(args, command: str):
    """``args`` (a namespace) with every path argument of ``command`` (a string or a list of them) given its leading
    ``~`` (``~/x``, ``~user/x``) expanded: a new namespace. ``-o '~/out'`` wrote a folder named ``~`` into the
    current folder."""
    from .declared import TABLE

    paths = {o.attr for o in TABLE.of(command) if o.attr in PATHS}
    return type(args)(**{k: _expanded(v) if k in paths else v for k, v in vars(args).items()})
