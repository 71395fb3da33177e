"""Tiny random models of every supported family (the real ``transformers`` classes), one factory each,
and the one ``disguised`` helper: a model moved by a hidden random group element (+ noise).

Every 1-D parameter (biases, norm weights) is randomised too, so that bias and norm handling is
exercised (transformers initialises biases to zero and norms to one).
"""

from __future__ import annotations

import torch

from conftest import add_noise, with_weights

HIDDEN, HEADS, FFN, VOCAB, LAYERS = 24, 3, 40, 60, 2
DEC_HIDDEN, DEC_HEADS, DEC_KV = 32, 4, 2


def _encoder(config_cls, **kw):
    common = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                  initializer_range=0.35, vocab_size=VOCAB, max_position_embeddings=40)
    return config_cls(**{**common, **kw})


def _configs():
    import transformers as T

    deberta = dict(relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16,
                   position_biased_input=False)
    decoder = dict(vocab_size=64, hidden_size=DEC_HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=DEC_HEADS, num_key_value_heads=DEC_KV, initializer_range=0.3,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        # name: (config factory, base class, task class)
        "bert": (lambda: _encoder(T.BertConfig), T.BertModel, T.BertForSequenceClassification),
        "roberta": (lambda: _encoder(T.RobertaConfig, pad_token_id=1), T.RobertaModel,
                    T.RobertaForSequenceClassification),
        "electra": (lambda: _encoder(T.ElectraConfig, embedding_size=HIDDEN), T.ElectraModel,
                    T.ElectraForSequenceClassification),
        "distilbert": (lambda: T.DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                                                  hidden_dim=FFN, max_position_embeddings=40, initializer_range=0.35),
                       T.DistilBertModel, T.DistilBertForSequenceClassification),
        # DeBERTa-v2 with separate relative-position projections (pos_key_proj / pos_query_proj) ...
        "deberta-v2": (lambda: _encoder(T.DebertaV2Config, share_att_key=False, **deberta), T.DebertaV2Model,
                       T.DebertaV2ForSequenceClassification),
        # ... and DeBERTa-v3 style: shared keys, log buckets, LayerNorm on the relative embeddings
        "deberta-v2-shared": (lambda: _encoder(T.DebertaV2Config, share_att_key=True, position_buckets=8,
                                               norm_rel_ebd="layer_norm", **deberta),
                              T.DebertaV2Model, T.DebertaV2ForSequenceClassification),
        "vit": (lambda: T.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    intermediate_size=FFN, initializer_range=0.35, image_size=8, patch_size=4,
                                    num_channels=3),
                T.ViTModel, T.ViTForImageClassification),
        "gpt2": (lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=32,
                                      initializer_range=0.3, bos_token_id=0, eos_token_id=0),
                 T.GPT2Model, T.GPT2LMHeadModel),
        "llama": (lambda: T.LlamaConfig(**decoder), T.LlamaModel, T.LlamaForCausalLM),
        "llama-bias": (lambda: T.LlamaConfig(**decoder, attention_bias=True, mlp_bias=True), T.LlamaModel,
                       T.LlamaForCausalLM),
        "mistral": (lambda: T.MistralConfig(**decoder), T.MistralModel, T.MistralForCausalLM),
        "qwen2": (lambda: T.Qwen2Config(**decoder), T.Qwen2Model, T.Qwen2ForCausalLM),
        # Qwen3Config defaults to head_dim 128 whatever the hidden size
        "qwen3": (lambda: T.Qwen3Config(**decoder, head_dim=DEC_HIDDEN // DEC_HEADS), T.Qwen3Model, T.Qwen3ForCausalLM),
        "phi": (lambda: T.PhiConfig(**decoder, partial_rotary_factor=0.5), T.PhiModel, T.PhiForCausalLM),
        **_dense_configs(T, decoder),
        **_moe_configs(T, decoder),
        **_stack_configs(T),
    }


def _stack_configs(T) -> dict:
    """Families with several layer stacks: T5 v1.1 (gated GELU; 2 encoder and 3 decoder layers), T5 v1.0
    (ReLU), mT5."""
    t5 = dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=FFN, num_layers=LAYERS, num_decoder_layers=LAYERS + 1,
              num_heads=HEADS, relative_attention_num_buckets=8, relative_attention_max_distance=20,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return {
        # v1.1 / Flan: gated GELU, no d^-0.5 scaling of the decoder output (transformers ties the LM head anyway)
        "t5": (lambda: T.T5Config(**t5, feed_forward_proj="gated-gelu", tie_word_embeddings=False), T.T5EncoderModel,
               T.T5ForConditionalGeneration),
        "t5-relu": (lambda: T.T5Config(**t5, feed_forward_proj="relu"), T.T5Model, T.T5ForConditionalGeneration),
        "mt5": (lambda: T.MT5Config(**t5, feed_forward_proj="gated-gelu"), T.MT5EncoderModel,
                T.MT5ForConditionalGeneration),
        # CLIP: towers of different widths, heads and depths; a single tower is the base model
        "clip": (lambda: T.CLIPConfig(text_config=_clip_text(), vision_config=_clip_vision(), projection_dim=12,
                                      initializer_factor=2.0),
                 lambda c: T.CLIPTextModel(c.text_config), T.CLIPModel),
        "clip_text": (lambda: T.CLIPTextConfig(**_clip_text()), T.CLIPTextModel, T.CLIPTextModelWithProjection),
        "clip_vision": (lambda: T.CLIPVisionConfig(**_clip_vision()), T.CLIPVisionModel, T.CLIPVisionModelWithProjection),
    }


def _clip_text() -> dict:
    return dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                vocab_size=VOCAB, max_position_embeddings=16, projection_dim=12, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, initializer_factor=2.0)


def _clip_vision() -> dict:
    return dict(hidden_size=20, num_hidden_layers=LAYERS + 1, num_attention_heads=4, intermediate_size=28,
                image_size=8, patch_size=4, num_channels=3, projection_dim=12, initializer_factor=2.0)


def _moe_configs(T, decoder: dict) -> dict:
    """Mixtures of experts: 4 experts of 16 units, top-2; the routing normalisation both ways."""
    moe = {**decoder, "intermediate_size": 16, "num_experts_per_tok": 2}
    qwen = dict(num_experts=4, moe_intermediate_size=16, head_dim=DEC_HIDDEN // DEC_HEADS)
    return {
        "mixtral": (lambda: T.MixtralConfig(**moe, num_local_experts=4), T.MixtralModel, T.MixtralForCausalLM),
        "qwen2_moe": (lambda: T.Qwen2MoeConfig(**moe, **qwen, shared_expert_intermediate_size=20, norm_topk_prob=False),
                      T.Qwen2MoeModel, T.Qwen2MoeForCausalLM),
        "qwen3_moe": (lambda: T.Qwen3MoeConfig(**moe, **qwen, norm_topk_prob=True), T.Qwen3MoeModel,
                      T.Qwen3MoeForCausalLM),
        "olmoe": (lambda: T.OlmoeConfig(**moe, num_experts=4, norm_topk_prob=False), T.OlmoeModel, T.OlmoeForCausalLM),
    }


def _dense_configs(T, decoder):
    """Gemma 1-3, GPT-NeoX, Phi-3, OLMo 2 (issue 22). Gemma defaults to head_dim 256: set to d / H."""
    head_dim = DEC_HIDDEN // DEC_HEADS
    gemma = dict(decoder, head_dim=head_dim)
    sandwich = dict(gemma, query_pre_attn_scalar=head_dim, sliding_window=6, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0)
    neox = dict(vocab_size=64, hidden_size=DEC_HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=DEC_HEADS, rotary_pct=0.5, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
                attention_bias=True)
    return {
        "gemma": (lambda: T.GemmaConfig(**gemma), T.GemmaModel, T.GemmaForCausalLM),
        "gemma2": (lambda: T.Gemma2Config(**sandwich), T.Gemma2Model, T.Gemma2ForCausalLM),
        "gemma3": (lambda: T.Gemma3TextConfig(**sandwich), T.Gemma3TextModel, T.Gemma3ForCausalLM),
        "gpt_neox": (lambda: T.GPTNeoXConfig(**neox), T.GPTNeoXModel, T.GPTNeoXForCausalLM),
        "gpt_neox-serial": (lambda: T.GPTNeoXConfig(**neox, use_parallel_residual=False), T.GPTNeoXModel,
                            T.GPTNeoXForCausalLM),
        "phi3": (lambda: T.Phi3Config(**decoder, partial_rotary_factor=0.5), T.Phi3Model, T.Phi3ForCausalLM),
        "olmo2": (lambda: T.Olmo2Config(**decoder), T.Olmo2Model, T.Olmo2ForCausalLM),
    }


DENSE = ("gemma", "gemma2", "gemma3", "gpt_neox", "gpt_neox-serial", "phi3", "olmo2")


FAMILIES = ("bert", "roberta", "electra", "distilbert", "deberta-v2", "deberta-v2-shared", "vit", "gpt2", "llama",
            "llama-bias", "mistral", "qwen2", "qwen3", "phi") + DENSE
DECODERS = ("gpt2", "llama", "llama-bias", "mistral", "qwen2", "qwen3", "phi") + DENSE
RMSNORM = ("llama", "llama-bias", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # mixtures of experts (decoders with RMSNorm)
FAMILIES += MOE
DECODERS += MOE
RMSNORM += MOE
PRE_LAYERNORM = ("vit", "gpt2", "phi", "gpt_neox", "gpt_neox-serial")  # pre-LN LayerNorm: O(d-1) after folding
# ("largest"), or permutations
WRITER_NORMS = ("gemma2", "gemma3", "olmo2")  # norms on the blocks' outputs: signed permutations of the stream
STACKS = ("t5", "t5-relu", "mt5", "clip")  # several layer stacks (encoder-decoder, two towers)
FAMILIES += STACKS + ("clip_text", "clip_vision")
RMSNORM += ("t5", "t5-relu", "mt5")
PRE_LAYERNORM += ("clip", "clip_text", "clip_vision")
TIED_FINAL_NORM = ("t5", "t5-relu", "mt5")  # the LM head is always tied, the decoder's final norm cannot fold
INPUT_NORMS = ("clip_vision",)  # a norm on the embeddings' sum (CLIP's pre_layrnorm): a permutation stream
WITH_RESIDUAL = FAMILIES  # every family's task models have a residual-stream group


def make_model(family: str, head: bool = False, dtype=torch.float64, seed: int = 0, tied: bool | None = None,
               **overrides):
    """A tiny random model of ``family`` (base model, or with its task head: sequence or image
    classification for encoders, the LM head for decoders). ``tied``: tie the LM head to the
    embeddings (decoders; default untied)."""
    config_fn, base_cls, head_cls = _configs()[family]
    config = config_fn()
    for k, v in overrides.items():
        setattr(config, k, v)
    if family in DECODERS:
        config.tie_word_embeddings = bool(tied)
    if head and family not in DECODERS:
        config.num_labels = 3
    if family in MOE and dtype == torch.float64:  # the default grouped_mm experts take no float64
        config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = (head_cls if head else base_cls)(config)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.to(dtype).eval()


def disguised(anchor, symmetries=("heads", "attn", "ffn", "rescale", "residual", "experts"), seed: int = 1, noise: float = 0.0,
              residual: str = "largest"):
    """``(model, noise norm, canonical anchor state dict)``: a hidden random element of every group of
    ``symmetries`` (with scales if ``rescale``) applied to the anchor in canonical form, plus Gaussian
    noise (``noise`` × each matched tensor's std) on the matched tensors. With noise 0 the model computes
    the anchor's function; aligning it back must reach the canonical anchor (or the noise level)."""
    from symmerge.core.apply import apply, canonicalize, random_elements
    from symmerge.core.resolve import declared_ties
    from symmerge.pipeline.align import instances_for

    _, instances = instances_for(anchor, residual=residual)
    chosen = [i for i in instances if i.group.symmetry in symmetries]
    wide = [i for i in chosen if not i.kind.per_layer]
    canonical = canonicalize(anchor.state_dict(), wide)
    sd, noise_norm = canonical, 0.0
    if noise:
        keys = sorted({s.key for i in chosen for s in i.slots if not s.diag})
        sd, noise_norm = add_noise(sd, noise, seed + 100, keys)
        for alias, source in declared_ties(anchor).items():  # a tied copy is the same tensor
            if alias in sd:
                sd[alias] = sd[source]
    elements = random_elements(chosen, torch.Generator().manual_seed(seed), scale="rescale" in symmetries)
    return with_weights(anchor, apply(sd, chosen, elements)), noise_norm, canonical
