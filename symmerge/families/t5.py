"""T5 / mT5 / Flan-T5 (``T5ForConditionalGeneration``, ``T5EncoderModel``): two layer stacks.

* The encoder and the decoder each have their own per-layer groups: the QK and VO rotations (+ scales)
  of every attention block, the FFN permutation. T5 does not scale its scores by ``1/sqrt(d_head)``: a
  scalar, which no group touches.
* Self-attention's head permutation is tied across each stack. Its relative position bias
  (``relative_attention_bias``, an embedding with one column per head) lives in layer 0 of each stack and
  is added to the scores of *every* layer of the stack, so the heads move by one permutation of every
  layer at once, with the bias's columns (``encoder.heads``, ``decoder.heads``: one instance per stack,
  valued by the sum over the stack's layers of the per-layer head pairings, one exact assignment); a
  rotation or scale inside a head leaves each head's scores, hence the bias, alone (per layer, as
  elsewhere). The tied group needs the whole stack in memory: streamed alignment leaves it out.
* Cross-attention (decoder layers, ``layer.1.EncDecAttention``) has no position bias: its heads are
  permuted per layer, with per-head QK rotations that turn the decoder-side ``q`` and the encoder-side
  ``k`` together, and VO rotations between ``v`` (reading the encoder's output) and ``o`` (writing the
  decoder's stream).
* The FFN is ReLU (v1.0: ``wi``, ``wo``) or gated GELU (v1.1 / Flan: ``gelu(wi_0 x) * wi_1 x``, then
  ``wo``): one permutation group with the gate, no unit scale.
* One residual group for both streams: the embedding ``shared`` writes both (transformers ties the
  encoder's and decoder's ``embed_tokens``, and the LM head, to it), so both streams move by the same
  element. T5LayerNorm is an RMSNorm without centring or bias: pre-norms fold into their readers — the
  encoder's final norm into every decoder layer's cross-attention ``k`` and ``v`` — for any orthogonal
  map; the decoder's final norm cannot fold into the tied LM head (scaled by ``d_model^-0.5``, a scalar),
  so the stream keeps to signed permutations unless that norm is uniform.
* Only the generation model reads its stream through a head (T5EncoderModel's output is the encoder's
  stream): its function is the logits (``encoder_last_hidden_state`` moves with the stream).
"""

from ..core.spec import Fold, Group, Member, Spec, Stack
from . import roles
from .roles import Attention, attention_groups, columns, rows, scoped

ENC, DEC = "encoder.block.{i}", "decoder.block.{i}"
FFN = ("wi_0", "wi_1", "wi")  # the gate (gated GELU), up (gated GELU), the input (ReLU)


def _attention(block: str, module: str) -> Attention:
    return Attention(q=f"layer.{block}.{module}.q", k=f"layer.{block}.{module}.k", v=f"layer.{block}.{module}.v",
                     o=f"layer.{block}.{module}.o")


def _ffn(layer: str, block: int) -> Group:
    """The FFN units: the gate (no scale) and the up/input rows of whichever variant the checkpoint has."""
    p = f"{layer}.layer.{block}.DenseReluDense."
    members = tuple(m for n in FFN for m in rows(p + n, 0 if n == "wi_0" else 1, optional=True))
    return Group(roles.FFN, "permutation", "ffn", members + columns(p + "wo", -1))


def _readers(layer: str, module: str, which: str = "qkv") -> tuple[Member, ...]:
    return tuple(m for x in which for m in columns(f"{layer}.{module}.{x}", 0))


def _ffn_readers(layer: str, block: int) -> tuple[Member, ...]:
    return tuple(Member(f"{layer}.layer.{block}.DenseReluDense.{n}.weight", 1, 0, optional=True) for n in FFN)


def _writers(layer: str, *modules: str) -> tuple[Member, ...]:
    return tuple(m for mod in modules for m in rows(f"{layer}.{mod}", 1))


def _bias(layer: str) -> tuple[Member, ...]:
    """The relative position bias (num_buckets, heads) of the stack's layer 0: its columns move with the heads."""
    return (Member(f"{layer.format(i=0)}.layer.0.SelfAttention.relative_attention_bias.weight", 1, 0),)


def _norm(name: str) -> Member:
    return Member(f"{name}.weight", 0, 0, diag=True)


ENC_SELF, DEC_SELF, CROSS = "layer.0.SelfAttention", "layer.0.SelfAttention", "layer.1.EncDecAttention"
ENC_NORMS = ((f"{ENC}.layer.0.layer_norm", _readers(ENC, ENC_SELF)),
             (f"{ENC}.layer.1.layer_norm", _ffn_readers(ENC, 1)))
DEC_NORMS = ((f"{DEC}.layer.0.layer_norm", _readers(DEC, DEC_SELF)),
             (f"{DEC}.layer.1.layer_norm", _readers(DEC, CROSS, "q")),
             (f"{DEC}.layer.2.layer_norm", _ffn_readers(DEC, 2)))
CROSS_KV = _readers(DEC, CROSS, "kv")  # read the encoder's output (its final norm)
HEAD = Member("lm_head.weight", 1, 0, optional=True, root=True)

STREAM = Group(
    "residual", "residual", "residual",
    (Member("shared.weight", 1),)
    + tuple(m for _, readers in ENC_NORMS + DEC_NORMS for m in readers) + CROSS_KV
    + _writers(ENC, f"{ENC_SELF}.o", "layer.1.DenseReluDense.wo")
    + _writers(DEC, f"{DEC_SELF}.o", f"{CROSS}.o", "layer.2.DenseReluDense.wo")
    + tuple(_norm(n) for n, _ in ENC_NORMS + DEC_NORMS)
    + (_norm("encoder.final_layer_norm"), _norm("decoder.final_layer_norm"), HEAD),
    params=(("norm", "rmsnorm"), ("placement", "pre")))

SPEC = Spec(
    "t5", ("t5", "mt5"),
    scoped("encoder", attention_groups(ENC, _attention("0", "SelfAttention"), tied=_bias(ENC)) + (_ffn(ENC, 1),))
    + scoped("decoder", attention_groups(DEC, _attention("0", "SelfAttention"), tied=_bias(DEC))
             + scoped("cross", attention_groups(DEC, _attention("1", "EncDecAttention"))) + (_ffn(DEC, 2),))
    + (STREAM,),
    folds=tuple(Fold(f"{n}.weight", readers) for n, readers in ENC_NORMS + DEC_NORMS)
    + (Fold("encoder.final_layer_norm.weight", CROSS_KV), Fold("decoder.final_layer_norm.weight", (HEAD,))),
    probe=f"{ENC}.{ENC_SELF}.q.weight",
    stacks=(Stack("encoder", ENC, f"{ENC}.{ENC_SELF}.q.weight", layers="num_layers", heads="num_heads"),
            Stack("decoder", DEC, f"{DEC}.{DEC_SELF}.q.weight", layers="num_decoder_layers", heads="num_heads")),
    task_classes=("ForConditionalGeneration",),
    outputs=("logits",),
)
