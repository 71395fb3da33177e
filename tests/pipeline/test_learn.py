"""Learned alignment: every step's element is exactly function-preserving (fp64), the result never ends
worse than its start on its own held-out objective, and it works across families (LayerNorm, RMSNorm
with RoPE/GQA/SwiGLU, GPT-2's fused layout, post-LN encoders)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_inputs, output_rel_diff, with_weights
from factories import RMSNORM, make_model
from symmerge.core.apply import apply, canonicalize
from symmerge.io.data import Batch, Data
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.learn import learn_alignment
from symmerge.pipeline.options import AlignOptions, LearnSettings

pytestmark = pytest.mark.usefixtures("single_thread")
FULL = "heads,attn,ffn,rescale,residual"


def unlabeled(model, n_batches: int = 4, batch: int = 8, seed: int = 0) -> Data:
    """Random but valid inputs as a Data set: images, token ids for LMs (next-token targets), or text."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        x = make_inputs(model, seed=int(torch.randint(0, 10 ** 6, (1,), generator=g)), batch=batch)
        if "pixel_values" in x:
            batches.append(Batch(x, torch.zeros(batch, dtype=torch.long)))
        else:
            mask = x["attention_mask"].bool()
            labels = x["input_ids"].masked_fill(~mask, -100)
            batches.append(Batch(x, labels if type(model).__name__.endswith(("LMHeadModel", "CausalLM"))
                                 else torch.zeros(batch, dtype=torch.long), mask))
    fmt = "image" if "pixel_values" in batches[0].inputs else "lm"
    return Data("synthetic", fmt, batches, n_batches * batch)


@pytest.mark.parametrize("family", ["vit", "llama", "gpt2", "bert", "gemma2", "gpt_neox", "phi3", "olmo2"])
def test_every_learned_step_is_exactly_function_preserving(family, request):
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=3)
    options = AlignOptions(symmetries=FULL, match="learned", align_data="unused",
                           learn=LearnSettings(steps=6, batch=8, lr=0.05, check_every=2, patience=100))
    _, instances = instances_for(a)
    wide = [i for i in instances if not i.kind.per_layer]
    ca, cb = canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)
    data = unlabeled(a)
    inputs = make_inputs(a)
    checked = []

    def on_step(step, params):
        learned = params.elements()
        assert learned, "nothing learned"
        moved = apply(ca, instances, learned)  # the learned deltas alone, in float64
        changed = [k for k in ca if not torch.equal(moved[k], ca[k])]
        assert changed
        assert output_rel_diff(a, with_weights(a, moved), inputs) <= 1e-10
        checked.append(step)

    elements, report = learn_alignment(instances, a, b, ca, cb, data, options, start={}, on_step=on_step)
    assert checked == list(range(6))
    assert report["held_out_best"] <= report["held_out_start"] + 1e-12
    final = with_weights(a, apply(ca, instances, elements))
    assert output_rel_diff(a, final, inputs) <= 1e-10


def test_learned_alignment_lowers_its_objective_and_verifies():
    a, b = make_model("vit", head=True, seed=0, dtype=torch.float32), make_model("vit", head=True, seed=3,
                                                                             dtype=torch.float32)
    data = unlabeled(a, n_batches=6, batch=16)
    options = AlignOptions(symmetries=FULL, match="learned", align_data=data,
                           learn=LearnSettings(steps=40, batch=16, lr=0.05, check_every=5, patience=100, holdout=0.2))
    result = align_pair(a, b, options)
    learned = result.report["learned"]
    assert result.report["match"] == "learned" and result.report["align_samples_used"] == 96
    assert learned["held_out_best"] < learned["held_out_start"]  # it learns something on held-out data
    assert learned["history"]["held_out"] and learned["steps"] == 40
    assert result.report["verify_max_rel_diff"] <= 1e-4  # the written model is still A's function
    # the anchor in A's parameterisation computes B's function
    assert output_rel_diff(b, result.anchor, make_inputs(b)) <= 1e-5


def test_learned_alignment_keeps_its_start_when_learning_cannot_help():
    """A and B the same function in different weights: the closed form already reaches B exactly, the
    objective cannot go lower, and the start is kept (never worse than the initialisation)."""
    from factories import disguised

    b = make_model("vit", head=True, seed=0)
    a = disguised(b, ("heads", "attn", "ffn", "rescale", "residual"), seed=2)[0]
    options = AlignOptions(symmetries=FULL, match="learned", align_data=unlabeled(a),
                           learn=LearnSettings(steps=10, batch=8, lr=0.05, check_every=2, patience=2))
    result = align_pair(a, b, options)
    learned = result.report["learned"]
    assert learned["held_out_best"] <= learned["held_out_start"] + 1e-9
    assert result.report["distance_after"] <= 1e-6 * result.report["distance_before"]


@pytest.mark.parametrize("held", [False, True])
def test_a_rounding_level_change_of_the_objective_is_not_an_improvement(held):
    """The checks run in float32: when learning cannot help (the test above), the end's objective equals the
    start's up to rounding, lower on some machines and higher on others (it failed on one machine: the moved
    state kept, distance_after 1.16e-3). A change of a few float32 ulps keeps the start; a real one is taken."""
    from symmerge.pipeline.learn import Checks

    start = 0.5612810204426447
    for value, kept in [(start * (1 - 3e-8), "start"), (start * (1 - 3e-7), "start"), (start * (1 - 1e-4), "moved")]:
        values, state = iter([start, value]), {"state": "start"}
        checks = Checks(LearnSettings(patience=5), held, lambda: next(values), lambda: dict(state), {"step": [], "train": []},
                        {})
        state["state"] = "moved"
        checks.after(2, 0.7)
        best, best_state = checks.finish()
        assert best_state["state"] == kept, (value, held)
        assert best == (start if kept == "start" else value)


def test_learn_settings_are_validated():
    from symmerge.errors import SymmergeError

    with pytest.raises(SymmergeError, match="align-data"):
        AlignOptions(match="learned")
    with pytest.raises(SymmergeError, match="alpha"):
        LearnSettings(alpha_low=0.9, alpha_high=0.1)
    with pytest.raises(SymmergeError, match="match mode"):
        AlignOptions(match="vibes", align_data="x")
    with pytest.raises(SymmergeError, match="start"):
        LearnSettings(start="random")
    with pytest.raises(SymmergeError, match="target"):
        LearnSettings(target="labels")
    with pytest.raises(SymmergeError, match="augment"):
        LearnSettings(augment=-1)


def test_learned_alignment_from_activations_with_augmented_images():
    """Starting from activation matching, augmented
    images and log-probability targets: every step function-preserving (fp64), the result verified."""
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=3)
    data = unlabeled(a, n_batches=4, batch=8)
    inputs = make_inputs(a)
    _, instances = instances_for(a)
    wide = [i for i in instances if not i.kind.per_layer]
    ca = canonicalize(a.state_dict(), wide)
    steps = []

    def on_step(step, params):
        assert output_rel_diff(a, with_weights(a, apply(ca, instances, params.elements())), inputs) <= 1e-10
        steps.append(step)

    settings = LearnSettings(steps=6, batch=8, lr=0.05, check_every=2, patience=100, start="activations",
                             augment=1, target="log-probabilities")
    options = AlignOptions(symmetries=FULL, match="learned", align_data=data, learn=settings)
    result = align_pair(a, b, options)
    learned = result.report["learned"]
    assert learned["start"].startswith("activations") and learned["steps"] == 6
    assert result.report["verify_max_rel_diff"] <= 1e-10
    cb = canonicalize(b.state_dict(), wide)
    from symmerge.pipeline.learn import learn_alignment as learn

    learn(instances, a, b, ca, cb, data, options, start={}, on_step=on_step)
    assert steps == list(range(6))


def test_augmented_views_are_image_batches_only():
    from symmerge.pipeline.learn import augmented

    img = unlabeled(make_model("vit", head=True, seed=0), n_batches=2, batch=4)
    views = augmented(img.batches, 3, torch.Generator().manual_seed(0))
    assert len(views) == 6 and all(v.inputs["pixel_values"].shape == img.batches[0].inputs["pixel_values"].shape
                                   for v in views)
    assert not augmented(unlabeled(make_model("gpt2", head=True, seed=0)).batches, 3, torch.Generator())


def test_learned_alignment_of_a_tied_lm_head():
    """GPT-2 with its LM head tied to the embeddings (both names in the state dict): learning runs, and the
    aligned model is still A's function."""
    a, b = make_model("gpt2", head=True, seed=0, tied=True), make_model("gpt2", head=True, seed=3, tied=True)
    options = AlignOptions(symmetries=FULL, match="learned", align_data=unlabeled(a),
                           learn=LearnSettings(steps=3, batch=8, lr=0.05))
    result = align_pair(a, b, options)
    assert result.report["learned"]["steps"] == 3 and result.report["verify_max_rel_diff"] <= 1e-10


@pytest.mark.parametrize("family, word", [("gpt2", "texts"), ("vit", "images")])
def test_learned_report_names_the_data_and_leaves_out_an_empty_held_out_history(family, word):
    """Without a held-out part the objective is checked on the training examples, named by the data's
    modality (texts for token data, images for pixels), and the history has no held-out column (not a
    column of NaN); with one, the column is there and finite."""
    import math

    a, b = make_model(family, head=True, seed=0, dtype=torch.float32), make_model(family, head=True, seed=3,
                                                                             dtype=torch.float32)
    data = unlabeled(a, n_batches=4, batch=8)
    assert data.format == ("image" if family == "vit" else "lm")
    for holdout in (0.0, 0.25):
        options = AlignOptions(symmetries=FULL, match="learned", align_data=data,
                               learn=LearnSettings(steps=4, batch=8, lr=0.05, check_every=2, holdout=holdout))
        learned = align_pair(a, b, options).report["learned"]
        history = learned["history"]
        assert history["step"] == [2, 4] and len(history["train"]) == 2
        if holdout:
            assert learned["checked_on"] == "held-out part"
            assert len(history["held_out"]) == 2 and all(math.isfinite(v) for v in history["held_out"])
        else:
            assert learned["checked_on"].startswith(f"training {word} (")
            assert "held_out" not in history
            other = "images" if word == "texts" else "texts"
            assert other not in learned["checked_on"]


def test_learned_objective_on_a_subset_of_positions():
    """``positions``: each batch scored on at most that many real next-token positions (never padding),
    drawn once; images are left alone; the alignment still verifies and never ends worse than its start."""
    from symmerge.errors import SymmergeError
    from symmerge.pipeline.learn import subsample_positions

    a, b = make_model("gpt2", head=True, seed=0, dtype=torch.float32), make_model("gpt2", head=True, seed=3,
                                                                              dtype=torch.float32)
    data = unlabeled(a, n_batches=3, batch=8)
    g = torch.Generator().manual_seed(0)
    batch = data.batches[0]
    sub = subsample_positions(batch, 5, g)
    assert int(sub.mask[:, 1:].sum()) == 5 and not bool(sub.mask[:, 0].any())
    assert bool((batch.mask[:, 1:] | ~sub.mask[:, 1:]).all())  # only real positions are kept
    assert sub.inputs is batch.inputs and torch.equal(batch.mask, data.batches[0].mask)  # input unchanged
    assert subsample_positions(batch, 10 ** 6, g) is batch and subsample_positions(batch, 0, g) is batch
    image = unlabeled(make_model("vit", head=True), n_batches=1).batches[0]
    assert subsample_positions(image, 3, g) is image
    options = AlignOptions(symmetries=FULL, match="learned", align_data=data,
                           learn=LearnSettings(steps=4, batch=8, lr=0.05, positions=6))
    result = align_pair(a, b, options)
    learned = result.report["learned"]
    assert learned["held_out_best"] <= learned["held_out_start"] + 1e-12
    assert result.report["verify_max_rel_diff"] <= 1e-4
    for bad in ({"positions": -1}, {"max_length": 1}):
        with pytest.raises(SymmergeError):
            LearnSettings(**bad)


@pytest.mark.parametrize("family, tied", [("llama", False), ("gpt2", True)])
def test_head_on_scored_positions_gives_the_scored_logits_of_the_full_output(family, tied):
    """``head_forward`` projects only the scored positions' hidden states through the LM head (a
    pre-hook): exactly the logits ``scored_logits`` picks from the full output, in the same order, also with
    a position subset and a tied head; image batches (no sequence mask) run in full. Negative control: the
    rows do not match the full output's unscored positions."""
    from symmerge.pipeline.learn import head_forward, scored_logits, subsample_positions

    kwargs = {"tied": True} if tied else {}
    model = make_model(family, head=True, seed=0, dtype=torch.float64, **kwargs).eval()
    data = unlabeled(model, n_batches=1, batch=6)
    sd = dict(model.state_dict())
    for batch in (data.batches[0], subsample_positions(data.batches[0], 7, torch.Generator().manual_seed(1))):
        with torch.no_grad():
            full = scored_logits(model(**batch.inputs).logits, batch)
            fast = head_forward(model, sd, batch)
        assert fast.shape == full.shape and (fast - full).abs().max() < 1e-12
        assert fast.shape[0] == int(batch.mask[:, 1:].sum())
        with torch.no_grad():
            shifted = model(**batch.inputs).logits[:, 1:][batch.mask[:, 1:]]  # the wrong positions
        assert (shifted - fast).abs().max() > 1e-3
    vit = make_model("vit", head=True, dtype=torch.float64).eval()
    image = unlabeled(vit, n_batches=1).batches[0]
    with torch.no_grad():
        assert torch.equal(head_forward(vit, dict(vit.state_dict()), image), vit(**image.inputs).logits)


def test_learned_in_bfloat16_with_fewer_checks_still_verifies():
    """``precision="bfloat16"``: the steps under bf16 autocast move the elements (the objective is still
    checked in float32, never worse than the start), the result is exactly A's function; ``check_batches``
    limits the checks, and the report says so and gives its seconds by stage."""
    from symmerge.errors import SymmergeError

    a, b = make_model("llama", head=True, seed=0, dtype=torch.float32), make_model("llama", head=True, seed=3,
                                                                               dtype=torch.float32)
    data = unlabeled(a, n_batches=4, batch=8)
    options = AlignOptions(symmetries=FULL, match="learned", align_data=data,
                           learn=LearnSettings(steps=6, batch=8, lr=0.05, precision="bfloat16", check_batches=2))
    result = align_pair(a, b, options)
    learned = result.report["learned"]
    assert learned["steps"] == 6 and learned["held_out_best"] < learned["held_out_start"]  # it learned
    assert learned["checked_on"].endswith("its first 2 batches")
    assert set(learned["seconds_by_stage"]) == {"targets", "checks", "steps"}
    assert all(v >= 0 for v in learned["seconds_by_stage"].values())
    assert result.report["verify_max_rel_diff"] <= 1e-4
    for bad in ({"precision": "float16"}, {"check_batches": -1}):
        with pytest.raises(SymmergeError):
            LearnSettings(**bad)
