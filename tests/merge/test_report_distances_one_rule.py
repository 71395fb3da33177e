"""A merge's report distances (``distances_between_inputs``, ``distance_result_to_inputs``) follow one rule in every
entry: ``symmerge merge`` loaded, ``symmerge merge --stream`` and ``symmerge run`` of the same merge as a mergekit
config report the same numbers, bit for bit (symmerge/merge/distances.py: one per-tensor function, the values summed
exactly). Before, memory summed ``core.distance.sq_distance``'s blocks and the stream the kernels' per-step values
with ``+=`` in the files' order: up to 2.2e-16 apart (docs/results/streameq_audit.md)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from factories import make_model
from symmerge.cli import main
from symmerge.merge import kernels
from symmerge.merge.distances import SquaredSums, exact_sum

pytestmark = pytest.mark.usefixtures("single_thread")

# method: (the command line's options, the config's method, its per-model and global parameters); slerp merges one
# model onto the base, the others two models (with the base where the method takes one); the command line merges the
# heads too (--heads merge), as a mergekit config merges every tensor, so that all three give the same result
METHODS = {
    "linear": (["--weights", "0.3,0.7"], "linear", [{"weight": 0.3}, {"weight": 0.7}], {}),
    "ties": (["--param", "density=0.5"], "ties", [{"weight": 1.0, "density": 0.5}] * 2, {}),
    "slerp": (["--param", "t=0.3"], "slerp", None, {"t": 0.3}),
    "task_arithmetic": ([], "task_arithmetic", [{"weight": 1.0}] * 2, {}),
    "dare_linear": (["--param", "density=0.6", "--param", "seed=7"], "dare_linear",
                    [{"weight": 1.0, "density": 0.6}] * 2, {}),
}
FIELDS = ("distances_between_inputs", "distance_result_to_inputs")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{(family, dtype): (base, m1, m2)}: tiny random models saved in float32 and bfloat16."""
    root = tmp_path_factory.mktemp("inputs")
    out = {}
    for family in ("llama", "bert"):
        for dtype in (torch.float32, torch.bfloat16):
            paths = []
            for name, seed in (("base", 0), ("m1", 1), ("m2", 2)):
                path = root / f"{family}-{str(dtype)[6:]}" / name
                make_model(family, head=True, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(path)
                paths.append(path)
            out[family, dtype] = tuple(paths)
    return out


def _report(out) -> dict:
    return json.loads((out / "symmerge_report.json").read_text())


def _tensors(out) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(out.glob("*.safetensors")))


def _config(path, method, base, models, per_model, params):
    lines = [f"merge_method: {method}"]
    if method == "slerp":
        lines += [f"base_model: {base}", "models:", f"  - model: {base}", f"  - model: {models[0]}"]
    else:
        if method != "linear":
            lines.append(f"base_model: {base}")
        lines.append("models:")
        for m, p in zip(models, per_model):
            lines += [f"  - model: {m}", f"    parameters: {json.dumps(p)}"]
    if method == "dare_linear":
        params = {**params, "seed": 7}
    if params:
        lines.append(f"parameters: {json.dumps(params)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _values(report) -> list:
    """The report's distances in order (the config names its inputs by their labels, merge by their paths)."""
    d = report["distances_between_inputs"]
    return [list(d["before_alignment"].values()), list(d["after_alignment"].values()),
            list(report["distance_result_to_inputs"].values())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("method", list(METHODS))
def test_merge_loaded_streamed_and_run_report_equal_distances(tmp_path, folders, method, family, dtype):
    base, m1, m2 = folders[family, dtype]
    options, config_method, per_model, params = METHODS[method]
    models = [m1] if method == "slerp" else [m1, m2]
    with_base = [] if method == "linear" else ["--base", str(base)]
    reports, tensors = {}, {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert main(["merge", *map(str, models), "--method", method, *options, *with_base, "--align", "none", "--heads", "merge",
                     "--mode", mode, "--progress", "none", "-o", str(out)]) == 0
        reports[mode], tensors[mode] = _report(out), _tensors(out)
    assert reports["memory"]["mode"] == "memory" and reports["stream"]["mode"] == "stream"
    assert tensors["memory"] == tensors["stream"]  # the same merge: the same result
    mem, streamed = ({f: r[f] for f in FIELDS} for r in (reports["memory"], reports["stream"]))
    assert mem == streamed  # every field, ==
    pairs = mem["distances_between_inputs"]["after_alignment"]
    assert len(pairs) == len(models) * (len(models) - 1) // 2 and len(mem["distance_result_to_inputs"]) == len(models)
    assert all(v > 0 and math.isfinite(v) for v in [*pairs.values(), *mem["distance_result_to_inputs"].values()])
    cfg = _config(tmp_path / "merge.yml", config_method, base, models, per_model or [], params)
    out = tmp_path / "run"
    assert main(["run", str(cfg), "-o", str(out), "--progress", "none"]) == 0
    ran = _report(out)
    assert _tensors(out) == tensors["stream"]  # the equivalent config: the same result
    assert _values(ran) == _values(reports["stream"])


def test_pairs_measured_alone_or_with_the_result_and_half_copies_agree():
    """The per-tensor function's values: a bfloat16 or float16 tensor and its float32 copy give the same (exact
    widening, either path of sq_distances); and they are the float64 sums to a rounding."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(3 * (1 << 14) + 77, generator=g) for _ in range(3)]
    for half in (torch.bfloat16, torch.float16):
        h = [x.to(half) for x in xs]
        assert kernels.sq_distances(h[:2], h[2]) == kernels.sq_distances([x.float() for x in h[:2]], h[2].float())
        assert kernels.sq_distances(h) == kernels.sq_distances([x.float() for x in h])
    mixed = kernels.sq_distances([xs[0].to(torch.bfloat16), xs[1]], xs[2])  # dtypes mixed: float32 copies
    assert mixed == kernels.sq_distances([xs[0].to(torch.bfloat16).float(), xs[1]], xs[2])
    pairs, to_result = kernels.sq_distances(xs[:2], xs[2])
    exact = lambda a, b: ((a.double() - b.double()) ** 2).sum().item()  # noqa: E731
    assert pairs[0, 1] == pytest.approx(exact(xs[0], xs[1]), rel=1e-13)
    assert to_result == pytest.approx([exact(xs[0], xs[2]), exact(xs[1], xs[2])], rel=1e-13)
    assert kernels.sq_distances([xs[0]]) == ({}, [])


def test_the_sums_are_exact_whatever_the_order():
    """SquaredSums adds each pair's per-tensor values exactly: tensors given in any order give the same bits (a plain
    ``+=`` in another order does not, on these values)."""
    g = torch.Generator().manual_seed(5)
    tensors = [[torch.randn(n, generator=g) * 10.0 ** (k % 7 - 3) for _ in range(3)]
               for k, n in enumerate([5, 300, 7, 4096, 33, 1000, 2, 65, 9000, 17])]
    totals = []
    for order in (range(10), reversed(range(10)), [3, 7, 1, 9, 0, 5, 2, 8, 4, 6]):
        sums = SquaredSums()
        for k in order:
            sums.add(tensors[k][:2], tensors[k][2])
        totals.append(sums.totals())
    assert totals[0] == totals[1] == totals[2]
    values = [kernels.sq_distances(t[:2], t[2])[1][0] for t in tensors]
    assert totals[0][1][0] == math.fsum(values)
    plain = [sum(values), sum(reversed(values))]
    assert any(p != totals[0][1][0] for p in plain)  # the values are chosen so that the order matters to +=
    assert exact_sum([1e308, 1e308]) == math.inf


@pytest.mark.parametrize("family,tied", [("llama", True), ("mixtral", False)], ids=["llama-tied", "mixtral"])
def test_the_same_tensors_are_measured_loaded_and_streamed(tmp_path, family, tied):
    """Both wings measure the body's tensors as the files store them: a tied LM head's embedding once (in memory its
    alias ``lm_head.weight`` was a second body tensor: 56.69 against the stream's 53.22 on this pair), a mixture's
    experts one stored tensor each (transformers fuses them in memory)."""
    models = []
    for seed in (1, 2):
        models.append(tmp_path / f"m{seed}")
        make_model(family, head=True, dtype=torch.float32, seed=seed, tied=tied or None).save_pretrained(models[-1])
    reports = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert main(["merge", *map(str, models), "--method", "linear", "--align", "none", "--mode", mode,
                     "--progress", "none", "-o", str(out)]) == 0
        reports[mode] = {f: _report(out)[f] for f in FIELDS}
    assert reports["memory"] == reports["stream"]
    sd = make_model(family, head=True, dtype=torch.float32, seed=1, tied=tied or None).state_dict()
    assert not tied or sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()


def test_an_aligned_merge_reports_the_same_merge_distances_loaded_and_streamed(tmp_path):
    """Aligned (the named symmetries stream): the aligned inputs' pairs and the distances to the result are equal too
    (the alignment's own figures, ``alignment.models``, keep core.distance's rule: a rounding apart)."""
    models = []
    for seed in (1, 2):
        models.append(tmp_path / f"m{seed}")
        make_model("llama", head=True, dtype=torch.float32, seed=seed).to(torch.bfloat16).save_pretrained(models[-1])
    reports = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert main(["merge", *map(str, models), "--method", "linear", "--align", "heads,attn,ffn,rescale",
                     "--mode", mode, "--progress", "none", "-o", str(out)]) == 0
        reports[mode] = _report(out)
    assert reports["stream"]["alignment"]["streamed"] and reports["stream"]["mode"] == "stream"
    mem, streamed = reports["memory"], reports["stream"]
    assert mem["distances_between_inputs"]["after_alignment"] == streamed["distances_between_inputs"]["after_alignment"]
    assert mem["distance_result_to_inputs"] == streamed["distance_result_to_inputs"]
