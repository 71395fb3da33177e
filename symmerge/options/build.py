"""The options objects of the parsed options: :class:`~symmerge.merge.fuse.MergeOptions`,
:class:`~symmerge.pipeline.options.AlignOptions`, :class:`~symmerge.pipeline.options.LearnSettings`. ``args``
is anything with the options as attributes — argparse's namespace from the command line, or the values a
config's keys make (:func:`symmerge.config.schema.values`): both are read the same way, once."""

from __future__ import annotations

from ..errors import SymmergeError
from ..pipeline.matchers import MATCHERS, matcher
from ..pipeline.options import AlignOptions, LearnSettings
from .declared import ALIGNMENT, LEARN_FLAGS, LEARN_SWITCHES, TABLE
from .parse import parse_anchor, parse_params, parse_weights


def _learn_values(args) -> dict:
    return {k: getattr(args, flag[2:].replace("-", "_")) for k, flag in LEARN_FLAGS.items()}


def _learn_switches(args) -> dict:
    """The ``--learn-*`` switches given (LearnSettings field → the option)."""
    return {k: o for k, o in LEARN_SWITCHES.items() if getattr(args, o.attr, None)}


def learn_settings(args) -> LearnSettings:
    """The :class:`LearnSettings` of the ``--learn-*`` options given (the rest: its defaults)."""
    values = {k: v for k, v in _learn_values(args).items() if v is not None}
    values.update({k: True for k in _learn_switches(args)})  # --learn-layerwise: LearnSettings.layerwise
    return LearnSettings(**values)


def align_options(args, symmetries, **extra) -> AlignOptions:
    """The :class:`AlignOptions` of the parsed options, for ``symmetries``."""
    needs_data = matcher(args.match).needs_data
    wanting = [flag for flag, name in (("--repair", "repair"), ("--temperature", "temperature")) if getattr(args, name,
                                                                                                        False)]
    if args.align_data is None and (needs_data or wanting):
        need = f"--match {args.match}" if needs_data else wanting[0]
        raise SymmergeError(f"{need} needs unlabeled data: pass --align-data FILE (labels, if present, are ignored), "
                            "or --align-data generate for causal LMs (sequences sampled from the models)")
    given = [LEARN_FLAGS[k] for k, v in _learn_values(args).items() if v is not None]
    given += [o.flag for o in _learn_switches(args).values()]
    if not matcher(args.match).learns and given:
        learning = ", ".join(n for n, m in MATCHERS.items() if m.learns)
        raise SymmergeError(f"{', '.join(given)}: the --learn-* flags apply to --match {learning} only")
    readers = [flag for flag, name in (("--repair", "repair"), ("--distill", "distill"),
                                       ("--temperature", "temperature"))
               if getattr(args, name, None)]
    if args.align_data is not None and not needs_data and not readers:
        data_matchers = "|".join(n for n, m in MATCHERS.items() if m.needs_data)
        raise SymmergeError(f"--align-data: nothing reads it with --match {args.match} (data-free); it is for --match "
                            f"{data_matchers} (or --repair, --distill, --temperature where the command has them): "
                            "add --match activations or learned, or leave --align-data out")
    n_models = len(getattr(args, "models", None) or ())
    star = next((flag for flag, name in (("--star", "star"), ("--anchor", "anchor"), ("--base", "base"))
                 if getattr(args, name, None) not in (None, False)), None)
    if getattr(args, "learn_frame", None) == "dual" and n_models > 2 and star:  # joint: every model moves (dual.py)
        raise SymmergeError(f"--learn-frame dual moves all {n_models} models into one shared frame, learned jointly; "
                            f"{star} aligns each model to one model's frame (leave out --learn-frame or {star})")
    if args.align_data is not None:
        from ..io.data import check_data_path
        from ..io.generate import is_generate, parse_generate

        if is_generate(args.align_data):
            parse_generate(args.align_data)  # fail before loading any model
        else:
            check_data_path(args.align_data, "--align-data")
    extra.setdefault("workers", args.workers)
    return AlignOptions(symmetries=symmetries, rescale=args.rescale, residual=args.residual, untie=args.untie,
                        max_sweeps=args.max_sweeps, restarts=args.restarts, solver_budget=args.solver_budget,
                        solver_seed=args.solver_seed, ends_weight=args.ends_weight,
                        depth_decay=args.depth_decay, match=args.match,
                        align_data=args.align_data, align_samples=args.align_samples, learn=learn_settings(args),
                        **extra)


FRAME_OPTIONS = ("anchor", "star", "joint_rounds", "joint_refine", "no_verify")  # merge's: read by the alignment only


def unread_alignment_flags(args, command: str, also=()) -> list[str]:
    """The alignment options of ``command`` given other than at their defaults (``--rescale``, ``--match``,
    ``--workers``, ...; with ``also``, more options by name): nothing reads them when nothing is aligned.
    ``--allow-tokenizer-mismatch`` is left out: a switch about the inputs, read by every merge."""
    given = []
    for option in TABLE.of(command):
        aligning = (option.part == ALIGNMENT and option.name != "allow_tokenizer_mismatch") or option.name in also
        if aligning and getattr(args, option.attr, option.default) != option.default:
            given.append(option.flag)
    return given


def merge_options(args):
    """The :class:`~symmerge.merge.fuse.MergeOptions` the Python API takes, from the parsed options.
    ``--align none`` with alignment options given is one error (they were accepted and dropped)."""
    if str(args.align).strip() == "none":
        unread = unread_alignment_flags(args, "merge", FRAME_OPTIONS)
        if getattr(args, "repair", False) or getattr(args, "distill", 0):  # they read --align-data, aligned or not
            unread = [flag for flag in unread if flag != "--align-data"]
        if unread:
            what = "an alignment option" if len(unread) == 1 else "alignment options"
            raise SymmergeError(f"{', '.join(unread)}: {what}, and --align none aligns nothing, so nothing would read "
                                f"{'it' if len(unread) == 1 else 'them'} (leave {'it' if len(unread) == 1 else 'them'} "
                                "out, or choose what to align with --align)")
    from ..merge.fuse import MergeOptions
    from ..merge.param_values import check_param_values
    from ..merge.repair import parse_channels
    return MergeOptions(
        method=args.method, align=align_options(args, args.align, verify=not args.no_verify), repair=args.repair,
        repair_channels=parse_channels(args.repair_channels), repair_samples=args.repair_samples,
        anchor=parse_anchor(args.anchor, args.models), data=list(args.data or []),
        eval_data=list(args.eval_data or []),
        weights=parse_weights(args.weights), params=check_param_values(args.method, parse_params(args.param)),
        base=args.base, heads=args.heads, head_from=args.head_from, device=args.device, fisher_variant=args.fisher,
        fisher_normalize=args.fisher_normalize, fisher_samples=args.fisher_samples, gram_normalize=not args.gram_sum,
        batch_size=args.batch_size, max_examples=args.max_examples, max_length=args.max_length,
        allow_pickle=args.allow_pickle, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
        joint=False if args.star else None, joint_rounds=args.joint_rounds, joint_refine=args.joint_refine,
        mode=args.mode, shard_size=args.shard_size, distill=args.distill, distill_lr=args.distill_lr)
