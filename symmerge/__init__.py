"""symmerge: symmetry-aware fusion of transformer models.

The package follows the data path: ``io`` (load) → ``families`` (spec from roles) → ``core`` (bind,
apply, distances, solvers) with ``groups`` (one module per group kind) → ``pipeline`` (solve, verify,
report; in memory or streamed) → ``merge`` (methods, statistics, fusion) → ``evaluate``.
"""

from ._version import __version__
from .errors import SymmergeError
from ._entry import guarded_imports

with guarded_imports():  # the symmerge command: a Ctrl-C during these imports (seconds) is one line, exit 130
    from . import groups as _groups  # noqa: F401  (registers the group kinds: symmerge.core.kinds)
    from .merge.barrier import BarrierOptions, barrier_many, barrier_study
    from .families import SPECS, spec_for, supported_model_types
    from .merge.fuse import MergeOptions, merge_models
    from .pipeline.align import Alignment, align, align_pair
    from .pipeline.options import AlignOptions, LearnSettings
    from .pipeline.to_folder import align_to_folder
    from . import merge  # noqa: E402  (the package is callable: symmerge.merge(models, out, options) -> report)

__all__ = ["merge", "align_to_folder", "align", "align_pair", "Alignment", "AlignOptions", "LearnSettings", "merge_models", "MergeOptions", "barrier_study", "barrier_many", "BarrierOptions",
           "SymmergeError", "SPECS", "spec_for", "supported_model_types"]

from .io.hf import trust_remote_code  # noqa: E402  (code shipped in model folders runs only inside this block)

__all__ += ["trust_remote_code"]
