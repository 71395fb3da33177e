"""The defaults of the :class:`~symmerge.merge.fuse.MergeOptions` and :class:`~symmerge.merge.barrier.BarrierOptions`
fields that a command-line flag or config key also has: one value, read by those dataclasses and by
:mod:`symmerge.options.declared`, which thus declares the flags without importing the fusion and the barrier study
(and the alignment pipeline behind them) into every command's start-up."""

from __future__ import annotations

from ..pipeline.options import DEFAULT_REFINE

MERGE = {
    "heads": "auto",
    "head_from": 0,
    "fisher_variant": "empirical",
    "fisher_samples": 1,
    "batch_size": 32,
    "distill": 0,  # steps of distillation toward the inputs' ensemble after the merge (not function-preserving)
    "distill_lr": 1e-4,  # the distillation's learning rate (symmerge.pipeline.distill)
    "joint_rounds": 10,  # cap on the joint alignment's rounds after the star
    "joint_refine": DEFAULT_REFINE,  # what those rounds re-solve: every group, or the permutations only
    "mode": "auto",  # symmerge.merge(...): auto, memory or stream (symmerge.merge.plan.choose_mode)
    "shard_size": "2GB",  # the output's largest shard (both modes)
}
BARRIER = {"points": 11, "joint_rounds": 10}
