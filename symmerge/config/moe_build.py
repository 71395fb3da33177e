"""Build a mixture of experts from dense models, as mergekit-moe does (``symmerge moe CONFIG OUT``).

The output keeps the base model's attention, norms, embeddings and head; layer ``i``'s expert ``e`` is
expert ``e``'s MLP of layer ``i``; the router (one row per expert) is initialised from the prompts:

* ``hidden``: the base model's hidden state entering layer ``i`` at the last token of each prompt (the
  prompts of a list run as one left-padded batch), in bfloat16 as mergekit-moe computes it; the row is the
  mean over the positive prompts minus the mean over the negative ones, divided by its norm;
* ``cheap_embed``: the base's token embeddings averaged over every token of the positive prompts (float32),
  divided by its norm, minus the same of the negative prompts, divided by its norm; the same row in every
  layer;
* ``random``: N(0, 1) entries (``seed``; not mergekit's stream of random numbers).

A prompt is tokenized with the base's tokenizer, the BOS token put first when the tokenizer has one and did
not add it. Outputs: Mixtral (``MixtralForCausalLM``, from Llama/Mistral models) or Qwen2-MoE
(``Qwen2MoeForCausalLM``, from Qwen2 models, with its shared expert; the shared expert's gate is its prompts'
row, its down projection times ``residual_scale``), written in transformers' own checkpoint layout
(``block_sparse_moe.experts.{e}.w1/w2/w3`` for Mixtral, ``mlp.experts.{e}.*_proj`` for Qwen2-MoE).

Streamed: the router is computed first (``hidden`` holds the base model only, ``cheap_embed`` reads its
embedding matrix only), then every output tensor is read from its source's safetensors, cast and written
one at a time into shards whose headers are planned in advance; the folder appears whole or not at all.

``align`` (beyond mergekit): each expert is first aligned to the base (``symmerge.align_to_folder``, one
expert at a time, into a temporary folder beside the output), so that an expert trained apart reads and
writes the base's residual stream in the base's coordinates. The attention, embeddings and head stay the
base's: the frame of the output is the base's, and only the experts move into it. An aligned model keeps
its function; where its stream was rotated its norms are folded (weight 1) into the layers that read them,
so an expert's input projections are divided by the base's post-attention norm (the norm the MoE applies
before its experts) and multiplied by the aligned expert's own: exact, for a base norm without zeros.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SymmergeError
from ..io.checkpoint import PlannedWriter, parse_size
from ..io.model import atomic_dir, check_finite, copy_side_files, ensure_output_dir, weight_files, write_json
from ..io.output import temp_prefix
from ..io.tokenizers import drop_tokenizer
from ..merge.parts import dare_seed
from ..progress import stage
from .moe import MoeConfig, read_moe_config

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CODES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# the dense families whose MLP (gate_proj, up_proj, down_proj, SwiGLU) becomes an expert, and the output each gives
MIXTRAL_INPUTS = ("llama", "mistral")
QWEN_INPUTS = ("qwen2",)
CAUSAL_LM = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
MLP = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_LAYER_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.")
HIDDEN_DTYPE = torch.bfloat16  # mergekit-moe runs the base model in bfloat16 for gate_mode hidden


@dataclass(frozen=True)
class MoeOptions:
    """How to build: ``device`` (the hidden-state pass), ``seed`` (``gate_mode: random``), ``shard_size``,
    ``align`` (True: align every expert to the base first with the recommended symmetries; an
    :class:`~symmerge.pipeline.options.AlignOptions`: with those; None: as mergekit), ``align_stream`` (align
    layer by layer from the checkpoints), ``allow_crimes`` (experts of
    another family than the base, as mergekit's flag), ``copy_tokenizer``, ``progress``, ``card`` (the model card,
    ``README.md``)."""

    device: str = "cpu"
    seed: int = 0
    shard_size: object = "5GB"
    align: object = None
    align_stream: bool = False
    allow_crimes: bool = False
    copy_tokenizer: bool = True
    progress: bool = True
    card: bool = True  # README.md, the output's model card (symmerge.io.card); --no-write-model-card: none


class _Source:
    """A model folder's safetensors, read one tensor at a time under their stored names; a tensor holding NaN or Inf
    is one error naming the folder and the tensor. ``named``: how messages name the folder (an aligned expert's
    temporary folder: the expert's own, said aligned)."""

    def __init__(self, folder, what: str, named: str | None = None):
        from ..io.model import safetensors_headers

        self.folder = Path(folder)
        self.what = what
        self.named = named or str(self.folder)
        self.config = json.loads((self.folder / "config.json").read_text())
        files, safe = weight_files(self.folder)
        if not safe:
            raise SymmergeError(f"{self.folder}: {what}: symmerge moe reads safetensors weights only")
        self.file_of, self.shape, self.dtype = {}, {}, {}
        for f, header in safetensors_headers(files).items():  # the one reader: a truncated file is one line
            for k, (code, shape) in header.tensors.items():
                if code not in _CODES:
                    raise SymmergeError(f"{f}: tensor {k!r} has unsupported dtype {code}")
                self.file_of[k], self.shape[k], self.dtype[k] = f, shape, _CODES[code]
        self._handles: dict = {}

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self.file_of:
            raise SymmergeError(f"{self.folder}: {self.what}: tensor {key!r} missing")
        f = self.file_of[key]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), "pt")
        t = self._handles[f].get_tensor(key)
        check_finite({key: t}, str(self.folder))  # NaN/Inf named by its input folder and tensor, as merge names it
        return t

    def mlp(self, layer: int, part: str) -> str:
        return f"model.layers.{layer}.mlp.{part}.weight"


def _check_sources(cfg: MoeConfig, base: _Source, experts: list, shared: list, allow_crimes: bool) -> str:
    """The output architecture (``mixtral`` or ``qwen``), after checking every model against the base."""
    bc = base.config
    mt = bc.get("model_type")
    arch = cfg.architecture or ("qwen" if cfg.shared or mt in QWEN_INPUTS else "mixtral")
    inputs = QWEN_INPUTS if arch == "qwen" else MIXTRAL_INPUTS
    if mt not in inputs:
        raise SymmergeError(f"{cfg.at('base_model')}: {base.folder} is {mt!r}; a "
                            f"{'Qwen2-MoE' if arch == 'qwen' else 'Mixtral'} output is built from "
                            f"{' / '.join(inputs)} models")
    _refuse_headless(base, cfg.at("base_model"))
    if arch == "qwen" and not cfg.shared:
        raise SymmergeError(f"{cfg.at('architecture' if cfg.architecture else 'base_model')}: a Qwen2-MoE output "
                            "needs a shared expert (shared_experts)")
    if arch == "mixtral" and cfg.shared:
        raise SymmergeError(f"{cfg.at('shared_experts')}: Mixtral has no shared expert (architecture: qwen has)")
    layers = bc.get("num_hidden_layers")
    for i, src in enumerate(experts + shared):
        where = cfg.at("experts" if i < len(experts) else "shared_experts", i if i < len(experts) else 0,
                       "source_model")
        c = src.config
        if c.get("model_type") != mt and not allow_crimes:
            raise SymmergeError(f"{where}: {src.folder} is {c.get('model_type')!r}, the base is {mt!r} (mismatched "
                                "architectures; --allow-crimes mixes them as mergekit does)")
        if c.get("model_type") not in inputs:
            raise SymmergeError(f"{where}: {src.folder} is {c.get('model_type')!r}; experts must be "
                                f"{' / '.join(inputs)} models")
        _refuse_headless(src, where)
        for key in ("hidden_size", "num_hidden_layers", "hidden_act"):
            if c.get(key) != bc.get(key):
                raise SymmergeError(f"{where}: {src.folder} has {key} {c.get(key)!r}, the base {bc.get(key)!r} "
                                    "(mismatched architectures)")
        if c.get("mlp_bias"):
            raise SymmergeError(f"{where}: {src.folder} has MLP biases; MoE experts have none")
        if i < len(experts) and c.get("intermediate_size") != experts[0].config.get("intermediate_size"):
            raise SymmergeError(f"{where}: {src.folder} has intermediate_size {c.get('intermediate_size')}, expert "
                                f"0 {experts[0].config.get('intermediate_size')}: every expert must be one size")
        for layer in range(layers):
            for part in MLP:
                key = src.mlp(layer, part)
                if key not in src.file_of:
                    raise SymmergeError(f"{where}: {src.folder} has no {key!r}")
    return arch


def _refuse_headless(src: _Source, where: str) -> None:
    """A checkpoint of the base-model class (``LlamaModel``: no LM head, its tensors ``layers.N...`` without
    ``model.``) is one error saying what it is and what moe needs: mergekit-moe reads an expert's
    ``model.layers.N.mlp.*`` and the base's head by name, and a Mixtral written from it would have no head."""
    if any(k.startswith("model.") for k in src.file_of) or not any(k.startswith("layers.") for k in src.file_of):
        return
    mt = src.config.get("model_type")
    what = (src.config.get("architectures") or [None])[0] or "a base-model class"
    wanted = CAUSAL_LM.get(mt) or " / ".join(CAUSAL_LM.values())
    raise SymmergeError(f"{where}: {src.folder} is a base model without its LM head ({what}: tensors 'layers.N...', "
                        f"not 'model.layers.N...'); symmerge moe, as mergekit-moe, builds from {wanted} checkpoints "
                        "(the causal-LM class, with its head)")


# ---- the router's initialisation ----------------------------------------------------------------------------

def _tokenizer(folder: Path):
    from ..io.hf import auto_tokenizer

    try:
        return auto_tokenizer(folder)  # a tokenizer folder's own code only with --trust-remote-code
    except SymmergeError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read it is the same user-facing fact
        raise SymmergeError(f"{folder}: the base model's tokenizer cannot be read ({type(e).__name__}); "
                            "gate_mode hidden and cheap_embed tokenize the prompts with it") from None


def prompt_ids(tok, prompt: str) -> list[int]:
    """The ids of ``prompt``: the tokenizer's, with its BOS token put first when it has one and did not."""
    ids = list(tok(prompt)["input_ids"])
    bos = tok.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


class ZeroRow(SymmergeError):
    """An expert's prompts give a zero router row (``index``: the expert's place in experts + shared_experts)."""

    def __init__(self, index: int):
        super().__init__(f"expert {index}: its prompts give a zero router row (its positive and negative prompts "
                         "tokenize alike, or to nothing, with the base's tokenizer)")
        self.index = index


def _unit(v: torch.Tensor, index: int) -> torch.Tensor:
    """``v`` / ‖v‖ along its last dimension. A finite row whose norm overflows (or underflows) in float32 — a base
    with huge values — is normalised in float64 (it was called a zero row); a row of NaN/Inf is one error that says
    the base's values overflow."""
    if not torch.isfinite(v).all():
        raise SymmergeError(f"expert {index}: the router row its prompts give is not finite (NaN/Inf): the base "
                            "model's embeddings or hidden states overflow float32 on them; look for huge values in "
                            "the base")
    n = v.norm(dim=-1, keepdim=True)
    if torch.isfinite(n).all() and (n > 0).all():
        return v / n
    wide = v.double()
    n = wide.norm(dim=-1, keepdim=True)
    if not (n > 0).all():
        raise ZeroRow(index)
    return (wide / n).to(v.dtype)


def cheap_embed_rows(embed: torch.Tensor, tok, experts) -> torch.Tensor:
    """One row per expert (E, d), float32: see the module's docstring."""
    table = embed.float()

    def mean(prompts):
        ids = [i for p in prompts for i in prompt_ids(tok, p)]
        return table[torch.tensor(ids, dtype=torch.long)].mean(0)

    rows = []
    for i, ex in enumerate(experts):
        v = _unit(mean(ex.positive), i)
        if ex.negative:
            v = _unit(v - _unit(mean(ex.negative), i), i)
        rows.append(v)
    return torch.stack(rows)


def _last_hidden(model, tok, prompts, device) -> torch.Tensor:
    """(layers, prompts, d): the hidden state entering each layer at each prompt's last token, the prompts run
    as one left-padded batch."""
    seqs = [prompt_ids(tok, p) for p in prompts]
    width = max(map(len, seqs))
    # padded with the BOS id, else EOS, as mergekit-moe pads (the masked positions do not change the last token's
    # state; a tokenizer's own pad id may lie beyond the embeddings, an added token)
    pad = next((t for t in (tok.bos_token_id, tok.eos_token_id) if t is not None), 0)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    layers = model.config.num_hidden_layers
    return torch.stack([hs[i][:, -1] for i in range(layers)])


def hidden_rows(model, tok, experts, device) -> torch.Tensor:
    """(layers, E, d) in the model's dtype: see the module's docstring."""
    out = []
    for i, ex in enumerate(experts):
        v = _last_hidden(model, tok, ex.positive, device).mean(1)
        if ex.negative:
            v = v - _last_hidden(model, tok, ex.negative, device).mean(1)
        out.append(_unit(v, i))
    return torch.stack(out, dim=1).cpu()


def router_rows(cfg: MoeConfig, base: _Source, options: MoeOptions, layers: int, hidden: int) -> torch.Tensor:
    """(layers, E + shared, d) router rows (the shared expert's last), float32 holding the computed values."""
    try:
        return _router_rows(cfg, base, options, layers, hidden)
    except ZeroRow as e:
        shared = e.index >= len(cfg.experts)
        where = ("shared_experts", 0) if shared else ("experts", e.index)
        raise SymmergeError(f"{cfg.at(*where)}: its prompts give a zero router row (positive and negative prompts "
                            "tokenize alike, or to nothing, with the base's tokenizer)") from None


def _router_rows(cfg: MoeConfig, base: _Source, options: MoeOptions, layers: int, hidden: int) -> torch.Tensor:
    experts = cfg.experts + cfg.shared
    if cfg.gate_mode == "random":
        g = torch.Generator().manual_seed(options.seed)
        return torch.randn((layers, len(experts), hidden), generator=g)
    tok = _tokenizer(base.folder)
    if cfg.gate_mode == "cheap_embed":
        rows = cheap_embed_rows(base.read("model.embed_tokens.weight"), tok, experts)
        return rows.unsqueeze(0).expand(layers, -1, -1).clone()
    from ..device import resolve_device
    from ..io.model import load_model

    device = resolve_device(options.device)
    with stage("hidden states of the prompts (base model, bfloat16)", enabled=options.progress):
        model = load_model(str(base.folder), spec=False)
        model.to(device=device, dtype=HIDDEN_DTYPE).eval()
        rows = hidden_rows(model, tok, experts, device).float()
        del model
    return rows


# ---- alignment --------------------------------------------------------------------------------------------

def _align_experts(cfg: MoeConfig, options: MoeOptions, work: Path) -> tuple[list, list]:
    """Every expert (and shared expert) aligned to the base: (their folders, their alignment summaries). An
    expert that is the base folder itself is taken as it is."""
    from ..pipeline.options import RECOMMENDED_NAME, AlignOptions
    from ..pipeline.to_folder import align_to_folder

    align = AlignOptions(symmetries=RECOMMENDED_NAME) if options.align is True else options.align
    folders, summaries, done = [], [], {}
    base = Path(cfg.base).resolve()
    for i, ex in enumerate(cfg.experts + cfg.shared):
        source = Path(ex.source).resolve()
        if source == base:
            folders.append(ex.source)
            summaries.append({"source_model": ex.source, "aligned": False, "why": "the base model itself"})
            continue
        if source in done:  # the same model twice: aligned once
            folders.append(folders[done[source]])
            summaries.append(summaries[done[source]])
            continue
        done[source] = i
        out = work / f"expert-{i}"
        with stage(f"aligned expert {i} to the base", enabled=options.progress):
            report = align_to_folder(ex.source, cfg.base, out, align, stream=options.align_stream,
                                     progress=False)
        folders.append(str(out))
        summaries.append({"source_model": ex.source, "aligned": True, "symmetries": report.get("symmetries"),
                          "distance_before": report.get("distance_before"),
                          "distance_after": report.get("distance_after"),
                          "verify_max_abs_diff": report.get("verify_max_abs_diff")})
    return folders, summaries


# ---- the output -------------------------------------------------------------------------------------------

def _output_config(arch: str, base_cfg: dict, cfg: MoeConfig, experts: list, shared: list, dtype: str):
    keep = {k: v for k, v in base_cfg.items()
            if k not in ("architectures", "model_type", "transformers_version", "auto_map", "torch_dtype", "dtype")}
    if arch == "mixtral":
        from transformers import MixtralConfig

        out = MixtralConfig(**{**keep, "num_local_experts": len(experts), "num_experts_per_tok": cfg.experts_per_token})
        out.architectures = ["MixtralForCausalLM"]
    else:
        from transformers import Qwen2MoeConfig

        out = Qwen2MoeConfig(**{**keep, "num_experts": len(experts), "num_experts_per_tok": cfg.experts_per_token,
                                "moe_intermediate_size": experts[0].config["intermediate_size"],
                                "shared_expert_intermediate_size": shared[0].config["intermediate_size"],
                                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                                "qkv_bias": True})
        out.architectures = ["Qwen2MoeForCausalLM"]
    out.dtype = dtype
    return out


def _plan(arch: str, base: _Source, experts: list, shared: list, rows: torch.Tensor, dtype, layers: int):
    """[(output name, dtype, shape, read, origin)] in writing order; ``read()`` gives the tensor before its cast to
    ``dtype``; ``origin``: the input folder and tensor it comes from (None: the router's rows), for messages."""
    plan = []

    def add(name, shape, read, origin=None):
        plan.append((name, dtype, tuple(shape), read, origin))

    by_layer: dict[int, list] = {}
    outside = []
    for key in base.file_of:
        m = _LAYER_MLP.match(key)
        if m:
            continue
        lm = re.match(r"^model\.layers\.(\d+)\.", key)
        (by_layer.setdefault(int(lm.group(1)), []) if lm else outside).append(key)

    def copy(src, key):
        return lambda: src.read(key)

    def origin(src, key, extra=""):
        return f"{src.named}: tensor {key!r}{extra}"

    for key in sorted(outside):
        add(key, base.shape[key], copy(base, key), origin(base, key))
    e_count = len(experts)
    for layer in range(layers):
        for key in sorted(by_layer.get(layer, [])):
            add(key, base.shape[key], copy(base, key), origin(base, key))
        gate = rows[layer, :e_count]
        moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
        add(f"model.layers.{layer}.{moe}.gate.weight", gate.shape, lambda g=gate: g)
        for e, (src, fix, noise) in enumerate(experts):
            for part in MLP:
                name = (f"model.layers.{layer}.block_sparse_moe.experts.{e}.{MIXTRAL_NAMES[part]}.weight"
                        if arch == "mixtral" else f"model.layers.{layer}.mlp.experts.{e}.{part}.weight")
                add(name, src.shape[src.mlp(layer, part)], _expert_reader(src, layer, part, fix, noise=noise),
                    origin(src, src.mlp(layer, part), _changed(fix, part)))
        for src, fix, scale, noise in shared:
            for part in MLP:
                scaled = scale if part == "down_proj" else None
                add(f"model.layers.{layer}.mlp.shared_expert.{part}.weight", src.shape[src.mlp(layer, part)],
                    _expert_reader(src, layer, part, fix, scaled, noise),
                    origin(src, src.mlp(layer, part), _changed(fix, part, scaled)))
            add(f"model.layers.{layer}.mlp.shared_expert_gate.weight", (1, rows.shape[-1]),
                lambda g=rows[layer, e_count:e_count + 1]: g)
    return plan


def _expert_reader(src: _Source, layer: int, part: str, fix, scale=None, noise=None):
    """``read()`` of one expert tensor: its input columns rescaled (``fix``), plus the expert's ``noise``
    ((standard deviation, seed) or None: N(0, σ²) entries, as mergekit-moe adds them before ``residual_scale``,
    from a generator seeded by the seed and the tensor's name, so a run is repeatable), times ``scale``."""
    def read():
        key = src.mlp(layer, part)
        t = src.read(key)
        if fix is not None and part != "down_proj":  # columns: the inputs, read behind the base's norm
            t = t.float() * fix(layer).unsqueeze(0)
        if noise is not None:
            sigma, seed = noise
            g = torch.Generator().manual_seed(dare_seed(seed, layer, key))
            t = t.float() + torch.randn(t.shape, generator=g) * sigma
        if scale is not None:
            t = t.float() * scale
        return t
    return read


def _changed(fix, part: str, scale=None) -> str:
    """What an expert's tensor went through on its way to the output, as a message says it."""
    said = " (its input columns rescaled for the base's post-attention norm)" if fix is not None \
        and part != "down_proj" else ""
    return said + (f" times residual_scale {scale:g}" if scale is not None else "")


def _cast(name: str, value: torch.Tensor, dtype, dtype_name: str, origin) -> torch.Tensor:
    """``value`` in the output dtype; a value beyond that dtype's range (inf after the cast) is one error naming the
    input folder and tensor it came from (``origin``), the output tensor and the largest magnitude."""
    t = value.to(dtype)
    if torch.isfinite(t).all():
        return t
    if origin is None:
        raise SymmergeError(f"tensor {name!r} of the output has non-finite values")
    largest = value.detach().abs().max().item()
    wider = {"float16": "; set dtype: bfloat16 or float32", "bfloat16": "; set dtype: float32"}.get(dtype_name, "")
    raise SymmergeError(f"{origin} does not fit in {dtype_name} (largest magnitude {largest:g}, beyond "
                        f"{dtype_name}'s {torch.finfo(dtype).max:g}): output tensor {name!r} would hold Inf{wider}")


def _norm_fix(aligned: _Source, base: _Source):
    """For an aligned expert: layer -> the factor on its input projections' columns, γ_aligned / γ_base of the
    post-attention norm (the base's norm is the one the MoE applies before the experts)."""
    def fix(layer):
        key = f"model.layers.{layer}.post_attention_layernorm.weight"
        g_base = base.read(key).double()
        g_own = aligned.read(key).double()
        if torch.equal(g_base, g_own):
            return torch.ones_like(g_base).float()
        if (g_base == 0).any():
            raise SymmergeError(f"{base.folder}: {key} has zeros: an aligned expert cannot be expressed behind it")
        return (g_own / g_base).float()
    return fix


def build_moe(config, out, options: MoeOptions | None = None) -> dict:
    """Build the MoE of ``config`` (a path or a :class:`~symmerge.config.moe.MoeConfig`) into the folder
    ``out`` (absent or empty, not inside the folder of one of its models; written atomically). Returns the report
    (also written as ``symmerge_report.json``)."""
    options = options or MoeOptions()
    t0 = time.perf_counter()
    cfg = config if isinstance(config, MoeConfig) else read_moe_config(config)
    out = Path(out)
    ensure_output_dir(out, inputs=[cfg.base, *(e.source for e in cfg.experts + cfg.shared)])
    max_bytes = parse_size(options.shard_size)
    base = _Source(cfg.base, "base_model")
    experts = [_Source(e.source, f"expert {i}") for i, e in enumerate(cfg.experts)]
    shared = [_Source(e.source, "shared expert") for e in cfg.shared]
    arch = _check_sources(cfg, base, experts, shared, options.allow_crimes)
    layers, hidden = base.config["num_hidden_layers"], base.config["hidden_size"]
    embed_dtype = base.dtype.get("model.embed_tokens.weight", torch.float32)
    dtype_name = cfg.dtype or {v: k for k, v in DTYPES.items()}.get(embed_dtype, "float32")
    dtype = DTYPES[dtype_name]
    rows = router_rows(cfg, base, options, layers, hidden)
    report = {"command": "moe", "architecture": "MixtralForCausalLM" if arch == "mixtral" else "Qwen2MoeForCausalLM",
              "base_model": cfg.base, "experts": [e.source for e in cfg.experts],
              "shared_experts": [e.source for e in cfg.shared], "gate_mode": cfg.gate_mode, "dtype": dtype_name,
              "experts_per_token": cfg.experts_per_token,
              "aligned": options.align is not None and options.align is not False}
    with contextlib.ExitStack() as stack:
        fixes = [None] * (len(experts) + len(shared))
        if options.align is not None and options.align is not False:
            out.parent.mkdir(parents=True, exist_ok=True)  # the aligned experts beside the output (a killed
            # run's are removed by the next one: symmerge.io.output)
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=temp_prefix(out, "experts"),
                                                                          dir=out.parent)))
            folders, report["alignment"] = _align_experts(cfg, options, work)
            aligned = [_Source(f, s.what, s.named if Path(f) == s.folder else f"{s.named} (aligned to the base)")
                       for f, s in zip(folders, experts + shared)]
            fixes = [_norm_fix(a, base) if a.folder != s.folder else None
                     for a, s in zip(aligned, experts + shared)]
            experts, shared = aligned[:len(experts)], aligned[len(experts):]
        noises = [None if e.noise_scale is None else (e.noise_scale, dare_seed(options.seed, i, "noise_scale"))
                  for i, e in enumerate([*cfg.experts, *cfg.shared])]
        exp = list(zip(experts, fixes[:len(experts)], noises[:len(experts)]))
        sh = [(s, f, e.residual_scale, n) for s, f, e, n in zip(shared, fixes[len(experts):], cfg.shared,
                                                                  noises[len(experts):])]
        plan = _plan(arch, base, exp, sh, rows, dtype, layers)
        out_config = _output_config(arch, base.config, cfg, experts, shared, dtype_name)
        with atomic_dir(out) as tmp, stage(f"wrote {out}", enabled=options.progress):
            writer = PlannedWriter(tmp, [(n, d, s) for n, d, s, _, _ in plan], max_bytes)
            try:
                for name, _, _, read, origin in plan:
                    writer.add(name, _cast(name, read(), dtype, dtype_name, origin))
                report["shards"] = writer.close()
            except BaseException:
                writer.abort()
                raise
            out_config.save_pretrained(str(tmp))
            report["side_files"] = copy_side_files(base.folder, tmp)
            if not options.copy_tokenizer:  # as `run --no-copy-tokenizer`: generation_config.json and the rest stay
                drop_tokenizer(tmp, report["side_files"])
            (tmp / "mergekit_moe_config.yml").write_text(cfg.text)
            report["seconds"] = time.perf_counter() - t0
            if options.card:
                from ..io.card import write_card

                write_card(tmp, report)
            write_json(tmp / "symmerge_report.json", report)
    return report
