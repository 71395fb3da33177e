"""Audit cases on the package first on sys.path: prints one JSON object of figures."""
import json, sys, io, contextlib, tempfile, shutil
from pathlib import Path
import torch
torch.set_num_threads(1)
sys.path.insert(0, "tests")
import symmerge
from conftest import vit_folder, npz_file
from symmerge.cli import main
from symmerge.evaluate.metrics import barrier
from safetensors.torch import load_file, save_file
root = Path(tempfile.mkdtemp(prefix="audit-", dir=None))
npz = npz_file(root / "e.npz", n=30, seed=1)
m1, m2 = (str(vit_folder(root / f"m{s}", s)) for s in (1, 2))
over = Path(vit_folder(root / "over", 1))
sd = load_file(str(over / "model.safetensors")); sd["vit.layernorm.bias"].fill_(1.0); sd["classifier.weight"][0].fill_(3e37)
save_file(sd, str(over / "model.safetensors"), metadata={"format": "pt"})
def run(name, *argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv] + ["--progress", "none", "-o", str(root / name)])
    f = root / name / "barrier.json"
    return rc, out.getvalue(), [x for x in err.getvalue().splitlines() if x.startswith(("warning", "symmerge", "note: the", "Traceback")) or "Error" in x], (json.loads(f.read_text()) if f.exists() else None)
res = {"package": symmerge.__file__, "nan_inside": str(barrier([0, .5, 1], [1.0, float("nan"), 1.0]))}
for pts in (2, 4):
    rc, out, err, j = run(f"p{pts}", "barrier", m1, m2, "--data", npz, "--align", "none", "--points", pts)
    res[f"points{pts}"] = {"rc": rc, "printed": out.splitlines()[:1], "warnings": err, "alphas": j["alphas"], "loss": j["curves"]["none"]["loss"]}
rc, out, err, j = run("out_over", "barrier", str(over), m2, "--data", npz, "--align", "none", "--points", 3)
res["overflow"] = {"rc": rc, "printed": out.splitlines()[:1], "warnings": err, "curve": j and j["curves"]["none"], "endpoint_A": j and j["endpoints"]["A"]}
rc, out, err, j = run("temp", "barrier", m1, m2, "--data", npz, "--align", "attn,ffn", "--align-data", npz, "--temperature", "--points", 5)
res["temperature"] = {"rc": rc, "warnings": err, "temperatures": j["curves"]["attn,ffn+temperature"]["temperatures"],
                      "at_bound": j["curves"]["attn,ffn+temperature"].get("temperatures_at_bound")}
print(json.dumps(res, indent=1))
shutil.rmtree(root)
