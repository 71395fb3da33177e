"""Safetensors checkpoints read lazily and written shard by shard (streaming alignment's I/O).

:class:`LazyCheckpoint` knows every tensor's shard, shape and dtype from the safetensors headers and
reads only the tensors asked for, straight from their byte offsets (each header parsed once, when the
checkpoint is opened; no memory map, so pages touched once do not stay in the process). :class:`ShardWriter`
writes tensors as they come into shards of bounded size and finishes with the standard
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ..errors import SymmergeError
from . import direct, names_cache
from .hf import (DiskNames, attention_heads, disk_to_memory, disk_to_memory_names, hf_config,  # noqa: F401
                 model_class, quiet_transformers)
from .shapes import (check_complete, check_config_counts, check_dtypes, check_shapes, expected_tensors,
                     refuse_incomplete)
from .model import (SAFE_INDEX, SAFE_SINGLE, SAFETENSORS_DTYPES, check_finite, read_config,
                    safetensors_headers, weight_files)



def parse_size(value) -> int:
    """'500MB', '2GB', '1.5GiB' or a number of bytes → bytes; a number must be a whole one > 0 (the API's
    ``shard_size=-1`` wrote one tensor per shard, NaN stopped in ``int()``)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise SymmergeError(f"a size is a whole number of bytes or a text such as 500MB or 2GB, got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise SymmergeError(f"size must be positive, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise SymmergeError(f"a size is a whole number of bytes or a text such as 500MB or 2GB, got {value!r}")
    text = str(value).strip().upper().replace(" ", "")
    units = {"KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            text, mult = text[: -len(unit)], factor
            break
    else:
        mult = 1
    try:
        size = int(float(text) * mult)
    except (ValueError, OverflowError):  # 'nan', 'x'; 'inf', '1e400': no whole number of bytes
        raise SymmergeError(f"cannot read size {value!r}; use e.g. 500MB or 2GB") from None
    if size <= 0:
        raise SymmergeError(f"size must be positive, got {value!r}")
    return size


class LazyCheckpoint:
    """An HF safetensors folder whose tensors are read on demand, named as in the model's
    ``state_dict`` (``disk_name`` gives each tensor's name in the files)."""

    def __init__(self, folder, spec: bool = True, fused: bool = False):
        """``fused``: present the tensors transformers fuses in memory from several stored ones (a mixture
        of experts' ``mlp.experts.gate_up_proj`` from ``experts.{e}.gate_proj/up_proj``) as one virtual
        tensor each, under its in-memory name: read by stacking the stored tensors, written back split
        (:meth:`to_disk`) under the checkpoint's own names and layout."""
        self.folder = Path(folder)
        self.config = read_config(self.folder, spec=spec)
        files, safe = weight_files(self.folder)
        if not safe:  # pragma: no cover - weight_files refuses pickle without allow_pickle
            raise SymmergeError(f"{self.folder}: streaming needs safetensors weights")
        headers = safetensors_headers(files)  # each file's header read and checked once, used for all below
        self.files = files
        # config.json against the stored tensors before any model is built from it (a lying layer count)
        check_config_counts(self.folder, self.config, stored_shapes(headers))
        if not self.config.get("architectures"):
            from .architecture import infer_architecture

            self.config["architectures"] = [infer_architecture(self.config, files, str(self.folder))]
        self._hf_config = None

        def build() -> dict:
            cls = model_class(self.config)
            cfg = self.hf_config
            if fused:
                rename, ties, parts = disk_to_memory_names(self.config, cfg, fused=True)
            else:
                (rename, ties), parts = disk_to_memory_names(self.config, cfg), {}
            tensors = expected_tensors(self.config, cfg, rename.values())
            return {"rename": rename, "ties": ties, "parts": parts, "class": cls.__name__,
                    "prefix": getattr(cls, "base_model_prefix", "") or "", "heads": attention_heads(cfg),
                    "shapes": tensors.pop("shapes"), "tensors": tensors}

        # the names, ties, class and head counts: cached per transformers version and config (building the
        # weightless model that gives them imports transformers' modeling stack: most of a small merge's time)
        known = names_cache.facts(self.config, fused, build)
        rename, self.ties, fusions = known["rename"], known["ties"], known["parts"]
        self.class_name, self.base_model_prefix, self.heads = known["class"], known["prefix"], known["heads"]
        self.virtual: dict = {}  # in-memory name -> symmerge.io.fused.Fused, for the fused tensors read as one
        self.save_names: dict[str, str] = {}  # in-memory name -> the name save_pretrained writes
        for disk, key in rename.items():
            self.save_names.setdefault(key, disk)
        self.disk_name: dict[str, str] = {}
        self.file_of: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, torch.dtype] = {}
        aliases: list[tuple[str, str]] = []  # (alias, in-memory name of the stored tensor) from file metadata
        for f, header in headers.items():
            stored = set(header.tensors)
            for disk, (code, shape) in header.tensors.items():
                dtype = SAFETENSORS_DTYPES.get(code)
                if dtype is None:
                    raise SymmergeError(f"{f}: tensor {disk!r} has unsupported dtype {code}")
                key = rename.get(disk, disk)
                if key in self.file_of:
                    raise SymmergeError(f"{f}: tensor {disk!r} stored twice")
                self.disk_name[key] = disk
                self.file_of[key], self.shape[key], self.dtype[key] = f, shape, dtype
            _remember_offsets(f, header)
            # safetensors' save_model stores a shared tensor once and names the others in the metadata
            aliases += [(rename.get(name, name), rename.get(target, target))
                        for name, target in header.metadata.items()
                        if isinstance(target, str) and target in stored and name not in stored]
        for alias, key in aliases:
            if alias not in self.file_of:
                self._same_as(alias, key)
        stored_names = list(self.file_of)
        self._fold_ties()
        self._fuse(fusions)
        # the config's shapes, and every tensor accounted for: the one check of both paths (in memory,
        # load_model reads the headers through this class before transformers loads anything)
        check_shapes(self, known.get("shapes"))
        check_dtypes(self, known.get("shapes"), known.get("buffers"))
        check_complete(self, {"shapes": known.get("shapes"), **known.get("tensors", {})}, stored_names)

    def _fuse(self, fusions: dict) -> None:
        """Replace each complete set of stored tensors of a fused tensor by the fused tensor (at the place of
        its first stored tensor); a partial set is a truncated or mismatched checkpoint: refused."""
        where: dict[str, str] = {}
        for key, fz in fusions.items():
            names = [p.name for p in fz.parts]
            present = [n for n in names if n in self.file_of]
            if not present:
                continue  # stored fused (under the in-memory name), or absent: the spec's resolution says
            if key in self.file_of:
                raise SymmergeError(f"{self.folder}: {key!r} is stored both fused and as {present[0]!r}")
            if len(present) != len(names):  # the one error of a missing tensor, as when read unfused
                refuse_incomplete(self.folder, self.class_name, missing=[n for n in names if n not in self.file_of])
            for p in fz.parts:
                if self.shape[p.name] != p.shape:
                    raise SymmergeError(f"{self.folder}: tensor {p.name!r} is {self.shape[p.name]}, {p.shape} "
                                        f"expected (a part of {key!r} {fz.shape}): mismatched checkpoint")
            dtypes = {self.dtype[n] for n in names}
            if len(dtypes) != 1:
                raise SymmergeError(f"{self.folder}: the tensors of {key!r} have different dtypes "
                                    f"{sorted(map(str, dtypes))}")
            self.virtual[key] = fz
            where[names[0]] = key
        if not self.virtual:
            return
        parts = {p.name for fz in self.virtual.values() for p in fz.parts}
        self._part_files = {n: self.file_of[n] for n in parts}
        tables = (self.disk_name, self.file_of, self.shape, self.dtype)
        old = [dict(t) for t in tables]
        for t in tables:
            t.clear()
        for k in old[1]:
            if k in where:
                fz = self.virtual[where[k]]
                first, last = fz.parts[0].name, fz.parts[-1].name
                self.disk_name[fz.key] = f"{first} … {last} ({len(fz.parts)} tensors)"
                self.file_of[fz.key], self.shape[fz.key], self.dtype[fz.key] = old[1][k], fz.shape, old[3][k]
            elif k not in parts:
                for t, o in zip(tables, old):
                    t[k] = o[k]

    def to_disk(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(name on disk, tensor)]`` to write the in-memory tensor ``key`` as ``save_pretrained`` does (a
        fused tensor: its stored tensors, split again)."""
        if key in self.virtual:
            return self.virtual[key].split(tensor)
        return [(self.save_name(key), tensor)]

    def _part_file(self, name: str) -> Path:
        return self._part_files[name]

    def _read_virtual(self, key: str) -> torch.Tensor:
        fz = self.virtual[key]
        stored = {}
        for p in fz.parts:
            stored[p.name] = self._read_stored(self._part_file(p.name), p.name, self.dtype[key], p.shape)
            check_finite({p.name: stored[p.name]}, str(self.folder))
        out = fz.stack(stored, self.dtype[key])
        del stored
        return out

    def _same_as(self, key: str, stored: str) -> None:
        """``key`` reads the tensor stored as ``stored``."""
        self.disk_name[key], self.file_of[key] = self.disk_name[stored], self.file_of[stored]
        self.shape[key], self.dtype[key] = self.shape[stored], self.dtype[stored]

    def _fold_ties(self) -> None:
        """Each declared tie ``{alias: source}`` becomes the source alone, as ``save_pretrained`` writes it,
        however the checkpoint stored it: the source only, the alias only (read as the source), both
        (the source is kept; transformers ties the alias to it when loading), or one tensor named twice
        in the safetensors metadata."""
        for alias, source in self.ties.items():
            if alias not in self.file_of:
                continue
            if source not in self.file_of:
                self._same_as(source, alias)
            for table in (self.disk_name, self.file_of, self.shape, self.dtype):
                del table[alias]

    def save_name(self, key: str) -> str:
        """The name ``save_pretrained`` gives the in-memory tensor ``key`` on disk (output shards)."""
        return self.save_names.get(key, self.disk_name.get(key, key))

    def keys(self) -> list[str]:
        return list(self.file_of)

    def nbytes(self, key: str) -> int:
        n = 1
        for d in self.shape[key]:
            n *= d
        return n * self.dtype[key].itemsize

    @property
    def hf_config(self):
        """The transformers config object (knows aliases such as GPT-2's ``n_head``), built on first use."""
        if self._hf_config is None:
            try:
                with quiet_transformers():
                    self._hf_config = hf_config(self.config)
            except SymmergeError:
                raise
            except Exception as e:
                raise SymmergeError(f"transformers cannot read this {self.config.get('model_type')} config "
                                    f"({type(e).__name__}: {e})") from None
        return self._hf_config

    def room(self, key: str) -> int:
        """Bytes a buffer for :meth:`read_direct` of ``key`` should have: its bytes, plus
        :data:`~symmerge.io.direct.SLACK` where the file is read with ``O_DIRECT``."""
        n = self.nbytes(key)
        return n + direct.SLACK if n and direct.reads_directly(self.file_of[key]) else n

    def meta(self) -> dict[str, torch.Tensor]:
        """Shape-only stand-ins (``meta`` tensors) for resolving a spec without reading weights."""
        return {k: torch.empty(self.shape[k], dtype=self.dtype[k], device="meta") for k in self.file_of}

    def read(self, keys) -> dict[str, torch.Tensor]:
        """The named tensors (each read into a tensor of its own: no memory map outlives the call); NaN/Inf
        refused. Read as :meth:`read_direct` reads (the byte offsets known since the checkpoint was opened, each
        file's header parsed once); a fused tensor (``virtual``) is stacked from its stored tensors."""
        out = {}
        for k in keys:
            out[k] = self._read_virtual(k) if k in self.virtual else \
                self._read_stored(self.file_of[k], self.disk_name[k], self.dtype[k], self.shape[k])
        for k in keys:
            if k not in self.virtual:  # a fused tensor's parts were checked as they were read
                check_finite({self.disk_name[k]: out[k]}, str(self.folder))
        return out

    def map_direct(self, key: str, check: bool = True) -> torch.Tensor:
        """One tensor mapped from its file (private, read-only use: no copy; the file's cached pages are
        read in place, and count in the process's memory only while the tensor lives: one mapping per
        tensor, unmapped when it is freed); NaN/Inf refused with ``check``. Falls back to
        :meth:`read_direct` where the tensor's offset does not suit its dtype."""
        import mmap

        if key in self.virtual:
            return self._read_virtual(key)
        f, disk = self.file_of[key], self.disk_name[key]
        start, end = _offsets(f)[disk]
        dtype = self.dtype[key]
        if end == start or start % dtype.itemsize:
            return self.read_direct(key, check)
        first = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            with open(f, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), end - first, access=mmap.ACCESS_COPY, offset=first)
        except (OSError, ValueError) as e:
            raise SymmergeError(f"{f}: cannot read tensor {disk!r} ({e})") from None
        if hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_WILLNEED)
        out = torch.frombuffer(mapped, dtype=torch.uint8)[start - first:].view(dtype).view(self.shape[key])
        del mapped  # the tensor holds the mapping
        if check:
            check_finite({disk: out}, str(self.folder))
        return out

    def read_blocks(self, key: str, first: int, stride: int, width: int) -> torch.Tensor:
        """The flat entries [p, p + width) of one tensor for p = first, first + stride, … (the last block
        cut at the tensor's end), concatenated: one positioned read per block, nothing else of the file
        touched (a sample costs its own bytes, not a mapping of the tensor's pages)."""
        numel = math.prod(self.shape[key])
        if key in self.virtual:  # a fused tensor assembled from its parts
            return blocks_of(self._read_virtual(key), first, stride, width)
        f, disk = self.file_of[key], self.disk_name[key]
        start, end = _offsets(f)[disk]
        size = self.dtype[key].itemsize
        starts = range(first, numel, stride)
        out = torch.empty(sum(min(width, numel - p) for p in starts), dtype=self.dtype[key])
        view = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        at = 0
        try:
            with open(f, "rb", buffering=0) as handle:
                for p in starts:
                    count = min(width, numel - p) * size
                    if os.preadv(handle.fileno(), [view[at:at + count]], start + p * size) != count:
                        raise SymmergeError(f"{f}: tensor {disk!r} truncated")
                    at += count
        except OSError as e:
            raise SymmergeError(f"{f}: cannot read tensor {disk!r} ({e})") from None
        return out

    def read_direct(self, key: str, check: bool = True, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor read straight from its file into a fresh tensor (one copy, no memory map: the
        pages read do not count in the process's memory); NaN/Inf refused with ``check``. Threads may
        call it at once (each read opens its own file handle; the read releases the GIL). ``buffer``: a
        uint8 tensor of at least :meth:`nbytes` bytes to read into instead (reused memory: no page
        faults on fresh pages); the result is a view of it."""
        if key in self.virtual:
            return self._read_virtual(key)
        f, disk = self.file_of[key], self.disk_name[key]
        out = self._read_stored(f, disk, self.dtype[key], self.shape[key], buffer)
        if check:
            check_finite({disk: out}, str(self.folder))
        return out

    def _read_stored(self, f: Path, disk: str, dtype, shape, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The stored tensor ``disk`` of file ``f`` read at its byte offsets (:func:`_offsets`: known from the
        header read when the checkpoint was opened), into ``buffer`` where it is given and large enough (with
        ``O_DIRECT`` where the file is read so); a file cut short, or changed into one whose header no longer
        holds the tensor at its size, is one error line."""
        try:
            start, end = _offsets(f)[disk]
        except (OSError, ValueError, KeyError) as e:
            raise SymmergeError(f"{f}: cannot read tensor {disk!r}, truncated or corrupt file ({e!r})") from None
        if end - start != math.prod(shape) * dtype.itemsize:
            raise SymmergeError(f"{f}: tensor {disk!r} holds {end - start} bytes, not the {shape} {dtype} it held when "
                                "the checkpoint was opened (the file changed)")
        if buffer is not None and end > start and buffer.numel() >= end - start + direct.SLACK \
                and direct.reads_directly(f):
            try:
                at, got = direct.read_into(f, start, end, buffer)
            except OSError as e:
                raise SymmergeError(f"{f}: cannot read tensor {disk!r} ({e})") from None
            out = buffer[at:at + end - start].view(dtype).view(shape)
        else:
            if buffer is not None and buffer.numel() >= end - start:
                out = buffer[:end - start].view(dtype).view(shape)
            else:
                out = torch.empty(shape, dtype=dtype)
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
            try:
                with open(f, "rb", buffering=0) as handle:
                    if hasattr(os, "posix_fadvise"):  # a larger read-ahead window for this sequential read
                        os.posix_fadvise(handle.fileno(), start, end - start, os.POSIX_FADV_SEQUENTIAL)
                    handle.seek(start)
                    got = handle.readinto(view) if len(view) else 0
            except OSError as e:
                raise SymmergeError(f"{f}: cannot read tensor {disk!r} ({e})") from None
        if got != end - start:
            raise SymmergeError(f"{f}: tensor {disk!r} truncated ({got} of {end - start} bytes)")
        return out

    def layout(self, name: str):
        """The checkpoint's layout (from headers only) for :func:`symmerge.core.layout.check_layouts`."""
        from ..core.layout import Layout

        return Layout(name, self.config["model_type"], self.heads,
                      dict(self.shape), self.disk_name, self.class_name)


_OFFSETS: dict = {}


def blocks_of(tensor: torch.Tensor, first: int, stride: int, width: int) -> torch.Tensor:
    """The flat entries [p, p + width) of ``tensor`` for p = first, first + stride, … (the last block cut at
    the end), concatenated: what :meth:`LazyCheckpoint.read_blocks` reads from a file."""
    flat = tensor.reshape(-1)
    return torch.cat([flat[p:p + width] for p in range(first, flat.numel(), stride)] or [flat[:0]])


def stored_shapes(headers) -> dict[str, list[int]]:
    """{stored name: shape} of every tensor of the safetensors files' ``headers`` ({file:
    :class:`~symmerge.io.model.Header`}, :func:`~symmerge.io.model.safetensors_headers`)."""
    return {k: list(shape) for header in headers.values() for k, (_, shape) in header.tensors.items()}


def _remember_offsets(file: Path, header) -> None:
    """:func:`_offsets`' answer for ``file`` from its ``header`` as safetensors checked it (no second read): its
    tensors' bytes follow one another from the end of the header to the end of the file, in ``header.order``
    (safetensors refuses a gap, an overlap or a size other than the tensors'). Every dtype must be known. Nothing when
    the installed safetensors has no ``offset_keys`` (the first direct read then parses the header, as before)."""
    if header.order is None:
        return
    sizes = {k: math.prod(shape) * SAFETENSORS_DTYPES[code].itemsize for k, (code, shape) in header.tensors.items()}
    at = header.size - sum(sizes.values())
    table = {}
    for k in header.order:
        table[k] = (at, at + sizes[k])
        at += sizes[k]
    _OFFSETS[(str(file), header.size, header.mtime_ns)] = table  # a file changed since: _offsets reads it again


def _offsets(file: Path) -> dict[str, tuple[int, int]]:
    """{tensor name: (first byte, end byte) in the file} from a safetensors header (cached per file,
    size and modification time)."""
    st = os.stat(file)
    cache_key = (str(file), st.st_size, st.st_mtime_ns)
    if cache_key not in _OFFSETS:
        with open(file, "rb") as handle:
            n = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(n))
        base = 8 + n
        _OFFSETS[cache_key] = {name: (base + v["data_offsets"][0], base + v["data_offsets"][1])
                               for name, v in header.items() if name != "__metadata__"}
    return _OFFSETS[cache_key]


_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class PlannedWriter:
    """Safetensors shards written as the tensors come, never held: every tensor's name, dtype and shape
    are known in advance (``plan``, in the order :meth:`add` will be called), so each shard's header is
    written first and each tensor's bytes go straight to the file. Shards of at most ``max_bytes`` (a
    larger tensor gets one of its own), named as :class:`ShardWriter` names them, with the index when
    there are several. Files are written under temporary names in ``folder``; :meth:`close` renames them."""

    def __init__(self, folder, plan, max_bytes: int, metadata: dict | None = None):
        self.folder = Path(folder)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[list[tuple[str, torch.dtype, tuple]]] = []
        size = None
        for name, dtype, shape in plan:
            n = _numel(shape) * dtype.itemsize
            if size is None or (size + n > max_bytes and self.shards[-1]):
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, dtype, tuple(shape)))
            size += n
        self.order = [name for shard in self.shards for name, _, _ in shard]
        self.total_bytes = sum(_numel(shape) * dtype.itemsize for shard in self.shards for _, dtype, shape in shard)
        self._next, self._shard, self._handle, self._left = 0, -1, None, 0
        m = direct.mode()  # O_DIRECT for a large output (falls back to buffered where unsupported)
        self.direct = m == "on" or (m == "auto" and self.total_bytes >= direct.WRITE_MIN_BYTES)
        self.wrote_directly = False

    def _open_next(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self.wrote_directly |= self._handle.direct
        self._shard += 1
        header, offset = {"__metadata__": self.metadata}, 0  # first, as safetensors writes it
        for name, dtype, shape in self.shards[self._shard]:
            n = _numel(shape) * dtype.itemsize
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._handle = direct.Output(self.folder / f".shard-{self._shard:05d}.safetensors", self.direct)
        self._handle.write(len(text).to_bytes(8, "little") + text)
        self._left = len(self.shards[self._shard])

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor of the plan (its name, dtype and shape must be the planned ones)."""
        if self._next >= len(self.order) or self.order[self._next] != name:
            raise SymmergeError(f"internal error: tensor {name!r} written out of the planned order")
        if self._left == 0:
            self._open_next()
        _, dtype, shape = self.shards[self._shard][len(self.shards[self._shard]) - self._left]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise SymmergeError(f"internal error: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                                f"planned {dtype} {shape}")
        t = tensor.detach().contiguous()
        if t.numel():
            self._handle.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1
        self._left -= 1

    def close(self) -> list[str]:
        """Close the last shard, give the shards their final names, write the index; the file names."""
        if self._next != len(self.order):
            raise SymmergeError(f"internal error: {len(self.order) - self._next} planned tensors never written")
        if self._handle is not None:
            self._handle.close()
            self.wrote_directly |= self._handle.direct
            self._handle = None
        return _final_names(self.folder, [[name for name, _, _ in shard] for shard in self.shards],
                            self.total_bytes)

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _final_names(folder: Path, shards: list[list[str]], total_bytes: int) -> list[str]:
    """Rename ``.shard-i`` files to their final names (one: ``model.safetensors``; else numbered, with
    the index); returns the file names."""
    n = len(shards)
    if n == 1:
        os.replace(folder / ".shard-00000.safetensors", folder / SAFE_SINGLE)
        return [SAFE_SINGLE]
    names, weight_map = [], {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(folder / f".shard-{i:05d}.safetensors", folder / name)
        names.append(name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


class ShardWriter:
    """Write tensors into ``folder`` as ``model-XXXXX-of-YYYYY.safetensors`` shards of at most
    ``max_bytes`` (a larger single tensor gets a shard of its own) plus the index; a checkpoint
    that fits one shard is written as ``model.safetensors``. At most one shard is held in memory."""

    def __init__(self, folder, max_bytes: int, metadata: dict | None = None):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.make_room(size)
        self.pending[key] = tensor.detach().contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def make_room(self, nbytes: int) -> None:
        """Flush now if ``nbytes`` more would not fit the current shard (call before reading them, so
        the pending shard is not held alongside)."""
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        save_file(self.pending, str(self.folder / f".shard-{len(self.shards):05d}.safetensors"),
                  metadata=self.metadata)
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Flush, give the shards their final names, write the index; returns the file names."""
        self.flush()
        return _final_names(self.folder, self.shards, self.total_bytes)


def _task_class(model_type: str, image: bool) -> str:
    """The usual task class of a model type: image classification for image models, the causal LM for
    decoder-only families (no masked-LM class), sequence classification for the other encoders."""
    from transformers.models.auto import modeling_auto as auto

    if image:
        return auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES[model_type]
    causal, masked = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if model_type in causal and model_type not in masked:
        return causal[model_type]
    return auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[model_type]


def _stacks_class(model_type: str) -> str:
    from transformers.models.auto import modeling_auto as auto

    return auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(model_type) or auto.MODEL_MAPPING_NAMES[model_type]


def template_disk_names(spec) -> tuple[str, dict]:
    """(task class, ``{(member template, root): the template as stored on disk}``) for ``symmerge specs``:
    the spec's in-memory templates mapped through transformers' own conversion, applied to a weightless
    two-layer model of the family's first model type (``{i}`` kept where the layer index goes). A
    template whose tensor this small config lacks (an optional bias) is mapped like its module's other
    tensors, or shown as it is."""
    import transformers

    from ..core.resolve import find_prefix

    model_type = spec.model_types[0]
    # a family of several stacks: its generation model (T5) or its base model holding every stack (CLIPModel);
    # a type with no task class of its kind (CLIP's single towers): its base model
    try:
        task = _task_class(model_type, spec.inputs == "image") if not spec.stacks else _stacks_class(model_type)
    except KeyError:
        task = _stacks_class(model_type)
    with quiet_transformers():
        cfg = transformers.AutoConfig.for_model(model_type)
        cfg.num_hidden_layers, cfg.tie_word_embeddings = 2, False
        cls = getattr(transformers, task)
        with torch.device("meta"):
            model = cls(cfg)
        to_disk = {m: d for d, m in disk_to_memory(model).items()}
    prefix = find_prefix(spec, to_disk.keys())
    modules = {}
    for m, d in to_disk.items():  # module path in memory -> on disk, for tensors this config lacks
        if m.rsplit(".", 1)[-1] == d.rsplit(".", 1)[-1]:
            modules.setdefault(m.rsplit(".", 1)[0], d.rsplit(".", 1)[0])

    def disk(key: str) -> str:
        if key in to_disk:
            return to_disk[key]
        module, _, leaf = key.rpartition(".")
        return f"{modules[module]}.{leaf}" if module in modules else key

    names = {}
    members = [(m.name, m.root) for g in spec.groups for m in g.members]
    members += [(n, False) for g in spec.groups for n in g.param("pair_norms", ())]
    for template, root in members:
        full = template if root else prefix + template
        if "{i}" not in full:
            names[(template, root)] = disk(full)
            continue
        first, second = disk(full.format(i=0)).split("."), disk(full.format(i=1)).split(".")
        if len(first) != len(second):
            names[(template, root)] = full
            continue
        names[(template, root)] = ".".join("{i}" if a != b else a for a, b in zip(first, second))
    return task, names
