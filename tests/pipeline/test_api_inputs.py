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


@pytest.mark.parametrize("wrong, hint", [(None, "NoneType"), (123, "int"), ("list", "one model here"),
                                         ("state_dict", "a state dict: load it")])
def test_a_model_of_the_wrong_type_is_one_error_naming_the_argument(pair, tmp_path, wrong, hint):
    a, b = pair
    wrong = {"list": [a], "state_dict": a.state_dict()}.get(wrong, wrong)
    for call, name in ((lambda: symmerge.align(wrong, b), "model"), (lambda: symmerge.align(a, wrong), "anchor"),
                       (lambda: symmerge.align_pair(a, wrong), "anchor"),
                       (lambda: symmerge.align_to_folder(wrong, b, tmp_path / "out"), "model"),
                       (lambda: symmerge.merge_models([a, wrong], "average"), r"models\[1\]"),
                       (lambda: symmerge.merge([wrong, a], tmp_path / "out"), r"models\[0\]"),
                       (lambda: symmerge.barrier_study(a, wrong, "x.npz"), "model_b")):
        with pytest.raises(UsageError, match=rf"^{name} must be a Hugging Face model folder .*{hint}"):
            call()
    assert not (tmp_path / "out").exists()


def test_one_model_or_none_where_a_list_goes_and_no_output_folder_are_one_error(pair, tmp_path):
    a, b = pair
    for models in (a, "a/", None):
        with pytest.raises(UsageError, match="^models must be a list of models"):
            symmerge.merge_models(models, "average")
        with pytest.raises(UsageError, match="^models must be a list of models"):
            symmerge.merge(models, tmp_path / "out")
    with pytest.raises(UsageError, match="^base must be"):
        symmerge.merge_models([a, b], "task_arithmetic", base=[a])
    for call in (lambda: symmerge.merge([a, b], None), lambda: symmerge.align_to_folder(a, b, None)):
        with pytest.raises(UsageError, match="^out must be the output folder's path"):
            call()
    assert not (tmp_path / "out").exists()
