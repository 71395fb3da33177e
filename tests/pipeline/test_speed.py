"""Speed without changing a result: the exact assignment solver (lapx when installed, scipy otherwise)
reaches scipy's optimum, layers solved on a thread pool give bit-identical elements, and the CUDA paths
(skipped without a GPU) agree with the CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from factories import disguised, make_model
from symmerge.core.solvers.assignment import assignment_solver, linear_assignment, match_permutation
from symmerge.errors import SymmergeError
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.engine import solve_local
from symmerge.pipeline.options import AlignOptions

pytestmark = pytest.mark.usefixtures("single_thread")  # the shared CPU: OpenMP teams wait for each other

HAS_LAPX = assignment_solver() == "lapx.lapjvh"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ------------------------------------------------------------------ the exact assignment solver


def _costs():
    """name → float64 cost matrix: random, structured (a shuffled near-copy, low rank), ties."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 16))
    shuffled = x[rng.permutation(200)] + 0.05 * rng.standard_normal((200, 16))
    return {
        "random": rng.standard_normal((300, 300)),
        "random_large": rng.standard_normal((700, 700)),
        "shuffled_copy": -(shuffled @ x.T),
        "low_rank": rng.standard_normal((150, 2)) @ rng.standard_normal((2, 150)),
        "integer_ties": rng.integers(0, 3, (120, 120)).astype(np.float64),
        "binary_ties": rng.integers(0, 2, (64, 64)).astype(np.float64),
        "all_equal": np.full((50, 50), 2.5),
        "zeros": np.zeros((33, 33)),
        "identity_ties": np.kron(np.eye(4), np.ones((8, 8))),
        "huge_and_tiny": rng.standard_normal((100, 100)) * 10.0 ** rng.integers(-8, 8, (100, 100)),
        "wide": rng.standard_normal((40, 90)),
        "tall": rng.standard_normal((90, 40)),
        "wide_ties": rng.integers(0, 2, (30, 70)).astype(np.float64),
        "one": np.array([[3.0]]),
        "large_offset": 1e4 + rng.standard_normal((200, 200)),  # float32 keeps ~3 digits of the spread
    }


def _check_assignment(cost, rows, cols):
    rows, cols = np.asarray(rows), np.asarray(cols)
    k = min(cost.shape)
    assert len(rows) == len(cols) == k
    assert len(set(rows.tolist())) == k and len(set(cols.tolist())) == k
    assert np.all(np.diff(rows) > 0), "rows must come sorted, as scipy returns them"
    return float(cost[rows, cols].sum())


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("solver", ["lapx", None, "scipy"])
@pytest.mark.parametrize("name", list(_costs()))
def test_assignment_optimum_equals_scipy(name, solver, dtype):
    """The optimum equals scipy's float64 optimum of the same values, for float32 costs too (lapx
    solves those in float32)."""
    if solver == "lapx" and not HAS_LAPX:
        pytest.skip("lapx (lap.lapjvh) is not installed")
    cost = _costs()[name].astype(dtype)
    before = cost.copy()
    rows, cols = linear_assignment(cost, solver=solver)
    cost = cost.astype(np.float64)  # both objectives summed in float64 from the same values
    value = _check_assignment(cost, rows, cols)
    reference = float(cost[linear_sum_assignment(cost)].sum())
    assert np.array_equal(cost, before.astype(np.float64)), "the solver must not change its input"
    assert value == pytest.approx(reference, rel=1e-12, abs=1e-9 * max(1.0, np.abs(cost).max()))


def test_assignment_solver_fallback(monkeypatch):
    """``SYMMERGE_ASSIGNMENT=scipy`` forces scipy; asking for lapx where it is missing is an error."""
    monkeypatch.setenv("SYMMERGE_ASSIGNMENT", "scipy")
    assert assignment_solver() == "scipy.linear_sum_assignment"
    cost = np.random.default_rng(1).standard_normal((20, 20))
    rows, cols = linear_assignment(cost)
    assert np.array_equal(cols, linear_sum_assignment(cost)[1])
    with pytest.raises(ImportError, match="lapx"):
        linear_assignment(cost, solver="lapx")


def test_match_permutation_recovers_a_shuffle_with_either_solver(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x2 = torch.randn(257, 9, dtype=torch.float64, generator=g)
    hidden = torch.randperm(257, generator=g)
    x1 = x2[torch.argsort(hidden)]
    found = match_permutation(x1 @ x2.T)
    monkeypatch.setenv("SYMMERGE_ASSIGNMENT", "scipy")
    assert torch.equal(found, match_permutation(x1 @ x2.T))
    assert torch.equal(x1.index_select(0, found), x2)


# ------------------------------------------------------------------ layers on a thread pool


def _same_elements(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        for f in dataclasses.fields(a[name]):
            x, y = getattr(a[name], f.name), getattr(b[name], f.name)
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), f"{name}.{f.name} differs between serial and parallel"
            else:
                assert x == y, f"{name}.{f.name} differs between serial and parallel"


@pytest.mark.parametrize("family,symmetries", [
    ("bert", ("attn", "ffn", "rescale")),
    ("llama", ("heads", "attn", "ffn", "rescale")),  # RoPE pairs, GQA head permutation, SwiGLU unit scales
    ("gpt2", ("heads", "attn", "ffn", "rescale", "residual")),  # coordinate descent with the stream
])
def test_parallel_layers_are_bit_identical_to_serial(family, symmetries):
    anchor = make_model(family, head=family != "bert", num_hidden_layers=5)
    model, _, _ = disguised(anchor, symmetries=symmetries, seed=3, noise=0.3)
    results = {}
    for workers in (1, 2, 4, None):  # a few sweeps of the coordinate descent are enough to compare
        options = AlignOptions(symmetries=symmetries, workers=workers, verify=False, max_sweeps=3)
        results[workers] = align_pair(model, anchor, options)
    serial = results.pop(1)
    for res in results.values():
        _same_elements(serial.elements, res.elements)
        sa, sb = serial.model.state_dict(), res.model.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_solve_local_restores_the_callers_threads():
    anchor = make_model("bert", num_hidden_layers=4)
    model, _, _ = disguised(anchor, symmetries=("attn", "ffn"), seed=2)
    _, instances = instances_for(model)
    threads, timings = torch.get_num_threads(), {}
    opts = AlignOptions(symmetries=("attn", "ffn"), workers=3).solver_options()
    found = solve_local([i for i in instances if i.kind.per_layer], model.state_dict(), anchor.state_dict(), opts,
                        timings=timings)
    assert torch.get_num_threads() == threads, "the layers' one-thread setting must not leak to the caller"
    assert sum(1 for i in instances if i.kind.name == "permutation" and i.name in found) == 4


def test_layer_map_order_threads_and_errors():
    from symmerge.core.parallel import layer_map

    threads = torch.get_num_threads()
    assert layer_map(lambda x: (x, torch.get_num_threads()), range(5), 3) == [(x, 1) for x in range(5)]
    assert layer_map(lambda x: torch.get_num_threads(), [0], 3) == [threads]  # one item: torch's threads
    with pytest.raises(ValueError, match="bad 2"):
        layer_map(lambda x: (_ for _ in ()).throw(ValueError(f"bad {x}")) if x == 2 else x, range(4), 2)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_workers_option_is_validated(bad):
    with pytest.raises(SymmergeError, match="workers"):
        AlignOptions(workers=bad)


def test_workers_reach_the_solver():
    assert AlignOptions(workers=3).solver_options().workers == 3
    assert AlignOptions().solver_options().workers is None


# ------------------------------------------------------------------ CUDA (skipped without a GPU)


@CUDA
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_align_on_cuda_equals_cpu(family):
    """Models on the GPU, and cost GEMMs on the GPU (``device="cuda"``): the same permutations, and the
    continuous elements and aligned weights equal to float64 rounding."""
    anchor = make_model(family, head=family != "bert", num_hidden_layers=3)
    model, _, _ = disguised(anchor, symmetries=("heads", "attn", "ffn", "rescale"), seed=4, noise=0.2)
    syms = ("heads", "attn", "ffn", "rescale")
    cpu = align_pair(model, anchor, AlignOptions(symmetries=syms, verify=False))
    gemm_on_gpu = align_pair(model, anchor, AlignOptions(symmetries=syms, verify=False, device="cuda"))
    on_gpu = align_pair(model.to("cuda"), anchor.to("cuda"), AlignOptions(symmetries=syms, verify=True))
    for res in (gemm_on_gpu, on_gpu):
        assert res.elements.keys() == cpu.elements.keys()
        for name, el in cpu.elements.items():
            for f in dataclasses.fields(el):
                x, y = getattr(el, f.name), getattr(res.elements[name], f.name)
                if isinstance(x, torch.Tensor):
                    y = y.cpu()
                    if x.dtype in (torch.int64, torch.int32, torch.bool):
                        assert torch.equal(x, y), name
                    else:
                        assert torch.allclose(x, y, rtol=1e-7, atol=1e-9), name
        sc, sg = cpu.model.state_dict(), res.model.state_dict()
        for k in sc:
            assert torch.allclose(sc[k], sg[k].cpu(), rtol=1e-7, atol=1e-9), k


@CUDA
def test_statistics_and_evaluation_on_cuda_equal_cpu():
    from symmerge.evaluate.metrics import evaluate
    from symmerge.merge.statistics import fisher_stats, gram_stats
    from test_stats import st_bert, st_text_data

    model, data = st_bert(0).to(torch.float64), st_text_data()
    for stats in (gram_stats, fisher_stats):
        cpu = stats(model, data, device="cpu", progress=False)
        gpu = stats(model, data, device="cuda", progress=False)
        assert cpu.tensors.keys() == gpu.tensors.keys()
        for k, v in cpu.tensors.items():
            assert torch.allclose(v, gpu.tensors[k].cpu(), rtol=1e-6, atol=1e-9), k
    on_cpu = evaluate(model, data, device="cpu", progress=False)
    on_gpu = evaluate(model, data, device="cuda", progress=False)
    assert on_cpu.keys() == on_gpu.keys()
    for k in on_cpu:
        assert on_cpu[k] == pytest.approx(on_gpu[k], rel=1e-6, abs=1e-9), k


def test_bench_matching_runs(monkeypatch, capsys):
    """``python -m benchmarks.bench_matching`` runs on the current API and prints its fields (2 small layers)."""
    import json
    import sys

    from benchmarks import bench_matching

    monkeypatch.setattr(sys, "argv", ["bench_matching", "--layers", "2", "--repeats", "1", "--hidden", "128",
                                      "--ffn", "256"])
    bench_matching.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("full_match_s", "full_match_serial_s", "full_match_serial_scipy_s", "attn_match_s",
                "attn_match_serial_s", "ffn_assignment_s_per_layer", "load_avg_start"):
        assert key in result
    assert "scipy" in result["ffn_assignment_s_per_layer"]


@pytest.mark.parametrize("family", ["bert", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("budget", [None, 1 << 12])  # one block, or blocks of 256 rows (the streamed path)
def test_permutation_cost_equals_the_float64_sum_of_member_products(family, dtype, budget, monkeypatch):
    """The FFN cost built block by block and member by member (first member written, the others added
    in place; signed SwiGLU members as |C±| + C₀) equals the float64 reference, in the members' precision."""
    import symmerge.groups.permutation as P

    if budget is not None:
        real = P.row_chunks
        monkeypatch.setattr(P, "row_chunks", lambda n, width, b=0: real(n, width, budget))
    model = make_model(family, intermediate_size=600).to(dtype)
    other = make_model(family, intermediate_size=600, seed=1).to(dtype)
    sa, sb = model.state_dict(), other.state_dict()
    _, instances = instances_for(model)
    ffn = next(i for i in instances if i.group.kind == "permutation")
    signed = ffn.group.param("unit_scale") == "nonzero"
    assert signed == (family == "llama")
    cost = P.permutation_cost(ffn, sa, sb, signed=signed)
    assert cost.dtype == dtype and cost.shape == (600, 600)

    def prod(s):
        x1 = sa[s.key].movedim(s.axis, 0).reshape(600, -1).double()
        x2 = sb[s.key].movedim(s.axis, 0).reshape(600, -1).double()
        return x1 @ x2.T

    scaled = sum(prod(s) for s in ffn.slots if signed and s.power)
    ref = (scaled.abs() if signed else 0) + sum(prod(s) for s in ffn.slots if not (signed and s.power))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (cost.double() - ref).abs().max() <= tol * ref.abs().max()
