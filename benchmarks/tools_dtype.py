"""``extract-lora``, ``BASE+ADAPTER`` inputs and ``moe`` through the command line, every family and dtype, checked
with ``transformers`` and PEFT.

    python -m benchmarks.tools_dtype [--dtypes float32,bfloat16,float16] [--families llama,gpt2] [--parts lora,adapter,moe]
                                     [--json FILE]

``lora``: per family of ``tests/factories.py`` (the task-head model) a base and a "fine-tune" (the base plus 5 %
noise on every tensor, made in float32 and both cast to the dtype), then ``extract-lora FT BASE --rank 2`` and
``--rank 1000`` (full rank). Checked: exit 0; PEFT's ``PeftModel.from_pretrained(base, OUT)`` with no missing or
unexpected key (loading info, warnings, transformers/PEFT log lines); the adapter's dtypes on disk (docs/lora.md:
the fine-tune's dtype); every layer's ``‖ΔW − B·A‖/‖ΔW‖`` recomputed from the files against the report's; at full
rank, the adapted base's outputs (run in float32) against the fine-tune's.
``adapter``: a PEFT LoRA (random ``B``) saved in bfloat16 on a Llama/GPT-2 base of each dtype, given as
``BASE+ADAPTER`` to ``merge`` (average, --align none) and to ``run`` (linear): the output loads, its dtype is the
base's, outputs finite, and the merged tensors equal PEFT's ``merge_and_unload``.
``moe``: Mixtral from Llama/Mistral and Qwen2-MoE from Qwen2 experts, each gate_mode (hidden, cheap_embed, random),
config ``dtype`` absent or the dtype: the output loads as its class without key lines, its dtype on disk and in
config.json is the config's, a forward gives finite outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from safetensors import safe_open  # noqa: E402

from conftest import add_noise, make_inputs, model_outputs, write_tokenizer  # noqa: E402
from factories import FAMILIES, make_model  # noqa: E402

from benchmarks.families_cli import cli, load, on_disk  # noqa: E402

KEY_WORDS = ("weight", "key", "initializ", "missing", "unexpected")


@contextlib.contextmanager
def said():
    """Everything transformers/PEFT log or warn inside the block (a list filled as it runs)."""
    import transformers

    lines: list = []

    class H(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    h, loggers = H(), [transformers.utils.logging.get_logger("transformers"), logging.getLogger("peft")]
    for lg in loggers:
        lg.addHandler(h)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            yield lines
    finally:
        for lg in loggers:
            lg.removeHandler(h)
        lines.extend(str(x.message) for x in w)


def key_lines(lines) -> list:
    return [x[:200] for x in lines if any(k in x.lower() for k in KEY_WORDS)]


def rel(ref, got) -> float:
    return max(((x.double() - y.double()).abs().max() / x.double().abs().max().clamp_min(1e-30)).item()
               for x, y in zip(ref, got))


def fail(rc, err) -> dict:
    return {"exit": rc, "error": err if rc == "EXC" else (err.strip().splitlines() or [""])[-1]}


def pair(family, dtype, d: Path) -> tuple:
    base = make_model(family, head=True, dtype=torch.float32, seed=0)
    ft = make_model(family, head=True, dtype=torch.float32, seed=0)
    sd, _ = add_noise(base.state_dict(), 0.05, seed=1)
    ft.load_state_dict(sd)
    from transformers.pytorch_utils import Conv1D

    for m, name in ((base, "base"), (ft, "ft")):
        m.to(dtype).save_pretrained(str(d / name))
        if family not in ("vit", "clip_vision"):
            write_tokenizer(d / name)
    return d / "base", d / "ft", {n for n, m in base.named_modules() if isinstance(m, Conv1D)}


def recomputed_errors(cls, ft, base, out, report, conv1d) -> float:
    """The largest |report's error − ‖ΔW − B·A‖/‖ΔW‖ from the files| over the layers (``conv1d``: the layers
    stored transposed, GPT-2's)."""
    from safetensors.torch import load_file

    def tensors(folder):  # the class's names (ViT's differ from its checkpoint's in transformers 5)
        with said():
            return cls.from_pretrained(str(folder)).state_dict()

    f, b, a = tensors(ft), tensors(base), load_file(str(out / "adapter_model.safetensors"))
    worst = 0.0
    for m in report["modules"]:
        name = m["module"]
        key = name + ".weight"
        dw = f[key].double() - b[key].double()
        A, B = a[f"base_model.model.{name}.lora_A.weight"].double(), a[f"base_model.model.{name}.lora_B.weight"].double()
        ba = (B @ A).T if name in conv1d else B @ A
        err = (torch.linalg.norm(dw - ba) / torch.linalg.norm(dw)).item()
        worst = max(worst, abs(err - m["relative_error"]))
    return worst


def lora_row(family, dtype, root) -> dict:
    import peft
    import transformers

    d = root / "lora" / str(dtype).replace("torch.", "") / family
    d.mkdir(parents=True)
    base, ft, conv1d = pair(family, dtype, d)
    rows = {}
    for rank in (2, 1000):
        out = d / f"r{rank}"
        rc, err = cli("extract-lora", ft, base, "-o", out, "--rank", rank, "--no-write-model-card")
        if rc != 0:
            rows[f"rank {rank}"] = fail(rc, err)
            continue
        report = json.loads((out / "symmerge_report.json").read_text())
        row = {}
        with safe_open(str(out / "adapter_model.safetensors"), "pt") as s:
            row["adapter_dtypes"] = sorted({str(s.get_slice(k).get_dtype()) for k in s.keys()})
        row["input_dtypes"] = on_disk(ft)["dtypes"]
        config = transformers.AutoConfig.from_pretrained(str(base))
        cls = getattr(transformers, config.architectures[0])
        row["error_mismatch"] = recomputed_errors(cls, ft, base, out, report, conv1d)
        row["max_error"] = report["relative_error"]["max"]
        with said() as lines:
            model = cls.from_pretrained(str(base)).eval()
            model = peft.PeftModel.from_pretrained(model, str(out))
        row["peft_lines"] = key_lines(lines) or None
        if rank == 1000:
            with said():
                ref = cls.from_pretrained(str(ft)).float().eval()
            model = model.float().eval()
            inputs = make_inputs(ref)
            row["rel_vs_finetune"] = rel(model_outputs(ref, inputs), model_outputs(model, inputs))
            row["rel_finetune_vs_base"] = rel(model_outputs(ref, inputs),
                                              model_outputs(cls.from_pretrained(str(base)).float(), inputs))
            try:
                with said():
                    merged = model.merge_and_unload()
                row["rel_merged_vs_finetune"] = rel(model_outputs(ref, inputs), model_outputs(merged, inputs))
            except Exception as e:  # noqa: BLE001 — PEFT refusing to merge is the finding
                row["merge_and_unload"] = f"{type(e).__name__}: {e}"[:200]
        rows[f"rank {rank}"] = row
    return rows


def lora_problems(row, dtype) -> list:
    found = []
    if row["peft_lines"]:
        found.append(f"PEFT said {row['peft_lines']}")
    if row["adapter_dtypes"] != row["input_dtypes"]:
        found.append(f"adapter dtypes {row['adapter_dtypes']} for input {row['input_dtypes']}")
    if row["error_mismatch"] > 1e-5:
        found.append(f"report's errors differ from the recomputed ones by {row['error_mismatch']:.2e}")
    if "rel_vs_finetune" in row:
        bound = 1e-5 if dtype == torch.float32 else 0.1 * row["rel_finetune_vs_base"]
        for k in ("rel_vs_finetune", "rel_merged_vs_finetune"):
            if k in row and not row[k] <= bound:
                found.append(f"full rank: {k} {row[k]:.2e} (bound {bound:.1e})")
    if "merge_and_unload" in row:
        found.append(f"PEFT merge_and_unload: {row['merge_and_unload']}")
    return found


def adapter_row(family, dtype, root) -> dict:
    import peft
    import transformers

    d = root / "adapter" / str(dtype).replace("torch.", "") / family
    d.mkdir(parents=True)
    base = make_model(family, head=True, dtype=torch.float32, seed=0).to(dtype)
    base.save_pretrained(str(d / "base"))
    write_tokenizer(d / "base")
    other = make_model(family, head=True, dtype=torch.float32, seed=2).to(dtype)
    other.save_pretrained(str(d / "other"))
    write_tokenizer(d / "other")
    targets = ["q_proj", "v_proj", "down_proj"] if family != "gpt2" else ["c_attn", "c_fc"]
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                          fan_in_fan_out=family == "gpt2")
    torch.manual_seed(3)
    pm = peft.get_peft_model(make_model(family, head=True, dtype=torch.float32, seed=0), cfg)
    pm.to(torch.bfloat16).save_pretrained(str(d / "adapter"))
    cls = type(base)
    with said():
        reference = peft.PeftModel.from_pretrained(cls.from_pretrained(str(d / "base")), str(d / "adapter"))
        reference = reference.merge_and_unload().state_dict()
    spec = f"{d / 'base'}+{d / 'adapter'}"
    config = d / "config.yml"
    config.write_text(f"models:\n  - model: {spec}\n    parameters: {{weight: 1.0}}\nmerge_method: linear\n")
    config2 = d / "config2.yml"
    config2.write_text(f"models:\n  - model: {spec}\n    parameters: {{weight: 0.5}}\n  - model: {d / 'other'}\n"
                       "    parameters: {weight: 0.5}\nmerge_method: linear\n")
    rows = {}
    for name, argv, out in (
            ("merge", ("merge", spec, d / "other", "--method", "average", "--align", "none", "-o", d / "m",
                       "--progress", "none"), d / "m"),
            ("run (weight 1: PEFT's merge)", ("run", config, d / "r1"), d / "r1"),
            ("run (linear)", ("run", config2, d / "r2"), d / "r2")):
        rc, err = cli(*argv)
        if rc != 0:
            rows[name] = fail(rc, err)
            continue
        model, info, lines = load(out)
        row = {**{k: v for k, v in on_disk(out).items() if k != "meta"}, "loading": info or None,
               "transformers_said": lines or None, "input_dtypes": on_disk(d / "base")["dtypes"]}
        row["finite"] = all(torch.isfinite(o).all().item() for o in model_outputs(model.float(), make_inputs(model)))
        if name.startswith("run (weight 1"):
            sd = model.state_dict()
            row["max_abs_vs_peft"] = max((sd[k].double() - v.double()).abs().max().item() for k, v in reference.items()
                                         if k in sd)
        rows[name] = row
    return rows


def loaded_problems(row) -> list:
    """What is wrong with a loaded output: key lines, loading info, non-finite outputs."""
    found = [f"{k}={row[k]}" for k in ("loading", "transformers_said") if row[k]]
    return found + ([] if row["finite"] else ["non-finite outputs"])


def adapter_problems(row, dtype) -> list:
    found = loaded_problems(row)
    if row["dtypes"] != row["input_dtypes"]:
        found.append(f"dtypes {row['input_dtypes']} -> {row['dtypes']}")
    if row.get("max_abs_vs_peft", 0) > 0:
        found.append(f"differs from PEFT's merge_and_unload by {row['max_abs_vs_peft']:.2e}")
    return found


def moe_row(family, dtype, root) -> dict:
    d = root / "moe" / str(dtype).replace("torch.", "") / family
    d.mkdir(parents=True)
    folders = []
    for seed in (0, 1, 2):
        folder = d / f"m{seed}"
        make_model(family, head=True, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(str(folder))
        write_tokenizer(folder)
        folders.append(folder)
    dtype_name = str(dtype).replace("torch.", "")
    rows = {}
    for gate in ("hidden", "cheap_embed", "random"):
        for cfg_dtype in (None, dtype_name, "float32" if dtype_name != "float32" else "bfloat16"):
            text = f"base_model: {folders[0]}\ngate_mode: {gate}\n" + (f"dtype: {cfg_dtype}\n" if cfg_dtype else "")
            text += "experts:\n"
            for folder, prompts in zip(folders[1:], (["the cat sat", "a dog ran"], ["the mat", "slow fast"])):
                text += f"  - source_model: {folder}\n    positive_prompts: {json.dumps(prompts)}\n"
            if family == "qwen2":
                text += f"shared_experts:\n  - source_model: {folders[0]}\n    positive_prompts: [\"the\"]\n"
            name = f"{gate} dtype={cfg_dtype or '(none)'}"
            config, out = d / f"{gate}-{cfg_dtype}.yml", d / f"{gate}-{cfg_dtype}"
            config.write_text(text)
            rc, err = cli("moe", config, out, "--progress", "none")
            if rc != 0:
                rows[name] = fail(rc, err)
                continue
            model, info, lines = load(out)
            disk = on_disk(out)
            row = {"class": type(model).__name__, "dtypes": disk["dtypes"], "config_dtype": disk["config_dtype"],
                   "want": cfg_dtype or dtype_name, "loading": info or None, "transformers_said": lines or None}
            row["finite"] = all(torch.isfinite(o).all().item() for o in model_outputs(model, make_inputs(model)))
            row["want_class"] = "Qwen2MoeForCausalLM" if family == "qwen2" else "MixtralForCausalLM"
            rows[name] = row
    return rows


def moe_problems(row, dtype) -> list:
    found = loaded_problems(row)
    if row["class"] != row["want_class"]:
        found.append(f"class {row['class']}")
    want = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[row["want"]]
    if row["dtypes"] != [want] or row["config_dtype"] != row["want"]:
        found.append(f"dtype {row['dtypes']} (config.json {row['config_dtype']}), config asks {row['want']}")
    return found


PARTS = {"lora": (lora_row, lora_problems, FAMILIES), "adapter": (adapter_row, adapter_problems, ("llama", "gpt2")),
         "moe": (moe_row, moe_problems, ("llama", "mistral", "qwen2"))}


def run_parts(args, root: Path, results: dict) -> int:
    """Every part × dtype × family asked for, its lines printed and its rows put in ``results``; the failing rows."""
    failed = 0
    for part in args.parts.split(","):
        row_fn, problems, families = PARTS[part]
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for family in [f for f in (args.families.split(",") if args.families else families) if f in families]:
                t0 = time.perf_counter()
                try:
                    rows = row_fn(family, dtype, root)
                except Exception as e:  # noqa: BLE001 — the benchmark's own failure is a finding too
                    rows = {"(setup)": {"exit": "EXC", "error": f"{type(e).__name__}: {e}"[:300]}}
                results.setdefault(part, {}).setdefault(dtype_name, {})[family] = rows
                for name, row in rows.items():
                    refused = row.get("exit") == 2 and row["error"].startswith("symmerge: error: ")
                    found = [f"exit {row['exit']}: {row['error']}"] if "exit" in row else problems(row, dtype)
                    failed += bool(found) and not refused
                    fig = "".join(f" {k} {row[k]:.2e}" for k in FIGURES if k in row)
                    said = f"refused in one line: {row['error']}" if refused else "; ".join(found) or "ok"
                    print(f"{part:7s} {dtype_name:9s} {family:18s} {name:28s} {said}{fig}", flush=True)
                print(f"{part:7s} {dtype_name:9s} {family:18s} {time.perf_counter() - t0:.1f} s wall", flush=True)
    return failed


FIGURES = ("max_error", "rel_vs_finetune", "rel_merged_vs_finetune", "max_abs_vs_peft")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--families", help="default: every family the part takes")
    p.add_argument("--parts", default="lora,adapter,moe")
    p.add_argument("--out", help="keep the folders here (default: a temporary folder, removed)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {}
    keep = contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory(prefix="tools-dtype-")
    with keep as root:
        failed = run_parts(args, Path(root), results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, separators=(",", ":"), default=str)
    print(f"{failed} failing row(s) (one-line refusals not counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
