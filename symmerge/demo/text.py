"""A real English text corpus fetched from a package registry, cleaned to plain prose lines, split
reproducibly, and a small byte-level BPE tokenizer trained on its training split.

* :func:`python_docs_dir` — the reStructuredText sources of the Python 3.11 documentation (the
  ``_sources/**/*.rst.txt`` files of the Debian package ``python3.11-doc``, 497 documents, 11 MB;
  PSF License Version 2, the licence of Python's documentation). Used from
  ``/usr/share/doc/python3.11/html/_sources`` when the package is installed; otherwise the ``.deb``
  (12.6 MB) is fetched with ``apt-get download`` and unpacked with ``dpkg -x`` into the cache (no root
  needed once the apt package lists exist), like Fashion-MNIST in :mod:`.datasets`.
* :func:`rst_paragraphs` — reST → plain English paragraphs, one per line: code, literal and doctest
  blocks, tables, titles, comments and non-prose directives dropped; prose directive bodies
  (``function``, ``note``, ``versionchanged`` …) kept; inline markup reduced to its text.
* :func:`split_documents` — deterministic train/validation/test split by document (seeded shuffle,
  each held-out split filled to a fraction of the characters); :func:`python_docs_splits` applies it
  to the corpus and caches the three splits as ``.txt`` files (one paragraph a line).
* :func:`train_tokenizer` — a byte-level BPE (``tokenizers``) trained on a list of texts, wrapped as a
  ``transformers.PreTrainedTokenizerFast`` whose single special token ``<|endoftext|>`` is the
  bos/eos/pad/unk token, cached under ``<cache>/tokenizers/<hash>``; ``save_pretrained`` of it goes
  into each model folder so that ``AutoTokenizer`` (and ``--data file.txt``) find it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .assets import cache_dir
from ..io.cache import DIGESTS, build_lock, damage, record_digests, remove_entry
from .debian import deb_data_dir
from ..errors import SymmergeError

PYDOCS_PACKAGE = "python3.11-doc"
PYDOCS_SYSTEM_DIR = Path("/usr/share/doc/python3.11/html/_sources")
PYDOCS_LICENSE = "PSF-2.0 (Python Software Foundation License Version 2, the licence of the Python documentation)"
EOT = "<|endoftext|>"
SPLITS = ("train", "validation", "test")
TEXT_FORMAT = 2  # bump when the cleaning or the split rule changes (part of the cached splits' key)

# ---------------------------------------------------------------- fetch


def _has_docs(folder: Path) -> bool:
    return (folder / "library" / "bisect.rst.txt").is_file() and (folder / "tutorial").is_dir()


def python_docs_dir(fetch: bool = True) -> Path:
    """Folder of the Python 3.11 documentation's reST sources (system install, else the cache)."""
    how = (f"fetch it with `python -m symmerge.demo.datasets python-docs` after an `apt-get update`, or install "
           f"the Debian package {PYDOCS_PACKAGE} (root)")
    return deb_data_dir(PYDOCS_PACKAGE, PYDOCS_SYSTEM_DIR, "usr/share/doc/python3.11/html/_sources", "python-docs",
                        _has_docs, "the Python documentation corpus", how, fetch)


@contextmanager
def cache_entry(out: Path):
    """Build a cache folder in a temp dir beside ``out`` (yielded; named as every output's,
    ``.<name>.symmerge-tmp-<pid>-*``, so that a later run removes it when this one was killed:
    :mod:`symmerge.io.output`), then publish it by one rename, with the umask's permissions. If another
    process published ``out`` first (two trainings started together), its folder is kept and this one
    dropped: both hold the same deterministic content."""
    from ..io.output import apply_umask, clean_stale, temp_prefix

    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        yield tmp
        apply_umask(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- reST -> plain prose

# directives whose body is not prose (code, tables, tables of contents, metadata)
SKIP_DIRECTIVES = {
    "code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "testsetup", "testcleanup",
    "productionlist", "literalinclude", "include", "csv-table", "table", "list-table", "toctree", "image",
    "figure", "raw", "highlight", "highlightlang", "index", "moduleauthor", "sectionauthor", "tabularcolumns",
    "autosummary", "only", "ifconfig", "availability", "impl-detail", "audit-event", "audit-event-table",
    "opcode", "cmdoption", "option", "envvar", "c:macro", "c:var", "c:type", "c:member", "c:function",
    "c:struct", "c:enumerator", "c:namespace", "limited-api-list", "refcounting", "math", "graphviz",
    "pdbcommand", "2to3fixer", "miscnews", "literal", "parsed-literal", "glossary", "hlist", "rubric",
    "contents", "sidebar", "topic", "centered", "program", "currentmodule", "module", "default-role",
}
_UNDERLINE = re.compile(r"^([=\-~^\"'`*+#:.<>_])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::(.*)$")
_BULLET = re.compile(r"^(?:[*+\-•]|#\.|\d+\.|\(?[a-z\d]\))\s+")
_INLINE = [
    (re.compile(r":[\w:-]+:`~?!?([^`<]*?)\s*<[^`>]*>`"), r"\1"),  # :ref:`text <target>`
    (re.compile(r":[\w:-]+:`~(?:[\w.]*\.)?([^`]*)`"), r"\1"),  # :func:`~a.b.c` -> c
    (re.compile(r":[\w:-]+:`!?([^`]*)`"), r"\1"),  # :func:`a.b` -> a.b, :term:`x` -> x
    (re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?"), r"\1"),  # `text <url>`_
    (re.compile(r"``([^`]*)``"), r"\1"),
    (re.compile(r"`([^`]*)`_{0,2}"), r"\1"),
    (re.compile(r"\*\*([^*]+)\*\*"), r"\1"),
    (re.compile(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])"), r"\1"),
    (re.compile(r"\s*\[#\w*\]_"), ""),  # footnote references
    (re.compile(r"\|(\w[\w -]*)\|"), r"\1"),  # substitutions
    (re.compile(r"(?<!\w)([A-Za-z][\w-]*[A-Za-z0-9])_(?!\w)"), r"\1"),  # reference_ names (not __dunder__)
    (re.compile(r"\\ ?"), ""),  # escapes
]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def clean_inline(text: str) -> str:
    """Inline reST markup reduced to its text, whitespace collapsed."""
    for pattern, repl in _INLINE:
        text = pattern.sub(repl, text)
    return " ".join(text.split())


def _is_prose(text: str, min_words: int) -> bool:
    words = text.split()
    if len(words) < min_words:
        return False
    letters = sum(ch.isalpha() for ch in text)
    return letters >= 0.6 * len(text) and any(ch in text for ch in ".:;?!,")


def rst_paragraphs(source: str, min_words: int = 5) -> list[str]:
    """The prose paragraphs of a reST document, each cleaned to one line of plain text.

    A paragraph is a run of non-blank lines (a new bullet item starts a new one). Dropped: blocks
    indented under a line ending in ``::`` (literal code), doctest (``>>>``) blocks, tables, section
    titles and their underlines, comments, the directives of :data:`SKIP_DIRECTIVES` with their bodies,
    and paragraphs of fewer than ``min_words`` words or mostly non-letters. The other directives
    (``function``, ``class``, ``note``, ``versionchanged`` …) lose their header line and options and
    keep their body."""
    lines = source.replace("\t", "    ").splitlines()
    out: list[str] = []
    current: list[str] = []
    skip_below: int | None = None  # skip lines indented deeper than this (a literal or skipped block)

    def flush():
        if current:
            text = clean_inline(" ".join(current))
            if text.endswith("::"):
                text = text[:-1]  # "for example::" introduces a code block: "for example:"
            if _is_prose(text, min_words):
                out.append(text)
            current.clear()

    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        i += 1
        if not line.strip():
            flush()
            continue
        ind = _indent(line)
        if skip_below is not None:
            if ind > skip_below:
                continue
            skip_below = None
        body = line.strip()
        nxt = lines[i].rstrip() if i < len(lines) else ""
        if _UNDERLINE.match(body) or (nxt.strip() and _UNDERLINE.match(nxt.strip()) and len(nxt.strip()) >= len(body)
                                      and not current):
            flush()  # a title (with its underline, skipped on the next line) or a transition
            continue
        if body.startswith(("+-", "+=", "|", ">>>", "...")) or body.startswith("%"):
            flush()  # tables, line blocks, doctest
            skip_below = ind - 1 if body.startswith(">>>") else skip_below
            continue
        m = _DIRECTIVE.match(body)
        if m or body.startswith(".."):
            flush()
            name = m.group(1) if m else None
            if name is None or name in SKIP_DIRECTIVES or name.startswith("c:"):
                skip_below = ind  # comments, targets and skipped directives: their indented body too
            else:  # a prose directive: skip its option lines, keep the body
                while i < len(lines) and lines[i].strip().startswith(":") and _indent(lines[i]) > ind:
                    i += 1
                arg = m.group(2).strip()
                if name in ("note", "warning", "seealso", "important", "tip", "caution", "attention",
                            "hint", "admonition", "deprecated-removed", "versionadded", "versionchanged",
                            "deprecated") and arg and not re.fullmatch(r"[\d. ]+", arg):
                    current.append(arg)
            continue
        if body.startswith(":") and re.match(r"^:[^:`]+:(\s|$)", body):
            flush()  # a field list item: keep its text
            body = re.sub(r"^:[^:`]+:\s*", "", body)
            if not body:
                continue
        elif _BULLET.match(body):
            flush()
            body = _BULLET.sub("", body, count=1)
        current.append(body)
        if body.endswith("::"):
            flush()
            skip_below = ind  # the literal block indented below
    flush()
    return out


def read_documents(folder) -> dict[str, list[str]]:
    """``{relative path: paragraphs}`` of every ``*.rst.txt`` below ``folder`` (sorted by path)."""
    folder = Path(folder)
    files = sorted(folder.rglob("*.rst.txt"))
    if not files:
        raise SymmergeError(f"{folder}: no *.rst.txt documents")
    docs = {}
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SymmergeError(f"{f}: cannot read ({type(e).__name__}: {e})") from None
        paragraphs = rst_paragraphs(text)
        if paragraphs:
            docs[f.relative_to(folder).as_posix()] = paragraphs
    return docs


# ---------------------------------------------------------------- splits


def split_documents(docs: dict[str, list[str]], fractions=(0.05, 0.05), seed: int = 0) -> dict[str, list[str]]:
    """``{"train", "validation", "test": [document name, ...]}``: the documents (in sorted-name order)
    shuffled with ``seed``; test takes documents until it holds ``fractions[1]`` of all characters,
    then validation until ``fractions[0]``; the rest is train (each list sorted)."""
    names = sorted(docs)
    f_val, f_test = fractions
    if not (0 < f_val and 0 < f_test and f_val + f_test < 1):
        raise SymmergeError(f"split fractions must be > 0 with a sum < 1, got {fractions}")
    if len(names) < 3:
        raise SymmergeError(f"a train/validation/test split needs at least 3 documents, got {len(names)}")
    sizes = {n: sum(len(p) + 1 for p in docs[n]) for n in names}
    total = sum(sizes.values())
    order = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]
    out = {s: [] for s in SPLITS}
    for split, frac in (("test", f_test), ("validation", f_val)):
        held = 0
        while order and held < frac * total and len(order) > 1:
            name = order.pop(0)
            out[split].append(name)
            held += sizes[name]
    out["train"] = order
    if not all(out.values()):
        raise SymmergeError(f"the split left an empty part: {({k: len(v) for k, v in out.items()})}")
    return {k: sorted(v) for k, v in out.items()}


def write_lines(path, lines) -> Path:
    """Write texts one per line (newlines inside a text become spaces), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(" ".join(t.split()) + "\n" for t in lines), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_lines(path) -> list[str]:
    try:
        return [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise SymmergeError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def corpus_splits(folder, fractions=(0.05, 0.05), seed: int = 0, root=None) -> dict[str, Path]:
    """The cleaned paragraphs of the reST documents under ``folder``, split by document, as three
    ``.txt`` files (one paragraph a line, documents in name order) cached under
    ``<root or cache>/text-splits/<hash>`` with a ``manifest.json`` (documents, lines, characters)."""
    folder = Path(folder)
    h = hashlib.sha256(json.dumps({"format": TEXT_FORMAT, "fractions": list(fractions), "seed": seed}).encode())
    for f in sorted(folder.rglob("*.rst.txt")):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    out = Path(root) if root is not None else cache_dir() / "text-splits"
    out = out / h.hexdigest()[:16]
    paths = {s: out / f"{s}.txt" for s in SPLITS}
    with build_lock(out):  # another process splitting the same corpus: wait, then reuse its folder
        if (out / "manifest.json").is_file():
            reason = _splits_damage(out)
            if reason is None:
                return paths
            print(f"note: {reason}; splitting the corpus again", file=sys.stderr)
        docs = read_documents(folder)
        parts = split_documents(docs, fractions, seed)
        remove_entry(out)  # an incomplete run of an earlier version, or a damaged folder
        with cache_entry(out) as tmp:
            manifest = {"source": str(folder), "seed": seed, "fractions": list(fractions), "splits": {}}
            for s in SPLITS:
                lines = [p for name in parts[s] for p in docs[name]]
                write_lines(tmp / f"{s}.txt", lines)
                manifest["splits"][s] = {"documents": parts[s], "lines": len(lines),
                                         "characters": sum(len(x) for x in lines),
                                         "sha256": hashlib.sha256((tmp / f"{s}.txt").read_bytes()).hexdigest()}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return paths


def _splits_damage(out: Path) -> str | None:
    """None when the split files match their manifest (sha256; a manifest of an earlier version: the line counts),
    else what is wrong, naming the file."""
    try:
        splits = json.loads((out / "manifest.json").read_text())["splits"]
        want = {s: dict(splits[s]) for s in SPLITS}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{out / 'manifest.json'}: unreadable ({type(e).__name__}: {e})"
    for s in SPLITS:
        path = out / f"{s}.txt"
        try:
            data = path.read_bytes()
        except OSError as e:
            return f"{path}: cannot read ({e.strerror})"
        if ("sha256" in want[s] and hashlib.sha256(data).hexdigest() != want[s]["sha256"]) or \
                ("sha256" not in want[s] and data.count(b"\n") != want[s].get("lines")):
            return f"{path}: its bytes differ from those written when it was built (damaged)"
    return None


def python_docs_splits(fetch: bool = True, seed: int = 0) -> dict[str, Path]:
    """The Python documentation corpus as train/validation/test ``.txt`` files (5 % / 5 % of the
    characters held out by document, ``seed`` 0)."""
    return corpus_splits(python_docs_dir(fetch), seed=seed)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts, vocab_size: int = 4096, max_length: int = 128, root=None, min_frequency: int = 2):
    """A byte-level BPE trained on ``texts`` (cached by a hash of texts and settings), as a
    ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as bos/eos/pad/unk and ``model_max_length``
    ``max_length``. Deterministic: the same texts give the same vocabulary and merges."""
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise SymmergeError(f"a byte-level BPE needs vocab_size >= 257, got {vocab_size}")
    texts = list(texts)
    if not texts:
        raise SymmergeError("no texts to train the tokenizer on")
    h = hashlib.sha256(json.dumps({"format": 1, "vocab": vocab_size, "min_frequency": min_frequency,
                                   "max_length": max_length}).encode())
    for t in texts:
        h.update(t.encode() + b"\n")
    out = Path(root) if root is not None else cache_dir() / "tokenizers"
    out = out / f"bpe{vocab_size}-{h.hexdigest()[:12]}"
    with build_lock(out):  # another process training the same tokenizer: wait, then reuse its folder
        if (out / "tokenizer.json").is_file():
            reason = damage(out)
            if reason is None:
                try:
                    loaded = load_tokenizer_folder(out)
                except SymmergeError as e:
                    reason = str(e)
                else:
                    if not (out / DIGESTS).is_file():
                        record_digests(out, "*")  # trained by an earlier version: checked from now on
                    return loaded
            print(f"note: {reason}; training the tokenizer again", file=sys.stderr)
        remove_entry(out)  # an incomplete run of an earlier version, or a damaged folder
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT,
                                       pad_token=EOT, model_max_length=max_length)
        with cache_entry(out) as tmp:
            fast.save_pretrained(str(tmp))
            record_digests(tmp, "*")
    return load_tokenizer_folder(out)


def load_tokenizer_folder(folder):
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 — any failure here means a broken folder
        raise SymmergeError(f"{folder}: no usable tokenizer ({type(e).__name__}: {e})") from None


def token_stream(texts, tokenizer, chunk: int = 2000) -> np.ndarray:
    """All texts tokenized and joined, each followed by the eos token, as one int32 array."""
    eos, backend = tokenizer.eos_token_id, tokenizer.backend_tokenizer
    texts, parts = list(texts), []
    for i in range(0, len(texts), chunk):
        for enc in backend.encode_batch(texts[i:i + chunk], add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos], np.int32))
    if not parts:
        raise SymmergeError("no texts to tokenize")
    return np.concatenate(parts)


def blocks(stream: np.ndarray, length: int) -> np.ndarray:
    """Non-overlapping windows of ``length`` tokens, (N, length) int64 (the tail is dropped)."""
    n = len(stream) // length
    if n == 0:
        raise SymmergeError(f"{len(stream)} tokens do not fill one block of {length}")
    return np.asarray(stream[:n * length], np.int64).reshape(n, length)
