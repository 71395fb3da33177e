"""The generic solvers against independent computations: random search / brute force / closed forms."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from symmerge.core.solvers import (head_objective, joint_scale, match_permutation, procrustes, scale_for_rotation,
                              sequential_scale)
from symmerge.core.parallel import layer_map

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64


def haar_orthogonal(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    """n Haar-random matrices of O(d) (both determinants)."""
    q, r = torch.linalg.qr(torch.randn(n, d, d, dtype=F64, generator=g))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]


def trace_inner(R, M):
    """tr(Rᵀ M), batched."""
    return torch.einsum("...ij,...ij->...", R, M)


# ------------------------------------------------------------------ Procrustes


@pytest.mark.parametrize("d", [2, 3, 5, 8])
def test_procrustes_beats_random_orthogonal_matrices(d):
    g = torch.Generator().manual_seed(d)
    M = torch.randn(d, d, dtype=F64, generator=g)
    R, nuc = procrustes(M)
    # R is orthogonal
    assert torch.allclose(R.T @ R, torch.eye(d, dtype=F64), atol=1e-12)
    # tr(RᵀM) is the nuclear norm (closed form via singular values, computed independently here)
    best = trace_inner(R, M).item()
    nuclear = np.linalg.norm(M.numpy(), ord="nuc")
    assert best == pytest.approx(nuclear, rel=1e-12)
    assert nuc.item() == pytest.approx(nuclear, rel=1e-12)
    # and no orthogonal matrix does better: 2000 Haar-random ones (both components of O(d)) ...
    Qs = haar_orthogonal(2000, d, g)
    assert (torch.linalg.det(Qs) < 0).any() and (torch.linalg.det(Qs) > 0).any()
    others = trace_inner(Qs, M[None])
    assert others.max().item() <= best + 1e-12
    # ... nor small perturbations of R (a strict local maximum)
    A = torch.randn(200, d, d, dtype=F64, generator=g)
    near = R[None] @ torch.linalg.matrix_exp(1e-3 * (A - A.mT))
    assert (trace_inner(near, M[None]) < best).all()


def test_procrustes_batched_and_recovers_rotation():
    g = torch.Generator().manual_seed(7)
    Q = haar_orthogonal(6, 4, g)
    X = torch.randn(6, 4, 10, dtype=F64, generator=g)
    # X1 = Qᵀ X2  ⇒  M = X1 X2ᵀ = Qᵀ X2 X2ᵀ and the best R (RᵀX1 ≈ X2) is Qᵀ
    X1 = Q.mT @ X
    R, nuc = procrustes(X1 @ X.mT)
    assert R.shape == (6, 4, 4) and nuc.shape == (6,)
    assert torch.allclose(R, Q.mT, atol=1e-10)
    assert torch.allclose(R.mT @ X1, X, atol=1e-10)


# ------------------------------------------------------------------ assignment


def brute_force_best(C: np.ndarray) -> float:
    n = C.shape[0]
    return max(sum(C[p[j], j] for j in range(n)) for p in itertools.permutations(range(n)))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_match_permutation_equals_brute_force(n):
    rng = np.random.default_rng(100 + n)
    for trial in range(4):
        C = rng.normal(size=(n, n))
        if trial == 3:
            C = np.round(C)  # integer costs with ties
        perm = match_permutation(torch.from_numpy(C)).numpy()
        assert sorted(perm.tolist()) == list(range(n))
        value = sum(C[perm[j], j] for j in range(n))
        assert value == pytest.approx(brute_force_best(C), abs=1e-12)


def test_match_permutation_semantics_and_batch():
    """index_select(perm) must put the matching unit of the moved model at the anchor's position."""
    g = torch.Generator().manual_seed(3)
    costs, truths, units = [], [], []
    for n in (5, 9, 30):
        X2 = torch.randn(n, 12, dtype=F64, generator=g)
        hidden = torch.randperm(n, generator=g)
        X1 = X2[torch.argsort(hidden)]  # X1 = X2 with units shuffled
        costs.append(X1 @ X2.T)
        truths.append(hidden)
        units.append((X1, X2))
    for perm, (X1, X2) in zip(layer_map(match_permutation, costs, workers=2), units):
        assert torch.equal(X1.index_select(0, perm), X2)
    for C, (X1, X2) in zip(costs, units):
        assert torch.equal(X1.index_select(0, match_permutation(C)), X2)


# ------------------------------------------------------------------ rescale


def head_data(X1p, X1m, X2p, X2m):
    """The solver inputs from raw head blocks (H, d, cols), as defined in symmerge/solvers/rescale.py."""
    sq = lambda x: x.square().sum((1, 2))  # noqa: E731
    return X1p @ X2p.mT, X1m @ X2m.mT, sq(X1p), sq(X1m), sq(X2p), sq(X2m)


def true_distance(a, R, X1p, X1m, X2p, X2m):
    """‖a RᵀX1₊ − X2₊‖² + ‖RᵀX1₋/a − X2₋‖² per head, computed directly from the blocks."""
    a = a[:, None, None]
    return ((a * R.mT @ X1p - X2p).square().sum((1, 2)) + (R.mT @ X1m / a - X2m).square().sum((1, 2)))


def random_heads(seed: int, H: int = 24, d: int = 4):
    """Head blocks of assorted sizes and scale mismatches, so optimal scales are far from 1 sometimes."""
    g = torch.Generator().manual_seed(seed)
    X1p = torch.randn(H, d, 7, dtype=F64, generator=g) * torch.exp(torch.randn(H, 1, 1, dtype=F64, generator=g))
    X1m = torch.randn(H, d, 5, dtype=F64, generator=g) * torch.exp(torch.randn(H, 1, 1, dtype=F64, generator=g))
    Q = haar_orthogonal(H, d, g)
    # anchors: correlated with a rotated copy (as in practice), plus independent parts
    X2p = 0.8 * Q @ X1p * 1.5 + 0.6 * torch.randn(H, d, 7, dtype=F64, generator=g)
    X2m = 0.8 * Q @ X1m / 1.5 + 0.6 * torch.randn(H, d, 5, dtype=F64, generator=g)
    return X1p, X1m, X2p, X2m


def profile(a, Mp, Mm, n1p, n1m):
    """F(a) = min_R f(a, R) via numpy's nuclear norm (independent of the solver's SVD path)."""
    a = np.asarray(a, dtype=np.float64)
    M = a[..., None, None] * Mp.numpy() + Mm.numpy() / a[..., None, None]
    nuc = np.linalg.svd(M, compute_uv=False).sum(-1)
    return a * a * n1p.numpy() + n1m.numpy() / (a * a) - 2 * nuc


def dense_min(Mp, Mm, n1p, n1m, lo=1e-2, hi=1e2, points=4000):
    """Global minimum of the profile per head: dense log grid, then golden-section refinement."""
    H = Mp.shape[0]
    grid = np.exp(np.linspace(np.log(lo), np.log(hi), points))
    vals = profile(np.broadcast_to(grid[:, None], (points, H)).copy(), Mp, Mm, n1p, n1m)  # (points, H)
    idx = vals.argmin(0)
    assert (idx > 0).all() and (idx < points - 1).all(), "minimiser at the edge of the search range"
    left, right = np.log(grid[idx - 1]), np.log(grid[idx + 1])
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        x1, x2 = right - ratio * (right - left), left + ratio * (right - left)
        f1, f2 = profile(np.exp(x1), Mp, Mm, n1p, n1m), profile(np.exp(x2), Mp, Mm, n1p, n1m)
        right, left = np.where(f1 < f2, x2, right), np.where(f1 < f2, left, x1)
    a = np.exp((left + right) / 2)
    return a, profile(a, Mp, Mm, n1p, n1m)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rescale_objective_ordering_and_brute_force(seed):
    X1p, X1m, X2p, X2m = random_heads(seed)
    Mp, Mm, n1p, n1m, n2p, n2m = head_data(X1p, X1m, X2p, X2m)
    const = n2p + n2m

    # the solver's objective is the true squared distance minus the anchor's norm
    g = torch.Generator().manual_seed(seed)
    R_any, a_any = haar_orthogonal(len(n1p), Mp.shape[-1], g), torch.exp(torch.randn(len(n1p), dtype=F64, generator=g))
    assert torch.allclose(head_objective(a_any, R_any, Mp, Mm, n1p, n1m) + const,
                          true_distance(a_any, R_any, X1p, X1m, X2p, X2m), rtol=1e-10)

    ones = torch.ones_like(n1p)
    R0, _ = procrustes(Mp + Mm)
    f_none = true_distance(ones, R0, X1p, X1m, X2p, X2m)
    R_s, a_s = sequential_scale(Mp, Mm, n1p, n1m)
    f_seq = true_distance(a_s, R_s, X1p, X1m, X2p, X2m)
    R_j, a_j = joint_scale(Mp, Mm, n1p, n1m, n2p, n2m)
    f_joint = true_distance(a_j, R_j, X1p, X1m, X2p, X2m)
    eps = 1e-10 * const
    assert (f_joint <= f_seq + eps).all()
    assert (f_seq <= f_none + eps).all()
    assert (a_s > 0).all() and (a_j > 0).all()
    assert torch.allclose(R_j.mT @ R_j, torch.eye(Mp.shape[-1], dtype=F64).expand_as(R_j), atol=1e-12)

    # joint = global minimum of the 1-D nuclear-norm profile, found by a dense independent search
    a_star, F_star = dense_min(Mp, Mm, n1p, n1m)
    f_joint_obj = head_objective(a_j, R_j, Mp, Mm, n1p, n1m).numpy()
    scale = const.numpy()
    assert np.all(f_joint_obj <= F_star + 1e-11 * scale)
    assert np.all(np.abs(f_joint_obj - F_star) <= 1e-10 * scale)
    assert np.allclose(a_j.numpy(), a_star, rtol=1e-4)
    # and the joint R is the Procrustes rotation at the joint a (f(a_j, R_j) = F(a_j))
    assert np.allclose(f_joint_obj, profile(a_j.numpy(), Mp, Mm, n1p, n1m), rtol=0, atol=1e-10 * scale.max())

    # sequential: R is Procrustes of Mp + Mm at a = 1, and a is a root of the paper's quartic (eq. 12)
    assert torch.allclose(R_s, R0, atol=1e-12)
    cp, cm = trace_inner(R_s, Mp), trace_inner(R_s, Mm)
    quartic = n1p * a_s**4 - cp * a_s**3 + cm * a_s - n1m
    size = n1p * a_s**4 + cp.abs() * a_s**3 + cm.abs() * a_s + n1m
    assert (quartic.abs() <= 1e-10 * size).all()
    # ... namely the root minimising f(·, R_s) over a > 0 (dense grid)
    grid = torch.exp(torch.linspace(math.log(1e-2), math.log(1e2), 20001, dtype=F64))[:, None]
    on_grid = grid**2 * n1p + n1m / grid**2 - 2 * (grid * cp + cm / grid)
    f_s = head_objective(a_s, R_s, Mp, Mm, n1p, n1m)
    assert (f_s <= on_grid.min(0).values + 1e-12 * scale.max()).all()


def test_scale_for_rotation_closed_form_identity_rotation():
    """With R = I and X2 = (c X1₊, X1₋ / c), the best scale is exactly c."""
    g = torch.Generator().manual_seed(11)
    X1p, X1m = torch.randn(5, 3, 6, dtype=F64, generator=g), torch.randn(5, 3, 4, dtype=F64, generator=g)
    c = torch.tensor([0.2, 0.7, 1.0, 2.5, 9.0], dtype=F64)
    Mp, Mm, n1p, n1m, _, _ = head_data(X1p, X1m, c[:, None, None] * X1p, X1m / c[:, None, None])
    eye = torch.eye(3, dtype=F64).expand(5, 3, 3)
    assert torch.allclose(scale_for_rotation(eye, Mp, Mm, n1p, n1m), c, rtol=1e-10)


def rot2(theta: float) -> torch.Tensor:
    return torch.tensor([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]], dtype=F64)


def brute_force_2d(Mp, Mm, n1p, n1m, a_grid, angles=7200):
    """min over a ∈ a_grid and all of O(2) (rotations and reflections, angle grid) of f(a, R)."""
    t = torch.linspace(0, 2 * math.pi, angles + 1, dtype=F64)[:-1]
    c, s = torch.cos(t), torch.sin(t)
    rots = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    refl = torch.stack([torch.stack([c, s], -1), torch.stack([s, -c], -1)], -2)
    Rs = torch.cat([rots, refl])  # (2·angles, 2, 2)
    cp, cm = trace_inner(Rs, Mp), trace_inner(Rs, Mm)  # (2·angles,)
    a = a_grid[:, None]
    f = a * a * n1p + n1m / (a * a) - 2 * (a * cp[None] + cm[None] / a)
    return f.min().item()


def test_joint_strictly_better_than_sequential():
    """A head where the QK parts disagree on the rotation at a = 1 but not at the optimal scale:
    X2₊ = 2·X1₊ (wants R = I, a = 2), X2₋ a quarter-turn of X1₋ (wants a = 1). At a = 1 the Procrustes
    rotation is a compromise (26.6°); the joint optimum moves to a ≈ 2 and nearly R = I."""
    X1p = torch.eye(2, dtype=F64)[None]
    X1m = torch.eye(2, dtype=F64)[None]
    X2p = 2.0 * X1p
    X2m = (rot2(math.pi / 2) @ X1m[0])[None]
    Mp, Mm, n1p, n1m, n2p, n2m = head_data(X1p, X1m, X2p, X2m)
    R_s, a_s = sequential_scale(Mp, Mm, n1p, n1m)
    R_j, a_j = joint_scale(Mp, Mm, n1p, n1m, n2p, n2m)
    f_s = true_distance(a_s, R_s, X1p, X1m, X2p, X2m).item()
    f_j = true_distance(a_j, R_j, X1p, X1m, X2p, X2m).item()
    # closed forms for this construction: F(a) = 2[a² + 1/a² − 2√(4a² + 1/a²)] + ‖X2‖²
    a_grid = np.exp(np.linspace(-3, 3, 200001))
    closed = 2 * (a_grid**2 + 1 / a_grid**2 - 2 * np.sqrt(4 * a_grid**2 + 1 / a_grid**2)) + n2p.item() + n2m.item()
    assert f_j == pytest.approx(closed.min(), abs=1e-8)
    assert f_j < f_s - 0.5  # strictly (and substantially) lower: 2.364 vs 3.223
    # an independent brute force over O(2) × a confirms the joint value is the global minimum
    a_dense = torch.exp(torch.linspace(-2, 2, 2001, dtype=F64))
    brute = brute_force_2d(Mp[0], Mm[0], n1p[0], n1m[0], a_dense, angles=3600) + n2p.item() + n2m.item()
    assert f_j <= brute + 1e-12
    assert f_j >= brute - 1e-5
    # and the sequential rotation really is the a = 1 compromise
    angle = math.atan2(R_s[0, 1, 0].item(), R_s[0, 0, 0].item())
    assert abs(abs(angle) - math.atan(0.5)) < 1e-10


def test_joint_brute_force_random_2d_heads():
    """Joint solution vs brute force over O(2) × a for random 2-D heads (no nuclear-norm identity used)."""
    X1p, X1m, X2p, X2m = random_heads(5, H=6, d=2)
    Mp, Mm, n1p, n1m, n2p, n2m = head_data(X1p, X1m, X2p, X2m)
    R_j, a_j = joint_scale(Mp, Mm, n1p, n1m, n2p, n2m)
    f_j = head_objective(a_j, R_j, Mp, Mm, n1p, n1m)
    a_dense = torch.exp(torch.linspace(math.log(0.05), math.log(20), 1201, dtype=F64))
    for h in range(6):
        brute = brute_force_2d(Mp[h], Mm[h], n1p[h], n1m[h], a_dense, angles=2400)
        tol = 1e-4 * (n2p[h] + n2m[h]).item()
        assert f_j[h].item() <= brute + 1e-10
        assert f_j[h].item() >= brute - tol


def test_joint_finds_global_minimum_of_two_basin_profile():
    """Profiles with two local minima: the joint solver must return the lower one, not the one
    next to the sequential start."""
    found = 0
    for seed in range(40):
        X1p, X1m, X2p, X2m = random_heads(1000 + seed, H=16, d=3)
        Mp, Mm, n1p, n1m, n2p, n2m = head_data(X1p, X1m, X2p, X2m)
        grid = np.exp(np.linspace(np.log(1e-2), np.log(1e2), 3000))
        vals = profile(np.broadcast_to(grid[:, None], (3000, 16)).copy(), Mp, Mm, n1p, n1m)
        interior = (vals[1:-1] < vals[:-2]) & (vals[1:-1] < vals[2:])
        multi = interior.sum(0) >= 2
        if not multi.any():
            continue
        found += int(multi.sum())
        R_j, a_j = joint_scale(Mp, Mm, n1p, n1m, n2p, n2m)
        f_j = head_objective(a_j, R_j, Mp, Mm, n1p, n1m).numpy()
        assert np.all(f_j[multi] <= vals[:, multi].min(0) + 1e-10 * (n2p + n2m).numpy()[multi])
        if found >= 5:
            break
    if not found:
        pytest.skip("no two-basin profile among the random heads")


def test_match_permutation_consume_negates_in_place_and_agrees():
    """consume=True hands the solver the cost negated in place (no copy): same optimum, cost spent;
    the default leaves the caller's cost untouched; float32 costs are solved as float32, other dtypes
    (half) converted to float64, never touching the caller's tensor."""
    g = torch.Generator().manual_seed(5)
    C = torch.randn(40, 40, dtype=F64, generator=g)
    keep = C.clone()
    perm = match_permutation(C)
    assert torch.equal(C, keep)
    assert torch.equal(match_permutation(C, consume=True), perm)
    assert torch.equal(C, -keep)  # consumed
    best = keep[perm, torch.arange(40)].sum()
    for _ in range(200):  # no random permutation beats it
        p = torch.randperm(40, generator=g)
        assert keep[p, torch.arange(40)].sum() <= best + 1e-12
    C32 = keep.float()
    assert torch.equal(match_permutation(C32), perm) and torch.equal(C32, keep.float())
    assert torch.equal(match_permutation(C32, consume=True), perm) and torch.equal(C32, -keep.float())
    C16 = keep.half()
    assert torch.equal(match_permutation(C16, consume=True), match_permutation(C16.double()))
    assert torch.equal(C16, keep.half())


# ------------------------------------------------------------------ RoPE pairs (closed form per pair)


def _pair_case(seed, n=5, pairs=6):
    """Random head blocks (rotate_half layout: pair j = rows j, j + pairs) of a moved (1) and an anchor
    (2) model, Q rows (power +1) and K rows (-1); the per-pair products the solver works from."""
    from symmerge.core.solvers.rope import pair_products

    g = torch.Generator().manual_seed(seed)
    q1, q2, k1, k2 = (torch.randn(1, 2 * pairs, n, dtype=torch.float64, generator=g) for _ in range(4))
    cp, P = pair_products(2.5 * q1, q2, 2 * pairs)  # unequal Q/K norms: the optimal scale is far from 1
    cm, M = pair_products(k1, k2, 2 * pairs)
    return cp[0], cm[0], P[0], M[0]


def _brute(f, theta_fixed=None, rho_fixed=None):
    """min f(ρ, θ) over a dense grid, refined by Nelder–Mead from the best grid point."""
    from scipy.optimize import minimize

    thetas = np.linspace(-math.pi, math.pi, 721) if theta_fixed is None else np.array([theta_fixed])
    logs = np.linspace(-4, 4, 801) if rho_fixed is None else np.array([math.log(rho_fixed)])
    T, L = np.meshgrid(thetas, logs)
    values = f(np.exp(L), T)
    k = np.unravel_index(values.argmin(), values.shape)
    free = [v is None for v in (theta_fixed, rho_fixed)]

    def obj(z):
        t = z[0] if free[0] else theta_fixed
        r = math.exp(z[-1]) if free[1] else rho_fixed
        return f(np.array(r), np.array(t))

    x0 = [v for v, keep in zip((T[k], L[k]), free) if keep]
    if not x0:
        return float(values[k])
    return minimize(obj, x0, method="Nelder-Mead", options=dict(xatol=1e-12, fatol=1e-14, maxiter=4000)).fun


@pytest.mark.parametrize("seed", range(3))
def test_rope_pair_solver_equals_brute_force(seed):
    from symmerge.core.solvers.rope import pair_objective, solve_pairs

    cp, cm, P, M = _pair_case(seed)
    results = {mode: solve_pairs(cp, cm, P, M, True, mode) for mode in ("none", "sequential", "joint")}
    values = {m: pair_objective(r[1], r[0], cp, cm, P, M) for m, r in results.items()}
    for j in range(len(cp)):
        def f(rho, theta):
            w = np.exp(-1j * theta)
            return rho**2 * P[j].item() + M[j].item() / rho**2 - 2 * (w * (rho * complex(cp[j]) + complex(cm[j]) / rho)).real
        scale = P[j].item() + M[j].item()
        assert values["none"][j].item() == pytest.approx(_brute(f, rho_fixed=1.0), abs=1e-9 * scale)
        theta_seq = results["sequential"][0][j].item()
        assert values["sequential"][j].item() == pytest.approx(_brute(f, theta_fixed=theta_seq), abs=1e-9 * scale)
        best = _brute(f)
        assert values["joint"][j].item() <= best + 1e-9 * scale
        assert values["joint"][j].item() == pytest.approx(best, abs=1e-7 * scale)
        assert values["joint"][j] <= values["sequential"][j] + 1e-12 * scale
        assert values["sequential"][j] <= values["none"][j] + 1e-12 * scale


def test_rope_pair_solver_degenerate_cases():
    from symmerge.core.solvers.rope import solve_pairs

    z = torch.zeros(3, dtype=torch.complex128)
    P, M = torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64), torch.tensor([16.0, 1.0, 2.0], dtype=torch.float64)
    theta, rho = solve_pairs(z, z, P, M, True, "joint")
    torch.testing.assert_close(rho, (M / P) ** 0.25)  # only ρ²P + M/ρ² is left
    theta, rho = solve_pairs(torch.tensor([1j]), torch.tensor([1j]), torch.ones(1, dtype=torch.float64),
                             torch.ones(1, dtype=torch.float64), True, "none")
    assert theta.item() == pytest.approx(math.pi / 2) and rho.item() == 1.0


def test_rope_solution_minimises_the_actual_distance():
    """Solver conventions agree with ``apply``: the solved element, applied to the weights, is closer
    to the anchor than many random RoPE-commuting elements, and small perturbations only increase it."""
    from factories import make_model
    from symmerge.core.apply import apply, random_elements
    from symmerge.core.solvers.rope import rope_element
    from symmerge.groups import Options
    from symmerge.groups.head_orthogonal import HeadElement
    from symmerge.pipeline.align import instances_for
    from symmerge.pipeline.engine import solve_local

    a, b = make_model("qwen2", seed=0), make_model("qwen2", seed=5)
    qk = [i for i in instances_for(a)[1] if i.group.kind == "rope_pairs"]
    keys = [s.key for i in qk for s in i.slots]
    sa, sb = a.state_dict(), b.state_dict()

    def dist(sd):
        return sum((sd[k] - sb[k]).square().sum().item() for k in keys)

    found = solve_local(qk, sa, sb, Options(frozenset({"attn", "rescale"}), "joint"))
    best = dist(apply(sa, qk, found))
    assert best < dist(sa)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert best <= dist(apply(sa, qk, random_elements(qk, g)))
    for inst in qk:
        e = found[inst.name]
        half = inst.info.rotary // 2
        tweak = rope_element(torch.full((inst.blocks, half), 1e-3, dtype=torch.float64),
                             torch.full((inst.blocks, half), 1.001, dtype=torch.float64), None, None, inst.size)
        moved = dict(found)
        moved[inst.name] = HeadElement(e.R @ tweak[0], e.a * tweak[1])
        assert dist(apply(sa, qk, moved)) > best


def test_signed_unit_scale_is_brute_force_optimal():
    from symmerge.core.solvers.rescale import quartic_scale

    g = torch.Generator().manual_seed(1)
    cp, cm = torch.randn(20, generator=g, dtype=torch.float64), torch.randn(20, generator=g, dtype=torch.float64)
    p, m = torch.rand(20, generator=g, dtype=torch.float64) + 0.1, torch.rand(20, generator=g, dtype=torch.float64) + 0.1
    s = quartic_scale(cp, cm, p, m, signed=True)
    grid = torch.cat([-torch.logspace(-3, 3, 20001, dtype=torch.float64), torch.logspace(-3, 3, 20001, dtype=torch.float64)])
    f = lambda a: a * a * p[:, None] - 2 * a * cp[:, None] + m[:, None] / (a * a) - 2 * cm[:, None] / a  # noqa: E731
    assert (f(s[:, None])[:, 0] <= f(grid[None]).min(1).values + 1e-12).all()
    assert ((s < 0) == (f(grid[None, :20001]).min(1).values < f(grid[None, 20001:]).min(1).values)).all()


# ------------------------------------------------------------------ the residual stream's groups


def test_signed_permutation_residual_equals_brute_force():
    from symmerge.core.solvers import signed_permutation_residual

    g = torch.Generator().manual_seed(0)
    d = 4
    for _ in range(5):
        C = torch.randn(d, d, dtype=torch.float64, generator=g)
        D = torch.rand(d, d, dtype=torch.float64, generator=g)
        perm, signs = signed_permutation_residual(C, D)
        mine = sum(signs[j] * C[perm[j], j] + D[perm[j], j] for j in range(d))
        best = max(sum(s[j] * C[p[j], j] + D[p[j], j] for j in range(d))
                   for p in itertools.permutations(range(d)) for s in itertools.product((-1, 1), repeat=d))
        assert mine.item() == pytest.approx(best.item(), abs=1e-12)


def test_permutation_residual_equals_brute_force():
    from symmerge.core.solvers import permutation_residual

    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        C, D = torch.randn(5, 5, generator=g, dtype=torch.float64), torch.randn(5, 5, generator=g, dtype=torch.float64)
        perm = permutation_residual(C, D)
        best = max(sum(C[p[j], j] + D[p[j], j] for j in range(5)).item() for p in itertools.permutations(range(5)))
        assert sum(C[perm[j], j] + D[perm[j], j] for j in range(5)).item() == pytest.approx(best, rel=1e-12)
        assert torch.equal(torch.sort(perm).values, torch.arange(5))


# ------------------------------------------------------------------ head permutation × per-head groups


@pytest.mark.parametrize("rescale", ["none", "joint"])
def test_head_pairing_with_per_head_rotations_is_jointly_optimal(rescale):
    """3 heads: heads + attn (+ rescale) reaches the minimum over all 6 head permutations, each followed
    by the exactly solved per-head groups: pairing by the optimal per-pair values is exact."""
    from factories import make_model
    from symmerge.core.apply import apply
    from symmerge.core.distance import sq_distance
    from symmerge.groups import Options
    from symmerge.groups.heads import HeadPerm
    from symmerge.pipeline.align import instances_for
    from symmerge.pipeline.engine import solve_local

    a, b = make_model("bert", seed=0), make_model("bert", seed=4)
    _, instances = instances_for(a)
    layer = [i for i in instances if i.layer == 0 and i.group.symmetry in ("heads", "attn")]
    heads, attn = layer[0], layer[1:]
    keys = sorted({s.key for i in layer for s in i.slots})
    sa, sb = a.state_dict(), b.state_dict()
    syms = {"heads", "attn"} | ({"rescale"} if rescale != "none" else set())
    found = solve_local(layer, sa, sb, Options(frozenset(syms), rescale))
    got = sq_distance(apply(sa, layer, found), sb, keys)
    values = []
    for p in itertools.permutations(range(3)):
        perm = torch.tensor(p)
        moved = apply(sa, [heads], {heads.name: HeadPerm(perm, perm)})
        rest = solve_local(attn, moved, sb, Options(frozenset(syms - {"heads"}), rescale))
        values.append(sq_distance(apply(moved, attn, rest), sb, keys))
    assert got == pytest.approx(min(values), rel=1e-10)
    assert min(values) < max(values)  # the pairing matters here
