"""Train small ``transformers`` language models from scratch, reproducibly, with a cache.

:func:`train_gpt2` trains a ``GPT2LMHeadModel`` built from a small :class:`GPT2Config`
(:func:`gpt2_config`), :func:`train_lm` any causal LM class its config names (a small Mixtral from
:func:`mixtral_config`: benchmark B6), on token blocks (int (N, T): non-overlapping windows of a token stream, see
:func:`symmerge.demo.text.blocks`) with the loop of :func:`symmerge.demo.train.fit` — fixed seed for
the initialisation and the block order, AdamW with warm-up then cosine decay, gradient clipping,
periodic validation loss. The result is an HF folder with the tokenizer and ``train_report.json``,
cached under ``<cache>/gpt2/<name>-<hash>`` (the hash covers the config, the tokenizer, the blocks, the
seed and every setting) and reused on the next call with the same inputs.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import SymmergeError
from ..io.model import quiet_transformers, save_model
from .train import TrainSettings, cached_build, callers_rng_kept, fit, inputs_key


def gpt2_config(vocab_size: int, context: int = 128, hidden: int = 256, layers: int = 6, heads: int = 4,
                inner: int | None = None, eos_token_id: int = 0, tie: bool = True, initializer_range: float = 0.02):
    """A small ``GPT2Config`` for ``GPT2LMHeadModel`` (FFN width 4·hidden unless given, no dropout,
    the LM head tied to the token embedding unless ``tie`` is False)."""
    from transformers import GPT2Config

    if hidden % heads:
        raise SymmergeError(f"hidden size {hidden} is not divisible by {heads} heads")
    if not 0 <= eos_token_id < vocab_size:
        raise SymmergeError(f"eos token id {eos_token_id} outside the vocabulary of {vocab_size}")
    return GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=hidden, n_layer=layers, n_head=heads,
                      n_inner=inner, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      initializer_range=initializer_range, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
                      pad_token_id=eos_token_id, tie_word_embeddings=tie, architectures=["GPT2LMHeadModel"])


def mixtral_config(vocab_size: int, context: int = 128, hidden: int = 128, layers: int = 4, heads: int = 4,
                   experts: int = 8, top_k: int = 2, inner: int | None = None, eos_token_id: int = 0,
                   initializer_range: float = 0.02):
    """A small ``MixtralConfig`` for ``MixtralForCausalLM``: ``experts`` SwiGLU experts of ``inner`` units
    (default hidden) per layer, ``top_k`` of them per token, untied LM head, no dropout or router jitter;
    the router's load-balancing loss is added in training (``router_aux_loss_coef``, 0.001)."""
    from transformers import MixtralConfig

    if hidden % heads:
        raise SymmergeError(f"hidden size {hidden} is not divisible by {heads} heads")
    if not 0 <= eos_token_id < vocab_size:
        raise SymmergeError(f"eos token id {eos_token_id} outside the vocabulary of {vocab_size}")
    return MixtralConfig(vocab_size=vocab_size, max_position_embeddings=context, hidden_size=hidden,
                         intermediate_size=inner or hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, num_local_experts=experts, num_experts_per_tok=top_k,
                         initializer_range=initializer_range, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
                         pad_token_id=eos_token_id, tie_word_embeddings=False, architectures=["MixtralForCausalLM"])


def lm_scores(model, blocks, batch_size: int = 32) -> tuple[float, float]:
    """(mean next-token cross-entropy, next-token accuracy) of ``model`` on token blocks (eval, no grad)."""
    x = torch.as_tensor(np.asarray(blocks), dtype=torch.int64)
    model.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            ids = x[i:i + batch_size]
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
            target = ids[:, 1:]
            loss += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                      target.reshape(-1), reduction="sum").item()
            correct += (logits.argmax(-1) == target).sum().item()
            count += target.numel()
    if count == 0:
        raise SymmergeError("no tokens to score (blocks of length >= 2 needed)")
    return loss / count, correct / count


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's serialised vocabulary, merges and special tokens."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def llama_config(vocab_size: int, context: int = 128, hidden: int = 256, layers: int = 4, heads: int = 4,
                 kv_heads: int | None = None, inner: int = 688, eos_token_id: int = 0, tie: bool = False,
                 initializer_range: float = 0.02, rope_theta: float = 10000.0):
    """A small ``LlamaConfig`` for ``LlamaForCausalLM`` (RMSNorm, SwiGLU FFN of width ``inner``, RoPE,
    ``kv_heads`` key/value heads — GQA when fewer than ``heads``, MHA by default —, no bias, no
    dropout, an untied LM head unless ``tie``)."""
    from transformers import LlamaConfig

    kv_heads = heads if kv_heads is None else kv_heads
    if hidden % heads or heads % kv_heads:
        raise SymmergeError(f"hidden size {hidden}, {heads} heads and {kv_heads} KV heads do not divide")
    if not 0 <= eos_token_id < vocab_size:
        raise SymmergeError(f"eos token id {eos_token_id} outside the vocabulary of {vocab_size}")
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=context, hidden_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       intermediate_size=inner, hidden_act="silu", attention_dropout=0.0,
                       initializer_range=initializer_range, rope_theta=rope_theta, bos_token_id=eos_token_id,
                       eos_token_id=eos_token_id, pad_token_id=eos_token_id, tie_word_embeddings=tie,
                       architectures=["LlamaForCausalLM"])


def _context(config) -> int:
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def train_gpt2(config, blocks, settings: TrainSettings, tokenizer, name: str = "gpt2", eval_blocks=None,
               eval_every: int = 0, eval_max: int = 128, cache: bool = True, root=None, progress: bool = True,
               log=print) -> Path:
    """Train (or reuse from the cache) a GPT-2 causal LM on ``blocks`` (int (N, T), T <= n_positions,
    ids < vocab_size); returns its HF folder (config, ``model.safetensors``, the tokenizer,
    ``train_report.json``). ``eval_blocks``: validation loss and accuracy every ``eval_every`` steps on
    the first ``eval_max`` of them, and on all of them after training (report only; the training is
    unaffected). ``root``: cache root (default ``<cache_dir()>/gpt2``)."""
    from transformers import GPT2LMHeadModel

    return train_lm(config, blocks, settings, tokenizer, name, eval_blocks, eval_every, eval_max, cache, root,
                    progress, log, subdir="gpt2", kind="gpt2-lm", model_class=GPT2LMHeadModel)


def train_llama(config, blocks, settings: TrainSettings, tokenizer, name: str = "llama", eval_blocks=None,
                eval_every: int = 0, eval_max: int = 128, cache: bool = True, root=None, progress: bool = True,
                log=print) -> Path:
    """:func:`train_gpt2` for a ``LlamaForCausalLM`` (:func:`llama_config`); cached under
    ``<cache_dir()>/llama`` unless ``root``."""
    from transformers import LlamaForCausalLM

    return train_lm(config, blocks, settings, tokenizer, name, eval_blocks, eval_every, eval_max, cache, root,
                    progress, log, subdir="llama", kind="llama-lm", model_class=LlamaForCausalLM)


def train_lm(config, blocks, settings: TrainSettings, tokenizer, name: str = "lm", eval_blocks=None,
             eval_every: int = 0, eval_max: int = 128, cache: bool = True, root=None, progress: bool = True,
             log=print, subdir: str = "lm", kind: str = "causal-lm", train_kwargs: dict | None = None,
             model_class=None) -> Path:
    """The loop of :func:`train_gpt2` / :func:`train_llama` for ``model_class`` (default: the causal LM
    class ``config.architectures[0]`` names), cached under ``<cache_dir()>/<subdir>``; ``kind`` goes into
    the cache key; ``train_kwargs``: extra forward arguments in training (a mixture of experts:
    ``output_router_logits=True`` adds the router's load-balancing loss to the loss)."""
    import transformers

    x = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64))
    if x.ndim != 2 or len(x) == 0 or x.shape[1] < 2:
        raise SymmergeError(f"token blocks must be (N >= 1, T >= 2), got shape {tuple(x.shape)}")
    if x.shape[1] > _context(config):
        raise SymmergeError(f"blocks of {x.shape[1]} tokens exceed the model's context of {_context(config)}")
    if int(x.min()) < 0 or int(x.max()) >= config.vocab_size:
        raise SymmergeError(f"token ids must lie in 0..{config.vocab_size - 1}, got {int(x.min())}..{int(x.max())}")
    if len(tokenizer) != config.vocab_size:
        raise SymmergeError(f"the tokenizer has {len(tokenizer)} tokens, the config {config.vocab_size}")
    extra = {"kind": kind, "tokenizer": tokenizer_hash(tokenizer),
             **({"train_kwargs": train_kwargs} if train_kwargs else {})}
    key = inputs_key(config, settings, [x.numpy()], extra=extra)
    with cached_build(root, subdir, name, key, cache, log) as (out, found), callers_rng_kept():
        if found:
            return out
        torch.manual_seed(settings.seed)
        with quiet_transformers():
            model = (model_class or getattr(transformers, config.architectures[0]))(config).float()

        def batch_loss(idx):
            ids = x[idx]
            return model(input_ids=ids, labels=ids, **(train_kwargs or {})).loss

        def evaluate():
            loss, acc = lm_scores(model, eval_blocks[:eval_max])
            return {"loss": loss, "accuracy": acc}

        report = fit(model, settings, len(x), batch_loss, name, evaluate if eval_blocks is not None else None,
                     eval_every, progress, log)
        report = {"name": name, "key": key, **report, "train_tokens": int(x.numel()),
                  "tokens_seen": settings.steps * min(settings.batch_size, len(x)) * x.shape[1],
                  "tie_word_embeddings": bool(config.tie_word_embeddings)}
        if eval_blocks is not None:
            report["eval_loss"], report["eval_accuracy"] = lm_scores(model, eval_blocks)
            report["eval_tokens"] = int(np.asarray(eval_blocks).size)
        with tempfile.TemporaryDirectory() as side:  # the tokenizer goes into the atomic save, beside the weights
            tokenizer.save_pretrained(side)
            save_model(model, out, src=side, report=report, report_name="train_report.json")
        extra = f", eval loss {report['eval_loss']:.4f}" if "eval_loss" in report else ""
        log(f"trained {name} in {report['seconds']:.0f} s ({report['seconds_per_step']:.3f} s/step){extra} -> {out}")
    return out
