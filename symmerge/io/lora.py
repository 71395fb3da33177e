"""LoRA inputs: ``BASE+ADAPTER`` (a model folder and a PEFT adapter folder, as mergekit writes them) resolved to
a model folder holding the base with the adapter merged in, exactly as PEFT's ``merge_and_unload`` merges it.

:func:`resolve_input` is the one resolver every command calls for a model it is given (``run``'s configs,
``merge``'s models and ``--base``, ``extract-lora``'s inputs): a spec without an adapter is returned as it is; a
``BASE+ADAPTER`` spec is merged into the LoRA merge cache (``--lora-merge-cache DIR``, as mergekit's: a merged model
is named after its inputs and reused by a later run; without one, a temporary folder removed when the process
ends), tensor by tensor — the base is never loaded whole: every tensor is read from its safetensors file, changed
if the adapter targets it, and written to the output's shards before the next is read — and atomically (a
merged folder in the cache is always complete).

What is applied, per target module, in the base tensor's dtype with PEFT's own arithmetic (the adapter's factors
in float32, one rounding to the base dtype; an embedding's delta rounded before it is added, as PEFT does):

* LoRA: ``W + s·B·A`` with ``s = lora_alpha / r`` (``use_rslora``: ``lora_alpha / √r``), ``r`` and
  ``lora_alpha`` per module from ``rank_pattern`` / ``alpha_pattern`` (PEFT's matching rule); linear layers,
  GPT-2's ``Conv1D`` (``fan_in_fan_out``, recognised by the weight's orientation) and embeddings
  (``lora_embedding_A/B``);
* DoRA (``use_dora``): ``m / ‖W + s·B·A‖ · (W + s·B·A)``, the norm per output row (per embedding dimension);
* ``lora_bias``: ``b + s·b_B``;
* tensors an adapter carries whole (``modules_to_save``, ``bias: all | lora_only``, an embedding layer saved
  with the adapter): they replace the base's.

Refused, in one line each: another PEFT method than LoRA, adapters whose base is not the given model
(``init_lora_weights`` PiSSA / OLoRA / CorDA / LoftQ ... not converted), ``layer_replication``,
``target_parameters``, ``trainable_token_indices``, activated LoRA, QALoRA, Megatron, convolution layers, an
adapter tensor that targets nothing in the base or whose shape does not fit.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SymmergeError
from .locks import try_lock
from .output import clean_stale_in
from .cache import DIGESTS, build_lock, damage, record_digests, remove_entry
from .provenance import remember

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."  # the prefix PEFT gives every tensor of an adapter of a transformers model
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}
# init_lora_weights values whose adapter expects a base changed at initialisation (unless converted, which
# resets the value to true)
_CHANGED_BASE = ("pissa", "olora", "corda", "loftq", "eva", "orthogonal", "lora_ga")
# config keys that must be empty or false for a plain LoRA merge: (key, what it is)
_REFUSED = (("layer_replication", "layer replication"), ("target_parameters", "LoRA on parameters (target_parameters)"),
            ("trainable_token_indices", "trainable tokens (trainable_token_indices)"),
            ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"), ("use_qalora", "QALoRA"),
            ("megatron_config", "Megatron layers"), ("arrow_config", "Arrow routing"), ("use_bdlora", "BD-LoRA"))


def split_spec(spec) -> tuple[str, str | None]:
    """``(model, adapter)`` of a model spec: ``BASE+ADAPTER`` as mergekit splits it (on the one ``+``), or
    ``(spec, None)`` for a spec without an adapter — and for an existing path that contains a ``+``."""
    text = str(spec)
    if "+" not in text or Path(text).expanduser().exists():
        return text, None
    parts = text.split("+")
    if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
        raise SymmergeError(f"{text!r}: a model with a LoRA adapter is written BASE+ADAPTER (one '+')")
    return parts[0].strip(), parts[1].strip()


def is_lora_spec(spec) -> bool:
    return split_spec(spec)[1] is not None


# -- the cache ------------------------------------------------------------------------------------------------

_cache: dict = {"dir": None, "temp": None, "dtype": None}


TEMP_PREFIX = "symmerge-lora-"  # + the process id + "-": the temporary merge cache of one process, removed at its exit
LIVE = ".symmerge-live.lock"  # in a temporary merge cache: locked (flock) by its process for as long as it runs
_live: list = []  # the descriptor holding this process's LIVE lock


def _temp_cache() -> Path:
    if _cache["temp"] is None:
        remove_stale_temp_caches()
        _cache["temp"] = _locked_temp_folder()
        atexit.register(shutil.rmtree, str(_cache["temp"]), True)
    return _cache["temp"]


def _locked_temp_folder(tries: int = 20) -> Path:
    """A new temporary merge cache holding its :data:`LIVE` file, locked by this process until it ends: made under a
    hidden name (``.symmerge-lora-PID-*``) and renamed once locked, so that no other process ever sees it unlocked
    under its own name. A kill before the rename leaves the hidden folder, which a later run's
    :func:`remove_stale_temp_caches` removes (its lock is free); a folder that run removed while this process was
    making it (before it was locked: a process it could not see, in another PID namespace) is made again."""
    for _ in range(tries):
        hidden = Path(tempfile.mkdtemp(prefix=f".{TEMP_PREFIX}{os.getpid()}-"))
        try:
            fd = os.open(hidden / LIVE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            continue  # removed by another process's clean-up before its lock file existed
        if try_lock(fd) is False:  # another process's clean-up holds it, removing the folder
            os.close(fd)
            continue
        # not taken on a file system without locks: the process id alone then says whether it runs
        folder = hidden.with_name(hidden.name[1:])
        try:
            os.rename(hidden, folder)
        except FileNotFoundError:
            os.close(fd)
            continue  # removed (with its lock file) before this process held the lock
        _live.append(fd)
        return folder
    raise SymmergeError(f"cannot make a temporary LoRA merge cache in {tempfile.gettempdir()}: each new folder was "
                        f"removed by another process before it was locked ({tries} tries)")


def remove_stale_temp_caches() -> list[Path]:
    """Remove the temporary merge caches of processes that are gone (killed before their exit removed them: each
    held whole merged models), the hidden ones too (killed while making one, before its rename:
    :func:`_locked_temp_folder`); those of running processes and of this one are left. Returns those removed.

    A cache whose :data:`LIVE` lock can be taken is a gone process's, whatever its id (which another process may
    have taken since, or which belongs to another PID namespace: a container sharing the temporary folder, another
    host on a shared file system), and is removed while that lock is held; one without the file (made by an earlier
    version, or a hidden one killed before its lock file) is judged by its id."""
    from .output import pid_alive

    removed = []
    root = Path(tempfile.gettempdir())
    for p in sorted([*root.glob(f"{TEMP_PREFIX}*-*"), *root.glob(f".{TEMP_PREFIX}*-*")]):
        pid = p.name.removeprefix(".")[len(TEMP_PREFIX):].split("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid() or not p.is_dir():
            continue
        with _held_if_released(p / LIVE) as gone:
            if gone is None:
                gone = not pid_alive(int(pid))
            if gone:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _lock_released(path: Path) -> bool | None:
    """Whether the :data:`LIVE` file ``path`` is locked by no process (its process is gone); None when there is no
    such file or it cannot be locked (an earlier version's folder, a file system without locks)."""
    with _held_if_released(path) as released:
        return released


@contextlib.contextmanager
def _held_if_released(path: Path):
    """:func:`_lock_released`'s answer, the lock held for the block when it was free (a process making its folder
    then cannot take it, and starts again)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # for writing: NFS emulates flock with write locks
    except OSError:
        yield None
        return
    try:
        yield try_lock(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def merge_cache(directory=None, dtype=None, inputs=(), out=None):
    """Within the block, :func:`resolve_input` merges adapters into ``directory`` (``--lora-merge-cache``) in
    ``dtype`` (``--lora-merge-dtype``); None leaves the enclosing block's setting (outside any: a temporary
    folder removed at exit, and the base's dtype). ``directory`` neither one of ``inputs`` nor inside one, nor
    the output ``out`` or inside it (:func:`refuse_cache_in_inputs`)."""
    old = dict(_cache)
    refuse_cache_in_inputs(directory, inputs, out)
    if directory is not None:
        _cache["dir"] = Path(directory).expanduser()
        if _cache["dir"].exists() and not _cache["dir"].is_dir():
            _cache["dir"] = old["dir"]
            raise SymmergeError(f"--lora-merge-cache {directory}: exists and is not a directory (the folder merged "
                                "BASE+ADAPTER models are kept in)")
    if dtype is not None:
        _cache["dtype"] = parse_dtype(dtype)
    try:
        yield
    finally:
        _cache["dir"], _cache["dtype"] = old["dir"], old["dtype"]


def refuse_cache_in_inputs(directory, inputs, out=None) -> None:
    """One error for a ``--lora-merge-cache`` that is the folder of one of ``inputs`` (model paths or
    ``BASE+ADAPTER`` specs) or lies inside one: the merged models written there would change an input; and for one
    that is the output ``out`` or lies inside it (the output, written in its place at the end, would be refused
    then, after the merges, as not empty)."""
    if directory is not None and out is not None:
        cache, target = Path(directory).expanduser().resolve(), Path(out).resolve()
        if cache == target or target in cache.parents:
            raise SymmergeError(f"--lora-merge-cache {directory}: inside the output folder {out}, which is written "
                                "whole in its place at the end: give a folder outside it")
    if directory is not None:
        from .output import refuse_output_in_inputs

        refuse_output_in_inputs(Path(directory).expanduser(), inputs, "--lora-merge-cache",
                                "the folder merged models are kept in", itself=True)


def parse_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().replace("torch.", "")
    if key not in DTYPES:
        raise SymmergeError(f"--lora-merge-dtype: one of float32, float16, bfloat16, got {dtype!r}")
    return DTYPES[key]


def resolve_input(spec, cache=None, dtype=None, merge: bool = True, allow_pickle: bool = False) -> str:
    """The model folder to read for ``spec``: ``spec`` itself, or for ``BASE+ADAPTER`` the folder of the base
    with the adapter merged in (``cache``: the folder merged models are kept in, default the current
    :func:`merge_cache`'s; ``dtype``: the merged tensors' dtype, default the current cache's, else the base's).
    ``merge=False``: the folders checked, nothing merged or written, and the base's folder returned (the merged
    folder has its tensors' names and shapes: a plan made on it refuses what the merged one's would).
    ``allow_pickle``: an adapter stored only as ``adapter_model.bin`` is read (``--allow-pickle``); refused otherwise,
    as a pickle checkpoint is."""
    model, adapter = split_spec(spec)
    if adapter is None:
        return str(spec)
    base, ad = Path(model).expanduser(), Path(adapter).expanduser()
    if not base.is_dir():
        raise SymmergeError(f"{spec}: the base model {model!r} is not a folder here")
    if not ad.is_dir():
        raise SymmergeError(f"{spec}: the LoRA adapter {adapter!r} is not a folder here")
    if not (base / "config.json").is_file():
        raise SymmergeError(f"{spec}: {model} has no config.json (expected a Hugging Face model folder)")
    adapter_weights(ad, allow_pickle)  # a pickle refused before anything is read or planned
    if not merge:
        return str(base)
    dtype = parse_dtype(dtype) or _cache["dtype"]
    directory = Path(cache).expanduser() if cache is not None else (_cache["dir"] or _temp_cache())
    out = directory / cache_name(base, ad, dtype)
    remember(out, spec)  # the reports name the input as written (symmerge.io.provenance)
    with build_lock(out):  # another process merging the same inputs: wait for it, then reuse its folder
        if (out / "config.json").is_file():  # merged by an earlier run (written atomically: complete)
            reason = damage(out)
            if reason is None:
                if not (out / DIGESTS).is_file():
                    record_digests(out)  # merged by an earlier version: checked from now on
                return str(out)
            print(f"note: {reason}; merging {spec} again", file=sys.stderr)
            remove_entry(out, "damaged merged model", "give --lora-merge-cache a writable folder")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            clean_stale_in(directory)  # every entry's temporary folder of a killed run, not only this entry's
            apply_adapter(base, ad, out, dtype=dtype, allow_pickle=allow_pickle)
        except OSError as e:
            raise SymmergeError(f"{out}: cannot write the merged model ({e})") from None
        record_digests(out)
    return str(out)


def cache_name(base: Path, adapter: Path, dtype=None) -> str:
    """The cached merge's folder name: the inputs' names and a digest of their absolute paths, the adapter
    files' sizes and modification times and the dtype (a changed adapter is merged again). Names too long for one
    folder name with the lock's suffix (two folders of 150 characters were 'file name too long') are cut to their
    first 80 bytes each (the digest keeps the full paths apart); a name that fits is the one earlier versions
    gave, so their cached merges are found again."""
    sig = [str(base.resolve()), str(adapter.resolve()), str(dtype)]
    for folder in (base, adapter):
        for f in sorted(folder.iterdir()):
            if f.is_file() and (f.suffix in (".safetensors", ".bin", ".json")):
                st = f.stat()
                sig.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    digest = hashlib.sha1("\n".join(sig).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    name = f"{base.name}+{adapter.name}-{digest}"
    if len(os.fsencode(name)) <= 200:
        return name
    return f"{_cut(base.name, 80)}+{_cut(adapter.name, 80)}-{digest}"


def _cut(name: str, size: int) -> str:
    """``name``'s first ``size`` bytes on the file system (a multi-byte character not split)."""
    return os.fsencode(name)[:size].decode("utf-8", "ignore")


# -- the adapter ----------------------------------------------------------------------------------------------

@dataclass
class Module:
    """What an adapter does to one module of the base (``name``: its path, e.g. ``model.layers.0.mlp.up_proj``)."""

    name: str
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    embedding: bool = False
    magnitude: torch.Tensor | None = None  # DoRA
    bias: torch.Tensor | None = None  # lora_B.bias (lora_bias)
    scaling: float = 1.0


@dataclass
class Adapter:
    folder: Path
    config: dict
    modules: dict = field(default_factory=dict)  # module name -> Module
    replace: dict = field(default_factory=dict)  # tensor name -> tensor carried whole

    @property
    def dora(self) -> bool:
        return bool(self.config.get("use_dora"))

    def variant(self) -> str:
        """The variant in words, for reports."""
        words = ["DoRA" if self.dora else "LoRA"]
        if self.config.get("use_rslora"):
            words.append("rsLoRA scaling")
        if self.config.get("rank_pattern") or self.config.get("alpha_pattern"):
            words.append("rank/alpha patterns")
        if self.config.get("lora_bias"):
            words.append("lora_bias")
        return ", ".join(words)


def pattern_key(patterns, name: str):
    """PEFT's rule for ``rank_pattern`` / ``alpha_pattern``: the first key that matches the end of the module's
    name at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def read_adapter(folder, allow_pickle: bool = False) -> Adapter:
    """The adapter in ``folder`` (``adapter_config.json`` and its weights), checked: one error for anything that
    is not a LoRA this module merges exactly (weights only in ``adapter_model.bin``: refused unless
    ``allow_pickle``)."""
    folder = Path(folder)
    cfg_file = folder / ADAPTER_CONFIG
    if not cfg_file.is_file():
        raise SymmergeError(f"{folder}: no {ADAPTER_CONFIG} (expected a PEFT adapter folder)")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SymmergeError(f"{cfg_file}: not valid JSON ({e})") from None
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise SymmergeError(f"{folder}: a {kind} adapter; symmerge applies LoRA adapters (and DoRA, rsLoRA) only")
    for key, what in _REFUSED:
        if config.get(key):
            raise SymmergeError(f"{folder}: {what} ({key}) is not supported; LoRA, DoRA, rsLoRA, rank/alpha patterns, "
                                "lora_bias and modules_to_save are")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_CHANGED_BASE):
        raise SymmergeError(f"{folder}: init_lora_weights={init!r} adapters apply to a base changed at initialisation; "
                            "convert the adapter to a plain LoRA first "
                            "(PEFT's path_initial_model_for_weight_conversion)")
    _check_numbers(cfg_file, config)
    tensors = _read_weights(folder, allow_pickle)
    ad = Adapter(folder, config)
    r0, alpha0 = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    parts: dict = {}
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        m = re.match(r"^(.*)\.(lora_A|lora_B)\.(weight|bias)$", name) or \
            re.match(r"^(.*)\.(lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(?:\.weight)?$", name)
        if m:
            mod, what = m.group(1), m.group(2)
            if what == "lora_B" and m.group(3) == "bias":
                what = "bias"
            elif what in ("lora_A", "lora_B") and m.group(3) == "bias":
                raise SymmergeError(f"{folder}: unexpected adapter tensor {key!r}")
            parts.setdefault(mod, {})[what] = t
        elif ".lora_" in name:
            raise SymmergeError(f"{folder}: adapter tensor {key!r} is of a LoRA variant symmerge does not apply")
        else:
            name = name.replace(".base_layer.", ".").replace(".modules_to_save.", ".")
            ad.replace[name] = t
    for mod, p in parts.items():
        untargeted = _untargeted(config, mod)
        if untargeted:
            raise SymmergeError(f"{folder}: module {mod!r} has LoRA weights, but {untargeted}: PEFT would not apply "
                                f"them there (the config and the weights disagree; fix {ADAPTER_CONFIG})")
        embedding = "lora_embedding_A" in p or "lora_embedding_B" in p
        A = p.get("lora_embedding_A" if embedding else "lora_A")
        B = p.get("lora_embedding_B" if embedding else "lora_B")
        if A is None or B is None:
            raise SymmergeError(f"{folder}: module {mod!r} has only one of its two LoRA factors")
        if A.dim() != 2 or B.dim() != 2:
            raise SymmergeError(f"{folder}: module {mod!r} is a convolution (LoRA factors of {A.dim()} dimensions); "
                                "symmerge applies LoRA to linear layers and embeddings")
        r = A.shape[0]
        if B.shape[1] != r:
            raise SymmergeError(f"{folder}: module {mod!r}: LoRA factors of ranks {r} and {B.shape[1]}")
        rk, ak = pattern_key(rank_pattern, mod), pattern_key(alpha_pattern, mod)
        rank = rank_pattern[rk] if rk is not None else r0
        alpha = alpha_pattern[ak] if ak is not None else alpha0
        if rank != r:
            raise SymmergeError(f"{folder}: module {mod!r} has rank {r} but the config says r={rank}")
        if ad.dora and "lora_magnitude_vector" not in p:
            raise SymmergeError(f"{folder}: use_dora is set but module {mod!r} has no lora_magnitude_vector")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        # lora_B.bias counts only with lora_bias, as PEFT loads it (mergekit-extract-lora writes it without the flag)
        bias = p.get("bias") if config.get("lora_bias") else None
        ad.modules[mod] = Module(mod, A, B, embedding, p.get("lora_magnitude_vector"), bias, scaling)
    if not ad.modules and not ad.replace:
        raise SymmergeError(f"{folder}: the adapter holds no tensors")
    return ad


def _number(value, whole: bool) -> bool:
    ok = isinstance(value, int) if whole else isinstance(value, (int, float))
    return ok and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_numbers(cfg_file: Path, config: dict) -> None:
    """One error naming the key when ``r``, ``lora_alpha`` or a rank/alpha pattern's value is not a positive (whole,
    for ranks) finite number (a string reached the scaling's division as a TypeError)."""
    for key, whole in (("r", True), ("lora_alpha", False)):
        if key in config and not _number(config[key], whole):
            raise SymmergeError(f"{cfg_file}: {key} must be a positive {'whole ' if whole else ''}number, got "
                                f"{config[key]!r}")
    for key, whole in (("rank_pattern", True), ("alpha_pattern", False)):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            raise SymmergeError(f"{cfg_file}: {key} must map module patterns to numbers, got {pattern!r}")
        for name, value in pattern.items():
            if not _number(value, whole):
                raise SymmergeError(f"{cfg_file}: {key}[{name!r}] must be a positive {'whole ' if whole else ''}"
                                    f"number, got {value!r}")


def _untargeted(config: dict, mod: str) -> str | None:
    """Why PEFT would not put a LoRA on module ``mod`` under ``config`` (None: it would): ``target_modules`` (a
    regular expression matching the whole name, or names the module's name ends with; ``all-linear``: any),
    ``exclude_modules`` and ``layers_to_transform`` (the layer index in the name, as PEFT reads it)."""
    def names(spec) -> bool:
        if isinstance(spec, str):
            return spec == "all-linear" or re.fullmatch(spec, mod) is not None
        return any(mod == x or mod.endswith("." + x) for x in spec or ())

    target, exclude = config.get("target_modules"), config.get("exclude_modules")
    if target is not None and not names(target):
        return f"target_modules ({target!r}) does not name it"
    if exclude and not (isinstance(exclude, str) and exclude == "all-linear") and names(exclude):
        return f"exclude_modules ({exclude!r}) names it"
    layers = config.get("layers_to_transform")
    if layers is not None:
        layers = [layers] if isinstance(layers, int) else list(layers)
        index = re.search(r"\.(\d+)\.", "." + mod + ".")
        if index is not None and int(index.group(1)) not in layers:
            return f"layers_to_transform ({layers}) leaves out its layer {int(index.group(1))}"
    return None


def adapter_weights(folder: Path, allow_pickle: bool = False) -> Path:
    """The adapter's weights file in ``folder``: its safetensors, else its pickle when ``allow_pickle`` (never
    unpickled without it: the same rule as a pickle checkpoint's); one error otherwise."""
    for name in ADAPTER_WEIGHTS:
        f = folder / name
        if not f.is_file():
            continue
        if f.suffix != ".safetensors" and not allow_pickle:
            raise SymmergeError(f"{f}: the adapter's weights are a pickle (loading one can run code), refused by "
                                "default: convert it to adapter_model.safetensors (PEFT's save_pretrained does by "
                                "default), or pass --allow-pickle to symmerge merge")
        return f
    raise SymmergeError(f"{folder}: no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")


def _read_weights(folder: Path, allow_pickle: bool = False) -> dict:
    f = adapter_weights(folder, allow_pickle)
    try:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(f))
        return torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:
        raise SymmergeError(f"{f}: cannot read the adapter's weights ({type(e).__name__}: {e})") from None


# -- merging --------------------------------------------------------------------------------------------------

def lora_delta(mod: Module, shape, conv1d=None) -> tuple[torch.Tensor, bool]:
    """``(s·B·A in float32, oriented as the weight of ``shape``; fan_in_fan_out)``: a ``Conv1D`` weight (in ×
    out) takes the product transposed. ``conv1d``: a callable answering for a square weight, whose shape
    cannot tell."""
    A, B = mod.A.float(), mod.B.float()
    if mod.embedding:  # lora_embedding_A: r x vocab, lora_embedding_B: dim x r
        delta = (B @ A).T * mod.scaling
        fifo = False
    else:
        prod = B @ A
        out_in = tuple(prod.shape)
        fifo = out_in != tuple(shape) and out_in[::-1] == tuple(shape)
        if out_in == tuple(shape) and out_in[0] == out_in[1] and conv1d is not None:
            fifo = bool(conv1d())
        delta = (prod.T if fifo else prod) * mod.scaling
    if tuple(delta.shape) != tuple(shape):
        raise SymmergeError(f"adapter module {mod.name!r}: its update is {tuple(delta.shape)}, the base's weight "
                            f"{tuple(shape)} (an adapter of another model?)")
    return delta, fifo


def merge_weight(weight: torch.Tensor, mod: Module, conv1d=None) -> torch.Tensor:
    """``weight`` (the base's, any dtype) with the module's LoRA / DoRA merged, as PEFT's ``merge`` computes it
    (its result in ``weight``'s dtype)."""
    delta, fifo = lora_delta(mod, weight.shape, conv1d)
    if mod.magnitude is not None:
        rows = weight.T if (fifo or mod.embedding) else weight
        d = delta.T if (fifo or mod.embedding) else delta
        norm = torch.linalg.norm(rows + d, dim=1)
        factor = mod.magnitude.float() / norm
        factor = factor.view(1, -1) if (fifo or mod.embedding) else factor.view(-1, 1)
        return (factor * (weight + delta)).to(weight.dtype)
    out = weight.clone()
    if mod.embedding:
        out += delta.to(weight.dtype)
    else:
        out += delta
    return out


def merge_bias(bias: torch.Tensor, mod: Module) -> torch.Tensor:
    out = bias.clone()
    out += mod.bias.float() * mod.scaling
    return out


def apply_adapter(base, adapter, out, dtype=None, progress: bool = True, allow_pickle: bool = False) -> dict:
    """Write ``base`` (an HF safetensors folder) with ``adapter`` merged into the new folder ``out``, one tensor at
    a time, atomically; returns what was done (also ``out/symmerge_lora.json``). ``allow_pickle``: see
    :func:`read_adapter`."""
    from ..progress import bar
    from .checkpoint import LazyCheckpoint, PlannedWriter
    from .model import atomic_dir, check_finite, copy_side_files, write_json

    base, adapter, out = Path(base), Path(adapter), Path(out)
    ad = read_adapter(adapter, allow_pickle)
    ck = LazyCheckpoint(base, spec=False)
    dtype = parse_dtype(dtype)
    keys = ck.keys()
    weights, biases, replace = _targets(ad, ck, base, adapter)
    kinds: dict = {}

    def conv1d_of(key: str):
        def ask() -> bool:  # a square weight: is its module GPT-2's Conv1D? (the class's modules, cached)
            if not kinds:
                kinds.update((n, k) for n, k, _, _ in module_kinds(ck)["modules"])
            return kinds.get(key.rsplit(".", 1)[0]) == "conv1d"
        return ask

    order = sorted(keys, key=lambda k: (str(ck.file_of[k]), k))
    plan = [(ck.disk_name[k], dtype or ck.dtype[k], ck.shape[k]) for k in order]
    floating = {k for k in order if ck.dtype[k].is_floating_point}
    plan = [(n, dt if k in floating else ck.dtype[k], s) for (n, dt, s), k in zip(plan, order)]
    changed = []
    with atomic_dir(out) as tmp:
        writer = PlannedWriter(tmp, plan, max_bytes=5 * 10 ** 9)
        try:
            for k in bar(order, desc=f"applying {adapter.name}", unit="tensor", enabled=progress):
                t = ck.read_direct(k)
                if dtype is not None and k in floating:
                    t = t.to(dtype)
                if k in replace:
                    t = replace[k].to(t.dtype)
                if k in weights:
                    t = merge_weight(t, weights[k], conv1d_of(k))
                if k in biases:
                    t = merge_bias(t, biases[k])
                if k in replace or k in weights or k in biases:
                    changed.append(k)
                    check_finite({k: t}, f"{base}+{adapter}")
                writer.add(ck.disk_name[k], t)
                del t
            writer.close()
        except BaseException:
            writer.abort()
            raise
        config = json.loads((base / "config.json").read_text())
        if dtype is not None:
            name = str(dtype).replace("torch.", "")
            for key in ("dtype", "torch_dtype"):
                if key in config or key == "dtype":
                    config[key] = name
        write_json(tmp / "config.json", config)
        copy_side_files(base, tmp)
        record = {"base": str(base), "adapter": str(adapter), "variant": ad.variant(),
                  "modules": len(ad.modules), "replaced": sorted(replace), "changed": len(changed),
                  "dtype": str(dtype).replace("torch.", "") if dtype is not None else "base"}
        write_json(tmp / "symmerge_lora.json", record)
    return record


def _targets(ad, ck, base: Path, adapter: Path) -> tuple[dict, dict, dict]:
    """(the base's tensors the adapter's modules change: {tensor: module} of the weights, of the biases; {tensor:
    value} of the tensors it replaces) of adapter ``ad`` on the checkpoint ``ck``, every shape checked before
    anything is written; an adapter tensor the base lacks is an error."""
    prefix = ck.base_model_prefix

    def target(name: str) -> str:
        """The base's tensor (in-memory name) for an adapter's tensor name, tied tensors to what they read."""
        for cand in (name, f"{prefix}.{name}" if prefix else None,
                     name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else None):
            if cand is None:
                continue
            if cand in ck.file_of:
                return cand
            if cand in ck.ties and ck.ties[cand] in ck.file_of:
                return ck.ties[cand]
        raise SymmergeError(f"{adapter}: the adapter changes {name!r}, which {base} does not have (an adapter of "
                            "another model?)")

    weights: dict = {}  # tensor -> Module (its .weight); biases: tensor -> Module
    biases: dict = {}
    for mod in ad.modules.values():
        weights[target(mod.name + ".weight")] = mod
        if mod.bias is not None:
            biases[target(mod.name + ".bias")] = mod
    replace = {target(k): v for k, v in ad.replace.items()}
    for k, v in replace.items():
        if tuple(v.shape) != tuple(ck.shape[k]):
            raise SymmergeError(f"{adapter}: the adapter's {k!r} is {tuple(v.shape)}, the base's {tuple(ck.shape[k])} "
                                "(resize the base's embeddings first?)")
    for k, mod in biases.items():
        if tuple(mod.bias.shape) != tuple(ck.shape[k]):
            raise SymmergeError(f"{adapter}: module {mod.name!r}: lora_B.bias is {tuple(mod.bias.shape)}, the base's "
                                f"bias {tuple(ck.shape[k])}")
    for k, mod in weights.items():
        lora_delta(mod, ck.shape[k], conv1d=lambda: True)  # shapes checked before anything is written
    return weights, biases, replace


def module_kinds(ck) -> dict:
    """``{"modules": [[name, kind, has weight, has bias], ...] in module order, "input": name, "output": name}`` of
    the checkpoint's class — kind ``embedding``, ``linear``, ``conv1d`` (GPT-2's, stored in x out) or ``other`` —
    and ``"loose": [[module, class, [parameters]], ...]`` the parameters of no ``weight``/``bias`` (fused MoE experts,
    CLIP's ``class_embedding``), from a weightless model, cached beside the tensor-name facts
    (:mod:`symmerge.io.names_cache`: building the model imports transformers' modeling code, most of a small
    extraction's time)."""
    from . import names_cache

    kept = f"modules-{names_cache._key(ck.config, False)}.json"
    entry = names_cache.read_entry(kept)
    if entry is not None and isinstance(entry.get("modules"), list) and isinstance(entry.get("loose"), list) \
            and all(isinstance(row, list) and len(row) == 4 for row in entry["modules"]):
        return entry
    from torch import nn

    from .hf import is_conv1d, linear_output_axis

    model = meta_model(ck)
    names = {id(m): n for n, m in model.named_modules()}
    emb_in, emb_out = _embeddings(model)
    rows, loose = [], []
    for name, module in model.named_modules():
        own = [p for p, _ in module.named_parameters(recurse=False) if p not in ("weight", "bias")]
        if own:  # fused MoE experts (gate_up_proj), CLIP's class_embedding, logit_scale: no module PEFT handles
            loose.append([name, type(module).__name__, own])
        w, b = getattr(module, "weight", None), getattr(module, "bias", None)
        if not name or not isinstance(w, torch.Tensor):
            continue
        kind = "embedding" if isinstance(module, nn.Embedding) else "conv1d" if is_conv1d(module) else \
            "linear" if linear_output_axis(module) is not None and w.dim() == 2 else "other"
        rows.append([name, kind, True, isinstance(b, torch.Tensor)])
    out = {"modules": rows, "input": names.get(id(emb_in)) if emb_in is not None else None,
           "output": names.get(id(emb_out)) if emb_out is not None else None, "loose": loose}
    names_cache.write_entry(kept, out)
    return out


def _embeddings(model) -> tuple:
    """The model's (input, output) embeddings, None for either its class does not name (CLIPModel names neither)."""
    found = []
    for getter in (model.get_input_embeddings, model.get_output_embeddings):
        try:
            found.append(getter())
        except NotImplementedError:
            found.append(None)
    return tuple(found)


def meta_model(ck):
    """A weightless (``meta``) model of the checkpoint's class: which module is what (linear, Conv1D, embedding)."""
    from .hf import hf_config, model_class, quiet_transformers

    with quiet_transformers(), torch.device("meta"):
        cls = model_class(ck.config)
        return cls(hf_config(ck.config))
