"""The library never moves or changes a caller's model: after every public entry (and the documented statistics and
evaluation helpers) each parameter and buffer of the caller's model is the same tensor object, on the same device,
in the same dtype, with the same storage, as before — also when the entry fails after moving the model.

No GPU is needed: ``moves`` makes every ``Module.to`` given a device a real move, as to or from a GPU (the module's
tensors get new storage), so that a caller's model the library moved no longer holds its own tensors."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_barrier import br_npz, br_vit  # noqa: F401  (br_npz: a fixture)

import symmerge
from symmerge.evaluate.metrics import evaluate, evaluate_ensemble, interpolation_curve
from symmerge.io.data import load_data
from symmerge.merge.statistics import activation_stats, fisher_stats, forward_seconds, gram_stats

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def moves(monkeypatch):
    to = torch.nn.Module.to

    def moving(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if torch._C._nn._parse_to(*args, **kwargs)[0] is not None:
            self._apply(lambda t: t.clone())
        return out

    monkeypatch.setattr(torch.nn.Module, "to", moving)


def _state(model) -> list:
    return [(name, t, t.data_ptr(), t.device, t.dtype, t.requires_grad, t.grad)
            for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                           model.named_buffers(remove_duplicate=False))]


def _kept(model, before) -> list:
    """The names of ``model``'s tensors that are not as in ``before`` (object, storage, device, dtype, grad)."""
    after = _state(model)
    assert [a[0] for a in after] == [b[0] for b in before]
    return [a[0] for a, b in zip(after, before)
            if a[1] is not b[1] or a[2:6] != b[2:6] or a[6] is not b[6]]


CPU = torch.device("cpu")


def _entries(a, b, npz, tmp_path):
    data = load_data(npz, a, batch_size=5)
    opts = symmerge.BarrierOptions(aligns=("attn,ffn",), points=3, progress=False, device=CPU)
    return {
        "evaluate": lambda: evaluate(a, data, device=CPU, progress=False),
        "evaluate_ensemble": lambda: evaluate_ensemble([a, b], data, device=CPU, progress=False),
        "interpolation_curve": lambda: interpolation_curve(a, b, data, [0.0, 1.0], device=CPU, progress=False),
        "gram_stats": lambda: gram_stats(a, data, device=CPU, progress=False),
        "fisher_stats": lambda: fisher_stats(a, data, device=CPU, max_examples=3, progress=False),
        "activation_stats": lambda: activation_stats(a, data, device=CPU, progress=False),
        "forward_seconds": lambda: forward_seconds(a, data, device=CPU),
        "align": lambda: symmerge.align(a, b, symmetries="attn,ffn", device=CPU),
        "align_pair": lambda: symmerge.align_pair(a, b, symmerge.AlignOptions(symmetries="attn", device=CPU)),
        "align_to_folder": lambda: symmerge.align_to_folder(a, b, tmp_path / "aligned",
                                                            symmerge.AlignOptions(symmetries="attn"), progress=False),
        "merge_models": lambda: symmerge.merge_models([a, b], "regmean", align="attn,ffn", data=str(npz),
                                                      eval_data=[str(npz)], device=CPU, progress=False),
        "merge": lambda: symmerge.merge([a, b], tmp_path / "merged", symmerge.MergeOptions(
            method="fisher", data=[str(npz)], eval_data=[str(npz)], max_examples=4, device=CPU, progress=False)),
        "barrier_study": lambda: symmerge.barrier_study(a, b, str(npz), opts),
        "barrier_study repair": lambda: symmerge.barrier_study(a, b, str(npz), dataclasses.replace(opts, 
            repair=True, temperature=True, align=symmerge.AlignOptions(align_data=str(npz)))),
        "barrier_many": lambda: symmerge.barrier_many([a, b], str(npz), opts),
    }


@pytest.mark.parametrize("entry", ["evaluate", "evaluate_ensemble", "interpolation_curve", "gram_stats",
                                   "fisher_stats", "activation_stats", "forward_seconds", "align", "align_pair",
                                   "align_to_folder", "merge_models", "merge", "barrier_study",
                                   "barrier_study repair", "barrier_many"])
def test_every_entry_leaves_the_callers_models_holding_their_own_tensors(moves, br_npz, tmp_path, entry):
    a, b = br_vit(0), br_vit(1)
    a.train()
    before = [_state(a), _state(b)]
    _entries(a, b, br_npz, tmp_path)[entry]()
    assert _kept(a, before[0]) == [] and _kept(b, before[1]) == []
    assert a.training and not b.training


def test_a_model_moved_then_failing_comes_back(br_npz):
    """On a device the computation fails on (meta: no values), the models are where they were after the error."""
    a, b = br_vit(0), br_vit(1)
    before = [_state(a), _state(b)]
    data = load_data(br_npz, a, batch_size=5)
    for call in (lambda: evaluate(a, data, device="meta", progress=False),
                 lambda: gram_stats(a, data, device="meta", progress=False),
                 lambda: symmerge.barrier_study(a, b, str(br_npz), aligns=("none",), points=2, device="meta",
                                                progress=False)):
        with pytest.raises(Exception):
            call()
        assert _kept(a, before[0]) == [] and _kept(b, before[1]) == []
        assert all(p.device == CPU for p in a.parameters())


def test_a_model_in_another_dtype_inside_the_call_comes_back_in_its_own():
    """What the wrapper puts back, directly: a call that casts and moves the caller's model in place."""
    from symmerge.io.arguments import keeps_models

    a = br_vit(0)
    a.classifier.weight.grad = torch.ones_like(a.classifier.weight)
    before = _state(a)

    @keeps_models
    def casting(model):
        model.to(torch.float64).requires_grad_(False)
        model.classifier.weight.grad = None
        return sum(p.sum() for p in model.parameters()).dtype

    assert casting(a) == torch.float64
    assert _kept(a, before) == [] and next(a.parameters()).dtype == torch.float32
    assert a.classifier.weight.grad.dtype == torch.float32 and a.classifier.weight.requires_grad


class Stopped(Exception):
    pass


def test_the_curves_models_stay_on_its_device_between_points(br_npz):
    """interpolation_curve's own θ(α) is loaded and evaluated on ``device`` at every α, and a transform (REPAIR, the
    temperature fit) gets it there: evaluate putting the probe back where it found it must not send it to the CPU."""
    a, b = br_vit(0), br_vit(1)
    data, seen = load_data(br_npz, a, batch_size=5), []

    def transform(probe, alpha):
        seen.append(next(probe.parameters()).device.type)
        raise Stopped  # meta tensors have no values: stop before evaluating

    with pytest.raises(Stopped):
        interpolation_curve(a, b, data, [0.0, 1.0], device="meta", progress=False, transform=transform)
    assert seen == ["meta"] and next(b.parameters()).device == CPU
