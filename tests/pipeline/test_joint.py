"""Joint alignment of N models (symmerge.pipeline.joint): disguised copies of one model come back into
one frame, the objective never increases, N = 2 matches pairwise alignment, bad calls are refused."""

from __future__ import annotations

import itertools

import pytest

from conftest import make_inputs, output_rel_diff, sq_dist
from factories import DECODERS, FAMILIES, RMSNORM, disguised, make_model
from symmerge.errors import SymmergeError
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.joint import JointSteps, align_joint, discrete_symmetries, mean_state_dict, spread
from symmerge.pipeline.options import RECOMMENDED, AlignOptions

pytestmark = pytest.mark.usefixtures("single_thread")


def _symmetries(model) -> tuple[str, ...]:
    _, instances = instances_for(model)
    have = {i.group.symmetry for i in instances}
    return tuple(s for s in RECOMMENDED if s in have or s == "rescale")


def _copies(family, n, noise, request):
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    anchor = make_model(family, head=True)
    symmetries = _symmetries(anchor)
    copies = [disguised(anchor, symmetries, seed=10 + s, noise=noise) for s in range(n)]
    return anchor, symmetries, [c[0] for c in copies], [c[1] for c in copies]


def _params(model) -> list[str]:
    return [k for k, _ in model.named_parameters()]


@pytest.mark.parametrize("family", FAMILIES)
def test_disguised_copies_come_back_into_one_frame(family, request):
    anchor, symmetries, models, noise = _copies(family, 3, 0.01, request)
    keys = _params(anchor)
    before = [sq_dist(a.state_dict(), b.state_dict(), keys) ** 0.5 for a, b in itertools.combinations(models, 2)]
    result = align_joint(models, AlignOptions(symmetries=symmetries), inputs=make_inputs(anchor))
    pairs = list(itertools.combinations(range(3), 2))
    for (i, j), d0 in zip(pairs, before):
        d = sq_dist(result.models[i].state_dict(), result.models[j].state_dict(), _params(result.models[i])) ** 0.5
        bound = 1.15 * (noise[i] ** 2 + noise[j] ** 2) ** 0.5  # ‖N_i − N_j‖ of independent noises
        assert d <= bound, (family, i, j, d, bound, d0)
        assert d0 > 10 * bound  # the hidden elements moved them far apart
    inputs = make_inputs(anchor)
    for x, y in zip(models, result.models):  # each model still computes its own function
        assert output_rel_diff(x, y, inputs) <= 1e-9
    obj = result.report["objective"]
    assert all(b <= a for a, b in zip(obj, obj[1:]))
    assert all(m["verify_max_rel_diff"] <= 1e-9 for m in result.report["models"])


@pytest.mark.parametrize("family", ["vit", "gpt2", "llama"])
def test_joint_objective_never_increases_on_unrelated_models(family, request):
    """Independent random models (no common frame to find): the rounds still only lower the spread,
    and the spread the report gives is the one recomputed from the returned models."""
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    models = [make_model(family, head=True, seed=s) for s in range(3)]
    symmetries = _symmetries(models[0])
    result = align_joint(models, AlignOptions(symmetries=symmetries, max_sweeps=10), max_rounds=2)
    obj = result.report["objective"]
    assert len(obj) == result.report["rounds"] + 1
    assert all(b <= a * (1 + 1e-12) for a, b in zip(obj, obj[1:]))
    sds = [x.state_dict() for x in result.models]
    assert spread(sds, _params(result.models[0])) == pytest.approx(obj[-1], rel=1e-9)
    star = align_joint(models, AlignOptions(symmetries=symmetries, max_sweeps=10), max_rounds=0)
    assert star.report["rounds"] == 0 and obj[-1] <= star.report["objective"][0] * (1 + 1e-12)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_two_models_jointly_match_the_pairwise_alignment(family, request):
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=1)
    opts = AlignOptions(symmetries=_symmetries(a), max_sweeps=30)
    pair = align_pair(b, a, opts)
    pair_d = sq_dist(pair.model.state_dict(), pair.anchor.state_dict(), _params(pair.model)) ** 0.5
    joint = align_joint([a, b], opts)
    joint_d = sq_dist(joint.models[0].state_dict(), joint.models[1].state_dict(), _params(a)) ** 0.5
    assert joint_d <= pair_d * (1 + 1e-9)  # never worse than the pairwise result
    assert joint_d >= 0.5 * pair_d  # and the same kind of optimum (the frames may differ)


def test_mean_state_dict_is_the_elementwise_mean():
    models = [make_model("bert", seed=s) for s in range(3)]
    keys = _params(models[0])
    sds = [m.state_dict() for m in models]
    mean = mean_state_dict(sds, keys)
    for k in keys:
        assert (mean[k] - (sds[0][k] + sds[1][k] + sds[2][k]) / 3).abs().max() <= 1e-14
    expected = sum(sq_dist(sd, mean, keys) for sd in sds)
    assert spread(sds, keys) == pytest.approx(expected, rel=1e-12)


def test_bad_calls_are_refused():
    models = [make_model("bert", seed=s) for s in range(3)]
    opts = AlignOptions(symmetries="attn,ffn")
    with pytest.raises(SymmergeError, match="at least 2"):
        align_joint(models[:1], opts)
    with pytest.raises(SymmergeError, match="out of range"):
        align_joint(models, opts, anchor=5)
    with pytest.raises(SymmergeError, match="x.npz"):  # learned: its data is read before anything is aligned
        align_joint(models, AlignOptions(symmetries="attn", match="learned", align_data="x.npz"))
    other = make_model("bert", seed=3, num_attention_heads=2, hidden_size=24)
    with pytest.raises(SymmergeError):
        align_joint(models[:2] + [other], opts)


@pytest.mark.parametrize("family", ["vit", "gpt2", "llama"])
def test_discrete_rounds_move_only_permutations_and_never_raise_the_spread(family, request):
    """``refine="discrete"``: the rounds after the star re-solve the head and unit permutations only. The
    spread never increases, every model keeps its function, and each model's tensors after the rounds are
    its star form with rows/columns permuted: the continuous elements (rotations, scales, the residual
    map) the star found are kept, so sorted values per tensor are unchanged."""
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    models = [make_model(family, head=True, seed=s) for s in range(3)]
    opts = AlignOptions(symmetries=_symmetries(models[0]), max_sweeps=10)
    star = align_joint(models, opts, max_rounds=0)
    moved = align_joint(models, opts, max_rounds=3, refine="discrete")
    assert moved.report["refine"] == "discrete"
    obj = moved.report["objective"]
    assert obj[0] == pytest.approx(star.report["objective"][0], rel=1e-12)  # the same star
    assert all(b <= a * (1 + 1e-12) for a, b in zip(obj, obj[1:]))
    assert sum(moved.report["moved_per_round"]) > 0  # unrelated models: some permutation does move
    keys = _params(models[0])
    for s, m in zip(star.models, moved.models):
        for k in keys:
            a, b = s.state_dict()[k].flatten().sort().values, m.state_dict()[k].flatten().sort().values
            assert (a - b).abs().max() <= 1e-6 * (1 + a.abs().max()), k
    inputs = make_inputs(models[0])
    for x, y in zip(models, moved.models):
        assert output_rel_diff(x, y, inputs) <= 1e-6
    # negative control: rounds that re-solve every group (MergeMany) do change the continuous elements
    everything = align_joint(models, opts, max_rounds=1, refine="all")
    changed = [(s.state_dict()[k].flatten().sort().values - m.state_dict()[k].flatten().sort().values).abs().max()
               for s, m in zip(star.models, everything.models) for k in keys]
    assert max(changed) > 1e-3


def test_discrete_symmetries_are_the_permutation_groups():
    """``Kind.discrete`` decides which symmetries the discrete rounds re-solve: head and FFN permutations,
    the residual stream only in its permutation variant; never the rotations or the scales."""
    vit = make_model("vit", head=True)
    assert discrete_symmetries(vit, AlignOptions(symmetries=RECOMMENDED).for_model(vit)) == ("heads", "ffn")
    assert discrete_symmetries(vit, AlignOptions(symmetries="attn,rescale")) == ()
    permuted = AlignOptions(symmetries="heads,ffn,residual", residual="permutation")
    assert discrete_symmetries(vit, permuted) == ("heads", "ffn", "residual")
    with pytest.raises(SymmergeError, match="joint refinement"):
        align_joint([vit, make_model("vit", head=True, seed=1)], AlignOptions(symmetries="ffn"), refine="some")
    from symmerge.merge.fuse import MergeOptions, merge_models

    with pytest.raises(SymmergeError, match="--joint-refine"):
        merge_models([vit] * 3, options=MergeOptions(joint_refine="some"))


def test_data_free_rounds_re_solve_the_head_pairings_on_full_rounds_only(monkeypatch):
    """Data-free, a step of the rounds is one sweep of the descent from the current element. The head
    pairings (the lazy kind), which the star has just solved, are held while the rounds gain (``tol`` 0:
    every round gains here), and valued again in one full round once a round gains less than ``tol`` (0.5:
    the first); the rounds end when that full round gains less too. The spread never increases, and each
    model keeps its function."""
    from symmerge.groups.heads import Heads

    calls = []
    complete = Heads.complete
    monkeypatch.setattr(Heads, "complete", lambda self, insts, *a, **k: calls.append(len(insts))
                        or complete(self, insts, *a, **k))
    models = [make_model("vit", head=True, seed=s) for s in range(3)]
    opts = AlignOptions(symmetries=_symmetries(models[0]))
    assert "heads" in opts.symmetries
    star = align_joint(models, opts, max_rounds=0, steps=JointSteps(star_sweeps=None))
    in_star = len(calls)
    held = align_joint(models, opts, max_rounds=3, steps=JointSteps(tol=0.0, star_sweeps=None))
    assert held.report["objective"][0] == pytest.approx(star.report["objective"][0], rel=1e-12)
    obj = held.report["objective"]
    assert held.report["rounds"] == 3 and all(b < a for a, b in zip(obj, obj[1:]))
    assert len(calls) == 2 * in_star  # no pairing valued in the rounds
    assert "1 sweep(s)" in held.report["step"] and "re-solved in 0 round(s)" in held.report["step"]
    calls.clear()
    once = align_joint(models, opts, max_rounds=5, steps=JointSteps(tol=0.5, star_sweeps=None))
    assert once.report["rounds"] == 2 and len(calls) == in_star + 3  # round 2: one valuation per model
    assert "re-solved in 1 round(s)" in once.report["step"]
    obj = once.report["objective"]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(obj, obj[1:]))
    inputs = make_inputs(models[0])
    for x, y in zip(models, held.models):
        assert output_rel_diff(x, y, inputs) <= 1e-9


@pytest.mark.parametrize("family", ["vit", "llama"])
def test_the_star_is_capped_only_when_rounds_follow(family, request):
    """``star_sweeps`` caps the star's pairwise descents only when data-free rounds continue them: without
    rounds the star is the converged one whatever the cap; with rounds the capped start ends no worse than
    the converged star. ``warm=False`` (the rounds before the sweeps: capped pairwise re-alignments from the
    stream tensors) still never increases the spread."""
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    models = [make_model(family, head=True, seed=s) for s in range(3)]
    opts = AlignOptions(symmetries=_symmetries(models[0]))
    full = align_joint(models, opts, max_rounds=0, steps=JointSteps(star_sweeps=None))
    assert (align_joint(models, opts, max_rounds=0, steps=JointSteps(star_sweeps=1)).report["objective"]
            == full.report["objective"])
    capped = align_joint(models, opts, steps=JointSteps(star_sweeps=1))
    obj = capped.report["objective"]
    assert obj[0] >= full.report["objective"][0] * (1 - 1e-12)  # one sweep: not yet the converged star
    assert all(b <= a * (1 + 1e-12) for a, b in zip(obj, obj[1:]))
    assert obj[-1] <= full.report["objective"][0] * (1 + 1e-12)
    assert "star capped at 1 sweep(s)" in capped.report["step"]
    old = align_joint(models, opts, max_rounds=2, steps=JointSteps(warm=False))
    assert old.report["step"] == "a pairwise re-alignment capped at 10 sweeps"
    assert all(b <= a * (1 + 1e-12) for a, b in zip(old.report["objective"], old.report["objective"][1:]))
    with pytest.raises(SymmergeError, match="star_sweeps"):
        align_joint(models, opts, steps=JointSteps(star_sweeps=0))
