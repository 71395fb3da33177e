"""Memory against disk: every command that has a streamed path, run through the real CLI twice — in memory and
streamed — on the same inputs, and compared.

    python -m benchmarks.streameq_audit [--families llama,bert] [--dtypes float32,bfloat16] [--json FILE]

Inputs (``tests/factories.py``, the task-head model of each family): per family and dtype a base, two fine-tunes
(the base plus 2 % noise, made in float32 and cast: :func:`benchmarks.repro_audit.make_inputs`) and an unrelated
model (another seed). Cases, each a pair (in memory, streamed):

* ``align``: ``align OTHER BASE`` against ``align --stream``, every family and dtype, with the symmetries that
  stream named explicitly (those ``align --stream`` resolves 'recommended' to, read from its report): in memory
  'recommended' adds the residual stream, which cannot stream (documented; one ``align (recommended)`` row per
  family in float32 shows it);
* ``merge METHOD``: ``--mode memory`` against ``--mode stream``, every method of ``symmerge merge --help`` on Llama
  in float32 with ``--align none`` and with the symmetries that stream; the methods of
  :data:`~benchmarks.repro_audit.CORE` aligned on Llama in the half dtypes, :data:`OTHERS` on the other families;
  the data methods (``fisher``, ``regmean``, ``ot_acts*``) without ``--data`` (both refuse; with it the streamed
  merge refuses, by design);
* ``run``: an aligned config (``method: average``, ``align: heads,attn,ffn,rescale``) with ``mode: memory`` against
  ``mode: stream``;
* ``moe --align``: without and with ``--align-stream`` (the per-layer groups);
* bad inputs: a missing tensor, a NaN, a shape mismatch, a truncated file, an integer tensor, each through
  ``align`` and aligned and plain merges both ways: the exit code and the error line (paths normalised).

Compared: every tensor bit for bit (names, dtypes, shapes, values), the safetensors metadata, ``config.json``,
every other file but the shards, the index, the report and the card (tokenizer files) byte for byte, the bytes of a
one-file output (promised for merges: docs/merge.md, "One merge, one file"), and the report field by field but
:data:`MAY_DIFFER` (measurements and the mode itself). Prints one row per case: held, or the first difference.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from benchmarks.families_cli import cli
from benchmarks.repro_audit import CORE, PARAMS, flat, make_inputs, methods, sha
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from factories import FAMILIES, MOE, make_model  # noqa: E402

LAYER_GROUPS = "heads,attn,ffn,rescale"  # the per-layer groups: what streams
OTHERS = ("average", "ties")  # the merges of the families but Llama (aligned; TIES with the base)
# report fields that legitimately differ between the two wings (a field path starting with one of these, or a
# timing): the mode itself, the streamed wing's own facts, measurements
MAY_DIFFER = {
    "mode": "the mode itself",
    "streamed": "the mode itself",
    "stream": "the streamed reader's facts (direct I/O, read-ahead peak)",
    "shards": "align --stream writes its own shards (about one layer each)",
    "bytes_written": "the streamed writer's count",
    "largest_layer_bytes": "the streamed plan's memory bound",
    "command_line": "the flag that asks for the mode",
    "plan.mode": "the mode itself",
    "plan.why": "why the mode was chosen",
    "plan.stream": "the mode itself",
    "device": "streamed: where the FFN cost GEMMs ran",
    "verify_max_abs_diff": "in memory the forward check's measurement; streamed the elements are checked",
    "verify_max_rel_diff": "as verify_max_abs_diff",
    "verify_tolerance": "as verify_max_abs_diff",
    "verify": "how the alignment was verified (forward check / element check)",
    "alignment.models[].verify": "as verify",
    "alignment.models[].mode": "the mode itself",
    "alignment.streamed": "the mode itself (docs/merge.md: true for a streamed aligned merge)",
    "alignment.models[].verify_max_rel_diff": "as verify_max_abs_diff",
    "alignment[].verify_max_abs_diff": "moe --align: as verify_max_abs_diff",
    "alignment[].verify_max_rel_diff": "as verify_max_abs_diff",
    "alignment[].verify_tolerance": "as verify_max_abs_diff",
    "plan.verify": "the plan's verification: a forward check in memory, the elements' check streamed",
    "alignment.mode": "the mode itself (an aligned config run)",
    "config.path": "the two config files differ by their 'mode' line",
    "distances_between_inputs.before_alignment": "documented (docs/merge.md): null for a streamed aligned merge",
    "alignment.models[].streamed": "the mode itself",
}
TIME_WORDS = ("timings", "seconds", "elapsed", "wall")


def may_differ(key: str) -> bool:
    parts = key.lower().replace("[", ".").split(".")
    if any(w in p for p in parts for w in TIME_WORDS) or parts[-1].endswith("_s"):
        return True
    plain = re.sub(r"\[\d+\]", "[]", key)  # list indices dropped
    return any(plain == k or plain.startswith(k + ".") or plain.startswith(k + "[") for k in MAY_DIFFER)


class Runner:
    def __init__(self, root: Path):
        self.root, self.n = root, 0

    def run(self, argv: list, out: bool = True) -> dict:
        self.n += 1
        folder = self.root / "out" / f"o{self.n}"
        rc, err = cli(*argv, *(["-o", folder] if out else []))
        line = next((x for x in reversed(err.strip().splitlines()) if x.strip()), "") if rc != 0 else ""
        return {"folder": folder, "rc": rc, "error": self.normal(line.replace(str(folder), "OUT"))}

    def normal(self, text: str) -> str:
        return text.replace(str(self.root), "ROOT")


def _files(folder: Path) -> dict:
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file()} if folder.is_dir() else {}


def _tensors_and_metadata(folder: Path) -> tuple[dict, list]:
    tensors, metadata = {}, []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            metadata.append(h.metadata())
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors, metadata


def _report(folder: Path, runner: Runner, out: Path) -> dict:
    path = folder / "symmerge_report.json"
    if not path.exists():
        return {}
    return flat(json.loads(runner.normal(path.read_text().replace(str(out), "OUT"))))


def compare(mem: dict, streamed: dict, runner: Runner, one_file_bytes: bool) -> str | None:
    """None when the two runs agree (exit code and error line; else tensors, metadata, side files, report), or the
    first difference."""
    if mem["rc"] != streamed["rc"] or mem["error"] != streamed["error"]:
        return f"exit {mem['rc']} '{mem['error'][:150]}' / {streamed['rc']} '{streamed['error'][:150]}'"
    if mem["rc"] != 0:
        return None
    a, b = mem["folder"], streamed["folder"]
    (ta, ma), (tb, mb) = _tensors_and_metadata(a), _tensors_and_metadata(b)
    if sorted(ta) != sorted(tb):
        return f"tensor names: {sorted(set(ta) ^ set(tb))[:3]}"
    for k in sorted(ta):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{k}: {x.dtype} {tuple(x.shape)} / {y.dtype} {tuple(y.shape)}"
        if not torch.equal(x, y):
            n = int((x != y).sum())
            d = float((x.double() - y.double()).abs().max())
            return f"{k}: {n} entries differ (max {d:.3g})"
    if {json.dumps(m, sort_keys=True) for m in ma} != {json.dumps(m, sort_keys=True) for m in mb}:
        return f"safetensors metadata {ma[:1]} / {mb[:1]}"
    fa, fb = _files(a), _files(b)
    # the config a run reads is copied into its output: the two differ by their 'mode' line
    skip = {"symmerge_report.json", "README.md", "model.safetensors.index.json", "symmerge_config.yml",
            "mergekit_config.yml"}
    side_a = {n for n in fa if not n.endswith(".safetensors") and n not in skip}
    side_b = {n for n in fb if not n.endswith(".safetensors") and n not in skip}
    if side_a != side_b:
        return f"files: {sorted(side_a ^ side_b)}"
    for n in sorted(side_a):
        if n == "config.json":
            if json.loads(fa[n].read_text()) != json.loads(fb[n].read_text()):
                return "config.json"
        elif fa[n].read_bytes() != fb[n].read_bytes():
            return f"{n} bytes"
    ia, ib = (p / "model.safetensors.index.json" for p in (a, b))
    if ia.exists() and ib.exists():
        wa, wb = (json.loads(p.read_text())["weight_map"] for p in (ia, ib))
        if set(wa) != set(wb):
            return "index names"
    if one_file_bytes and len([n for n in fa if n.endswith(".safetensors")]) == 1 == \
            len([n for n in fb if n.endswith(".safetensors")]) and sha(a) != sha(b):
        return "one-file output: bytes differ (tensors equal)"
    ra, rb = _report(a, runner, a), _report(b, runner, b)
    fields = [k for k in sorted(set(ra) | set(rb)) if not may_differ(k) and ra.get(k) != rb.get(k)]
    if fields:
        rounding = [k for k in fields if _rounding(ra.get(k), rb.get(k))]
        other = [k for k in fields if k not in rounding]
        if not other:
            worst = max(abs(ra[k] - rb[k]) / max(abs(ra[k]), abs(rb[k])) for k in rounding)
            return f"report: {len(rounding)} float field(s) a rounding apart (max rel {worst:.1e}; {rounding[0]})"
        k = other[0]
        more = f" (+{len(other) - 1} more field(s))" if len(other) > 1 else ""
        return f"report {k}: {str(ra.get(k, '(absent)'))[:80]} / {str(rb.get(k, '(absent)'))[:80]}{more}"
    ca, cb = ((p / "README.md").read_text() if (p / "README.md").exists() else None for p in (a, b))
    if (ca is None) != (cb is None):
        return "model card: one wing only"
    return None


def _rounding(x, y) -> bool:
    """Two floats a rounding apart (relative 1e-12 or less): a sum taken in another order."""
    return (isinstance(x, float) and isinstance(y, float) and x != y
            and abs(x - y) <= 1e-12 * max(abs(x), abs(y)))


class Audit:
    def __init__(self, root: Path):
        self.runner, self.rows, self.root = Runner(root), [], root

    def pair(self, case: str, mem_argv: list, stream_argv: list, one_file_bytes: bool = False, out: bool = True,
             note: str = ""):
        t = time.perf_counter()
        mem, streamed = self.runner.run(mem_argv, out), self.runner.run(stream_argv, out)
        diff = compare(mem, streamed, self.runner, one_file_bytes)
        outcome = "refused both" if mem["rc"] != 0 and diff is None else ("held" if diff is None else "DIFF")
        self.rows.append({"case": case, "held": diff is None, "outcome": outcome, "first_difference": diff or "",
                          "note": note, "seconds": round(time.perf_counter() - t, 2),
                          "error": mem["error"] if mem["rc"] != 0 else ""})
        print(f"{case:58s} {outcome:12s} {diff or mem['error'][:90]}", flush=True)


def streamed_symmetries(audit: Audit, model: Path, anchor: Path) -> str:
    got = audit.runner.run(["align", model, anchor, "--stream", "--progress", "none"])
    if got["rc"] != 0:
        return LAYER_GROUPS
    return ",".join(json.loads((got["folder"] / "symmerge_report.json").read_text())["symmetries"]) or "none"


def merge_argv(method: str, m, one: Path, align: str, mode: str, extra=()) -> list:
    n = 1 if m.models[1] == 1 else 2
    argv = ["merge", *[one / f"m{i}" for i in (1, 2)[:n]], "--method", method, *PARAMS.get(method, []),
            "--align", align, "--mode", mode, "--progress", "none", *extra]
    return argv + (["--base", one / "base"] if m.needs_base else [])


def audit_family(audit: Audit, family: str, dtype: str, all_methods: bool):
    root = audit.root / f"{family}-{dtype}"
    make_inputs(family, getattr(torch, dtype), root)
    one = root / "one"
    tag = f"{family} {dtype}"
    syms = streamed_symmetries(audit, one / "other", one / "base")
    audit.pair(f"{tag} align --symmetries {syms}",
               ["align", one / "other", one / "base", "--symmetries", syms, "--progress", "none"],
               ["align", one / "other", one / "base", "--symmetries", syms, "--progress", "none", "--stream"])
    if dtype == "float32":
        audit.pair(f"{tag} align (recommended)", ["align", one / "other", one / "base", "--progress", "none"],
                   ["align", one / "other", one / "base", "--progress", "none", "--stream"],
                   note="documented: in memory 'recommended' adds residual, which cannot stream")
    meths = methods()
    chosen = sorted(meths) if all_methods else [m for m in (CORE if family == "llama" else OTHERS) if m in meths]
    for method in chosen:
        m = meths[method]
        for align in (["none", syms] if all_methods else [syms]):
            label = "none" if align == "none" else "layer groups"
            audit.pair(f"{tag} merge {method} --align {label}", merge_argv(method, m, one, align, "memory"),
                       merge_argv(method, m, one, align, "stream"), one_file_bytes=True,
                       note="refused streamed: needs the models in memory (docs/merge.md)" if m.needs else "")


def corrupt_inputs(root: Path) -> dict:
    """A good pair (llama float32, base and a fine-tune) and one broken copy of the fine-tune per kind of bad input."""
    from safetensors.torch import load_file, save_file

    make_inputs("llama", torch.float32, root)
    one = root / "one"
    bad = {}
    src = one / "m1" / "model.safetensors"
    key = "model.layers.1.mlp.down_proj.weight"

    def variant(name, change):
        folder = root / "bad" / name
        folder.mkdir(parents=True)
        for f in (one / "m1").iterdir():
            if f.name != "model.safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        sd = load_file(str(src))
        change(sd)
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        bad[name] = folder

    variant("missing tensor", lambda sd: sd.pop(key))
    variant("NaN", lambda sd: sd[key].view(-1).__setitem__(0, float("nan")))
    variant("int tensor", lambda sd: sd.__setitem__(key, sd[key].to(torch.int32)))
    variant("shape mismatch", lambda sd: sd.__setitem__(key, sd[key][:, :-1].contiguous()))
    folder = root / "bad" / "truncated file"
    folder.mkdir(parents=True)
    for f in (one / "m1").iterdir():
        data = f.read_bytes()
        (folder / f.name).write_bytes(data[: len(data) // 2] if f.name == "model.safetensors" else data)
    bad["truncated file"] = folder
    other = make_model("llama", head=True, dtype=torch.float32, seed=0, intermediate_size=48)
    other.save_pretrained(str(root / "bad" / "other config"))
    bad["other config (FFN 48)"] = root / "bad" / "other config"
    return bad


def audit_bad(audit: Audit):
    root = audit.root / "bad-inputs"
    bad = corrupt_inputs(root)
    one = root / "one"
    for name, folder in bad.items():
        align = ["align", folder, one / "base", "--symmetries", LAYER_GROUPS, "--progress", "none"]
        audit.pair(f"bad: {name}: align", align, [*align, "--stream"])
        for method, align_flag in (("average", "none"), ("average", LAYER_GROUPS), ("ties", "none")):
            base = ["--base", one / "base"] if method == "ties" else []
            argv = ["merge", folder, one / "m2", "--method", method, *PARAMS.get(method, []), "--align", align_flag,
                    "--progress", "none", *base]
            label = "none" if align_flag == "none" else "layer groups"
            audit.pair(f"bad: {name}: merge {method} --align {label}", [*argv, "--mode", "memory"],
                       [*argv, "--mode", "stream"])


def audit_run_and_moe(audit: Audit):
    root = audit.root / "llama-float32" / "one"
    cfg = audit.root / "cfg"
    cfg.mkdir(exist_ok=True)
    for mode in ("memory", "stream"):  # symmerge's own keys, and a mergekit config with align
        (cfg / f"own-{mode}.yml").write_text(
            f"method: average\nmodels:\n  - {root / 'other'}\n  - {root / 'base'}\nalign: {LAYER_GROUPS}\n"
            f"mode: {mode}\nprogress: none\n")
        (cfg / f"mergekit-{mode}.yml").write_text(
            f"merge_method: linear\nmodels:\n  - model: {root / 'other'}\n    parameters: {{weight: 0.5}}\n"
            f"  - model: {root / 'base'}\n    parameters: {{weight: 0.5}}\nalign: {LAYER_GROUPS}\nmode: {mode}\n")
    for kind in ("own", "mergekit"):
        audit.pair(f"llama float32 run ({kind} keys, aligned, mode memory/stream)", ["run", cfg / f"{kind}-memory.yml"],
                   ["run", cfg / f"{kind}-stream.yml"], one_file_bytes=True)
    moe = cfg / "moe.yml"
    moe.write_text(f"base_model: {root / 'base'}\ngate_mode: random\ndtype: float32\nexperts:\n"
                   f"  - source_model: {root / 'other'}\n  - source_model: {root / 'm1'}\n")
    argv = ["moe", moe, "--align", "--symmetries", LAYER_GROUPS, "--progress", "none"]
    audit.pair("llama float32 moe --align (layer groups), --align-stream", argv, [*argv, "--align-stream"])


def table(rows: list) -> str:
    lines = ["| case | held? | first difference (or the refusal both gave) | note |", "|---|---|---|---|"]
    for r in rows:
        text = r["first_difference"] or (f"refused: `{r['error'][:110]}`" if r["error"] else "")
        lines.append(f"| {r['case']} | {r['outcome']} | {text.replace('|', '/')} | {r['note']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(f for f in FAMILIES if f not in ("clip_text", "clip_vision")))
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--json", help="also write every row here")
    p.add_argument("--dir", help="where the inputs and outputs go (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        audit = Audit(Path(tmp))
        for dtype in args.dtypes.split(","):
            for family in args.families.split(","):
                full = family == "llama" and dtype == "float32"
                audit_family(audit, family, dtype, all_methods=full)
        if (audit.root / "llama-float32" / "one").is_dir():  # run and moe read the Llama float32 inputs
            audit_run_and_moe(audit)
        audit_bad(audit)
    rows = audit.rows
    held = sum(r["held"] for r in rows)
    print(f"\n{held} of {len(rows)} cases held; {time.perf_counter() - start:.0f} s")
    print(table(rows))
    if args.json:  # one row a line, empty fields left out
        kept = [{k: v for k, v in r.items() if v not in ("", None)} for r in rows]
        Path(args.json).write_text("[\n" + ",\n".join(json.dumps(r, separators=(",", ":")) for r in kept) + "\n]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
