"""The unlabeled data the data-driven matchers and REPAIR read."""

from __future__ import annotations

import time
from dataclasses import replace

from ..errors import SymmergeError
from ..io.data import Data, check_data, load_data, rebatch, take
from ..io.generate import generate_data, is_generate, parse_generate


def load_align_data(options, model, sources=None, progress: bool = True, timings: dict | None = None):
    """The unlabeled alignment data of ``options`` (:class:`~symmerge.pipeline.options.AlignOptions`;
    ``align_data``: a path, a loaded Data, or ``generate[:N[:LEN[:SEED]]]``), at most ``align_samples``
    examples, validated against ``model`` (labels, if present, are not used). ``generate``: sequences
    sampled from ``sources`` (the models being aligned; default ``[model]``, see
    :mod:`symmerge.io.generate`; ``progress``: a bar per model; ``timings``: its seconds added under
    ``generate``). A file cut to ``align_samples`` says so (:func:`~symmerge.io.data.load_data`'s note,
    under the name ``--align-samples``)."""
    batch_size = min(options.learn.batch, options.align_samples)
    max_length = options.learn.max_length if options.matcher.learns else None
    if isinstance(options.align_data, Data):
        check_data(options.align_data, model, use_labels=False)
        data = take(options.align_data, options.align_samples, limit="--align-samples")
    elif is_generate(options.align_data):
        n, length, seed = parse_generate(options.align_data)
        t = time.perf_counter()
        data = generate_data(sources or [model], min(n, options.align_samples), length, seed=seed,
                             batch_size=batch_size, spec=f"generate:{n}:{length}:{seed}", progress=progress)
        if timings is not None:
            timings["generate"] = timings.get("generate", 0.0) + time.perf_counter() - t
        check_data(data, model, use_labels=False)
    else:
        data = load_data(options.align_data, model, max_examples=options.align_samples, max_length=max_length,
                         batch_size=batch_size, labels=False, limit="--align-samples")
        return with_scored_items(data, "learned alignment") if options.matcher.learns else data
    # the learned steps' minibatches are the data's batches: in-memory or generated data is batched (and its
    # sequences cut) as a file is read, so that --learn-batch / --learn-max-length mean one thing
    if options.matcher.learns:
        return with_scored_items(rebatch(data, batch_size, max_length), "learned alignment")
    return data


def with_scored_items(data: Data, reader: str) -> Data:
    """``data`` without the batches of next-token data (``lm``) that score nothing: every text in them one token long
    after tokenization, so no position predicts a next token, and a learned step or a KL over them is 0/0 — NaN,
    which learned alignment and distillation took silently (exit 0, ``loss=nan``). None left: one error naming the
    file and ``reader`` (what scores next-token predictions)."""
    kept = scoring(data.batches, data.format)
    if not kept:
        raise nothing_scored(data.path, reader)
    if len(kept) == len(data.batches):
        return data
    return replace(data, batches=kept, n=sum(b.size for b in kept))


def scoring(batches, data_format: str) -> list:
    """The ``batches`` that score at least one item (of next-token data, ``lm``: a position followed by a token)."""
    if data_format != "lm":
        return list(batches)
    return [b for b in batches if b.mask is None or int(b.mask[:, 1:].sum()) > 0]


def nothing_scored(path, reader: str) -> SymmergeError:
    return SymmergeError(f"{path}: no text has a next token to predict (each is one token long after tokenization): "
                         f"{reader} scores next-token predictions; give texts of two tokens or more")


def read_once(options, models, timings: dict | None = None, progress: bool = True):
    """``options`` with its ``align_data`` read once for every later reader: a file loaded (and cut to
    ``align_samples``, batched for the matcher) as :func:`load_align_data` reads it, a ``generate`` spec
    replaced by the sequences it stands for, sampled once from ``models`` (every model being aligned or
    merged), so that every pairwise alignment, round and REPAIR step sees the same data and a cut file's
    note is printed once; a loaded Data or no data: unchanged. The file is tokenized with ``models[0]``'s
    tokenizer (the models' tokenizers are checked equal before). ``timings``: the sampling's seconds
    under ``generate`` (a step of its own, not part of loading)."""
    if options.align_data is None or isinstance(options.align_data, Data):
        return options
    return options.with_(align_data=load_align_data(options, models[0], sources=models, progress=progress,
                                                    timings=timings))
