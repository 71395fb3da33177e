"""A YAML config read with the line of every key and list item, so that every error names where it is.

:func:`read_documents` gives one :class:`Doc` per YAML document (``---`` separates the documents of a
mergekit-multi file); :meth:`Doc.at` names a nested key as ``CONFIG line N: models[1].parameters.density``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SymmergeError
from ..io.yaml_bounded import MAX_BYTES, parse_bounded


@dataclass
class Doc:
    """One document: its ``data`` (plain Python values), the config ``path`` and the 1-based line of every
    key path (a tuple of mapping keys and list indices)."""

    path: Path
    data: object
    lines: dict = field(default_factory=dict)
    start: int = 1
    index: int = 0
    count: int = 1

    def line(self, *where) -> int:
        """The line of ``where`` or of its nearest enclosing key."""
        where = tuple(where)
        while where:
            if where in self.lines:
                return self.lines[where]
            where = where[:-1]
        return self.start

    def at(self, *where) -> str:
        """``CONFIG line N: key.path`` (the document's first line without ``where``)."""
        label = dotted(where)
        doc = f" (document {self.index + 1})" if self.count > 1 and not where else ""
        return f"{self.path} line {self.line(*where)}{doc}" + (f": {label}" if label else "")

    def error(self, message: str, *where) -> SymmergeError:
        """One error: ``CONFIG line N: message``, with the key's path before the message when it is nested
        (``CONFIG line 7: models[1].parameters.density: ...``)."""
        head = f"{self.path} line {self.line(*where)}"
        if self.count > 1:
            head += f" (document {self.index + 1})"
        label = dotted(where) if len(where) > 1 else ""
        return SymmergeError(f"{head}: {label}: {message}" if label else f"{head}: {message}")


def dotted(where) -> str:
    out = ""
    for part in where:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _key_text(k) -> str:
    import yaml

    return k.value if isinstance(k, yaml.ScalarNode) else str(k)


def _walk(node, where, lines):
    import yaml

    if isinstance(node, yaml.MappingNode):
        # a key given in the mapping itself and by a merge key (``<<: *anchor``, which the loader puts first)
        # is named at the line where it is given last: the one that counts
        entries = {_key_text(k): (k, v) for k, v in node.value}
        for key, (k, v) in entries.items():
            lines.setdefault(where + (key,), k.start_mark.line + 1)
            _walk(v, where + (key,), lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.setdefault(where + (i,), item.start_mark.line + 1)
            _walk(item, where + (i,), lines)


def read_documents(path) -> list[Doc]:
    """Every document of the YAML file ``path`` (empty documents skipped); a missing file, a file over
    :data:`MAX_BYTES`, invalid YAML, a key given twice or an alias bomb is one error with its line."""
    path = Path(path)
    if path.is_dir():
        raise SymmergeError(f"{path}: is a directory, not a config file (a YAML file: CONFIG.yml)")
    if not path.is_file():  # a FIFO, a device: never opened (a FIFO with no writer would block forever)
        raise SymmergeError(f"{path}: not a regular file (a FIFO, a device...); a config is a YAML file"
                            if path.exists() else f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise SymmergeError(f"{path}: cannot read the config ({e.strerror or e})") from None
    if len(raw) > MAX_BYTES:
        raise SymmergeError(f"{path}: the config is over {MAX_BYTES // (1024 * 1024)} MiB (a merge config is a "
                            "few kilobytes); refusing to read it")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SymmergeError(f"{path}: not UTF-8 text (byte {e.start})") from None
    docs = []
    for value, node in parse_bounded(path, text):
        if value is None:
            continue
        lines: dict = {}
        _walk(node, (), lines)
        docs.append(Doc(path, value, lines, node.start_mark.line + 1))
    if not docs:
        raise SymmergeError(f"{path}: the config is empty")
    for i, d in enumerate(docs):
        d.index, d.count = i, len(docs)
        if not isinstance(d.data, dict):
            raise SymmergeError(f"{path} line {d.start}: a config is a mapping of keys (models, merge_method, ...), "
                                f"got {type(d.data).__name__}")
    return docs
