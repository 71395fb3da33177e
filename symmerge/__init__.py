"""symmerge: symmetry-aware fusion of transformer models.

The package follows the data path: ``io`` (load) → ``families`` (spec from roles) → ``core`` (bind,
apply, distances, solvers) with ``groups`` (one module per group kind) → ``pipeline`` (solve, verify,
report; in memory or streamed) → ``merge`` (methods, statistics, fusion) → ``evaluate``.

Importing the package imports torch and registers the group kinds; the public names below are imported when
first used (PEP 562), so that a command imports only the modules it runs (``symmerge run CONFIG`` neither the
alignment pipeline nor the barrier study).
"""

from ._version import __version__
from .errors import SymmergeError
from ._entry import guarded_imports

with guarded_imports():  # the symmerge command: a Ctrl-C during these imports (seconds) is one line, exit 130
    from . import groups as _groups  # noqa: F401  (registers the group kinds: symmerge.core.kinds)

# public name -> the module defining it (imported at the name's first use; ``merge``, the package itself, callable:
# symmerge.merge(models, out, options) -> report, is imported by __getattr__ as every subpackage is)
_LAZY = {
    "BarrierOptions": "merge.barrier", "barrier_many": "merge.barrier", "barrier_study": "merge.barrier",
    "SPECS": "families", "spec_for": "families", "supported_model_types": "families",
    "MergeOptions": "merge.fuse", "merge_models": "merge.fuse",
    "Alignment": "pipeline.align", "align": "pipeline.align", "align_pair": "pipeline.align",
    "AlignOptions": "pipeline.options", "LearnSettings": "pipeline.options",
    "align_to_folder": "pipeline.to_folder",
    "trust_remote_code": "io.hf",  # code shipped in model folders runs only inside this block
}

__all__ = ["merge", "align_to_folder", "align", "align_pair", "Alignment", "AlignOptions", "LearnSettings",
           "merge_models", "MergeOptions", "barrier_study", "barrier_many", "BarrierOptions", "SymmergeError", "SPECS",
           "spec_for", "supported_model_types", "trust_remote_code"]


def __getattr__(name: str):
    """A public name (:data:`_LAZY`), or a subpackage or module of the package (``symmerge.merge``, the package
    callable as the library entry; ``symmerge.pipeline``, ... as the eager package had them), imported now."""
    import importlib
    import importlib.util

    if name in _LAZY:
        with guarded_imports():
            value = getattr(importlib.import_module("." + _LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        with guarded_imports():
            return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
