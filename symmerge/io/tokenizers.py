"""The inputs' tokenizers compared before anything is aligned or merged.

Two checkpoints whose embedding rows mean different tokens (a retrained tokenizer of the same size, a
token added to one of them) merge silently into a model that mixes unrelated tokens. Every command
that combines models (``align``, ``merge``, ``barrier``, and their Python API) therefore compares, for
every input given as a folder, what decides which row a text reads:

* the **vocabulary**: token → id, added tokens included;
* the **special tokens**: role → token (``cls_token``, ``eos_token``, ``additional_special_tokens``...);
* the **added tokens**: their ids (in the vocabulary above) and which tokens are special (the roles'
  tokens and the added tokens flagged special).

They are read straight from the tokenizer files (``tokenizer.json``, else ``vocab.txt`` / ``vocab.json``,
plus ``tokenizer_config.json``, ``special_tokens_map.json``, ``added_tokens.json``); only a tokenizer
without any of those (a sentencepiece or tiktoken model alone) is loaded with ``AutoTokenizer``,
offline. Folders whose tokenizer files are byte-identical are equal without parsing anything.

A difference is one :class:`SymmergeError` naming the first differing tokens (token and id in each
model), unless ``allow_mismatch`` (``--allow-tokenizer-mismatch``): the report's ``tokenizer`` entry then
records the differences. A folder without a tokenizer, and a model given as an in-memory object, are
not compared, with a note.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SymmergeError

# files that define a tokenizer (a subset of symmerge.io.model.SIDE_FILES)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "spm.model",
                   "sentencepiece.bpe.model", "sentencepiece.model", "bpe.codes", "tokenizer.tiktoken")
VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model", "spm.model",
               "sentencepiece.bpe.model", "sentencepiece.model", "bpe.codes", "tokenizer.tiktoken")
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                 "additional_special_tokens", "extra_special_tokens")
# transformers 4 writes the extra special tokens as additional_special_tokens, 5 as extra_special_tokens:
# both are compared as one role, additional_special_tokens
EXTRA_ROLES = ("additional_special_tokens", "extra_special_tokens")
SHOWN = 3  # differing tokens named in an error


@dataclass
class TokenizerView:
    """What a tokenizer maps text to: ``vocab`` (token → id, added tokens included), ``special``
    (role → token, or a tuple of tokens), ``special_tokens`` (every token marked special: the roles' and
    the added tokens flagged special), ``added`` (token → id of the tokens added beyond the base
    vocabulary)."""

    vocab: dict
    special: dict
    special_tokens: frozenset
    added: dict


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SymmergeError(f"{path}: unreadable tokenizer file ({e})") from None


def _content(value):
    """A special-token value as written in the configs (a string, a dict with ``content``, a list)."""
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, (list, tuple)):
        return tuple(c for c in (_content(v) for v in value) if c)
    if isinstance(value, str):
        return value
    return None


def _vocab_from_tokenizer_json(model: dict, where: Path) -> dict:
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # WordPiece, BPE, WordLevel
        return {str(t): int(i) for t, i in vocab.items()}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        return {str(entry[0]): i for i, entry in enumerate(vocab)}
    raise SymmergeError(f"{where}: tokenizer.json has no vocabulary under model.vocab")


def _auto_vocab(path: Path) -> dict:
    """The vocabulary of a tokenizer with no readable vocabulary file (sentencepiece, tiktoken)."""
    try:
        from .hf import auto_tokenizer
        from .model import quiet_transformers

        with quiet_transformers():
            tok = auto_tokenizer(path)
        return dict(tok.get_vocab())
    except SymmergeError:
        raise
    except Exception as e:  # any failure of a third-party loader: one clear message
        raise SymmergeError(f"{path}: could not read the tokenizer to compare it ({type(e).__name__}: {e}); pass "
                            "--allow-tokenizer-mismatch to go on without comparing") from None


def has_vocabulary(path) -> bool:
    """Whether the folder ``path`` holds a vocabulary file (:data:`VOCAB_FILES`): a tokenizer of its own."""
    return any((Path(path) / f).is_file() for f in VOCAB_FILES)


def read_tokenizer(path) -> TokenizerView | None:
    """The :class:`TokenizerView` of an HF folder, or ``None`` when it holds no vocabulary file."""
    path = Path(path)
    if not has_vocabulary(path):
        return None
    try:
        return _read(path)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # well-formed JSON, wrong shape
        raise SymmergeError(f"{path}: malformed tokenizer files ({type(e).__name__}: {e})") from None


def _read(path: Path) -> TokenizerView:
    added: dict = {}
    if (path / "tokenizer.json").is_file():
        tj = _json(path / "tokenizer.json")
        vocab = _vocab_from_tokenizer_json(tj.get("model") or {}, path)
        for t in tj.get("added_tokens") or []:
            added[str(t["content"])] = (int(t["id"]), bool(t.get("special", False)))
    elif (path / "vocab.txt").is_file():
        lines = (path / "vocab.txt").read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        vocab = {}
        for i, token in enumerate(lines):
            vocab.setdefault(token, i)  # a repeated line keeps its first id, as BERT's loader does
    elif (path / "vocab.json").is_file():
        vocab = {str(t): int(i) for t, i in _json(path / "vocab.json").items()}
    else:
        vocab = _auto_vocab(path)
    config = _json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    for i, t in (config.get("added_tokens_decoder") or {}).items():
        added.setdefault(str(t["content"]), (int(i), bool(t.get("special", False))))
    if (path / "added_tokens.json").is_file():
        for t, i in _json(path / "added_tokens.json").items():
            added.setdefault(str(t), (int(i), False))
    base = dict(vocab)
    for token, (i, _) in added.items():
        vocab.setdefault(token, i)
    special: dict = {}
    smap = _json(path / "special_tokens_map.json") if (path / "special_tokens_map.json").is_file() else {}
    for source in (config, smap):
        for role in SPECIAL_ROLES:
            value = source.get(role)
            if role in EXTRA_ROLES:  # a list, or (transformers 5) a dict of named extra tokens
                values = value.values() if isinstance(value, dict) and "content" not in value else value or ()
                tokens = tuple(sorted({c for c in (_content(v) for v in values) if isinstance(c, str) and c}))
                if tokens:
                    special["additional_special_tokens"] = tuple(sorted(
                        set(special.get("additional_special_tokens", ())) | set(tokens)))
            elif _content(value):
                special[role] = _content(value)
    marked = {t for t, (_, flag) in added.items() if flag}
    for value in special.values():
        marked |= {value} if isinstance(value, str) else set(value)
    return TokenizerView(vocab, special, frozenset(marked),
                         {t: i for t, (i, _) in added.items() if base.get(t) != i})


def drop_tokenizer(folder: Path, side_files: dict | None = None) -> None:
    """Remove the tokenizer files (:data:`TOKENIZER_FILES`) copied into the output ``folder``, and from the
    ``copied`` list of its ``side_files`` report (``--no-copy-tokenizer``, mergekit's: every other side file, such
    as generation_config.json, stays)."""
    for name in TOKENIZER_FILES:
        (Path(folder) / name).unlink(missing_ok=True)
    if side_files is not None:
        side_files["copied"] = [n for n in side_files.get("copied", []) if n not in TOKENIZER_FILES]


def _fingerprint(path: Path) -> str | None:
    """A hash of the folder's tokenizer files (``None`` without a vocabulary file)."""
    if not has_vocabulary(path):
        return None
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            h.update(b"\0")
    return h.hexdigest()


def differences(a: TokenizerView, b: TokenizerView, name_a: str, name_b: str, limit: int = SHOWN) -> list[str]:
    """The first differences between two tokenizers, in words: vocabulary (by id), then special tokens,
    then added tokens."""
    out = []
    diff = [t for t in a.vocab.keys() | b.vocab.keys() if a.vocab.get(t) != b.vocab.get(t)]
    diff.sort(key=lambda t: (min(i for i in (a.vocab.get(t), b.vocab.get(t)) if i is not None), t))
    for t in diff[:limit]:
        ia, ib = a.vocab.get(t), b.vocab.get(t)
        out.append(f"token {t!r} has id {ia} in {name_a} and {ib} in {name_b}" if ia is not None and ib is not None
                   else f"token {t!r} (id {ia if ia is not None else ib}) is in {name_a if ia is not None else name_b} "
                        f"only")
    if len(diff) > limit:
        out.append(f"... {len(diff) - limit} more tokens differ ({len(diff)} in all; vocabulary sizes "
                   f"{len(a.vocab)} and {len(b.vocab)})")
    for role in sorted(a.special.keys() | b.special.keys()):
        if a.special.get(role) != b.special.get(role):
            out.append(f"special token {role} is {a.special.get(role)!r} in {name_a} and {b.special.get(role)!r} "
                       f"in {name_b}")
    for t in sorted(a.special_tokens ^ b.special_tokens):
        out.append(f"{t!r} is a special token in {name_a if t in a.special_tokens else name_b} only")
        if len(out) > 2 * limit + 4:
            break
    return out


def check_tokenizers(inputs, allow_mismatch: bool = False) -> dict:
    """Compare the tokenizers of ``inputs`` (``(name, model or folder)`` pairs) before anything is done;
    returns the report's ``tokenizer`` entry, or raises :class:`SymmergeError` naming the first
    differing tokens (unless ``allow_mismatch``). A folder named by itself that a ``BASE+ADAPTER`` input was merged
    into is named by that spec (:func:`symmerge.io.provenance.named_as`)."""
    from .provenance import named_as

    compared, without, in_memory = [], [], []
    for name, x in inputs:
        if named_as(x) is not None and str(name) == str(x):  # a BASE+ADAPTER input: named as the user wrote it
            name = named_as(x)
        if not isinstance(x, (str, Path)):
            in_memory.append(name)
        elif _fingerprint(Path(x)) is None:
            without.append(name)
        else:
            compared.append((name, Path(x)))
    entry: dict = {"status": "not_compared", "models": [n for n, _ in compared], "allow_mismatch": allow_mismatch}
    notes = []
    if without:
        notes.append(f"no tokenizer in {', '.join(without)}")
    if in_memory:
        notes.append(f"{', '.join(in_memory)} given as in-memory model{'s' if len(in_memory) > 1 else ''}")
    if len(compared) >= 2:
        entry["status"] = "same"
        first_name, first = compared[0]
        prints = {p: _fingerprint(p) for _, p in compared}
        view0 = None
        found = []
        for name, p in compared[1:]:
            if prints[p] == prints[first]:
                continue
            view0 = view0 or read_tokenizer(first)
            diff = differences(view0, read_tokenizer(p), first_name, name)
            if diff:
                found.append({"models": [first_name, name], "differences": diff})
        if found:
            if not allow_mismatch:
                f = found[0]
                raise SymmergeError(
                    f"the tokenizers of {f['models'][0]} and {f['models'][1]} differ: " + "; ".join(f["differences"])
                    + ". Their embedding rows stand for different tokens, so merging them mixes unrelated tokens; "
                    "pass --allow-tokenizer-mismatch (Python: allow_tokenizer_mismatch=True) to go on anyway")
            entry.update(status="different", mismatches=found)
            notes.append("the tokenizers differ (allowed by --allow-tokenizer-mismatch): the output carries the "
                         "tokenizer of the model its side files come from")
    if entry["status"] == "not_compared":
        notes.append("the tokenizers were not compared (fewer than two folders with a tokenizer)")
    elif without or in_memory:
        notes.append(f"compared the tokenizers of {', '.join(entry['models'])} only")
    if notes:
        entry["note"] = "; ".join(notes)
    return entry


def print_note(entry: dict | None) -> None:
    """The ``tokenizer`` entry's note on stderr (the CLI's last lines), if it has one."""
    import sys

    if entry and entry.get("note"):
        print(f"note: tokenizers: {entry['note']}", file=sys.stderr)
