"""The YAML nesting bound (symmerge.io.yaml_bounded.MAX_DEPTH) holds before any node is composed, with either
PyYAML loader: the composers recurse once a level (PyYAML's own in Python: a RecursionError past ~1 000 levels; the
libyaml binding in C: PyYAML 6.0, which pyproject admits, crashed the interpreter at 100 000 levels), so with libyaml
the depth is read off the parse events, and the pure-Python composer checks it before each node. Its verdict is
checked against the depth of the composed node tree."""

import random

import pytest
import yaml

from symmerge.errors import SymmergeError
from symmerge.io import yaml_bounded
from symmerge.io.yaml_bounded import MAX_DEPTH, parse_bounded

LOADERS = ["python"] + (["libyaml"] if getattr(yaml, "CSafeLoader", None) else [])


@pytest.fixture(params=LOADERS)
def loader(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(yaml_bounded, "_loader_class", lambda: yaml.SafeLoader)
    return request.param


def node_depth(node, depth=0) -> int:
    """The deepest node under ``node`` (the root at 0), on the composed tree (the oracle)."""
    if isinstance(node, yaml.MappingNode):
        return max([depth] + [node_depth(x, depth + 1) for kv in node.value for x in kv])
    if isinstance(node, yaml.SequenceNode):
        return max([depth] + [node_depth(x, depth + 1) for x in node.value])
    return depth


def nested(rng: random.Random, levels: int) -> str:
    """A document ``levels`` collections deep, each level flow or block, a mapping, a sequence, or a sequence
    written without its own indentation under a mapping's key."""
    def block(level: int, indent: int) -> str:
        pad = " " * indent
        if level == 0:
            return pad + "v\n"
        kind = rng.choice(["map", "seq", "indentless", "flow"])
        if kind == "flow":
            return pad + "[" * level + "x" + "]" * level + "\n"
        if kind == "map":
            return f"{pad}k{level}: w\n{pad}k:\n" + block(level - 1, indent + 2)
        if kind == "seq":
            return f"{pad}- w\n{pad}-\n" + block(level - 1, indent + 2)
        return f"{pad}k:\n{pad}- w\n{pad}-\n" + block(level - 1, indent + 2)  # a mapping and its indentless list
    return block(levels, 0)


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 3_000, 100_000])
def test_deep_flow_nesting_is_one_error_naming_the_bound(tmp_path, loader, levels):
    text = "a: " + "[" * levels + "]" * levels + "\n"
    # libyaml's scanner reads flow collections ahead, and since PyYAML 6.0.4's wheels refuses past 1 000 levels itself
    theirs = r"|not valid YAML \(exceeded maximum nesting depth\)" if loader == "libyaml" and levels > 1_000 else ""
    with pytest.raises(SymmergeError, match=rf"deep\.yml line 1: (the config is nested more than {MAX_DEPTH} levels"
                                            rf"{theirs})"):
        parse_bounded(tmp_path / "deep.yml", text)


def test_deep_block_nesting_names_its_line(tmp_path, loader):
    text = "".join("  " * i + "k:\n" for i in range(5_000)) + "  " * 5_000 + "v\n"
    with pytest.raises(SymmergeError, match=rf"line {MAX_DEPTH + 1}: the config is nested more than {MAX_DEPTH}"):
        parse_bounded(tmp_path / "deep.yml", text)


def test_the_bound_is_the_composed_tree_depth(tmp_path, loader):
    rng = random.Random(0)
    seen = set()
    for _ in range(60):
        text = nested(rng, rng.randint(MAX_DEPTH - 8, MAX_DEPTH + 3))
        depth = node_depth(yaml.compose(text, Loader=yaml.SafeLoader))
        if depth > MAX_DEPTH:
            with pytest.raises(SymmergeError, match="nested more than"):
                parse_bounded(tmp_path / "c.yml", text)
        else:
            assert parse_bounded(tmp_path / "c.yml", text)[0][0] == yaml.safe_load(text)
        seen.add(depth > MAX_DEPTH)
    assert seen == {True, False}  # both sides of the bound were drawn


def test_at_the_bound_every_document_reads(tmp_path, loader):
    at = "a: " + "[" * (MAX_DEPTH - 1) + "1" + "]" * (MAX_DEPTH - 1) + "\n---\nb: 2\n"  # the scalar at depth 64
    values = [v for v, _ in parse_bounded(tmp_path / "at.yml", at)]
    assert values[1] == {"b": 2} and node_depth(yaml.compose(at.split("---")[0], Loader=yaml.SafeLoader)) == MAX_DEPTH
    with pytest.raises(SymmergeError, match="line 3: the config is nested more than"):  # the second document
        parse_bounded(tmp_path / "two.yml", "a: 1\n---\nb: " + "[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH + "\n")


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "a: &a {b: [1, {c: *a}]}\n", "- &s [x, [y, *s]]\n"])
def test_a_collection_holding_itself_is_one_error(tmp_path, loader, text):
    with pytest.raises(SymmergeError, match=r"self\.yml line 1: an alias refers to a collection that holds it"):
        parse_bounded(tmp_path / "self.yml", text)


def test_an_alias_used_twice_is_no_cycle(tmp_path, loader):
    text = "base: &b {x: [1, 2]}\none: *b\ntwo: [*b, *b]\n"
    assert parse_bounded(tmp_path / "ok.yml", text)[0][0] == yaml.safe_load(text)


def test_the_text_is_parsed_once_where_the_composer_is_python(tmp_path, loader, monkeypatch):
    """The pure-Python loader bounds the depth as it composes: no second parse for the events (libyaml's composer,
    in C, cannot be stopped, so its events are read first)."""
    calls = []
    real = yaml_bounded._check_depth
    monkeypatch.setattr(yaml_bounded, "_check_depth", lambda *a: calls.append(a) or real(*a))
    text = "a: [1, {b: [2, 3]}]\nc: x\n"
    values = [v for v, _ in parse_bounded(tmp_path / "c.yml", text)]
    assert values == [yaml.safe_load(text)]
    assert len(calls) == (0 if loader == "python" else 1)
    with pytest.raises(SymmergeError, match=f"line 1: the config is nested more than {MAX_DEPTH} levels deep"):
        parse_bounded(tmp_path / "d.yml", "[" * (MAX_DEPTH + 1) + "x" + "]" * (MAX_DEPTH + 1))
    assert len(calls) == (0 if loader == "python" else 2)
