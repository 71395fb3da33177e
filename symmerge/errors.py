"""The one exception type symmerge raises for bad input; the CLI prints it and exits non-zero."""


def did_you_mean(name, known, quoted: bool = True) -> str:
    """`` (did you mean 'x'?)`` when a name of ``known`` is close to ``name``, else ``''`` (``quoted=False``: the
    close name bare, as a flag is shown: `` (did you mean --symmetries?)``)."""
    close = closest(name, known)
    if close is None:
        return ""
    return f" (did you mean {close!r}?)" if quoted else f" (did you mean {close}?)"


def closest(name, known) -> str | None:
    """The name of ``known`` closest to ``name`` when one is close (what :func:`did_you_mean` suggests), else None."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.75)
    return close[0] if close else None


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
