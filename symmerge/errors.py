"""The one exception type symmerge raises for bad input; the CLI prints it and exits non-zero."""


class SymmergeError(Exception):
    """A user-facing error: bad input, unsupported model, failed verification."""


class RemoteCodeError(SymmergeError):
    """A model or tokenizer folder needs its own Python code, and running it was not asked for
    (``--trust-remote-code``)."""


class OutputError(SymmergeError):
    """The output cannot be written: a full disk, a file-size limit, a read-only file system, a permission,
    a symbolic link where the folder should be, another run writing the same output."""


class InputReadError(SymmergeError):
    """An input could not be read by the operating system (permission, I/O error)."""


class UsageError(SymmergeError, TypeError):
    """The library called with an argument it does not take (also a ``TypeError``, as Python's own)."""
