"""The learned alignment's α range as options (issue 42 item 3): ``--learn-alpha-low LO`` and
``--learn-alpha-high HI`` (config keys ``learn_alpha_low``, ``learn_alpha_high``) set
``LearnSettings(alpha_low, alpha_high)``; a flag and its key give the same settings; a range outside
0 <= LO <= HI <= 1 is one ``symmerge: error:`` line (exit 2, nothing written), from a flag and from a config."""

from __future__ import annotations

import pytest
import yaml

from symmerge.cli import main
from symmerge.commands.config_options import parser
from symmerge.config.command import SymmergeConfig
from symmerge.config.schema import values
from symmerge.config.source import read_documents
from symmerge.errors import SymmergeError
from symmerge.options.build import align_options, learn_settings
from symmerge.pipeline.options import LearnSettings

BASE = ["m1", "m2", "-o", "out", "--method", "average", "--match", "learned", "--align-data", "d.npz"]
KEYS = {"output": "out", "method": "average", "match": "learned"}


def _from_key(tmp_path, keys: dict):
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump({**KEYS, **keys}, sort_keys=False))
    doc = read_documents(path)[0]
    return values(SymmergeConfig("merge", ["m1", "m2"], None, {}, {**KEYS, **keys}, doc))


@pytest.mark.parametrize("lo, hi", [(0.3, 0.7), (0.5, 0.5), (0.0, 1.0)])
def test_the_flags_and_the_keys_set_the_same_alpha_range(tmp_path, lo, hi):
    args = parser("merge").parse_args(BASE + ["--learn-alpha-low", str(lo), "--learn-alpha-high", str(hi)])
    from_flags = learn_settings(args)
    from_keys = learn_settings(_from_key(tmp_path, {"learn_alpha_low": lo, "learn_alpha_high": hi}))
    assert from_flags == from_keys == LearnSettings(alpha_low=lo, alpha_high=hi)
    assert (from_flags.alpha_low, from_flags.alpha_high) == (lo, hi)


def test_one_end_given_keeps_the_other_default(tmp_path):
    default = LearnSettings()
    args = parser("merge").parse_args(BASE + ["--learn-alpha-low", "0.4"])
    assert learn_settings(args) == learn_settings(_from_key(tmp_path, {"learn_alpha_low": 0.4}))
    assert (learn_settings(args).alpha_low, learn_settings(args).alpha_high) == (0.4, default.alpha_high)
    assert (default.alpha_low, default.alpha_high) == (0.1, 0.9)  # the defaults are unchanged


def test_the_range_reaches_the_align_options(tmp_path):
    data = tmp_path / "d.npz"
    data.write_bytes(b"")  # only its existence is checked before loading
    argv = [a if a != "d.npz" else str(data) for a in BASE]
    args = parser("merge").parse_args(argv + ["--learn-alpha-low", "0.25", "--learn-alpha-high", "0.75"])
    learn = align_options(args, args.align).learn
    assert (learn.alpha_low, learn.alpha_high) == (0.25, 0.75)


BAD = [(["--learn-alpha-low", "0.8", "--learn-alpha-high", "0.2"],
        "--learn-alpha-low/--learn-alpha-high: the learned alignment's α range must satisfy 0 <= low <= high <= 1, "
        "got 0.8 and 0.2"),
       (["--learn-alpha-high", "1.5"],
        "--learn-alpha-low/--learn-alpha-high: the learned alignment's α range must satisfy 0 <= low <= high <= 1, "
        "got 0.1 and 1.5"),
       (["--learn-alpha-low", "-0.1"], "--learn-alpha-low must be >= 0, got -0.1")]
FLAG_LINE = {2: "symmerge merge: error: argument --learn-alpha-low: must be >= 0, got -0.1 (see symmerge merge --help)"}


@pytest.mark.parametrize("flags, line", BAD)
def test_a_bad_range_is_one_line_from_the_api_a_flag_and_a_key(tmp_path, capsys, flags, line):
    lo = float(flags[flags.index("--learn-alpha-low") + 1]) if "--learn-alpha-low" in flags else 0.1
    hi = float(flags[flags.index("--learn-alpha-high") + 1]) if "--learn-alpha-high" in flags else 0.9
    with pytest.raises(SymmergeError):
        LearnSettings(alpha_low=lo, alpha_high=hi)
    out = tmp_path / "out"
    data = tmp_path / "d.npz"
    data.write_bytes(b"")
    argv = ["merge", "m1", "m2", "-o", str(out), "--method", "average", "--match", "learned",
            "--align-data", str(data), *flags]
    if BAD.index((flags, line)) in FLAG_LINE:  # a flag's own range: argparse's line, naming the command
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2 and capsys.readouterr().err == FLAG_LINE[BAD.index((flags, line))] + "\n"
    else:
        assert main(argv) == 2
        assert capsys.readouterr().err == f"symmerge: error: {line}\n"
    assert not out.exists()
    cfg = tmp_path / "c.yml"
    keys = {"merge_method": "average", "models": ["m1", "m2"], "match": "learned", "align_data": str(data),
            **{f[2:].replace("-", "_"): float(v) for f, v in zip(flags[::2], flags[1::2])}}
    cfg.write_text(yaml.safe_dump(keys, sort_keys=False))
    assert main(["run", str(cfg), str(out)]) == 2
    err = capsys.readouterr().err  # run echoes the command line it stands for, then the one error line
    last = err.splitlines()[-1]  # a key out of its declared range also names the config and its line
    assert last.startswith("symmerge: error: ") and last.endswith(line) and "Traceback" not in err
    assert not out.exists()
