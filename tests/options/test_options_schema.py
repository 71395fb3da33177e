"""One options schema (issue 39 item 3): every option of ``merge``, ``align`` and ``barrier`` is declared once
(symmerge/options/declared.py) and its flag and its config key are generated from that declaration. Shown here,
table-driven from the declarations themselves: every option's flag and key exist and read a value to the same
thing; a value out of an option's range is the same one line from a flag and from a config key (and from the
command line, exit 2, nothing written); options are immutable once validated; no module reads argparse's
internals or imports a command by name (AST scans, each shown to fail on a planted case)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import yaml

import symmerge
from symmerge.cli import main
from symmerge.commands.config_options import parser
from symmerge.config.command import SymmergeConfig
from symmerge.config.schema import option_names, values
from symmerge.config.source import read_documents
from symmerge.errors import SymmergeError
from symmerge.merge.fuse import MergeOptions
from symmerge.pipeline.options import AlignOptions, LearnSettings
from conftest import vit_folder
from symmerge.options.declared import TABLE

COMMANDS = ("merge", "align", "barrier")
REQUIRED = {"merge": (["m1", "m2"], {"output": "out", "method": "average"}),
            "align": (["m1", "m2"], {"output": "out"}),
            "barrier": (["m1", "m2"], {"output": "out", "data": "d.npz"})}


def _argv(command, models, keys) -> list[str]:
    return [*models, *[x for k, v in keys.items() for x in (TABLE.get(command, k).flag, str(v))]]


VALID = {"align": "attn,ffn", "symmetries": "attn,ffn", "layers": "0,1", "device": "cpu:0",
         "lora_merge_dtype": "bfloat16", "repair_channels": "ffn,attn_out", "shard_size": "3GB"}


def sample(option):
    """(what a config writes, what the command line writes) for a value of ``option`` other than its default,
    chosen from its declaration: its last choice, a number above its minimum, a switch turned the other way."""
    if option.form in ("switch", "const"):
        return True, [option.flag]
    if option.form == "onoff":
        return (not option.default), [option.flag if not option.default else "--no-" + option.flag[2:]]
    if option.choices:
        value = next(c for c in reversed(option.choices) if c != option.default)
    elif option.parse is int:
        value = int(option.minimum or 0) + 3
    elif option.parse is float:
        value = (option.minimum or 0) + 2.5
    elif option.name == "distill":  # a whole number of steps
        value = 3
    elif option.name == "weights":
        value = "0.25,0.75"
    elif option.name == "param":
        value = "density=0.4"
    elif option.name in VALID:  # text read by a reader of its own (symmerge.options.parse): a value it takes
        value = VALID[option.name]
    elif option.parse is not None:  # --learn-dirichlet: a number or 'auto'
        value = 2.5
    else:
        value = f"{option.name}-value"
    if option.form == "append":
        return [value, value], [option.flag, str(value), option.flag, str(value)]
    if option.joins and isinstance(value, str) and option.name != "weights":
        return value.split(","), [option.flag, value]
    return value, [option.flag, str(value)]


def _doc(tmp_path, keys: dict):
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return read_documents(path)[0]


def _cases():
    for command in COMMANDS:
        for option in TABLE.of(command):
            if option.form != "positional" and option.name not in REQUIRED[command][1]:
                yield pytest.param(command, option.name, id=f"{command}-{option.name}")


@pytest.mark.parametrize("command, name", list(_cases()))
def test_every_flag_and_its_config_key_read_the_same_value(tmp_path, command, name):
    option = TABLE.get(command, name)
    models, required = REQUIRED[command]
    written, argv = sample(option)
    assert name in option_names(command)  # the key exists
    assert option.flag in parser(command)._option_string_actions  # and so does the flag  # noqa: SLF001
    from_flag = vars(parser(command).parse_args(_argv(command, models, required) + argv))
    keys = {**required, name: written}
    from_key = vars(values(SymmergeConfig(command, models, None, {}, keys, _doc(tmp_path, keys))))
    assert from_flag[option.attr] == from_key[option.attr]
    assert from_flag[option.attr] != option.default  # the sample is not the default: the test can tell
    from_flag.pop("handler")
    assert from_flag == from_key  # and nothing else differs


def test_the_table_covers_every_option_of_the_parsers():
    for command in COMMANDS:
        declared = {o.flag for o in TABLE.of(command) if o.form != "positional"}
        flags = {next((f for f in a.option_strings if f.startswith("--")), None)
                 for a in parser(command)._actions if a.option_strings}  # noqa: SLF001
        assert flags == declared, command


RANGED = [pytest.param(c, o.name, id=f"{c}-{o.name}") for c in COMMANDS for o in TABLE.of(c) if o.minimum is not None]


@pytest.mark.parametrize("command, name", RANGED)
def test_a_value_out_of_range_is_the_same_line_from_a_flag_and_a_key(tmp_path, command, name):
    option = TABLE.get(command, name)
    models, required = REQUIRED[command]
    low = option.minimum - 1 if option.parse is int else option.minimum - 0.5
    with pytest.raises(SymmergeError) as flag:
        parser(command).parse_args(_argv(command, models, required) + [option.flag, str(low)])
    keys = {**required, name: low}
    with pytest.raises(SymmergeError) as key:
        values(SymmergeConfig(command, models, None, {}, keys, _doc(tmp_path, keys)))
    words = f"must be >= {option.minimum:g}, got {low}"  # argparse's line names the flag: the key's line, its flag
    assert str(flag.value) == f"argument {option.flag}: {words}"
    assert str(key.value) == f"{tmp_path / 'c.yml'} line {len(keys)}: {option.flag} {words}"
    option.in_range(option.minimum)  # the bound itself is accepted


def test_out_of_range_on_the_command_line_and_in_a_run_config_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as refused:  # argparse's refusal, naming the command and the flag
        main(["merge", "a", "b", "--method", "average", "--joint-rounds", "-1", "-o", str(out)])
    assert refused.value.code == 2
    flag_err = capsys.readouterr().err
    cfg = tmp_path / "c.yml"
    cfg.write_text("merge_method: average\nmodels: [a, b]\njoint_rounds: -1\n")
    assert main(["run", str(cfg), str(out)]) == 2
    key_err = capsys.readouterr().err
    assert flag_err == ("symmerge merge: error: argument --joint-rounds: must be >= 0, got -1 "
                        "(see symmerge merge --help)\n")
    assert key_err == f"symmerge: error: {cfg} line 3: --joint-rounds must be >= 0, got -1\n"
    assert not out.exists()


def test_options_are_immutable_once_validated():
    opts = MergeOptions(method="average", head_from=2, repair_channels="ffn, norm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.head_from = 0
    checked = opts.check(3)
    assert checked is not opts and checked.head_from == 2 and checked.repair_channels == ("ffn", "norm")
    assert opts.repair_channels == "ffn, norm"  # the object given is left as it is
    assert checked.check(3) == checked  # validating the validated changes nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        symmerge.BarrierOptions().points = 3


def test_the_plan_keeps_the_validated_options_and_the_merge_runs_on_them(tmp_path):
    from symmerge.merge.plan import plan_merge

    folders = [str(vit_folder(tmp_path / f"vit{s}", s)) for s in (0, 1, 2)]
    given = MergeOptions(method="task_arithmetic", base=folders[2], head_from=1, progress=False, evaluate=False,
                         align=AlignOptions(symmetries="none"), params={"scale": 0.5})
    plan = plan_merge(folders[:2], given, mode="stream")
    assert plan.options == given.check(2) and plan.options.head_from == 1
    assert plan.options.params != given.params  # the method's defaults filled in on the copy only
    report = symmerge.merge(folders[:2], tmp_path / "out", given)
    assert report["head"]["from_index"] == 1 and report["params"] == plan.options.params


ROOT = Path(symmerge.__file__).parent
PRIVATE = {"_actions", "_option_string_actions", "_AppendAction", "_StoreAction", "_defaults", "_group_actions",
           "_subparsers", "_registries"}


def argparse_internals(sources: dict) -> list[str]:
    """``path:line`` of every read of argparse's private names, and of every ``importlib`` import of a
    command outside ``cli.py`` (the one place that imports the commands by name)."""
    hits = []
    for p, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in PRIVATE:
                hits.append(f"{p}:{node.lineno}")
            if (p != "cli.py" and isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
                    and any(isinstance(a, ast.Constant) and "commands" in str(a.value)
                            or isinstance(a, ast.JoinedStr) and "commands" in ast.unparse(a) for a in node.args)):
                hits.append(f"{p}:{node.lineno}")
    return sorted(hits)


def _sources() -> dict:
    return {str(p.relative_to(ROOT)): p.read_text() for p in ROOT.rglob("*.py")}


def test_no_module_reads_argparse_internals_or_imports_a_command_by_name():
    assert argparse_internals(_sources()) == []


def test_the_internals_scan_finds_planted_cases():
    planted = {"commands/x.py": "def f(p):\n    return [a for a in p._actions]\n",
               "config/y.py": "import argparse\nisinstance(a, argparse._AppendAction)\n",
               "config/z.py": "import importlib\nm = importlib.import_module(f'symmerge.commands.{name}')\n",
               "cli.py": "import importlib\nm = importlib.import_module(f'symmerge.commands.{name}')\n"}
    assert argparse_internals(planted) == ["commands/x.py:2", "config/y.py:2", "config/z.py:2"]


# the options whose range the Python API refuses too: option name -> the options object made with a value
API_RANGES = {
    "joint_rounds": lambda v: MergeOptions(joint_rounds=v).check(2),
    "align_samples": lambda v: AlignOptions(align_samples=v),
    "max_sweeps": lambda v: AlignOptions(max_sweeps=v),
    "solver_budget": lambda v: AlignOptions(solver_budget=v),
    "learn_steps": lambda v: LearnSettings(steps=v),
    "learn_batch": lambda v: LearnSettings(batch=v),
    "learn_positions": lambda v: LearnSettings(positions=v),
    "learn_max_length": lambda v: LearnSettings(max_length=v),
    "learn_check_batches": lambda v: LearnSettings(check_batches=v),
    "learn_augment": lambda v: LearnSettings(augment=v),
}


@pytest.mark.parametrize("name", sorted(API_RANGES))
def test_the_declared_range_is_the_one_the_python_api_enforces(name):
    option = TABLE.get("merge", name)
    step = 1 if option.parse is int else 0.5
    API_RANGES[name](option.minimum)  # the bound: accepted by both
    option.in_range(option.minimum)
    with pytest.raises(SymmergeError):
        API_RANGES[name](option.minimum - step)  # just below: refused by both
    with pytest.raises(SymmergeError):
        option.in_range(option.minimum - step)


@pytest.mark.parametrize("name", sorted(API_RANGES))
def test_the_api_refuses_an_out_of_range_value_with_the_flags_own_line(name):
    """The range is declared once (``symmerge/option_ranges.py``, read by the declaration and the options object): a value
    just below it is the same one line from the Python API's constructor and from the flag."""
    from symmerge.option_ranges import MINIMA

    option = TABLE.get("merge", name)
    assert option.minimum == MINIMA[name] and set(API_RANGES) == set(MINIMA)
    low = option.minimum - (1 if option.parse is int else 0.5)
    with pytest.raises(SymmergeError) as api:
        API_RANGES[name](low)
    with pytest.raises(SymmergeError) as flag:
        option.in_range(low)
    assert str(api.value) == str(flag.value) == f"{option.flag} must be >= {option.minimum:g}, got {low}"
