"""symmerge: symmetry-aware fusion of transformer models."""

from .align import align
from .errors import SymmergeError
from .spec import SPECS, spec_for, supported_model_types

__all__ = ["align", "SymmergeError", "SPECS", "spec_for", "supported_model_types"]
__version__ = "0.1.0"
