"""LoRA tools against mergekit 0.1.5: ``extract-lora`` and a merge whose input is ``base+adapter``, on a ~50 M-parameter
Llama stand-in, in one run, alternating.

    python -m benchmarks.bench_lora [--dir /tmp/symmerge-bench-lora] [--repeats 1] [--rank 32] [--json out.json] [--tiny]

Inputs (generated once into ``--dir``, reused): a random Llama (hidden 512, 12 layers, FFN 1408, vocabulary 8192,
untied head: 48.6 M parameters, float32), a full fine-tune of it (every tensor + Gaussian noise of 1 % of its
standard deviation) and a PEFT LoRA adapter of it (r = 16 on every linear layer, made by PEFT, factors moved off
their initial values). ``--tiny``: hidden 64, 2 layers (the smoke test).

Measured, every run a child process (wall from here; CPU and peak RSS from ``wait4`` of that child):

* ``extract``: ``symmerge extract-lora FT BASE -o OUT --rank R`` against ``mergekit-extract-lora --model FT
  --base-model BASE --out-path OUT --max-rank R``; whether the adapters agree (largest relative difference of the
  per-layer products B·A, and whole tensors equal);
* ``extract-lowrank``: the same with ``--svd lowrank`` (randomized), against the same mergekit run; its mean
  relative error beside the full SVD's;
* ``lora-input``: ``symmerge run`` of a config averaging ``base+adapter`` with the fine-tune against ``mergekit-yaml``
  of the same config, each with a fresh ``--lora-merge-cache``; whether the outputs are equal bit for bit.

Ratios are symmerge / mergekit medians of the same run. mergekit from ``--mergekit-bin`` (default the venv
``.ci/run`` builds); without it only symmerge's figures are printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_merge import measure, python_env

SIZES = {"standin": dict(hidden=512, layers=12, ffn=1408, vocab=8192, heads=8),
         "tiny": dict(hidden=64, layers=2, ffn=128, vocab=256, heads=4)}


def child_generate(root: str, size: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    s = SIZES[size]
    root = Path(root)
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(root / "base"))
    g = torch.Generator().manual_seed(1)
    sd = {k: v + 0.01 * v.std().nan_to_num(0.02).clamp_min(1e-3) * torch.randn(v.shape, generator=g)
          for k, v in model.state_dict().items()}
    ft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ft.load_state_dict(sd)
    ft.save_pretrained(str(root / "ft"))
    pm = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.mul_(0.1)
    pm.save_pretrained(str(root / "adapter"))
    print(json.dumps({"parameters": sum(v.numel() for v in sd.values())}))


def child_compare(kind: str, a: str, b: str) -> None:
    """``extract``: the largest relative difference of B·A per layer and whether whole tensors are equal;
    ``merge``: whether two model folders are equal bit for bit."""
    import torch
    from safetensors.torch import load_file

    def load(folder):
        out = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    x, y = load(a), load(b)
    if kind == "merge":
        print(json.dumps({"equal": x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)}))
        return
    worst, whole = 0.0, True
    for k in x:
        if k.endswith("lora_A.weight"):
            kb = k.replace("lora_A", "lora_B")
            p, q = x[kb] @ x[k], y[kb] @ y[k]
            worst = max(worst, float((p - q).norm() / q.norm().clamp_min(1e-30)))
        elif "lora_" not in k:
            whole &= torch.equal(x[k], y[k])
    print(json.dumps({"same_keys": x.keys() == y.keys(), "max_product_difference": worst, "whole_equal": whole}))


def run_child(*args) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_lora", "--child", *args], capture_output=True,
                         text=True, env=python_env(), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/symmerge-bench-lora")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--mergekit-bin", default="/tmp/symmerge-mergekit/bin")
    p.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        if args.child[0] == "generate":
            child_generate(*args.child[1:])
        else:
            child_compare(*args.child[1:])
        return 0
    size = "tiny" if args.tiny else "standin"
    root = Path(args.dir) / size
    if not (root / "adapter" / "adapter_config.json").is_file():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        run_child("generate", str(root), size)
    mk = Path(args.mergekit_bin)
    have_mk = (mk / "mergekit-extract-lora").is_file() and (mk / "mergekit-yaml").is_file()
    work = root / "runs"
    env = python_env()
    sym = [sys.executable, "-m", "symmerge.cli"]
    config = root / "lora_input.yml"
    config.write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {root / 'base'}+{root / 'adapter'}\n"
                      f"    parameters: {{weight: 0.5}}\n  - model: {root / 'ft'}\n    parameters: {{weight: 0.5}}\n")
    rows: dict = {"extract": {"symmerge": [], "mergekit": []}, "extract-lowrank": {"symmerge": [], "mergekit": []},
                  "lora-input": {"symmerge": [], "mergekit": []}}
    checks: dict = {}
    for i in range(args.repeats):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        rows["extract"]["symmerge"].append(measure(sym + ["extract-lora", str(root / "ft"), str(root / "base"), "-o",
                                                          str(work / "s_ad"), "--rank", str(args.rank),
                                                          "--progress", "none"], env=env))
        rows["extract-lowrank"]["symmerge"].append(measure(sym + ["extract-lora", str(root / "ft"), str(root / "base"),
                                                                  "-o", str(work / "s_low"), "--rank", str(args.rank),
                                                                  "--svd", "lowrank", "--progress", "none"], env=env))
        rows["lora-input"]["symmerge"].append(measure(sym + ["run", str(config), str(work / "s_m"), "--lora-merge-cache",
                                                             str(work / "s_cache"), "--progress", "none"], env=env))
        if have_mk:
            rows["extract"]["mergekit"].append(measure([str(mk / "mergekit-extract-lora"), "--model", str(root / "ft"),
                                                        "--base-model", str(root / "base"), "--out-path",
                                                        str(work / "m_ad"), "--max-rank", str(args.rank), "--quiet"]))
            rows["extract-lowrank"]["mergekit"].append(rows["extract"]["mergekit"][-1])  # against the same run
            rows["lora-input"]["mergekit"].append(measure([str(mk / "mergekit-yaml"), str(config), str(work / "m_m"),
                                                           "--lora-merge-cache", str(work / "m_cache"), "--quiet"]))
            if i == 0:
                checks["extract"] = run_child("compare", "extract", str(work / "s_ad"), str(work / "m_ad"))
                errors = [json.loads((work / d / "symmerge_report.json").read_text())["relative_error"]["mean"]
                          for d in ("s_low", "s_ad")]
                checks["extract-lowrank"] = {"mean_error": errors[0], "mean_error_full_svd": errors[1]}
                checks["lora-input"] = run_child("compare", "merge", str(work / "s_m"), str(work / "m_m"))
    result = {"size": size, "rank": args.rank, "repeats": args.repeats, "rows": {}, "checks": checks}
    print(f"LoRA tools, {size} Llama ({SIZES[size]}), rank {args.rank}, {args.repeats} repeat(s)")
    print(f"{'task':<16} {'symmerge s':>10} {'mergekit s':>10} {'wall ratio':>10} {'sym RSS GB':>10} "
          f"{'mk RSS GB':>10} {'RSS ratio':>9}")
    for task, r in rows.items():
        s_wall = statistics.median(x["wall_s"] for x in r["symmerge"])
        s_rss = statistics.median(x["peak_rss_gb"] for x in r["symmerge"])
        row = {"symmerge_wall_s": s_wall, "symmerge_peak_rss_gb": s_rss}
        if r["mergekit"]:
            m_wall = statistics.median(x["wall_s"] for x in r["mergekit"])
            m_rss = statistics.median(x["peak_rss_gb"] for x in r["mergekit"])
            row.update(mergekit_wall_s=m_wall, mergekit_peak_rss_gb=m_rss, wall_ratio=s_wall / m_wall,
                       rss_ratio=s_rss / m_rss)
            print(f"{task:<16} {s_wall:>10.2f} {m_wall:>10.2f} {s_wall / m_wall:>10.2f} {s_rss:>10.3f} {m_rss:>10.3f} "
                  f"{s_rss / m_rss:>9.2f}")
        else:
            print(f"{task:<16} {s_wall:>10.2f} {'-':>10} {'-':>10} {s_rss:>10.3f} {'-':>10} {'-':>9}")
        result["rows"][task] = row
    if checks:
        print(f"agreement: extract {checks['extract']}; lora-input {checks['lora-input']}; extract-lowrank "
              f"{checks['extract-lowrank']}")
    else:
        print(f"note: mergekit not found in {mk}: symmerge's figures only")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
