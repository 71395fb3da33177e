"""REPAIR (symmerge.merge.repair): channel statistics reset to the interpolated endpoints', folded into
weights and biases; wired into merge_models and barrier_study."""

from __future__ import annotations

import pytest
import torch

from conftest import output_rel_diff
from factories import make_model
from symmerge.merge.barrier import barrier_study
from symmerge.evaluate.metrics import interpolate
from symmerge.merge.fuse import merge_models
from symmerge.merge.repair import CHANNELS, _head_sizes, _sites, parse_channels, repair, statistics_data
from symmerge.pipeline.bound import bind
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import with_state_dict
from test_activations import unlabeled


def _stats(model, data, names):
    """Independent per-channel mean and std of module outputs over all tokens of ``data``."""
    got = {n: [] for n in names}
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: got[n].append(o.detach()))
             for n in names]
    masks = []
    with torch.no_grad():
        for b in data:
            model(**b.inputs)
            masks.append(b.mask)
    for h in hooks:
        h.remove()
    out = {}
    for n, xs in got.items():  # padding tokens excluded
        x = torch.cat([x[m] if m is not None else x.reshape(-1, x.shape[-1]) for x, m in zip(xs, masks)]).double()
        out[n] = (x.mean(0), x.std(0, unbiased=False))
    return out


def test_a_known_affine_damage_of_one_layer_is_undone_exactly():
    """Merged = endpoint A with layer 0's fc1 outputs mapped y → 0.5 y − 0.2 b + 1 (a per-channel affine
    map): REPAIR towards A (weights 1, 0) restores A's fc1 weight and bias, and leaves everything else."""
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=4)
    data = unlabeled(a, batches=2)
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    w, bias = "vit.layers.0.mlp.fc1.weight", "vit.layers.0.mlp.fc1.bias"
    sd[w], sd[bias] = 0.5 * sd[w], 0.3 * sd[bias] + 1.0
    damaged = with_state_dict(a, sd)
    fixed, report = repair(damaged, [a, b], [1.0, 0.0], data, channels=("ffn",))
    out = fixed.state_dict()
    for k, v in a.state_dict().items():
        torch.testing.assert_close(out[k], v, atol=1e-9, rtol=1e-9)
    assert report["std_ratio_before"]["ffn"] < 1.0 and report["scale_only"] == []


@pytest.mark.parametrize("family", ["vit", "bert", "gpt2"])
def test_every_corrected_channel_has_the_target_statistics(family):
    """Fully sequential REPAIR (``site``): each corrected module's output mean and std equal the
    interpolated endpoint statistics (measured independently); the endpoints are untouched and the
    architecture (keys, shapes, dtypes) is unchanged."""
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=4)
    data = unlabeled(a, batches=2)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (a, b)]
    merged = with_state_dict(b, interpolate(a.state_dict(), b.state_dict(), 0.3))
    per_channel = tuple(c for c in CHANNELS if c != "qk")  # qk: one scale per head (the test below)
    fixed, report = repair(merged, [a, b], [0.3, 0.7], data, channels=per_channel, remeasure="site")

    names = [n for n, kind in _sites(bind(a)).items() if kind != "qk"]
    assert report["modules"] == len(names) and set(report["std_ratio_before"]) == {"ffn", "attn_out", "mlp_out", "norm"}
    sa, sb, sf = (_stats(m, data, names) for m in (a, b, fixed))
    for n in names:
        target_mean = 0.3 * sa[n][0] + 0.7 * sb[n][0]
        target_std = 0.3 * sa[n][1] + 0.7 * sb[n][1]
        if n in report["scale_only"]:
            continue
        torch.testing.assert_close(sf[n][0], target_mean, atol=1e-8, rtol=0)
        torch.testing.assert_close(sf[n][1], target_std, atol=1e-8, rtol=1e-8)
    for m, sd in zip((a, b), before):
        assert all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    new, old = fixed.state_dict(), merged.state_dict()
    assert type(fixed) is type(merged) and list(new) == list(old)
    assert all(new[k].shape == old[k].shape and new[k].dtype == old[k].dtype for k in old)
    sm = _stats(merged, data, names)
    assert any(not torch.allclose(sm[n][1], sf[n][1]) for n in names)  # it did change something


def test_repair_at_an_endpoint_is_the_endpoint():
    a, b = make_model("llama", head=True, seed=0), make_model("llama", head=True, seed=4)
    data = unlabeled(a, batches=2)
    fixed, report = repair(a, [a, b], [1.0, 0.0], data)
    assert output_rel_diff(a, fixed, data.batches[0].inputs) < 1e-9
    assert report["scale_only"]  # RMSNorm and bias-free Linears: scale only, and said so


def test_merge_models_and_barrier_study_repair(tmp_path):
    a, b = make_model("vit", head=True, seed=0, dtype=torch.float32), make_model("vit", head=True, seed=4,
                                                                                  dtype=torch.float32)
    align = unlabeled(a, batches=2)
    opts = AlignOptions(symmetries=("attn", "ffn"), align_data=align)
    plain, _ = merge_models([a, b], "average", align=opts.with_(align_data=None), evaluate_result=False,
                            progress=False)  # data nothing reads is refused (a data-free alignment, no REPAIR)
    fixed, rep = merge_models([a, b], "average", align=opts, evaluate_result=False, progress=False, repair=True)
    assert rep["repair"]["modules"] > 0 and "repair" in rep["timings"]
    assert list(fixed.state_dict()) == list(plain.state_dict())
    assert any(not torch.equal(fixed.state_dict()[k], plain.state_dict()[k]) for k in plain.state_dict())
    with pytest.raises(Exception, match="align-data"):
        merge_models([a, b], "average", align=AlignOptions(symmetries=("attn",)), evaluate_result=False, repair=True)
    import numpy as np

    x = torch.cat([bt.inputs["pixel_values"] for bt in unlabeled(a, batches=1, seed=9)]).numpy()
    np.savez(tmp_path / "test.npz", pixel_values=x, labels=np.arange(len(x)) % 3)
    study = barrier_study(a, b, tmp_path / "test.npz", aligns=("attn,ffn",), points=3, progress=False,
                          repair=True, align=AlignOptions(align_data=align))
    assert set(study["curves"]) == {"none", "attn,ffn", "none+repair", "attn,ffn+repair"}
    for v in ("none", "attn,ffn"):  # REPAIR at the endpoints changes nothing
        plain_c, rep_c = study["curves"][v], study["curves"][v + "+repair"]
        assert rep_c["loss"][0] == pytest.approx(plain_c["loss"][0], rel=1e-4)
        assert rep_c["loss"][-1] == pytest.approx(plain_c["loss"][-1], rel=1e-4)
        assert rep_c["loss"][1] != pytest.approx(plain_c["loss"][1], rel=1e-6)


def test_one_plus_w_norms_get_their_scale_folded_as_one_plus_w(fp64_rmsnorm):
    """Gemma's RMSNorm multiplies by 1 + w: REPAIR's scale s must give (1 + w)·s, i.e. w → (1 + w)·s − 1
    (w·s would be wrong). Without a bias the fold is scale only, so each norm's output std (not its mean)
    reaches the interpolated target."""
    a, b = make_model("gemma2", head=True, seed=0), make_model("gemma2", head=True, seed=4)
    data = unlabeled(a, batches=2)
    merged = with_state_dict(b, interpolate(a.state_dict(), b.state_dict(), 0.3))
    fixed, report = repair(merged, [a, b], [0.3, 0.7], data, channels=("norm",), remeasure="site")
    names = [n for n, k in _sites(bind(a)).items() if k == "norm"]
    assert names and set(report["scale_only"]) == set(names)
    sa, sb, sf = (_stats(m, data, names) for m in (a, b, fixed))
    for n in names:
        torch.testing.assert_close(sf[n][1], 0.3 * sa[n][1] + 0.7 * sb[n][1], atol=1e-8, rtol=1e-8)


def test_the_channels_of_a_family_with_several_stacks_are_found():
    """T5's groups are named per stack (encoder.ffn, decoder.cross.attn.vo): REPAIR still finds their FFN and
    attention-output channels, in both stacks."""
    model = make_model("t5", head=True)
    kinds = _sites(bind(model))
    ffn = [n for n, k in kinds.items() if k == "ffn"]
    assert any(n.startswith("encoder.") for n in ffn) and any(n.startswith("decoder.") for n in ffn)
    assert any(k == "attn_out" and n.startswith("decoder.") for n, k in kinds.items())


def _head_rms(stat, size):
    mean, std = stat
    return (mean.square() + std.square()).view(-1, size).mean(1).sqrt()


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_the_qk_channel_sets_every_heads_query_and_key_rms_by_one_factor_per_head(family):
    """Channel ``qk``: per head, the RMS of the q and k projections' outputs of the repaired model equals
    the interpolation of the endpoints' (measured independently), by one factor per head on the rows (and
    bias) of q and k — GQA's key heads included (llama: 4 query heads over 2 key heads); nothing else moves.
    Negative control: the merged model's head RMS is off the target before."""
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=4)
    data = unlabeled(a, batches=2)
    merged = with_state_dict(b, interpolate(a.state_dict(), b.state_dict(), 0.4))
    fixed, report = repair(merged, [a, b], [0.4, 0.6], data, channels=("qk",))
    sizes = _head_sizes(bind(a))
    assert sizes and all(n.endswith(("q_proj", "k_proj", "query", "key")) for n in sizes)
    assert report["modules"] == len(sizes) and set(report["std_ratio_before"]) == {"qk"}
    names = list(sizes)
    sa, sb, sm, sf = (_stats(m, data, names) for m in (a, b, merged, fixed))
    off = 0.0
    for n, size in sizes.items():
        target = 0.4 * _head_rms(sa[n], size) + 0.6 * _head_rms(sb[n], size)
        torch.testing.assert_close(_head_rms(sf[n], size), target, atol=1e-9, rtol=1e-9)
        off = max(off, (_head_rms(sm[n], size) / target - 1).abs().max().item())
        w_new, w_old = fixed.get_submodule(n).weight, merged.get_submodule(n).weight
        ratio = (w_new / w_old).view(-1, size, w_old.shape[1])  # one factor per head
        torch.testing.assert_close(ratio, ratio[:, :1, :1].expand_as(ratio), atol=1e-9, rtol=1e-9)
        if getattr(fixed.get_submodule(n), "bias", None) is not None:
            bias_ratio = (fixed.get_submodule(n).bias / merged.get_submodule(n).bias).view(-1, size)
            torch.testing.assert_close(bias_ratio, ratio[:, :, 0], atol=1e-9, rtol=1e-9)
    assert off > 1e-3  # the merge did move the heads' scale
    if family == "llama":
        assert {fixed.get_submodule(n).weight.shape[0] // s for n, s in sizes.items()} == {4, 2}  # q and kv heads
    changed = {k for k, v in fixed.state_dict().items() if not torch.equal(v, merged.state_dict()[k])}
    assert changed and all(k.rsplit(".", 1)[0] in sizes for k in changed)


def test_fused_qkv_projections_get_no_qk_channel_and_channel_lists_are_checked():
    assert _head_sizes(bind(make_model("gpt2", head=True, seed=0))) == {}  # c_attn: q and k are slices
    assert parse_channels("ffn, norm,qk") == ("ffn", "norm", "qk") and parse_channels(["norm"]) == ("norm",)
    for bad, msg in (("ffn,heads", "unknown REPAIR channels 'heads'"), (",", "no REPAIR channels")):
        with pytest.raises(Exception, match=msg):
            parse_channels(bad)
    a = make_model("llama", head=True, seed=0)
    data = unlabeled(a, batches=2)
    assert statistics_data(data, None) is data and statistics_data(data, 5).n == 5
    with pytest.raises(Exception, match="REPAIR samples must be >= 1"):
        statistics_data(data, 0)
