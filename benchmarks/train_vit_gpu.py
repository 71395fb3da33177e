"""Train one model of a B1-recipe ViT pair (benchmarks/vit_fashion_mnist.py's settings and data) on a GPU, into
the cache folder ``train_vit`` uses (the same cache key), so that the benchmarks reuse it (issue 42: the pairs of
docs/results/datafree_multistart.md, 8 models in parallel on one H200, 128 s each). The steps run on the device,
so the weights are not bit-identical to a CPU run's.

    SYMMERGE_CACHE=... python benchmarks/train_vit_gpu.py SEED_A,SEED_B A|B [cuda]"""
import json, sys, tempfile
from pathlib import Path
import numpy as np
import torch
from benchmarks.vit_fashion_mnist import parse_args, prepare_data, work_dir
from benchmarks.common import pair_settings
from symmerge.demo.datasets import FASHION_CLASSES, PIXEL_MEAN, PIXEL_STD
from symmerge.demo import train as T
from symmerge.io.model import save_model

pair, which = sys.argv[1], sys.argv[2]
dev = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cuda")
args = parse_args(["--seeds", pair, "--train-only", which])
x_tr, y_tr, x_te, y_te = prepare_data(args, work_dir(args))[0]
config = T.vit_config(args.hidden, args.layers, args.heads, args.intermediate, args.patch, labels=FASHION_CLASSES)
seeds, todo = pair_settings(args)
(name, settings), = todo
name = f"fmnist-{name}"
key = T.cache_key(config, x_tr, y_tr, settings)
out, found = T.cached_folder(None, "vit", name, key, True)
if found:
    sys.exit(0)
x = torch.from_numpy(np.ascontiguousarray(T._as_pixels(x_tr)))
x = (x[:, None] if x.ndim == 3 else x).to(dev)
y = torch.from_numpy(np.asarray(y_tr).astype(np.int64)).to(dev)
torch.manual_seed(settings.seed)
from transformers import ViTForImageClassification
model = ViTForImageClassification(config).float().train().to(dev)
def batch_loss(idx):
    idx = idx.to(dev)
    return torch.nn.functional.cross_entropy(model(pixel_values=x[idx]).logits, y[idx],
                                             label_smoothing=settings.label_smoothing)
report = T.fit(model, settings, len(x), batch_loss, name, None, 0, False, print)
model = model.cpu().eval()
report = {"name": name, "key": key, **report, "pixel_normalisation": {"mean": PIXEL_MEAN, "std": PIXEL_STD},
          "trained_on": str(dev) + (" " + torch.cuda.get_device_name() if dev.type == "cuda" else "")}
report["eval_loss"], report["eval_accuracy"] = T.accuracy(model, x_te[:2000], y_te[:2000])
with tempfile.TemporaryDirectory() as side:
    (Path(side) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "ViTImageProcessor", "do_resize": False, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [PIXEL_MEAN], "image_std": [PIXEL_STD],
        "size": {"height": config.image_size, "width": config.image_size}}, indent=2) + "\n")
    save_model(model, out, src=side, report=report, report_name="train_report.json")
print(f"trained {name} seed {settings.seed} in {report['seconds']:.0f} s, eval acc {report['eval_accuracy']:.4f} -> {out}")
