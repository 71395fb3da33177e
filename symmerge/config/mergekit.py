"""A mergekit config (``mergekit-yaml`` / ``mergekit-multi``) as plain merge jobs: inputs, method, one
:class:`~symmerge.merge.steps.TensorStep` per output tensor, the output's config.json edits, dtypes,
tokenizer source and chat template. One pass over the config and the inputs' headers, every error (naming
the key and its line) before anything is read or written.

Semantics, as mergekit 0.1.x (``mergekit.plan.MergePlanner``, ``mergekit.config``), checked against it by
``tests/config/test_mergekit_configs.py``:

* ``models:`` is one slice of every model's whole stack (the base model added as an input when not listed);
  ``slices:`` list output slices, each of ``sources`` with one ``layer_range: [a, b)`` each (same length);
  the output's layer count is the sum of the slices' lengths;
* a gradient's position ``t`` is the layer's place in its slice, ``j / (n − 1)`` (1 for a one-layer slice);
  tensors outside the layers (embeddings, final norm, LM head) take ``t = 0``, from the first slice's
  sources (before the layers) or the last slice's (after them);
* a parameter is looked up in a slice source's ``parameters``, then the slice's, then the top-level
  ``parameters`` (with ``models:``, a model's ``parameters`` are its source's); filters match a per-model
  parameter against the input tensor's name and a global one against the output tensor's;
* per-model parameters (``weight``, and the method's :attr:`~symmerge.merge.base.Method.per_model`) are
  not given to the base model of a method that uses one; a method's defaults (mergekit's) fill in the rest.

Each method's contract — base required, optional, ignored (one more input) or refused; how many models; a
required ``weight``; a copy step (passthrough) — is declared on the method (:class:`symmerge.merge.base.Method`)
and read here; no method is named in this module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..core.layout import experts_fused_hint
from ..errors import SymmergeError
from ..io.lora import resolve_input
from ..merge.steps import TensorSource, TensorStep, copies
from . import layout as layouts
from . import lenient
from .params import check_setting, resolve

# the keys of a mergekit 0.1.x config (MergeConfiguration), and what symmerge does not do of them
KEYS = ("name", "merge_method", "models", "slices", "base_model", "parameters", "dtype", "out_dtype",
        "tokenizer_source", "tokenizer", "chat_template", "modules")
OUTPUT_KEYS = ("output", "out", "out_path")
DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16", "fp16": "float16",
          "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64", "fp64": "float64",
          "double": "float64"}  # float64: mergekit writes it too


@dataclass
class Input:
    """A merge input: a folder, or the output of an earlier job (``job``: its index)."""

    folder: str | None = None
    job: int | None = None
    label: str = ""
    # a base-class checkpoint read as the fine-tunes' task class: (the fine-tune's folder, the renaming plan of
    # symmerge.io.prefix); its body under the task class's base-model prefix, the tensors it lacks never merged
    adapt: tuple | None = None

    def checkpoint(self, headers: "Headers | None" = None):
        """The input as the streamed executor reads it: its folder (``headers``: its checkpoint, the headers the
        plan read), or for an adapted base a view of it under the task class's names
        (:func:`symmerge.io.prefix.prefixed`)."""
        if self.adapt is None:
            return headers.of(self.folder) if headers is not None else Path(self.folder)
        from ..io.prefix import prefixed

        headers = headers if headers is not None else Headers()
        task, pl = self.adapt
        return prefixed(headers.of(self.folder), headers.of(task), pl)


class Headers(dict):
    """The inputs' safetensors headers (and config.json), read once per folder — a
    :class:`~symmerge.io.checkpoint.LazyCheckpoint` each, by folder — by the planner, and handed with its jobs to
    the run (:func:`symmerge.config.run.run_jobs`): one plan resolved once from the headers, which nothing reads
    again."""

    def of(self, folder):
        key = str(Path(folder))
        if key not in self:
            from ..io.checkpoint import LazyCheckpoint

            self[key] = LazyCheckpoint(Path(folder), spec=False)
        return self[key]


# config.json's lists of one entry per layer (transformers checks their length against the layer count: a sliced
# Qwen2/Gemma2 with its 'layer_types' unchanged did not load)
PER_LAYER_LISTS = ("layer_types", "no_rope_layers")


def per_layer_edits(out_lay, origins: list) -> dict:
    """The edits of ``out_lay``'s config.json lists of one entry per layer (:data:`PER_LAYER_LISTS`) for a sliced
    merge whose output layer j comes from source layer ``origins[j]``: each layer keeps its own entry (a sliding-
    window layer stays one)."""
    edits = {}
    for key in PER_LAYER_LISTS:
        values = out_lay.config.get(key)
        if isinstance(values, list) and len(values) == out_lay.layers:
            edits[key] = [values[i] for i in origins]
    return edits


@dataclass
class Job:
    """One merge: what the executor runs. ``steps`` name tensors in memory naming; their sources index
    ``inputs``. ``config_from``/``side_files_from``: the input whose config.json (plus ``config_edits``) and
    whose side files (tokenizer, generation config) the output gets."""

    name: str | None
    method: str
    inputs: list[Input]
    steps: list[TensorStep]
    config_from: int
    config_edits: dict
    side_files_from: int
    dtype: str | None = None
    out_dtype: str | None = None
    chat_template: str | None = None
    output: Path | None = None
    final: bool = True
    line: str = ""
    layers: int = 0
    shapes: dict = field(default_factory=dict)
    base: int | None = None  # the input that is the method's base model (None: none, or one more input)
    report: dict | None = None  # written to the output as symmerge_report.json (an aligned config's alignment)
    # the output vocabulary every model's embedding rows are mapped to (symmerge.config.vocab), and the output
    # tensors that are vocabulary tensors
    vocab: object = None
    vocab_steps: set = field(default_factory=set)
    # each output layer's source layer (a sliced merge: the per-layer lists of config.json follow their layers)
    layer_origins: list = field(default_factory=list)
    # the headers the planner read (Headers: a checkpoint per folder), which the run reads its inputs through
    headers: dict = field(default_factory=lambda: Headers(), repr=False, compare=False)


def _doc_str(doc, value, where, what="a model folder"):
    if not isinstance(value, str) or not value.strip():
        raise doc.error(f"expected {what}, got {value!r}", *where)
    return value.strip()


def method_for(doc, name):
    from ..errors import did_you_mean
    from ..merge import METHODS

    if not isinstance(name, str):
        raise doc.error(f"the merge method's name, got {name!r}", "merge_method")
    if name not in METHODS:
        raise doc.error(f"unknown merge method {name!r}{did_you_mean(name, METHODS)} (symmerge has: "
                        f"{', '.join(sorted(METHODS))})", "merge_method")
    return name, METHODS[name]


def _kind(default):
    for t in (bool, int, float, str):
        if isinstance(default, t):
            return t
    return None


class _Names:
    """The parameters a method takes in a mergekit config: per-model ones (``weight`` and the method's
    :attr:`~symmerge.merge.base.Method.per_model`, with their aliases) and global ones."""

    def __init__(self, name, method):
        from ..merge import base as _base

        MUST = getattr(_base, "REQUIRED", object())  # a parameter without a default (slerp's t)

        self.name = name
        self.method = method
        aliases = dict(getattr(method, "aliases", {}) or {})
        per = set(getattr(method, "per_model", ()) or ())
        self.per_model = per | {a for a, (target, _) in aliases.items() if target in per} | {"weight"}
        self.globals = (set(method.params) | set(aliases)) - self.per_model
        self.required = {p for p, v in method.params.items() if v is MUST}
        self.weight_required = method.weight_required
        self.defaults = {k: v for k, v in method.params.items() if v is not MUST}
        self.checks = dict(getattr(method, "checks", {}) or {})
        # every model's weight is a finite number (the sign and the sum: the method's rule, per tensor), named with
        # its key and line like every declared parameter, not later with the first tensor it would have weighted
        self.checks.setdefault("weight", _base.real())

    def all(self):
        return sorted(self.per_model | self.globals)

    def kind(self, p):
        check = self.checks.get(p)
        if check is not None:
            return {"real": float, "int": int, "bool": bool}.get(check.type)
        return _kind(self.defaults.get(p))

    def value_kind(self, p):
        """The type a written value of ``p`` is read as (:func:`~symmerge.config.lenient.coerce`): its kind, or
        ``bool`` for a choice that includes true/false (``normalize``: true, false or 'count')."""
        check = self.checks.get(p)
        if check is not None and check.type == "choice" and any(isinstance(c, bool) for c in check.choices):
            return bool
        return self.kind(p)


def parameter_names(method) -> _Names:
    """The parameters ``method`` takes in a mergekit config, and the type each value is read as."""
    return _Names(method.name, method)


def _check_params(doc, params, where, names: _Names, per_model_only=False, warn=None):
    """``params`` as mergekit reads them: each value coerced to its parameter's type
    (:func:`~symmerge.config.lenient.coerce_setting`) and checked; a parameter the method does not take (or a
    merge-wide one given per model, which mergekit does not read there) is one warning and left out."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise doc.error("'parameters' is a mapping of parameter names to values", *where)
    out = {}
    for k, v in params.items():
        if not isinstance(k, str):
            raise doc.error(f"a parameter name, got {k!r}", *where)
        if k not in names.per_model and k not in names.globals:
            _warn(warn, lenient.unknown(doc, f"a parameter of method {names.name!r}", k, names.all(),
                                        *where, k))
            continue
        if per_model_only and k not in names.per_model:
            _warn(warn, f"{doc.at(*where, k)}: {k!r} is one value for the whole merge in {names.name!r}; mergekit does "
                        "not read it per model, so it is ignored here: put it in the top-level 'parameters'")
            continue
        v = lenient.coerce_setting(v, names.value_kind(k))
        check_setting(doc, v, where + (k,), names.kind(k))
        _check_values(doc, names, k, v, where + (k,))
        out[k] = v
    return out


def _check_values(doc, names: _Names, name: str, value, where) -> None:
    """Every value ``value`` holds (a scalar, a gradient's numbers, each filter's value) checked by the parameter's
    declared type and range (:class:`symmerge.merge.base.Check`), as ``--param`` checks it: a bad one is one error
    naming the key and its line in the command's words (``method 'ties': parameter 'density' must be a number in
    [0.0, 1.0], got 1.5``), not, later, the first tensor it would have merged."""
    check = names.checks.get(name)
    if check is None:
        return
    for v in _leaves(value):
        try:
            check(names.name, name, v)
        except SymmergeError as e:
            raise doc.error(str(e), *where) from None


def _leaves(value):
    """The plain values of a parameter's setting: the scalar, a gradient's entries, each filter's (``value``)."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return [value]
    return [leaf for v in value for leaf in (_leaves(v["value"]) if isinstance(v, dict) else [v])]


def _warn(warn, line):
    if warn is None:
        raise SymmergeError(line)
    warn(line)


@dataclass
class _Source:
    model: int  # index in the job's inputs
    a: int
    b: int
    params: dict
    where: tuple


@dataclass
class _Slice:
    sources: list
    params: dict
    base: int | None
    where: tuple


class Planner:
    """Plans every document of a config, in dependency order."""

    def __init__(self, docs, read_layout=None, seed=None, folders=None, truncate_embeddings=False,
                 merge_adapters=True):
        self.docs = docs
        # False: a BASE+ADAPTER input planned on its base's folder, nothing merged (symmerge.config.describe)
        self.merge_adapters = merge_adapters
        self.seed = seed
        self.truncate_embeddings = truncate_embeddings  # mergekit-yaml's --unsafe-truncate-embeddings
        # model reference -> the folder read for it (the aligned copies of an aligned config: symmerge.config.aligned)
        self.folders = dict(folders or {})
        self.headers = Headers()  # every input folder's headers, read once (the jobs carry them to the run)
        self.read_layout = read_layout or (lambda folder: layouts.from_names(
            folder, *layouts.read_names(folder, self.headers.of(folder))))
        self._layouts: dict = {}
        self.jobs: list[Job] = []
        self.named: dict[str, int] = {}  # name -> job index
        self.job_layouts: list = []
        self.warnings: list[str] = []  # one line per key or parameter ignored, as mergekit ignores it
        self._warned: set[str] = set()
        self._scopes: list = [{}, {}]
        self._module_name: str | None = None  # the named module being planned (symmerge.config.modules)

    def warn(self, line: str) -> None:
        if line not in self._warned:  # a set: 60 000 unknown keys took 159 s in a list's membership test
            self._warned.add(line)
            self.warnings.append(line)

    # -- inputs -------------------------------------------------------------------------------------------
    def _ref(self, doc, value, where, inputs: list[Input]) -> int:
        ref = _doc_str(doc, value, where)
        for i, inp in enumerate(inputs):
            if inp.label == ref:
                return i
        if ref in self.named:
            inputs.append(Input(job=self.named[ref], label=ref))
            return len(inputs) - 1
        try:  # BASE+ADAPTER: the base with the LoRA adapter merged in (symmerge.io.lora, the one resolver)
            folder = Path(resolve_input(self.folders.get(ref, ref), merge=self.merge_adapters)).expanduser()
        except SymmergeError as e:
            raise doc.error(str(e), *where) from None
        from ..io.single import as_folder, is_single_file

        if is_single_file(folder):  # a single .safetensors file: its config beside it, else the base model's
            base = doc.data.get("base_model")
            base = base if isinstance(base, str) and Path(base).expanduser().is_dir() else None
            try:
                folder = as_folder(folder, base or next((i.folder for i in inputs if i.folder is not None), None))
            except SymmergeError as e:
                raise doc.error(str(e), *where) from None
        if not folder.is_dir():
            raise doc.error(f"model {ref!r} is not a folder here (nor the name of an earlier merge in this file); "
                            "mergekit names on the Hugging Face Hub must be downloaded first "
                            "(huggingface-cli download NAME --local-dir DIR)", *where)
        if not (folder / "config.json").is_file():
            raise doc.error(f"{ref}: no config.json (expected a Hugging Face model folder)", *where)
        inputs.append(Input(folder=str(folder), label=ref))
        return len(inputs) - 1

    def layout(self, doc, inp: Input, where):
        if self._module_name is not None:
            return self._module_layout(doc, inp, where)
        if inp.job is not None:
            return self.job_layouts[inp.job]
        key = inp.folder if inp.adapt is None else (inp.folder, inp.adapt[0])
        if key not in self._layouts:
            try:
                if inp.adapt is None:
                    self._layouts[key] = self.read_layout(inp.folder)
                else:
                    view = inp.checkpoint(self.headers)
                    self._layouts[key] = layouts.from_names(inp.folder, dict(view.config), dict(view.shape),
                                                            {k: str(v).replace("torch.", "")
                                                             for k, v in view.dtype.items()})
            except SymmergeError as e:
                raise doc.error(str(e), *where) from None
        return self._layouts[key]

    def _module_layout(self, doc, inp: Input, where):
        """The layout of the module being planned of a multi-module input (:mod:`symmerge.config.modules`)."""
        from .modules import MAPS, architecture, module_layout, module_map

        key = (inp.folder if inp.job is None else ("job", inp.job), self._module_name)
        if key not in self._layouts:
            try:
                if inp.job is not None:
                    whole = self.job_layouts[inp.job]
                    folder, names = whole.folder, (dict(whole.config), whole.shapes, whole.dtypes)
                else:
                    folder, names = inp.folder, layouts.read_names(inp.folder, self.headers.of(inp.folder))
            except SymmergeError as e:
                raise doc.error(str(e), *where) from None
            if module_map(names[0]) is None:
                arch = architecture(names[0]) or "no architecture in config.json"
                raise doc.error(f"module {self._module_name!r}: {inp.label} ({arch}) is a model of one stack, whose "
                                f"one module is 'default' (symmerge merges the named modules of "
                                f"{', '.join(sorted(MAPS))})", "modules", self._module_name)
            try:
                self._layouts[key] = module_layout(folder, *names, self._module_name)
            except SymmergeError as e:
                raise doc.error(str(e), *where) from None
        return self._layouts[key]

    def _adapt_base(self, inputs: list, base) -> int | None:
        """A base given as its base class (``BertModel``, ``LlamaModel``) beside fine-tunes of a task class
        (``BertForSequenceClassification``): the base is read as the task class (one rule,
        :func:`symmerge.io.prefix.lazy_plan`). Returns the fine-tune's input index, or None."""
        if base is None or inputs[base].folder is None:
            return None
        from ..io.prefix import lazy_is_task, lazy_plan

        base_ck = self.headers.of(inputs[base].folder)
        if lazy_is_task(base_ck):
            return None
        for i, inp in enumerate(inputs):
            if i == base or inp.folder is None:
                continue
            ck = self.headers.of(inp.folder)
            if lazy_is_task(ck) and (pl := lazy_plan(ck, base_ck)) is not None:
                inputs[base] = Input(folder=inputs[base].folder, label=inputs[base].label, adapt=(inp.folder, pl))
                return i
        return None

    # -- one document -------------------------------------------------------------------------------------
    def plan_doc(self, doc, final: bool) -> Job:
        data = doc.data
        for k in data:
            if k not in KEYS and k not in OUTPUT_KEYS and k != "align":  # align: none
                from .command import option_names

                self.warn(lenient.unknown(doc, "a mergekit key", k, KEYS + OUTPUT_KEYS + option_names(), k))
        if "merge_method" not in data:
            raise doc.error("'merge_method' is missing (e.g. linear, ties, slerp, passthrough)")
        mk_name, method = method_for(doc, data["merge_method"])
        names = _Names(mk_name, method)
        modules = self._modules(doc, data)
        for root, _, body in modules:
            _check_body(doc, root, body)
        top = _check_params(doc, data.get("parameters"), ("parameters",), names, warn=self.warn)
        dtype = self._dtype(doc, data, "dtype")
        out_dtype = self._dtype(doc, data, "out_dtype")
        inputs: list[Input] = []
        base = None
        if data.get("base_model") is not None:
            base = self._ref(doc, data["base_model"], ("base_model",), inputs)
        parts = []  # per module: (its name or None, its slices, whether sliced, its parameter scopes)
        try:
            for root, mname, body in modules:
                self._module_name = mname
                module = (_check_params(doc, body.get("parameters"), root + ("parameters",), names, warn=self.warn)
                          if root else {})
                self._scopes = [module, top]  # below a slice's parameters: the module's, then the top level's
                if body.get("models"):
                    slices = self._models_slices(doc, body["models"], base, method.base_policy, names, inputs, root)
                else:
                    slices = self._slices(doc, body["slices"], base, names, inputs, root)
                for s in slices:
                    self._contract(doc, mk_name, method, s, inputs)
                parts.append((mname, slices, bool(body.get("slices")), self._scopes))
            if modules[0][1] is not None:
                self._every_module(doc, modules, inputs[parts[0][1][0].sources[0].model])
            job = self._job(doc, data, final, method, inputs, base, parts[0][1], dtype, out_dtype)
            if modules[0][1] is None:
                self._steps(doc, job, parts[0][1], names, mk_name, method, parts[0][2])
            else:
                self._modules_steps(doc, job, parts, names, mk_name, method)
        finally:
            self._module_name = None
        return job

    def _job(self, doc, data, final, method, inputs, base, slices, dtype, out_dtype) -> Job:
        task = self._adapt_base(inputs, base)
        tok, vocab = self._tokenizer(doc, data, inputs, base)
        if vocab is None and self.truncate_embeddings:
            vocab = self._truncated(doc, inputs)
        chat = self._chat_template(doc, data)
        config_from = task if task is not None else base if base is not None else slices[0].sources[0].model
        side = tok if tok is not None else config_from
        return Job(data.get("name"), method.name, inputs, [], config_from, {}, side, dtype, out_dtype, chat,
                   final=final, line=doc.at(), base=base if method.uses_base else None, vocab=vocab,
                   headers=self.headers)

    def _modules(self, doc, data) -> list[tuple]:
        """Each module merged: (the key path of its mapping, its name — None for a model of one stack —, the
        mapping holding its ``models`` / ``slices`` / ``parameters``). The document itself or mergekit's
        ``modules: {default: ...}`` for a model of one stack; ``modules: {NAME: ...}`` for the named modules of
        a multi-module model (:mod:`symmerge.config.modules`), or every module of one given whole ``models``."""
        modules = data.get("modules")
        if not modules:
            found = self._peek_modules(data)
            if found is None:
                return [((), None, data)]
            if data.get("slices"):
                raise doc.error(f"{found[0]} is a model of several modules ({', '.join(found[1])}): its slices go "
                                "under 'modules: NAME: slices:', one module at a time", "slices")
            return [((), m, data) for m in found[1]]
        if data.get("models") or data.get("slices"):
            raise doc.error("give one of 'models', 'slices' or 'modules'", "modules")
        if not isinstance(modules, dict) or not all(isinstance(m, dict) for m in modules.values()):
            raise doc.error("'modules' maps a module's name (default) to its 'models' or 'slices'", "modules")
        for name, body in modules.items():
            for k in body:
                if k not in ("models", "slices", "parameters"):
                    self.warn(lenient.unknown(doc, "a key of a module", k, ("models", "slices", "parameters"),
                                              "modules", name, k))
        if set(modules) == {"default"}:
            return [(("modules", "default"), None, modules["default"])]
        return [(("modules", name), name, body) for name, body in modules.items()]

    def _peek_modules(self, data) -> tuple | None:
        """(architecture, its module names) of a document's first model where it is a model of several modules
        (read from its config.json before anything else), else None."""
        from .modules import architecture, module_names

        first = data.get("base_model")
        models, slices = data.get("models"), data.get("slices")
        if not isinstance(first, str) and isinstance(models, list) and models:
            first = models[0].get("model") if isinstance(models[0], dict) else models[0]
        if not isinstance(first, str) and isinstance(slices, list) and slices and isinstance(slices[0], dict):
            sources = slices[0].get("sources")
            if isinstance(sources, list) and sources and isinstance(sources[0], dict):
                first = sources[0].get("model")
        if not isinstance(first, str):
            return None
        if first in self.named:
            config = dict(self.job_layouts[self.named[first]].config)
        else:
            path = Path(self.folders.get(first, first)).expanduser() / "config.json"
            try:
                import json

                config = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
        names = module_names(config) if isinstance(config, dict) else ("default",)
        return None if names == ("default",) else (architecture(config), names)

    def _every_module(self, doc, modules, first: Input) -> None:
        """A merge of named modules gives every module of the architecture (mergekit writes a model without the
        tensors of a module left out)."""
        from .modules import architecture, module_names

        config = self._module_layout(doc, first, ("modules",)).config
        given = [m for _, m, _ in modules]
        missing = [m for m in module_names(config) if m not in given]
        if missing:
            raise doc.error(f"'modules' gives no {missing[0]!r}: {architecture(config)} has the modules "
                            f"{', '.join(module_names(config))}, and a merge gives every one (mergekit writes a "
                            "model without the tensors of a module left out)", "modules")

    def _dtype(self, doc, data, key):
        v = data.get(key)
        if v is None:
            return None
        if not isinstance(v, str) or v.lower() not in DTYPES:
            shown = repr(v) if isinstance(v, (str, int, float, bool, type(None))) else f"a YAML {type(v).__name__}"
            raise doc.error(f"{key!r} is one of float32, float16, bfloat16, float64, got {shown}", key)
        return DTYPES[v.lower()]

    def _models_slices(self, doc, models, base, policy, names, inputs, root=()):
        if not isinstance(models, list):
            raise doc.error("'models' is a list of models (each '- model: FOLDER' with optional 'parameters')",
                            *root, "models")
        items = []
        for i, item in enumerate(models):  # every key and value first, then the folders
            where = root + ("models", i)
            params = {}
            if isinstance(item, str):
                ref, rw = item, where
            elif isinstance(item, dict):
                for k in item:
                    if k not in ("model", "parameters"):
                        self.warn(lenient.unknown(doc, "a key of a model", k, ("model", "parameters"), *where, k))
                if "model" not in item:
                    raise doc.error("needs 'model': a model folder", *where)
                ref, rw = item["model"], where + ("model",)
                params = _check_params(doc, item.get("parameters"), where + ("parameters",), names,
                                       per_model_only=True, warn=self.warn)
            else:
                raise doc.error(f"a model is '- model: FOLDER' (or a folder), got {item!r}", *where)
            items.append((ref, rw, params, where))
        base_ref = doc.data.get("base_model") if policy in ("required", "optional") else None
        weighed = [p for r, _, p, _ in items if r != base_ref]
        if any("weight" in p for p in weighed) and not all("weight" in p for p in weighed) and \
                not any("weight" in sc for sc in self._scopes):
            raise doc.error("give a weight to every model or to none (or a default 'weight' in the top-level "
                            "'parameters')", *root, "models")
        sources, seen = [], set()
        for ref, rw, params, where in items:
            idx = self._ref(doc, ref, rw, inputs)
            if idx in seen:
                raise doc.error(f"model {inputs[idx].label!r} is listed twice", *where)
            seen.add(idx)
            sources.append(_Source(idx, 0, -1, params, where))
        if base is not None and base not in seen and policy != "refused":
            sources.append(_Source(base, 0, -1, {}, ("base_model",)))
        layers = {}
        for s in sources:
            lay = self.layout(doc, inputs[s.model], s.where)
            s.b = lay.layers
            layers[s.model] = lay.layers
        if len(set(layers.values())) > 1:
            detail = ", ".join(f"{inputs[m].label}: {n}" for m, n in layers.items())
            raise doc.error(f"the models have different numbers of layers ({detail}): use 'slices' with "
                            "'layer_range' to say which layers to merge", *root, "models")
        return [_Slice(sources, {}, base, root + ("models",))]

    def _slices(self, doc, slices, base, names, inputs, root=()):
        if not isinstance(slices, list):
            raise doc.error("'slices' is a list of output slices, each with 'sources'", *root, "slices")
        out = []
        for i, sl in enumerate(slices):
            where = root + ("slices", i)
            if not isinstance(sl, dict):
                raise doc.error("a slice is a mapping with 'sources' (and optional 'parameters', 'base_model')",
                                *where)
            for k in sl:
                if k not in ("sources", "parameters", "base_model", "residual_weight"):
                    self.warn(lenient.unknown(doc, "a key of a slice", k, ("sources", "parameters", "base_model"),
                                              *where, k))
            if sl.get("residual_weight") is not None:
                raise doc.error("'residual_weight' is not supported", *where, "residual_weight")
            sb = base
            if sl.get("base_model") is not None:
                sb = self._ref(doc, sl["base_model"], where + ("base_model",), inputs)
            params = _check_params(doc, sl.get("parameters"), where + ("parameters",), names, warn=self.warn)
            srcs = sl.get("sources")
            if not isinstance(srcs, list) or not srcs:
                raise doc.error("'sources' is a non-empty list of '- model: FOLDER' with 'layer_range: [a, b]'",
                                *where, "sources")
            sources, seen = [], set()
            for j, src in enumerate(srcs):
                sw = where + ("sources", j)
                if not isinstance(src, dict) or "model" not in src:
                    raise doc.error("a source is '- model: FOLDER' with 'layer_range: [a, b]'", *sw)
                for k in src:
                    if k not in ("model", "layer_range", "parameters"):
                        self.warn(lenient.unknown(doc, "a key of a source", k, ("model", "layer_range", "parameters"),
                                                  *sw, k))
                idx = self._ref(doc, src["model"], sw + ("model",), inputs)
                if idx in seen:
                    raise doc.error(f"model {inputs[idx].label!r} is twice in one slice", *sw)
                seen.add(idx)
                lay = self.layout(doc, inputs[idx], sw + ("model",))
                rng = src.get("layer_range")
                if "layer_range" not in src:
                    raise doc.error("needs 'layer_range: [a, b]' (layers a … b−1)", *sw)
                if isinstance(rng, list) and all(isinstance(x, str) and x.strip().isdigit() for x in rng):
                    rng = [int(x) for x in rng]  # ["0", "2"]: whole numbers written as text, as mergekit reads them
                if (not isinstance(rng, list) or len(rng) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                          for x in rng)):
                    raise doc.error(f"'layer_range' is [a, b] (two integers: layers a … b−1), got {rng!r}", *sw,
                                    "layer_range")
                a, b = rng
                if not 0 <= a < b <= lay.layers:
                    raise doc.error(f"layer_range [{a}, {b}] is not within the model's {lay.layers} layers "
                                    f"(0 <= a < b <= {lay.layers})", *sw, "layer_range")
                p = _check_params(doc, src.get("parameters"), sw + ("parameters",), names, warn=self.warn)
                sources.append(_Source(idx, a, b, p, sw))
            lengths = {s.b - s.a for s in sources}
            if len(lengths) > 1:
                raise doc.error("the sources of a slice must have the same number of layers, got "
                                + ", ".join(f"[{s.a}, {s.b}]" for s in sources), *where, "sources")
            out.append(_Slice(sources, params, sb, where))
        return out

    def _contract(self, doc, mk_name, method, sl: _Slice, inputs):
        """The slice against the method's declared contract (its base policy, :meth:`Method.check_inputs`)."""
        models = [s.model for s in sl.sources]
        base, policy = sl.base, method.base_policy
        if policy in ("required", "optional") and base is not None and base not in models:
            raise doc.error(f"the base model {inputs[base].label!r} is not among this slice's sources", *sl.where)
        if policy == "required" and base is None:
            raise doc.error(f"method {mk_name!r} needs 'base_model' (the model the others were fine-tuned from)",
                            "merge_method")
        if policy == "refused" and base is not None:
            raise doc.error(f"method {mk_name!r} does not use a base model", "base_model")
        uses_base = method.uses_base and base is not None
        if uses_base and len(models) == 1 and method.base_alone_is_base:
            self.warn(f"{doc.at(*sl.where)}: only the base model is listed: {mk_name!r} adds no task vector, and "
                      "the base's tensors are written unchanged (as mergekit writes them)")
            return
        try:
            method.check_inputs(len(models) - (1 if uses_base else 0), uses_base)
        except SymmergeError as e:
            raise doc.error(str(e), *sl.where) from None

    def _tokenizer(self, doc, data, inputs, base):
        """(the input whose tokenizer the output copies, or None; the :class:`~symmerge.config.vocab.Vocabulary`
        every model's embedding rows are mapped to, or None when they already agree)."""
        src = data.get("tokenizer_source")
        key = ("tokenizer_source",)
        tokens, pad = {}, None
        if data.get("tokenizer") is not None:
            if src is not None:
                raise doc.error("give 'tokenizer' or 'tokenizer_source', not both", "tokenizer")
            tok = data["tokenizer"]
            if not isinstance(tok, dict):
                raise doc.error("'tokenizer' is a mapping with 'source' (base, union or a model)", "tokenizer")
            for k in tok:
                if k not in ("source", "tokens", "pad_to_multiple_of"):
                    self.warn(lenient.unknown(doc, "a key of 'tokenizer'", k,
                                              ("source", "tokens", "pad_to_multiple_of"), "tokenizer", k))
            pad = tok.get("pad_to_multiple_of")
            if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or pad < 1):
                raise doc.error(f"'pad_to_multiple_of' is a positive integer, got {pad!r}", "tokenizer",
                                "pad_to_multiple_of")
            tokens = self._tokens(doc, tok.get("tokens"), inputs)
            src = tok.get("source", "union")
            key = ("tokenizer", "source")
        if src is None:
            return None, None
        if not isinstance(src, str) or not src.strip():
            raise doc.error(f"the tokenizer's source is 'union', 'base' or a model, got {src!r}", *key)
        if src == "base":
            if base is None:
                raise doc.error("tokenizer source 'base' needs 'base_model'", *key)
            idx = base
        elif src == "union":
            idx = None
        else:
            idx = self._ref(doc, src, key, inputs)
        ref = idx if idx is not None else base if base is not None else 0
        from ..io.tokenizers import has_vocabulary

        with contextlib.ExitStack() as stack:
            folders = {i: self._tokenizer_folder(inp, stack) for i, inp in enumerate(inputs)}
            if idx is not None and not has_vocabulary(folders[idx]):
                self.warn(f"{doc.at(*key)}: {inputs[idx].label!r} has no tokenizer files: the output has no "
                          "tokenizer (name a source that has one)")
            if not tokens and not pad and self._same_vocab(folders, ref) and \
                    self._rows_are_tokens(doc, inputs, folders, ref, key):
                return ref, None  # every model has the vocabulary asked for: the rows are merged as they are
            from . import vocab as vocabs

            configs = {i: dict(self.layout(doc, inputs[i], key).config) for i in folders}
            try:
                vocab = vocabs.build("union" if idx is None else idx, folders, configs, base, 0, tokens, pad)
            except SymmergeError as e:
                raise doc.error(str(e), *key) from None
        return (base if base is not None else 0) if idx is None else idx, vocab

    def _truncated(self, doc, inputs):
        """``--unsafe-truncate-embeddings``: every model's vocabulary rows cut to the smallest model's count
        (token ids assumed the same; the tokenizer copied as it is), or None when the counts agree."""
        from .vocab import Vocabulary, vocab_size

        sizes = {i: vocab_size(dict(self.layout(doc, inp, ("models",)).config)) for i, inp in enumerate(inputs)}
        if None in sizes.values() or len(set(sizes.values())) < 2:
            return None
        m = min(sizes.values())
        return Vocabulary(None, {f"<row {k}>": k for k in range(m)}, m, {i: list(range(m)) for i in sizes}, {})

    def _tokenizer_folder(self, inp: Input, stack) -> Path:
        """The folder holding the tokenizer of input ``inp``: its own, or for an earlier merge of this file the
        tokenizer that merge writes (its output vocabulary, saved for the plan into a temporary folder that
        ``stack`` removes; else its tokenizer source's folder)."""
        if inp.job is None:
            return Path(inp.folder)
        job = self.jobs[inp.job]
        if job.vocab is None:
            return self._tokenizer_folder(job.inputs[job.side_files_from], stack)
        import tempfile

        from .vocab import write_tokenizer

        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="symmerge-vocab-")))
        write_tokenizer(job.vocab, folder)
        return folder

    def _tokens(self, doc, tokens, inputs) -> dict:
        """``tokenizer.tokens``: token -> :class:`~symmerge.config.vocab.TokenSource`."""
        from .vocab import TokenSource

        if tokens is None:
            return {}
        if not isinstance(tokens, dict):
            raise doc.error("'tokens' maps tokens to {source: MODEL, force: true/false}", "tokenizer", "tokens")
        out = {}
        for t, cfg in tokens.items():
            where = ("tokenizer", "tokens", t)
            if not isinstance(cfg, dict) or set(cfg) - {"source", "force"}:
                raise doc.error("a token takes 'source' (a model, {kind: model_token, model, token or token_id} or "
                                "{kind: zero}) and 'force'", *where)
            force = cfg.get("force", False)
            if not isinstance(force, bool):
                raise doc.error(f"'force' is true or false, got {force!r}", *where, "force")
            src = cfg.get("source")
            if isinstance(src, str):
                out[str(t)] = TokenSource("model", self._ref(doc, src, where + ("source",), inputs), force=force)
            elif isinstance(src, dict) and src.get("kind") == "zero" and set(src) == {"kind"}:
                out[str(t)] = TokenSource("zero", force=force)
            elif isinstance(src, dict) and src.get("kind") == "model_token" and "model" in src \
                    and not set(src) - {"kind", "model", "token", "token_id"} \
                    and (("token" in src) != ("token_id" in src)):
                tid = src.get("token_id")
                if tid is not None and (not isinstance(tid, int) or isinstance(tid, bool) or tid < 0):
                    raise doc.error(f"'token_id' is a token id, got {tid!r}", *where, "source", "token_id")
                out[str(t)] = TokenSource("model_token", self._ref(doc, src["model"], where + ("source", "model"),
                                                                   inputs), token=src.get("token"), token_id=tid,
                                          force=force)
            else:
                raise doc.error("'source' is a model, {kind: model_token, model: M, token: T} (or token_id: N) or "
                                f"{{kind: zero}}, got {src!r}", *where, "source")
        return out

    def _rows_are_tokens(self, doc, inputs, folders, idx, key) -> bool:
        """Every model's vocabulary tensors have one row per token of input ``idx``'s tokenizer (mergekit cuts
        padding rows beyond the tokenizer's tokens off, and sets ``vocab_size`` to their count)."""
        from ..io.tokenizers import read_tokenizer
        from .vocab import vocab_size

        view = read_tokenizer(folders[idx])
        if view is None:
            return True
        return all(vocab_size(dict(self.layout(doc, i, key).config)) in (None, len(view.vocab)) for i in inputs)

    def _same_vocab(self, folders, idx) -> bool:
        """Every input has the vocabulary of input ``idx`` (``folders``: each input's tokenizer folder; an input
        without tokenizer files counts as having it, as mergekit assumes)."""
        from ..io.tokenizers import differences, read_tokenizer

        view = read_tokenizer(folders[idx])
        if view is None:
            return True
        for f in folders.values():
            other = read_tokenizer(f)
            if other is not None and differences(view, other, "a", "b", limit=1):
                return False
        return True

    def _chat_template(self, doc, data):
        ct = data.get("chat_template")
        if ct is None:
            return None
        if not isinstance(ct, str) or not ct.strip():
            raise doc.error("'chat_template' is 'auto', a template name or a Jinja template", "chat_template")
        if ct != "auto" and "{" not in ct:
            from .chat_templates import TEMPLATES, named

            if named(ct) is not None:
                return named(ct)
            raise doc.error(f"invalid chat template {ct!r}: 'auto', a built-in name ({', '.join(sorted(TEMPLATES))}) "
                            "or a Jinja template", "chat_template")
        return ct

    # -- the steps ----------------------------------------------------------------------------------------
    def _steps(self, doc, job, slices, names, mk_name, method, sliced):
        job.steps, job.shapes, job.layers, lays, out_lay = self._module_steps(doc, job, slices, names, mk_name,
                                                                             method)
        self._record_layout(doc, job, lays, out_lay, sliced)

    def _modules_steps(self, doc, job, parts, names, mk_name, method) -> None:
        """The steps of every named module, one after the other (mergekit's order of planning), and the output's
        config edits: the layer count of each sliced module, the dtype."""
        job.steps, job.shapes, job.layers = [], {}, 0
        edits: dict = {}
        dtypes: dict = {}
        for mname, slices, sliced, scopes in parts:
            self._module_name, self._scopes = mname, scopes
            steps, shapes, layers, lays, out_lay = self._module_steps(doc, job, slices, names, mk_name, method)
            job.steps += steps
            job.shapes.update(shapes)
            job.layers += layers
            if sliced and out_lay.layer_key:
                edits[out_lay.layer_key] = layers
                edits.update(per_layer_edits(out_lay, job.layer_origins[-layers:] if layers else []))
            for st in steps:
                dtypes[st.name] = lays[st.sources[0].model].dtypes[st.sources[0].key]
        want = job.out_dtype or job.dtype
        config = out_lay.config
        if want:
            edits["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = want
            dtypes = dict.fromkeys(dtypes, want)
        job.config_edits = edits
        self.job_layouts.append(layouts.Layout(f"<{job.name or 'merge'}>", {**config, **edits}, job.shapes, dtypes,
                                               0, None))

    def _module_steps(self, doc, job, slices, names, mk_name, method) -> tuple:
        """(the steps, the output shapes, the layer count, every input's layout, the output's layout) of the
        module being planned (the whole model for a model of one stack)."""
        inputs = job.inputs
        scopes = self._scopes
        out_lay = self.layout(doc, inputs[job.config_from], ("merge_method",))
        lays = {i: self.layout(doc, inp, ("models",)) for i, inp in enumerate(inputs)}
        vocab_names: dict = {}  # input -> its vocabulary tensors (their rows mapped to the output vocabulary)
        if job.vocab is not None:
            from dataclasses import replace as _replace

            from .vocab import is_vocabulary_tensor

            for i, lay in list(lays.items()):
                found = {n for n in (*lay.pre, *lay.post) if is_vocabulary_tensor(n, lay.shapes[n], lay.config)}
                vocab_names[i] = found
                lays[i] = _replace(lay, shapes={**lay.shapes, **{n: (job.vocab.size, *lay.shapes[n][1:])
                                                                for n in found}})
            out_lay = lays[job.config_from]
        steps: list[TensorStep] = []
        shapes: dict = {}
        cache: dict = {}

        def one(out_name, sl: _Slice, pairs, t, where):
            # pairs: (source, input tensor name) in slice order
            base = sl.base if method.uses_base else None
            for s, name in pairs:
                lay = lays[s.model]
                if name not in lay.shapes:
                    raise doc.error(f"model {inputs[s.model].label!r} has no tensor {name!r}"
                                    f"{experts_fused_hint(name, lay.shapes)}", *s.where)
            shape = lays[pairs[0][0].model].shapes[pairs[0][1]]
            for s, name in pairs[1:]:
                if lays[s.model].shapes[name] != shape:
                    raise doc.error(f"{name} has shape {lays[s.model].shapes[name]} in {inputs[s.model].label!r} "
                                    f"and {shape} in {inputs[pairs[0][0].model].label!r}", *s.where)
            shapes[out_name] = shape
            if any(n in vocab_names.get(s.model, ()) for s, n in pairs):
                job.vocab_steps.add(out_name)
            merged = [(s, n) for s, n in pairs if s.model != base]
            base_src = next((TensorSource(s.model, n) for s, n in pairs if s.model == base), None)
            if not merged:  # only the base (Method.base_alone_is_base): no task vector to add
                steps.append(TensorStep(out_name, (base_src,), merge=False))
                return
            adapt = inputs[base].adapt if base is not None else None
            if base_src is not None and adapt is not None and base_src.key in adapt[1].added:
                # a tensor the base-class model lacks (the task head): kept from the first fine-tune, never merged
                steps.append(TensorStep(out_name, (TensorSource(merged[0][0].model, merged[0][1]),), merge=False))
                return
            if method.copy_unless is not None:  # a copy, unless that parameter says otherwise (passthrough's scale)
                value = resolve(method.copy_unless, [merged[0][0].params, sl.params, *scopes], merged[0][1], t)
                if copies(method, value):  # the rule of every entry (symmerge.merge.steps.copies)
                    steps.append(TensorStep(out_name, (TensorSource(merged[0][0].model, merged[0][1]),), merge=False))
                    return
            weights, params = self._step_params(doc, inputs, names, mk_name, sl, merged, out_name, t, where)
            step = TensorStep(out_name, tuple(TensorSource(s.model, n) for s, n in merged), base_src, weights,
                              MappingProxyType(params))
            self._check_step(doc, method, step, where, cache)
            steps.append(step)

        first, last = slices[0], slices[-1]
        for name in out_lay.pre:
            one(name, first, [(s, name) for s in first.sources], 0.0, first.where)
        out_i = 0
        for sl in slices:
            n = sl.sources[0].b - sl.sources[0].a
            for j in range(n):
                t = j / (n - 1) if n > 1 else 1.0
                self._layer_in_place(doc, inputs, lays, out_lay, sl, j, out_i)
                job.layer_origins.append(sl.sources[0].a + j)
                for suffix in out_lay.suffixes + out_lay.optional:
                    pairs = [(s, lays[s.model].layer_name(s.a + j, suffix)) for s in sl.sources]
                    if suffix in out_lay.optional and any(n not in lays[s.model].shapes for s, n in pairs):
                        # a tensor only some layers hold (T5's relative attention bias), as mergekit's optional
                        continue
                    one(out_lay.layer_name(out_i, suffix), sl, pairs, t, sl.where)
                out_i += 1
        for name in out_lay.post:
            one(name, last, [(s, name) for s in last.sources], 0.0, last.where)
        return steps, shapes, out_i, lays, out_lay

    @staticmethod
    def _layer_in_place(doc, inputs, lays, out_lay, sl: _Slice, j: int, out_i: int) -> None:
        """Layers of several kinds (a dense FFN among mixtures of experts) merge where each source layer holds the
        tensors the output's layer ``out_i`` holds in the config written (``out_lay``'s); a slice that puts one
        kind where the config says another is one error."""
        if not (out_lay.layer_sets or any(lays[s.model].layer_sets for s in sl.sources)):
            return
        want = layouts.layer_kind(out_lay, out_i)
        for s in sl.sources:
            have = layouts.layer_kind(lays[s.model], s.a + j)
            if have != want:
                odd = sorted(have ^ want)[0] if have is not None and want is not None else ""
                where = f" ({lays[s.model].layer_name(s.a + j, odd)})" if odd else ""
                raise doc.error(f"model {inputs[s.model].label!r}: layer {s.a + j} holds other tensors{where} than "
                                f"layer {out_i} of the output (as {out_lay.folder}'s config.json lays out its "
                                "layers of several kinds): slices that move such layers need layers of one "
                                "template", *s.where)

    def _step_params(self, doc, inputs, names, mk_name, sl: _Slice, merged, out_name, t, where) -> tuple:
        """(the per-model weights or None, the parameters) of one merged output tensor ``out_name``: every
        parameter of the method resolved for it (per model from the model's, the slice's and the top-level
        scopes; shared ones from the slice's and the top level), defaults filled in, a missing required one an
        error naming it and where it would go."""
        scopes = self._scopes
        shared = {}
        for p in sorted(names.globals):
            v = resolve(p, [sl.params, *scopes], out_name, t)
            if v is not None:
                shared[p] = v
        per: dict = {}
        for p in sorted(names.per_model):
            vals = [resolve(p, [s.params, sl.params, *scopes], n, t) for s, n in merged]
            if all(v is None for v in vals):
                if p == "weight" and names.weight_required:
                    raise doc.error(f"no {p!r} for {out_name} (method {mk_name!r} needs one per model: set it in "
                                    "each model's parameters or in the top-level 'parameters')", *where)
                continue
            missing = [i for i, v in enumerate(vals) if v is None]
            if missing:
                s = merged[missing[0]][0]
                if (p == "weight" and names.weight_required) or p not in names.defaults:
                    raise doc.error(f"no {p!r} for model {inputs[s.model].label!r} on {out_name} (set it for every "
                                    "model, or in the top-level 'parameters')", *s.where)
                vals = [names.defaults[p] if v is None else v for v in vals]
            per[p] = tuple(vals)
        for p in sorted(names.required):
            if p not in shared and p not in per:
                raise doc.error(f"no {p!r} for {out_name}: method {mk_name!r} needs it (in 'parameters')", *where)
        weights = per.pop("weight", None)
        params = {**shared, **per}
        if self.seed is not None and "seed" in names.defaults and "seed" not in params:
            params["seed"] = self.seed
        elif self.seed is not None and "seed" in params and params["seed"] != self.seed:
            self.warn(f"{doc.at()}: --random-seed {self.seed} is not used for {mk_name!r}: the config sets its "
                      f"'seed' ({params['seed']}), which wins; the flag seeds only a merge whose config sets none")
        return weights, params

    def _record_layout(self, doc, job, lays: dict, out_lay, sliced) -> None:
        """The output's config edits (layer count of a sliced merge, vocabulary size, dtype) set on ``job`` and its
        layout (names, shapes, dtypes) added to the planner's, from the job's steps and shapes."""
        steps, shapes, out_i = job.steps, job.shapes, job.layers
        edits = {}
        if sliced and out_lay.layer_key:
            edits[out_lay.layer_key] = out_i
            edits.update(per_layer_edits(out_lay, job.layer_origins))
        elif sliced and out_i != out_lay.layers:
            raise doc.error(f"cannot set the output's layer count ({out_i}) in its config.json", "slices")
        if job.vocab is not None and "vocab_size" in out_lay.config:
            edits["vocab_size"] = job.vocab.size
        want = job.out_dtype or job.dtype
        if want:
            edits["torch_dtype" if "torch_dtype" in out_lay.config and "dtype" not in out_lay.config
                  else "dtype"] = want
        job.config_edits = edits
        dtypes = {}
        for st in steps:
            src = st.sources[0]
            dtypes[st.name] = want or lays[src.model].dtypes[src.key]
        config = {**out_lay.config, **edits}
        self.job_layouts.append(layouts.from_names(f"<{job.name or 'merge'}>", config, shapes, dtypes))

    def _check_step(self, doc, method, step, where, cache):
        from ..merge.steps import step_arguments

        try:
            step_arguments(method, step, len(step.sources), cache)
        except SymmergeError as e:
            raise doc.error(f"{step.name}: {e}", *where) from None

    # -- the whole file -----------------------------------------------------------------------------------
    def plan(self) -> list[Job]:
        docs = self.docs
        names = {}
        for d in docs:
            n = d.data.get("name")
            if n is None:
                continue
            if not isinstance(n, str) or not n.strip():
                raise d.error(f"'name' is a name for this merge, got {n!r}", "name")
            if n in names:
                raise d.error(f"two merges are named {n!r} (the other at line {names[n].line('name')})", "name")
            names[n] = d
        unnamed = [d for d in docs if d.data.get("name") is None]
        if len(docs) > 1 and len(unnamed) > 1:
            raise unnamed[1].error("more than one merge without 'name': every merge but the final one needs a name")
        order = self._order(docs, names)
        used = {r for d in docs for r in _references(d, names)}
        finals = unnamed or [d for d in docs if d.data["name"] not in used]
        if len(finals) != 1:
            raise docs[0].error("no single final merge: leave the final merge unnamed (the others are used by name)")
        for d in order:
            job = self.plan_doc(d, final=d is finals[0])
            if job.name is not None:
                self.named[job.name] = len(self.jobs)
            self.jobs.append(job)
        return self.jobs

    def _order(self, docs, names):
        state, order = {}, []

        def visit(d, chain):
            key = id(d)
            if state.get(key) == "done":
                return
            if state.get(key) == "busy":
                raise d.error("merges use each other in a cycle: " + " -> ".join(chain + [d.data.get("name")]))
            state[key] = "busy"
            for r in _references(d, names):
                if r != d.data.get("name"):
                    visit(names[r], chain + [d.data.get("name") or "final"])
            state[key] = "done"
            order.append(d)

        for d in docs:
            visit(d, [])
        return order


def _check_body(doc, root, body) -> None:
    """A module's mapping (or the document) gives ``models`` or ``slices``, one of them, not empty."""
    has_models, has_slices = bool(body.get("models")), bool(body.get("slices"))
    if not has_models and not has_slices:
        if "models" in body or "slices" in body:
            key = "models" if "models" in body else "slices"
            raise doc.error(f"'{key}' is empty: list the models to merge", *root, key)
        raise doc.error("'models' is missing (the models to merge; or 'slices' for layer ranges)", *root)
    if has_models and has_slices:
        raise doc.error("give 'models' (whole models) or 'slices' (layer ranges), not both", *root, "slices")


def _references(doc, names) -> set:
    refs = set()
    data = doc.data

    def add(v):
        if isinstance(v, str) and v in names:
            refs.add(v)

    def items(v):
        return v if isinstance(v, list) else []

    add(data.get("base_model"))
    modules = data.get("modules")
    for body in [data, *(modules.values() if isinstance(modules, dict) else ())]:
        if not isinstance(body, dict):
            continue
        for m in items(body.get("models")):
            add(m.get("model") if isinstance(m, dict) else m)
        for sl in items(body.get("slices")):
            if isinstance(sl, dict):
                add(sl.get("base_model"))
                for s in items(sl.get("sources")):
                    if isinstance(s, dict):
                        add(s.get("model"))
    return refs
