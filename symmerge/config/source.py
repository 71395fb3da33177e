"""A YAML config read with the line of every key and list item, so that every error names where it is.

:func:`read_documents` gives one :class:`Doc` per YAML document (``---`` separates the documents of a
mergekit-multi file); :meth:`Doc.at` names a nested key as ``CONFIG line N: models[1].parameters.density``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SymmergeError


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


def _walk(node, where, lines):
    import yaml

    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else str(k)
            lines.setdefault(where + (key,), k.start_mark.line + 1)
            _walk(v, where + (key,), lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.setdefault(where + (i,), item.start_mark.line + 1)
            _walk(item, where + (i,), lines)


def read_documents(path) -> list[Doc]:
    """Every document of the YAML file ``path`` (empty documents skipped); a missing file or invalid YAML is
    one error with its line."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise SymmergeError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        values = list(yaml.safe_load_all(text))
        nodes = list(yaml.compose_all(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SymmergeError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    docs = []
    for value, node in zip(values, nodes):
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
