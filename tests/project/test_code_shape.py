"""The code's shape (issue 39, item 5): short functions with few parameters as the habit, typed state rather than
attribute bags. A NEW function over :data:`~guards.MAX_LINES` lines or over :data:`~guards.MAX_PARAMETERS`
parameters fails here, and so does a new attribute bag (``__dict__.update``, ``vars(x).update``, ``setattr`` with a
computed name). The ones that remain are listed below, each with its reason; the lists can only shrink: an entry
that no longer applies (the function was shortened, split, narrowed or removed) fails too, so that it is crossed
off. Measure the counts with ``python benchmarks/code_shape.py``."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from guards import MAX_LINES, MAX_PARAMETERS, attribute_bags, bags, shape

# path::function (relative to symmerge/) → why it is still over MAX_LINES lines
LONG = {
    "pipeline/learn.py::_learn_round": "the learned matcher's optimisation round (the dual engineer's area this "
                                       "round: its signature only is changed here)",
}

# path::function (relative to symmerge/) → why it still takes more than MAX_PARAMETERS parameters
WIDE = {
    "merge/kernels_whole.py::_combine": "a numba kernel: its arrays and scalars are its parameters (the rules "
                                        "engineer's file)",
    "merge/plan.py::merge_report": "the report's entries (the plans engineer builds one report builder)",
    "pipeline/to_folder.py::align_to_folder": "the public API of `symmerge align` (the plans engineer's file)",
    "pipeline/activations.py::match_activations": "the activation matcher (the scale engineer's file this round)",
    "demo/lm.py::train_lm": "a demo training loop's hyper-parameters, called by keyword from benchmarks",
    "demo/lm.py::train_llama": "a demo training loop's hyper-parameters, called by keyword from benchmarks",
    "demo/lm.py::train_gpt2": "a demo training loop's hyper-parameters, called by keyword from benchmarks",
    "demo/lm.py::llama_config": "a demo model's sizes, called by keyword from benchmarks",
    "demo/train.py::train_vit": "a demo training loop's hyper-parameters, called by keyword from benchmarks",
    "demo/train.py::vit_config": "a demo model's sizes, called by keyword from benchmarks",
    "core/resolve.py::resolve": "a spec's names resolved against a checkpoint: the public entry, called by keyword "
                                "from 20 places",
    "families/roles.py::build": "a family spec's roles, called by keyword from every family module",
    "pipeline/align.py::align": "the public Python API `symmerge.align(...)`, keyword for keyword the CLI's",
    "pipeline/learn_joint.py::learn_mixture": "the dual engineer's area this round",
    "pipeline/engine.py::solve": "the descent's knobs (init, start, lazy, tol, max_sweeps), passed by keyword from "
                                 "15 places, benchmarks' functools.partial among them: a Descent record is next",
}

# path::function (relative to symmerge/) → why it still sets attributes by computed names
BAGS: dict = {}  # none left


SPLIT = "split it into short functions (a stage each, handing on a typed record)"
NARROW = "group its parameters into the typed records that exist (options objects, plans, stage records), not **kwargs"
DECLARE = "declare the attributes (a dataclass, one record per stage) instead of setting them from data"


def _report(kind: str, found: dict | list, allowed: dict, advice: str) -> list[str]:
    new = [f"{k} ({found[k]})" if isinstance(found, dict) else k for k in found if k not in allowed]
    gone = [k for k in allowed if k not in found]
    return ([f"new {kind}: {', '.join(new)} — {advice}; do not list it"] if new else []) + \
           ([f"{kind} no longer applies: {', '.join(gone)} — cross it off the list in tests/project/test_code_shape.py"]
            if gone else [])


def test_no_new_function_over_the_line_limit():
    long, _ = shape()
    assert not (problems := _report(f"function over {MAX_LINES} lines", long, LONG, SPLIT)), problems


def test_no_new_function_over_the_parameter_limit():
    _, wide = shape()
    assert not (problems := _report(f"function over {MAX_PARAMETERS} parameters", wide, WIDE, NARROW)), problems


def test_no_attribute_bags_in_the_product():
    assert not (problems := _report("attribute bag", bags(), BAGS, DECLARE)), problems


def test_every_entry_says_why():
    for table in (LONG, WIDE, BAGS):
        assert all(isinstance(v, str) and len(v) > 5 for v in table.values())


def _plant(tmp_path, text: str):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "planted.py").write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


def test_a_planted_long_function_fails_and_the_limit_itself_passes(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES - 1))
    # at_limit: its def line and MAX_LINES - 1 lines; C.over: one line more
    pkg = _plant(tmp_path, f"class C:\n    def at_limit(self):\n{body}\n    def over(self):\n{body}        y = 1\n")
    long, wide = shape(pkg)
    assert long == {"planted.py::C.over": MAX_LINES + 1} and not wide
    assert _report("long", long, LONG, SPLIT)[0].startswith("new long: planted.py::C.over (81)")


def test_a_planted_wide_function_fails_and_the_limit_itself_passes(tmp_path):
    ten = ", ".join(f"a{i}" for i in range(MAX_PARAMETERS))
    pkg = _plant(tmp_path, f"""
        class C:
            def fine(self, {ten}):
                def inner({ten}, *more):
                    pass

        def outer({ten}):
            def fine_too(*, {ten}):
                pass
        """)
    long, wide = shape(pkg)
    assert not long and wide == {"planted.py::C.fine.inner": MAX_PARAMETERS + 1}
    assert _report("wide", wide, WIDE, NARROW)


def test_a_planted_attribute_bag_fails_and_declared_attributes_pass():
    assert attribute_bags("""
class Run:
    def __init__(self, **kw):
        self.__dict__.update(kw)

def fill(x, pairs):
    for k, v in pairs:
        setattr(x, k, v)

def also(x, d):
    vars(x).update(d)

def declared(x):
    setattr(x, "name", 1)
    x.other = 2
    return getattr(x, "name")
""") == ["Run.__init__", "also", "fill"]


def test_the_old_run_bag_would_have_been_caught():
    """``_Run`` as it was in merge/fuse.py before the typed stage records."""
    assert attribute_bags("class _Run:\n    def __init__(self, **kw):\n        self.timings = {}\n"
                          "        self.__dict__.update(kw)\n") == ["_Run.__init__"]


def test_the_stage_records_are_frozen_dataclasses():
    """The in-memory merge's and the joint alignment's stages hand on frozen records (docs/code_shape.md): a stage
    cannot write into an earlier stage's record."""
    from symmerge.merge import fuse
    from symmerge.pipeline import joint

    records = [fuse.Loaded, fuse.Aligned, fuse.Statistics, fuse.Merged, fuse.Evaluated, joint._Joint, joint._Steps,
               joint._Frame, joint.JointSteps]
    for record in records:
        assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen, record.__name__
    done = fuse.Evaluated(evaluation=None, seconds=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.seconds = 2.0
