"""Issue 35, item 1: a base-class checkpoint (BertModel, LlamaModel) and fine-tunes saved with their task
class (BertForSequenceClassification, LlamaForCausalLM) are one architecture: they merge (in memory and
streamed, with and without alignment) and align together; the body follows the per-tensor rule, the
heads are the fine-tunes', the report says what the base lacked."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli, save_folder
from factories import make_model
from symmerge.io.model import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

TASK = {"bert": "BertForSequenceClassification", "llama": "LlamaForCausalLM"}
PREFIX = {"bert": "bert.", "llama": "model."}
HEAD = {"bert": "classifier.", "llama": "lm_head."}


def fine_tune(base, family: str, seed: int, noise: float = 0.02):
    """``base`` + Gaussian noise on every body tensor, as the task class with a random head."""
    import transformers

    cls = getattr(transformers, TASK[family])
    config = base.config.__class__.from_dict(base.config.to_dict())
    config.architectures = [TASK[family]]
    if family == "bert":
        config.num_labels = 3
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    p = PREFIX[family]
    for k, v in base.state_dict().items():
        sd[p + k] = v.float() + noise * v.float().std() * torch.randn(v.shape, generator=g)
    model.load_state_dict(sd)
    return model.eval()


@pytest.fixture(scope="module", params=["bert", "llama"])
def trio(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    base = make_model(family, dtype=torch.float32)
    fts = [fine_tune(base, family, s) for s in (1, 2)]
    folders = [save_folder(base, root / "base")] + [save_folder(m, root / f"ft{i}") for i, m in enumerate(fts)]
    return family, folders


def tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rule(method, base, a, b):
    """The per-tensor rule computed by hand, in float64."""
    a, b = a.double(), b.double()
    if method == "average":
        return (a + b) / 2
    base = base.double()
    ta, tb = a - base, b - base
    if method == "task_arithmetic":
        return base + ta + tb
    # TIES at density 1: the elected sign's entries averaged
    elected = torch.sign(ta + tb)
    agree = [(torch.sign(t) == elected) & (t != 0) for t in (ta, tb)]
    count = agree[0].int() + agree[1].int()
    total = ta * agree[0] + tb * agree[1]
    return base + torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


@pytest.mark.parametrize("mode", ["memory", "stream"])
@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "average"])
def test_base_class_base_with_task_class_fine_tunes_merge_by_the_rule(trio, method, mode, tmp_path):
    family, (base, ft0, ft1) = trio
    out = tmp_path / "out"
    extra = ["--base", base, "--param", "density=1", "--param", "scope=tensor"] if method == "ties" else \
        ["--base", base] if method == "task_arithmetic" else []
    # average: the base itself is one of the two models merged (docs/merge.md's `merge <base> <fine-tune>`)
    models = [ft0, ft1] if method != "average" else [base, ft0]
    assert run_cli("merge", *models, "--method", method, "--align", "none", "--mode", mode, *extra, "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["mode"] == mode
    adapted = report["base_adapted"]
    assert len(adapted) == 1 and adapted[0]["prefix_added"] == PREFIX[family]
    assert all(k.startswith(HEAD[family]) for k in adapted[0]["tensors_only_in_fine_tunes"])
    assert adapted[0]["tensors_only_in_fine_tunes"]
    got, b, a0, a1 = tensors(out), tensors(base), tensors(ft0), tensors(ft1)
    p = PREFIX[family]
    assert set(got) == set(a0)  # the fine-tunes' class and names
    for k, v in got.items():
        if k.startswith(p):
            inner = k[len(p):]
            expected = rule(method, b[inner], a0[k], a1[k]) if method != "average" else rule(method, None, b[inner], a0[k])
            torch.testing.assert_close(v.double(), expected, atol=2e-6, rtol=1e-5, msg=k)
        else:  # the head: the fine-tunes' (head_from 0: ft0's; for average, the base has none: ft0's)
            assert torch.equal(v, a0[k]), k
    model = load_model(out, spec=False)
    assert type(model).__name__ == TASK[family]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_aligned_merge_equals_the_merge_with_the_base_saved_as_the_task_class(trio, mode, tmp_path):
    """With alignment the rule runs on aligned models; the oracle: the same base saved as the task class
    (its head: ft0's) gives the same body."""
    family, (base, ft0, ft1) = trio
    as_task = fine_tune(load_model(base, spec=False), family, 0, noise=0.0)
    sd = as_task.state_dict()
    ft0_sd = load_model(ft0, spec=False).state_dict()
    for k in sd:
        if k.startswith(HEAD[family]):
            sd[k] = ft0_sd[k]
    as_task.load_state_dict(sd)
    oracle_base = save_folder(as_task, tmp_path / "base-as-task")
    align = "attn,ffn,rescale"
    # scope=tensor: a model-wide threshold would count the oracle base's head, which the real base lacks
    args = ["--method", "ties", "--align", align, "--mode", mode, "--param", "density=0.5", "--param", "scope=tensor"]
    out, ref = tmp_path / "out", tmp_path / "ref"
    assert run_cli("merge", ft0, ft1, *args, "--base", base, "-o", out) == 0
    assert run_cli("merge", ft0, ft1, *args, "--base", oracle_base, "-o", ref) == 0
    got, want, head = tensors(out), tensors(ref), tensors(ft0)
    assert set(got) == set(want)
    for k in got:
        if k.startswith(PREFIX[family]):
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=k)
        else:  # the base had no head: ft0's is kept, not merged (the oracle's base had ft0's head: merged)
            assert torch.equal(got[k], head[k]), k
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["alignment"]["symmetries"] and report["base_adapted"]


@pytest.mark.parametrize("stream", [False, True])
def test_align_fine_tune_to_base_and_base_to_fine_tune(trio, stream, tmp_path):
    family, (base, ft0, _) = trio
    flags = ["--stream"] if stream else []
    out = tmp_path / "ft-to-base"
    assert run_cli("align", ft0, base, "--symmetries", "attn,ffn", *flags, "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["base_adapted"][0]["model"] == "anchor"
    assert report["distance_after"] <= report["distance_before"] + 1e-6
    assert type(load_model(out, spec=False)).__name__ == TASK[family]
    back = tmp_path / "base-to-ft"
    assert run_cli("align", base, ft0, "--symmetries", "attn,ffn", *flags, "-o", back) == 0
    aligned = load_model(back, spec=False)
    assert type(aligned).__name__ == type(load_model(base, spec=False)).__name__  # a base model stays one
    assert json.loads((back / "symmerge_report.json").read_text())["base_adapted"][0]["model"] == "model"


def test_the_real_minilm_as_base(minilm, tmp_path):
    """The packaged all-MiniLM-L6-v2 (a BertModel) as the base of two fine-tunes saved as
    BertForSequenceClassification: task arithmetic follows the rule, streamed and in memory."""
    from pathlib import Path

    base_folder = Path(minilm[0])
    base = load_model(base_folder, spec=False)
    fts = [save_folder(fine_tune(base, "bert", s, noise=0.01), tmp_path / f"ft{s}") for s in (1, 2)]
    b = tensors(base_folder)
    for mode in ("stream", "memory"):
        out = tmp_path / f"out-{mode}"
        assert run_cli("merge", *fts, "--method", "task_arithmetic", "--base", base_folder, "--align", "none",
                       "--mode", mode, "--allow-tokenizer-mismatch", "-o", out) == 0
        got, a0, a1 = tensors(out), tensors(fts[0]), tensors(fts[1])
        for k, v in got.items():
            if k.startswith("bert."):
                torch.testing.assert_close(v.double(), rule("task_arithmetic", b[k[5:]], a0[k], a1[k]),
                                           atol=2e-6, rtol=1e-5, msg=k)
            else:
                assert torch.equal(v, a0[k])
        assert type(load_model(out, spec=False)).__name__ == "BertForSequenceClassification"


def test_barrier_and_a_config_with_a_base_class_model(tmp_path):
    """``barrier`` between a ViTModel (its pooler left out) and a ViTForImageClassification fine-tune of it,
    and a config (``symmerge run``) merging fine-tunes with the base-class base."""
    from transformers import ViTConfig, ViTForImageClassification, ViTModel

    from conftest import npz_file

    cfg = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
                    patch_size=4, num_channels=1, num_labels=3, initializer_range=0.4)
    torch.manual_seed(0)
    base = ViTModel(cfg).eval()
    base_dir = save_folder(base, tmp_path / "base")
    fts = []
    for s in (1, 2):
        torch.manual_seed(s)
        ft = ViTForImageClassification(cfg)
        sd = ft.state_dict()
        for k, v in base.state_dict().items():
            if "vit." + k in sd:
                sd["vit." + k] = v + 0.01 * torch.randn(v.shape)
        ft.load_state_dict(sd)
        fts.append(save_folder(ft, tmp_path / f"ft{s}"))
    data = npz_file(tmp_path / "d.npz")
    out = tmp_path / "study"
    assert run_cli("barrier", base_dir, fts[0], "--data", data, "--points", "3", "--align", "attn,ffn", "-o", out) == 0
    study = json.loads((out / "barrier.json").read_text())
    entry = study["base_adapted"][0]
    assert entry["prefix_added"] == "vit." and entry["left_out"] and all("pooler" in k for k in entry["left_out"])
    config = tmp_path / "merge.yml"
    config.write_text(f"merge_method: task_arithmetic\nbase_model: {base_dir}\nmodels:\n  - {fts[0]}\n  - {fts[1]}\n"
                      f"parameters:\n  weight: 1.0\nalign: none\noutput: {tmp_path / 'merged'}\n")
    assert run_cli("run", config) == 0  # a mergekit config (align: none): planned into steps, streamed
    merged = load_model(tmp_path / "merged", spec=False)
    assert type(merged).__name__ == "ViTForImageClassification"
    b, f0, f1 = (load_model(x, spec=False).state_dict() for x in (base_dir, fts[0], fts[1]))
    sd = merged.state_dict()
    for k, v in sd.items():
        if k.startswith("vit.") and k[4:] in b:  # the body: task arithmetic over the base read under 'vit.'
            want = b[k[4:]].double() + (f0[k].double() - b[k[4:]]) + (f1[k].double() - b[k[4:]])
            assert torch.allclose(v.double(), want, atol=1e-5), k
        else:  # the head the base lacks: kept from the first fine-tune, not merged
            assert torch.equal(v, f0[k]), k


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_base_class_anchor_is_read_as_the_task_class(trio, mode, tmp_path):
    """``--anchor BASE`` (a base-class folder, not merged) as ``--base`` is: read as the fine-tunes' class; the
    oracle: the same base saved as the task class gives the same merge."""
    family, (base, ft0, ft1) = trio
    as_task = fine_tune(load_model(base, spec=False), family, 0, noise=0.0)
    oracle = save_folder(as_task, tmp_path / "base-as-task")
    args = ["--method", "average", "--align", "attn,ffn", "--mode", mode, "--progress", "none"]
    out, ref = tmp_path / "out", tmp_path / "ref"
    assert run_cli("merge", ft0, ft1, *args, "--anchor", base, "-o", out) == 0
    assert run_cli("merge", ft0, ft1, *args, "--anchor", oracle, "-o", ref) == 0
    got, want = tensors(out), tensors(ref)
    assert set(got) == set(want) == set(tensors(ft0))
    for k in got:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=k)
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["alignment"]["anchor"]["rule"] == "given" and report["alignment"]["symmetries"]
    # one entry, one form in memory and streamed: the anchor is not merged, nothing is kept in its place
    entry = report["base_adapted"][-1]
    assert entry == report["alignment"]["anchor"]["base_adapted"] and entry["model"] == str(base)
    assert entry["prefix_added"] == PREFIX[family] and "the anchor" in entry["note"] and entry["taken_from"] is None
    assert sorted(entry) == sorted(["class", "model", "note", "prefix_added", "read_as", "taken_from",
                                    "tensors_only_in_fine_tunes"] + (["left_out"] if "left_out" in entry else []))
    assert type(load_model(out, spec=False)).__name__ == TASK[family]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_t5_encoder_and_full_t5_is_one_error_saying_what_to_do(tmp_path, capsys, mode):
    """T5EncoderModel against T5ForConditionalGeneration (no prefix: the encoder's tensors are a part of the
    full model's): one error naming both classes and how to merge the shared encoder; that way works."""
    from transformers import T5EncoderModel

    full = make_model("t5", dtype=torch.float32, head=True)
    enc = save_folder(make_model("t5", dtype=torch.float32), tmp_path / "enc")
    fullf = save_folder(full, tmp_path / "full")
    capsys.readouterr()
    assert run_cli("merge", enc, fullf, "--method", "average", "--align", "none", "--mode", mode,
                   "--progress", "none", "-o", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "is a T5EncoderModel and" in err and "a T5ForConditionalGeneration" in err, err
    assert "save " in err and "as a T5EncoderModel first" in err and len(err.strip().splitlines()) == 1
    T5EncoderModel.from_pretrained(fullf).save_pretrained(tmp_path / "full-encoder")  # what the error says
    assert run_cli("merge", enc, tmp_path / "full-encoder", "--method", "average", "--align", "none", "--mode", mode,
                   "--progress", "none", "-o", tmp_path / "out") == 0
