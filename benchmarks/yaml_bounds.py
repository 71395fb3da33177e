"""What the bounded YAML reader (``symmerge/io/yaml_bounded.py: parse_bounded``) costs over PyYAML's own safe load,
on mergekit-style configs of a few sizes up to the reader's cap (``MAX_BYTES``, 2 MiB): a ``models:`` list of
entries with a ``parameters:`` mapping each (the shape of a large published config, repeated). Per size and loader
(PyYAML's C loader where libyaml is there, and the pure-Python one): the least of ``--repeat`` times of

- ``yaml.load`` (the plain safe load: composed and built once, no bound checked),
- ``parse_bounded`` (composed with the depth bounded, then checked and built: libyaml's loader reads the depth off
  the parse events first, the pure-Python one bounds it as it composes),
- its two checks alone: the depth pass over the parse events (``_check_depth``; run by ``parse_bounded`` with
  libyaml's loader only, ``depth_pass_used``) and the node check (``_check_node`` on a composed tree),

and the ratio ``parse_bounded / yaml.load``. The values built are compared: the bounded reader must give the plain
load's result.

    python -m benchmarks.yaml_bounds --repeat 3 --json /tmp/yaml_bounds.json
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import machine

SIZES = (4 * 1024, 256 * 1024, 2 * 1024 * 1024 - 1024)


def config_text(nbytes: int) -> str:
    """A mergekit-style config of about ``nbytes`` bytes (never more): a ``ties`` merge of many models, each with
    a weight and a list of densities."""
    head = "merge_method: ties\nbase_model: org/base\ndtype: float32\nmodels:\n"
    parts, size, i = [head], len(head), 0
    while True:
        entry = (f"  - model: org/model-{i}\n    parameters:\n      weight: {0.1 + i % 7 / 10:.1f}\n"
                 f"      density: [0.5, 0.6, {i % 9 / 10:.1f}]\n")
        if size + len(entry) > nbytes:
            return "".join(parts)
        parts.append(entry)
        size += len(entry)
        i += 1


def least(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(text: str, loader, repeat: int) -> dict:
    """The row of one config text and one loader class."""
    import yaml

    from symmerge.io import yaml_bounded as yb

    original = yb._loader_class
    yb._loader_class = lambda: loader
    try:
        plain = yaml.load(text, Loader=loader)
        bounded = yb.parse_bounded("config.yml", text)
        if [value for value, _ in bounded] != [plain]:
            raise SystemExit("parse_bounded built another value than yaml.load")
        node = bounded[0][1]
        row = {"bytes": len(text.encode()), "loader": loader.__name__,
               "yaml_load_s": least(lambda: yaml.load(text, Loader=loader), repeat),
               "parse_bounded_s": least(lambda: yb.parse_bounded("config.yml", text), repeat),
               "depth_pass_s": least(lambda: yb._check_depth("config.yml", text), repeat),
               "node_check_s": least(lambda: yb._check_node("config.yml", node), repeat),
               "depth_pass_used": yb._composing(loader) is None}
    finally:
        yb._loader_class = original
    row["ratio"] = row["parse_bounded_s"] / row["yaml_load_s"]
    return row


def main(argv=None) -> dict:
    import yaml

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="config sizes in bytes, comma separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    loaders = [c for c in (getattr(yaml, "CSafeLoader", None), yaml.SafeLoader) if c is not None]
    rows = []
    print("depth: the pass over the parse events ('-': measured, not run by parse_bounded with this loader)")
    print(f"{'bytes':>9} {'loader':<12} {'yaml.load':>10} {'bounded':>9} {'depth':>8} {'nodes':>8} {'ratio':>6}")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        text = config_text(nbytes)
        for loader in loaders:
            r = measure(text, loader, args.repeat)
            rows.append(r)
            print(f"{r['bytes']:>9} {r['loader']:<12} {r['yaml_load_s']:>9.4f}s {r['parse_bounded_s']:>8.4f}s "
                  f"{r['depth_pass_s']:>7.4f}{'s' if r['depth_pass_used'] else '-'} {r['node_check_s']:>7.4f}s {r['ratio']:>5.2f}x")
    result = {"machine": machine(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
