"""HF model folders in and out: validated loading, atomic writing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputReadError, OutputError, SymmergeError
from ..families import spec_for
from .output import (apply_umask, check_free_space, check_writable, claim_output, clean_stale, os_fault, output_fault,
                     refuse_output_in_inputs, release_output, temp_prefix)
from .hf import DiskNames, check_remote_code, model_class, quiet_transformers, remote_code_allowed  # noqa: F401
from .finite import check_finite  # noqa: F401 - read from here by the loaders, the streamed reader and moe

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SINGLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_NAMES = {SAFE_SINGLE, SAFE_INDEX, PICKLE_SINGLE, PICKLE_INDEX}


CONFIG_LIMIT = 16 << 20  # bytes of config.json read at most (ImageNet-21k's id2label: under 1 MiB)


def read_config(path: Path, spec: bool = True) -> dict:
    """The folder's config.json as a dict; with ``spec``, an unsupported ``model_type`` (no symmetry spec)
    fails here, before any weights are read (plain merges pass ``spec=False``)."""
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise SymmergeError(f"{path}: not a directory (expected a Hugging Face model folder)")
    if not cfg_file.is_file():
        if os.path.lexists(cfg_file):  # there, but no file: a FIFO, a device, a broken or looping link
            raise SymmergeError(f"{cfg_file}: {_not_a_file(cfg_file)}")
        if (path / "adapter_config.json").is_file():
            raise SymmergeError(f"{path}: a PEFT adapter folder (adapter_config.json), not a model: merge, run and "
                                "extract-lora take it with its base model as BASE+ADAPTER")
        raise SymmergeError(f"{path}: no config.json (expected a Hugging Face model folder){_hub_cache_hint(path)}")
    try:
        size = cfg_file.stat().st_size
        if size > CONFIG_LIMIT:  # read whole and parsed: a 300 MB file took 70 s before anything was refused
            raise SymmergeError(f"{cfg_file}: {size / 2**20:.0f} MiB, not a model's config (they are kilobytes; the "
                                f"largest read is {CONFIG_LIMIT // 2**20} MiB, e.g. 21k class names)")
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SymmergeError(f"{cfg_file}: not valid JSON ({e})") from None
    except OSError as e:
        raise InputReadError(f"{cfg_file}: cannot read ({e.strerror or e})") from None
    if not isinstance(config, dict):
        raise SymmergeError(f"{cfg_file}: not a JSON object (got a {type(config).__name__})")
    if "model_type" not in config:
        raise SymmergeError(f"{cfg_file}: no model_type")
    if not isinstance(config["model_type"], str):
        raise SymmergeError(f"{cfg_file}: model_type is a name, got {config['model_type']!r}")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise SymmergeError(f"{cfg_file}: architectures is a list of class names, got {archs!r}")
    check_remote_code(config, path)
    if spec:
        spec_for(config["model_type"])  # unsupported types fail here, before any weights are read
    _check_side_files(path)
    return config


def _check_side_files(path: Path) -> None:
    """A side file of the folder (:data:`SIDE_FILES`: outputs copy them) that is there but no regular file (a FIFO, a
    device, a broken link) fails when the config is read, before any work, rather than when an output is written
    (extract-lora, which copies none, refuses it too: such a folder is broken)."""
    for name in sorted(SIDE_FILES):
        item = path / name
        if os.path.lexists(item) and not item.is_file():
            raise SymmergeError(f"{item}: {_not_a_file(item)}; a side file of the model folder, which outputs copy "
                                "(remove it or make it a regular file)")


def _hub_cache_hint(path: Path) -> str:
    """For a Hugging Face cache's folder of one model (``models--org--name``, given instead of its snapshot): where
    the model folder is."""
    snapshots = path / "snapshots"
    if not snapshots.is_dir():
        return ""
    found = sorted(p.name for p in snapshots.iterdir() if (p / "config.json").is_file())
    where = snapshots / (found[0] if len(found) == 1 else "<revision>")
    return f"; {path.name} is a Hugging Face cache's folder: the model folder is {where}"


def _not_a_file(path: Path) -> str:
    """Why ``path``, which is there, is no regular file."""
    if path.is_symlink() and not path.exists():
        return f"a broken or looping symbolic link (to {os.readlink(path)})"
    return "not a regular file (a FIFO, a device...)"


def _weights_hint(path: Path) -> str:
    """A weight file of the expected name that is no regular file; weight files a folder holds under other names
    (``MODEL.SAFETENSORS``, ``weights.safetensors``): named."""
    special = [n for n in (SAFE_SINGLE, SAFE_INDEX) if os.path.lexists(path / n) and not (path / n).is_file()]
    if special:
        return f"; {special[0]} is {_not_a_file(path / special[0])}"
    try:
        found = sorted(p.name for p in path.iterdir()
                       if p.suffix.lower() in (".safetensors", ".bin") and p.name not in WEIGHT_NAMES)
    except OSError:
        return ""
    return (f"; found {', '.join(found[:3])}: the names are case-sensitive and fixed (model.safetensors, "
            "model-00001-of-00002.safetensors with model.safetensors.index.json)") if found else ""


class ShardIndexError(SymmergeError):
    """A shard index that is malformed or names files outside its folder: never read past, in any mode."""


def _shards(path: Path, index_name: str) -> list[Path]:
    """The shard files a shard index names, each confined to the model's folder: a name that is absolute,
    climbs out (``..``) or is not a plain string is refused (an index must not make symmerge read another
    folder's files). Symlinks inside the folder are followed (a hub cache's snapshots link to its blobs)."""
    try:
        index = json.loads((path / index_name).read_text())
        odd = next(((k, v) for k, v in index["weight_map"].items() if not isinstance(v, str)), None)
        if odd is not None:  # sorted() of mixed names said "'<' not supported between instances of 'str' and 'int'"
            raise ShardIndexError(f"{path / index_name}: weight_map[{odd[0]!r}] is {odd[1]!r}, not a shard file name")
        names = sorted(set(index["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ShardIndexError(f"{path / index_name}: malformed shard index ({e})") from None
    for name in names:
        parts = Path(name).parts if isinstance(name, str) else ()
        if not name or not isinstance(name, str) or os.path.isabs(name) or ".." in parts or "\\" in name:
            raise ShardIndexError(f"{path / index_name}: shard {name!r} lies outside the model's folder; a shard "
                                "index may only name files inside it")
    return [path / f for f in names]


def weight_files(path: Path, allow_pickle: bool = False) -> tuple[list[Path], bool]:
    """The checkpoint's weight files and whether they are safetensors; refuses pickle by default."""
    if (path / SAFE_SINGLE).is_file():
        files, safe = [path / SAFE_SINGLE], True
    elif (path / SAFE_INDEX).is_file():
        files, safe = _shards(path, SAFE_INDEX), True
    elif (path / PICKLE_SINGLE).is_file() or (path / PICKLE_INDEX).is_file():
        if not allow_pickle:
            raise SymmergeError(
                f"{path}: only pickle weights (pytorch_model.bin); refusing to unpickle untrusted files. "
                "Convert to safetensors, or pass --allow-pickle to load them with torch.load(weights_only=True)"
            )
        files = [path / PICKLE_SINGLE] if (path / PICKLE_SINGLE).is_file() else _shards(path, PICKLE_INDEX)
        safe = False
    else:
        raise SymmergeError(f"{path}: no weights (model.safetensors or a shard index){_weights_hint(path)}")
    for f in files:
        if not f.is_file():
            raise SymmergeError(f"{f}: weight shard missing")
    return files, safe


def check_safetensors(files: list[Path]) -> None:
    """Open each file's header: truncated or corrupt files fail here with one clear message."""
    safetensors_headers(files)


def safetensors_headers(files: list[Path]) -> dict:
    """{file: :class:`Header`} of the safetensors ``files``, each header read and checked once, by safetensors itself
    (``safe_open``: a truncated file, a bad header, overlapping or gapped offsets, a size that is not the tensors'):
    a failure is one clear message."""
    from safetensors import safe_open

    out = {}
    for f in files:
        try:
            st = os.stat(f)  # before the header is read: a file replaced meanwhile has another and is read again
            with safe_open(str(f), "pt") as handle:
                tensors = {}
                for name in handle.keys():
                    sl = handle.get_slice(name)
                    tensors[name] = (sl.get_dtype(), tuple(sl.get_shape()))
                order = list(handle.offset_keys()) if hasattr(handle, "offset_keys") else None  # older: none
                out[Path(f)] = Header(tensors, order, dict(handle.metadata() or {}), st.st_size, st.st_mtime_ns)
        except Exception as e:  # safetensors raises its own error type for every header problem
            raise SymmergeError(f"{f}: unreadable safetensors file, truncated or corrupt ({e})") from None
    return out


@dataclass(frozen=True)
class Header:
    """One safetensors file's header as safetensors read and checked it (:func:`safetensors_headers`)."""

    tensors: dict  # stored name -> (safetensors dtype code, shape), in safetensors' key order
    order: list | None  # the stored names in the order of their bytes in the file (None: this safetensors cannot say)
    metadata: dict
    size: int  # the file's bytes and modification time (ns) just before its header was read
    mtime_ns: int


def load_model(path, allow_pickle: bool = False, device: str = "cpu", spec: bool = True):
    """Load and validate an HF model folder; returns the model in eval mode. ``spec=False``: any model
    type transformers loads (plain merges), not only those with a symmetry spec. A tensor transformers reports
    missing (it would fill it at random) or unexpected (it would drop it) is refused; the commands load through
    :func:`symmerge.io.reader.load_model`, which first reads the headers through the streamed paths' reader."""
    path = Path(path)
    config = read_config(path, spec=spec)
    files, safe = weight_files(path, allow_pickle)
    dtype = "auto"
    if safe:
        dtype = stored_dtype(safetensors_headers(files)) or "auto"
        if not config.get("architectures"):
            from .architecture import infer_architecture

            config["architectures"] = [infer_architecture(config, files, str(path))]
    try:
        with quiet_transformers():
            model, info = model_class(config).from_pretrained(
                str(path), use_safetensors=safe, local_files_only=True, dtype=dtype, output_loading_info=True,
                trust_remote_code=remote_code_allowed(),
            )
    except SymmergeError:
        raise
    except Exception as e:
        raise SymmergeError(f"{path}: transformers could not load the model ({type(e).__name__}: {e})") from None
    check_loading_info(path, model, info)
    check_finite(model.state_dict(), str(path), DiskNames(model))
    return model.to(device).eval()


# safetensors dtype codes (a header's "dtype") and the torch dtypes they store; `PlannedWriter` writes the reverse
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def stored_dtype(headers: dict):
    """The one floating dtype every floating tensor of a checkpoint is stored in (``headers``:
    :func:`safetensors_headers`), else None. The model is loaded in it: config.json's ``dtype`` can be stale (a
    checkpoint converted to bfloat16 by a script that left ``float32`` there), and transformers' ``dtype="auto"``
    then casts every tensor to the config's dtype, so a merge in memory wrote float32 where the streamed merge,
    which reads the tensors as stored, wrote bfloat16."""
    found = {SAFETENSORS_DTYPES.get(code) for h in headers.values() for code, _ in h.tensors.values()}
    floating = {d for d in found if d is not None and d.is_floating_point}
    return floating.pop() if len(floating) == 1 else None


def written_dtype(text: str, dtypes) -> str:
    """config.json ``text`` naming the floating dtype its tensors are written in (``dtypes``: the output's): its
    ``dtype`` (and transformers 4's ``torch_dtype``) rewritten when every floating tensor is written in one dtype
    and the config names another (a stale config: the tensors were stored in bfloat16 under ``float32``), else
    ``text`` as it is."""
    floating = {d for d in dtypes if d.is_floating_point}
    if len(floating) != 1:
        return text
    name = str(floating.pop()).removeprefix("torch.")
    config = json.loads(text)
    keys = [k for k in ("dtype", "torch_dtype") if isinstance(config.get(k), str) and config[k] != name]
    if not keys:
        return text
    config.update({k: name for k in keys})
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def check_loading_info(path, model, info: dict) -> None:
    """What transformers itself says it filled at random or dropped while loading (a pickle checkpoint has no
    headers to read first), refused with the headers' one error (:func:`symmerge.io.shapes.refuse_incomplete`)."""
    from .shapes import refuse_incomplete

    names = DiskNames(model)
    missing = sorted(names.get(k, k) for k in info.get("missing_keys") or ())
    extra = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        k = mismatched[0][0] if isinstance(mismatched[0], tuple) else mismatched[0]
        raise SymmergeError(f"{path}: tensor {names.get(k, k)!r} does not have the shape its config.json "
                            f"({type(model).__name__}) gives it: a mismatched or corrupt checkpoint")
    refuse_incomplete(path, type(model).__name__, missing, extra)


def ensure_output_dir(out: Path, inputs=()) -> None:
    """``out`` is absent or an empty folder, not a link, not inside an input's folder (``inputs``:
    :func:`refuse_output_in_inputs`), and can be written (symmerge.io.output.check_writable), and this process
    claims it (symmerge.io.output.claim_output; released when the output is written or the command ends): every
    writing command calls this before any heavy work."""
    out = Path(out)
    refuse_output_in_inputs(out, inputs)
    if out.exists() and not out.is_symlink() and (not out.is_dir() or any(out.iterdir())):
        raise OutputError(f"{out}: output exists and is not an empty directory; refusing to overwrite")
    check_writable(out)
    claim_output(out)  # a second run writing the same folder fails now, not after its work


def check_room(out, models) -> None:
    """Free space for ``out``, before any work: about the weights of the smallest input folder (a merge or an
    alignment writes one model of the inputs' tensors; :func:`symmerge.io.output.check_free_space`)."""
    sizes = []
    for m in models:
        if isinstance(m, (str, Path)):
            try:
                sizes.append(sum(f.stat().st_size for f in weight_files(Path(m), allow_pickle=True)[0]))
            except (SymmergeError, OSError):
                pass
    if sizes:
        check_free_space(out, min(sizes))


_EXTRA: dict[str, dict[str, str]] = {}  # output path -> {file name: text} written into it by atomic_dir


@contextlib.contextmanager
def extra_files(out, files: dict):
    """Within the block, the folder :func:`atomic_dir` writes to ``out`` also holds ``files`` ({name: text}), written
    into its temporary folder before the rename: part of the output when it appears, never added to it afterwards
    (``run``'s copy of a config of symmerge's keys, which the command it runs knows nothing of)."""
    key = os.path.abspath(out)
    _EXTRA[key] = dict(files)
    try:
        yield
    finally:
        _EXTRA.pop(key, None)


@contextlib.contextmanager
def atomic_dir(out):
    """Yield a temp dir beside ``out`` (named so that a later run recognises it: symmerge.io.output); on
    success give everything in it the umask's permissions and rename it to ``out``, on failure (an error, a
    Ctrl-C, SIGTERM) remove it. Temporary folders of earlier runs whose process is gone are removed first. An
    operating-system failure (a full disk, a file-size limit, a permission...) is one
    :class:`~symmerge.errors.OutputError`. The claim on ``out`` ends with the block."""
    out = Path(out)
    try:
        ensure_output_dir(out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            claim_output(out)
            clean_stale(out)
            tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
        except OSError as e:
            raise output_fault(out, e) from None
        try:
            yield tmp
            for name, text in _EXTRA.get(os.path.abspath(out), {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
            apply_umask(tmp)
            if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
                out.rmdir()
            if out.exists():
                raise OutputError(f"{out}: the output appeared while this run was writing it (another program?); "
                                  "nothing was written")
            os.rename(tmp, out)
        except BaseException as e:
            _remove(tmp)
            fault = os_fault(e)
            if fault is not None and not isinstance(e, SymmergeError):
                raise output_fault(out, fault) from None
            raise
    finally:
        release_output(out)


def _remove(tmp: Path) -> None:
    """Remove a temporary folder, again if a writer thread still finishing added to it meanwhile."""
    for _ in range(20):
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            return
        time.sleep(0.05)


# Files an output folder takes over from its source model: what loading and using the model needs
# besides its weights and config (tokenizer, processors, generation settings, chat template, model card).
# Everything else (optimizer states, original/ checkpoints in other formats, another tool's reports...)
# would describe the unaligned model, and is left out.
SIDE_FILES = frozenset({
    # tokenizers
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "spm.model", "sentencepiece.bpe.model",
    "sentencepiece.model", "bpe.codes", "tokenizer.tiktoken",
    # processors
    "preprocessor_config.json", "image_processor_config.json", "processor_config.json",
    "feature_extractor_config.json", "video_preprocessor_config.json",
    # generation, chat template
    "generation_config.json", "chat_template.jinja", "chat_template.json",
})
GENERATION_CONFIG = "generation_config.json"
# The input's model card describes the input: the output gets its own (symmerge.io.card), never a copy.
REPLACED = frozenset({"README.md"})
SIDE_FOLDERS = frozenset({"additional_chat_templates"})  # transformers 5: extra named chat templates


def _names_code(folder: Path) -> bool:
    """Whether ``folder``'s config.json or tokenizer_config.json has an ``auto_map``: the output keeps it (config.json
    is the input's), so the folder's ``.py`` files come along, copied and never imported, and the output loads as its
    input did, with transformers' own class or, under ``trust_remote_code``, with that code."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            config = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("auto_map"):
            return True
    return False


def copy_side_files(src: Path, dst: Path, report: dict | None = None, merge_modules=None) -> dict:
    """Copy the allowed side files (:data:`SIDE_FILES`, :data:`SIDE_FOLDERS`) of ``src`` into ``dst``, and
    a sentence-transformers pipeline whole (:mod:`symmerge.io.sentence_transformers`; its module weights
    merged by ``merge_modules`` when ``report`` is a merge's; the ``.py`` files of a folder with an ``auto_map``,
    :func:`_names_code`); returns ``{"copied": [...], "left_out": [...]}``
    (folders with a trailing ``/``; the weights, config.json, a generation_config.json the output already has and the
    model card, README.md, are written anew, and in neither)."""
    from .cache import DIGESTS  # a cached folder's record of its weights (symmerge.io.cache): theirs, not a side file
    from .sentence_transformers import write_pipeline

    copied, left_out = write_pipeline(Path(dst), Path(src), report, merge_modules), []
    code = _names_code(Path(src))
    for item in sorted(Path(src).iterdir()):
        name = item.name
        if name in WEIGHT_NAMES or name in ("config.json", DIGESTS) or (item.is_file()
                                                                      and item.suffix == ".safetensors"):
            continue
        target = dst / name
        if name in REPLACED or target.exists():  # the output's own (generation_config.json, the pipeline)
            continue
        allowed = name in SIDE_FOLDERS if item.is_dir() else (name in SIDE_FILES or (code and item.suffix == ".py"))
        label = name + "/" if item.is_dir() else name
        if not allowed:
            left_out.append(label)
            continue
        if item.is_dir():
            shutil.copytree(item, target)
        else:
            shutil.copy2(item, target)
        copied.append(label)
    return {"copied": sorted(copied), "left_out": left_out}


def write_json(path: Path, obj) -> None:
    """``obj`` as strict JSON (a non-finite float as null); a report (``symmerge_report.json``, ``barrier.json``)
    gains, in place, the symmerge version and the command line that made it (:mod:`symmerge.io.provenance`)."""
    from .provenance import REPORT_FILES, finite, stamp

    if isinstance(obj, dict) and Path(path).name in REPORT_FILES:
        stamp(obj)
    path.write_text(json.dumps(finite(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


def save_model(model, out, src=None, report: dict | None = None, report_name: str = "symmerge_report.json",
               merge_modules=None, shard_size=None) -> Path:
    """Write ``model`` as an HF folder at ``out`` atomically, with the allowed side files of ``src``, a
    model card (README.md) and the report (which gains ``side_files``: what was copied and what was left
    out). ``shard_size`` (bytes: :func:`~symmerge.io.checkpoint.parse_size` reads ``2GB``): the largest weights file
    (a tensor larger than it is a file of its own), several files then indexed; None: transformers' own default."""
    from .card import write_card

    out = Path(out)
    shards = {} if shard_size is None else {"max_shard_size": int(shard_size)}
    with atomic_dir(out) as tmp:
        with quiet_transformers():
            model.save_pretrained(str(tmp), safe_serialization=True, **shards)
        if src is not None:
            # transformers wrote its own (derived from config.json, or its rewrite of the input's): the input's file is
            # copied as it is below, or none without one, as streamed
            (tmp / GENERATION_CONFIG).unlink(missing_ok=True)
            side = copy_side_files(Path(src), tmp, report, merge_modules)
            if report is not None:
                report["side_files"] = side
        write_card(tmp, report)  # README.md, the output's own model card (symmerge/io/card.py)
        if report is not None:
            write_json(tmp / report_name, report)
    return out
