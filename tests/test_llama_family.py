"""Llama / Mistral / Qwen2 / Qwen3 (and Phi's partial RoPE): RoPE-pair QK group (Qwen3: restricted by its
per-head q_norm/k_norm), GQA-shared VO rotations, SwiGLU permutation + unit scales, RMSNorm residual
stream (folded norms, orthogonal Q; signed permutations when a tied LM head keeps a non-uniform final norm).

transformers' RMSNorm computes in float32 even for a float64 model (``hidden.to(torch.float32)``),
which caps any fp64 equivalence check at ~1e-7. The fp64 tests therefore replace its forward by the
same formula evaluated in the input dtype (:func:`fp64_rmsnorm`); for float32 inputs it is the same
computation, and the fp32 tests run the unmodified classes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from conftest import add_noise, make_inputs, output_rel_diff, sq_dist, with_weights
from symmerge.align import align, instances_for
from symmerge.apply import HeadElement, PermElement, apply, fold_norms, haar, random_elements
from symmerge.errors import SymmergeError
from symmerge.solve import solve_local
from symmerge.solvers.residual import signed_permutation_residual
from symmerge.solvers.rope import pair_objective, pair_products, rope_element, solve_pairs
from symmerge.solvers.rescale import quartic_scale

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
HIDDEN, HEADS, KV, FFN, LAYERS, VOCAB = 32, 4, 2, 40, 2, 64
FAMILIES = ("llama", "mistral", "qwen2", "llama-bias", "qwen3")


def _classes(family):
    import transformers as T

    return {"llama": (T.LlamaConfig, T.LlamaForCausalLM, T.LlamaModel),
            "llama-bias": (T.LlamaConfig, T.LlamaForCausalLM, T.LlamaModel),
            "mistral": (T.MistralConfig, T.MistralForCausalLM, T.MistralModel),
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, T.Qwen2Model),
            "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, T.Qwen3Model),
            "phi": (T.PhiConfig, T.PhiForCausalLM, T.PhiModel)}[family]


def decoder(family="llama", tied=False, dtype=torch.float64, seed=0, base=False, kv=KV, **overrides):
    """A tiny random decoder with GQA; every 1-D parameter (norms, biases) randomised too."""
    config_cls, lm_cls, base_cls = _classes(family)
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=kv, initializer_range=0.3, tie_word_embeddings=tied,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama-bias":
        kw.update(attention_bias=True, mlp_bias=True)
    if family == "phi":
        kw.update(partial_rotary_factor=0.5)
    if family == "qwen3":  # Qwen3Config defaults to head_dim 128 whatever the hidden size
        kw.update(head_dim=HIDDEN // HEADS)
    torch.manual_seed(seed)
    model = (base_cls if base else lm_cls)(config_cls(**{**kw, **overrides}))
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


@pytest.fixture
def fp64_rmsnorm(monkeypatch):
    """RMSNorm in the input dtype (see the module docstring)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm):
        monkeypatch.setattr(cls, "forward", forward)


def group_of(inst) -> str:
    return {"head_orthogonal": "attn", "rope_pairs": "attn", "permutation": "ffn", "residual": "residual"}[inst.group.kind]


def elements_of(instances, symmetry: str, seed: int) -> dict:
    """A random element of one symmetry: ``attn`` (rotations only), ``rescale`` (scales only: RoPE
    pairs, VO heads, SwiGLU units), ``ffn`` (permutations), ``residual``, or ``all``."""
    full = random_elements(instances, torch.Generator().manual_seed(seed), scale=symmetry in ("rescale", "all"))
    out = {}
    for inst in instances:
        el, kind = full[inst.name], group_of(inst)
        if symmetry == "all" or symmetry == kind == "attn" or symmetry == kind == "residual":
            out[inst.name] = el
        elif symmetry == kind == "ffn":
            out[inst.name] = PermElement(el.perm)
        elif symmetry == "rescale" and kind == "attn":
            out[inst.name] = HeadElement(HeadElement.identity(inst.blocks, inst.size).R, el.a)
        elif symmetry == "rescale" and kind == "ffn":
            out[inst.name] = PermElement(torch.arange(inst.size), el.scale)
    return out


def transformed(model, symmetry="all", seed=0) -> dict:
    _, instances = instances_for(model)
    sd = fold_norms(model.state_dict(), instances) if symmetry in ("residual", "all") else model.state_dict()
    return apply(sd, instances, elements_of(instances, symmetry, seed))


# ------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("symmetry", ["attn", "rescale", "ffn", "residual", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_element_preserves_outputs(family, symmetry, tied, dtype, request):
    if dtype == torch.float64:
        request.getfixturevalue("fp64_rmsnorm")
    model = decoder(family, tied, dtype)
    inputs = make_inputs(model)
    for seed in (0, 1):
        new = transformed(model, symmetry, seed)
        assert any(not torch.equal(new[k], v) for k, v in model.state_dict().items())
        assert output_rel_diff(model, with_weights(model, new), inputs) <= TOL[dtype]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mha_without_gqa_and_one_kv_head(family, fp64_rmsnorm):
    for kv in (HEADS, 1):
        model = decoder(family, kv=kv)
        assert output_rel_diff(model, with_weights(model, transformed(model)), make_inputs(model)) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_base_model_local_symmetries(dtype, fp64_rmsnorm):
    """LlamaModel (no head): its output is the stream itself, so there is no residual group."""
    model = decoder("llama", base=True, dtype=dtype)
    _, instances = instances_for(model)
    assert all(i.group.kind != "residual" for i in instances)
    new = transformed(model, "all")
    assert output_rel_diff(model, with_weights(model, new), make_inputs(model)) <= TOL[dtype]
    with pytest.raises(SymmergeError, match="residual"):
        align(model, model, ("attn", "residual"))


def test_residual_moves_every_stream_tensor():
    """Independent list: every weight and norm except the readers' own output biases (q/k/v,
    gate/up), which live in head/unit space, not on the stream."""
    model = decoder("llama-bias")
    sd = model.state_dict()
    _, instances = instances_for(model)
    res = [i for i in instances if i.name == "residual"]
    folded = fold_norms(sd, res)
    new = apply(folded, res, elements_of(res, "residual", 0))
    changed = {k for k in sd if not torch.equal(new[k], folded[k])}
    expected = {k for k in sd if not k.endswith("bias") or "o_proj" in k or "down_proj" in k} - {
        k for k in sd if "norm" in k}  # norms are 1 after folding and stay 1
    assert changed == expected
    assert all(torch.equal(new[k], torch.ones_like(new[k])) for k in sd if "norm" in k)


def test_tied_uniform_final_norm_keeps_the_orthogonal_group(fp64_rmsnorm):
    model = decoder("llama", tied=True)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.3)
    _, instances = instances_for(model)
    res = next(i for i in instances if i.name == "residual")
    assert res.variant == "orthogonal"
    assert "model.norm.weight" not in {n for n, _ in res.folds}
    new = transformed(model, "all")
    assert torch.equal(new["model.norm.weight"], model.state_dict()["model.norm.weight"])
    assert output_rel_diff(model, with_weights(model, new), make_inputs(model)) <= 1e-10


def test_partial_rotary_phi():
    """Phi rotates only the first half of each head (partial_rotary_factor 0.5): pairs (j, j + r/2)
    there, the full orthogonal group on the rest."""
    model = decoder("phi")
    _, instances = instances_for(model)
    qk = next(i for i in instances if i.group.kind == "rope_pairs")
    assert (qk.size, qk.rotary) == (8, 4)
    inputs = make_inputs(model)
    el = random_elements([qk], torch.Generator().manual_seed(0))[qk.name]
    assert el.R[0, 4:, 4:].abs().min() > 0  # a dense rotation on the non-rotated dims
    for seed in (0, 1):
        assert output_rel_diff(model, with_weights(model, transformed(model, "all", seed)), inputs) <= 1e-10
    with pytest.raises(SymmergeError, match="qk_layernorm"):
        instances_for(decoder("phi", qk_layernorm=True))


# ------------------------------------------------------------------ negative controls


def _broken(model, how: str):
    _, instances = instances_for(model)
    sd = model.state_dict()
    g = torch.Generator().manual_seed(7)
    qk = [i for i in instances if i.group.kind == "rope_pairs"]
    vo = [i for i in instances if i.group.name == "attn.vo"]
    ffn = [i for i in instances if i.group.kind == "permutation"]
    res = [i for i in instances if i.group.kind == "residual"]
    if how in ("correct_rope", "general_rotation", "interleaved_pairs"):
        els = random_elements(qk, g, scale=False)
        if how == "general_rotation":  # the paper's per-head rotation: does not commute with RoPE
            els = {i.name: HeadElement(haar(i.blocks, i.size, g), torch.ones(i.blocks, dtype=torch.float64)) for i in qk}
        elif how == "interleaved_pairs":  # pairs (2j, 2j+1): the other RoPE layout
            order = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
            inv = torch.argsort(order)
            els = {k: HeadElement(e.R[:, inv][:, :, inv], e.a) for k, e in els.items()}
        return apply(sd, qk, els)
    if how in ("gqa_correct", "gqa_wrong_mapping"):
        # VO element per KV head, expanded to query heads by hand: h // rep is right, h % H_kv is not
        els, out = random_elements(vo, g, scale=False), sd
        rep = HEADS // KV
        heads = torch.arange(HEADS) // rep if how == "gqa_correct" else torch.arange(HEADS) % KV
        for inst in vo:
            v = dataclasses.replace(inst, slots=tuple(s for s in inst.slots if s.power == 1))
            o = dataclasses.replace(inst, blocks=HEADS, name=inst.name + ".o",
                                    slots=tuple(dataclasses.replace(s, repeat=1) for s in inst.slots if s.power == -1))
            e = els[inst.name]
            out = apply(out, [v, o], {v.name: e, o.name: HeadElement(e.R[heads], e.a[heads])})
        return out
    if how in ("scale_gate", "scale_up_only"):
        els = {i.name: PermElement(torch.arange(i.size), torch.full((i.size,), 1.5, dtype=torch.float64)) for i in ffn}
        power = {"scale_gate": {"gate_proj": 1, "up_proj": 0, "down_proj": -1},
                 "scale_up_only": {"gate_proj": 0, "up_proj": 1, "down_proj": 0}}[how]
        fixed = [dataclasses.replace(i, slots=tuple(dataclasses.replace(s, power=power[s.key.split(".")[-2]])
                                                    for s in i.slots)) for i in ffn]
        return apply(sd, fixed, els)
    if how == "residual_unfolded":  # rotate the stream but keep the norm weights (skip the fold)
        no_norms = [dataclasses.replace(i, slots=tuple(s for s in i.slots if not s.diag)) for i in res]
        return apply(sd, no_norms, {i.name: HeadElement(haar(1, i.size, g), torch.ones(1)) for i in res})
    if how == "tied_orthogonal":  # a tied model with a non-uniform final norm: orthogonal Q is no symmetry
        fake = [dataclasses.replace(i, variant="orthogonal",
                                    slots=tuple(s for s in i.slots if not s.diag)) for i in res]
        return apply(fold_norms(sd, res), fake, {i.name: HeadElement(haar(1, i.size, g), torch.ones(1)) for i in fake})
    raise AssertionError(how)


@pytest.mark.parametrize("how,tied", [("general_rotation", False), ("interleaved_pairs", False),
                                      ("gqa_wrong_mapping", False), ("scale_gate", False), ("scale_up_only", False),
                                      ("residual_unfolded", False), ("tied_orthogonal", True)])
def test_negative_controls_change_outputs(how, tied, fp64_rmsnorm):
    model = decoder("llama", tied=tied)
    inputs = make_inputs(model)
    for good in ("correct_rope", "gqa_correct"):
        assert output_rel_diff(model, with_weights(model, _broken(model, good)), inputs) <= 1e-10
    diff = output_rel_diff(model, with_weights(model, _broken(model, how)), inputs)
    assert diff > 1e-3, f"{how} changed outputs by only {diff:.3g}"


def test_tied_model_rejects_orthogonal_residual_on_unfoldable_norm():
    model = decoder("llama", tied=True)
    _, instances = instances_for(model)
    res = next(i for i in instances if i.name == "residual")
    assert res.variant == "signed_permutation" and not res.folds
    with pytest.raises(SymmergeError, match="fold"):
        apply(model.state_dict(), [res], {res.name: HeadElement(haar(1, res.size, torch.Generator()), torch.ones(1))})


# ------------------------------------------------------------------ solvers against brute force


def _pair_case(seed, n=5, pairs=6):
    """Random head blocks (rotate_half layout: pair j = rows j, j + pairs) of a moved (1) and an anchor
    (2) model, Q rows (power +1) and K rows (-1); the per-pair products the solver works from."""
    g = torch.Generator().manual_seed(seed)
    q1, q2, k1, k2 = (torch.randn(1, 2 * pairs, n, dtype=torch.float64, generator=g) for _ in range(4))
    cp, P = pair_products(2.5 * q1, q2, 2 * pairs)  # unequal Q/K norms: the optimal scale is far from 1
    cm, M = pair_products(k1, k2, 2 * pairs)
    return cp[0], cm[0], P[0], M[0]


def _brute(f, theta_fixed=None, rho_fixed=None):
    """min f(ρ, θ) over a dense grid, refined by Nelder–Mead from the best grid point."""
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
    cp, cm, P, M = _pair_case(seed)
    results = {mode: solve_pairs(cp, cm, P, M, True, mode) for mode in ("none", "sequential", "joint")}
    values = {m: pair_objective(r[1], r[0], cp, cm, P, M) for m, r in results.items()}
    for j in range(len(cp)):
        def f(rho, theta):
            w = np.exp(-1j * theta)
            return rho**2 * P[j].item() + M[j].item() / rho**2 - 2 * (w * (rho * complex(cp[j]) + complex(cm[j]) / rho)).real
        scale = P[j].item() + M[j].item()
        # rotation only: the best angle at ρ = 1
        assert values["none"][j].item() == pytest.approx(_brute(f, rho_fixed=1.0), abs=1e-9 * scale)
        # sequential: the best ρ for its angle
        theta_seq = results["sequential"][0][j].item()
        assert values["sequential"][j].item() == pytest.approx(_brute(f, theta_fixed=theta_seq), abs=1e-9 * scale)
        # joint: the global optimum over both
        best = _brute(f)
        assert values["joint"][j].item() <= best + 1e-9 * scale
        assert values["joint"][j].item() == pytest.approx(best, abs=1e-7 * scale)
        assert values["joint"][j] <= values["sequential"][j] + 1e-12 * scale
        assert values["sequential"][j] <= values["none"][j] + 1e-12 * scale


def test_rope_pair_solver_degenerate_cases():
    z = torch.zeros(3, dtype=torch.complex128)
    P, M = torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64), torch.tensor([16.0, 1.0, 2.0], dtype=torch.float64)
    theta, rho = solve_pairs(z, z, P, M, True, "joint")
    torch.testing.assert_close(rho, (M / P) ** 0.25)  # only ρ²P + M/ρ² is left
    theta, rho = solve_pairs(torch.tensor([1j]), torch.tensor([1j]), torch.ones(1, dtype=torch.float64),
                             torch.ones(1, dtype=torch.float64), True, "none")
    assert theta.item() == pytest.approx(math.pi / 2) and rho.item() == 1.0


def test_rope_solution_minimises_the_actual_distance():
    """Solver conventions agree with ``apply``: the solved element, applied to the weights, is closer
    to the anchor than many random RoPE-commuting elements, and its distance is the predicted one."""
    from symmerge.solve import solve

    a, b = decoder("qwen2", seed=0), decoder("qwen2", seed=5)
    _, instances = instances_for(a)
    qk = [i for i in instances if i.group.kind == "rope_pairs"]
    keys = [s.key for i in qk for s in i.slots]
    sa, sb = a.state_dict(), b.state_dict()
    found = solve(qk, sa, sb, ("attn", "rescale"))
    best = sq_dist(apply(sa, qk, found), sb, keys)
    assert best < sq_dist(sa, sb, keys)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert best <= sq_dist(apply(sa, qk, random_elements(qk, g)), sb, keys)
    # small perturbations of the solved angles/scales only increase the distance
    for inst in qk:
        e = found[inst.name]
        tweak = rope_element(torch.full((inst.blocks, inst.rotary // 2), 1e-3, dtype=torch.float64),
                             torch.full((inst.blocks, inst.rotary // 2), 1.001, dtype=torch.float64), None, None, inst.size)
        moved = dict(found)
        moved[inst.name] = HeadElement(e.R @ tweak[0], e.a * tweak[1])
        assert sq_dist(apply(sa, qk, moved), sb, keys) > best


def test_signed_permutation_residual_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    d = 4
    for _ in range(5):
        C = torch.randn(d, d, dtype=torch.float64, generator=g)
        D = torch.rand(d, d, dtype=torch.float64, generator=g)
        Q = signed_permutation_residual(C, D)
        mine = (Q * C).sum() + (Q.abs() * D).sum()
        best = max(sum(s[j] * C[p[j], j] + D[p[j], j] for j in range(d))
                   for p in itertools.permutations(range(d)) for s in itertools.product((-1, 1), repeat=d))
        assert mine.item() == pytest.approx(best.item(), abs=1e-12)


def test_signed_unit_scale_is_brute_force_optimal():
    g = torch.Generator().manual_seed(1)
    cp, cm = torch.randn(20, generator=g, dtype=torch.float64), torch.randn(20, generator=g, dtype=torch.float64)
    p, m = torch.rand(20, generator=g, dtype=torch.float64) + 0.1, torch.rand(20, generator=g, dtype=torch.float64) + 0.1
    s = quartic_scale(cp, cm, p, m, signed=True)
    grid = torch.cat([-torch.logspace(-3, 3, 20001, dtype=torch.float64), torch.logspace(-3, 3, 20001, dtype=torch.float64)])
    f = lambda a: a * a * p[:, None] - 2 * a * cp[:, None] + m[:, None] / (a * a) - 2 * cm[:, None] / a  # noqa: E731
    assert (f(s[:, None])[:, 0] <= f(grid[None]).min(1).values + 1e-12).all()
    assert ((s < 0) == (f(grid[None, :20001]).min(1).values < f(grid[None, 20001:]).min(1).values)).all()


# ------------------------------------------------------------------ alignment end to end


def disguised(anchor, seed=1, noise=0.0, symmetries=("attn", "ffn", "rescale", "residual")):
    """A hidden random element (+ optional noise on the matched tensors) applied to the folded anchor."""
    _, instances = instances_for(anchor)
    sd, noise_norm = fold_norms(anchor.state_dict(), instances), 0.0
    if noise:
        keys = {s.key for i in instances for s in i.slots if not s.diag}
        if anchor.config.tie_word_embeddings:
            keys.discard("lm_head.weight")  # the same tensor as the embeddings
        sd, noise_norm = add_noise(sd, noise, seed + 100, sorted(keys))
    els = elements_of([i for i in instances if "residual" in symmetries or i.name != "residual"], "all", seed)
    return with_weights(anchor, apply(sd, instances, els)), noise_norm, fold_norms(anchor.state_dict(), instances)


def params(model) -> list[str]:
    return [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_recovers_transformed_copy(family, tied, fp64_rmsnorm):
    anchor = decoder(family, tied)
    model, _, folded_anchor = disguised(anchor)
    inputs = make_inputs(anchor)
    assert output_rel_diff(anchor, model, inputs) <= 1e-10
    aligned, report = align(model, anchor, ("attn", "ffn", "rescale", "residual"), inputs=inputs)
    assert type(aligned) is type(anchor)
    assert report["distance_before"] > 10
    # independent of the report: the aligned weights equal the (folded) anchor's
    assert sq_dist(aligned.state_dict(), folded_anchor, params(anchor)) ** 0.5 <= 1e-9 * report["distance_before"]
    assert output_rel_diff(anchor, aligned, inputs) <= 1e-10
    sweeps = report["residual_sweeps_sq_distance"]
    assert sweeps[-1] <= 1e-18 * report["distance_before"] ** 2 + 1e-24
    if tied:
        assert report["residual_variant"] == "signed_permutation"
        assert aligned.lm_head.weight is aligned.model.embed_tokens.weight  # still tied
    else:
        assert report["residual_variant"] == "orthogonal"
        for k, v in aligned.state_dict().items():
            if "norm" in k and not k.endswith(("q_norm.weight", "k_norm.weight")):  # per-head norms stay
                assert torch.equal(v, torch.ones_like(v)), k


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_noisy_copy_aligns_to_noise_level_fp32(tied):
    anchor = decoder("qwen2", tied, dtype=torch.float32)
    model, noise, _ = disguised(anchor, seed=2, noise=0.02)
    aligned, report = align(model, anchor, ("attn", "ffn", "rescale", "residual"))
    assert report["distance_before"] > 20 * noise
    assert 0.8 * noise <= report["distance_after"] <= noise * (1 + 1e-4)
    assert report["verify_max_rel_diff"] <= 1e-5


def test_independent_models_coordinate_descent(fp64_rmsnorm):
    a, b = decoder("llama", seed=0), decoder("llama", seed=9)
    inputs = make_inputs(a)
    aligned, report = align(a, b, ("attn", "ffn", "rescale", "residual"), inputs=inputs)
    sweeps = report["residual_sweeps_sq_distance"]
    assert len(sweeps) >= 2 and sweeps[1] <= sweeps[0]
    assert report["distance_after"] ** 2 == pytest.approx(min(sweeps), rel=1e-9)  # the best sweep is returned
    assert report["distance_after"] < report["distance_before"]
    assert output_rel_diff(a, aligned, inputs) <= 1e-10
    _, local = align(a, b, ("attn", "ffn", "rescale"), inputs=inputs)
    assert local["distance_after"] < local["distance_before"]


# ------------------------------------------------------------------ Qwen3: per-head q_norm / k_norm


def _tie_pairs(model, pairs):
    """Make q_norm/k_norm weights equal on rotary pairs ``pairs`` (j and j + d/2) in every layer."""
    d = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight[[j + d // 2 for j in pairs]] = norm.weight[list(pairs)]
    return model


def _qk(model):
    return [i for i in instances_for(model)[1] if i.group.kind == "rope_pairs"]


def test_qwen3_locked_pairs_follow_the_norm_weights():
    model = decoder("qwen3")
    d = model.config.head_dim
    assert all(i.locked == tuple(range(d // 2)) for i in _qk(model))  # generic weights: every pair locked
    _tie_pairs(model, [0, 2])
    assert all(i.locked == tuple(j for j in range(d // 2) if j not in (0, 2)) for i in _qk(model))
    with torch.no_grad():  # a difference in k_norm alone locks the pair again
        model.model.layers[1].self_attn.k_norm.weight[d // 2] += 0.1
    assert [i.locked for i in _qk(model)][1] == tuple(j for j in range(d // 2) if j != 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_qwen3_free_rotation_on_tied_pairs_preserves_outputs(dtype, request):
    if dtype == torch.float64:
        request.getfixturevalue("fp64_rmsnorm")
    model = _tie_pairs(decoder("qwen3", dtype=dtype), [0, 1, 3])
    inputs = make_inputs(model)
    qk = _qk(model)
    els = random_elements(qk, torch.Generator().manual_seed(3))
    for inst in qk:
        R = els[inst.name].R
        assert R[:, 0, 0].abs().max() < 1 and torch.all(els[inst.name].a == 1)  # a real rotation, no scale
        assert torch.all(R[:, 2, 2].abs() == 1)  # locked pair 2: a sign flip only
    assert output_rel_diff(model, with_weights(model, apply(model.state_dict(), qk, els)), inputs) <= TOL[dtype]


@pytest.mark.parametrize("how", ["rotate_locked_pair", "pair_scale", "llama_group"])
def test_qwen3_negative_controls(how, fp64_rmsnorm):
    """Breaking the restriction changes outputs: a rotation of a pair whose norm weights differ, a
    per-pair scale (the norm divides it out unevenly), or Llama's whole QK group (rotation + scale)."""
    model = _tie_pairs(decoder("qwen3"), [0, 1, 3])
    inputs = make_inputs(model)
    qk = _qk(model)
    free = [dataclasses.replace(i, locked=()) for i in qk]
    els = random_elements(free, torch.Generator().manual_seed(4), scale=False)
    if how == "rotate_locked_pair":  # identity except pair 2 (locked), rotated by 1 rad
        for e in els.values():
            theta = torch.zeros(e.R.shape[0], e.R.shape[-1] // 2, dtype=torch.float64)
            theta[:, 2] = 1.0
            e.R, _ = rope_element(theta, torch.ones_like(theta), None, None, e.R.shape[-1])
    elif how == "pair_scale":  # a scale on the (tied, free) pair 0 only
        for e in els.values():
            e.R = HeadElement.identity(e.R.shape[0], e.R.shape[-1]).R
            e.a = torch.ones(e.R.shape[0], e.R.shape[-1], dtype=torch.float64)
            e.a[:, [0, e.R.shape[-1] // 2]] = 1.7
    else:
        els = random_elements(free, torch.Generator().manual_seed(4), scale=True)
    diff = output_rel_diff(model, with_weights(model, apply(model.state_dict(), free, els)), inputs)
    assert diff > 1e-3, f"{how} changed outputs by only {diff:.3g}"


def test_qwen3_sign_choice_equals_brute_force():
    """All pairs locked: per KV head the solver's flips equal the best of all 2^(d/2) patterns."""
    anchor, model = decoder("qwen3", seed=0), decoder("qwen3", seed=5)
    qk = [i for i in _qk(model) if i.layer == 0]
    (inst,) = qk
    elements = solve_local(qk, model.state_dict(), anchor.state_dict(), ("attn",), "joint")
    R = elements[inst.name].R
    d = inst.size
    h = d // 2
    sd_a, sd_b = model.state_dict(), anchor.state_dict()
    for head in range(inst.blocks):
        def dist(signs):
            el = HeadElement.identity(inst.blocks, d)
            el.R[head] = torch.diag(torch.tensor(list(signs) * 2, dtype=torch.float64))
            new = apply(sd_a, [inst], {inst.name: el})
            return sum((new[s.key] - sd_b[s.key]).square().sum().item() for s in inst.slots)
        best = min(itertools.product((1.0, -1.0), repeat=h), key=dist)
        assert torch.equal(torch.diagonal(R[head])[:h].sign(), torch.tensor(best, dtype=torch.float64))
        assert dist(torch.diagonal(R[head])[:h].tolist()) == pytest.approx(dist(best), rel=1e-12)
