"""The merge loop, written once: a method is a per-tensor function plus an optional whole-model hook.

A :class:`Method` supplies

* ``tensor(key, tensors, weights, stats, base, params, context) -> tensor``: the merged value of one
  floating-point tensor, from the models' ``tensors`` (same shape, model order), the (possibly
  normalised) ``weights``, the models' statistics for ``key`` (a list, one per model, or ``None`` when
  the method needs none or some model has none for ``key``), the base model's tensor (``None``
  without a base), the method's ``params`` (defaults filled in) and ``context``; any float dtype may
  be returned, the loop casts back to the input dtype;
* optionally ``prepare(state_dicts, base, weights, params) -> context``: run once before the loop,
  to check parameter values and compute whole-model quantities (e.g. TIES's model-wide magnitude
  thresholds); its result is passed to every ``tensor`` call. A method with ``needs_model`` (it
  needs the architecture, e.g. OT fusion) gets three more keywords: ``stats`` (as checked), ``model``
  (a model of the merged checkpoints' architecture) and ``anchor`` (the index of the model the
  others were aligned to, or None).

:func:`merge_state_dicts` validates everything once (:func:`check_layout` for keys, shapes and the
base model; the weights; the statistics) and copies non-floating tensors (integer buffers such as
``position_ids``) from the base model when one is given, else from the first model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SymmergeError

# the statistics a method may consume (``Method.needs``); gathered by the caller on the aligned models
STATISTICS = ("gram", "fisher", "activations")
_STAT_NAMES = {"gram": "Gram matrices", "fisher": "Fisher diagonals", "activations": "activations"}


def check_needs(name: str, needs) -> None:
    """``needs`` must be ``None`` or one of :data:`STATISTICS`."""
    if needs is not None and needs not in STATISTICS:
        raise SymmergeError(f"method {name!r} needs unknown statistics {needs!r} "
                            f"(known: {', '.join(STATISTICS)}, or None)")


def normalized_weights(weights, n: int, normalize: bool = True, signed: bool = False) -> list[float]:
    """``n`` weights (uniform when ``None``), finite; with ``normalize`` (an average) non-negative and scaled
    to sum to 1 (``signed``: mergekit's ``linear``, any sign, divided by their sum, which must not be 0: a weight
    above 1 beside a negative one extrapolates), else (multipliers of task vectors, as mergekit takes them: a
    negative weight subtracts a task) any finite values, not all zero."""
    if weights is None:
        weights = [1.0] * n
    try:
        weights = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise SymmergeError(f"weights must be numbers, got {weights!r}") from None
    if len(weights) != n:
        raise SymmergeError(f"got {len(weights)} weights for {n} models")
    if any(not abs(w) < float("inf") for w in weights) or not any(weights):
        raise SymmergeError(f"weights must be finite and not all zero, got {weights}")
    if normalize and signed and sum(weights) == 0:
        raise SymmergeError(f"weights {weights} sum to 0: linear with normalize divides by their sum (give weights "
                            "of another sum, or normalize: false)")
    if normalize and not signed and (any(w < 0.0 for w in weights) or sum(weights) <= 0):
        raise SymmergeError(f"weights of an average must be non-negative and not all zero, got {weights}")
    total = sum(weights) if normalize else 1.0
    return [w / total for w in weights]


def weighted_sum(tensors, weights) -> torch.Tensor:
    """Σ w_i t_i in float64 (exact enough for any input dtype); caller casts back."""
    out = tensors[0].double() * weights[0]
    for t, w in zip(tensors[1:], weights[1:]):
        out.add_(t.double(), alpha=w)
    return out


CHUNK = 1 << 15  # entries per chunk of an elementwise merge: cache-sized float64 temporaries, one thread (torch runs
# an op of at most 32768 entries, its parallel grain size, in the calling thread: no pool to wake per chunk)


def check_layout(state_dicts, base=None, needs_base: bool = False, method: str = "merge",
                 accepts_base: bool = False) -> list[str]:
    """Keys of the first state dict, after checking that all models agree in keys and shapes, and that
    ``base`` is given when the method needs one (``needs_base``), is not given to a method that uses none
    (neither ``needs_base`` nor ``accepts_base``: an optional base), and holds every key with the same shape."""
    if not state_dicts:
        raise SymmergeError("nothing to merge: no models given")
    first = state_dicts[0]
    keys = list(first)
    for i, sd in enumerate(state_dicts[1:], 1):
        if sd.keys() != first.keys():
            raise SymmergeError(f"model {i} has different tensors than model 0")
    if needs_base and base is None:
        raise SymmergeError(f"method {method!r} needs a base model (the common pre-trained model): pass base=/--base")
    if base is not None and not (needs_base or accepts_base):
        raise SymmergeError(f"method {method!r} does not use a base model")
    if base is not None:
        missing = [k for k in keys if k not in base]
        if missing:
            raise SymmergeError(f"base model lacks tensor {missing[0]!r}")
    others = [(f"model {i}", sd) for i, sd in enumerate(state_dicts[1:], 1)]
    if base is not None:
        others.append(("base", base))
    for k in keys:
        for what, sd in others:
            if sd[k].shape != first[k].shape:
                raise SymmergeError(f"shapes differ for {k}: {what} has {tuple(sd[k].shape)}, "
                                    f"model 0 has {tuple(first[k].shape)}")
    return keys


def check_stats(method: str, needs, stats, n: int):
    """``stats`` (one dict per model) when the method needs statistics; ``None`` otherwise. A
    :class:`~symmerge.merge.statistics.Stats` of the kind needed is read as ``merge_models`` reads it by default
    (Gram matrices per token, :meth:`~symmerge.merge.statistics.Stats.means`; its ``tensors`` for the sums);
    one of another kind, or anything but a dict, is one error."""
    if needs is None:
        return None
    if stats is None or len(stats) != n:
        raise SymmergeError(f"method {method!r} needs the {_STAT_NAMES[needs]} of every model "
                            f"(gather them with data: --data)")
    read = []
    for i, s in enumerate(stats):
        if not isinstance(s, dict) and hasattr(s, "kind") and hasattr(s, "means"):  # a Stats (statistics imports
            # what imports this module: read by its fields, not its class)
            held = getattr(s, "kind")  # the statistics' own word (gram, fisher, activations), not a group kind
            if held != needs:
                raise SymmergeError(f"method {method!r} needs the {_STAT_NAMES[needs]} of every model; stats[{i}] "
                                    f"holds {_STAT_NAMES.get(held, held)}")
            s = s.means() if needs == "gram" else s.tensors
        elif not isinstance(s, dict):
            raise SymmergeError(f"method {method!r}: stats[{i}] is a {type(s).__name__}; give a Stats of "
                                f"{_STAT_NAMES[needs]} or a dict of tensors by state-dict key")
        read.append(s)
    return read


class _Required:
    """The default of a parameter without one (mergekit's ``t`` of slerp): :meth:`Method.check_params` asks for it."""

    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()


@dataclass(frozen=True)
class Check:
    """A parameter's declared type and range, applied by :meth:`Method.check_params` to its value (to each
    value of a per-model parameter): ``type`` is ``"real"`` (a finite number within [``lo``, ``hi``], an
    end excluded where ``lo_open``/``hi_open``), ``"int"`` (an integer ≥ ``lo``), ``"bool"`` (true/false;
    also the strings "true"/"false") or ``"choice"`` (one of ``choices``, compared as given); ``optional``:
    ``None`` is allowed too. A bad value is one SymmergeError naming the method and the parameter."""

    type: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple = ()
    optional: bool = False

    def describe(self) -> str:
        if self.type == "real":
            if self.lo is None and self.hi is None:
                return "a finite number"
            left = "-inf" if self.lo is None else repr(float(self.lo))
            right = "inf" if self.hi is None else repr(float(self.hi))
            return (f"a number in {'(' if self.lo_open or self.lo is None else '['}{left}, {right}"
                    f"{')' if self.hi_open or self.hi is None else ']'}")
        if self.type == "int":
            return "an integer" + ("" if self.lo is None else f" >= {int(self.lo)}")
        if self.type == "bool":
            return "true or false"
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def __call__(self, method: str, name: str, value):
        if value is None and self.optional:
            return None
        bad = SymmergeError(f"method {method!r}: parameter {name!r} must be {self.describe()}, got {value!r}")
        if self.type == "bool":
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if isinstance(value, bool):
                return value
            raise bad
        if self.type == "choice":
            if isinstance(value, str) and value.strip().lower() in ("true", "false") and True in self.choices:
                return value.strip().lower() == "true"
            for c in self.choices:  # True == 1 in Python: compare types too
                if value == c and type(value) is type(c):
                    return c
            raise bad
        if isinstance(value, bool):
            raise bad
        if self.type == "int":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, int) or (self.lo is not None and value < self.lo):
                raise bad
            return value
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(x):
            raise bad
        if self.lo is not None and (x < self.lo or (self.lo_open and x == self.lo)):
            raise bad
        if self.hi is not None and (x > self.hi or (self.hi_open and x == self.hi)):
            raise bad
        return x


def real(lo=None, hi=None, lo_open=False, hi_open=False, optional=False) -> Check:
    return Check("real", lo, hi, lo_open, hi_open, optional=optional)


def integer(lo=None) -> Check:
    return Check("int", lo)


def boolean() -> Check:
    return Check("bool")


def choice(*values) -> Check:
    return Check("choice", choices=tuple(values))


def per_model_values(value, n: int) -> list:
    """``n`` values of a per-model parameter given as one value (repeated) or one per model."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise SymmergeError(f"a per-model parameter has {len(value)} values for {n} models")
        return list(value)
    return [value] * n


@dataclass(frozen=True)
class Method:
    """A merge method: per-tensor rule, optional whole-model ``prepare`` hook, and its metadata.

    ``doc`` keeps the first line of the text given (e.g. a module docstring). ``normalize_weights``:
    weights are scaled to sum to 1 (averaging methods) or used as given (multipliers of task vectors).
    ``needs_model``: ``merge`` must be given ``model=`` (see the module docstring). ``elementwise``:
    each entry of the result depends only on the same entry of the inputs (given ``context`` and the
    per-tensor context), so :func:`merge_tensor` runs the rule on chunks of :data:`CHUNK` entries
    (cache-sized float64 temporaries instead of whole-tensor ones; the same values). ``tensor_context``
    (optional, elementwise methods): ``(key, tensors, base, weights, params, context) -> context`` run
    once per tensor on the whole tensors; its result replaces ``context`` for that tensor's chunks
    (per-tensor thresholds, random generators that draw the chunks in order).

    The parameters: ``params`` holds the defaults (:data:`REQUIRED` for one that must be given), ``checks``
    each parameter's :class:`Check` (type and range; also for an alias, checked before it is translated),
    ``aliases`` alias → (parameter, translation or None) (mergekit's ``lambda`` for ``scale``; ``density``
    for DARE's ``drop`` = 1 − density), ``per_model`` the parameters that take one value per model,
    ``check_all`` ``(params) -> None`` a check across parameters (DELLA's density ± epsilon), and
    ``check_weights`` ``(weights, params) -> None`` the method's own rule for its weights under its parameters
    (linear's non-zero sum under ``normalize``), checked with each step's arguments, where a config names the key.
    The defaults are mergekit's for every mergekit name (one meaning, from the command line and from a config).

    The contract, read by every caller (the command, a config's planner, the steps): ``needs_base`` (the
    base is required), ``accepts_base`` (optional: nuslerp, multislerp take task vectors when given),
    ``ignores_base`` (mergekit's methods without a base — linear, karcher, passthrough: a config's
    ``base_model`` is one more input) — neither of the three: a base is refused; :attr:`base_policy` names
    it. ``models``: (least, most or None) merged models, the base not counted (slerp: the base and exactly
    one other). ``weight_required``: a config must give every model a ``weight`` (mergekit has no default).
    ``other_names``: names the method is also registered under (``dare`` = ``dare_linear``).
    ``copy_unless``: a one-model method whose step is a plain copy of its input unless this (per-model)
    parameter is given other than 1 (passthrough's ``scale``). ``whole_tensor`` ``(params) -> bool``: an
    elementwise method whose rule needs the whole tensor under these parameters (the chunks are skipped).
    """

    name: str
    tensor: Callable
    needs: str | None = None
    needs_base: bool = False
    params: dict = field(default_factory=dict)
    doc: str = ""
    prepare: Callable | None = None
    normalize_weights: bool = True
    needs_model: bool = False
    elementwise: bool = False
    tensor_context: Callable | None = None
    # (key, tensors, weights, base, params, context, out) -> bool: the whole tensor into out (the chunks'
    # bits; for a whole-tensor rule, those of ``tensor``), or False (nothing written: the chunks, or ``tensor``, run)
    fused_into: Callable | None = None
    # parameters that may take one value per merged model (mergekit's per-model ``density``, ``epsilon``, ...):
    # :meth:`check_params` with ``n`` gives them as a tuple of ``n`` values (a scalar is repeated)
    per_model: tuple = ()
    checks: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)
    check_all: Callable | None = None
    check_weights: Callable | None = None
    accepts_base: bool = False
    models: tuple = (1, None)
    whole_tensor: Callable | None = None
    ignores_base: bool = False
    weight_required: bool = False
    other_names: tuple = ()
    copy_unless: str | None = None
    # the dtype the rule computes in when it is not the inputs' (a config's ``dtype``: config.run.computing_in)
    computes_in: object = None
    # its float16/bfloat16 rule reduces whole tensors (norms, dot products, sums over more than torch's grain size),
    # whose rounding depends on torch's thread count: the executor runs its half-precision steps with mergekit's
    # count (in_dtype.mergekit_threads); a rule without (elementwise, per-row) runs single-threaded, faster
    half_reductions: bool = False

    @property
    def base_policy(self) -> str:
        """``required``, ``optional``, ``ignored`` (a base model is one more input) or ``refused``."""
        return ("required" if self.needs_base else "optional" if self.accepts_base
                else "ignored" if self.ignores_base else "refused")

    @property
    def base_alone_is_base(self) -> bool:
        """Given only its base (no model besides it), the result is the base unchanged: a method that needs a base
        and adds any number of task vectors to it (TIES, DARE, task arithmetic, ...; mergekit writes the base).
        A method with a least number of models above 1 (model_stock) or a fixed number (slerp) refuses it."""
        return self.needs_base and self.models == (1, None)

    @property
    def uses_base(self) -> bool:
        """The method merges task vectors from a base model when one is given (required or optional)."""
        return self.needs_base or self.accepts_base

    def __post_init__(self):
        object.__setattr__(self, "doc", ((self.doc or "").strip().splitlines() or [""])[0])

    def _check_value(self, name: str, value):
        check = self.checks.get(name)
        if check is None:
            return value
        if isinstance(value, (list, tuple)):
            return type(value)(check(self.name, name, v) for v in value)
        return check(self.name, name, value)

    def check_params(self, params: dict, n: int | None = None) -> dict:
        """Known parameters with defaults filled in; unknown names → SymmergeError. Aliases are translated
        (an alias and its parameter both given → SymmergeError), every value is checked against its
        :class:`Check`, a :data:`REQUIRED` one must be given. With ``n`` (the number of
        merged models), a parameter of :attr:`per_model` becomes a tuple of ``n`` values (a scalar repeated;
        a list or tuple must have ``n`` entries); without ``n``, a per-model list is kept as given."""
        params = dict(params)
        for alias, (target, translate) in self.aliases.items():
            if alias not in params:
                continue
            if target in params:
                raise SymmergeError(f"method {self.name!r}: give {target!r} or its alias {alias!r}, not both")
            value = self._check_value(alias, params.pop(alias))
            if translate is not None and value is not None:
                value = type(value)(translate(v) for v in value) if isinstance(value, (list, tuple)) \
                    else translate(value)
            params[target] = value
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            known = ", ".join([*self.params, *self.aliases]) or "none"
            raise SymmergeError(f"method {self.name!r} has no parameter {unknown[0]!r} (parameters: {known})")
        out = {**self.params, **params}
        for name, value in out.items():
            if value is REQUIRED:
                raise SymmergeError(f"method {self.name!r} needs the parameter {name!r}")
            if isinstance(value, (list, tuple)) and name not in self.per_model:
                raise SymmergeError(f"method {self.name!r}: parameter {name!r} takes one value, not one per model")
            if name in params:
                value = out[name] = self._check_value(name, value)
            if n is not None and name in self.per_model:
                if isinstance(value, (list, tuple)):
                    if len(value) != n:
                        raise SymmergeError(f"method {self.name!r}: parameter {name!r} has {len(value)} values "
                                            f"for {n} models")
                    out[name] = tuple(value)
                else:
                    out[name] = (value,) * n
        if self.check_all is not None:
            self.check_all(self.name, out)
        return out

    def check_inputs(self, n: int, has_base: bool) -> None:
        """``n`` merged models (the base not counted) are what the method takes, and the base is given
        where it is needed; SymmergeError otherwise."""
        least, most = self.models
        if n < least or (most is not None and n > most):
            want = (f"exactly {least}" if least == most else f"at least {least}" if most is None
                    else f"{least} to {most}")
            extra = " besides the base model" if self.needs_base or self.accepts_base else ""
            raise SymmergeError(f"method {self.name!r} merges {want} model{'s' if (most or 2) > 1 else ''}"
                                f"{extra}, got {n}")
        if self.needs_base and not has_base:
            raise SymmergeError(f"method {self.name!r} needs a base model (the common pre-trained model): "
                                "pass base=/--base")

    def merge(self, state_dicts, weights=None, stats=None, base=None, model=None, anchor=None, **params) -> dict:
        """The merged state dict: :func:`merge_state_dicts` with this method."""
        return merge_state_dicts(self, state_dicts, weights=weights, stats=stats, base=base, model=model,
                                 anchor=anchor, **params)


def merge_state_dicts(method: Method, state_dicts, weights=None, stats=None, base=None, model=None, anchor=None,
                      **params) -> dict:
    """Merge ``state_dicts`` (same keys and shapes) tensor by tensor with ``method``. ``model`` and
    ``anchor`` are passed to the ``prepare`` of methods with ``needs_model`` (ignored otherwise)."""
    params = method.check_params(params, n=len(state_dicts))
    keys = check_layout(state_dicts, base, method.needs_base, method.name, accepts_base=method.accepts_base)
    method.check_inputs(len(state_dicts), base is not None)
    w = normalized_weights(weights, len(state_dicts), normalize=method.normalize_weights)
    stats = check_stats(method.name, method.needs, stats, len(state_dicts))
    extra = {}
    if method.needs_model:
        if model is None:
            raise SymmergeError(f"method {method.name!r} needs the architecture: pass model= (a model of the merged "
                                "checkpoints)")
        extra = {"stats": stats, "model": model, "anchor": anchor}
    context = method.prepare(state_dicts, base, w, params, **extra) if method.prepare is not None else None
    out = {}
    for k in keys:
        st = None if stats is None or any(k not in s for s in stats) else [s[k] for s in stats]
        out[k] = merge_tensor(method, k, [sd[k] for sd in state_dicts], w, st, None if base is None else base[k],
                              params, context)
    return out


def promoted_dtype(dtypes) -> torch.dtype:
    """torch's promotion of ``dtypes`` where the first is floating (its floating ones; else the first): the dtype
    mergekit's arithmetic on inputs of several dtypes runs in (bfloat16 with float16: float32); one dtype: that
    dtype. The one rule of :func:`promoted` (tensors in hand) and the streamed executor's (stored dtypes)."""
    out = dtypes[0]
    for d in dtypes[1:]:
        if out.is_floating_point and d.is_floating_point:
            out = torch.promote_types(out, d)
    return out


def promoted(tensors) -> torch.dtype:
    """:func:`promoted_dtype` of the floating ``tensors`` (None entries skipped)."""
    return promoted_dtype([t.dtype for t in tensors if t is not None and t.is_floating_point()])


def merge_tensor(method: Method, key: str, tensors, weights, stats, base, params, context,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """One merged tensor, in the inputs' dtype: the one step shared by the in-memory loop
    (:func:`merge_state_dicts`) and the streamed one (:mod:`symmerge.merge.stream`), so both give the
    same bits. A non-floating tensor (an integer buffer) is taken from the base, else the first model.
    Elementwise methods without statistics run on chunks of :data:`CHUNK` entries, written into
    ``out`` when given (uint8 memory of at least the result's bytes: the streamed merge's ring); a
    whole-tensor rule with a ``fused_into`` kernel writes there too."""
    ref = tensors[0] if base is None else base
    if not ref.is_floating_point():
        return ref.clone()
    # held in the dtype the rule computes in: a config's ``dtype`` (mergekit holds its result there until
    # ``out_dtype``; bfloat16 inputs merged at ``dtype: float32`` were rounded back to bfloat16), else the inputs'
    # promoted (several dtypes: float32 ties of float32 and bfloat16 fine-tunes on a float16 base was held in float16)
    held = method.computes_in if method.computes_in is not None else promoted([*tensors, base])
    if method.computes_in is None and any(t is not None and t.is_floating_point() and t.dtype != held
                                          for t in [*tensors, base]):
        # inputs of several dtypes: each cast to the promoted one first (mergekit's result on them is its result
        # with ``dtype:`` that dtype, bit for bit: its thresholds and masks see the cast values)
        tensors = [t.to(held) if t.is_floating_point() else t for t in tensors]
        base = base.to(held) if base is not None and base.is_floating_point() else base
    whole = method.whole_tensor is not None and method.whole_tensor(params)
    nbytes = ref.numel() * torch.empty((), dtype=held).element_size()
    if out is not None and out.dtype == torch.uint8 and out.numel() >= nbytes:
        out = out[:nbytes].view(held).view(ref.shape)
    else:
        out = None
    if not method.elementwise or stats is not None or whole:
        # a whole-tensor rule: its fused kernel into ``out`` (the bits of its ``tensor``), else ``tensor``
        if stats is None and method.fused_into is not None:
            target = out if out is not None else torch.empty(ref.shape, dtype=held)
            if method.fused_into(key, tensors, weights, base, params, context, target):
                return target
        return method.tensor(key, tensors, weights, stats, base, params, context).to(held)
    if method.tensor_context is not None:
        context = method.tensor_context(key, tensors, base, weights, params, context)
    if out is None:
        out = torch.empty(ref.shape, dtype=held)
    if method.fused_into is not None and method.fused_into(key, tensors, weights, base, params, context, out):
        return out  # one fused pass (numba), the same bits as the chunks below
    flat_out = out.view(-1)
    flat = [t.reshape(-1) for t in tensors]
    flat_base = None if base is None else base.reshape(-1)
    for i in range(0, flat_out.numel(), CHUNK):
        s = slice(i, i + CHUNK)
        value = method.tensor(key, [t[s] for t in flat], weights, None, None if flat_base is None else flat_base[s],
                              params, context)
        flat_out[s].copy_(value)
    return out
