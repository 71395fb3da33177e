"""YAML read with bounds, for configs and for the front matter of model cards: composed once (PyYAML's C
loader where libyaml is there, else its pure-Python one), safe (``!!python/object`` and every other object-building
tag refused), and checked before anything is built from it: the nesting depth before any node deeper than the bound
is composed (composing recurses once a level: libyaml's composer, in C, cannot be stopped, so its parse events are
read once before; the pure-Python composer checks it as it goes), then on the composed node graph the number of
values the aliases stand for (a few hundred bytes of nested aliases, a "billion laughs", would expand to gigabytes)
and keys given twice in one mapping (naming both lines). Each is one :class:`~symmerge.errors.SymmergeError`, in
milliseconds. ``python -m benchmarks.yaml_bounds`` measures the cost over PyYAML's plain safe load."""

from __future__ import annotations

from ..errors import SymmergeError

# Bounds checked on the composed YAML graph before anything is built from it: a mergekit config is a few
# kilobytes; a few hundred bytes of nested aliases (a "billion laughs") would otherwise expand to gigabytes.
MAX_BYTES = 2 * 1024 * 1024
MAX_DEPTH = 64
MAX_NODES = 1_000_000  # every alias counted as the nodes it stands for (a 2 MiB config has ~200 000)


def _loader_class():
    """PyYAML's C loader where libyaml is there (about 10 times faster), else the pure-Python one; both
    safe (``!!python/object`` and other tags that would build objects are refused)."""
    import yaml

    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


class _TooDeep(Exception):
    """A node deeper than :data:`MAX_DEPTH`, met by a composer that bounds the depth itself (:func:`_composing`)."""

    def __init__(self, line: int):
        super().__init__(line)
        self.line = line


def _too_deep(path, line: int) -> SymmergeError:
    return SymmergeError(f"{path} line {line}: the config is nested more than {MAX_DEPTH} levels deep")


_BOUNDED: dict = {}


def _composing(loader):
    """``loader`` made to refuse a node deeper than :data:`MAX_DEPTH` before composing it (:class:`_TooDeep`), if
    it composes in Python (PyYAML's pure-Python loaders: ``compose_node`` recurses once a level); None for a loader
    that composes in C (libyaml's), whose depth is read off the parse events first (:func:`_check_depth`)."""
    if not hasattr(loader, "compose_node"):
        return None
    if loader not in _BOUNDED:
        class Bounded(loader):
            _level = 0  # collections open around the node composed next (the root's: 0)

            def compose_node(self, parent, index):
                if self._level > MAX_DEPTH:
                    raise _TooDeep(self.peek_event().start_mark.line + 1)
                self._level += 1
                try:
                    return super().compose_node(parent, index)
                finally:
                    self._level -= 1

        Bounded.__name__ = Bounded.__qualname__ = f"DepthBounded{loader.__name__}"
        _BOUNDED[loader] = Bounded
    return _BOUNDED[loader]


def _check_depth(path, text: str) -> None:
    """Refuse a document nested deeper than :data:`MAX_DEPTH` (the root is at depth 0, a value of a collection one
    level below it), from the parse events alone: the parsers keep their own stack, while the composers recurse once
    a level, PyYAML's in Python (a RecursionError past ~1 000 levels) and libyaml's binding in C (the wheels of PyYAML
    6.0 to 6.0.3, which pyproject admits, crash the interpreter at 100 000 levels; 6.0.4's refuse past 1 000)."""
    import yaml

    parser = _loader_class()(text)
    level = 0  # collections open around the next event
    try:
        while parser.check_event():
            event = parser.get_event()
            if isinstance(event, yaml.CollectionEndEvent):
                level -= 1
            elif isinstance(event, yaml.NodeEvent):  # a scalar, an alias or a collection's start: a node
                if level > MAX_DEPTH:
                    raise _too_deep(path, event.start_mark.line + 1)
                level += isinstance(event, yaml.CollectionStartEvent)
    finally:
        parser.dispose()


def _check_node(path, root) -> None:
    """Refuse a document whose aliases expand past :data:`MAX_NODES` nodes (counted without expanding them:
    each node's size is computed once), a collection that holds itself through an alias (``a: &a [*a]``), and a
    mapping that gives a key twice (naming both lines). One error, in milliseconds; the depth was bounded before
    a node past it was composed (:func:`_check_depth`, :func:`_composing`)."""
    import yaml

    sizes: dict[int, int] = {}
    open_: set[int] = set()  # the collections whose size is being computed: the path from the root

    def size(node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in open_:
            raise SymmergeError(f"{path} line {node.start_mark.line + 1}: an alias refers to a collection that "
                                "holds it (the config would contain itself)")
        open_.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    first = seen.get((k.tag, k.value))
                    if first is not None:
                        raise SymmergeError(f"{path} line {k.start_mark.line + 1}: key {k.value!r} given twice "
                                            f"(first on line {first})")
                    seen[(k.tag, k.value)] = k.start_mark.line + 1
                total += size(k) + size(v)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
        if total > MAX_NODES:
            why = " through its aliases (aliases nested in aliases?)" if len(sizes) < MAX_NODES // 2 else ""
            raise SymmergeError(f"{path} line {node.start_mark.line + 1}: the config expands to more than "
                                f"{MAX_NODES} values{why}; refusing to read it")
        open_.discard(id(node))
        sizes[id(node)] = total
        return total

    size(root)


def parse_bounded(path, text: str) -> list[tuple[object, object]]:
    """(value, node) of every document of ``text`` (read from ``path``, named in errors), composed once: its
    depth bounded before a node past it is composed (libyaml's loader: on the parse events, :func:`_check_depth`;
    the pure-Python one: as it composes, :func:`_composing`), then each document checked (:func:`_check_node`) and
    built from the same nodes."""
    import yaml

    out = []
    loader_class = _loader_class()
    bounded = _composing(loader_class)
    try:
        if bounded is None:
            _check_depth(path, text)
        loader = (bounded or loader_class)(text)
        try:
            while loader.check_node():
                node = loader.get_node()
                if node is None:
                    continue
                _check_node(path, node)
                out.append((loader.construct_document(node), node))
        finally:
            loader.dispose()
    except _TooDeep as e:
        raise _too_deep(path, e.line) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SymmergeError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    return out
