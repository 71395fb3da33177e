"""T5's self-attention heads tied across each stack (``encoder.heads``, ``decoder.heads``), measured on a
Flan-T5-small-sized model (random init of the real ``T5ForConditionalGeneration``: no T5 checkpoint ships in
any package here, see /work/shared/ASSETS.md).

1. Recovery: the anchor disguised by a hidden random element of every group (the tied head permutations
   included) aligns back: distance after / before, the tied permutation found, and the seconds.
2. Two independent inits: the weight matcher's distance after alignment and its seconds with the tied
   groups and without them (the same instances less the tied ones, as before they existed), in one run.

    PYTHONPATH=$PWD python benchmarks/t5_tied_heads.py [--layers 8] [--threads 1]

Prints the figures as JSON (``--out FILE`` also writes them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch


def config(layers: int):
    from transformers import T5Config

    # google/flan-t5-small's shapes (v1.1: gated GELU, untied LM head in its config; transformers 5 ties it)
    return T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=layers, num_decoder_layers=layers,
                    num_heads=6, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128, decoder_start_token_id=0,
                    pad_token_id=0, eos_token_id=1)


def model(layers: int, seed: int):
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(seed)
    m = T5ForConditionalGeneration(config(layers)).eval()
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():  # the norms and the relative bias away from their init (ones; already random)
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.mul_(torch.exp(0.2 * torch.randn(p.shape, generator=g)))
    return m


def run(layers: int) -> dict:
    from symmerge.core.apply import apply, canonicalize, random_elements
    from symmerge.core.distance import sq_distance
    from symmerge.groups.heads import Tied
    from symmerge.pipeline.align import align_pair, instances_for
    from symmerge.pipeline.verify import with_state_dict
    from symmerge.pipeline.engine import solve
    from symmerge.pipeline.options import AlignOptions

    symmetries = ("heads", "attn", "ffn", "rescale", "residual")
    anchor = model(layers, 0)
    out: dict = {"config": {"d_model": 512, "heads": 6, "d_kv": 64, "d_ff": 1024, "layers": f"{layers}+{layers}",
                            "params": sum(p.numel() for p in anchor.parameters())}}
    # 1. recovery of a hidden element of every group
    _, instances = instances_for(anchor)
    wide = [i for i in instances if not i.kind.per_layer]
    canonical = canonicalize(anchor.state_dict(), wide)
    hidden = random_elements(instances, torch.Generator().manual_seed(1))
    disguised = with_state_dict(anchor, apply(canonical, instances, hidden))
    t0 = time.perf_counter()
    result = align_pair(disguised, anchor, AlignOptions(symmetries=symmetries))
    seconds = time.perf_counter() - t0
    r = result.report
    tied = [i for i in instances if isinstance(i.info, Tied)]
    out["recovery"] = {"distance_before": r["distance_before"], "distance_after": r["distance_after"],
                       "relative": r["distance_after"] / r["distance_before"], "seconds": round(seconds, 2),
                       "verify_max_rel_diff": r.get("verify_max_rel_diff"),
                       "tied_heads": {i.name: {"hidden": hidden[i.name].kv.tolist(),
                                               "found": result.elements[i.name].kv.tolist()} for i in tied}}
    # 2. two independent inits: with and without the tied groups (weights matcher, same descent)
    other = model(layers, 1)
    opts = AlignOptions(symmetries=symmetries).solver_options()
    ca, cb = canonicalize(other.state_dict(), wide), canonicalize(anchor.state_dict(), wide)
    keys = sorted({s.key for i in instances for s in i.slots})
    base = math.sqrt(sq_distance(ca, cb, keys))
    pair = {"distance_before": base}
    for label, chosen in (("with_tied", instances), ("without_tied", [i for i in instances if i not in tied])):
        t0 = time.perf_counter()
        history: list = []
        elements = solve(chosen, ca, cb, opts, history=history)
        pair[label] = {"distance_after": math.sqrt(sq_distance(apply(ca, chosen, elements), cb, keys)),
                       "seconds": round(time.perf_counter() - t0, 2), "sweeps": len(history)}
        if label == "with_tied":
            pair[label]["tied_heads"] = {i.name: elements[i.name].kv.tolist() for i in tied}
    out["independent_pair"] = pair
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="layers per stack (Flan-T5-small: 8)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--out", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.layers)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        from pathlib import Path

        from symmerge.io.model import write_json

        write_json(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
