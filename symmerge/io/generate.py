"""Alignment data without a corpus: token sequences sampled from the causal LMs being aligned.

``--align-data generate[:N[:LEN[:SEED]]]`` (:func:`parse_generate`) stands for ``N`` sequences of
``LEN`` tokens (defaults :data:`DEFAULT_SEQUENCES`, :data:`DEFAULT_LENGTH`, seed 0), sampled from the models themselves
(:func:`generate_data`): the sequences are shared out round-robin over the models (two models: half
from each, each model's share in one batch), every one starts from the model's BOS token (else EOS, else
a random token), and each next token is drawn from the model's softmax at temperature 1 (no top-k /
top-p), with the model's KV cache, by the Gumbel-max rule (``argmax(logits − log(−log u))``, ``u``
uniform: an exact draw from the softmax, cheaper than ``torch.multinomial``). The draws come from one
``torch.Generator`` seeded with ``SEED``: the same models and seed give the same tokens.

The defaults, 256 sequences of 16 tokens, are the recipe measured on B7 (docs/results.md, "B7 without
a corpus"): many short sequences fit the residual stream as well as fewer long ones for the same number
of tokens, at a fraction of the sampling steps (one forward per token position).
The result is an unlabeled ``lm`` :class:`~symmerge.io.data.Data` (every token real: no padding), which
the activation statistics, the learned alignment and REPAIR read as they read a ``.txt`` file.

Only models with a causal-LM head can generate; any other raises one :class:`SymmergeError`.
"""

from __future__ import annotations

import torch

from ..errors import SymmergeError
from ..progress import bar
from .data import Batch, Data, head_kind

PREFIX = "generate"
DEFAULT_SEQUENCES = 256
DEFAULT_LENGTH = 16
DEFAULT_SEED = 0


def is_generate(spec) -> bool:
    """Whether an ``--align-data`` value asks for generated sequences (``generate`` or ``generate:...``)."""
    return isinstance(spec, str) and (spec == PREFIX or spec.startswith(PREFIX + ":"))


def parse_generate(spec: str) -> tuple[int, int, int]:
    """``generate[:N[:LEN[:SEED]]]`` → (N, LEN, SEED), else one clear error."""
    parts = spec.split(":")
    if parts[0] != PREFIX or len(parts) > 4:
        raise SymmergeError(f"--align-data {spec!r}: expected generate[:N[:LEN[:SEED]]] (N sequences of LEN tokens)")
    values = [DEFAULT_SEQUENCES, DEFAULT_LENGTH, DEFAULT_SEED]
    for i, (text, what) in enumerate(zip(parts[1:], ("N (sequences)", "LEN (tokens per sequence)", "SEED"))):
        try:
            values[i] = int(text)
        except ValueError:
            raise SymmergeError(f"--align-data {spec!r}: {what} must be a whole number, got {text!r}") from None
    n, length, seed = values
    if n < 1:
        raise SymmergeError(f"--align-data {spec!r}: N must be >= 1, got {n}")
    if length < 2:
        raise SymmergeError(f"--align-data {spec!r}: LEN must be >= 2 tokens, got {length}")
    if seed < 0:
        raise SymmergeError(f"--align-data {spec!r}: SEED must be >= 0, got {seed}")
    if seed >= 2 ** 64:  # torch.Generator's seed is 64 bits
        raise SymmergeError(f"--align-data {spec!r}: SEED must be below 2**64, got {seed}")
    if n * length >= 2 ** 63:
        raise SymmergeError(f"--align-data {spec!r}: N x LEN must be below 2**63 tokens, got {n} x {length}")
    return n, length, seed


def check_generator(model, spec: str = PREFIX) -> None:
    """A causal language model (an LM head reading the tokens before), else one clear error."""
    config = model.config
    if head_kind(model) != "lm" or getattr(config, "is_encoder_decoder", False) or not hasattr(config, "vocab_size"):
        raise SymmergeError(f"--align-data {spec}: generating alignment data needs causal language models "
                            f"(an LM head, e.g. LlamaForCausalLM), got {type(model).__name__}; "
                            "give a data file instead")


def _start_token(config) -> int | None:
    for name in ("bos_token_id", "eos_token_id"):
        t = getattr(config, name, None)
        t = t[0] if isinstance(t, (list, tuple)) and t else t
        if isinstance(t, int) and 0 <= t < config.vocab_size:
            return t
    return None


def cache_argument(model) -> str:
    """The forward's KV-cache keyword (``cache`` in transformers 5, ``past_key_values`` before), which is
    also the output's field."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def draw(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(n, 1) token ids drawn from ``softmax(logits)`` (n, vocab) by the Gumbel-max rule."""
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64).clamp_(min=1e-300)
    return (logits.double() - u.log_().neg_().log_()).argmax(-1, keepdim=True)


@torch.no_grad()
def sample(model, n: int, length: int, generator: torch.Generator, progress: bool = False,
           desc: str = "generating") -> torch.Tensor:
    """(n, length) token ids: the start token, then ``length - 1`` tokens drawn from ``model`` at
    temperature 1 (:func:`draw`), one at a time over the KV cache; ``progress``: a bar over the token
    positions (:func:`symmerge.progress.bar`)."""
    config = model.config
    first = _start_token(config)
    if first is None:
        ids = torch.randint(config.vocab_size, (n, 1), generator=generator)
    else:
        ids = torch.full((n, 1), first, dtype=torch.long)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and length > limit:
        raise SymmergeError(f"--align-data generate: LEN {length} exceeds the model's context "
                            f"(max_position_embeddings {limit})")
    out = [ids]
    name = cache_argument(model)
    past, step = None, ids
    was_training = model.training
    model.eval()
    try:
        for _ in bar(range(length - 1), enabled=progress, desc=desc, unit="tokens"):
            res = model(input_ids=step, use_cache=True, **{name: past})
            past = res.get(name)
            if past is None:
                raise SymmergeError(f"--align-data generate: {type(model).__name__} returned no KV cache")
            step = draw(res.logits[:, -1], generator)
            out.append(step)
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)


def generate_data(models, n: int = DEFAULT_SEQUENCES, length: int = DEFAULT_LENGTH, seed: int = DEFAULT_SEED,
                  batch_size: int = 32, spec: str | None = None, progress: bool = True) -> Data:
    """``n`` sequences of ``length`` tokens sampled from ``models`` (round-robin: sequence i from model
    i mod len(models)), as unlabeled ``lm`` data in batches of ``batch_size``. Deterministic in ``seed``.
    ``progress``: one bar per model over the token positions (in a log: a line per model, and the
    heartbeat while one runs)."""
    models = list(models)
    spec = spec or f"{PREFIX}:{n}:{length}"
    if not models:
        raise SymmergeError(f"--align-data {spec}: no model to generate from")
    for m in models:
        check_generator(m, spec)
    vocab = {int(m.config.vocab_size) for m in models}
    if len(vocab) > 1:
        raise SymmergeError(f"--align-data {spec}: the models' vocabularies differ in size ({sorted(vocab)})")
    if batch_size < 1:
        raise SymmergeError(f"batch size must be >= 1, got {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    counts = [len(range(i, n, len(models))) for i in range(len(models))]
    k = len(models)
    drawn = [sample(m, c, length, generator, progress=progress,
                    desc=f"{spec}: {c} sequences of {length} tokens from model {i + 1}/{k}") if c else None
             for i, (m, c) in enumerate(zip(models, counts))]
    rows = torch.empty(n, length, dtype=torch.long)
    for i, ids in enumerate(drawn):
        if ids is not None:
            rows[i::len(models)] = ids
    batches = [Batch({"input_ids": rows[i:i + batch_size], "attention_mask": torch.ones_like(rows[i:i + batch_size])},
                     None, torch.ones(rows[i:i + batch_size].shape, dtype=torch.bool))
               for i in range(0, n, batch_size)]
    return Data(spec, "lm", batches, n, labeled=False)
