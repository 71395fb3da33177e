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


def unexpected_keyword(owner: str, name: str, known) -> "UsageError":
    """The one error for a keyword ``owner`` (``"AlignOptions()"``) does not take: Python's own words, with the
    closest of ``known`` suggested (``'symetries'``: did you mean 'symmetries'?)."""
    return UsageError(f"{owner} got an unexpected keyword argument {name!r}{did_you_mean(name, known)}")


def keywords_checked(cls):
    """``cls`` (a dataclass), its constructor refusing a keyword that is none of its fields with one
    :class:`UsageError` (a ``TypeError`` too) that names the closest field, and a field declared ``bool`` given
    anything but True or False (``verify="no"`` would read as true); the signature is kept."""
    import dataclasses
    import functools

    init, known = cls.__init__, [f.name for f in dataclasses.fields(cls) if f.init]
    flags = [f.name for f in dataclasses.fields(cls) if f.type in ("bool", bool)]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        unknown = next((k for k in kwargs if k not in known), None)
        if unknown is not None:
            raise unexpected_keyword(f"{cls.__name__}()", unknown, known)
        init(self, *args, **kwargs)
        wrong = next((f for f in flags if not isinstance(getattr(self, f), bool)), None)
        if wrong is not None:
            raise UsageError(f"{cls.__name__}(): {wrong} must be True or False, got {getattr(self, wrong)!r}")

    cls.__init__ = checked
    return cls


def options_argument(options, cls, keywords=None, build=None, owner: str = "", hint: str = ""):
    """The options object of a call: ``options`` when it is a ``cls``, or (``options`` None) ``build(**keywords)``
    (default ``cls``); else one :class:`UsageError`: options of another type (``hint`` after the type: where what
    was given goes), or options and keywords both. ``owner``: the entry called, heading the line
    (``"barrier_study(): "``)."""
    if options is None:
        return (build or cls)(**(keywords or {}))
    name = cls.__name__
    if not isinstance(options, cls):
        article = "an" if name[0] in "AEIOU" else "a"
        raise UsageError(f"{owner}options must be {article} {name}, got {type(options).__name__}{hint}")
    if keywords:
        raise UsageError(f"{owner}give either a {name} or keywords, not both")
    return options


class SymmergeError(Exception):
    """A user-facing error: bad input, unsupported model, failed verification."""


class RemoteCodeError(SymmergeError):
    """A model or tokenizer folder needs its own Python code, and running it was not asked for
    (``--trust-remote-code``)."""


class OutputError(SymmergeError):
    """The output cannot be written: a full disk, a file-size limit, a read-only file system, a permission,
    a symbolic link where the folder should be, another run writing the same output."""


class OutOfMemory(SymmergeError):
    """A command ran out of memory (:func:`symmerge.io.output.memory_fault`): how much was asked for and the
    command's way out (its ``MEMORY_WAY_OUT``: a streamed mode, a smaller shard, fewer workers); its temporary
    folders and its output's claim are removed as after any error, so nothing was written."""


class InputReadError(SymmergeError):
    """An input could not be read by the operating system (permission, I/O error)."""


class UsageError(SymmergeError, TypeError):
    """The library called with an argument it does not take (also a ``TypeError``, as Python's own)."""
