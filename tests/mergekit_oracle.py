"""mergekit 0.1.5 as an oracle: tiny stand-in checkpoints, mergekit's merge of a config, and the distance of
symmerge's result to it.

mergekit runs in-process (its ``run_merge``), so the tests that use it run in the venv that has it
(``.ci/run`` builds ``/tmp/symmerge-mergekit``, which sees the project's packages) and are skipped
elsewhere (:func:`available`). Stand-ins follow ../shared/ASSETS.md: Llama / Mistral / GPT-2 shapes with
hidden 64, a shared WordLevel tokenizer, fine-tunes = base + N(0, ``noise``).

Closeness is measured as ‖ours − theirs‖ / ‖theirs − base‖ over all floating tensors (:func:`relative_gap`):
the share of the merge's own change that the two results disagree on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ARCHS = ("llama", "mistral", "gpt2", "qwen2", "gemma2")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def available() -> bool:
    try:
        import mergekit.merge  # noqa: F401
    except Exception:
        return False
    return True


def _config(arch: str, layers: int, hidden: int = 64):
    """A ``transformers`` config of ``arch``: 4 heads (2 KV heads), ``hidden`` wide, the MLP 2.5 × ``hidden``."""
    from transformers import Gemma2Config, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    inter = hidden * 5 // 2
    if arch == "llama":
        return LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=False)
    if arch == "mistral":
        return MistralConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             sliding_window=None, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=False)
    if arch == "gemma2":
        return Gemma2Config(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                            max_position_embeddings=64, sliding_window=32)
    if arch == "gpt2":
        return GPT2Config(vocab_size=128, n_embd=hidden, n_layer=layers, n_head=4, n_positions=64)
    raise ValueError(arch)


def save_tokenizer(folder: Path, vocab_size: int = 128) -> None:
    """A WordLevel tokenizer of ``vocab_size`` tokens (ids 0..vocab_size-1), as transformers saves it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def family(root, arch: str = "llama", dtype: str = "float32", n: int = 2, layers: int = 4, noise: float = 0.004,
           seed: int = 0, hidden: int = 64) -> tuple[Path, list[Path]]:
    """(base folder, ``n`` fine-tune folders) of a tiny ``arch`` model (``hidden`` wide) stored in ``dtype``;
    fine-tune i is the base plus N(0, ``noise``) noise on every floating tensor (seed ``seed + 1 + i``)."""
    from transformers import AutoModelForCausalLM

    root = Path(root)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, layers, hidden), dtype=torch.float32)
    base_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    paths = []
    for i in range(n + 1):
        sd = base_sd
        if i > 0:
            g = torch.Generator().manual_seed(seed + i)
            sd = {k: (v + noise * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v
                  for k, v in base_sd.items()}
        model.load_state_dict(sd)
        folder = root / ("base" if i == 0 else f"ft{i}")
        model.to(DTYPES[dtype]).save_pretrained(str(folder))
        model.to(torch.float32)
        save_tokenizer(folder)
        paths.append(folder)
    return paths[0], paths[1:]


def run_mergekit(config, out, seed: int = 0) -> Path:
    """mergekit's merge of ``config`` (a dict, or YAML text) into ``out``, randomised methods seeded by ``seed``."""
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    if isinstance(config, dict):
        config = yaml.safe_dump(config)
    torch.manual_seed(seed)
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(config)), str(out),
              options=MergeOptions(copy_tokenizer=True, lazy_unpickle=False, random_seed=seed, quiet=True))
    return Path(out)


def tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder, under its stored name."""
    from safetensors.torch import load_file

    folder = Path(folder)
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def config_of(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def relative_gap(ours: dict, theirs: dict, base: dict | None = None) -> float:
    """‖ours − theirs‖ / ‖theirs − base‖ over the floating tensors of ``theirs`` (``base`` None: / ‖theirs‖);
    the two must hold the same names and shapes."""
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:5]
    num = den = 0.0
    for k, t in theirs.items():
        if not t.is_floating_point():
            assert torch.equal(ours[k], t), k
            continue
        assert ours[k].shape == t.shape, (k, ours[k].shape, t.shape)
        num += float((ours[k].double() - t.double()).pow(2).sum())
        ref = t.double() - (base[k].double() if base is not None and k in base else 0.0)
        den += float(ref.pow(2).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def dtype_rounding(dtype: str) -> float:
    """The relative rounding of one value in ``dtype`` (half an ulp at 1)."""
    return {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dtype]
