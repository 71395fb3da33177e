"""YAML read with bounds, for configs and for the front matter of model cards: parsed once (PyYAML's C
loader where libyaml is there), safe (``!!python/object`` and every other object-building tag refused),
and checked on the composed node graph before anything is built from it — nesting depth, the number of
values the aliases stand for (a few hundred bytes of nested aliases, a "billion laughs", would expand to
gigabytes) and keys given twice in one mapping (naming both lines). Each is one
:class:`~symmerge.errors.SymmergeError`, in milliseconds."""

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


def _check_node(path, root) -> None:
    """Refuse a document nested deeper than :data:`MAX_DEPTH`, one whose aliases expand past
    :data:`MAX_NODES` nodes (counted without expanding them: each node's size is computed once), and
    a mapping that gives a key twice (naming both lines). One error, in milliseconds."""
    import yaml

    sizes: dict[int, int] = {}

    def size(node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise SymmergeError(f"{path} line {node.start_mark.line + 1}: the config is nested more than "
                                f"{MAX_DEPTH} levels deep")
        known = sizes.get(id(node))
        if known is not None:
            return known
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
                total += size(k, depth + 1) + size(v, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item, depth + 1)
        if total > MAX_NODES:
            why = " through its aliases (aliases nested in aliases?)" if len(sizes) < MAX_NODES // 2 else ""
            raise SymmergeError(f"{path} line {node.start_mark.line + 1}: the config expands to more than "
                                f"{MAX_NODES} values{why}; refusing to read it")
        sizes[id(node)] = total
        return total

    size(root, 0)


def parse_bounded(path, text: str) -> list[tuple[object, object]]:
    """(value, node) of every document of ``text`` (read from ``path``, named in errors), parsed once:
    each document composed, checked (:func:`_check_node`), then built from the same nodes."""
    import yaml

    loader = _loader_class()(text)
    out = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            _check_node(path, node)
            out.append((loader.construct_document(node), node))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SymmergeError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    finally:
        loader.dispose()
    return out


