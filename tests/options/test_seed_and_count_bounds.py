"""Values a hostile-input probe of the learned path found (2026-12-03), each reproduced first: a seed of 2**64 (or a
negative one, which numpy's generator refuses) was a ValueError traceback out of torch's generator; ``--learn-steps``
or ``--distill`` of 2**63 or more an OverflowError traceback out of the progress bar; ``--learn-augment`` had no upper
bound (10**20 views filled 7 GB in 40 s); ``barrier --temperature`` without ``--align-data`` answered in the Python
API's words (``pass align=AlignOptions(align_data=...)``); ``--align none,ffn`` said "unknown symmetry 'none';
choose from ... or none". Each is now one line naming the flag, before any model is read."""

from __future__ import annotations

import pytest

from conftest import run_cli

BIG = str(2 ** 64)

CASES = [
    (("align", "--match", "learned", "--learn-seed", BIG), "--learn-seed", "2**64 - 1"),
    (("align", "--match", "learned", "--learn-seed", "-1"), "--learn-seed", "2**64 - 1"),
    (("align", "--solver-seed", BIG), "--solver-seed", "2**64 - 1"),
    (("align", "--match", "learned", "--learn-steps", str(10 ** 23)), "--learn-steps", "<= 1e+09"),
    (("align", "--match", "learned", "--learn-augment", "65"), "--learn-augment", "<= 64"),
    (("merge", "--distill", "9999999999999999999"), "--distill", "<= 1e+09"),
    (("barrier", "--data", "d.txt", "--temperature"), "--temperature needs unlabeled data", "--align-data FILE"),
    (("align", "--symmetries", "none,ffn"), "'none' stands alone", "cannot be combined"),
]


@pytest.mark.parametrize("argv,first,second", CASES, ids=[" ".join(c[0][:1] + c[0][-2:]) for c in CASES])
def test_one_line_naming_the_flag_before_any_model_is_read(tmp_path, capsys, argv, first, second):
    command, *flags = argv
    models = [str(tmp_path / "not-read-a"), str(tmp_path / "not-read-b")]  # nothing there: read would fail
    try:
        rc = run_cli(command, *models, *flags, "-o", tmp_path / "out")
    except SystemExit as e:  # argparse's own line (a flag's value it cannot take)
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and first in err[0] and second in err[0], err
    assert "Traceback" not in err[0] and "AlignOptions" not in err[0]
    assert not (tmp_path / "out").exists()


def test_the_api_refuses_the_same_seeds():
    from symmerge.errors import SymmergeError
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    for bad in (2 ** 64, -1):
        with pytest.raises(SymmergeError, match="--learn-seed"):
            LearnSettings(seed=bad)
        with pytest.raises(SymmergeError, match="--solver-seed"):
            AlignOptions(solver_seed=bad)
    assert LearnSettings(seed=2 ** 64 - 1).seed == 2 ** 64 - 1
