"""The last hand-written flags in the schema (issue 39 item 3): ``moe``, ``extract-lora`` and ``demo`` declare their
options in ``symmerge/options/declared.py`` like every other command. Their parsers are the contract: every
argument's flags, destination, default, choices, nargs, metavar, type, action, help text and help group are
those of the hand-written parsers they replace (``data/hand_written_flags.json``, dumped from those parsers
before the change by :func:`dump`)."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).parent / "data" / "hand_written_flags.json"
COMMANDS = {"moe": "moe", "extract-lora": "extract_lora", "demo": "demo"}


def dump(command: str) -> list[dict]:
    """Every argument of ``symmerge COMMAND``'s parser, as argparse holds it, in order."""
    module = importlib.import_module(f"symmerge.commands.{COMMANDS[command]}")
    parser = argparse.ArgumentParser(prog=f"symmerge {command}", add_help=False)
    module.add_arguments(parser)
    group = {id(a): g.title for g in parser._action_groups for a in g._group_actions}  # noqa: SLF001
    out = []
    for a in parser._actions:  # noqa: SLF001
        default = a.default if isinstance(a.default, (str, int, float, bool, list, type(None))) else repr(a.default)
        out.append({"flags": list(a.option_strings), "dest": a.dest, "default": default,
                    "choices": list(a.choices) if a.choices is not None else None, "nargs": a.nargs,
                    "metavar": a.metavar, "const": a.const, "required": a.required, "help": a.help,
                    "type": getattr(a.type, "__name__", None), "action": type(a).__name__,
                    "group": group.get(id(a))})
    return out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_declared_flags_are_the_hand_written_ones(command):
    """Every hand-written argument is still there, the same in every field and in the same order; options
    declared later (shared parts such as the learned alignment's) may be added between them."""
    before = json.loads(SNAPSHOT.read_text())[command]
    kept = {a["dest"] for a in before}
    assert [a for a in dump(command) if a["dest"] in kept] == before


def test_the_commands_declare_their_options():
    """No argument of these commands is added outside the generated parser code (``add_argument`` by hand)."""
    import symmerge.commands as commands

    for name in COMMANDS.values():
        text = (Path(commands.__file__).parent / f"{name}.py").read_text()
        assert "add_argument(" not in text, name


if __name__ == "__main__":  # the snapshot, from the parsers as they are
    SNAPSHOT.write_text(json.dumps({c: dump(c) for c in sorted(COMMANDS)}, indent=1, ensure_ascii=False) + "\n")


@pytest.mark.parametrize("flag,text,error", [
    ("--distill", "many", "--distill takes a number of steps >= 0, got 'many'"),
    ("--distill", "-3", "--distill takes a number of steps >= 0, got -3"),
    ("--distill", "2.5", "--distill takes a number of steps >= 0, got '2.5'"),
    ("--distill-lr", "fast", "--distill-lr must be a positive number, got 'fast'"),
    ("--distill-lr", "0", "--distill-lr must be a positive number, got 0.0"),
    ("--distill-lr", "nan", "--distill-lr must be a positive number, got nan"),
])
def test_the_distillation_flags_are_read_by_the_schema(tmp_path, flag, text, error):
    """``--distill`` and ``--distill-lr`` are read by their declarations (numbers in the parsed options, not texts
    parsed later): a bad value is the API's one line, from the flag and from a config key alike (the key's line
    named)."""
    from symmerge.commands.config_options import parser
    from symmerge.config.command import SymmergeConfig
    from symmerge.config.schema import values
    from symmerge.errors import SymmergeError
    from test_options_schema import _doc

    argv = ["a", "b", "--method", "average", "-o", "o"]
    args = parser("merge").parse_args(argv + ["--distill", "40", "--distill-lr", "3e-3"])
    assert (args.distill, args.distill_lr) == (40, 0.003)
    with pytest.raises(SymmergeError) as from_flag:
        parser("merge").parse_args(argv + [flag, text])
    assert str(from_flag.value) == f"argument {flag}: {error[len(flag) + 1:]}"  # argparse's line names the flag
    keys = {"output": "o", "method": "average", flag[2:].replace("-", "_"): text}
    with pytest.raises(SymmergeError) as from_key:
        values(SymmergeConfig("merge", ["a", "b"], None, {}, keys, _doc(tmp_path, keys)))
    assert str(from_key.value) == f"{tmp_path / 'c.yml'} line 3: {error}"
