"""Run a described config: each mergekit job in dependency order (intermediates of a multi-document file
in a temporary folder beside the output, removed at the end), or the symmerge command line."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SymmergeError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
CONFIG_COPY = "mergekit_config.yml"  # the config, beside the model card (as mergekit writes it)
SYMMERGE_CONFIG_COPY = "symmerge_config.yml"  # a config of symmerge's keys (commands/run.py): no mergekit config


@dataclass(frozen=True)
class RunOptions:
    """How a config's merges are written (``symmerge run``'s and mergekit-yaml's flags): the largest shard,
    progress on stderr, the model card (``README.md``) and the config's copy (``mergekit_config.yml``) or
    not (``--no-write-model-card``), the tokenizer copied or not (``--no-copy-tokenizer``: a tokenizer the
    config builds, ``tokenizer_source`` / ``tokenizer``, is still written, as mergekit writes it), the device
    the per-tensor arithmetic runs on (``--cuda``, ``--device``: tensors are read and written on the CPU)."""

    shard_size: str = "5GB"
    progress: bool = True
    card: bool = True
    copy_tokenizer: bool = True
    device: str | None = None


def run_jobs(desc, shard_size="5GB", progress=True, options: RunOptions | None = None) -> list[dict]:
    """Every job of ``desc`` (a mergekit config); the final one written to ``desc.output`` with its report
    (``symmerge_report.json``), model card and the config's copy. Returns one summary dict per job. An aligned
    config (``desc.alignment``) aligns its models into one frame first (:func:`run_aligned`)."""
    from ..io.checkpoint import LazyCheckpoint
    from ..io.model import ensure_output_dir
    from ..io.output import side_name

    opts = options or RunOptions(shard_size=shard_size, progress=progress)
    out = Path(desc.output)
    ensure_output_dir(out, inputs=model_folders(desc))
    if desc.alignment is not None:
        return run_aligned(desc, options=opts)
    temp = None
    folders: list[Path] = []
    summaries = []
    try:
        for job in desc.jobs:
            if job.final:
                target = out
            else:
                if temp is None:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    temp = Path(tempfile.mkdtemp(prefix=f".{side_name(out)}.intermediates-", dir=out.parent))
                target = temp / job.name
            # the checkpoints: an input's as the plan read it, an earlier merge's output opened here, once
            inputs = [i.checkpoint(job.headers) if i.folder is not None else LazyCheckpoint(folders[i.job], spec=False)
                      for i in job.inputs]
            t0 = time.perf_counter()
            execute(job, inputs, target, options=opts, desc=desc if job.final else None)
            folders.append(target)
            summaries.append({"name": job.name, "method": job.method, "tensors": len(job.steps),
                              "layers": job.layers, "output": str(target), "seconds": time.perf_counter() - t0})
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return summaries


def model_folders(desc) -> list[str]:
    """Every model the config reads, as written (``BASE+ADAPTER``: both folders) and as read (the merged
    folder of a LoRA input, a single file's folder): every ``model``, ``base_model``, slice source and tokenizer
    source of every document (an earlier merge of the file is no folder of the user's)."""
    return [x for job in desc.jobs for inp in job.inputs if inp.folder is not None for x in (inp.label, inp.folder)]


def run_aligned(desc, shard_size="5GB", progress=True, options: RunOptions | None = None) -> list[dict]:
    """An aligned config (one merge): its models aligned into one frame, their aligned copies in a temporary
    folder beside the output (``.<name>.symmerge-tmp-<pid>-aligned-*``, removed at the end), the config
    re-planned on them and run; the output's ``symmerge_report.json`` holds the alignment."""
    import contextlib

    from ..io.output import clean_stale, temp_prefix
    from . import aligned
    from .mergekit import Planner

    opts = options or RunOptions(shard_size=shard_size, progress=progress)
    out = Path(desc.output)
    spec = desc.alignment
    with contextlib.ExitStack() as stack:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(out)
        work = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "aligned"), dir=out.parent))
        stack.callback(shutil.rmtree, work, True)
        t0 = time.perf_counter()
        moved, planned = aligned.align_job(desc.jobs[0], spec, out, work, stack)  # planned once, in there
        seconds = time.perf_counter() - t0
        jobs = Planner(desc.docs, seed=desc.seed, folders=moved).plan() if moved else desc.jobs
        job = jobs[0]
        job.output = out
        labels = [i.label for i in desc.jobs[0].inputs]
        job.report = {"aligned": {i.label: moved.get(i.label) is not None for i in job.inputs},
                      "alignment": spec.report, "labels": labels, "align_seconds": seconds}
        t1 = time.perf_counter()
        inputs = [i.checkpoint(job.headers) for i in job.inputs]
        execute(job, inputs, out, options=opts, desc=desc, alignment=planned)
        return [{"name": job.name, "method": job.method, "tensors": len(job.steps), "layers": job.layers,
                 "output": str(out), "seconds": time.perf_counter() - t1, "align_seconds": seconds,
                 "alignment": spec.report}]


def execute(job, inputs, out, shard_size="5GB", progress=True, options: RunOptions | None = None,
            desc=None, alignment=None) -> dict:
    """One job through the streamed executor (:func:`symmerge.merge.executor.execute_steps`): its steps read
    from ``inputs`` (the inputs' checkpoints, :class:`~symmerge.io.checkpoint.LazyCheckpoint` s or views of them),
    merged and written to ``out`` with the config.json of input ``config_from`` plus the job's edits, the side files
    (tokenizer, generation config) of input ``side_files_from``, and the chat template asked for; with ``desc`` (the
    final merge of a config) its report, model card and the config's copy (``alignment``: an aligned config's
    alignment plan, recorded in the report's plan)."""
    from ..merge import METHODS
    from ..merge.executor import OutputFolder, execute_steps
    from ..merge.stream import head_keys_of

    started = time.perf_counter()
    opts = options or RunOptions(shard_size=shard_size, progress=progress)
    method = METHODS.get(job.method)
    if method is None:  # pragma: no cover - the plan checked the name
        raise SymmergeError(f"unknown merge method {job.method!r}")
    plain = method
    if job.dtype is not None and any(st.merge for st in job.steps):
        method = computing_in(method, DTYPES[job.dtype])
    if opts.device is not None and opts.device != "cpu" and any(st.merge for st in job.steps):
        method = computing_on(method, opts.device)
    folders = [Path(p.folder) for p in inputs]  # an adapted base: its view's folder is the task's
    config = json.loads((folders[job.config_from] / "config.json").read_text())
    config.update(job.config_edits)
    want = job.out_dtype or job.dtype
    if job.vocab is not None:
        from .vocab import remapped_inputs

        inputs = remapped_inputs(job, list(inputs), DTYPES[job.dtype] if job.dtype else None)

    heads = head_keys_of(inputs[job.config_from])  # the input config_from as the run reads it

    def finish(tmp, facts):
        tmp = Path(tmp)
        built = job.vocab is not None and job.vocab.tokenizer is not None  # the config builds the tokenizer
        if not opts.copy_tokenizer and not built:
            from ..io.tokenizers import drop_tokenizer

            drop_tokenizer(tmp, facts.get("side_files"))
        if built:
            from .vocab import write_tokenizer

            write_tokenizer(job.vocab, tmp)
        if job.chat_template is not None and (opts.copy_tokenizer or built):
            write_chat_template(tmp, job.chat_template, folders)
        if desc is not None:
            write_outputs(tmp, job, desc, plain, facts, opts, alignment, started=started, heads=heads)

    return execute_steps(inputs, job.steps, method, out,
                         OutputFolder(config=config, dtype=DTYPES[want] if want else None,
                                      side_files_from=folders[job.side_files_from], naming=job.config_from,
                                      shard_size=opts.shard_size, finish=finish),
                         progress=opts.progress, distances=body_steps(job, heads))


def body_steps(job, heads) -> set:
    """The output tensors the report's distances sum: the body — every step but ``heads`` (the head keys of the input
    ``config_from``, :func:`symmerge.merge.stream.head_keys_of`) — as ``symmerge merge`` measures them for the same
    merge (docs/merge.md, "Two distances"; one rule: :func:`symmerge.merge.steps.measured_steps`)."""
    from ..merge.steps import measured_steps

    return measured_steps(job.steps, heads)


def config_head(steps, labels, heads) -> dict:
    """A config's report ``head`` entry: what its steps do — every tensor as its steps say, or, when every step copies
    from one input (a one-model passthrough), the entry ``symmerge merge`` reports for the same merge
    (:func:`symmerge.merge.heads.passthrough_head`, without its ``requested`` and ``keys``: a config asks for no head
    policy, its steps name the tensors); ``heads``: the head keys of the input ``config_from``."""
    from ..merge.heads import passthrough_head

    copied = passthrough_head(steps, labels, heads)
    return copied or {"policy": "merge", "note": "a mergekit config merges every tensor as its steps say"}


def write_outputs(folder: Path, job, desc, method, facts, opts: RunOptions, alignment=None, started=None, *,
                  heads) -> dict:
    """The final merge's ``symmerge_report.json`` (:func:`symmerge.merge.plan.merge_report`, the report every
    merge writes, built from the document's plan — :func:`symmerge.config.run_plan.plan_document` — plus the
    config's entry and the merge report's ``timings``: ``merge`` from ``started``, ``align`` an aligned config's
    alignment) and, unless ``opts.card`` is off, its model card (``README.md``,
    :func:`symmerge.io.card.write_card`) and the config's text (``mergekit_config.yml``); ``heads``:
    the head keys of its input ``config_from`` (:func:`symmerge.merge.stream.head_keys_of`)."""
    import math

    from ..io.card import write_card
    from ..io.model import write_json
    from ..merge.plan import merge_report, stream_entry
    from .run_plan import model_type_at, document_of, merged_names, plan_document

    extra = dict(job.report or {})
    align_seconds = float(extra.pop("align_seconds", 0.0))
    labels = extra.pop("labels", None) or [i.label for i in job.inputs]
    doc_plan = plan_document(desc, job, method, model_type_at(folder), labels, alignment)
    plan = doc_plan.merge
    names, uniform = merged_names(job, labels)
    pairs = {f"{names[i]} | {names[j]}": math.sqrt(v) for (i, j), v in sorted(facts["pairwise_sq"].items())} \
        if uniform else None
    alignment = extra.pop("alignment", None) or plan.alignment()
    report = merge_report(
        plan, base=labels[job.base] if job.base is not None else None, alignment=alignment,
        head=config_head(job.steps, labels, heads),
        distances_between_inputs={"before_alignment": None if extra.get("aligned") else pairs,
                                  "after_alignment": pairs},
        distance_result_to_inputs={names[i]: math.sqrt(v) for i, v in facts["result_sq"].items()} if uniform else None,
        stream=stream_entry(facts), side_files=facts.get("side_files"),
        names=names)
    report["config"] = {"path": str(desc.path), "name": job.name, "merge_method": document_of(desc, job).data.get(
        "merge_method"), "merges": len(desc.jobs), "tensors": len(job.steps), "layers": job.layers,
        "dtype": job.dtype, "out_dtype": job.out_dtype, "warnings": list(desc.warnings)}
    report.update(extra)
    merge_seconds = time.perf_counter() - started if started is not None else 0.0
    report["timings"] = {"load": 0.0, "align": align_seconds, "statistics": 0.0, "merge": merge_seconds,
                         "evaluate": 0.0, "total": align_seconds + merge_seconds}
    if opts.card:
        write_card(folder, report)
        (folder / CONFIG_COPY).write_text(Path(desc.path).read_text(encoding="utf-8"), encoding="utf-8")
    write_json(folder / "symmerge_report.json", report)
    return report


def computing_on(method, device):
    """``method`` with its arithmetic on ``device`` (``--cuda``, ``--device``): each step's tensors moved there,
    the result brought back to the CPU, where the executor reads and writes (mergekit's math device)."""
    from dataclasses import replace

    def move(t):
        return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t

    def tensor(key, tensors, weights, stats, base, params, context):
        out = method.tensor(key, [move(t) for t in tensors], weights, stats, move(base), params, context)
        return out.to("cpu") if isinstance(out, torch.Tensor) else out

    context = None
    if method.tensor_context is not None:
        def context(key, tensors, base, weights, params, ctx):
            return method.tensor_context(key, [move(t) for t in tensors], move(base), weights, params, ctx)

    return replace(method, tensor=tensor, tensor_context=context, fused_into=None)


def computing_in(method, dtype):
    """``method`` with its floating inputs rounded to ``dtype`` first: mergekit's ``dtype``, the dtype the merge
    computes in (its thresholds and masks see the rounded values)."""
    from dataclasses import replace

    def rounds(t) -> bool:
        return t is not None and t.is_floating_point() and t.dtype != dtype

    def cast(t):
        return t.to(dtype) if rounds(t) else t

    def tensor(key, tensors, weights, stats, base, params, context):
        out = method.tensor(key, [cast(t) for t in tensors], weights, stats, cast(base), params, context)
        # a float64 result (symmerge's exact form of the rule) is rounded to ``dtype``, where mergekit holds its
        # result before ``out_dtype`` widens it; a rule running mergekit's own arithmetic returns its dtype already
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and dtype != torch.float64:
            out = out.to(dtype)
        return out

    context = None
    if method.tensor_context is not None:
        def context(key, tensors, base, weights, params, ctx):
            return method.tensor_context(key, [cast(t) for t in tensors], cast(base), weights, params, ctx)

    fused = None
    if method.fused_into is not None:
        def fused(key, tensors, weights, base, params, context, out):
            # inputs already in ``dtype`` (a float32 config on float32 files, bfloat16 on bfloat16): nothing to
            # round, so the method's own fused kernel gives the bits of its rule; else the rule on the cast inputs
            if any(rounds(t) for t in [*tensors, base]):
                return False
            return method.fused_into(key, tensors, weights, base, params, context, out)

    return replace(method, tensor=tensor, tensor_context=context, fused_into=fused, computes_in=dtype)


def write_chat_template(folder: Path, template: str, inputs) -> None:
    """The output's chat template: ``template``, or with ``auto`` the most common one of the inputs (none:
    left as copied)."""
    from collections import Counter

    if template == "auto":
        found = [t for t in (read_chat_template(p) for p in inputs) if t]
        if not found:
            return
        template = Counter(t.strip() for t in found).most_common(1)[0][0]
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        if "chat_template" in data:
            data.pop("chat_template")
            cfg.write_text(json.dumps(data, indent=2) + "\n")
    (folder / "chat_template.json").unlink(missing_ok=True)
    (folder / "chat_template.jinja").write_text(template)


def read_chat_template(folder: Path) -> str | None:
    f = folder / "chat_template.jinja"
    if f.is_file():
        return f.read_text()
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(t, dict):
            t = t.get("default")
        if isinstance(t, list):
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return None


def print_summary(desc, summaries) -> None:
    for s in summaries:
        if s.get("alignment") is not None:
            a = s["alignment"]
            anchor = a.get("anchor") or {}
            what = (f"aligned with {','.join(a['symmetries'])} into one frame ({a.get('mode', '')}; anchor: "
                    f"{anchor.get('name')}, {anchor.get('rule')}) in {s['align_seconds']:.2f} s"
                    if a.get("symmetries") else "nothing aligned")
            print(what + (f" (note: {a['note']})" if a.get("note") else ""))
        where = "intermediate " + s["name"] if s["output"] != str(desc.output) else str(desc.output)
        print(f"merged {s['tensors']} tensors ({s['layers']} layers) with {s['method']} -> {where} "
              f"({s['seconds']:.2f} s)")


__all__ = ["RunOptions", "execute", "print_summary", "run_jobs"]
