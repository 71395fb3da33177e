"""Start-up (``symmerge/options/declared.py`` and the package's lazy names): the flags' defaults that MergeOptions and
BarrierOptions also have are one value, read from :mod:`symmerge.merge.option_defaults` by both, so that declaring
the flags imports neither the fusion nor the barrier study; the package imports its public names when first used.
Checked in child processes: ``import symmerge`` and ``symmerge run --help`` (whose text is unchanged:
``test_hand_written_flags.py``) import none of ``merge.fuse``, ``merge.barrier``, the alignment pipeline or numba,
and every public name still resolves to its module's object."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import MISSING, fields

import pytest

HEAVY = ("symmerge.merge.fuse", "symmerge.merge.barrier", "symmerge.pipeline.align", "symmerge.pipeline.joint",
         "symmerge.pipeline.learn", "symmerge.evaluate.metrics", "numba")


def _default(cls, name):
    f = next(f for f in fields(cls) if f.name == name)
    return f.default if f.default is not MISSING else f.default_factory()


def test_the_dataclasses_and_the_declared_flags_share_one_value_per_default():
    from symmerge.merge import option_defaults
    from symmerge.merge.barrier import BarrierOptions
    from symmerge.merge.fuse import MergeOptions
    from symmerge.options import declared

    for cls, values, read in ((MergeOptions, option_defaults.MERGE, declared.M),
                              (BarrierOptions, option_defaults.BARRIER, declared.B)):
        for name, value in values.items():
            assert _default(cls, name) == value == read(name), (cls.__name__, name)
    table = {(o.attr, c): o.default for o in declared.OPTIONS for c in o.commands}
    assert table[("joint_rounds", "merge")] == _default(MergeOptions, "joint_rounds")
    assert table[("points", "barrier")] == _default(BarrierOptions, "points")
    assert table[("shard_size", "merge")] == _default(MergeOptions, "shard_size")


def _modules(code: str, argv0: str = "my_script.py") -> list:
    script = f"import sys, json\nsys.argv[0] = {argv0!r}\n{code}\nprint(json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [
    "import symmerge",
    "from symmerge.cli import build_parser\nbuild_parser().parse_args(['run', 'c.yml', 'out'])",
])
def test_the_package_and_the_command_line_import_no_fusion_study_pipeline_or_numba(code):
    modules = _modules(code)  # one child process (a fresh interpreter per check is what matters, not per name)
    loaded = [m for m in HEAVY if m in modules]
    assert not loaded, loaded


def test_every_public_name_resolves_to_its_modules_object():
    import symmerge
    from symmerge.merge import barrier, fuse
    from symmerge.pipeline import align, options, to_folder

    assert symmerge.align_pair is align.align_pair and symmerge.MergeOptions is fuse.MergeOptions
    assert symmerge.barrier_study is barrier.barrier_study and symmerge.AlignOptions is options.AlignOptions
    assert symmerge.align_to_folder is to_folder.align_to_folder and callable(symmerge.merge)
    assert all(getattr(symmerge, name) is not None for name in symmerge.__all__)
    assert set(symmerge.__all__) <= set(dir(symmerge))
    with pytest.raises(AttributeError):
        symmerge.no_such_name


def test_a_subpackage_is_an_attribute_of_the_package_as_before():
    """The eager package had imported its subpackages (``import symmerge; symmerge.families.spec_for`` worked); the
    lazy one imports one when it is first named (a module inside it is imported as Python imports any)."""
    got = _modules("import symmerge\nassert callable(symmerge.families.spec_for) and callable(symmerge.merge)\n"
                   "assert symmerge.config.__name__ == 'symmerge.config'")
    assert "symmerge.families" in got and "symmerge.config" in got
