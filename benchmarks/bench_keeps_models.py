"""What leaving a caller's models as they came costs (``symmerge.io.arguments.keeps_models``, on every public entry
and documented helper, nested: ``barrier_study`` → ``repaired_curve`` → ``interpolation_curve`` → ``evaluate`` per
α): the note of a model's modules, tensors and modes before a call and the restore after it, against one forward pass
of a small batch through the same model, on random-init Llama shapes (the issue-42 scale points). Printed per size:
parameters, seconds per note + restore (median of ``--repeat``), seconds per forward of ``--batch`` × ``--tokens``
tokens, and their ratio.

    python -m benchmarks.bench_keeps_models --sizes 135m,360m --repeat 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import machine

SHAPES = {  # hidden, layers, intermediate, heads, kv heads (SmolLM2 135M / 360M, a 1 B Llama)
    "135m": (576, 30, 1536, 9, 3),
    "360m": (960, 32, 2560, 15, 5),
    "1b": (2048, 16, 8192, 32, 8),
    "tiny": (64, 2, 128, 4, 2),  # the smoke test's
}


def _model(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers, inter, heads, kv = SHAPES[size]
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=49152,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model.to_empty(device="cpu").eval()


def measured(size: str, repeat: int, batch: int, tokens: int) -> dict:
    """One size's row: parameters, the median note + restore and forward seconds, their ratio."""
    from symmerge.io.arguments import _held, _restore
    model = _model(size)
    kept = []
    for _ in range(repeat):
        t = time.perf_counter()
        _restore(_held(model))
        kept.append(time.perf_counter() - t)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens))
    with torch.inference_mode():
        model(ids)
        fwd = []
        for _ in range(3):
            t = time.perf_counter()
            model(ids)
            fwd.append(time.perf_counter() - t)
    k, f = statistics.median(kept), statistics.median(fwd)
    return {"size": size, "params": sum(p.numel() for p in model.parameters()), "kept_s": k, "forward_s": f,
            "ratio": k / f}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="135m,360m")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    print(machine())
    print(f"{'size':>5} {'params':>12} {'note+restore s':>15} {'forward s':>10} {'ratio':>8}")
    for size in args.sizes.split(","):
        r = measured(size, args.repeat, args.batch, args.tokens)
        print(f"{size:>5} {r['params']:>12,} {r['kept_s']:>15.5f} {r['forward_s']:>10.3f} {r['ratio']:>8.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
