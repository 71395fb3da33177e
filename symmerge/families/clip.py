"""CLIP (``CLIPModel``; ``CLIPTextModel`` / ``CLIPVisionModel`` and their ``...WithProjection``): two towers.

* Each tower is a pre-LN LayerNorm transformer with its own heads, QK/VO rotations and scales, FFN
  permutation (quick-GELU) and residual stream (O(d−1) after folding, as ViT): the text tower's final
  norm folds into ``text_projection``, the vision tower's ``post_layernorm`` into ``visual_projection``.
* The vision stream is the output of ``pre_layrnorm``, a LayerNorm on the embeddings' sum that cannot
  fold (``Stream.input_norms``): its stream keeps to permutations unless that norm is uniform.
* The shared embedding space (``projection``, symmetry ``residual``): ``text_projection`` and
  ``visual_projection`` left-multiplied by one orthogonal ``Qᵀ``. The logits are ``logit_scale`` times the
  cosine similarities of the two embeddings, and ``cos(Qᵀa, Qᵀb) = cos(a, b)``; ``logit_scale`` is
  untouched. The embeddings ``text_embeds`` / ``image_embeds`` move by ``Qᵀ`` (their function, the
  similarities, does not): CLIPModel's function is its logits.
* A single tower (CLIPTextModel, CLIPVisionModel) outputs its stream: per-layer groups only; with its
  projection (``...WithProjection``) the stream is read by the projection and the tower's residual group
  applies (its function: the embeddings).
"""

from dataclasses import replace

from ..core.spec import Group, Member, Spec, Stack
from .roles import MLP, Attention, Stream, build, scoped

ATTN = Attention(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.out_proj")
FFN = MLP(inputs=("mlp.fc1",), output="mlp.fc2")
NORMS = (("layer_norm1", "attn"), ("layer_norm2", "mlp"))


def _text(root: str = "") -> Spec:
    e = root + "embeddings."
    return build(
        "clip_text", ("clip_text_model",), root + "encoder.layers.{i}", ATTN, FFN,
        Stream("layernorm", "pre", embeddings=(Member(e + "token_embedding.weight", 1),
                                               Member(e + "position_embedding.weight", 1)),
               norms=NORMS, final=root + "final_layer_norm",
               heads=(Member("text_projection.weight", 1, 0, optional=True, root=True),)))


def _vision(root: str = "") -> Spec:
    e = root + "embeddings."
    return build(
        "clip_vision", ("clip_vision_model",), root + "encoder.layers.{i}", ATTN, FFN,
        Stream("layernorm", "pre", embeddings=(Member(e + "class_embedding", 0),
                                               Member(e + "patch_embedding.weight", 0),
                                               Member(e + "position_embedding.weight", 1)),
               norms=NORMS, final=root + "post_layernorm", input_norms=(root + "pre_layrnorm",),
               heads=(Member("visual_projection.weight", 1, 0, optional=True, root=True),)),
        inputs="image")


TEXT = replace(_text(), outputs=("text_embeds",))  # CLIPTextModelWithProjection: the embeddings are its function
VISION = replace(_vision(), outputs=("image_embeds",))

# the shared space: one orthogonal map of both projections' outputs. The residual kind's dense variant
# without centring ("rmsnorm", nothing folded; "post": no stream scale). The two sides differ in power only
# so that moving one of them alone is a side of its own (the negative control); no scale is ever applied.
PROJECTION = Group("projection", "residual", "residual",
                   (Member("text_projection.weight", 0, 1, root=True),
                    Member("visual_projection.weight", 0, 0, root=True)),
                   params=(("norm", "rmsnorm"), ("placement", "post"),
                           ("description", "one orthogonal map of the shared embedding space: the outputs of both "
                                           "projections (the logits are cosine similarities)")))


def _tower(scope: str, spec: Spec) -> tuple[tuple[Group, ...], tuple]:
    """A tower's groups named ``{scope}.…``, its folds bound to its own residual group."""
    return scoped(scope, spec.groups), tuple(replace(f, group=f"{scope}.residual") for f in spec.folds)


_TEXT_GROUPS, _TEXT_FOLDS = _tower("text", _text("text_model."))
_VISION_GROUPS, _VISION_FOLDS = _tower("vision", _vision("vision_model."))

SPEC = Spec(
    "clip", ("clip",), _TEXT_GROUPS + _VISION_GROUPS + (PROJECTION,), inputs="text+image",
    folds=_TEXT_FOLDS + _VISION_FOLDS,
    probe="text_model.encoder.layers.{i}.self_attn.q_proj.weight",
    stacks=(Stack("text", "text_model.encoder.layers.{i}", "text_model.encoder.layers.{i}.self_attn.q_proj.weight",
                  config="text_config"),
            Stack("vision", "vision_model.encoder.layers.{i}",
                  "vision_model.encoder.layers.{i}.self_attn.q_proj.weight", config="vision_config")),
    task_classes=("CLIPModel",),
    outputs=("logits_per_image", "logits_per_text"),
)
