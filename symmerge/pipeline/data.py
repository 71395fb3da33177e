"""The unlabeled data the data-driven matchers and REPAIR read."""

from __future__ import annotations

from ..io.data import Data, check_data, load_data, take


def load_align_data(options, model):
    """The unlabeled alignment data of ``options`` (:class:`~symmerge.pipeline.options.AlignOptions`;
    ``align_data``: a path or a loaded Data), at most ``align_samples`` examples, validated against
    ``model`` (labels, if present, are not used)."""
    if isinstance(options.align_data, Data):
        check_data(options.align_data, model, use_labels=False)
        return take(options.align_data, options.align_samples)
    max_length = options.learn.max_length if options.match == "learned" else None
    return load_data(options.align_data, model, max_examples=options.align_samples, max_length=max_length,
                     batch_size=min(options.learn.batch, options.align_samples), labels=False)
