"""Refusals found in the review of issue 39: a symmetry the model's family does not declare (``--symmetries experts``
on a Llama) is one error naming the family's symmetries — from the command (exit 2, nothing written) and the library
entry that writes, which plan the alignment — of an alignment that silently aligns nothing of it; the dual learned frame, which moves the anchor too, is
refused where every model is aligned onto a fixed anchor: a barrier of more than two models (joint alignment, its
star) and the federated strategy (each client onto the global model)."""

from __future__ import annotations

import pytest
import torch

from conftest import npz_file, run_cli, vit_folder
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamas")
    for seed in (0, 1):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(str(root / f"{seed}"))
    return root / "0", root / "1"


@pytest.mark.parametrize("extra", [[], ["--stream"], ["--print-plan"]])
def test_align_refuses_a_symmetry_the_family_does_not_declare(llamas, tmp_path, capsys, extra):
    capsys.readouterr()
    rc = run_cli("align", *llamas, "-o", tmp_path / "out", "--symmetries", "attn,experts", "--progress", "none",
                 *extra)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and not out, (rc, err)
    assert lines[0] == ("symmerge: error: the llama family has no 'experts' symmetry; its symmetries: heads, attn, "
                        "ffn, residual, rescale"), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [[], ["--mode", "stream"], ["--print-plan"]])
def test_merge_refuses_it_too(llamas, tmp_path, capsys, extra):
    """``merge --align experts`` on a Llama (found after the align refusal: merge exited 0 and aligned nothing of
    it) — the merge plan asks the same question."""
    capsys.readouterr()
    rc = run_cli("merge", *llamas, "--method", "average", "--align", "attn,experts", "-o", tmp_path / "out",
                 "--progress", "none", *extra)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and not out, (rc, err)
    assert lines[0].startswith("symmerge: error: the llama family has no 'experts' symmetry"), lines
    assert not (tmp_path / "out").exists()
    assert run_cli("merge", *llamas, "--method", "average", "--align", "attn", "-o", tmp_path / "ok",
                   "--progress", "none") == 0


def test_the_library_entries_refuse_it_too_and_a_mixture_takes_it(llamas, tmp_path):
    """``symmerge.align_to_folder`` plans as the command does; ``align_pair`` (which aligned the groups the family
    has and reported ``experts`` as aligned) refuses it in the same words, in memory and from folders, in the
    one-sided and the dual frame; 'recommended' still resolves to what the model has."""
    from symmerge.errors import SymmergeError
    from symmerge.pipeline.align import align, align_pair
    from symmerge.pipeline.options import AlignOptions
    from symmerge.pipeline.to_folder import align_to_folder

    line = "the llama family has no 'experts' symmetry; its symmetries: heads, attn, ffn, residual, rescale"
    with pytest.raises(SymmergeError, match="the llama family has no 'experts' symmetry"):
        align_to_folder(*llamas, tmp_path / "out", AlignOptions(symmetries="experts"), progress=False)
    assert not (tmp_path / "out").exists()
    a, b = (make_model("llama", head=True, dtype=torch.float32, seed=s) for s in (0, 1))
    before = {k: v.clone() for k, v in a.state_dict().items()}
    for x, y in ((a, b), llamas):
        with pytest.raises(SymmergeError) as err:
            align_pair(x, y, AlignOptions(symmetries="attn,experts"))
        assert str(err.value) == line
    with pytest.raises(SymmergeError) as err:
        align(a, b, ("heads", "experts"))
    assert str(err.value) == line
    with pytest.raises(SymmergeError) as err:
        align_pair(a, b, _dual().with_(symmetries=("attn", "experts")))
    assert str(err.value) == line
    assert all(torch.equal(v, before[k]) for k, v in a.state_dict().items())  # the input untouched
    assert "experts" not in align_pair(a, b, AlignOptions(symmetries="recommended")).report["symmetries"]
    a, b = (make_model("mixtral", head=True, dtype=torch.float32, seed=s) for s in (0, 1))
    report = align_pair(a, b, AlignOptions(symmetries="experts", verify=False)).report
    assert report["symmetries"] == ["experts"]


def _dual(align_data="generate:4:4"):
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    return AlignOptions(symmetries="attn", match="learned", align_data=align_data,
                        learn=LearnSettings(steps=2, batch=4, frame="dual"))


def test_a_barrier_of_three_models_refuses_the_dual_frame_in_its_plan(tmp_path):
    """Refused by the plan, before any model is read (before: after loading and evaluating every model, by the
    joint learned alignment); two models keep the dual frame (``barrier_study`` uses both moved models)."""
    from symmerge.errors import SymmergeError
    from symmerge.merge.barrier import BarrierOptions, barrier_many, plan_barrier

    models = [vit_folder(tmp_path / f"m{i}", seed=i) for i in range(3)]
    npz_file(tmp_path / "d.npz")
    options = BarrierOptions(align=_dual(tmp_path / "d.npz"), progress=False)
    refusal = "^the dual learned frame moves the anchor too, and a barrier of 3 models"
    with pytest.raises(SymmergeError, match=refusal):
        plan_barrier(models, tmp_path / "d.npz", options)
    with pytest.raises(SymmergeError, match=refusal):
        barrier_many(models, tmp_path / "d.npz", options)
    assert plan_barrier(models[:2], tmp_path / "d.npz", options).frame == "pair"


def test_the_federated_strategy_refuses_the_dual_frame():
    pytest.importorskip("flwr")
    from symmerge.errors import SymmergeError
    from symmerge.federated.options import ClientAlignment

    with pytest.raises(SymmergeError, match="^the dual learned frame moves the anchor too, and a federated round"):
        ClientAlignment(_dual())


def test_a_matcher_that_does_not_learn_ignores_the_dual_frame_everywhere(llamas, tmp_path):
    """``LearnSettings(frame="dual")`` with ``match="weights"`` (the Python API takes it; the command refuses every
    ``--learn-*`` flag without ``--match learned``) is the one-sided weight matching at every entry, as the other
    learned settings are ignored: ``symmerge.align`` aligned A onto B with it while ``align_to_folder``, a barrier of
    three models and the federated strategy refused it as the dual frame (each entry had its own test of the frame).
    ``AlignOptions.dual`` is the one test now."""
    import importlib.util

    from mergekit_oracle import tensors
    from symmerge.merge.barrier import BarrierOptions, plan_barrier
    from symmerge.pipeline.align import align
    from symmerge.pipeline.options import AlignOptions, LearnSettings
    from symmerge.pipeline.to_folder import align_to_folder

    one_sided = AlignOptions(symmetries="attn,ffn", match="weights")
    ignored = one_sided.with_(learn=LearnSettings(frame="dual"))
    for name, options in (("one", one_sided), ("dual", ignored)):
        align_to_folder(*llamas, tmp_path / name, options, progress=False)
    files = sorted(p.name for p in (tmp_path / "one").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "dual").glob("*.safetensors"))
    a, b = tensors(tmp_path / "one"), tensors(tmp_path / "dual")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = (make_model("llama", head=True, dtype=torch.float32, seed=s) for s in (0, 1))
    moved = align(a, b, ("attn", "ffn"), match="weights", learn=LearnSettings(frame="dual"))[0].state_dict()
    assert all(torch.equal(v, moved[k]) for k, v in align(a, b, ("attn", "ffn"), match="weights")[0].state_dict().items())
    models = [vit_folder(tmp_path / f"v{i}", seed=i) for i in range(3)]
    npz_file(tmp_path / "d.npz")
    plan = plan_barrier(models, tmp_path / "d.npz", BarrierOptions(align=ignored, progress=False))
    assert plan.frame != "pair"
    if importlib.util.find_spec("flwr") is not None:
        from symmerge.federated.options import ClientAlignment

        assert ClientAlignment(ignored).options.dual is False
    assert _dual().dual and not ignored.dual and not one_sided.dual
