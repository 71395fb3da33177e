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


@pytest.mark.parametrize("make, message", [
    (lambda: symmerge.AlignOptions(verify="no"), r"verify must be True or False, got 'no'"),
    (lambda: symmerge.AlignOptions(untie="yes"), r"untie must be True or False"),
    (lambda: symmerge.MergeOptions(evaluate="false"), r"evaluate must be True or False"),
    (lambda: symmerge.BarrierOptions(repair=1), r"repair must be True or False"),
    (lambda: symmerge.AlignOptions(learn={"steps": 3}), r"learn must be a LearnSettings"),
    (lambda: symmerge.AlignOptions(symmetries=5), r"symmetries must be a comma list"),
    (lambda: symmerge.AlignOptions(symmetries=["attn", 5]), r"symmetries must be a comma list"),
    (lambda: symmerge.AlignOptions(layers=1.5), r"layers must be layer indices"),
    (lambda: symmerge.AlignOptions(layers=["x"]), r"layers must be layer indices"),
    (lambda: symmerge.AlignOptions(max_sweeps=float("nan")), r"--max-sweeps must be a whole number >= 1, got nan"),
    (lambda: symmerge.AlignOptions(max_sweeps=2.5), r"--max-sweeps must be a whole number >= 1, got 2.5"),
    (lambda: symmerge.AlignOptions(align_samples="10"), r"--align-samples must be a number >= 1, got '10'"),
    (lambda: symmerge.LearnSettings(steps=float("nan")), r"--learn-steps must be"),
    (lambda: symmerge.MergeOptions(align=3), r"align must be an AlignOptions or a symmetry list"),
    (lambda: symmerge.BarrierOptions(align="attn"), r"align must be an AlignOptions \(the variants' symmetries go in "
                                                    r"aligns=\)"),
    (lambda: symmerge.BarrierOptions(points=float("nan")), r"--points must be a whole number >= 2"),
    (lambda: symmerge.BarrierOptions(points=2.5), r"--points must be a whole number >= 2"),
])
def test_a_bad_value_in_an_options_object_is_one_error_naming_the_field(make, message):
    with pytest.raises(SymmergeError, match=message):
        make()


def test_the_values_the_options_objects_read_for_the_user():
    assert symmerge.AlignOptions(layers="0,1").layers == (0, 1)
    assert symmerge.AlignOptions(layers=1).layers == (1,)
    assert symmerge.AlignOptions(layers=range(2)).layers == (0, 1)
    with pytest.raises(UsageError, match="names layer 0 twice"):  # each instance was bound, and solved, twice
        symmerge.AlignOptions(layers="0,0")
    assert symmerge.AlignOptions(solver_budget=0.5).solver_budget == 0.5  # seconds: a fraction is fine
    assert symmerge.MergeOptions(align="attn,ffn").align.symmetries == ("attn", "ffn")
    assert symmerge.MergeOptions(align="none").align.symmetries == ()
    assert symmerge.BarrierOptions(aligns="attn,ffn").aligns == ("attn,ffn",)  # one variant, not one per letter


def test_an_options_argument_of_the_wrong_type_is_one_error(pair, tmp_path):
    a, b = pair
    for call in (lambda: symmerge.align_pair(a, b, "attn"), lambda: symmerge.align_to_folder(a, b, tmp_path / "o", "attn")):
        with pytest.raises(UsageError, match=r"options must be an AlignOptions, got str \(symmetries go in "
                                             r"AlignOptions\(symmetries='attn'\)\)"):
            call()
    for call in (lambda: symmerge.merge([a, b], tmp_path / "o", "average"),
                 lambda: symmerge.merge_models([a, b], options="average")):
        with pytest.raises(UsageError, match=r"options must be a MergeOptions, got str \(a method goes in "
                                             r"MergeOptions\(method='average'\)\)"):
            call()
    assert not (tmp_path / "o").exists()


def _modes(model) -> list:
    return [m.training for m in model.modules()]


def test_the_callers_models_keep_their_train_mode_and_weights(pair, tmp_path):
    a, b = (m.__class__(m.config).train() for m in pair)  # fresh modules in train() mode, as after training
    for m, src in zip((a, b), pair):
        m.load_state_dict(src.state_dict())
    a.model.layers[0].eval()  # and one submodule in eval mode: every module's flag is kept
    modes, weights = [_modes(a), _modes(b)], [{k: v.clone() for k, v in m.state_dict().items()} for m in (a, b)]
    aligned, report = symmerge.align(a, b, symmetries="attn,ffn")
    assert report["verify_max_rel_diff"] <= 1e-5 and not aligned.training
    symmerge.align_pair(a, b, symmerge.AlignOptions(symmetries="recommended"))
    symmerge.merge_models([a, b], "average", progress=False)
    symmerge.align_to_folder(a, b, tmp_path / "aligned", symmerge.AlignOptions(symmetries="attn"), progress=False)
    assert [_modes(a), _modes(b)] == modes
    for m, sd in zip((a, b), weights):
        assert all(torch.equal(v, sd[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("keywords, message", [
    (dict(weights="1,2"), r"weights must be a list of numbers, one per model, got '1,2'"),
    (dict(params=0.5), r"params must be a dict of the method's parameters"),
    (dict(anchor=1.5), r"^anchor \(an index into models, a folder or a model\) must be"),
    (dict(anchor=True), r"^anchor .* got bool"),
    (dict(head_from=1.5), r"head_from must be an index into the models, got 1.5"),
])
def test_a_merge_field_of_the_wrong_type_is_one_error(pair, keywords, message):
    with pytest.raises(UsageError, match=message):
        symmerge.merge_models(list(pair), "average", progress=False, **keywords)


def test_align_takes_progress_as_merge_does_and_checks_its_inputs(pair, capsys):
    a, b = pair
    _, report = symmerge.align(a, b, symmetries="attn", progress=True)  # as merge_models(progress=True)
    assert report["verify_max_rel_diff"] <= 1e-5 and "verified" in capsys.readouterr().err
    with pytest.raises(UsageError, match="progress must be True, False or a callback"):
        symmerge.align(a, b, progress="yes")
    with pytest.raises(UsageError, match=r"inputs must be a dict of tensors.*: 'input_ids' is list"):
        symmerge.align(a, b, inputs={"input_ids": [[1, 2, 3]]})


@pytest.mark.parametrize("make, message", [
    (lambda: symmerge.LearnSettings(seed=1.5), r"--learn-seed must be a whole number from 0 to 2\*\*64 - 1, got 1.5"),
    (lambda: symmerge.LearnSettings(budget=-1), r"--learn-budget must be >= 0"),
    (lambda: symmerge.LearnSettings(budget=float("nan")), r"--learn-budget must be a number >= 0, got nan"),
    (lambda: symmerge.LearnSettings(check_every=0), r"check_every must be a whole number >= 1"),
    (lambda: symmerge.LearnSettings(patience=-1), r"patience must be a whole number >= 0"),
    (lambda: symmerge.LearnSettings(dirichlet_steps=float("nan")), r"dirichlet_steps must be a whole number >= 0"),
])
def test_a_bad_learned_alignment_setting_is_one_error(make, message):
    with pytest.raises(SymmergeError, match=message):
        make()


def test_data_flags_and_merge_counts_of_the_wrong_type_or_range_are_one_error(pair, tmp_path):
    import numpy as np

    a, b = pair
    assert symmerge.LearnSettings(seed=np.int64(3)).seed == 3  # numpy's whole numbers are whole numbers
    data = r"data must be a data file's path \(.npz, .jsonl or .txt\) or a symmerge.io.data.Data, got "
    for call, got in ((lambda: symmerge.barrier_study(a, b, None), "NoneType"),
                      (lambda: symmerge.merge_models([a, b], "fisher", data=123, progress=False), "int"),
                      (lambda: symmerge.align(a, b, match="activations", align_data=123), "int")):
        with pytest.raises(UsageError, match=data + got):
            call()
    for keywords, message in ((dict(fisher_samples=0), "--fisher-samples must be >= 1"),
                              (dict(batch_size=0), "--batch-size must be >= 1"),
                              (dict(fisher_variant="emprical"), "unknown Fisher variant 'emprical'")):
        with pytest.raises(SymmergeError, match=message):
            symmerge.merge_models([a, b], "average", progress=False, **keywords)
    with pytest.raises(UsageError, match="stream must be True or False, got 'yes'"):
        symmerge.align_to_folder(a, b, tmp_path / "o", stream="yes")
    with pytest.raises(UsageError, match="allow_pickle must be True or False"):
        symmerge.align_pair(a, b, allow_pickle="x")
    assert not (tmp_path / "o").exists()


def test_extract_lora_checks_its_arguments_and_options_first(pair, tmp_path):
    from symmerge.merge.extract_lora import ExtractOptions, extract_lora

    a, b = pair
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    with pytest.raises(UsageError, match=r"'rnk' \(did you mean 'rank'\?\)"):
        ExtractOptions(rnk=4)
    with pytest.raises(UsageError, match="embed_lora must be True or False, got 'no'"):
        ExtractOptions(embed_lora="no")
    assert ExtractOptions(exclude_regexes="lm_head.*").exclude_regexes == ("lm_head.*",)  # one pattern
    options = ExtractOptions(rank=2, progress=False)
    for call, message in (
            (lambda: extract_lora(a, tmp_path / "b", tmp_path / "o", options),
             r"^finetune must be a Hugging Face model folder .* got LlamaForCausalLM \(a model in memory: "
             r"save_pretrained it first\)"),
            (lambda: extract_lora(tmp_path / "a", None, tmp_path / "o", options), r"^base must be .* got NoneType"),
            (lambda: extract_lora(tmp_path / "a", tmp_path / "b", None, options), r"^out must be the output folder"),
            (lambda: extract_lora(tmp_path / "a", tmp_path / "b", tmp_path / "o", 4),
             r"^options must be an ExtractOptions, got int")):
        with pytest.raises(UsageError, match=message):
            call()
    assert not (tmp_path / "o").exists()


def test_symmerge_merge_names_itself_for_a_misspelt_keyword(pair, tmp_path):
    with pytest.raises(UsageError, match=r"^symmerge.merge\(\) got an unexpected keyword argument 'methd' "
                                         r"\(did you mean 'method'\?\)"):
        symmerge.merge(list(pair), tmp_path / "o", methd="ties")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("options, flag", [
    (lambda: symmerge.MergeOptions(method="average", max_length=0).check(2), "--max-length"),
    (lambda: symmerge.MergeOptions(method="average", max_examples=-1).check(2), "--max-examples"),
    (lambda: symmerge.BarrierOptions(max_examples=0), "--max-examples"),
    (lambda: symmerge.BarrierOptions(batch_size=0), "--batch-size"),
])
def test_the_library_takes_the_flags_minima(options, flag):
    """The library's options refuse what the flags refuse (``--max-length 0``, ``--max-examples -1``: the CLI's
    declared minimum 1), in one error naming the flag; None (unset) stays accepted."""
    with pytest.raises(SymmergeError, match=f"{flag} must be >= 1"):
        options()
    symmerge.MergeOptions(method="average", max_length=None, max_examples=None).check(2)


def test_a_model_in_memory_with_nan_or_inf_is_one_error_as_a_folder_is(pair, tmp_path):
    """A folder holding NaN is refused when it is loaded; the same model given in memory reached the solvers: lapjv's
    "cost matrix is infeasible", an SVD that did not converge, or (``symmetries='attn'``, ``ties``) a result that
    carried or dropped the NaN in silence. Now one error naming the argument and the tensor, the caller's model
    untouched."""
    import copy

    a, b = pair
    for bad in (float("nan"), float("inf")):
        poisoned = copy.deepcopy(a)
        with torch.no_grad():
            poisoned.model.layers[0].mlp.up_proj.weight[0, 0] = bad
        kept = poisoned.state_dict()["model.layers.0.mlp.up_proj.weight"].clone()
        tensor = r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' holds NaN or Inf values"
        for call, name in ((lambda: symmerge.align(poisoned, b, progress=False), "model"),
                           (lambda: symmerge.align(poisoned, b, symmetries="attn", progress=False), "model"),
                           (lambda: symmerge.align_pair(b, poisoned), "anchor"),
                           (lambda: symmerge.align_to_folder(poisoned, b, tmp_path / "out"), "model"),
                           (lambda: symmerge.merge_models([b, poisoned], "ties", base=a), r"models\[1\]"),
                           (lambda: symmerge.merge_models([a, b], "task_arithmetic", base=poisoned), "base"),
                           (lambda: symmerge.merge([poisoned, b], tmp_path / "out"), r"models\[0\]"),
                           (lambda: symmerge.barrier_study(a, poisoned, "x.npz"), "model_b")):
            with pytest.raises(SymmergeError, match=rf"^{name} \(in memory\): {tensor}"):
                call()
        assert not (tmp_path / "out").exists()
        after = poisoned.state_dict()["model.layers.0.mlp.up_proj.weight"]
        assert torch.allclose(after, kept, rtol=0, atol=0, equal_nan=True)  # the caller's model as it was


@pytest.mark.parametrize("inputs, raised", [({"pixel_values": torch.zeros(1, 3, 16, 16)}, "ValueError"),
                                            ({"input_ids": torch.tensor([[500, 1]])}, "IndexError")])
def test_verification_inputs_the_model_does_not_take_are_one_error_before_the_alignment(pair, inputs, raised):
    """They ran only in the verification, after the whole alignment, and raised transformers' or torch's own
    error 20 frames deep."""
    a, b = pair
    for call in (lambda: symmerge.align(a, b, inputs=inputs, progress=False), lambda: symmerge.align_pair(a, b,
                                                                                                         inputs=inputs)):
        with pytest.raises(UsageError, match=rf"^inputs: the model does not run on them \({raised}: "):
            call()
    _, report = symmerge.align(a, b, inputs={"input_ids": torch.tensor([[5, 1, 7]])}, progress=False)
    assert report["verify_max_rel_diff"] < 1e-5


@pytest.mark.parametrize("make, message", [
    (lambda: symmerge.LearnSettings(lr="x"), r"lr > 0, got x"),
    (lambda: symmerge.LearnSettings(dirichlet_holdout="x"), r"dirichlet_holdout in \(0, 1\), got 0, x"),
    (lambda: symmerge.LearnSettings(alpha_low="x"), r"--learn-alpha-low/--learn-alpha-high must be numbers"),
    (lambda: symmerge.LearnSettings(holdout="x"), r"holdout fraction must be in \[0, 1\), got x"),
    (lambda: symmerge.AlignOptions(descent_tol="x"), r"descent_tol must be in \[0, 1\), got x"),
    (lambda: symmerge.AlignOptions(layers=[]), r"layers \[\] names no layer; leave it out"),
    (lambda: symmerge.MergeOptions(joint="x").check(2), r"joint must be True, False or None"),
    (lambda: symmerge.MergeOptions(mode="x").check(2), r"unknown mode 'x'; choose one of auto, stream, memory"),
    (lambda: symmerge.MergeOptions(repair_samples="x").check(2), r"REPAIR samples must be a whole number >= 1"),
])
def test_a_value_of_the_wrong_type_is_one_error_not_a_comparison_s_type_error(make, message):
    """``'<=' not supported between 'float' and 'str'`` came out of the options' range checks; a str ``joint`` was
    taken for its truth, a bad ``mode`` merged in memory, and ``layers=[]`` aligned the model-wide groups only
    (``--layers ""`` is refused)."""
    with pytest.raises(SymmergeError, match=message):
        make()
