"""One options object per concern, with the same defaults in Python and on the CLI: a command run with
only its required arguments builds exactly the options object Python builds with no arguments — except
the symmetries, by design (the CLI aligns ``recommended``, Python's ``align`` the paper's set)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from symmerge.cli import build_parser
from symmerge.commands.alignment_args import alignment_options
from symmerge.commands.merge import options_from
from symmerge.merge.fuse import MergeOptions
from symmerge.pipeline.options import AlignOptions

BY_DESIGN = {"symmetries", "recommended"}


def _differences(a, b, skip=()) -> list[str]:
    return [f.name for f in fields(a) if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)]


@pytest.mark.parametrize("argv", [["align", "m", "a", "-o", "out"], ["barrier", "m", "a", "--data", "d.npz", "-o", "out"]])
def test_alignment_flags_default_to_the_python_defaults(argv):
    args = build_parser().parse_args(argv)
    cli = alignment_options(args, "recommended")
    assert cli.recommended and cli.symmetries
    assert _differences(cli, AlignOptions(), BY_DESIGN) == []
    assert cli.learn == AlignOptions().learn  # the learned alignment's settings too, field by field
    # negative control: a flag that is given does show up as a difference
    changed = alignment_options(build_parser().parse_args(argv + ["--max-sweeps", "7"]), "recommended")
    assert _differences(changed, AlignOptions(), BY_DESIGN) == ["max_sweeps"]


def test_merge_flags_default_to_merge_options():
    args = build_parser().parse_args(["merge", "x", "y", "-o", "out", "--method", MergeOptions().method])
    cli, py = options_from(args), MergeOptions()
    assert _differences(cli, py, {"align"}) == []
    assert _differences(cli.align, replace(py.align, verify=cli.align.verify)) == []  # Python merges align 'recommended' too
    assert cli.align.verify == py.align.verify
