"""The Python API as a library user meets it: a misspelt keyword, a wrong type or a bad value given to the public
entries (``symmerge.align``, ``align_pair``, ``align_to_folder``, ``merge_models``, ``symmerge.merge``) and their
options objects is one :class:`SymmergeError` (a :class:`UsageError`, also a ``TypeError``, for a wrong argument)
that names it, before any work and without output; never an ``AttributeError`` or ``TypeError`` from deep inside."""

from __future__ import annotations

import pytest
import torch

import symmerge
from factories import make_model
from symmerge.errors import SymmergeError, UsageError

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pair():
    return (make_model("llama", head=True, dtype=torch.float32, seed=0),
            make_model("llama", head=True, dtype=torch.float32, seed=1))


@pytest.mark.parametrize("make, wrong, right", [
    (lambda: symmerge.AlignOptions(symetries="attn"), "symetries", "symmetries"),
    (lambda: symmerge.LearnSettings(stesp=3), "stesp", "steps"),
    (lambda: symmerge.MergeOptions(methd="ties"), "methd", "method"),
    (lambda: symmerge.BarrierOptions(pionts=5), "pionts", "points"),
])
def test_a_misspelt_keyword_of_an_options_object_names_the_field(make, wrong, right):
    with pytest.raises(UsageError, match=rf"unexpected keyword argument '{wrong}' \(did you mean '{right}'\?\)"):
        make()


def test_a_misspelt_keyword_of_align_and_merge_models_names_the_option(pair):
    a, b = pair
    with pytest.raises(UsageError, match=r"'rescal' \(did you mean 'rescale'\?\)"):
        symmerge.align(a, b, rescal="joint")
    with pytest.raises(UsageError, match=r"merge_models\(\) got an unexpected keyword argument 'wieghts' "
                                         r"\(did you mean 'weights'\?\)"):
        symmerge.merge_models([a, b], "average", wieghts=[1, 2])
    with pytest.raises(TypeError):  # still Python's own kind of error for it
        symmerge.AlignOptions(symetries="attn")


def test_the_checked_constructors_keep_their_signatures_and_fields():
    import inspect

    assert "symmetries" in inspect.signature(symmerge.AlignOptions).parameters
    assert symmerge.AlignOptions(symmetries="attn").with_(max_sweeps=3).max_sweeps == 3
    assert symmerge.MergeOptions(method="ties").method == "ties"
