"""``symmerge.trust_remote_code(allowed)``, the library's switch for code shipped in model folders, takes True or
False only: ``"no"`` read as true would let a folder's code run, so anything else is one error naming the argument,
at the call (before a ``with`` block is entered), and the setting stays as it was."""

from __future__ import annotations

import pytest

import symmerge
from symmerge.errors import UsageError
from symmerge.io.hf import remote_code_allowed


@pytest.mark.parametrize("wrong", ["no", "yes", 1, 0, None, [False]])
def test_anything_but_true_or_false_is_one_error_naming_the_argument(wrong):
    with pytest.raises(UsageError, match=rf"^allowed must be True or False, got {wrong!r}".replace("[", r"\[")):
        symmerge.trust_remote_code(wrong)
    with pytest.raises(UsageError, match="^allowed must be True or False"):
        with symmerge.trust_remote_code(wrong):
            pytest.fail("the block ran")
    assert remote_code_allowed() is False


def test_true_and_false_set_it_inside_the_block_only():
    with symmerge.trust_remote_code():
        assert remote_code_allowed() is True
        with symmerge.trust_remote_code(False):
            assert remote_code_allowed() is False
        assert remote_code_allowed() is True
    assert remote_code_allowed() is False
