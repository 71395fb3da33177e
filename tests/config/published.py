"""The published mergekit configs of tests/data/published_configs/ and their stand-ins, shared by
tests/config/test_published_configs.py and benchmarks/bench_configs.py: each file is the config as its model
card or repository gives it, its source on the first line, the family of its models on the second.

:func:`stand_ins` swaps a config's model names for stand-ins of the same family (tests/mergekit_oracle.py: the
base model's name for the family's base, every other name for a fine-tune, layer counts as the slices say),
tiny by default or ``hidden`` wide; :func:`run_mergekit_file` is mergekit's result of a (multi-document) text."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

import mergekit_oracle as mo

DATA = Path(__file__).resolve().parents[1] / "data" / "published_configs"
FILES = sorted(p.name for p in DATA.glob("*.yml"))
HALF = ("float16", "bfloat16")


def docs_of(text):
    return [d for d in yaml.safe_load_all(text) if d]


def header(text, key):
    m = re.search(rf"^# {key}: (.+)$", text, re.M)
    return m.group(1).strip() if m else None


def body_of(doc) -> dict:
    """The mapping holding a document's ``models``/``slices``: the document, or its ``modules: default``."""
    return (doc.get("modules") or {}).get("default") or doc


def refs(doc) -> list[str]:
    """The model names of one document, in order (base model first)."""
    out: list[str] = []

    def add(v):
        if isinstance(v, str) and v not in out:
            out.append(v)

    add(doc.get("base_model"))
    body = body_of(doc)
    for m in body.get("models") or []:
        add(m.get("model") if isinstance(m, dict) else m)
    for sl in body.get("slices") or []:
        add(sl.get("base_model"))
        for s in sl.get("sources") or []:
            add(s.get("model"))
    src = doc.get("tokenizer_source")
    if src not in (None, "base", "union"):
        add(src)
    return out


def layers_of(docs) -> int:
    """The stand-ins' layer count: the highest layer a slice reads (4 without slices)."""
    ends = [s["layer_range"][1] for d in docs for sl in body_of(d).get("slices") or [] for s in sl.get("sources") or []]
    return max(ends) if ends else 4


def family_key(text, hidden: int = 64) -> tuple:
    """(family, dtype, number of fine-tunes, layers, hidden): the stand-ins a config text needs."""
    docs = docs_of(text)
    names = {d.get("name") for d in docs} - {None}
    base_ref, others = _roles(docs, names)
    dtype = next((d.get("dtype") for d in docs if d.get("dtype") in HALF), "float32")
    return header(text, "family"), dtype, max(len(others), 1), layers_of(docs), hidden


def _roles(docs, names):
    bases = [d.get("base_model") for d in docs if isinstance(d.get("base_model"), str)]
    all_refs = list(dict.fromkeys(r for d in docs for r in refs(d) if r not in names))
    base_ref = next((b for b in bases if b not in names), None)
    return base_ref, [r for r in all_refs if r != base_ref]


def stand_ins(text, mktemp, cache: dict, hidden: int = 64):
    """(the config text with its model names swapped for stand-ins, the stand-ins' base folder, the dtype).
    ``mktemp(name)`` gives a new empty folder; ``cache`` keeps the stand-in families built (by
    :func:`family_key`) across calls."""
    docs = docs_of(text)
    names = {d.get("name") for d in docs} - {None}
    base_ref, others = _roles(docs, names)
    key = family_key(text, hidden)
    arch, dtype, n, layers, _ = key
    if key not in cache:
        cache[key] = mo.family(mktemp(f"{arch}-{dtype}-{n}-{layers}-{hidden}"), arch, dtype, n=n, layers=layers,
                               hidden=hidden)
    base, fts = cache[key]
    mapping = {r: str(f) for r, f in zip(others, fts)}
    if base_ref is not None:
        mapping[base_ref] = str(base)
    for ref in sorted(mapping, key=len, reverse=True):  # longest first: no name is a part of a longer one here
        text = re.sub(r"(?<![\w/.-])" + re.escape(ref) + r"(?![\w/.-])", lambda m, r=ref: mapping[r], text)
    return text, base, dtype


def run_mergekit_file(text, out: Path, seed=0) -> Path:
    """mergekit's result of a (multi-document) config text: each merge in order, later ones reading the earlier
    ones' outputs by their names."""
    docs = docs_of(text)
    done: dict = {}
    final = None
    for i, d in enumerate(docs):
        body = yaml.safe_dump(d, sort_keys=False)
        for name, folder in sorted(done.items(), key=lambda kv: -len(kv[0])):
            body = re.sub(r"(?<![\w/.-])" + re.escape(name) + r"(?![\w/.-])", str(folder), body)
        cfg = yaml.safe_load(body)
        cfg.pop("name", None)
        target = out if i == len(docs) - 1 else out.parent / f"{out.name}-step{i}"
        final = mo.run_mergekit(cfg, target, seed=seed)
        if d.get("name"):
            done[d["name"]] = target
    return final
