"""The one exception type symmerge raises for bad input; the CLI prints it and exits non-zero."""


class SymmergeError(Exception):
    """A user-facing error: bad input, unsupported model, failed verification."""
