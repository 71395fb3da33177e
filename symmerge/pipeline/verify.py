"""Check that an alignment preserved the function, in one place for in-memory and streamed alignment:

* every group element is checked to be a valid element of its group (orthogonal, finite positive or
  non-zero scales, bijective permutations...): a valid element preserves the function exactly, which
  the tests prove for every family and kind;
* where both models are in memory, they are run on the same inputs and their outputs compared.
"""

from __future__ import annotations

import copy

import torch

from ..core.apply import check_elements
from ..core.spec import Spec
from ..errors import SymmergeError
from ..io.finite import non_finite

ELEMENT_CHECK = "group elements (orthogonal, valid scales, bijective permutations)"


def sample_inputs(model, spec: Spec, batch: int = 2, length: int = 16, seed: int = 0) -> dict:
    """Random but valid inputs: token ids with a padded row, or pixels of the configured size; a model
    taking both (CLIP) gets both, an encoder-decoder (T5) decoder ids too."""
    import inspect

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    takes = inspect.signature(model.forward).parameters
    out = {}
    if spec.inputs == "image" or ("pixel_values" in takes and spec.inputs != "text"):
        vision = getattr(cfg, "vision_config", None) or cfg
        size = vision.image_size
        out["pixel_values"] = torch.randn(batch, vision.num_channels, size, size, generator=g)
    if spec.inputs != "image" and "input_ids" in takes:
        text = getattr(cfg, "text_config", None) or cfg
        ids = torch.randint(0, text.vocab_size, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[-1, length // 2:] = 0
        out.update(input_ids=ids, attention_mask=mask)
        if "decoder_input_ids" in takes and getattr(cfg, "is_encoder_decoder", False):
            out["decoder_input_ids"] = torch.randint(0, text.vocab_size, (batch, length // 2), generator=g)
        if "encoder_hidden_states" in takes and getattr(cfg, "add_cross_attention", False):
            # a decoder with cross-attention (GPT-2, BERT): compared with encoder states too, or the verification
            # never runs the cross-attention tensors (an alignment that moved the stream past them passed)
            width = getattr(text, "hidden_size", None) or getattr(text, "n_embd")
            out["encoder_hidden_states"] = torch.randn(batch, length // 2 + 1, width, generator=g)
    return out


def _outputs(model, inputs, names: tuple[str, ...] = ()) -> list[torch.Tensor]:
    """The model's floating outputs (only ``names`` where the model returns some of them: the spec's
    ``outputs``; T5EncoderModel has no logits, its every output is its function)."""
    with torch.no_grad():
        out = model(**inputs)
    picked = [v for k, v in out.items() if k in names and torch.is_tensor(v)] if hasattr(out, "items") else []
    if picked:
        return [v for v in picked if v.is_floating_point()]
    values = out.values() if hasattr(out, "values") else (out if isinstance(out, tuple) else [out])
    return [v for v in values if torch.is_tensor(v) and v.is_floating_point()]


def check_runs_on(model, inputs: dict | None) -> None:
    """The caller's verification ``inputs`` (None: made for the model) tried on ``model`` before any work: inputs
    the model does not take (keys, shapes, token ids beyond the vocabulary) are one :class:`UsageError` rather than
    transformers' or torch's own traceback after the alignment."""
    if inputs is None:
        return
    from ..errors import UsageError

    device = next(model.parameters()).device
    try:
        _outputs(model.eval(), {k: v.to(device) for k, v in inputs.items()})
    except Exception as e:  # noqa: BLE001 - whatever the forward raises on them is the inputs' fault here
        raise UsageError(f"inputs: the model does not run on them ({type(e).__name__}: {str(e).splitlines()[0]}); "
                         "give the model's forward keywords, e.g. {'input_ids': ids} with ids below its vocabulary "
                         "size, or leave inputs out (made for the model)") from None


def with_state_dict(model, state_dict: dict, share: bool = False):
    """A copy of ``model`` holding ``state_dict`` (the original is left untouched).

    ``share``: the copy's parameters and buffers *are* ``state_dict``'s tensors (cast to the model's dtypes
    where they differ), not copies of them: only the modules are copied, no weight — the same values as
    ``load_state_dict`` gives, in no extra memory. The caller must not give tensors it will change in place,
    nor the model's own (see :func:`owned_apart`). A state dict whose names or shapes do not match the
    model's falls back to ``load_state_dict`` (and its error)."""
    if share:
        clone = _sharing_clone(model, state_dict)
        if clone is not None:
            return clone.eval()
    clone = copy.deepcopy(model)
    clone.load_state_dict(state_dict)
    return clone.eval()


def _sharing_clone(model, state_dict: dict):
    """``model``'s modules copied, every parameter and persistent buffer a new one wrapping
    ``state_dict``'s tensor; None when the names or shapes do not match."""
    own = model.state_dict(keep_vars=True)
    if set(own) != set(state_dict) or any(tuple(v.shape) != tuple(state_dict[k].shape) for k, v in own.items()):
        return None
    source = {}  # id(tensor) → the name it is loaded from (tied names: the last, as load_state_dict's copies)
    for k, v in own.items():
        source[id(v)] = k
    memo = {}
    for k, v in own.items():
        if id(v) in memo:
            continue
        value = state_dict[source[id(v)]].detach().to(v.dtype)
        memo[id(v)] = torch.nn.Parameter(value, requires_grad=v.requires_grad) if isinstance(
            v, torch.nn.Parameter) else value
    return copy.deepcopy(model, memo)


def owned_apart(state_dict: dict, *others) -> dict:
    """``state_dict`` with every tensor sharing storage with one of ``others``' (models or state dicts) cloned:
    safe to hand to :func:`with_state_dict` with ``share=True`` when the result leaves the caller (the inputs
    stay untouched whatever is done to it)."""
    taken = {t.untyped_storage().data_ptr() for m in others
             for t in (m if isinstance(m, dict) else m.state_dict()).values()}
    return {k: v.clone() if v.untyped_storage().data_ptr() in taken else v for k, v in state_dict.items()}


def compare(model_a, model_b, inputs: dict, names: tuple[str, ...] = ()) -> dict:
    """Max absolute and relative (to the largest output magnitude) difference over all outputs (``names``:
    only these)."""
    device = next(model_a.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    max_abs, scale = 0.0, 0.0
    for a, b in zip(_outputs(model_a.eval(), inputs, names), _outputs(model_b.eval(), inputs, names)):
        max_abs = max(max_abs, (a.double() - b.double()).abs().max().item())
        scale = max(scale, a.double().abs().max().item())
    return {"max_abs_diff": max_abs, "max_rel_diff": max_abs / scale if scale else max_abs}


def default_tolerance(dtype: torch.dtype) -> float:
    """The largest relative output difference an exact alignment is allowed by default, by the models' dtype.
    float64: 1e-6, not float64's own rounding — transformers' RMSNorm (Llama, Mistral, Qwen, …) computes a float64
    input in float32 and casts back, so a float64 Llama moved by an exact stream rotation differs from itself by
    ~1e-7 (a wrong element differs by far more: ≥ 1e-3)."""
    return {torch.float64: 1e-6, torch.float32: 1e-4}.get(dtype, 5e-2)


def verify_elements(instances, elements: dict) -> None:
    check_elements(instances, elements)


def verify_forward(model, aligned, spec: Spec, tol: float | None = None, inputs: dict | None = None) -> dict:
    """Compare the outputs of ``model`` and ``aligned``; the report's ``verify_*`` fields. Raises
    :class:`SymmergeError` beyond the tolerance (default by dtype)."""
    tol = default_tolerance(_dtype(model)) if tol is None else tol
    diff = compare(model, aligned, inputs or sample_inputs(model, spec), spec.outputs)
    if not diff["max_rel_diff"] <= tol:
        raise SymmergeError(f"aligned model is not equivalent: max relative output difference "
                            f"{diff['max_rel_diff']:.3g} > {tol:.3g}{_unmoved_readers(model, aligned, spec)}")
    return {"verify_max_abs_diff": diff["max_abs_diff"], "verify_max_rel_diff": diff["max_rel_diff"],
            "verify_tolerance": tol}


def _unmoved_readers(model, aligned, spec: Spec) -> str:
    """The failed verification's hint when the residual stream moved (the input embeddings changed): the floating
    tensors of the stream's width the alignment left as they were — a head or tensor the family's spec does not
    declare, which reads or writes the stream (GPT2DoubleHeadsModel's multiple-choice head, the mask token and
    decoder of ViTForMaskedImageModeling); '' when there is none."""
    width = getattr(model.config, "hidden_size", None)
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return ""
    if not isinstance(width, int) or not isinstance(embeddings, torch.nn.Module):
        return ""
    weight = next((p for p in embeddings.parameters() if width in p.shape), None)
    before, after = model.state_dict(), aligned.state_dict()
    name = next((k for k, p in model.named_parameters() if p is weight), None)
    if name is None or name not in after or torch.equal(before[name], after[name].to(weight.dtype)):
        return ""
    # a tensor of equal entries (a fresh norm's ones, a zero bias) is its own image under a permutation: not kept
    kept = [k for k, v in before.items() if v.is_floating_point() and width in v.shape and k in after
            and bool((v != v.flatten()[0]).any()) and torch.equal(v, after[k].to(v.dtype))]
    if not kept:
        return ""
    more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
    return (f"; the residual stream moved but {', '.join(kept[:3])}{more} (of its width {width}) did not: "
            f"{type(model).__name__} has a head or tensor the {spec.family} symmetry spec does not declare; align "
            f"the model's base class, or leave out the 'residual' symmetry")


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def working_copies(models) -> list:
    """The models an alignment solves, applies and verifies on: float32 copies where any is in a half dtype
    (bfloat16, float16: solved and verified in their own arithmetic, a tiny bfloat16 Llama's exact alignment
    missed the half tolerance, 0.08 > 0.05) or their dtypes differ (float32 beside bfloat16 stopped in a GEMM of
    two dtypes); the models themselves, untouched, otherwise. :func:`in_dtype_of` casts the results back."""
    dtypes = {_dtype(m) for m in models}
    if len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64}:
        return list(models)
    return [copy.deepcopy(m).to(torch.float32) if _dtype(m) != torch.float32 else m for m in models]


def in_dtype_of(result, stored):
    """``result`` (solved on a :func:`working_copies` copy of ``stored``) in ``stored``'s dtype, rounded once; a value
    the alignment moved past that dtype's range (float16's 65504) is one error, not an Inf written in silence."""
    if _dtype(result) == _dtype(stored):
        return result
    rounded = result.to(_dtype(stored))
    with torch.no_grad():
        name = non_finite(rounded.state_dict())
    if name is not None:
        raise SymmergeError(out_of_range(name, _dtype(stored)))
    return rounded


def out_of_range(name: str, dtype) -> str:
    """The one line of an aligned tensor that does not fit in its model's stored ``dtype``."""
    kind = str(dtype).removeprefix("torch.")
    return (f"{name}: the aligned tensor does not fit in {kind} (a value past its range would be written as Inf): "
            f"the alignment's rotations and scales moved it there; align a float32 copy of the checkpoint")


def working_note(stored, work) -> dict | None:
    """The report's ``working_copies`` entry when :func:`working_copies` made any (None otherwise): the dtype solved
    and verified in, each model's stored dtype, and that the result is rounded to it once."""
    if all(w is x for w, x in zip(work, stored)):
        return None
    name = lambda m: str(_dtype(m)).removeprefix("torch.")  # noqa: E731
    return copies_entry(name(work[0]), [name(m) for m in stored])


def copies_entry(dtype: str, stored: list) -> dict:
    """The report's ``working_copies`` entry: verified on ``dtype`` copies of models ``stored`` in these dtypes."""
    return {"dtype": dtype, "stored": stored,
            "note": (f"solved and verified on {dtype} copies (verify_max_rel_diff is that alignment's); the "
                     "aligned model is rounded to its stored dtype once, which moves its outputs by that dtype's "
                     "rounding")}
