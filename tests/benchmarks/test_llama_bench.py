"""The B7 benchmarks' helpers (``benchmarks.llama_datafree``, ``benchmarks.bench_llama_align``): the cached
pair is found exactly (the MHA pair's pattern must not pick the GQA pair's folders), the data-free
variants' stream weighting and merge-side q/k rescaling compute what they say, and a weighted stream
alignment still keeps the function. Tiny random models: seconds."""

from __future__ import annotations

import pytest
import torch

from benchmarks import llama_datafree as ld
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _folders(root, names):
    for n in names:
        (root / "llama" / n).mkdir(parents=True)


def test_pair_folders_tells_the_mha_pair_from_the_gqa_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path))
    mha = ["mypair-A-4a75f929e176", "mypair-B-642acd269685"]
    gqa = ["mypair-A-gqa2-ba17f9cd6f86", "mypair-B-gqa2-0123456789ab"]
    _folders(tmp_path, mha + gqa + ["mypair-tiny-A-04110516a46d"])
    assert [p.name for p in ld.pair_folders(name="mypair")] == mha  # "mypair-A-gqa2-..." sorts after "mypair-A-4a..."
    assert [p.name for p in ld.pair_folders(kv_heads=4, heads=4, name="mypair")] == mha  # kv heads = heads: MHA
    assert [p.name for p in ld.pair_folders(kv_heads=2, name="mypair")] == gqa
    with pytest.raises(SystemExit, match="mypair-A-gqa1"):
        ld.pair_folders(kv_heads=1, name="mypair")


def test_pair_folders_needs_both_models(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path))
    _folders(tmp_path, ["mypair-A-4a75f929e176"])
    with pytest.raises(SystemExit, match="--train-only B"):
        ld.pair_folders(name="mypair")


def test_pair_folders_refuses_a_name_several_pairs_share(tmp_path, monkeypatch):
    """Two cached recipes under one name: picking one by hash order measured another pair than the documented one."""
    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path))
    _folders(tmp_path, ["mypair-A-4a75f929e176", "mypair-A-9dac97bed36c", "mypair-B-642acd269685"])
    with pytest.raises(SystemExit, match="several cached models mypair-A .*4a75f929e176, mypair-A-9dac97bed36c"):
        ld.pair_folders(name="mypair")


@pytest.mark.parametrize("kv_heads,argv", [(None, []), (4, []), (2, ["--kv-heads", "2"])])
def test_the_b7_pair_is_llama_texts_recipe(kv_heads, argv, monkeypatch):
    """``pydocs`` (B7): the folders ``benchmarks.llama_text`` trains or reuses at its default flags (``--kv-heads`` for
    GQA), not a pattern over the cache."""
    from benchmarks import llama_text

    seen = []
    monkeypatch.setattr(llama_text, "prepare_data", lambda args, work: {"work": work})
    monkeypatch.setattr(llama_text, "train_pair",
                        lambda args, data, log: seen.append((args, data)) or (None, (0, 1), ["A", "B"]))
    assert ld.pair_folders(kv_heads) == ["A", "B"]
    (args, data), = seen
    assert vars(args) == vars(llama_text.parse_args(argv)) and data["work"] == llama_text.work_dir(args)


def test_unknown_variant_is_one_error():
    with pytest.raises(SystemExit, match="unknown variant"):
        ld.variant_setup("weights-of-the-world")
    for v in ld.VARIANTS:
        ld.variant_setup(v)


def _pair():
    """Two independent tiny Llamas (float32: HF's RMSNorm computes in float32, so a rotated stream is exact to
    float32's precision only)."""
    return tuple(make_model("llama", head=True, seed=s, dtype=torch.float32) for s in (0, 1))


def _stream(model):
    from symmerge.pipeline.bound import bind

    return next(i for i in bind(model, None, "largest").instances if not i.kind.per_layer)


def test_stream_weights_weigh_each_tensor_and_restore_the_cost():
    from symmerge.core.slots import unit_matrix
    from symmerge.groups.residual import Residual

    a, b = _pair()
    inst = _stream(a)
    sa, sb = a.state_dict(), b.state_dict()
    plain, _ = inst.kind.cost(inst, sa, sb)
    before = Residual.cost
    with ld.stream_weights("cos"):
        weighted, _ = inst.kind.cost(inst, sa, sb)
    expected = torch.zeros_like(weighted)
    for s in inst.slots:
        if not s.diag:
            x1, x2 = unit_matrix(sa[s.key], s).double(), unit_matrix(sb[s.key], s).double()
            expected += x1 @ x2.T / (x1.norm() * x2.norm())
    assert torch.allclose(weighted, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(weighted, plain)  # negative control: the weighting changes the cost
    assert Residual.cost is before and torch.equal(inst.kind.cost(inst, sa, sb)[0], plain)  # restored


def test_weighted_stream_alignment_keeps_the_function():
    a, b = _pair()
    res, wall, cpu, objective = ld.align_once(a, b, "weight-sqrt")
    assert res.report["verify_max_rel_diff"] < 1e-4 and wall > 0 and cpu > 0 and objective > 0


def test_restarts_keep_the_lowest_objective():
    a, b = _pair()
    res0, *_, obj0 = ld.align_once(a, b, "recommended")
    res, *_, obj = ld.align_once(a, b, "restarts-2")
    assert obj <= obj0 + 1e-9 and obj == pytest.approx(min(res.report["residual_sweeps_sq_distance"]))


def test_qk_norm_restores_the_interpolated_norms_only_on_q_and_k():
    from symmerge.evaluate.metrics import interpolate

    sa = make_model("llama", head=True, seed=0).state_dict()
    sb = make_model("llama", head=True, seed=1).state_dict()
    mixed = interpolate(sa, sb, 0.25)
    out = ld.qk_norm(sa, sb, 0.25, mixed)
    changed = [k for k in sa if not torch.equal(out[k], mixed[k])]
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight")) for k in changed)
    for k in changed:
        target = 0.25 * sa[k].norm() + 0.75 * sb[k].norm()
        assert out[k].norm().item() == pytest.approx(target.item(), rel=1e-12)
        assert mixed[k].norm() < target  # negative control: plain interpolation shrinks them


def test_solve_with_reaches_the_weight_matcher(monkeypatch):
    """The benchmarks' variants (``solve_with``; ``bench_llama_align``'s eager/lazy) patch ``engine.solve``:
    the weight matcher must look it up there at call time."""
    from symmerge.pipeline import engine

    a, b = _pair()
    original, seen = engine.solve, []
    monkeypatch.setattr(engine, "solve", lambda *x, **kw: seen.append(kw) or original(*x, **kw))
    with ld.solve_with(init="all"):
        assert engine.solve.keywords == {"init": "all"}
        ld.align_once(a, b, "recommended")
    assert seen and seen[0]["init"] == "all"
    ld.align_once(a, b, "recommended")
    assert "init" not in seen[-1]  # restored
