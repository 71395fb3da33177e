"""sentence-transformers pipelines kept whole through ``align`` and ``merge``.

A sentence-transformers model is an HF folder (the ``Transformer`` module, at the folder's root) plus
a pipeline that reads its output: ``modules.json`` lists the modules, each in its own folder
(``1_Pooling/``, ``2_Dense/``, ``3_Normalize/``...), and ``sentence_bert_config.json`` /
``config_sentence_transformers.json`` hold the Transformer's and the model's settings. symmerge keeps
that pipeline:

* **checked**: every input of a merge must have the same pipeline — the same module types in the same
  folders, the same module configs, the same settings (``__version__`` aside; a setting only one input
  has is its library version's default, and not compared; legacy Pooling flags read as
  ``pooling_mode``), the same tensors in modules with weights — or none; anything else is one error
  naming the difference (:func:`check_pipelines`);
* **copied**: the output gets the configs of the model its side files come from
  (:func:`write_pipeline`, called by :func:`symmerge.io.model.copy_side_files`);
* **merged**: the weights of modules beyond the transformer (``2_Dense/model.safetensors``) are merged
  with the merge's method, tensor by tensor (:func:`symmerge.merge.modules.merge_module_weights`,
  passed in by the merge as ``merge_modules``: io never imports the merge methods); methods that need statistics
  or the architecture (``fisher``, ``regmean``, ``ot_*``) have none for these modules, and their tensors
  are averaged with the merge's weights instead (the report says so). ``align`` copies them: the
  aligned transformer computes the same output, so they still fit;
* **their input kept in its frame**: the pipeline reads the transformer's last hidden state, which is
  the residual stream. A ``residual`` transform (a permutation or rotation of the stream's coordinates)
  would rotate every embedding: norms and cosines between texts survive, but the embeddings no longer
  equal the original model's, so an index built with the input model stops matching, and a Dense
  module would read permuted inputs. No module of the pipeline is transformed with the stream, so
  ``recommended`` leaves ``residual`` out (with a note) and naming it is an error
  (:func:`output_reader` states the fact, :func:`symmerge.pipeline.recommend.recommended` the rule). (For a base
  model class, e.g. ``BertModel``, ``recommended`` has no residual group anyway: its output is the stream.)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import SymmergeError

MODULES = "modules.json"
# settings files at the folder's root: the model's, and the Transformer module's (sentence_<model>_config.json)
ROOT_CONFIGS = ("modules.json", "config_sentence_transformers.json")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
IGNORED_SETTINGS = ("__version__",)  # which library versions saved the model: not part of the pipeline
# sentence-transformers < 6 wrote a Pooling's mode as one flag per mode, 6 as one ``pooling_mode``
# (as sentence-transformers itself converts them when it loads an old config)
LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def _pooling(config: dict) -> dict:
    """A Pooling config in sentence-transformers 6's form, whichever version wrote it."""
    config = dict(config)
    if "word_embedding_dimension" in config:
        config.setdefault("embedding_dimension", config.pop("word_embedding_dimension"))
    flags = [k for k in LEGACY_POOLING if k in config]
    if flags:
        modes = [mode for k, mode in LEGACY_POOLING.items() if config.get(k)] or ["mean"]
        for k in flags:
            del config[k]
        config.setdefault("pooling_mode", modes[0] if len(modes) == 1 else modes)
    return config


def short_type(entry: dict) -> str:
    """``sentence_transformers.models.Pooling`` and ``...sentence_transformer.modules.pooling.Pooling``
    (sentence-transformers 2 and 6) are both ``Pooling``."""
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SymmergeError(f"{path}: unreadable sentence-transformers file ({e})") from None


@dataclass
class Pipeline:
    """A sentence-transformers folder's pipeline: ``modules`` as ``modules.json`` lists them."""

    folder: Path
    modules: list

    @property
    def names(self) -> list[str]:
        return [short_type(m) for m in self.modules]

    def root_configs(self) -> list[str]:
        names = [n for n in ROOT_CONFIGS if (self.folder / n).is_file()]
        return names + sorted(p.name for p in self.folder.glob("sentence_*_config.json") if p.is_file())

    def module_folders(self) -> list[str]:
        """The modules' folders (the Transformer's, the root, excluded), those that exist."""
        return [m["path"] for m in self.modules if m.get("path") and (self.folder / m["path"]).is_dir()]

    def weight_file(self, module: str) -> Path | None:
        return next((self.folder / module / w for w in WEIGHTS if (self.folder / module / w).is_file()), None)

    def weighted(self) -> list[str]:
        """The module folders holding weights (e.g. ``2_Dense``)."""
        return [m for m in self.module_folders() if self.weight_file(m) is not None]

    def settings(self) -> dict:
        """Everything the pipeline's behaviour depends on besides weights: the root settings and every
        module's JSON configs (parsed, ``__version__`` left out)."""
        out = {}
        for name in self.root_configs():
            value = _json(self.folder / name)
            if isinstance(value, dict):
                value = {k: v for k, v in value.items() if k not in IGNORED_SETTINGS}
            out[name] = value
        pooling = {m.get("path") for m in self.modules if short_type(m) == "Pooling"}
        for m in self.module_folders():
            for f in sorted((self.folder / m).glob("*.json")):
                value = _json(f)
                out[f"{m}/{f.name}"] = _pooling(value) if m in pooling and isinstance(value, dict) else value
        if MODULES in out:  # module types compared by class name, whichever library version wrote them
            out[MODULES] = [{**e, "type": short_type(e)} for e in out[MODULES]]
        return out

    def describe(self) -> str:
        return "[" + ", ".join(self.names) + "]"


def read_pipeline(path, allow_nested: bool = False) -> Pipeline | None:
    """The :class:`Pipeline` of a sentence-transformers folder (one with ``modules.json``), else ``None``."""
    path = Path(path)
    if not (path / MODULES).is_file():
        return None
    modules = _json(path / MODULES)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise SymmergeError(f"{path / MODULES}: not a list of modules with a type each")
    transformers = [m for m in modules if short_type(m) == "Transformer"]
    if not transformers or transformers[0].get("path", "") != "":
        where = transformers[0].get("path") if transformers else None
        raise SymmergeError(
            f"{path}: a sentence-transformers model whose transformer is "
            f"{'in ' + repr(where) if where else 'missing'}; symmerge merges models whose Transformer module is the "
            "folder itself (modules.json path \"\"), as sentence-transformers saves them since version 2; re-save it "
            "with SentenceTransformer(...).save(folder)")
    for m in modules:
        p = m.get("path", "")
        if p and (Path(p).is_absolute() or ".." in Path(p).parts):
            raise SymmergeError(f"{path / MODULES}: module path {p!r} leaves the folder")
    return Pipeline(path, modules)


def _first_difference(a, b, where: str = "") -> str | None:
    """Where two parsed JSON values first differ, in words. Of two objects only the keys both have are
    compared: a key only one has was written by another library version, which reads it as its default."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() & b.keys(), key=str):
            d = _first_difference(a[k], b[k], f"{where}{k}.")
            if d:
                return d
        return None
    return None if a == b else f"{where.rstrip('.')} is {a!r} in one and {b!r} in the other"


def module_tensors(path: Path, allow_pickle: bool) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:  # safetensors' own error types
            raise SymmergeError(f"{path}: unreadable safetensors file ({e})") from None
    if not allow_pickle:
        raise SymmergeError(f"{path}: pickle weights; refusing to unpickle untrusted files. Convert to safetensors, "
                            "or pass --allow-pickle")
    import torch

    return torch.load(str(path), map_location="cpu", weights_only=True)


def check_pipelines(named, method=None, base=None, allow_pickle: bool = False) -> dict | None:
    """Compare the pipelines of ``named`` (``(name, model or folder)`` pairs) before anything is loaded;
    returns the report's ``sentence_transformers`` entry (``None`` when no input is a
    sentence-transformers folder) or raises :class:`SymmergeError` on the first difference.
    ``method``: the merge :class:`~symmerge.merge.base.Method` (modules with weights are merged with it;
    a task-vector method needs them in ``base`` too)."""
    pipes = [(name, read_pipeline(x) if isinstance(x, (str, Path)) else None) for name, x in named]
    if not any(p for _, p in pipes):
        return None
    first_name, first = next((n, p) for n, p in pipes if p is not None)
    for name, x in named:
        if not isinstance(x, (str, Path)):
            raise SymmergeError(f"{first_name} is a sentence-transformers model; {name} is a model in memory, whose "
                                "pipeline cannot be checked: pass every model as a folder")
    for name, p in pipes:
        if p is None:
            raise SymmergeError(f"the sentence-transformers pipelines differ: {first_name} has {first.describe()} "
                                f"(modules.json), {name} is a plain model folder (no modules.json)")
        if p is first:
            continue
        if p.names != first.names \
                or [m.get("path", "") for m in p.modules] != [m.get("path", "") for m in first.modules]:
            raise SymmergeError(f"the sentence-transformers pipelines differ: {first_name} has {first.describe()}, "
                                f"{name} has {p.describe()} (modules.json)")
        sa, sb = first.settings(), p.settings()
        for key in sorted(sa.keys() & sb.keys()):  # a file only one has: its module's defaults
            d = _first_difference(sa[key], sb[key])
            if d:
                raise SymmergeError(f"the sentence-transformers pipelines of {first_name} and {name} differ: "
                                    f"{key}: {d}")
        if p.weighted() != first.weighted():
            raise SymmergeError(f"the sentence-transformers pipelines of {first_name} and {name} differ: modules with "
                                f"weights {first.weighted()} and {p.weighted()}")
    entry = {"modules": first.names, "module_folders": first.module_folders(), "weighted_modules": first.weighted()}
    if entry["weighted_modules"] and method is not None:
        shapes = {}
        for name, p in pipes:
            for m in p.weighted():
                sd = module_tensors(p.weight_file(m), allow_pickle)
                got = {k: tuple(t.shape) for k, t in sd.items()}
                if shapes.setdefault(m, got) != got:
                    raise SymmergeError(f"the sentence-transformers pipelines of {first_name} and {name} differ: "
                                        f"{m} holds other tensors or shapes")
        if method.needs_base:
            base_pipe = read_pipeline(base) if isinstance(base, (str, Path)) else None
            missing = [m for m in first.weighted() if base_pipe is None or base_pipe.weight_file(m) is None]
            if missing:
                raise SymmergeError(f"method {method.name!r} merges task vectors, and the base has no {missing[0]}/ "
                                    "weights to take them from: give a sentence-transformers base with the same "
                                    "pipeline")
            for m in first.weighted():
                got = {k: tuple(t.shape) for k, t in module_tensors(base_pipe.weight_file(m), allow_pickle).items()}
                if got != shapes[m]:
                    raise SymmergeError(f"the base's {m}/ holds other tensors or shapes than the models'")
        entry["weighted_method"] = (method.name if not (method.needs or method.needs_model) else "average")
        if method.needs or method.needs_model:
            entry["note"] = (f"{', '.join(entry['weighted_modules'])}: averaged with the merge's weights "
                             f"({method.name} needs statistics or the architecture, which these modules do not have)")
    return entry


def output_reader(entry: dict | None) -> str | None:
    """Why the transformer's output frame must stay when a sentence-transformers pipeline (``entry``, from
    :func:`check_pipelines`) reads it, or None without one: the fact
    :func:`symmerge.pipeline.recommend.recommended` reads to leave out (or refuse) the symmetries whose kind
    moves the output frame (the residual stream)."""
    if entry is None:
        return None
    return ("the sentence-transformers pipeline (" + ", ".join(entry["modules"][1:]) + ") reads the transformer's "
            "output, the residual stream, and none of its modules is transformed with it: a residual transform "
            "would change the coordinates of every embedding")


def write_pipeline(dst: Path, src: Path, report: dict | None, merge_modules=None) -> list[str]:
    """Write the pipeline of ``src`` into the output folder ``dst``: its settings and module folders, the
    weights of its modules merged (a merge report, with ``sentence_transformers``) or copied; returns
    the names written (folders with a trailing ``/``), ``[]`` when ``src`` is no sentence-transformers
    folder."""
    pipe = read_pipeline(src)
    if pipe is None:
        return []
    entry = (report or {}).get("sentence_transformers")
    merged = {}
    if entry and entry.get("weighted_modules") and report.get("method"):
        if merge_modules is None:  # a programming error: the merge's module weights would be silently copied
            raise SymmergeError("writing a merged sentence-transformers pipeline needs merge_modules="
                                "symmerge.merge.modules.merge_pipeline_modules")
        merged = merge_modules(entry, report)
    written = []
    for name in pipe.root_configs():
        shutil.copy2(src / name, dst / name)
        written.append(name)
    for module in pipe.module_folders():
        target = dst / module
        target.mkdir(parents=True, exist_ok=True)
        for item in sorted((src / module).iterdir()):
            if module in merged and item.name in WEIGHTS:
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, target / item.name)
        if module in merged:
            from safetensors.torch import save_file

            save_file({k: t.contiguous() for k, t in merged[module].items()}, str(target / "model.safetensors"),
                      metadata={"format": "pt"})
        written.append(module + "/")
    if entry is not None:
        entry["merged_modules" if merged else "copied_modules"] = sorted(merged) or pipe.weighted()
    return written
