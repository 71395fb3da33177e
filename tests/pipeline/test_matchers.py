"""Matchers on the group-kind plug-ins: every kind declares the capabilities the activation and learned
matchers read; every matcher runs on every kind (a family using each kind, all groups at once, the
result function-preserving and moving each kind's tensors); a kind without a capability is refused by
name; no code outside symmerge/groups/ branches on a kind's name."""

from __future__ import annotations

import pytest

from conftest import make_inputs, output_rel_diff
from factories import FAMILIES, RMSNORM, make_model
from symmerge.errors import SymmergeError
from symmerge.groups import KINDS, Kind
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.options import AlignOptions, LearnSettings
from test_activations import unlabeled

pytestmark = pytest.mark.usefixtures("single_thread")
FULL = "heads,attn,ffn,rescale,residual"


def test_every_kind_declares_its_matcher_capabilities():
    for name, kind in KINDS.items():
        assert kind.activation_sites in ("slots", "units", "stream", "inputs", "weights", ""), name
        assert kind.activation_statistic in ("gram", "correlation"), name
        assert isinstance(kind.moves_before_scales, bool), name
        # a model-wide kind is read at the block boundaries, a per-layer one at its slots or units
        assert (kind.activation_sites == "stream") == (not kind.per_layer) or kind.activation_sites in ("weights", ""), name
        for method in ("fit_activations", "weight_scales", "learn_init"):
            assert callable(getattr(kind, method)), (name, method)
        if kind.activation_sites == "inputs":  # its own statistics from a module's input: all three overridden
            for method in ("activation_input", "observe", "fit_observed"):
                assert getattr(type(kind), method) is not getattr(Kind, method), (name, method)


def _family_of_each_kind() -> dict[str, str]:
    """For every registered kind, the first test family whose task model binds an instance of it."""
    found = {}
    for family in FAMILIES:
        _, instances = instances_for(make_model(family, head=True))
        for inst in instances:
            found.setdefault(inst.kind.name, family)
    return found


def test_every_kind_is_used_by_a_test_family():
    assert set(_family_of_each_kind()) == set(KINDS)


@pytest.mark.parametrize("match", ["activations", "learned"])
@pytest.mark.parametrize("family", sorted(set(_family_of_each_kind().values())))
def test_every_matcher_runs_on_every_kind(family, match, request):
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=5)
    options = AlignOptions(symmetries="recommended", match=match, align_data=unlabeled(a),
                           learn=LearnSettings(steps=3, batch=4, start="activations"))
    result = align_pair(a, b, options, inputs=make_inputs(a))
    assert output_rel_diff(a, result.model, make_inputs(a)) <= 1e-9
    moved = {k for k, v in result.model.state_dict().items()
             if k in a.state_dict() and v.shape == a.state_dict()[k].shape and not v.equal(a.state_dict()[k])}
    solved = [i for i in result.instances if i.group.symmetry in result.report["symmetries"]]
    for inst in solved:  # every kind's element was solved and moved its tensors
        assert inst.name in result.elements, (family, match, inst.name)
    kinds = {i.kind.name for i in solved}
    assert kinds == {i.kind.name for i in result.instances}  # 'recommended' covers every kind the model has
    for kind in kinds:
        keys = {s.key for i in solved if i.kind.name == kind for s in i.slots}
        assert keys & moved, (family, match, kind)


def test_a_kind_without_activation_sites_is_refused_by_name(monkeypatch):
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=1)
    monkeypatch.setattr(KINDS["permutation"], "activation_sites", "")
    with pytest.raises(SymmergeError, match="'permutation' group kind declares no per-layer activation sites"):
        align_pair(a, b, AlignOptions(symmetries="attn,ffn", match="activations", align_data=unlabeled(a)))
    monkeypatch.undo()
    monkeypatch.setattr(KINDS["residual"], "activation_sites", "")
    with pytest.raises(SymmergeError, match="'residual' group kind does not declare them"):
        align_pair(a, b, AlignOptions(symmetries=FULL, match="activations", align_data=unlabeled(a)))


def _is_a_kind(node) -> bool:
    """``x.kind``, ``x.kind.name``, ``kind.name``: an expression that is a group kind, or its name (a variable
    ``kind`` alone is not: the word names other things, a parameter's Python type in config/params.py)."""
    import ast

    named = isinstance(node, ast.Attribute) and node.attr == "name"
    node = node.value if named else node
    return (isinstance(node, ast.Attribute) and node.attr == "kind") or (named and isinstance(node, ast.Name)
                                                                          and node.id == "kind")


def _kind_comparisons(source: str, names, others=()) -> list[int]:
    """The lines of ``source`` that compare with a kind's name written out (tests/guards.py), or compare a kind
    (or its name) with anything but a string literal of another vocabulary (``inst.kind is HEADS``,
    ``a.kind.name == b.kind.name``; ``stats.kind == "fisher"`` is the statistics' own word)."""
    import ast

    from guards import literals, name_comparisons

    identity = [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
                and any(map(_is_a_kind, [node.left, *node.comparators]))
                and not all(_is_a_kind(s) or (literals(s) and not literals(s) & set(names))
                            for s in [node.left, *node.comparators])]
    return sorted(set(identity + name_comparisons(source, names, others)))


def test_no_code_outside_groups_branches_on_a_kind_name():
    """No module outside ``symmerge/groups/`` branches on a group kind (a name of ``KINDS``, or the kind object
    itself): it reads the kind's declared capabilities (``activation_sites``, ``discrete``, ``learn_init``...).
    The residual stream's element ``variant`` (permutation, signed_permutation) is a vocabulary of its own. The
    checker is first shown to catch the planted cases, which the regular expression it replaces let through."""
    from guards import leaks

    names = set(KINDS)
    others = {"variant"}
    planted = ('if inst.kind.name == "permutation":\n    pass\n'  # 1
               'ok = "rope_pairs" != k.name\n'  # 3: the literal first (the regular expression missed it)
               'if inst.kind is HEADS or (a.kind.name) in b:\n    pass\n'  # 4: identity, parentheses
               'if stats.kind == "fisher" and variant == "permutation":\n    pass\n'  # other vocabularies
               'KINDS["heads"] = HeadsKind()\n')  # a registration
    assert _kind_comparisons(planted, names, others) == [1, 3, 4]
    assert not leaks(names, lambda rel: rel.parts[0] == "groups", others, check=_kind_comparisons)


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_activations_pair_heads_without_their_rotations(family):
    """``--match activations --symmetries heads,ffn`` (head pairing without ``attn``: the joint alignment's
    discrete rounds): the pairing is valued through the heads' QK/VO blocks even though their rotations are
    not solved; the result keeps the function and is not farther from the anchor than before."""
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=1)
    result = align_pair(a, b, AlignOptions(symmetries="heads,ffn", match="activations", align_data=unlabeled(a)))
    assert output_rel_diff(a, result.model, make_inputs(a)) <= 1e-5
    assert any(i.group.symmetry == "heads" for i in result.instances if i.name in result.elements)
    assert result.report["distance_after"] <= result.report["distance_before"] * (1 + 1e-9)
