"""Arguments of the Python API's barrier and merge entries, as a library user meets them (a probe of the API found
each).

Barrier:

* ``barrier_many`` (and, from 4c44631 to its fix, ``barrier_study``) left the caller's models in eval mode: the
  ``keeps_models`` decorator had slid onto a helper inserted above them;
* ``barrier_many(subsets=...)`` was dropped in silence (the command refused it), ``aligns=None`` stopped in a raw
  TypeError, and ``repair_samples=-2`` passed when REPAIR was off (``merge_models`` refuses it).

Merge:

* ``evaluate=False`` (a documented field) stopped in a raw TypeError ("multiple values for keyword 'evaluate'");
* ``rescale=`` and ``verify=`` beside ``align=AlignOptions(...)`` were dropped in silence (the AlignOptions' own
  values ran): one UsageError;
* ``MergeOptions(data="file")`` was split into its characters ("got 7" files): one file for every model, as the
  keyword form reads it;
* ``shard_size=-1`` (or 0, 1.5, True) wrote one tensor per shard, NaN stopped in ``int()``; ``batch_size=2.5``
  reached torch after the alignment; ``repair_channels=None`` stopped in a raw TypeError; ``distill_lr="fast"`` was
  accepted without ``distill``: each one error before any model is read."""

from __future__ import annotations

import pytest
import torch

from conftest import npz_file, save_folder, vit_folder
from factories import make_model
from symmerge.errors import SymmergeError, UsageError

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    root = tmp_path_factory.mktemp("barrier_api")
    return [vit_folder(root / f"v{s}", s) for s in range(3)], npz_file(root / "d.npz", n=8)


def test_the_callers_models_keep_their_training_mode(three):
    from transformers import ViTForImageClassification

    from symmerge.merge.barrier import barrier_many, barrier_study

    folders, data = three
    models = [ViTForImageClassification.from_pretrained(str(f)) for f in folders]
    for m in models:
        m.train()
    barrier_many(models, data, aligns=("attn",), points=3, progress=False)
    assert all(m.training for m in models)
    barrier_study(models[0], models[1], data, aligns=("attn",), points=3, progress=False)
    assert all(m.training for m in models)


def test_what_only_two_models_have_is_refused_for_more(three):
    from symmerge.merge.barrier import barrier_many

    folders, data = three
    with pytest.raises(SymmergeError, match="--subsets compares two models"):
        barrier_many(folders, data, subsets="single", points=3, progress=False)


@pytest.mark.parametrize("keywords, error, match", [
    ({"aligns": None}, UsageError, "aligns is a tuple of variants"),
    ({"repair_samples": -2}, SymmergeError, "REPAIR samples must be >= 1"),
    ({"batch_size": 2.5}, SymmergeError, "--batch-size must be a whole number"),
    ({"max_examples": 2.5}, SymmergeError, "--max-examples must be a whole number"),
])
def test_bad_arguments_are_one_error_before_any_model_is_read(three, keywords, error, match):
    from symmerge.merge.barrier import barrier_study

    folders, data = three
    with pytest.raises(error, match=match):
        barrier_study(folders[0], folders[1], data, points=3, progress=False, **keywords)


@pytest.fixture(scope="module")
def pair(three):
    folders, data = three
    return folders[:2], data


def test_evaluate_is_a_keyword_too(pair):
    import symmerge

    folders, data = pair
    _, report = symmerge.merge_models(folders, eval_data=data, evaluate=False, align="none", progress=False)
    assert "evaluation" not in report  # the merged model not evaluated
    _, report = symmerge.merge_models(folders, eval_data=data, align="none", progress=False)
    assert "evaluation" in report
    with pytest.raises(UsageError, match="evaluate and evaluate_result are one option"):
        symmerge.merge_models(folders, evaluate=False, evaluate_result=True, progress=False)


def test_alignment_keywords_beside_align_options_are_refused(pair):
    import symmerge
    from symmerge.pipeline.options import AlignOptions

    folders, _ = pair
    with pytest.raises(UsageError, match="rescale and verify beside align=AlignOptions"):
        symmerge.merge_models(folders, align=AlignOptions(symmetries="attn,rescale"), rescale="none", verify=False,
                              progress=False)
    # beside a symmetry list they are read
    _, report = symmerge.merge_models(folders, align="attn,rescale", rescale="none", progress=False)
    assert report["alignment"]["rescale"] == "none"


def test_one_data_file_in_merge_options_is_for_every_model(pair):
    from symmerge.merge.fuse import MergeOptions

    folders, data = pair
    assert MergeOptions(method="regmean", data=data).data == [data]
    assert MergeOptions(eval_data=data).check(2).eval_data == [data]


@pytest.mark.parametrize("keywords, match", [
    ({"shard_size": -1}, "size must be positive"),
    ({"shard_size": 0}, "size must be positive"),
    ({"shard_size": 1.5}, "a whole number of bytes"),
    ({"shard_size": True}, "a whole number of bytes"),
    ({"shard_size": float("nan")}, "a whole number of bytes"),
    ({"batch_size": 2.5}, "--batch-size must be a whole number"),
    ({"max_examples": 2.5}, "--max-examples must be a whole number"),
    ({"repair_channels": None}, "REPAIR channels are a comma list"),
    ({"distill_lr": "fast"}, "--distill-lr must be a positive number"),
])
def test_bad_values_are_one_error_and_nothing_written(tmp_path, keywords, match):
    import symmerge

    a, b = (save_folder(make_model("llama", dtype=torch.float32, seed=s), tmp_path / f"m{s}") for s in range(2))
    with pytest.raises(SymmergeError, match=match):
        symmerge.merge([a, b], tmp_path / "out", progress=False, **keywords)
    assert not (tmp_path / "out").exists()


def test_align_entries_name_a_misspelt_keyword(pair):
    """``align_pair(symetries=...)`` and ``align_to_folder(symmetries=...)`` were Python's bare TypeError."""
    from symmerge.pipeline.align import align_pair

    folders, _ = pair
    with pytest.raises(UsageError, match=r"'symetries' \(an option of the alignment goes in options=AlignOptions"):
        align_pair(*folders, symetries="attn")
    with pytest.raises(UsageError, match="did you mean 'options'"):
        align_pair(*folders, optins=None)


@pytest.mark.parametrize("entry", ["merge", "align_to_folder"])
def test_an_output_that_is_no_path_is_one_usage_error(pair, tmp_path, monkeypatch, entry):
    import symmerge
    from symmerge.pipeline.to_folder import align_to_folder

    folders, _ = pair
    monkeypatch.chdir(tmp_path)
    call = (lambda: symmerge.merge(folders, 5)) if entry == "merge" else (lambda: align_to_folder(*folders, 5))
    with pytest.raises(UsageError, match="out is the output folder, a str or a Path, got 5"):
        call()
    assert list(tmp_path.iterdir()) == []


def test_a_plan_of_another_type_is_one_usage_error(pair):
    import symmerge
    from symmerge.pipeline.align import align_pair

    folders, _ = pair
    with pytest.raises(UsageError, match="plan is an AlignPlan"):
        align_pair(*folders, plan="x")
    with pytest.raises(UsageError, match="plan is a MergePlan"):
        symmerge.merge_models(folders, plan="x")


def test_recommended_beside_a_list_is_refused():
    """``AlignOptions(symmetries="attn", recommended=True)`` aligned the recommended set, the list dropped."""
    from symmerge.pipeline.options import AlignOptions

    with pytest.raises(UsageError, match="recommended=True asks for 'recommended'"):
        AlignOptions(symmetries="attn", recommended=True)
    assert AlignOptions(symmetries="recommended", recommended=True).recommended


def test_method_none_is_the_default_in_every_entry(pair, tmp_path):
    """``merge_models(method=None)`` merged with 'average' (None: not given), ``symmerge.merge(method=None)`` said
    'unknown merge method None'."""
    import symmerge

    folders, _ = pair
    report = symmerge.merge(folders, tmp_path / "out", method=None, align="none", progress=False)
    assert report["method"] == "average"
