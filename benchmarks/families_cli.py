"""Every family through the command line, the outputs checked with ``transformers`` itself.

    python -m benchmarks.families_cli [--dtypes float32,bfloat16,float16] [--families llama,t5] [--base]
                                      [--out DIR] [--json FILE]

For each family of ``tests/factories.py`` (tiny random models with their task head, or with ``--base`` the base
model; hidden size ≤ 32) two folders are saved by ``save_pretrained`` in each dtype, with a WordPiece tokenizer
(not ViT / CLIP vision), and the CLI runs, in this process: ``align A B``, ``align A B --stream --verify-forward``,
``merge A B --method average`` (memory, aligned by ``recommended``), ``merge A B --method average --align none
--mode stream`` and ``run`` of a two-model ``linear`` mergekit config. Every output is loaded by the class its
config.json names (``from_pretrained(..., output_loading_info=True)``) and checked: no missing, unexpected or
mismatched keys and no such warning; the dtypes on disk and config.json's ``dtype``; safetensors metadata; the
tensor count against the input's; the input's side files (tokenizer, generation_config.json) present, and the
tokenizer files byte for byte; for the alignments, the output's largest relative output difference from the input,
both run in float32 (``make_inputs`` of ``tests/conftest.py``); for the merges, finite outputs. Prints one line
per family and command (``ok`` or what failed) and writes the rows to ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import make_inputs, model_outputs, write_tokenizer  # noqa: E402
from factories import FAMILIES, make_model  # noqa: E402

NO_TOKENIZER = ("vit", "clip_vision")
OWN_FILES = ("README.md", "symmerge_report.json", "model.safetensors.index.json", "mergekit_config.yml")
TOKENIZER_FILES = ("tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "tokenizer.json")


def cli(*argv) -> tuple:
    """(exit code, or 'EXC' with the traceback's tail; stderr) of ``symmerge ARGV`` in this process."""
    import traceback

    from symmerge.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return main([str(a) for a in argv]), err.getvalue()
    except BaseException as e:  # noqa: BLE001 — a traceback is the finding
        return "EXC", "".join(traceback.format_exception(e))[-800:]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def load(folder):
    """(the model its config.json names, loading info with anything in it, transformers' lines on weights/keys)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    handler, logger = _Lines(), transformers.utils.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = getattr(transformers, config.architectures[0]).from_pretrained(str(folder),
                                                                                         output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    said = [x for x in handler.lines if any(w in x.lower() for w in ("weight", "key", "initializ"))]
    return model.eval(), {k: v for k, v in info.items() if v and k != "error_msgs"}, said


def on_disk(folder) -> dict:
    from safetensors import safe_open

    names, meta, dtypes = {}, set(), set()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            meta.add(json.dumps(s.metadata()))
            for k in s.keys():
                names[k] = f.name
                dtypes.add(str(s.get_slice(k).get_dtype()))
    config = json.loads((Path(folder) / "config.json").read_text())
    return {"tensors": len(names), "meta": sorted(meta), "dtypes": sorted(dtypes),
            "config_dtype": config.get("dtype", config.get("torch_dtype"))}


def side(folder) -> set:
    return {p.name for p in Path(folder).iterdir() if p.suffix != ".safetensors" and p.name not in OWN_FILES}


def rel(a, b, inputs) -> float:
    pairs = zip(model_outputs(a, inputs), model_outputs(b, inputs))
    return max(((x.double() - y.double()).abs().max() / x.double().abs().max().clamp_min(1e-30)).item()
               for x, y in pairs)


def check(out, source, reference) -> dict:
    """What ``out`` (a command's output folder) holds, against its input ``source``."""
    model, info, said = load(out)
    row = {**on_disk(out), "loading": info or None, "transformers_said": said or None,
           "input": on_disk(source), "side_missing": sorted(side(source) - side(out)) or None}
    row["tokenizer_differs"] = [f for f in TOKENIZER_FILES if (source / f).exists() and
                                (not (out / f).exists() or (source / f).read_bytes() != (out / f).read_bytes())] or None
    gen = source / "generation_config.json"
    if gen.exists():
        row["generation_config_same"] = (out / gen.name).exists() and \
            json.loads(gen.read_text()) == json.loads((out / gen.name).read_text())
    if reference is not None:
        row["rel"] = rel(reference, model.float(), make_inputs(reference))
    else:
        row["finite"] = all(torch.isfinite(o).all().item() for o in model_outputs(model.float(), make_inputs(model)))
    return row


def problems(row: dict) -> list[str]:
    """What a row says is wrong (empty: ok)."""
    if "rc" in row:
        return [f"exit {row['rc']}: {row['error']}"]
    found = [f"{k}={row[k]}" for k in ("loading", "transformers_said", "side_missing", "tokenizer_differs") if row[k]]
    if row["dtypes"] != row["input"]["dtypes"] or row["config_dtype"] != row["input"]["config_dtype"]:
        found.append(f"dtype {row['input']['dtypes']} -> {row['dtypes']} (config.json {row['config_dtype']})")
    if row["tensors"] != row["input"]["tensors"]:
        found.append(f"tensors {row['input']['tensors']} -> {row['tensors']}")
    if row["meta"] != ['{"format": "pt"}']:
        found.append(f"metadata {row['meta']}")
    if row.get("generation_config_same") is False:
        found.append("generation_config.json differs")
    if row.get("finite") is False:
        found.append("non-finite outputs")
    return found


def commands(a, b, d) -> dict:
    config = d / "config.yml"
    config.write_text(f"models:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n  - model: {b}\n"
                      "    parameters: {weight: 0.5}\nmerge_method: linear\n")
    quiet = ("--progress", "none")
    return {"align": ("align", a, b, "-o", d / "align", *quiet),
            "align --stream": ("align", a, b, "-o", d / "align-stream", "--stream", "--verify-forward", *quiet),
            "merge (memory)": ("merge", a, b, "--method", "average", "-o", d / "merge", *quiet),
            "merge --mode stream": ("merge", a, b, "--method", "average", "--align", "none", "--mode", "stream",
                                    "-o", d / "merge-stream", *quiet),
            "run (mergekit config)": ("run", config, d / "run")}


def family_rows(family: str, dtype: torch.dtype, head: bool, root: Path) -> dict:
    d = root / str(dtype).replace("torch.", "") / family
    d.mkdir(parents=True)
    a, b = d / "A", d / "B"
    for seed, folder in ((0, a), (1, b)):
        make_model(family, head=head, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(str(folder))
        if family not in NO_TOKENIZER:
            write_tokenizer(folder)
    reference = load(a)[0].float()
    rows = {}
    for name, argv in commands(a, b, d).items():
        rc, err = cli(*argv)
        out = Path(argv[argv.index("-o") + 1]) if "-o" in argv else Path(argv[2])
        if rc != 0:
            rows[name] = {"rc": rc, "error": err if rc == "EXC" else (err.strip().splitlines() or [""])[-1]}
            continue
        rows[name] = check(out, a, reference if name.startswith("align") else None)
    return rows


def compact(row: dict) -> dict:
    """A row as ``--json`` keeps it: the figures, not the input's own (its dtypes and tensor count only)."""
    if "rc" in row:
        return {"exit": row["rc"], "error": row["error"]}
    kept = {k: row[k] for k in ("dtypes", "config_dtype", "tensors") if k in row}
    kept.update(input_tensors=row["input"]["tensors"], metadata=row["meta"])
    kept.update({k: row[k] for k in ("loading", "transformers_said", "side_missing", "tokenizer_differs",
                                     "generation_config_same", "rel", "finite") if k in row})
    return kept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--base", action="store_true", help="base models (no task head)")
    p.add_argument("--out", help="keep the folders here (default: a temporary folder, removed)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(args.out or tempfile.mkdtemp(prefix="families-cli-"))
    results, failed = {}, 0
    try:
        for dtype_name in args.dtypes.split(","):
            for family in args.families.split(","):
                t0 = time.perf_counter()
                rows = family_rows(family, getattr(torch, dtype_name), not args.base, root)
                results.setdefault(dtype_name, {})[family] = {k: compact(v) for k, v in rows.items()}
                for name, row in rows.items():
                    found = problems(row)
                    failed += bool(found)
                    figure = f" rel {row['rel']:.2e}" if "rel" in row else ""
                    print(f"{dtype_name:9s} {family:18s} {name:22s} {'; '.join(found) if found else 'ok'}{figure}")
                print(f"{dtype_name:9s} {family:18s} {time.perf_counter() - t0:.1f} s wall", flush=True)
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, separators=(",", ":"), default=str) + "\n")
    print(f"{failed} failing row(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
