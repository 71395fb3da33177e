"""An alignment of float16 checkpoints that moves a value past float16's range (65504) is one error naming the
tensor, in memory and streamed, with nothing written: the result was rounded to float16 and written with Inf (exit
0; the loaded model's logits were NaN)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import run_cli, write_tokenizer
from factories import make_model
from learned_pair import LINES

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """B holds 65504 (float16's largest) in a query row; A is B with that RoPE pair of rows turned by 45° (in q
    and k: the same function) and its queries scaled by 1.003 (k by 1/1.003): aligning A to B turns the pair back,
    to 65504 x 1.003."""
    root = tmp_path_factory.mktemp("half-range")
    b = make_model("llama", head=True, dtype=torch.float32, seed=0)
    q, k = b.model.layers[0].self_attn.q_proj.weight, b.model.layers[0].self_attn.k_proj.weight
    half = b.config.head_dim // 2  # HF's rotary pairs: (i, i + head_dim / 2) within a head
    with torch.no_grad():
        q[0, 5], q[half, 5] = 65504.0, 0.0
        b.half().save_pretrained(root / "b")
        a = make_model("llama", head=True, dtype=torch.float32, seed=0)
        a.load_state_dict(b.float().state_dict())
        c = s = math.sqrt(0.5)
        for w in (a.model.layers[0].self_attn.q_proj.weight, a.model.layers[0].self_attn.k_proj.weight):
            x, y = w[0].clone(), w[half].clone()
            w[0], w[half] = c * x - s * y, s * x + c * y
        a.model.layers[0].self_attn.q_proj.weight.mul_(1.003)
        a.model.layers[0].self_attn.k_proj.weight.div_(1.003)
        a.half().save_pretrained(root / "a")
    for name in ("a", "b"):
        write_tokenizer(root / name)
    (root / "lines.txt").write_text("\n".join(LINES) + "\n")
    return root / "a", root / "b"


LEARNED = ["--stream", "--match", "learned", "--learn-start", "weights", "--learn-steps", "1", "--learn-batch", "4"]


@pytest.mark.parametrize("flags", [[], ["--stream"], LEARNED])
def test_a_value_past_float16_s_range_is_one_error(pair, tmp_path, capsys, flags):
    """Streamed learned: the written folder was verified against A at 1e-4, so the Inf failed as 'not
    equivalent: nan'; it is now verified before the rounding, and the rounding is checked on its own."""
    a, b = pair
    if "learned" in flags:
        flags = [*flags, "--align-data", a.parent / "lines.txt"]
    assert run_cli("align", a, b, "-o", tmp_path / "out", "--symmetries", "attn", "-q", *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("symmerge: error: model.layers.0.self_attn.q_proj.weight: the aligned tensor does not fit "
                          "in float16") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*symmerge-tmp*"))
