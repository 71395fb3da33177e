"""The barrier study's figures recomputed by hand on the audit's tiny ViT pair (run from the repository root)."""
import copy, json, math, sys, tempfile
from pathlib import Path
import numpy as np, torch
torch.set_num_threads(1)
sys.path[:0] = ["tests", "tests/evaluate"]
from conftest import classifier_eval, npz_file
from test_barrier_audit import _vits_with_norms
from symmerge.merge.barrier import barrier_study
from symmerge.pipeline.align import align_pair
from symmerge.pipeline.options import AlignOptions
t = Path(tempfile.mkdtemp())
a, b = _vits_with_norms(t)  # the test's pair: norms and biases moved off 1 and 0
npz = npz_file(t / "eval.npz", n=23)
res = barrier_study(a, b, npz, aligns=["recommended"], points=6, batch_size=5, progress=False)
name = next(v for v in res["curves"] if v != "none")
al = align_pair(a, b, AlignOptions(symmetries=name))
z = np.load(npz); x = {"pixel_values": torch.from_numpy(z["pixel_values"])}
def point(ea, eb, al_):
    m = copy.deepcopy(eb); sa = ea.state_dict()
    m.load_state_dict({k: al_ * sa[k] + (1 - al_) * v for k, v in eb.state_dict().items()}); return m
def dist(m1, m2):
    s1, s2 = m1.state_dict(), m2.state_dict()
    return math.sqrt(sum(((s1[k].double() - s2[k].double()) ** 2).sum().item() for k, _ in m1.named_parameters()))
out = {"variant": name}
for v, (ea, eb) in (("none", (a, b)), (name, (al.model, al.anchor))):
    mine = [classifier_eval(point(ea, eb, al_), x, z["labels"]) for al_ in res["alphas"]]
    L = [m[0] for m in mine]; line = [al_ * L[-1] + (1 - al_) * L[0] for al_ in res["alphas"]]
    c = res["curves"][v]
    out[v] = {"barrier_symmerge": c["barrier"], "barrier_mine": max(u - w for u, w in zip(L, line)),
              "loss_max_rel_diff": max(abs(p - q) / abs(q) for p, q in zip(c["loss"], L)),
              "accuracy_max_abs_diff": max(abs(p - m[1]) for p, m in zip(c["accuracy"], mine)),
              "loss_symmerge": c["loss"], "accuracy_symmerge": c["accuracy"]}
out["distance_before_stored"] = {"symmerge": res["distances"][name]["before"]["whole"], "mine": dist(a, b)}
out["distance_after"] = {"symmerge": res["curves"][name]["distance_after"], "table": res["distances"][name]["after"]["whole"], "mine": dist(al.model, al.anchor)}
out["distance_before_curve_folded"] = res["curves"][name]["distance_before"]
print(json.dumps(out, indent=1))
