"""A mergekit config's output vocabulary (``tokenizer_source`` / ``tokenizer: {source, tokens,
pad_to_multiple_of}``) and every model's embedding rows mapped to it, as mergekit 0.1.x does it (its README,
"Tokenizer Configuration"; checked against mergekit 0.1.5 by ``tests/config/test_tokenizer_union.py``):

* **the vocabulary**: ``base`` (the base model's tokenizer, else the first model's), a model's, or ``union``:
  the base's (else the first model's) tokenizer with every token of the other models it lacks added — plain
  tokens as added tokens, then the other models' added tokens (special or not, with their settings) — in the
  order of the models and, within a model, of its token ids (mergekit adds them in hash-map order, which
  changes from run to run: the ids of the added tokens may differ from mergekit's, the rows of each token do
  not). A token whose id is not below its model's ``vocab_size`` is not counted. ``tokens`` adds the tokens it
  names that the vocabulary lacks. ``pad_to_multiple_of`` pads the row count; the padding rows are the mean
  of the vocabulary's rows, per model.
* **each model's rows** (every tensor outside the layers whose first dimension is the model's vocabulary:
  input embeddings and LM head): a token the model has keeps its own row; a token it lacks gets the base
  model's row when the base (among the tensor's inputs) has it, else the row of the one model that has it,
  else the mean of the rows of the models that have it (summed in the inputs' dtype in model order, then
  divided), else zeros. ``tokens: {TOKEN: {source: MODEL | {kind: model_token, model, token | token_id} |
  {kind: zero}, force: bool}}`` names the row given to models that lack the token (with ``force``, to every
  model). The merge method then merges these rows like any tensor.
* the output's ``config.json`` gets the new ``vocab_size``, its folder the output tokenizer
  (``save_pretrained``; the inputs' tokenizer files are not copied).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SymmergeError


@dataclass
class TokenSource:
    """A row named in ``tokens``: ``source`` ``model`` (the model's row for this token), ``model_token`` (the
    model's row for ``token`` / ``token_id``) or ``zero`` (mergekit's ``kind`` of a token source); ``model``: an
    input index."""

    source: str
    model: int | None = None
    token: str | None = None
    token_id: int | None = None
    force: bool = False


@dataclass
class Vocabulary:
    """The output vocabulary and, per input index, ``perm``: output id → the input's id (−1: lacks it)."""

    tokenizer: object  # a transformers tokenizer: what the output folder gets
    vocab: dict  # token -> output id
    size: int  # rows of the output's vocabulary tensors (len(vocab), padded)
    perm: dict  # input index -> list of ints (len(vocab))
    vocabs: dict  # input index -> its own vocabulary (token -> id, below vocab_size)
    tokens: dict = field(default_factory=dict)  # token -> TokenSource
    base: int | None = None  # the input whose row a token lacking elsewhere takes first

    def identity_for(self, i: int, rows: int) -> bool:
        """Input ``i``'s rows are already the output's (same ids, same count, nothing forced)."""
        p = self.perm[i]
        return rows == self.size == len(p) and all(j == k for k, j in enumerate(p)) and not any(
            s.force for s in self.tokens.values())


def vocab_size(config: dict) -> int | None:
    for c in (config, config.get("text_config") or {}):
        v = c.get("vocab_size")
        if isinstance(v, int):
            return v
    return None


def load_tokenizer(folder):
    """The folder's tokenizer (fast, offline), or one error."""
    from ..io.hf import auto_tokenizer
    from ..io.model import quiet_transformers

    try:
        with quiet_transformers():
            return auto_tokenizer(folder, use_fast=True)
    except SymmergeError:
        raise
    except Exception as e:
        raise SymmergeError(f"{folder}: cannot load its tokenizer ({type(e).__name__}: {e})") from None


def _own_vocab(tok, limit: int | None) -> dict:
    return {t: i for t, i in tok.get_vocab().items() if limit is None or i < limit}


def _copy(tok):
    """An independent copy of a tokenizer (saved and loaded back), so that adding tokens leaves it alone."""
    import tempfile

    from ..io.hf import auto_tokenizer
    from ..io.model import quiet_transformers

    with tempfile.TemporaryDirectory() as d, quiet_transformers():
        tok.save_pretrained(d)
        return auto_tokenizer(d, use_fast=True)


def build(source, folders: dict, configs: dict, base: int | None, first: int, tokens: dict,
          pad_to_multiple_of: int | None) -> Vocabulary:
    """The :class:`Vocabulary` of ``source`` (``union``, ``base`` or an input index) over the inputs
    ``folders`` (index → folder; ``configs``: index → config.json), the base input ``base`` (else ``first``
    stands in for it), extra ``tokens`` (token → :class:`TokenSource`)."""
    toks = {i: load_tokenizer(f) for i, f in folders.items()}
    vocabs = {i: _own_vocab(t, vocab_size(configs[i])) for i, t in toks.items()}
    ref = base if base is not None else first
    if source == "union":
        out = _copy(toks[ref])
        if len(vocabs[ref]) != len(toks[ref].get_vocab()):
            raise SymmergeError(f"{folders[ref]}: its tokenizer has tokens beyond the model's vocab_size "
                                f"({vocab_size(configs[ref])}): a union vocabulary of it is not supported")
        have = set(out.get_vocab())
        order = [ref] + [i for i in folders if i != ref]
        added_infos = []
        for i in order:
            decoder = getattr(toks[i], "added_tokens_decoder", {}) or {}
            added = {info.content for idx, info in decoder.items()}
            for t, _ in sorted(vocabs[i].items(), key=lambda kv: kv[1]):
                if t in added or t in have:
                    continue
                out.add_tokens(t)
                have.add(t)
            for idx, info in sorted(decoder.items()):
                if idx < (vocab_size(configs[i]) or idx + 1) and info.content not in have:
                    added_infos.append(info)
                    have.add(info.content)
        for info in added_infos:
            out.add_tokens(info)
    else:
        idx = ref if source == "base" else source
        out = _copy(toks[idx])
    have = set(out.get_vocab())
    for t in tokens:
        if t not in have:
            out.add_tokens(t)
            have.add(t)
    vocab = dict(out.get_vocab())
    size = len(vocab)
    if pad_to_multiple_of and size % pad_to_multiple_of:
        size += pad_to_multiple_of - size % pad_to_multiple_of
    inverse = sorted(vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in inverse] != list(range(len(vocab))):
        raise SymmergeError("the output tokenizer's ids are not 0 … n−1")
    perm = {i: [vocabs[i].get(t, -1) for t, _ in inverse] for i in folders}
    return Vocabulary(out, vocab, size, perm, vocabs, dict(tokens), base)


def remap(vocab: Vocabulary, tensors: dict, inputs: list, dtype=None) -> dict:
    """Every input's rows of one vocabulary tensor mapped to the output vocabulary: ``tensors`` input index →
    tensor (vocabulary first), ``inputs`` the tensor's inputs in model order; returns index → tensor of
    ``vocab.size`` rows (in ``dtype``, else the inputs' promoted dtype)."""
    if dtype is None:
        dtype = tensors[inputs[0]].dtype
        for i in inputs:
            dtype = torch.promote_types(dtype, tensors[i].dtype)
    rest = tensors[inputs[0]].shape[1:]
    for i in inputs:
        if tensors[i].shape[1:] != rest:
            raise SymmergeError(f"the vocabulary tensors' other dimensions differ ({tuple(tensors[i].shape)} and "
                                f"{(None, *rest)})")
    n = len(vocab.vocab)
    defaults = {}
    for token, tid in vocab.vocab.items():
        spec = vocab.tokens.get(token)
        lacking = [i for i in inputs if vocab.perm[i][tid] < 0]
        if not lacking and not (spec is not None and spec.force):
            continue
        defaults[tid] = _default_row(vocab, tensors, inputs, token, tid, spec, rest, dtype)
    out = {}
    for i in inputs:
        t = tensors[i]
        rows = torch.zeros((vocab.size, *rest), dtype=dtype)
        p = torch.tensor(vocab.perm[i], dtype=torch.long)
        have = p >= 0
        if vocab.size and have.any():
            rows[:n][have] = t[p[have]].to(dtype)
        for tid, row in defaults.items():
            spec = vocab.tokens.get(_token_of(vocab, tid))
            if vocab.perm[i][tid] < 0 or (spec is not None and spec.force):
                if row is not None:
                    rows[tid] = row
        if vocab.size > n:
            rows[n:] = rows[:n].mean(dim=0)
        out[i] = rows
    return out


def _token_of(vocab: Vocabulary, tid: int) -> str:
    if not hasattr(vocab, "_inverse"):
        vocab._inverse = {i: t for t, i in vocab.vocab.items()}
    return vocab._inverse[tid]


def _default_row(vocab, tensors, inputs, token, tid, spec, rest, dtype):
    """The row a model lacking ``token`` gets (None: none, the row stays zero)."""
    if spec is not None:
        if spec.source == "zero":
            return torch.zeros(rest, dtype=dtype)
        if spec.model not in tensors:
            raise SymmergeError(f"token {token!r}: its source model is not an input of this tensor")
        if spec.source == "model_token":
            j = spec.token_id if spec.token_id is not None else vocab.vocabs[spec.model].get(spec.token)
            if j is None or not 0 <= j < tensors[spec.model].shape[0]:
                raise SymmergeError(f"token {token!r}: {spec.token if spec.token_id is None else spec.token_id!r} is "
                                    "not a token of its source model")
        else:
            j = vocab.perm[spec.model][tid]
            if j < 0:
                raise SymmergeError(f"token {token!r}: its source model does not have it")
        return tensors[spec.model][j].to(dtype)
    donors = [i for i in inputs if vocab.perm[i][tid] >= 0]
    if not donors:
        return torch.zeros(rest, dtype=dtype)
    if len(donors) == 1:
        return tensors[donors[0]][vocab.perm[donors[0]][tid]].to(dtype)
    if vocab.base is not None and vocab.base in donors:
        return tensors[vocab.base][vocab.perm[vocab.base][tid]].to(dtype)
    acc = torch.zeros(rest, dtype=dtype)
    for i in donors:
        acc = acc + tensors[i][vocab.perm[i][tid]].to(dtype)
    return acc / len(donors)


# names of the tensors whose rows are tokens (input embeddings, LM heads and their biases), for the one case their
# shape cannot tell: a hidden size equal to the vocabulary size, where every hidden-width tensor (the final norm, a
# pooler) has as many rows as tokens
VOCABULARY_NAMES = ("embed", "wte", "word_embeddings", "tok_embeddings", "lm_head", "embed_out", "predictions.decoder",
                    "predictions.bias", "final_logits_bias", "output.weight")


def _hidden_size(config: dict) -> int | None:
    from ..io.shapes import HIDDEN_SIZES

    for c in (config, config.get("text_config") or {}):
        for key in (*HIDDEN_SIZES, "dim"):  # and DistilBERT's top-level "dim"
            if isinstance(c.get(key), int):
                return c[key]
    return None


def is_vocabulary_tensor(name: str, shape, config: dict) -> bool:
    """A tensor outside the layers whose rows are the model's vocabulary (input embeddings, LM head): its first
    dimension is the vocabulary size (not a position table); where the hidden size is the vocabulary size too, by
    its name (:data:`VOCABULARY_NAMES`): ``model.norm.weight`` was remapped as if its entries were tokens."""
    v = vocab_size(config)
    if v is None or len(shape) < 1 or shape[0] != v or "position" in name:
        return False
    return _hidden_size(config) != v or any(word in name for word in VOCABULARY_NAMES)


def write_tokenizer(vocab: Vocabulary, folder: Path) -> None:
    """The output tokenizer into ``folder``, replacing any tokenizer files copied there."""
    from ..io.model import quiet_transformers
    from ..io.tokenizers import drop_tokenizer

    drop_tokenizer(folder)
    with quiet_transformers():
        vocab.tokenizer.save_pretrained(str(folder))


def remapped_inputs(job, inputs: list, dtype=None) -> list:
    """``inputs`` (folders or checkpoints) of ``job`` with the sources of its vocabulary steps read as their
    rows mapped to the output vocabulary (:func:`remap`, per step over the step's inputs)."""
    from ..io.checkpoint import LazyCheckpoint

    ckpts = [x if isinstance(x, LazyCheckpoint) else LazyCheckpoint(Path(x), spec=False) for x in inputs]
    overrides: dict = {}
    for st in job.steps:
        if st.name not in job.vocab_steps:
            continue
        srcs = list(st.sources) + ([st.base] if st.base is not None else [])
        if any((s.model, s.key) in overrides for s in srcs):
            continue
        tensors = {s.model: ckpts[s.model].read([s.key])[s.key] for s in srcs}
        rows = remap(job.vocab, tensors, [s.model for s in srcs], dtype)
        for s in srcs:
            overrides[(s.model, s.key)] = rows[s.model]
    out = []
    for i, c in enumerate(ckpts):
        mine = {k: t for (j, k), t in overrides.items() if j == i}
        out.append(RowsView(c, mine) if mine else c)
    return out


def _rows_view_class():
    from ..io.prefix import KeyView

    class _RowsView(KeyView):
        """A checkpoint with some tensors replaced by tensors in memory (its vocabulary rows remapped)."""

        def __init__(self, ckpt, replaced: dict):
            super().__init__({k: (ckpt, k) for k in ckpt.keys()}, ckpt)
            self.replaced = replaced
            for k, t in replaced.items():
                self.shape[k] = tuple(t.shape)
                self.dtype[k] = t.dtype

        def nbytes(self, key):
            t = self.replaced.get(key)
            return t.numel() * t.element_size() if t is not None else super().nbytes(key)

        def room(self, key):
            return self.nbytes(key) if key in self.replaced else super().room(key)

        def read(self, keys, _stored=False):
            out = super().read([k for k in keys if k not in self.replaced])
            out.update({k: self.replaced[k].clone() for k in keys if k in self.replaced})
            return {k: out[k] for k in keys}

        def read_direct(self, key, check=True, buffer=None):
            t = self.replaced.get(key)
            if t is None:
                return super().read_direct(key, check, buffer)
            if buffer is not None and buffer.numel() >= self.nbytes(key):
                view = buffer[:self.nbytes(key)].view(t.dtype).view(t.shape)
                view.copy_(t)
                return view
            return t.clone()

        def map_direct(self, key, check=True):
            return self.replaced[key] if key in self.replaced else super().map_direct(key, check)

        def read_blocks(self, key, first, stride, width):
            if key not in self.replaced:
                return super().read_blocks(key, first, stride, width)
            from ..io.checkpoint import blocks_of

            return blocks_of(self.replaced[key], first, stride, width)

    return _RowsView


def RowsView(ckpt, replaced):  # noqa: N802 - a class made on first use (io.prefix imports transformers lazily)
    return _rows_view_class()(ckpt, replaced)
