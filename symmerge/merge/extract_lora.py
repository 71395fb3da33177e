"""A PEFT LoRA adapter of a fine-tune's task vector (``symmerge extract-lora FINETUNE BASE -o OUT --rank R``), as
``mergekit-extract-lora`` extracts it, read a pair of tensors at a time.

Per module of the fine-tune's class (a weightless ``meta`` model says which module is what), in mergekit's order
of rules:

* an embedding (the input embeddings, the output embeddings, any ``nn.Embedding``) without ``embed_lora`` is saved
  whole (``modules_to_save``, by its last name), unless an ``--exclude-regex`` matches it; so is every module named
  by ``--save-module`` (its fine-tuned weight and bias);
* else, when the ``--include-regex`` / ``--exclude-regex`` filters keep it: a linear layer (``nn.Linear`` and GPT-2's
  ``Conv1D``, whose weight is stored transposed) or, with ``embed_lora``, an embedding, gets the truncated SVD of its
  task vector ``ΔW = W_ft − W_base`` in float32: rank ``r = min(R, min(ΔW.shape))``, lowered to the number of
  singular values above ``--sv-epsilon`` when it is positive; ``A = √S·Vᵀ``, ``B = U·√S`` (``--no-distribute-scale``:
  ``A = S·Vᵀ``, ``B = U``), in the fine-tune's dtype; an embedding's factors are those of ``ΔWᵀ``
  (``lora_embedding_A/B``). A layer's bias change is kept as ``lora_B.bias`` with ``lora_bias: true`` (mergekit
  writes it without the flag, so PEFT drops it) when every layer written has a bias and none is an embedding; else
  (Qwen2's biased q/k/v beside unbiased layers) PEFT's ``bias: lora_only``, the biased layers' fine-tuned biases
  carried whole (``base_layer.bias``), as PEFT's lora_bias would leave keys missing and refuse to merge; a module
  of another kind (a norm) is saved whole unless ``--skip-undecomposable``.

The adapter's config: ``r`` the largest rank written, ``lora_alpha = r``, ``rank_pattern`` = ``alpha_pattern`` for
the modules of another rank (every module's scale is 1), ``target_modules`` the modules' last names (a module's full
name where a module of the same last name is left out). SVDs of modules of one shape run batched. Each module's
relative reconstruction error ``‖ΔW − s·B·A‖ / ‖ΔW‖`` (of the factors as written) goes to ``symmerge_report.json``.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SymmergeError, UsageError, keywords_checked, options_argument

BATCH_BYTES = 64 * 2 ** 20  # float32 task vectors of one shape decomposed together, at most
SVDS = ("full", "lowrank")
SEQ_CLS_HEADS = ("classifier", "score")  # PeftModelForSequenceClassification adds them to modules_to_save
OVERSAMPLE, POWER_ITERATIONS = 10, 4  # --svd lowrank: q = R + 10 random directions, 4 subspace iterations


@keywords_checked
@dataclass(frozen=True)
class ExtractOptions:
    """``mergekit-extract-lora``'s options under their names."""

    rank: int = 128
    distribute_scale: bool = True
    embed_lora: bool = False
    save_modules: tuple = ()
    exclude_regexes: tuple = ()
    include_regexes: tuple = ()
    sv_epsilon: float = 0.0
    skip_undecomposable: bool = False
    device: str = "cpu"
    svd: str = "full"  # full: torch.linalg.svd (mergekit's); lowrank: randomized (torch.svd_lowrank), seeded
    seed: int = 0
    write_model_card: bool = True
    progress: bool = True

    def __post_init__(self):
        for name in ("save_modules", "exclude_regexes", "include_regexes"):  # one name or pattern: not its letters
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise SymmergeError(f"--rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.sv_epsilon, (int, float)) and math.isfinite(self.sv_epsilon)
                and self.sv_epsilon >= 0):
            raise SymmergeError(f"--sv-epsilon must be a number >= 0, got {self.sv_epsilon!r}")
        from ..device import resolve_device

        resolve_device(self.device)  # a device torch cannot name, or cuda without one: one line, before any work
        if self.svd not in SVDS:
            raise SymmergeError(f"--svd is one of {', '.join(SVDS)}, got {self.svd!r}")
        for flag, patterns in (("--exclude-regex", self.exclude_regexes), ("--include-regex", self.include_regexes)):
            for p in patterns:
                try:
                    re.compile(p)
                except re.error as e:
                    raise SymmergeError(f"{flag} {p!r}: not a regular expression ({e})") from None


@dataclass
class Entry:
    """One module of the fine-tune: ``how`` is ``lora`` (linear), ``embedding`` (LoRA of an embedding), ``full`` (its
    weight and bias saved whole) or ``module`` (every parameter of it and of the modules inside it saved whole,
    ``keys``: a module of loose parameters named by ``--save-module``)."""

    name: str
    how: str
    weight: str | None
    bias: str | None = None
    transposed: bool = False  # Conv1D: the weight is stored in x out
    result: dict = field(default_factory=dict)
    keys: tuple = ()  # how == "module": (state-dict name, stored name) of each of its parameters


def _plan(ft, base, kinds: dict, options: ExtractOptions, notes: list) -> tuple[list[Entry], list[str]]:
    """The modules to extract and to save whole (mergekit's rules, module order), and modules_to_save."""
    embed_lora = options.embed_lora
    if kinds["input"]:  # a grown vocabulary: saved whole, with or without --embed-lora, and PEFT needs a resize
        key, bkey = _stored(ft, f"{kinds['input']}.weight"), _stored(base, f"{kinds['input']}.weight")
        if key and bkey and ft.shape[key][0] != base.shape[bkey][0]:
            notes.append(f"vocabulary sizes differ (fine-tune {ft.shape[key][0]}, base {base.shape[bkey][0]}): "
                         "embeddings saved whole (modules_to_save), not as LoRA; load the adapter on the base after "
                         f"base.resize_token_embeddings({ft.shape[key][0]}) (PEFT refuses their shapes otherwise)")
            embed_lora = False
    to_save = list(options.save_modules)
    entries: list[Entry] = []
    excluded = lambda name: any(re.search(r, name) for r in options.exclude_regexes)  # noqa: E731
    heads = SEQ_CLS_HEADS if ft.class_name.endswith("ForSequenceClassification") else ()
    for name, kind, _, has_bias in kinds["modules"]:
        wkey = _stored(ft, f"{name}.weight")
        if wkey is None:
            continue
        bkey = _stored(ft, f"{name}.bias") if has_bias else None
        last = name.split(".")[-1]
        # PEFT's SEQ_CLS model saves every module whose name ends so (DistilBERT's pre_classifier too) whole,
        # whatever the config says: a LoRA in one is not loaded
        head = next((part for part in name.split(".") if part.endswith(heads)), None) if heads else None
        if head:
            if head not in to_save:
                to_save.append(head)
                notes.append(f"{head}: the classification head, saved whole (modules_to_save), as PEFT's "
                             "sequence-classification model keeps it")
            entries.append(Entry(name, "full", wkey, bkey))
            continue
        is_embedding = name in (kinds["input"], kinds["output"]) or kind == "embedding"
        if not embed_lora and is_embedding and not excluded(name) and last not in to_save:
            to_save.append(last)
        if name in to_save or last in to_save:
            entries.append(Entry(name, "full", wkey, bkey))
            continue
        if options.include_regexes and not any(re.search(r, name) for r in options.include_regexes):
            continue
        if excluded(name):
            continue
        if kind == "embedding":
            entries.append(Entry(name, "embedding", wkey))
        elif kind in ("linear", "conv1d"):
            entries.append(Entry(name, "lora", wkey, bkey, transposed=kind == "conv1d"))
        elif not options.skip_undecomposable:
            if last not in to_save:
                to_save.append(last)
                notes.append(f"{last}: neither a linear layer nor an embedding, saved whole (modules_to_save)")
            entries.append(Entry(name, "full", wkey, bkey))
    # a tied output head reads the input embeddings' weight: its LoRA would add the embeddings' change twice
    seen: dict = {}
    kept = []
    for e in entries:
        if e.how != "full" and e.weight in seen:
            notes.append(f"{e.name}: tied to {seen[e.weight]} (its change comes with it)")
            continue
        seen.setdefault(e.weight, e.name)
        kept.append(e)
    return kept, to_save


def _loose_parameters(kinds: dict, options: ExtractOptions, notes: list, ft, base) -> list[Entry]:
    """Parameters of no linear layer, embedding or norm (fused MoE experts, CLIP's class embedding) that the filters
    keep and the fine-tune changed: their module saved whole where ``--save-module`` names it (returned: PEFT's
    ``modules_to_save`` carries a whole module, its parameters and those of the modules inside it), else one error (a
    LoRA can neither decompose nor carry them, and their change would be lost), or with ``--skip-undecomposable`` a
    note that they are left out. Those stored under their own names in both checkpoints and equal there (a ViT
    fine-tune's untouched ``cls_token``) lose nothing: a note."""
    kept = [(m, cls, ps) for m, cls, ps in kinds.get("loose", [])
            if not any(re.search(r, m) for r in options.exclude_regexes)
            and (not options.include_regexes or any(re.search(r, m) for r in options.include_regexes))]
    same = [(m, cls, ps) for m, cls, ps in kept if all(_unchanged(ft, base, f"{m}.{p}" if m else p) for p in ps)]
    if same:
        names = ", ".join(f"{m or cls}.{p}" for m, cls, ps in same for p in ps)
        notes.append(f"unchanged by the fine-tune, so nothing is lost: {names} (parameters of no linear layer or "
                     "embedding, which an adapter cannot carry)")
    kept = [x for x in kept if x not in same]
    named = [x for x in kept if x[0] and (x[0] in options.save_modules or x[0].split(".")[-1] in options.save_modules)]
    whole = [_module_entry(kinds, ft, m) for m, _, _ in named]
    for e in whole:
        notes.append(f"{e.name}: parameters of no linear layer or embedding, saved whole with the modules inside it "
                     "(--save-module; modules_to_save by its full name)")
    kept = [x for x in kept if x not in named]
    if not kept:
        return whole
    m, cls, ps = kept[0]
    what = f"{m or '(the model)'} ({cls}: {', '.join(ps)})" + (f" and {len(kept) - 1} more" if len(kept) > 1 else "")
    if options.skip_undecomposable:
        notes.append(f"left out (--skip-undecomposable): {what}, parameters of no linear layer or embedding")
        return whole
    save = f"save the module whole with --save-module {m}, " if m and _stored_whole(kinds, ft, m) else ""
    raise SymmergeError(f"cannot extract {what}: parameters of no linear layer or embedding, which a PEFT LoRA "
                        "adapter does not decompose (mixtures of experts' fused experts, CLIP's class embedding, "
                        f"ViT's class token); a change of theirs would be lost: {save}leave them out with "
                        "--skip-undecomposable or -e REGEX")


def _stored_whole(kinds: dict, ft, module: str) -> bool:
    try:
        _module_entry(kinds, ft, module)
    except SymmergeError:
        return False
    return True


def _module_entry(kinds: dict, ft, module: str) -> Entry:
    """The entry saving ``module`` whole: every parameter of it and of the modules inside it (weights and biases of
    the modules with one, the loose parameters), each stored under its own name (else one error: PEFT reads them so;
    transformers' fused experts are stored per expert)."""
    names = [f"{n}.{p}" for n, _, _, has_bias in kinds["modules"] if _within(n, module)
             for p in (("weight", "bias") if has_bias else ("weight",))]
    names += [f"{n}.{p}" for n, _, ps in kinds.get("loose", []) if _within(n, module) for p in ps]
    keys = []
    for name in names:
        stored = _stored(ft, name)
        if stored is None:
            raise SymmergeError(f"--save-module {module}: its parameter {name} is not stored under that name (fused "
                                "experts are stored per expert), so PEFT could not load it saved whole; leave the "
                                "module out with --skip-undecomposable or -e REGEX")
        keys.append((name, stored))
    return Entry(module, "module", None, keys=tuple(keys))


def _within(name: str, module: str) -> bool:
    """Whether the module ``name`` is ``module`` or one inside it."""
    return name == module or name.startswith(module + ".")


def _last(name: str) -> str:
    """A module's last name (``q_proj`` of ``model.layers.0.self_attn.q_proj``): PEFT's names match by it."""
    return name.split(".")[-1]


def _whole_modules(entries: list, to_save: list, whole: list, kinds: dict, notes: list) -> tuple[list, list]:
    """The plan with the modules saved whole (``whole``): the entries of the modules inside them dropped (their change
    comes with them), ``modules_to_save`` naming each by its full name (PEFT matches its names as suffixes: a last
    name ``embeddings`` would wrap ViT's ``patch_embeddings`` inside it too) and no longer the last names that only
    modules inside them had."""
    inside = lambda name: any(_within(name, w.name) for w in whole)  # noqa: E731
    dropped = [e for e in entries if inside(e.name)]
    if dropped:
        names = ", ".join(e.name for e in dropped)
        notes.append(f"inside a module saved whole, so not extracted on their own: {names}")
    entries = [e for e in entries if not inside(e.name)] + whole
    outside = {_last(n) for n, *_ in kinds["modules"] if not inside(n)}
    within = {_last(n) for n, *_ in kinds["modules"] if inside(n)} | {_last(w.name) for w in whole}
    gone = {s for s in to_save if s not in outside and (s in within or inside(s))}
    notes[:] = [n for n in notes if n.split(":")[0] not in gone]  # "projection: ... saved whole": inside one now
    # a last name of modules inside and outside (CLIP's position_embedding): the outside ones by their full names
    shared = {s: [n for n, *_ in kinds["modules"] if _last(n) == s and not inside(n)] for s in to_save
              if s in outside and s in within}
    to_save = [x for s in to_save if s not in gone for x in shared.get(s, [s])] + [w.name for w in whole]
    return entries, list(dict.fromkeys(to_save))


def _unmatched_save_modules(kinds: dict, options: ExtractOptions) -> list[str]:
    """A warning for each ``--save-module`` that names no module of the fine-tune (by its full or last name): kept in
    ``modules_to_save`` as mergekit-extract-lora keeps it, but nothing is saved for it (a misspelt name, mostly)."""
    from ..errors import did_you_mean

    names = [name for name, *_ in kinds["modules"]] + [m for m, *_ in kinds.get("loose", []) if m]
    lasts = {name.split(".")[-1] for name in names}
    return [f"--save-module {s}: no module of the fine-tune is named so{did_you_mean(s, sorted(lasts))}; nothing is "
            "saved for it (it stays in modules_to_save, as mergekit-extract-lora keeps it)"
            for s in options.save_modules if s not in lasts and s not in names]


def _unmatched_regexes(kinds: dict, options: ExtractOptions) -> list[str]:
    """A warning for each ``--include-regex`` / ``--exclude-regex`` that matches no module of the fine-tune (a
    misspelt pattern, mostly: it selects or leaves out nothing); when no ``--include-regex`` matches any module,
    one error (the adapter would hold no LoRA module at all)."""
    names = [name for name, *_ in kinds["modules"]]
    missed = {flag: [p for p in patterns if not any(re.search(p, n) for n in names)]
              for flag, patterns in (("--include-regex", options.include_regexes),
                                     ("--exclude-regex", options.exclude_regexes))}
    if names and options.include_regexes and len(missed["--include-regex"]) == len(options.include_regexes):
        raise SymmergeError(f"nothing to extract: --include-regex {', '.join(map(repr, options.include_regexes))} "
                            f"matches no module of the fine-tune (its modules are named like {names[0]})")
    return [f"{flag} {p!r}: matches no module of the fine-tune (e.g. {names[0]}); it "
            f"{'selects' if flag == '--include-regex' else 'leaves out'} nothing"
            for flag, patterns in missed.items() for p in patterns if names]


def _unchanged(ft, base, key: str) -> bool:
    """Whether the state-dict tensor ``key`` is stored in both checkpoints and equal there (False when either lacks
    it under that name: fused experts are stored per expert)."""
    fk, bk = _stored(ft, key), _stored(base, key)
    return fk is not None and bk is not None and torch.equal(ft.read_direct(fk), base.read_direct(bk))


def _stored(ck, key: str) -> str | None:
    """The checkpoint's tensor for the state-dict name ``key`` (a tied alias: the tensor it reads), or None."""
    if key in ck.file_of:
        return key
    src = ck.ties.get(key)
    return src if src in ck.file_of else None


def _check_pair(ft, base, e: Entry, key: str) -> str:
    """The base's tensor for the fine-tune's ``key``, of the same shape (else one error)."""
    bkey = _stored(base, key)
    if bkey is None:
        raise SymmergeError(f"the base model has no {key!r} (the fine-tune's {e.name}): not a fine-tune of this base")
    if tuple(ft.shape[key]) != tuple(base.shape[bkey]):
        raise SymmergeError(f"{e.name}: the fine-tune's {key} is {tuple(ft.shape[key])}, the base's "
                            f"{tuple(base.shape[bkey])} (mismatched shapes: not a fine-tune of this base)")
    return bkey


def _read_pair(ft, base, e: Entry, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    return ft.read_direct(key), base.read_direct(_check_pair(ft, base, e, key))


def _decompose(deltas: torch.Tensor, rank: int, options: ExtractOptions):
    """Factors of a batch of task vectors (k x m x n, float32): [(A, B, singular values kept)] per matrix."""
    from ..device import resolve_device

    device = resolve_device(options.device)
    deltas = deltas.to(device)
    k = min(deltas.shape[1:])
    if options.svd == "lowrank" and rank + OVERSAMPLE < k:
        # randomized: the top rank + OVERSAMPLE directions after POWER_ITERATIONS subspace iterations, then the
        # exact SVD of the task vector projected on them (the best rank-r factors within that subspace)
        gen = torch.Generator(device=device).manual_seed(options.seed)
        omega = torch.randn(deltas.shape[0], deltas.shape[2], rank + OVERSAMPLE, generator=gen, device=device)
        q = torch.linalg.qr(deltas @ omega).Q
        for _ in range(POWER_ITERATIONS):
            q = torch.linalg.qr(deltas @ torch.linalg.qr(deltas.mT @ q).Q).Q
        u, s, vh = torch.linalg.svd(q.mT @ deltas, full_matrices=False)
        u = q @ u
    else:
        u, s, vh = torch.linalg.svd(deltas, full_matrices=False)
    out = []
    for i in range(deltas.shape[0]):
        r = min(rank, s.shape[1])
        if options.sv_epsilon > 0:
            r = min(int((s[i] > options.sv_epsilon).sum()), r)
        si = s[i, :r]
        if options.distribute_scale:
            root = si.sqrt()
            A, B = root[:, None] * vh[i, :r], u[i, :, :r] * root[None, :]
        else:
            A, B = si[:, None] * vh[i, :r], u[i, :, :r]
        out.append((A.cpu(), B.cpu(), si.cpu()))
    return out


def _arguments(finetune, base, out, options) -> ExtractOptions:
    """The options (None: the defaults), after the arguments' types: folders (not models in memory), an output path
    and an :class:`ExtractOptions`; else one :class:`UsageError` naming the argument."""
    import os

    from ..io.arguments import output_argument, utf8_checked

    for name, x in (("finetune", finetune), ("base", base)):
        if not isinstance(x, (str, os.PathLike)):
            hint = " (a model in memory: save_pretrained it first)" if isinstance(x, torch.nn.Module) else ""
            raise UsageError(f"{name} must be a Hugging Face model folder or BASE+ADAPTER (str or Path), got "
                             f"{type(x).__name__}{hint}")
        utf8_checked(x, name)
    output_argument(out)
    return options_argument(options, ExtractOptions)


def extract_lora(finetune, base, out, options: ExtractOptions | None = None) -> dict:
    """Write the PEFT LoRA adapter of ``finetune − base`` into the new folder ``out`` (atomically); returns the report
    (also ``out/symmerge_report.json``). ``finetune`` and ``base`` are HF folders (or ``BASE+ADAPTER``)."""
    from ..io.checkpoint import LazyCheckpoint
    from ..io.lora import module_kinds, resolve_input
    from ..io.model import atomic_dir, ensure_output_dir, write_json

    options = _arguments(finetune, base, out, options)
    out = Path(out)
    ensure_output_dir(out, inputs=(finetune, base))
    t0 = time.perf_counter()
    ft_path, base_path = resolve_input(finetune), resolve_input(base)
    ft, bs = LazyCheckpoint(Path(ft_path), spec=False), LazyCheckpoint(Path(base_path), spec=False)
    if ft.config.get("model_type") != bs.config.get("model_type"):
        raise SymmergeError(f"the fine-tune is a {ft.config.get('model_type')} model and the base a "
                            f"{bs.config.get('model_type')} one: extract-lora takes two models of one architecture")
    kinds = module_kinds(ft)
    notes: list = []
    entries, to_save = _plan(ft, bs, kinds, options, notes)
    whole = _loose_parameters(kinds, options, notes, ft, bs)
    if whole:
        entries, to_save = _whole_modules(entries, to_save, whole, kinds, notes)
    warnings = _unmatched_save_modules(kinds, options) + _unmatched_regexes(kinds, options)
    lora = [e for e in entries if e.how not in ("full", "module")]
    if not lora:  # modules saved whole only (or none): an adapter without a target module, which PEFT refuses
        whole = f" (only modules saved whole: {', '.join(dict.fromkeys(e.name.split('.')[-1] for e in entries))})" \
            if entries else ""
        raise SymmergeError(f"nothing to extract: the include/exclude regexes leave no linear layer or embedding to "
                            f"decompose{whole}; the adapter would have no target module for PEFT to load")
    for e in lora:  # every pair checked from the headers before any SVD runs
        for key in (e.weight, e.bias):
            if key is not None:
                _check_pair(ft, bs, e, key)
    tensors: dict = {}
    bias_deltas = _extract_all(ft, bs, lora, options, tensors)
    written = [e for e in lora if e.result["rank"] > 0]
    if lora and not written:  # an adapter without a target module: PEFT refuses to load it
        largest = max(e.result["task_vector_norm"] for e in lora)
        why = (f"no singular value above --sv-epsilon {options.sv_epsilon:g} (the largest task vector's norm, a "
               f"bound on its singular values, is {largest:.4g})") if largest > 0 else "the fine-tune equals the base"
        raise SymmergeError(f"nothing to extract: every LoRA module was left out, {why}; the adapter would have no "
                            "target module for PEFT to load")
    for e in lora:
        if e.result["rank"] == 0:
            notes.append(f"{e.name}: no singular value above --sv-epsilon: left out")
    lora_bias, bias = _bias_tensors(ft, written, bias_deltas, tensors)
    full = [e for e in entries if e.how in ("full", "module")]
    for e in full:
        for name, stored in e.keys or ((f"{e.name}.weight", e.weight), (f"{e.name}.bias", e.bias)):
            if stored is not None:
                tensors[f"base_model.model.{name}"] = ft.read_direct(stored).clone()
    if not tensors:
        raise SymmergeError("nothing to write: every module was left out")
    config = adapter_config(kinds, written, to_save if full else [], base, lora_bias, ft, bias)
    report = {
        "finetune": str(finetune), "base": str(base), "rank": options.rank, "r": config["r"],
        "options": {"svd": options.svd, "distribute_scale": options.distribute_scale, "embed_lora": options.embed_lora,
                    "save_modules": list(options.save_modules), "exclude_regexes": list(options.exclude_regexes),
                    "include_regexes": list(options.include_regexes), "sv_epsilon": options.sv_epsilon,
                    "skip_undecomposable": options.skip_undecomposable},
        "modules": [e.result for e in lora], "modules_to_save": config["modules_to_save"],
        "saved_whole": [e.name for e in full], "lora_bias": lora_bias, "bias": bias, "notes": notes,
        "warnings": warnings,
    }
    errors = [r["relative_error"] for r in report["modules"]]
    report["relative_error"] = {"mean": sum(errors) / len(errors) if errors else 0.0, "max": max(errors, default=0.0)}
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "adapter_config.json", config)
        report["seconds"] = time.perf_counter() - t0
        write_json(tmp / "symmerge_report.json", report)
        if options.write_model_card:
            from ..io.card import write_card

            write_card(tmp, report)  # README.md: the one card writer of every command
    return report


def _bias_tensors(ft, written, bias_deltas: dict, tensors: dict) -> tuple[bool, str]:
    """The written layers' bias changes into ``tensors``; returns the config's ``(lora_bias, bias)``: ``lora_B.bias``
    when every written layer has a bias and none is an embedding; else PEFT's ``bias="lora_only"`` (the biased layers'
    fine-tuned biases whole), as PEFT's lora_bias would give the unbiased layers a ``lora_B.bias`` missing from the
    file, refuse to merge them, and refuse an embedding LoRA."""
    if not any(bool(d.abs().max() > 0) for d, _ in bias_deltas.values() if d.numel()):
        return False, "none"
    if any(e.name not in bias_deltas or e.how == "embedding" for e in written):
        for e in written:
            if e.bias is not None:
                tensors[f"base_model.model.{e.name}.base_layer.bias"] = ft.read_direct(e.bias).clone()
        return False, "lora_only"
    for e in written:
        if e.name in bias_deltas:
            d, dt = bias_deltas[e.name]
            tensors[f"base_model.model.{e.name}.lora_B.bias"] = d.to(dt)
    return True, "none"


def _extract_all(ft, bs, lora, options: ExtractOptions, tensors: dict) -> dict:
    """Every LoRA module's task vector decomposed (its ``A``/``B`` into ``tensors``, its ``result`` set), in batches
    of one shape (their orientation as the adapter stores them: out x in, embeddings dim x vocab), every pair of
    tensors read when its batch runs; returns the bias deltas ``{module: (delta, dtype)}``."""
    from ..progress import bar

    groups: dict = {}
    for e in lora:
        shape = ft.shape[e.weight]
        groups.setdefault(tuple(shape[::-1]) if (e.transposed or e.how == "embedding") else tuple(shape), []).append(e)
    bias_deltas: dict = {}
    with bar(total=len(lora), desc="extracting LoRA", unit="module", enabled=options.progress) as progress:
        for shape, members in groups.items():
            per = max(1, BATCH_BYTES // max(1, 4 * math.prod(shape)))
            for i in range(0, len(members), per):
                _extract_batch(ft, bs, members[i:i + per], options, tensors, bias_deltas, progress)
    return bias_deltas


def _extract_batch(ft, bs, batch, options: ExtractOptions, tensors: dict, bias_deltas: dict, progress) -> None:
    """One batch of modules of one shape: their deltas read and decomposed together (see :func:`_extract_all`);
    ``progress`` advanced by each module."""
    deltas, dtypes = [], []
    for e in batch:
        a, b = _read_pair(ft, bs, e, e.weight)
        dtypes.append(torch.result_type(a, b))
        d = a.float() - b.float()
        deltas.append(d.T if (e.transposed or e.how == "embedding") else d)
        if e.bias is not None:
            fa, fb = _read_pair(ft, bs, e, e.bias)
            bias_deltas[e.name] = (fa.float() - fb.float(), torch.result_type(fa, fb))
        del a, b
    stack = torch.stack(deltas)
    for e, d, dt, (A, B, s) in zip(batch, deltas, dtypes, _decompose(stack, options.rank, options)):
        A, B = A.to(dt).contiguous(), B.to(dt).contiguous()
        norm = float(torch.linalg.norm(d))
        err = float(torch.linalg.norm(d - B.float() @ A.float())) / norm if norm > 0 else 0.0
        e.result = {"module": e.name, "kind": "embedding" if e.how == "embedding" else "linear",
                    "shape": list(ft.shape[e.weight]), "rank": int(A.shape[0]),
                    "relative_error": err, "task_vector_norm": norm}
        if A.shape[0] > 0:
            pre = f"base_model.model.{e.name}"
            if e.how == "embedding":
                tensors[f"{pre}.lora_embedding_A"], tensors[f"{pre}.lora_embedding_B"] = A, B
            else:
                tensors[f"{pre}.lora_A.weight"], tensors[f"{pre}.lora_B.weight"] = A, B
        progress.update(1)
    del stack, deltas


def adapter_config(kinds, written, modules_to_save, base, lora_bias, ft, bias="none") -> dict:
    ranks = {e.name: e.result["rank"] for e in written}
    r = max(ranks.values(), default=1)
    other = {k: v for k, v in ranks.items() if v != r}
    names = set(ranks)
    candidates: dict = {}
    for name, kind, _, _ in kinds["modules"]:
        if kind != "other":
            candidates.setdefault(_last(name), set()).add(name)
    targets: list = []
    for suffix in sorted({_last(n) for n in names}):
        mine = {n for n in names if _last(n) == suffix}
        targets += [suffix] if candidates.get(suffix, set()) <= mine else sorted(mine)
    cls = ft.class_name
    task = "CAUSAL_LM" if cls.endswith("ForCausalLM") else "SEQ_CLS" if cls.endswith("ForSequenceClassification") \
        else None
    return {"base_model_name_or_path": str(base), "peft_type": "LORA", "task_type": task, "r": r, "lora_alpha": r,
            "rank_pattern": other, "alpha_pattern": dict(other), "use_rslora": False, "use_dora": False,
            "lora_bias": lora_bias, "target_modules": targets, "modules_to_save": sorted(modules_to_save) or None,
            "lora_dropout": 0.0, "fan_in_fan_out": False, "bias": bias, "inference_mode": True,
            "init_lora_weights": True}


def summary_rows(report) -> list[tuple]:
    """(module kind, modules, shape, rank, mean error, max error) per last name of the modules, for the printed
    table."""
    groups: dict = {}
    for r in report["modules"]:
        groups.setdefault(r["module"].split(".")[-1], []).append(r)
    rows = []
    for name, rs in groups.items():
        shapes = {tuple(r["shape"]) for r in rs}
        ranks = sorted({r["rank"] for r in rs})
        errs = [r["relative_error"] for r in rs]
        rows.append((name, len(rs), "x".join(map(str, next(iter(shapes)))) if len(shapes) == 1 else "various",
                     str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}", sum(errs) / len(errs), max(errs)))
    return rows
