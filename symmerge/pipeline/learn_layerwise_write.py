"""``symmerge align A B -o OUT --match learned --stream``: the learned alignment of two checkpoints read layer by
layer from their safetensors (:mod:`symmerge.pipeline.learn_layerwise_files`), written as the streamed alignment
writes its output (issue 42, item 6).

Neither model is ever in memory: the learned elements are found from the files (the closed-form start and the
layer-wise learned steps), then applied to A one layer at a time — the same operations per tensor as the
in-memory path's ``apply``, so the same bits — and handed to the shard writer (shards of about one layer), with
the tensors outside the layers copied through; the config and side files as the streamed alignment copies them.
The output is then verified: A's logits against the written folder's, both run layer by layer from the files, on
the first alignment batches (``--verify-tol``, default 1e-4). A checkpoint stored in half precision is verified as
the in-memory alignment verifies it, on float32: A's float32 upcast against A moved in float32 before its rounding
(the written folder's rounding moves the logits by that dtype's step, bfloat16's ~1e-2, past any exact
alignment's tolerance: it is reported as ``written_max_rel_diff``, with ``working_copies``). The report
(``symmerge_report.json``, built from the alignment's plan) and the model card are the other align paths'.

What the file-based path cannot do is refused in one line before anything is read (the dual frame, the residual
stream's group, ``generate:`` data, ``--no-verify``, pickle checkpoints, ``--pipeline``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import SymmergeError
from .align_plan import LEARNED_STREAM, OUTPUTS_CHECK  # noqa: F401  (this path's mode and output check)
from .learn_layerwise import LayerTensors


def learned_stream_refusal(options, folders=(), *, allow_pickle: bool = False, pipeline: bool = False,
                           verify_forward: bool = False) -> str | None:
    """Why ``align --stream --match learned`` of ``folders`` (the model and the anchor) cannot run with ``options``
    (None: it can)."""
    if allow_pickle:
        return "--stream reads safetensors only; convert pickle checkpoints first"
    if not all(Path(x).is_dir() for x in folders):
        return "--stream --match learned reads two model folders (config.json and safetensors), not single files"
    if options.dual:
        return ("--learn-frame dual moves the anchor too, and align writes one model: use symmerge merge or symmerge "
                "barrier, which use both moved models")
    if verify_forward:
        return ("--verify-forward loads both models to compare their outputs; --stream --match learned always compares "
                "them from the files, layer by layer, without loading either: leave out --verify-forward")
    refusal = files_refusal(options, "--stream")
    if refusal is None and pipeline:
        return "--pipeline applies to the data-free streamed alignment; --stream --match learned runs layer by layer"
    return refusal


def files_refusal(options, flag: str) -> str | None:
    """Why the learned alignment from the files (:func:`align_learned_streaming`) cannot run with the alignment
    ``options`` (None: it can), for ``align --stream`` and ``merge --mode stream`` alike (``flag`` names the mode)."""
    from ..io.generate import is_generate

    if not options.verify:
        return f"{flag} --match learned always verifies its output from the files; --no-verify does not apply"
    if options.align_data is None:
        return "--match learned needs unlabeled --align-data (a .txt, .jsonl or .npz file)"
    if isinstance(options.align_data, str) and is_generate(options.align_data):
        return (f"{flag} --match learned reads --align-data from a file; generate: samples from the models in "
                f"memory (leave out {flag}, or save the samples to a file first)")
    if options.untie or options.residual != "largest":
        return f"{flag} does not align the residual stream; --untie and --residual do not apply"
    return None


def merge_refusal(options) -> str | None:
    """Why ``merge --mode stream --match learned`` cannot align with the alignment ``options`` (None: it can): each
    model is aligned to the anchor by :func:`align_learned_streaming` (from the files, one model moved)."""
    if options.dual:
        return ("--learn-frame dual moves both models into a frame between them, in memory; the streamed learned "
                "alignment moves each model onto the anchor from the files")
    return files_refusal(options, "--mode stream")


def _write_layers(pair, elements, writer, distances, progress: bool) -> None:
    """A moved by ``elements``, one layer at a time (the tensors outside the layers first, copied), in its stored
    dtypes, into ``writer``; each tensor's distance to B before and after recorded."""
    from ..core.distance import sq_distance
    from ..progress import bar
    from .verify import out_of_range

    stored = list(pair.ckpt_a.keys())  # on disk (a tied head is not stored: its source is)
    moved = LayerTensors(pair.tensors_a, stored, pair.paths, pair.instances, elements, dtype=None, keep=1)
    groups = [g for g in ["", *pair.paths] if g in moved.groups]
    for g in bar(groups, desc="writing the aligned layers", unit="layers", enabled=progress):
        keys = moved.groups[g]
        writer.make_room(sum(pair.ckpt_a.nbytes(k) for k in keys))
        new, before, after = moved.group(g), pair.ckpt_a.read(keys), pair.tensors_b.read(keys)
        for k in keys:
            distances.add(k, sq_distance(before, after, [k]), sq_distance(new, after, [k]))
            if new[k].is_floating_point() and not bool(torch.isfinite(new[k]).all()):
                raise SymmergeError(out_of_range(k, new[k].dtype))  # past float16's range: never an Inf written
            for name, t in pair.ckpt_a.to_disk(k, new[k]):
                writer.add(name, t)
        moved.cache.clear()
        del new, before, after
    writer.flush()


def _checks(pair, elements, written, batches, tol) -> dict:
    """The verification fields of the written folder (``written``: its tensors read back) against A on ``batches``
    (``tol``: ``--verify-tol``, None for 1e-4); A stored in half precision: A moved in float32, before its rounding,
    against A's float32 upcast, as in memory, with the rounding's own difference reported (see the module text)."""
    from .learn_layerwise_files import _logit_difference, verified
    from .stream import _half, _stored
    from .verify import copies_entry

    tol = 1e-4 if tol is None else tol
    if not _half(pair.ckpt_a):
        return verified(pair, written, batches, tol)
    exact = LayerTensors(pair.tensors_a, list(pair.tensors_a), pair.paths, pair.instances, elements)
    checks = verified(pair, exact, batches, tol)
    _, rounding = _logit_difference(pair.skeleton, pair.paths, exact, written, batches)
    return {**checks, "written_max_rel_diff": rounding,
            "working_copies": copies_entry("float32", [_stored(c) for c in (pair.ckpt_a, pair.ckpt_b)])}


def align_learned_streaming(model, anchor, out, options, *, shard_size="1GB", progress: bool = True,
                            allow_tokenizer_mismatch: bool = False, plan=None, model_heads=()) -> dict:
    """Align the safetensors folder ``model`` to ``anchor`` with the learned matcher from the files, and write the
    result to the folder ``out`` atomically (see the module text). ``plan``: the alignment's
    :class:`~symmerge.pipeline.align_plan.AlignPlan` (made here from the headers when not given). ``model_heads``:
    tensors the anchor takes from the model (a streamed merge's anchor proxy, as in memory: models whose heads
    differ aligned by their bodies). Returns the report."""
    from ..io.checkpoint import LazyCheckpoint, ShardWriter, parse_size
    from ..io.card import write_card
    from ..io.model import atomic_dir, copy_side_files, ensure_output_dir, write_json, written_dtype
    from ..io.tokenizers import check_tokenizers
    from ..progress import stage, stage_printer
    from .align_plan import plan_align, plan_report
    from .data import load_align_data
    from .learn_layerwise_files import CheckpointPair, learn_pair
    from .report import Distances, alignment_report
    from .stream import MIN_LOW_MEMORY_SHARD, _bound_malloc
    from .verify import ELEMENT_CHECK

    refusal = learned_stream_refusal(options, (model, anchor))  # the command's own flags: align_to_folder's
    if refusal:
        raise SymmergeError(refusal)
    ensure_output_dir(Path(out))  # fail before any expensive work
    t0 = time.perf_counter()
    tokenizer = check_tokenizers([(str(model), model), (str(anchor), anchor)], allow_tokenizer_mismatch)
    _bound_malloc(1 << 20)  # freed layer tensors go back to the OS (glibc), not into a heap that only grows
    plan = plan if plan is not None else plan_align(model, anchor, options, stream=True)
    with stage("read the checkpoint headers", enabled=progress):
        pair = CheckpointPair(model, anchor, options, model_heads)
    data = load_align_data(pair.options, pair.skeleton, progress=progress)
    elements, learned = learn_pair(pair, data, stage_printer(desc="learned alignment") if progress else None)
    match_seconds = time.perf_counter() - t0
    groups = LayerTensors(pair.tensors_a, list(pair.ckpt_a.keys()), pair.paths).groups
    largest = max((sum(pair.ckpt_a.nbytes(k) for k in ks) for g, ks in groups.items() if g), default=0)
    distances = Distances()
    with atomic_dir(out) as tmp:
        writer = ShardWriter(tmp, min(parse_size(shard_size), max(largest, MIN_LOW_MEMORY_SHARD)))
        _write_layers(pair, elements, writer, distances, progress)
        names = writer.close()
        side_files = copy_side_files(Path(model), tmp)
        (tmp / "config.json").write_text(written_dtype((Path(model) / "config.json").read_text(),
                                                          set(pair.ckpt_a.dtype.values())))
        with stage("verified the written model's outputs (from the files)", enabled=progress):
            written = pair.plain(type(pair.tensors_a)(LazyCheckpoint(tmp, fused=True)))
            checks = _checks(pair, elements, written, list(data.batches)[:2], options.verify_tol)
        report = alignment_report(
            pair.spec, pair.ckpt_a.config["model_type"], pair.options, pair.instances, distances, model=str(model),
            anchor=str(anchor), streamed=True, mode=LEARNED_STREAM, match="learned",
            verify=ELEMENT_CHECK, shards=names, bytes_written=writer.total_bytes, largest_layer_bytes=largest,
            side_files=side_files, tokenizer=tokenizer, align_samples_used=data.n, align_data=data.path,
            match_seconds=match_seconds, **learned, **checks)
        report["seconds"] = time.perf_counter() - t0
        report = plan_report(plan, report)
        write_card(tmp, report)  # README.md, the output's own model card
        write_json(tmp / "symmerge_report.json", report)
    return report
