"""sentence-transformers pipelines survive align and merge (issue 23, item 1), on the real
all-MiniLM-L6-v2: the output loads with SentenceTransformer, builds the same modules, and its embeddings
equal the original's; module weights beyond the transformer (a Dense built here) are merged with the
merge's method; mismatched pipelines are refused; the residual stream the pipeline reads is never
transformed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli, save_folder
from factories import disguised, make_model

pytestmark = pytest.mark.usefixtures("single_thread")
st = pytest.importorskip("sentence_transformers")

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Interest rates were left unchanged on Thursday.",
             "Is this the right train for the airport?", "Photosynthesis converts light into chemical energy."]


def module_names(model) -> list[str]:
    return [type(m).__name__ for m in model]


def encode(folder):
    model = st.SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    with torch.no_grad():
        return module_names(model), model.encode(SENTENCES, convert_to_tensor=True).double()


def assert_same_embeddings(e, ref):
    cos = torch.nn.functional.cosine_similarity(e, ref, dim=-1)
    assert (1 - cos).abs().max() <= 1e-5, cos
    assert (e.norm(dim=-1) - ref.norm(dim=-1)).abs().max() <= 1e-5


def copy_pipeline(src, dst, weights_from=None):
    """``src`` (a sentence-transformers folder) at ``dst``: small files copied, the transformer's weights
    linked (or written from the model ``weights_from``)."""
    dst.mkdir(parents=True)
    for item in os.scandir(src):
        target = dst / item.name
        if item.is_dir():
            shutil.copytree(item.path, target)
        elif item.name == "model.safetensors" and weights_from is None:
            target.symlink_to(item.path)
        elif item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item.path, target)
    if weights_from is None:
        shutil.copy(f"{src}/config.json", dst / "config.json")
    else:
        weights_from.save_pretrained(str(dst))
    return dst


@pytest.fixture(scope="module")
def original(minilm):
    names, emb = encode(minilm[0])
    assert names == ["Transformer", "Pooling", "Normalize"]
    return names, emb


@pytest.fixture(scope="module")
def hidden(minilm, tmp_path_factory):
    """all-MiniLM-L6-v2 disguised by a hidden element of heads, attn, ffn, rescale (no noise): the same
    function, far away in weights."""
    path, anchor, _ = minilm
    model, _, _ = disguised(anchor, ("heads", "attn", "ffn", "rescale"), seed=3)
    folder = copy_pipeline(path, tmp_path_factory.mktemp("hidden") / "m", weights_from=model)
    assert (folder / "modules.json").is_file() and (folder / "1_Pooling" / "config.json").is_file()
    return folder


def check_output(out, original, inputs):
    names, emb = encode(out)
    assert names == original[0]
    assert_same_embeddings(emb, original[1])
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["sentence_transformers"]["modules"] == original[0]
    left_out = report["side_files"]["left_out"]
    assert not {"modules.json", "1_Pooling/", "sentence_bert_config.json"} & set(left_out)
    card = (out / "README.md").read_text()
    assert "symmerge" in card and card != (inputs / "README.md").read_text()
    return report


def test_merge_and_align_minilm_with_itself_keep_the_pipeline(minilm, original, tmp_path):
    path = minilm[0]
    out = tmp_path / "merged"
    assert run_cli("merge", path, path, "--method", "average", "-o", out, "--progress", "none") == 0
    check_output(out, original, Path(path))
    out = tmp_path / "aligned"  # streamed: the other writing path
    assert run_cli("align", path, path, "--stream", "-o", out, "--progress", "none") == 0
    report = check_output(out, original, Path(path))
    assert report["streamed"] is True and report["sentence_transformers"]["copied_modules"] == []


def test_merge_and_align_minilm_with_a_disguised_copy(minilm, original, hidden, tmp_path):
    path = Path(minilm[0])
    # the disguised copy computes the same embeddings from weights far from the original's
    names, emb = encode(hidden)
    assert_same_embeddings(emb, original[1])
    merged = tmp_path / "merged"
    assert run_cli("merge", hidden, path, "--method", "average", "-o", merged, "--progress", "none") == 0
    report = check_output(merged, original, path)
    assert report["alignment"]["symmetries"] == ["heads", "attn", "ffn", "rescale"]  # BertModel: no residual
    before = report["distances_between_inputs"]["before_alignment"]
    after = report["distances_between_inputs"]["after_alignment"]
    assert list(after.values())[0] < 1e-3 * list(before.values())[0]
    aligned = tmp_path / "aligned"
    assert run_cli("align", hidden, path, "-o", aligned, "--progress", "none") == 0
    report = check_output(aligned, original, path)
    assert report["sentence_transformers"]["module_folders"] == ["1_Pooling"]


def dense_pipeline(path, folder, seed, out_features=8):
    """all-MiniLM-L6-v2 + a random Dense (384 → 8, tanh) + Normalize, saved by sentence-transformers."""
    torch.manual_seed(seed)
    base = st.SentenceTransformer(str(path), device="cpu", local_files_only=True)
    dense = st.models.Dense(base[1].get_sentence_embedding_dimension(), out_features)
    model = st.SentenceTransformer(modules=[base[0], base[1], dense, st.models.Normalize()], device="cpu")
    model.save(str(folder))
    weights = folder / "model.safetensors"  # the transformer's weights: the real ones, linked
    weights.unlink()
    weights.symlink_to(f"{path}/model.safetensors")
    return folder


@pytest.fixture(scope="module")
def dense(minilm, tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    return [dense_pipeline(minilm[0], root / f"d{i}", seed=i) for i in range(3)]


def dense_weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "2_Dense" / "model.safetensors"))


def test_a_dense_module_is_merged_with_the_method(dense, tmp_path):
    from symmerge.merge import get_method

    a, b, base = dense
    out = tmp_path / "avg"
    assert run_cli("merge", a, b, "--method", "average", "--weights", "0.7,0.3", "--align", "none", "-o", out,
                   "--progress", "none") == 0
    names, _ = encode(out)
    assert names == ["Transformer", "Pooling", "Dense", "Normalize"]
    assert json.loads((out / "symmerge_report.json").read_text())["mode"] == "stream"  # --align none streams
    memory = tmp_path / "avg-memory"
    assert run_cli("merge", a, b, "--method", "average", "--weights", "0.7,0.3", "--align", "none", "--mode", "memory",
                   "-o", memory, "--progress", "none") == 0
    assert dense_weights(memory).keys() == dense_weights(out).keys()
    assert all(torch.equal(dense_weights(memory)[k], dense_weights(out)[k]) for k in dense_weights(out))
    assert "symmerge" in (out / "README.md").read_text()
    got, wa, wb = dense_weights(out), dense_weights(a), dense_weights(b)
    assert set(got) == {"linear.weight", "linear.bias"}
    for k in got:
        torch.testing.assert_close(got[k], 0.7 * wa[k] + 0.3 * wb[k], rtol=0, atol=1e-6)
    report = json.loads((out / "symmerge_report.json").read_text())["sentence_transformers"]
    assert report["merged_modules"] == ["2_Dense"] and report["weighted_method"] == "average"
    # a task-vector method takes the Dense's task vectors from the base's Dense
    out = tmp_path / "ties"
    assert run_cli("merge", a, b, "--method", "ties", "--base", base, "--param", "density=0.5", "--align", "none",
                   "-o", out, "--progress", "none") == 0
    expect = get_method("ties").merge([wa, wb], base=dense_weights(base), density=0.5)
    got = dense_weights(out)
    for k in expect:
        assert torch.equal(got[k], expect[k]), k
    assert not torch.equal(got["linear.weight"], dense_weights(a)["linear.weight"])
    # methods with statistics have none for the Dense: it is averaged with the merge's weights, and said so
    from symmerge.io.sentence_transformers import check_pipelines
    from symmerge.merge.modules import merge_module_weights

    entry = check_pipelines([("a", a), ("b", b)], get_method("regmean"))
    assert entry["weighted_method"] == "average" and "2_Dense: averaged" in entry["note"]
    fallback = merge_module_weights(entry, [a, b], get_method("regmean"), weights=[0.7, 0.3])["2_Dense"]
    torch.testing.assert_close(fallback["linear.weight"], 0.7 * wa["linear.weight"] + 0.3 * wb["linear.weight"],
                               rtol=0, atol=1e-6)
    # the aligned copy of a Dense pipeline keeps its Dense as it is
    out = tmp_path / "aligned"
    assert run_cli("align", a, b, "--symmetries", "attn", "-o", out, "--progress", "none") == 0
    assert torch.equal(dense_weights(out)["linear.weight"], wa["linear.weight"])
    assert json.loads((out / "symmerge_report.json").read_text())["sentence_transformers"]["copied_modules"] == \
        ["2_Dense"]
    streamed = tmp_path / "streamed"
    assert run_cli("align", a, b, "--symmetries", "attn", "--stream", "-o", streamed, "--progress", "none") == 0
    assert encode(streamed)[0] == ["Transformer", "Pooling", "Dense", "Normalize"]
    assert torch.equal(dense_weights(streamed)["linear.weight"], wa["linear.weight"])
    assert "symmerge align --stream" in (streamed / "README.md").read_text()


def test_mismatched_pipelines_are_refused(minilm, dense, tmp_path, capsys):
    path = minilm[0]
    cls = copy_pipeline(path, tmp_path / "cls")
    config = json.loads((cls / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (cls / "1_Pooling" / "config.json").write_text(json.dumps(config))
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.txt"):
        (plain / name).symlink_to(f"{path}/{name}")
    cases = [(cls, "1_Pooling/config.json: pooling_mode is 'mean' in one and 'cls' in the other"),
             (dense[0], "has [Transformer, Pooling, Normalize], " + f"{dense[0]} has [Transformer, Pooling, Dense, "
                                                                    "Normalize]"),
             (plain, "is a plain model folder (no modules.json)")]
    for i, (other, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        assert run_cli("merge", path, other, "--method", "average", "-o", out) == 2
        err = capsys.readouterr().err
        assert "sentence-transformers pipelines" in err and message in err, err
        assert not out.exists()
    # a task-vector method needs the Dense of the base too
    assert run_cli("merge", *dense[:2], "--method", "task_arithmetic", "--base", path, "-o", tmp_path / "tv") == 2
    assert "the base has no 2_Dense/ weights" in capsys.readouterr().err and not (tmp_path / "tv").exists()
    # the same pipeline saved by sentence-transformers 6 (other config formats, more settings) merges
    resaved = tmp_path / "resaved"
    st.SentenceTransformer(str(path), device="cpu", local_files_only=True).save(str(resaved))
    assert "pooling_mode" in json.loads((resaved / "1_Pooling" / "config.json").read_text())
    from symmerge.io.sentence_transformers import check_pipelines

    assert check_pipelines([("a", path), ("b", resaved)])["modules"] == ["Transformer", "Pooling", "Normalize"]
    config = json.loads((resaved / "1_Pooling" / "config.json").read_text())
    (resaved / "1_Pooling" / "config.json").write_text(json.dumps({**config, "pooling_mode": "max"}))
    with pytest.raises(Exception, match="pooling_mode is 'mean' in one and 'max' in the other"):
        check_pipelines([("a", path), ("b", resaved)])


def test_the_residual_stream_the_pipeline_reads_is_kept(tmp_path, capsys):
    """A pipeline over a model class with a task head (the residual group exists): 'recommended' leaves
    residual out, with a note; naming it is an error; the stream (the pipeline's input) is unchanged."""
    from transformers import BertModel

    from symmerge import align_pair, AlignOptions, merge_models
    from symmerge.errors import SymmergeError

    folders = []
    for seed in (0, 1):
        f = save_folder(make_model("bert", head=True, seed=seed), tmp_path / f"m{seed}")
        (f / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (f / "1_Pooling").mkdir()
        (f / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
        folders.append(f)
    result = align_pair(*folders, AlignOptions(symmetries="recommended"))
    assert "residual" not in result.report["symmetries"]
    assert "residual left out of 'recommended'" in result.report["sentence_transformers"]["note"]
    ids = torch.randint(0, 60, (2, 7))
    before = BertModel.from_pretrained(str(folders[0])).eval()(input_ids=ids).last_hidden_state
    after = result.model.bert(input_ids=ids).last_hidden_state
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    with pytest.raises(SymmergeError, match="residual transform would change the coordinates of every embedding"):
        align_pair(*folders, AlignOptions(symmetries="attn,residual"))
    assert run_cli("align", *folders, "-o", tmp_path / "out") == 0
    assert "note: residual left out of 'recommended'" in capsys.readouterr().err
    _, report = merge_models(folders, "average", progress=False)
    assert "residual" not in report["alignment"]["symmetries"] and "sentence-transformers" in report["alignment"]["note"]
    # without the pipeline, the same models get the residual group
    for f in folders:
        (f / "modules.json").unlink()
    assert "residual" in align_pair(*folders, AlignOptions(symmetries="recommended")).report["symmetries"]
