"""``--data FILE`` loaders: ``.npz`` images, ``.jsonl`` labelled texts, ``.txt`` causal-LM lines.

* ``.npz``: arrays ``pixel_values`` (N, C, H, W) floating and ``labels`` (N,) integer — image classification;
* ``.jsonl``: one JSON object per line with ``text`` (a non-empty string) and ``label`` (an int class id) —
  sequence classification, tokenized with the model folder's tokenizer;
* ``.txt``: one text per non-empty line — causal-LM loss (next-token cross-entropy).

Text files are UTF-8 (a leading BOM is dropped); a text longer than the model reads is cut to its first
``max_tokens`` tokens, and the cut is counted (``Data.truncated``, a note on stderr, the reports' fields).

Unlabeled data (``load_data(..., labels=False)``: alignment statistics, REPAIR): ``.npz`` needs only
``pixel_values`` and ``.jsonl`` only ``text``; labels, where present, are ignored (``Batch.labels`` is
None), and any model taking the inputs is accepted (no classification or LM head needed).

Everything is validated against the model that will consume it (labels < ``num_labels``, channel
count and image size, token ids < ``vocab_size``, the right kind of head); problems raise one
:class:`SymmergeError`. Batches are built once and kept on the CPU.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from ..errors import SymmergeError, UsageError
from .hf import quiet_transformers

FORMATS = {".npz": "image", ".jsonl": "text", ".txt": "lm"}
RAW_PIXELS = 10  # pixels all >= 0 with one above this are taken for unscaled 0-255 values (a note, not a refusal)


@dataclass
class Batch:
    inputs: dict  # keyword arguments of the model's forward
    labels: torch.Tensor | None  # (B,) class ids, or (B, T) token ids with -100 where ignored (lm); None: unlabeled
    mask: torch.Tensor | None = None  # (B, T) bool: real (non-padding) tokens; None for images

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch({k: move(v) for k, v in self.inputs.items()}, move(self.labels), move(self.mask))

    @property
    def size(self) -> int:
        """Examples in the batch."""
        return len(next(iter(self.inputs.values())))


@dataclass
class Data:
    path: str
    format: str  # "image" | "text" | "lm"
    batches: list = field(default_factory=list)
    n: int = 0  # examples (images, texts or lines)
    labeled: bool = True  # False: loaded with ``labels=False`` (inputs only)
    total: int | None = None  # examples in the file when fewer (``n``) were kept: cut by ``limit``
    limit: str | None = None  # what cut it (``--max-examples``, ``--align-samples``), when ``total`` is set
    truncated: int = 0  # texts longer than ``max_tokens``, cut to their first ``max_tokens`` tokens
    max_tokens: int | None = None  # the tokens a text was cut to (texts: ``--max-length``, the model's positions)
    lines: list | None = None  # each example's line in the file (.jsonl), which messages name

    @property
    def cut(self) -> bool:
        """Whether only the first ``n`` of the file's ``total`` examples were read."""
        return self.total is not None and self.total > self.n

    def cut_info(self) -> dict:
        """The report fields of a cut (``{}`` when the whole file was read, no text cut): ``examples_in_file``,
        ``cut_by`` (examples left out); ``texts_truncated``, ``max_tokens`` (texts cut short)."""
        info = {"examples_in_file": self.total, "cut_by": self.limit or "max_examples"} if self.cut else {}
        return {**info, "texts_truncated": self.truncated, "max_tokens": self.max_tokens} if self.truncated else info

    def truncation_note(self) -> str | None:
        """One sentence saying how many texts were cut short, or None."""
        if not self.truncated:
            return None
        one = self.truncated == 1
        return (f"{self.path}: {self.truncated} of its {self.n} texts {'is' if one else 'are'} longer than "
                f"{self.max_tokens} tokens and {'was' if one else 'were'} cut to {'its' if one else 'their'} first "
                f"{self.max_tokens} (the least of max_length: merge's --max-length or --learn-max-length, default "
                "512; the model's max_position_embeddings and the tokenizer's model_max_length)")

    def cut_note(self) -> str | None:
        """One sentence saying what was cut, or None."""
        if not self.cut:
            return None
        by = f" ({self.limit} {self.n})" if self.limit else ""
        return f"{self.path}: only the first {self.n} of its {self.total} examples were read{by}"

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


# ---------------------------------------------------------------- model checks


def head_kind(model) -> str:
    """'classification', 'lm' or 'none' from the model class (transformers naming)."""
    name = type(model).__name__
    if name.endswith(("ForSequenceClassification", "ForImageClassification")):
        return "classification"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "lm"
    if name.endswith("ForConditionalGeneration") and getattr(model.config, "is_encoder_decoder", False):
        return "lm"  # a sequence-to-sequence LM (T5): lm data is scored as reconstruction (see predictions)
    return "none"


def _need_classifier(model, path: str) -> int:
    if head_kind(model) != "classification":
        raise SymmergeError(f"{path}: labelled data needs a classification model, got {type(model).__name__}")
    n = int(model.config.num_labels)
    if n < 2:
        raise SymmergeError(f"{path}: the model has num_labels={n} (a regression head); cross-entropy needs >= 2")
    return n


def _check_labels(labels: np.ndarray, num_labels: int, path: str, lines: list | None = None) -> None:
    bad = np.flatnonzero((labels < 0) | (labels >= num_labels))
    if bad.size:
        i = int(bad[0])
        where = f"{path}:{lines[i]}: label {labels[i]}" if lines else f"{path}: label {labels[i]} of example {i}"
        raise SymmergeError(f"{where} is out of range for a model with num_labels={num_labels} (labels must be "
                            f"0..{num_labels - 1})")


def takes_images(model) -> bool:
    cfg = model.config
    return hasattr(cfg, "image_size") and hasattr(cfg, "num_channels") and not hasattr(cfg, "vocab_size")


def check_modality(fmt: str, model, path) -> None:
    """Images for an image model, text for a text model: checked before anything is read or tokenized."""
    kind = {"image": "image data (.npz)", "text": "text data (.jsonl)", "lm": "text data (.txt)"}[fmt]
    if hasattr(model.config, "text_config") and hasattr(model.config, "vision_config"):
        raise SymmergeError(f"{path}: a {model.config.model_type} model takes text and images together, and the data "
                            "formats hold one of them; align it on the weights (--match weights) and merge it "
                            "without --data")
    if fmt == "image" and not takes_images(model):
        raise SymmergeError(f"{path}: {kind} but the model ({model.config.model_type}) takes text; give it .jsonl "
                            "(text, label) or .txt (causal-LM lines)")
    if fmt != "image" and takes_images(model):
        raise SymmergeError(f"{path}: {kind} but the model ({model.config.model_type}) takes images; give it .npz "
                            "with pixel_values (N, C, H, W) and labels (N,)")


def _check_pixels(path, shape: tuple, channels: int, size: tuple) -> None:
    """``shape`` = (N, C, H, W) of the model's channels and size, else a message naming the layout expected."""
    expected = f"(N, {channels}, {size[0]}, {size[1]})"
    if len(shape) == 3 and tuple(shape[1:]) == tuple(size):
        raise SymmergeError(f"{path}: pixel_values must be (N, C, H, W) = {expected}; got {shape}, with no channel "
                            "axis — add it with x[:, None]")
    if len(shape) != 4:
        raise SymmergeError(f"{path}: pixel_values must be (N, C, H, W) = {expected}; got {shape}")
    if shape[1] != channels and shape[3] == channels and tuple(shape[1:3]) == tuple(size):
        raise SymmergeError(f"{path}: pixel_values must be (N, C, H, W) = {expected}; got {shape}, which looks like "
                            "NHWC — transpose with x.transpose(0, 3, 1, 2)")
    if shape[1] != channels:
        raise SymmergeError(f"{path}: pixel_values must be (N, C, H, W) = {expected}; got {shape}: {shape[1]} "
                            f"channels, the model expects {channels}")
    if tuple(shape[2:]) != tuple(size):
        raise SymmergeError(f"{path}: images are {shape[2]}x{shape[3]}, the model expects {size[0]}x{size[1]} "
                            f"(pixel_values must be {expected})")


def check_data(data: Data, model, labels: np.ndarray | None = None, use_labels: bool = True) -> None:
    """Validate ``data`` against ``model`` (called by :func:`load_data`; call again for other models).
    ``use_labels=False`` (or unlabeled data): only the inputs are checked (any model taking them)."""
    cfg = model.config
    use_labels = use_labels and data.labeled
    check_modality(data.format, model, data.path)
    if data.format == "image":
        n_labels = _need_classifier(model, data.path) if use_labels else 0
        size = cfg.image_size if isinstance(cfg.image_size, (list, tuple)) else (cfg.image_size, cfg.image_size)
        first = data.batches[0].inputs["pixel_values"]
        _check_pixels(data.path, (data.n,) + tuple(first.shape[1:]), cfg.num_channels, size)
    else:
        if data.format == "text":
            n_labels = _need_classifier(model, data.path) if use_labels else 0
        elif use_labels and head_kind(model) != "lm" and not getattr(cfg, "is_decoder", False):
            raise SymmergeError(f"{data.path}: .txt data (causal-LM loss) needs a causal language model, "
                                f"got {type(model).__name__}")
        if not data.batches or any(b.inputs["input_ids"].numel() == 0 for b in data.batches):
            raise SymmergeError(f"{data.path}: the tokenizer turned the text into no tokens: no usable tokenizer "
                                "(tokenizer.json or vocabulary files) in the model folder")
        top = max(int(b.inputs["input_ids"].max()) for b in data.batches)
        if top >= cfg.vocab_size:
            raise SymmergeError(f"{data.path}: token id {top} >= the model's vocab_size {cfg.vocab_size} "
                                "(tokenizer does not match the model)")
    if use_labels and data.format in ("image", "text"):
        labels = torch.cat([b.labels for b in data.batches]).numpy()
        _check_labels(labels, n_labels, data.path, data.lines)


# ---------------------------------------------------------------- readers


def _read_npz(path: Path, batch_size: int, max_examples, labels: bool = True, labels_for: str = ""):
    import zipfile

    if not zipfile.is_zipfile(path):  # numpy would read it as a pickle and speak of pickled data
        raise SymmergeError(f"{path}: not an .npz file (an .npz is a zip archive of arrays: write it with numpy.savez)")
    key = None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {}
            for key in z.files:
                arrays[key] = z[key]
    except ValueError as e:
        if key is not None and "allow_pickle" in str(e):
            store = "np.asarray(labels, dtype=np.int64)" if key == "labels" else "np.stack(images).astype(np.float32)"
            raise SymmergeError(f"{path}: array {key!r} holds pickled Python objects (dtype object), which are never "
                                f"loaded (unpickling can run code); store numbers, e.g. {store}") from None
        raise SymmergeError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None
    except Exception as e:
        raise SymmergeError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None
    for key in ("pixel_values", "labels") if labels else ("pixel_values",):
        if key not in arrays:
            why = f": labels are read by {labels_for}" if key == "labels" and labels_for else ""
            raise SymmergeError(f"{path}: missing array {key!r} (found {', '.join(arrays) or 'none'}){why}")
    x = arrays["pixel_values"]
    y = arrays["labels"] if labels else np.zeros(len(x), dtype=np.int64)
    if x.ndim not in (3, 4):
        raise SymmergeError(f"{path}: pixel_values must be (N, C, H, W), got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise SymmergeError(f"{path}: pixel_values must be floating point (float32) as the model reads them, got "
                            f"{x.dtype}; scale them as its image processor does (for 0-255 pixels: x / 255, then its "
                            "mean and std, e.g. (x / 255 - 0.5) / 0.5 for ViT)")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        fix = ("; flatten them with labels.reshape(-1)" if y.ndim == 2 and y.shape[1:] == (1,) else
               "; store them with labels.astype(np.int64)" if np.issubdtype(y.dtype, np.floating) and y.ndim == 1
               and np.isfinite(y).all() and (y == np.round(y)).all() else "")
        raise SymmergeError(f"{path}: labels must be a 1-D integer array (N,) of class ids, got shape {y.shape} "
                            f"dtype {y.dtype}{fix}")
    if len(x) != len(y):
        raise SymmergeError(f"{path}: {len(x)} images but {len(y)} labels")
    if len(x) == 0:
        raise SymmergeError(f"{path}: no examples")
    if not np.isfinite(x).all():
        raise SymmergeError(f"{path}: pixel_values hold NaN or Inf")
    low, high = float(x.min()), float(x.max())
    if low >= 0 and high > RAW_PIXELS:
        print(f"note: {path}: pixel_values run from {low:g} to {high:g}, raw 0-255 pixels by the look of them; the "
              "model reads them as they are, so unless it was trained on such values scale them as its image "
              "processor does (x / 255, then its mean and std)", file=sys.stderr)
    total = len(x)
    if max_examples:
        x, y = x[:max_examples], y[:max_examples]
    xt, yt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(y.astype(np.int64))
    batches = [Batch({"pixel_values": xt[i:i + batch_size]}, yt[i:i + batch_size] if labels else None)
               for i in range(0, len(xt), batch_size)]
    return batches, len(xt), total


def _read_jsonl(path: Path, max_examples, labels: bool = True, labels_for: str = ""):
    """(texts, labels, examples in the file, each text's line): past ``max_examples`` the lines are only counted."""
    texts, ys, total, where = [], [], 0, []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decoded(raw[len(BOM):] if lineno == 1 and raw.startswith(BOM) else raw, path, lineno)
            if not line.strip():
                continue
            total += 1
            if max_examples and len(texts) >= max_examples:
                continue  # counted, not parsed
            if line.lstrip().startswith("["):
                raise SymmergeError(f"{path}:{lineno}: a JSON array, not JSON Lines: a .jsonl holds one object per "
                                    'line, {"text": "...", "label": 0}; write each row with json.dumps(row) + "\\n"')
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SymmergeError(f"{path}:{lineno}: not valid JSON ({e}); a .jsonl holds one JSON object per line"
                                    ) from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise SymmergeError(f"{path}:{lineno}: expected an object with a string field 'text'")
            if not obj["text"].strip():
                raise SymmergeError(f"{path}:{lineno}: field 'text' is empty; give the text or drop the line")
            label = _label(obj, path, lineno, labels_for) if labels else 0
            texts.append(obj["text"])
            ys.append(label)
            where.append(lineno)
    if not texts:
        raise SymmergeError(f"{path}: no examples")
    return texts, ys, total, where


def _label(obj: dict, path: Path, lineno: int, labels_for: str = "") -> int:
    """The line's ``label``: a class id (an int, 0 or more), else one error naming the line (``labels_for``: what
    reads the labels)."""
    if "label" not in obj:
        why = f"labels are read by {labels_for}; " if labels_for else ""
        raise SymmergeError(f"{path}:{lineno}: no 'label' ({why}labelled data needs an integer class id on every "
                            "line; alignment data, --align-data, reads only 'text')")
    label = obj["label"]
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < 2 ** 63:
        return label
    names = " (map label names to the model's class ids: its config.json's label2id)" if isinstance(label, str) else ""
    raise SymmergeError(f"{path}:{lineno}: field 'label' must be a class id, a whole number 0, 1, ... below the "
                        f"model's num_labels, got {label!r}{names}")


BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows editors write first: dropped, as utf-8-sig does


def _decoded(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SymmergeError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                            "save the file as UTF-8") from None


def _read_txt(path: Path, max_examples):
    raw = path.read_bytes()
    try:
        lines = [ln.strip() for ln in raw.decode("utf-8-sig").splitlines()]
    except UnicodeDecodeError as e:
        start, end = raw.rfind(b"\n", 0, e.start) + 1, raw.find(b"\n", e.start)  # the line holding the bad byte
        _decoded(raw[start:end if end >= 0 else len(raw)], path, raw.count(b"\n", 0, e.start) + 1)
        raise SymmergeError(f"{path}: not UTF-8 text ({e})") from None
    lines = [ln for ln in lines if ln]
    if not lines:
        raise SymmergeError(f"{path}: no non-empty lines")
    return (lines[:max_examples] if max_examples else lines), len(lines)


def load_tokenizer(source):
    """A tokenizer object, or one loaded (offline) from a model folder."""
    if source is None:
        raise SymmergeError("text data needs a tokenizer: the model folder has none and none was given")
    if not isinstance(source, (str, Path)):
        return source
    from transformers.utils import logging as hf_logging

    from .hf import auto_tokenizer
    from .tokenizers import has_vocabulary

    if Path(source).is_dir() and not has_vocabulary(source) and not (Path(source) / "tokenizer_config.json").is_file():
        # transformers builds a tokenizer of the model type's class from config.json alone, knowing only its special
        # tokens: every word would be read as the unknown token, and the loss measured on nothing
        raise SymmergeError(f"{source}: no usable tokenizer in the model folder (no tokenizer.json, vocab file or "
                            "tokenizer_config.json); copy the tokenizer files of the model it was trained from into it")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return auto_tokenizer(source)
    except SymmergeError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise SymmergeError(f"{source}: no usable tokenizer in the model folder ({type(e).__name__}: {first}); copy "
                            "the tokenizer files of the model it was trained from (tokenizer.json, "
                            "tokenizer_config.json and the like) into it") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def _max_length(model, tokenizer, max_length) -> int:
    limits = [max_length or 512, getattr(model.config, "max_position_embeddings", None) if model is not None else None,
              getattr(tokenizer, "model_max_length", None)]
    return int(min(x for x in limits if isinstance(x, int) and x > 0))


def _class_pad(tokenizer, model, path) -> int:
    """The id labelled texts are padded with: the model's config ``pad_token_id`` where it has one (the id a decoder's
    classification head skips to find each text's last token, and RoBERTa counts positions by), else the
    tokenizer's; a tokenizer without a pad token (GPT-2, Llama) and a config without one is one error."""
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if isinstance(pad, int):
        return pad
    if tokenizer.pad_token is None:
        raise SymmergeError(f"{path}: the tokenizer has no pad token and the model's config no pad_token_id, so texts "
                            "of unequal lengths cannot be classified in one batch; set pad_token_id in the model's "
                            "config.json (the id it was fine-tuned with, often its eos_token_id)")
    return tokenizer.pad_token_id


def _tokenize(texts, tokenizer, batch_size, max_len, lm: bool) -> tuple[list, int]:
    """(batches, how many texts were longer than ``max_len`` tokens and cut)."""
    if tokenizer.pad_token is None:  # lm or unlabeled text: the mask, not the pad id, marks the padding (any token
        # pads, id 0's where there is no EOS or UNK; a fast tokenizer's pad token does not change how it splits)
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token or tokenizer.convert_ids_to_tokens(0)
    batches, truncated = [], 0
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=max_len, return_tensors="pt",
                        padding_side="right")  # a left pad would be scored (lm) and move absolute positions
        full = [texts[i + j] for j in (enc["attention_mask"].sum(1) == max_len).nonzero().flatten().tolist()]
        if full:  # at the limit: cut, or exactly that long (without transformers' warning of indexing errors)
            with quiet_transformers():
                truncated += sum(len(ids) > max_len for ids in tokenizer(full, truncation=False)["input_ids"])
        inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
        batches.append(Batch(inputs, inputs["input_ids"].masked_fill(~mask, -100) if lm else None, mask))
    return batches, truncated


def has_labels(path) -> bool:
    """Whether the data file ``path`` holds labels, read cheaply: a ``.npz``'s ``labels`` array, a ``.jsonl``'s
    first example's ``label`` (a ``.txt`` is its own labels: the next tokens); an unreadable file says True, and
    :func:`load_data` names what is wrong with it."""
    suffix = Path(str(path)).suffix
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as arrays:
                return "labels" in arrays.files
        if suffix == ".jsonl":
            with open(path, encoding="utf-8-sig") as f:
                first = next((line for line in f if line.strip()), None)
            return first is None or "label" in json.loads(first)
    except (OSError, ValueError, TypeError, AttributeError):
        return True
    return True


def check_data_path(path, flag: str | None = None) -> Path:
    """Fail early (before loading any model) on a missing file or an unknown format; ``flag``: the option that gave
    the path, named first in the refusal (``--data bogus: unknown data format ''; ...``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"data must be a data file's path (.npz, .jsonl or .txt) or a symmerge.io.data.Data, got "
                         f"{type(path).__name__}")
    path = Path(path)
    named = f"{flag} {path}" if flag else str(path)
    if path.is_dir():
        raise SymmergeError(f"{named}: is a directory, not a data file (.npz images, .jsonl text, "
                            ".txt causal-LM lines)")
    if path.suffix.lower() not in FORMATS:
        spelled = (" or generate[:N[:LEN[:SEED]]] (lower case) for sequences the models generate"
                   if flag == "--align-data" and str(path).lower().startswith("generate") else "")
        raise SymmergeError(f"{named}: unknown data format {path.suffix!r}; use .npz (images), .jsonl (text, label) "
                            f"or .txt (causal-LM lines){spelled}")
    if not path.is_file():
        there = path.exists()  # a FIFO, a device: never opened (a FIFO with no writer would block forever)
        raise SymmergeError(f"{named}: " + ("not a regular file (a FIFO, a device...): give a data file" if there
                                            else "data file not found"))
    return path


def load_data(path, model=None, tokenizer=None, batch_size: int = 32, max_length: int | None = None,
              max_examples: int | None = None, labels: bool = True, limit: str | None = "--max-examples",
              labels_for: str = "") -> Data:
    """Read ``path`` (format from its suffix), batch it, and validate it against ``model`` if given.

    ``tokenizer``: a tokenizer or a folder holding one (default: the model's own folder,
    ``model.name_or_path``); only text formats use it. ``labels=False``: inputs only (``.npz`` without
    ``labels``, ``.jsonl`` without ``label``; labels present are ignored; batches have ``labels=None``).
    ``max_examples``: only the first so many; when that cuts the file, the result says so (``total``,
    ``limit``, :meth:`Data.cut_info`) and a note naming ``limit`` (the option that set it) goes to stderr
    (``limit=None``: no note, the fields still set). ``labels_for``: what reads the labels, named when they are
    missing (e.g. ``--method fisher's statistics``).
    """
    path = check_data_path(path)
    fmt = FORMATS[path.suffix.lower()]
    if model is not None:
        check_modality(fmt, model, path)
    if batch_size < 1:
        raise SymmergeError(f"batch size must be >= 1, got {batch_size}")
    if max_examples is not None and max_examples < 1:
        raise SymmergeError(f"max_examples must be >= 1 (or None: every example), got {max_examples}")
    lines = None  # each example's line: .jsonl
    if fmt == "image":
        batches, n, total = _read_npz(path, batch_size, max_examples, labels, labels_for)
    else:
        if tokenizer is None and model is not None and getattr(model, "name_or_path", ""):
            tokenizer = model.name_or_path
        tok = load_tokenizer(tokenizer)
        max_len = _max_length(model, tok, max_length)
        if fmt == "text":
            texts, ys, total, lines = _read_jsonl(path, max_examples, labels, labels_for)
            if labels and model is not None:
                _need_classifier(model, path)  # the kind of model first (check_data's order), before its pad token
            pad = _class_pad(tok, model, path) if labels else None
            batches, truncated = _tokenize(texts, tok, batch_size, max_len, lm=False)
            for b in batches if pad is not None else ():
                b.inputs["input_ids"] = b.inputs["input_ids"].masked_fill(~b.mask, pad)
            y = torch.tensor(ys, dtype=torch.int64)
            for j, b in enumerate(batches):
                b.labels = y[j * batch_size:(j + 1) * batch_size] if labels else None
        else:
            texts, total = _read_txt(path, max_examples)
            batches, truncated = _tokenize(texts, tok, batch_size, max_len, lm=True)
            if not labels:
                for b in batches:
                    b.labels = None
        if not labels and model is not None and hasattr(model, "prepare_decoder_input_ids_from_labels") \
                and getattr(model.config, "is_encoder_decoder", False):
            for b in batches:  # an encoder-decoder (T5) reads unlabeled text as reconstruction, as predictions does:
                # the decoder fed the text shifted right (teacher forcing), so both stacks run
                b.inputs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(
                    labels=b.inputs["input_ids"].masked_fill(~b.mask, -100))
        n = len(texts)
    data = Data(str(path), fmt, batches, n, labeled=labels, total=total if total > n else None,
                limit=limit if total > n else None, **({} if fmt == "image" else
                                                       {"truncated": truncated, "max_tokens": max_len}),
                lines=lines)
    if model is not None:
        check_data(data, model)
    if data.cut and limit:
        print(f"note: {data.cut_note()}", file=sys.stderr)
    if data.truncated:
        print(f"note: {data.truncation_note()}", file=sys.stderr)
    return data


def take(data: Data, n: int, limit: str | None = None) -> Data:
    """The first ``n`` examples of ``data`` (``data`` itself when it has no more); the result records
    the cut (``total``: the file's examples; ``limit``: what cut it, default ``data``'s own)."""
    if data.n <= n:
        return data
    batches, left = [], n
    for b in data.batches:
        if left <= 0:
            break
        if b.size > left:
            cut = lambda t: None if t is None else t[:left]  # noqa: E731
            b = Batch({k: cut(v) for k, v in b.inputs.items()}, cut(b.labels), cut(b.mask))
        batches.append(b)
        left -= b.size
    return Data(data.path, data.format, batches, n, data.labeled, total=data.total or data.n,
                limit=limit if limit is not None else data.limit, truncated=data.truncated, max_tokens=data.max_tokens,
                lines=None if data.lines is None else data.lines[:n])


def rebatch(data: Data, size: int, max_length: int | None = None) -> Data:
    """``data`` in batches of ``size`` examples (the last one smaller), each sequence cut to its first
    ``max_length`` tokens when given: the batches that reading the file with ``batch_size=size`` and
    ``max_length`` gives (images exactly; texts re-padded, on the side the data is padded on, to the longest
    sequence of each new batch, the pads taking the values the data's pads have). ``data`` itself when it is
    already so batched. Labels and the cut record (``total``, ``limit``) are kept."""
    if size < 1:
        raise SymmergeError(f"batch size must be >= 1, got {size}")
    sizes = [b.size for b in data.batches]
    longest = max((b.mask.shape[1] for b in data.batches if b.mask is not None), default=0)
    if all(n == size for n in sizes[:-1]) and sizes[-1:] <= [size] and (max_length is None or longest <= max_length):
        return data
    rows, pads, side = _examples(data, max_length), _pad_values(data), "left" if _left_padded(data) else "right"
    batches = [_padded(rows[i:i + size], pads, side) for i in range(0, len(rows), size)]
    return Data(data.path, data.format, batches, data.n, data.labeled, total=data.total, limit=data.limit,
                truncated=data.truncated, max_tokens=data.max_tokens, lines=data.lines)


def _token_wise(b: Batch) -> list:
    """The inputs of ``b`` with a value per token (shaped like its mask); none for images."""
    return [k for k, v in b.inputs.items() if b.mask is not None and v.shape[:2] == b.mask.shape]


def _pad_values(data: Data) -> dict:
    """Each token-wise input's value at a padded position of ``data`` (0 where nothing is padded)."""
    pads = {}
    for b in data.batches:
        for k in _token_wise(b):
            if k not in pads or (pads[k] is None and (~b.mask).any()):
                pads[k] = b.inputs[k][~b.mask][0].item() if (~b.mask).any() else None
    return {k: 0 if v is None else v for k, v in pads.items()}


def _left_padded(data: Data) -> bool:
    """Whether the texts are padded on the left (every row's last position a real token, some first one not)."""
    masks = [b.mask for b in data.batches if b.mask is not None]
    return bool(masks) and all(m[:, -1].all() for m in masks) and any(not m[:, 0].all() for m in masks)


def _examples(data: Data, max_length: int | None) -> list:
    """Every example of ``data`` as ``(inputs, label)``: images as they are, texts as their real tokens (the
    first ``max_length`` of them when given)."""
    rows = []
    for b in data.batches:
        token_wise = _token_wise(b)
        for i in range(b.size):
            keep = None if b.mask is None else b.mask[i].nonzero().flatten()[:max_length]
            inputs = {k: (v[i, keep] if k in token_wise else v[i]) for k, v in b.inputs.items()}
            per_token = b.labels is not None and b.labels.dim() == 2 and keep is not None
            rows.append((inputs, None if b.labels is None else (b.labels[i, keep] if per_token else b.labels[i])))
    return rows


def _padded(rows: list, pads: dict, side: str) -> Batch:
    """One batch of ``rows`` (from :func:`_examples`); token-wise inputs padded on ``side`` with ``pads`` to the
    longest."""
    first, label = rows[0]
    stack = lambda ts: torch.stack(list(ts))  # noqa: E731
    if not pads:  # images
        return Batch({k: stack(r[0][k] for r in rows) for k in first}, None if label is None else stack(
            r[1] for r in rows), None)

    def pad(ts, value):
        return pad_sequence(list(ts), batch_first=True, padding_value=value, padding_side=side)

    inputs = {k: pad((r[0][k] for r in rows), pads[k]) if k in pads else stack(r[0][k] for r in rows) for k in first}
    mask = pad((torch.ones(len(r[0][next(iter(pads))]), dtype=torch.bool) for r in rows), False)
    labels = None if label is None else (pad((r[1] for r in rows), -100) if label.dim() == 1 else
                                         stack(r[1] for r in rows))
    return Batch(inputs, labels, mask)


# ---------------------------------------------------------------- predictions


def predictions(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (M, C), targets (M,)) over the batch's scored items: examples, or next tokens (lm). An
    encoder-decoder (T5) scores lm data as reconstruction: the text into the encoder, every token of it
    predicted by the decoder from the ones before (teacher forcing: ``labels`` shifted right inside)."""
    if batch.labels.dim() == 2 and getattr(model.config, "is_encoder_decoder", False):
        logits = model(**batch.inputs, labels=batch.labels).logits
        keep = batch.labels != -100
        return logits[keep], batch.labels[keep]
    logits = model(**batch.inputs).logits
    if batch.labels.dim() == 1:
        return logits, batch.labels
    logits, targets = logits[:, :-1], batch.labels[:, 1:]
    keep = targets != -100
    return logits[keep], targets[keep]
