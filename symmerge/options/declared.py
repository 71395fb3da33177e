"""Every option of ``symmerge merge``, ``align`` and ``barrier`` (and the parts ``moe``, ``extract-lora`` and
``run`` share), declared once: name (= config key), flags, how its value is read, choices, range, default,
help, commands. Help shows them in this order. Defaults that the options objects also have are one value with
Python's: read from their dataclasses (:func:`default`: AlignOptions, LearnSettings) or from the values
MergeOptions' and BarrierOptions' fields take theirs from (:mod:`symmerge.merge.option_defaults`: :func:`M`,
:func:`B`), so that declaring the flags does not import the fusion and the barrier study."""

from __future__ import annotations

from dataclasses import MISSING, fields

from ..groups import RESCALE_MODES
from ..merge import option_defaults
from ..merge.heads import HEAD_POLICIES
from ..merge.registry import METHODS
from ..pipeline.options import (DEFAULT_REFINE, JOINT_REFINE, LEARN_FRAMES, LEARN_PRECISIONS, MATCH_MODES, RECOMMENDED,
                                RECOMMENDED_NAME, RESIDUAL_CHOICES, AlignOptions, LearnSettings, describe_symmetries)
from ..pipeline.options import LEARN_STARTS  # --learn-start
from ..pipeline.options import AUGMENT_STYLES  # --learn-augment-style
from ..progress import MODES as PROGRESS_MODES
from ..option_ranges import MAXIMA, MINIMA
from .parse import (channel_list, concentration, device_name, distill_lr, distill_steps, layer_list, lora_dtype,
                    mergekit_size_text, method_name, param_item, positive, size_text, symmetry_list, weight_list)
from .schema import Option, Table

MERGE, ALIGN, BARRIER, RUN = "merge", "align", "barrier", "run"
STUDIES = frozenset({MERGE, BARRIER})
ALIGNING = frozenset({MERGE, ALIGN, BARRIER, "moe"})  # the commands with the alignment flags (moe: with --align)
MODELS = frozenset({MERGE, ALIGN, BARRIER})
ALIGNMENT, REPAIR = "alignment", "repair"  # parts shared by several commands (Option.part)
MERGEKIT = "mergekit"  # run's flags of mergekit-yaml (a group of their own in its help: TITLES)
TITLES = {MERGEKIT: "mergekit-yaml's flags (as mergekit-yaml CONFIG OUT; docs/configs.md)"}


def default(cls, name: str):
    """The default of the field ``name`` of the dataclass ``cls``."""
    f = next(f for f in fields(cls) if f.name == name)
    return f.default if f.default is not MISSING else f.default_factory()


def M(name: str):
    """The default of a :class:`~symmerge.merge.fuse.MergeOptions` field (its field's value)."""
    return option_defaults.MERGE[name]


def B(name: str):
    """The default of a :class:`~symmerge.merge.barrier.BarrierOptions` field (its field's value)."""
    return option_defaults.BARRIER[name]


def opt(name, *flags, on, **kw) -> Option:
    return Option(name, flags, commands=frozenset({on} if isinstance(on, str) else on), **kw)


def noop(name, what) -> Option:
    """A switch of mergekit-yaml's that ``symmerge run`` accepts and that changes nothing (``what``: why)."""
    return opt(name, "--" + name.replace("_", "-"), on=RUN, part=MERGEKIT, form="onoff", default=False,
               help=f"no-op: {what}")


A, L = AlignOptions, LearnSettings
OPTIONS = (
    opt("models", on=MERGE, form="positional", nargs="+",
        help="HF model folders to merge (as many as the method takes: one is a merge too, as in a config)"),
    opt("models", on=BARRIER, form="positional", nargs="+", metavar="MODEL",
        help="HF model folders: A B (A aligned to B, the anchor, in the aligned variants), or three or more (aligned "
             "jointly into one frame)"),
    opt("model", on=ALIGN, form="positional", help="HF model folder to align (config.json + safetensors)"),
    opt("anchor", on=ALIGN, form="positional", help="HF model folder of the anchor (left unchanged)"),
    opt("data", "--data", on=BARRIER, required=True,
        help="evaluation data (held out): .npz (images), .jsonl (text, label) or .txt (LM)"),
    opt("output", "-o", "--output", on=MODELS, required=True, help="output folder (must not exist or be empty)"),
    opt("method", "--method", on=MERGE, parse=method_name, required=True,
        help=f"fusion method: {', '.join(sorted(METHODS))}"),
    opt("align", "--align", on=MERGE, parse=symmetry_list, default=RECOMMENDED_NAME, joins=True,
        help="symmetries to align before merging: " + describe_symmetries(
            f"{RECOMMENDED_NAME} (= {','.join(RECOMMENDED)} where the model has them; residual is also left out when "
            "the task heads differ)")),
    opt("align", "--align", on=BARRIER, form="append", parse=symmetry_list, joins=True,
        help="alignment variant(s) compared with no alignment (repeatable): " + describe_symmetries(
            f"{RECOMMENDED_NAME} (= {','.join(RECOMMENDED)} where the model has them)")),
    # align's own
    opt("symmetries", "--symmetries", on=ALIGN, parse=symmetry_list, default=RECOMMENDED_NAME, joins=True,
        help=describe_symmetries(f"{RECOMMENDED_NAME} (= {','.join(RECOMMENDED)} where the model has them; as for "
                                 f"merge and barrier). With --stream, {RECOMMENDED_NAME} leaves residual out (it "
                                 "cannot stream)")),
    opt("layers", "--layers", on=ALIGN, parse=layer_list, joins=True,
        help="only align these layers, e.g. '0,1,5' (default: all)"),
    opt("no_verify", "--no-verify", on=ALIGN, form="switch", default=False,
        help="skip the equivalence check (not recommended)"),
    opt("verify_tol", "--verify-tol", on=ALIGN, parse=float, minimum=0,
        help="max relative output difference accepted (default: 1e-6 fp64, 1e-4 fp32 and half models, verified "
             "on float32 copies in memory and with --stream --verify-forward)"),
    opt("stream", "--stream", on=ALIGN, form="switch", default=False,
        help="layer by layer from safetensors shards, never holding a whole model in memory (attn, ffn, rescale; "
             "not residual): --match weights, or --match learned learned from the files one layer at a time "
             "(docs/results/learned_scale.md)"),
    # None: not given (1GB with --stream; refused without it)
    opt("shard_size", "--shard-size", on=ALIGN, parse=size_text,
        help="with --stream: largest output shard (default 1GB; without --pipeline shards are also cut at about one "
             "layer, to bound memory)"),
    opt("pipeline", "--pipeline", on=ALIGN, form="switch", default=False,
        help="with --stream: overlap reads, matching and writes across layers (faster when I/O is slow; holds a few "
             "layers in memory instead of one part of one)"),
    opt("device", "--device", on=ALIGN, parse=device_name, default="cpu",
        help="where the FFN cost GEMMs run: cpu (default), cuda, cuda:N or auto"),
    opt("verify_forward", "--verify-forward", on=ALIGN, form="switch", default=False,
        help="with --stream: also load both models at the end and compare outputs (needs the RAM)"),
    opt("allow_pickle", "--allow-pickle", on=ALIGN, form="switch", default=False,
        help="accept pytorch_model.bin checkpoints (loaded with torch.load(weights_only=True))"),
    # merge's and barrier's
    opt("anchor", "--anchor", on=MERGE,
        help="anchor: index of a model (0-based: 0..N-1) or a folder (default: base model for task-vector methods; "
             "the second of two models; else the model closest to the average). With more than two models and no "
             "anchor, every model is aligned jointly into one frame (each to the mean of the others, from the star "
             "on the model closest to the average; with --match learned, then random convex combinations of the "
             "models learned against the same combinations of their predictions); an anchor keeps the star: every "
             "model aligned to it"),
    opt("star", "--star", on=MERGE, form="switch", default=False,
        help="with more than two models: align every model to one anchor (the default rule's, or --anchor) instead "
             "of jointly into one frame"),
    opt("points", "--points", on=BARRIER, parse=int, minimum=2, default=B("points"),
        help="number of α values in [0, 1] (default 11)"),
    opt("joint_rounds", "--joint-rounds", on=MERGE, parse=int, minimum=MINIMA["joint_rounds"],
        default=M("joint_rounds"), metavar="N",
        help="joint alignment (more than two models, no --anchor): at most N rounds of 'each model to the mean of "
             "the others' after the star (default 10; it stops when a round lowers the spread by less than 1e-3 "
             "data-free, where a round is one sweep per model, 1e-4 with activations)"),
    opt("joint_rounds", "--joint-rounds", on=BARRIER, parse=int, minimum=MINIMA["joint_rounds"],
        default=B("joint_rounds"), metavar="N",
        help="more than two models: rounds of the joint alignment after the star (default 10)"),
    opt("joint_refine", "--joint-refine", on=MERGE, choices=JOINT_REFINE, default=M("joint_refine"),
        help="what the joint alignment's rounds re-solve: 'all' the groups (MergeMany; for the continuous groups "
             "generalized Procrustes) or 'discrete' only the head and unit permutations, keeping the star's rotations "
             f"and scales (default {DEFAULT_REFINE})"),
    opt("joint_refine", "--joint-refine", on=BARRIER, choices=JOINT_REFINE, default=DEFAULT_REFINE,
        help="more than two models: what the joint alignment's rounds re-solve, 'all' the groups or 'discrete' the "
             f"permutations only (default {DEFAULT_REFINE})"),
    opt("subsets", "--subsets", on=BARRIER, choices=("single", "last"),
        help="also match only layer i (single) or only the last k layers (last); loss at α = 0.5"),
    opt("temperature", "--temperature", on=BARRIER, form="switch", default=False,
        help="each variant also gets a '+temperature' curve: at every α the merged model's softmax temperature "
             "fitted on the unlabeled --align-data against the endpoints' mixed predictions (the calibration baseline "
             "of Ito et al.; labels never used)"),
    opt("base", "--base", on=MERGE, help="base (pre-trained) model folder for task_arithmetic, ties, dare"),
    opt("data", "--data", on=MERGE, form="append", metavar="FILE",
        help="data (.npz, .jsonl, .txt) for the statistics of the methods that read data (fisher, regmean, ot_acts, "
             "ot_acts_emd; training data); give it once for "
             "all models or once per model (in model order)"),
    opt("eval_data", "--eval-data", on=MERGE, form="append", metavar="FILE",
        help="held-out data (.npz, .jsonl, .txt) the merged model and the inputs are scored on; once for all models "
             "or once per model (file i scored with model i's head). Without it the evaluation uses --data, and the "
             "report and stderr say so"),
    opt("weights", "--weights", on=MERGE, parse=weight_list, help="comma-separated model weights, e.g. 0.7,0.3"),
    opt("param", "--param", on=MERGE, form="append", parse=param_item, default=[], metavar="KEY=VALUE",
        help="method parameter, e.g. alpha=0.9 (regmean), scale=0.5, density=0.2, drop=0.9, seed=1; a per-model "
             "one takes a value per model: density=0.7,0.4"),
    opt("heads", "--heads", on=MERGE, choices=HEAD_POLICIES, default=M("heads"),
        help="heads outside the base model: auto (default: a language model's head, whose rows are the vocabulary, "
             "is merged like the embeddings; a task head is kept), keep one model's (--head-from), or merge them "
             "(same label space only)"),
    opt("head_from", "--head-from", on=MERGE, parse=int, default=M("head_from"),
        help="index of the model whose head is kept (0-based: 0..N-1; default 0)"),
    opt("fisher", "--fisher", on=MERGE, choices=("empirical", "sampled"), default=M("fisher_variant"),
        help="Fisher variant: true labels (empirical) or labels sampled from the model"),
    opt("fisher_samples", "--fisher-samples", on=MERGE, parse=int, minimum=1, default=M("fisher_samples"),
        help="label samples per example (sampled Fisher)"),
    opt("fisher_normalize", "--fisher-normalize", on=MERGE, form="switch", default=False,
        help="scale each model's Fisher to mean 1"),
    opt("gram_sum", "--gram-sum", on=MERGE, form="switch", default=False,
        help="RegMean with summed Grams (weights models by data size) instead of per-token means"),
    opt("batch_size", "--batch-size", on=STUDIES, parse=int, minimum=1, default=M("batch_size"),
        help="examples per batch when data is read (statistics, evaluation, alignment on data)"),
    opt("max_examples", "--max-examples", on=MERGE, parse=int, minimum=1,
        help="use at most this many examples per file"),
    opt("max_examples", "--max-examples", on=BARRIER, parse=int, minimum=1,
        help="use at most this many examples of --data"),
    opt("max_length", "--max-length", on=MERGE, parse=int, minimum=1, help="truncate texts to this many tokens"),
    opt("device", "--device", on=STUDIES, parse=device_name, default="cpu", help="cpu (default), cuda, cuda:N or auto"),
    opt("no_verify", "--no-verify", on=STUDIES, form="switch", default=False,
        help="skip the equivalence check of each alignment"),
    opt("allow_pickle", "--allow-pickle", on=STUDIES, form="switch", default=False,
        help="accept pytorch_model.bin checkpoints"),
    # run's own (a config's flags: none of them is a config key)
    opt("config", on=RUN, form="positional",
        help="YAML file: a mergekit config (models or slices, merge_method, parameters, base_model, dtype, "
             "tokenizer_source: union, ...; several documents for mergekit-multi; with align: and the merge "
             "command's alignment options, aligned first), or one with symmerge's options by their long names (see "
             "docs/merge.md, Merge configs)"),
    opt("out", on=RUN, form="positional", nargs="?", help="output folder (as mergekit-yaml CONFIG OUT)"),
    opt("output", "-o", "--output", on=RUN, help="output folder (the same as OUT)"),
    opt("align", "--align", on=RUN, parse=symmetry_list, metavar="recommended|LIST",
        help="align every model into one frame first, then run the config on the aligned models (gradients, "
             "filters, slices and all; the frame as symmerge merge chooses it: the base model's, else the second of "
             "two, else joint); a mergekit config is merged without alignment unless asked (here or with 'align:' in "
             "the config)"),
    opt("print_command", "--print-command", on=RUN, form="switch", default=False,
        help="print what the config runs (the symmerge command line, or the merge plan) and exit"),
    opt("progress", "--progress", on=RUN, choices=PROGRESS_MODES, default="auto",
        help="progress on stderr, unless the config sets its own 'progress'"),
    opt("trust_remote_code", "--trust-remote-code", on=MODELS | {"run", "moe"}, form="onoff", default=False,
        help="let transformers import Python code shipped in a model or tokenizer folder (auto_map in config.json): "
             "only for folders you trust. Without it a folder that needs its code (a model type transformers does not "
             "know) is refused, and one transformers knows is read with transformers' own class; symmerge never runs "
             "a folder's code otherwise (its .py files are copied to the output, not imported; see SECURITY.md)"),
    opt("mode", "--mode", on=MERGE, choices=("auto", "stream", "memory"), default=M("mode"),
        help="stream: merge tensor by tensor from the safetensors files (memory ~ the largest tensors, any model "
             "size; per-tensor methods without alignment); memory: load the models; auto (default): stream whatever "
             "can stream, else load"),
    opt("shard_size", "--shard-size", on=MERGE, parse=size_text, default=M("shard_size"),
        help="the output's largest shard, streamed or written from memory (default 2GB; a tensor larger than it is "
             "a shard of its own)"),
    opt("print_plan", "--print-plan", on=MERGE, form="switch", default=False,
        help="print the resolved plan and its steps (one per output tensor: copy, or merge with which inputs and "
             "parameters) as JSON, then exit without reading weights or writing"),
    opt("distill", "--distill", on=MERGE, parse=distill_steps, default=M("distill"), metavar="STEPS",
        help="after the merge (and --repair), STEPS optimiser steps of KL distillation of the merged model toward "
             "the ensemble of the aligned inputs (the average of their probabilities) on the unlabeled --align-data; "
             "every parameter moves, so the result is no longer function-preserving alignment and the report labels "
             "it 'distilled (not function-preserving)' (default 0: none)"),
    opt("distill_lr", "--distill-lr", on=MERGE, parse=distill_lr, default=M("distill_lr"), metavar="LR",
        help="the distillation's learning rate (Adam, cosine decay to 0; default 1e-4)"),
    opt("print_plan", "--print-plan", on=ALIGN, form="switch", default=False,
        help="print the resolved plan (symmetries, matcher, anchor, verification) and its steps (one per output "
             "tensor: copy, or the alignment maps acting on it and their axes) as JSON, from the headers, and exit; "
             "nothing is written"),
    opt("print_plan", "--print-plan", on=BARRIER, form="switch", default=False,
        help="print the resolved plan (the models, each alignment variant with its symmetries and steps, the "
             "interpolation points, the curves, the evaluation data) as JSON, from the headers, and exit; nothing "
             "is written"),
    opt("print_plan", "--print-plan", on=RUN, form="switch", default=False,
        help="print the plan of each document of the config as JSON (the merge: method, inputs, parameters and "
             "every output tensor's step; the alignment of an aligned config; a config of symmerge's keys: its "
             "command's --print-plan) and exit; no weight is read, nothing is written"),
    # a model given as BASE+ADAPTER: a LoRA adapter merged into its base first (symmerge.io.lora.merge_cache)
    opt("lora_merge_cache", "--lora-merge-cache", on={MERGE, "run", "extract-lora"}, metavar="DIR", part="lora",
        help="merge models given as BASE+ADAPTER (a PEFT LoRA adapter) into DIR and reuse them on a later run (as "
             "mergekit; default: a temporary folder removed at exit)"),
    opt("lora_merge_dtype", "--lora-merge-dtype", on={MERGE, "run", "extract-lora"}, parse=lora_dtype, metavar="DTYPE",
        part="lora",
        help="dtype of the models merged from BASE+ADAPTER inputs (default: the base's)"),
    # every flag of mergekit-yaml 0.1.5, with its effect in symmerge run or as a documented no-op (docs/configs.md)
    opt("copy_tokenizer", "--copy-tokenizer", on=RUN, part=MERGEKIT, form="onoff", default=True,
        help="copy the tokenizer of the config's tokenizer source (or base) to the output (default on; off: none is "
             "copied, a tokenizer the config builds is still written, as mergekit)"),
    opt("write_model_card", "--write-model-card", on=RUN, part=MERGEKIT, form="onoff", default=True,
        help="write README.md (the model card) and mergekit_config.yml (the config; symmerge_config.yml for a config "
             "of symmerge's keys) beside the model (default on, "
             "as mergekit); symmerge_report.json is always written"),
    opt("out_shard_size", "--out-shard-size", on=RUN, part=MERGEKIT, parse=mergekit_size_text, metavar="SIZE",
        help="largest output shard in bytes, as mergekit: a number with K/M/B suffixes (thousand, million, billion: 5B "
             "is 5e9 bytes) or 2GB"),
    opt("random_seed", "--random-seed", on=RUN, part=MERGEKIT, parse=int, metavar="N",
        help="seed of the randomised methods (DARE, DELLA): their 'seed' parameter"),
    opt("cuda", "--cuda", on=RUN, part=MERGEKIT, form="onoff", default=False,
        help="merge on the GPU when there is one (tensors read and written on the CPU; without a GPU, a warning and "
             "the CPU)"),
    opt("device", "--device", on=RUN, part=MERGEKIT, parse=device_name, metavar="DEVICE",
        help="device the merge arithmetic runs on (cpu, cuda, cuda:N)"),
    opt("gpu_rich", "--gpu-rich", on=RUN, part=MERGEKIT, form="switch", default=False,
        help="as mergekit: --cuda (and its no-ops below)"),
    opt("num_threads", "-j", "--num-threads", on=RUN, part=MERGEKIT, parse=int, minimum=1, metavar="N",
        help="torch threads for the merge arithmetic (default: torch's)"),
    opt("quiet", "-q", "--quiet", on=RUN, part=MERGEKIT, form="onoff", default=False,
        help="no progress on stderr (--progress none)"),
    opt("verbose", "-v", on=RUN, part=MERGEKIT, form="count", default=0,
        help="progress as one line per stage (--progress lines); repeat for no more"),
    noop("lazy_unpickle", "tensors are always read lazily (safetensors)"),
    noop("low_cpu_memory", "results are written as they come, tensor by tensor"),
    noop("read_to_gpu", "with --cuda each tensor is moved to the GPU after it is read"),
    noop("multi_gpu", "one device"),
    noop("async_write", "symmerge always writes on a thread of its own, behind the merge"),
    opt("write_threads", "--write-threads", on=RUN, part=MERGEKIT, parse=int, metavar="N",
        help="no-op: one writer thread"),
    noop("clone_tensors", "every output tensor is written on its own (a layer used twice included)"),
    opt("safe_serialization", "--safe-serialization", on=RUN, part=MERGEKIT, form="onoff", default=True,
        help="safetensors (always; --no-safe-serialization is ignored with a warning)"),
    noop("allow_crimes", "symmerge checks every tensor's name and shape, not the architectures' names"),
    opt("unsafe_truncate_embeddings", "--unsafe-truncate-embeddings", on=RUN, part=MERGEKIT, form="onoff",
        default=False, help="cut every model's vocabulary rows to the smallest model's (same token ids assumed)"),
    opt("transformers_cache", "--transformers-cache", on=RUN, part=MERGEKIT, metavar="DIR",
        help="no-op: models are local folders (nothing is downloaded)"),
    # the alignment flags (AlignOptions, LearnSettings)
    opt("rescale", "--rescale", on=ALIGNING, part=ALIGNMENT, choices=tuple(RESCALE_MODES),
        default=default(A, "rescale"),
        help="how per-head scales are solved when 'rescale' is aligned: joint optimum (default), the paper's "
             "sequential, or none"),
    opt("residual", "--residual", on=ALIGNING, part=ALIGNMENT, choices=RESIDUAL_CHOICES, default=default(A, "residual"),
        help="with the residual symmetry: largest (default: the largest function-preserving group of the family's "
             "stream — O(d-1) for pre-LN LayerNorm with the norms folded, O(d) for RMSNorm, permutations for "
             "post-LN) "
             "or permutation (the norms kept as they are: permutations of the stream for LayerNorm, signed "
             "permutations for RMSNorm)"),
    opt("untie", "--untie", on=ALIGNING, part=ALIGNMENT, form="switch", default=False,
        help="untie a tied LM head so the final norm can fold into it and the stream gets its largest group (the "
             "output then stores the head separately)"),
    opt("max_sweeps", "--max-sweeps", on=ALIGNING, part=ALIGNMENT, parse=int, minimum=MINIMA["max_sweeps"],
        default=default(A, "max_sweeps"),
        help="cap on the coordinate-descent sweeps over the coupled groups (default 200; it stops earlier when a "
             "sweep lowers the objective by less than 1e-4 of it, and warns at the cap)"),
    opt("restarts", "--restarts", on=ALIGNING, part=ALIGNMENT, parse=int, minimum=0, metavar="N",
        help="data-free solver: after its plain starts (the usual one, the identity, both models in a canonical "
             "frame), N restarts from the best so far (its stream kicked, two heads or two blocks of FFN units "
             "swapped, a random stream), each followed by the whole descent (e.g. 5: seconds on a small ViT, minutes "
             "on a large model; 0: the plain starts only). The lowest objective is kept; the report's solver entry "
             "lists every start. Default: no search, the one descent (on B1 and three held-out pairs the search "
             "lowered the weight objective but not the barrier: docs/results.md)"),
    opt("solver_budget", "--solver-budget", on=ALIGNING, part=ALIGNMENT, parse=float, minimum=MINIMA["solver_budget"],
        metavar="SECONDS",
        help="data-free solver: begin no restart after this many seconds (default: no limit; the result then "
             "depends on the machine's speed); 0: the first descent alone"),
    opt("solver_seed", "--solver-seed", on=ALIGNING, part=ALIGNMENT, parse=int, default=default(A, "solver_seed"),
        help="data-free solver: the restarts' seed (default 0)"),
    opt("ends_weight", "--ends-weight", on=ALIGNING, part=ALIGNMENT, parse=positive, metavar="W",
        default=default(A, "ends_weight"),
        help="data-free solver: count the residual stream's ends (embeddings, task heads, norms, the writers' "
             "biases: the tensors no per-layer group moves) W times in the weight distance it minimises (default 1; "
             "10 lowered B1's barrier 0.53 -> 0.44 and three held-out ViT pairs' mean 0.345 -> 0.315, though not "
             "every pair: docs/results/datafree_frontier.md)"),
    opt("depth_decay", "--depth-decay", on=ALIGNING, part=ALIGNMENT, parse=positive, metavar="F",
        default=default(A, "depth_decay"),
        help="data-free solver: weigh the layers' tensors less with depth in the weight distance it minimises, "
             "geometrically from the first layer (once) to the last (1/F) (default 1: every layer once; 10 lowered "
             "B1's barrier 0.53 -> 0.37 and three other ViT pairs' mean 0.345 -> 0.329, each pair lower or equal: "
             "docs/results/datafree_frontier.md)"),
    opt("match", "--match", on=ALIGNING, part=ALIGNMENT, choices=MATCH_MODES, default=default(A, "match"),
        help="what the group elements are fitted to: weights (data-free, default), activations (statistics of both "
             "models on --align-data) or learned (from the closed form, the continuous elements optimised so the "
             "interpolated model matches the interpolated predictions on --align-data; no labels)"),
    opt("align_data", "--align-data", on=ALIGNING, part=ALIGNMENT, metavar="FILE|generate[:N[:LEN[:SEED]]]",
        help="unlabeled data for --match activations|learned and --repair: the formats of --data (.npz images, "
             ".jsonl text, .txt LM lines; labels, if present, are ignored), or, for causal LMs without a corpus, "
             "generate[:N[:LEN[:SEED]]]: N sequences of LEN tokens sampled from the models themselves at "
             "temperature 1 (shared out over the models: half from each of two; default generate:256:16:0; for "
             "merge and barrier the measured recipe adds --repair --repair-channels ffn,norm,qk --repair-samples "
             "64)"),
    opt("align_samples", "--align-samples", on=ALIGNING, part=ALIGNMENT, parse=int, minimum=MINIMA["align_samples"],
        default=default(A, "align_samples"), help="use at most this many examples of --align-data (default 1000)"),
    opt("learn_steps", "--learn-steps", on=ALIGNING, part=ALIGNMENT, parse=int, minimum=MINIMA["learn_steps"],
        maximum=MAXIMA["learn_steps"],
        learn="steps",
        help=f"--match learned: optimiser steps (default {L.steps} of {L.batch} examples; the start is kept if the "
             "end is not better)"),
    opt("learn_budget", "--learn-budget", on=ALIGNING, part=ALIGNMENT, parse=float, minimum=0, metavar="SECONDS",
        learn="budget",
        help="--match learned: begin no step after this many seconds of learning — the endpoints' predictions, the "
             "checks and the steps; the closed-form start is not counted (default: no limit)"),
    opt("learn_seed", "--learn-seed", on=ALIGNING, part=ALIGNMENT, parse=int, learn="seed",
        help="--match learned: seed (default 0)"),
    opt("learn_batch", "--learn-batch", on=ALIGNING, part=ALIGNMENT, parse=int, minimum=MINIMA["learn_batch"],
        learn="batch",
        help=f"--match learned: examples per step (default {L.batch})"),
    opt("learn_positions", "--learn-positions", on=ALIGNING, part=ALIGNMENT, parse=int,
        minimum=MINIMA["learn_positions"], learn="positions",
        help="--match learned, text: the objective on this many random next-token positions of each batch, the "
             f"endpoints' predictions cached there only (default {L.positions}: every position)"),
    opt("learn_max_length", "--learn-max-length", on=ALIGNING, part=ALIGNMENT, parse=int,
        minimum=MINIMA["learn_max_length"], metavar="TOKENS",
        learn="max_length",
        help="--match learned, text: the alignment texts truncated to this many tokens (default: 512, or the "
             "model's context where shorter)"),
    opt("learn_precision", "--learn-precision", on=ALIGNING, part=ALIGNMENT, choices=LEARN_PRECISIONS,
        learn="precision",
        help="--match learned: the training steps and the endpoints' predictions in float32 (default) or under "
             "bfloat16 autocast (faster on CPUs with bf16 instructions; the checks stay float32, the elements are "
             "applied and verified in float64)"),
    opt("learn_frame", "--learn-frame", on=ALIGNING, part=ALIGNMENT, choices=LEARN_FRAMES, learn="frame",
        help="--match learned: one-sided (default: A moved onto B, or every model onto the frame model) or dual "
             "(every model moved into a frame between them, each folded LayerNorm split back into a per-coordinate "
             "scale and shift of its own; each verified against its original; not with --star/--anchor/--base; "
             "docs/results/dual_learned.md, docs/results/quality_learned.md)"),
    opt("learn_layerwise", "--learn-layerwise", on=ALIGNING, part=ALIGNMENT, form="const", learn="layerwise",
        help="--match learned: build and differentiate the interpolated model one layer at a time (gradient "
             "checkpointing per layer): the same objective and gradient in memory bounded by a few layers (LLM-size "
             "pairs; docs/results/learned_scale.md)"),
    opt("learn_start", "--learn-start", on=ALIGNING, part=ALIGNMENT, choices=LEARN_STARTS, learn="start",
        help=f"--match learned: the closed form learning starts from (default {L.start}: activation matching on "
             "--align-data; weights: data-free weight matching, no activation statistics: LLM-size pairs with "
             "--stream, docs/results/learned_scale.md)"),
    opt("learn_check_batches", "--learn-check-batches", on=ALIGNING, part=ALIGNMENT, parse=int,
        minimum=MINIMA["learn_check_batches"],
        metavar="N", learn="check_batches",
        help="--match learned: the objective checks (start/end, or held-out) on at most N batches (default "
             f"{L.check_batches}: all)"),
    opt("learn_dirichlet", "--learn-dirichlet", on=ALIGNING, part=ALIGNMENT, parse=concentration,
        metavar="C|auto|uniform", learn="dirichlet",
        help="--match learned with more than two models (joint): the mixture weights drawn from Dirichlet(C, ..., C) "
             "(1: uniform on the simplex; larger C: mixtures nearer the plain average); uniform (or inf): every step "
             "at the plain average, each model weighted 1/N (the merge's own weights); auto (the default): C chosen "
             f"from {', '.join(f'{c:g}' for c in L.dirichlet_grid)} on a held-out {L.dirichlet_holdout * 100:g}%% "
             "of --align-data by the objective at the uniform mixture (the report's learned.dirichlet_choice)"),
    opt("workers", "--workers", on=ALIGNING, part=ALIGNMENT, parse=int, minimum=1,
        help="FFN layers (cost GEMM + exact assignment) solved at once on a thread pool, beside the head groups "
             "(default: one per core; 1: one thing after another on one thread; the result is the same). align "
             "--stream: only with --pipeline (default 2 there), the low-memory mode solves one part of one layer at "
             "a time"),
    opt("allow_tokenizer_mismatch", "--allow-tokenizer-mismatch", on=ALIGNING, part=ALIGNMENT, form="switch",
        default=False,
        help="go on when the models' tokenizers differ (vocabulary, special or added tokens); by default that is an "
             "error naming the first differing tokens. The report's tokenizer entry records the differences"),
    opt("repair", "--repair", on=STUDIES, part=REPAIR, form="switch", default=False,
        help="REPAIR: reset the per-channel means and standard deviations of the merged model (FFN pre-activations, "
             "norm outputs) to the interpolation of the endpoints', on --align-data, folded into weights and biases "
             "(architecture unchanged)"),
    opt("repair_channels", "--repair-channels", on=STUDIES, part=REPAIR, parse=channel_list, default="ffn,norm",
        metavar="LIST",
        joins=True,
        help="the channels --repair corrects, comma-separated: ffn (FFN pre-activations), norm (norm outputs), "
             "attn_out, mlp_out (the stream writers), qk (per head, the RMS of queries and keys: the attention "
             "logits' scale); default ffn,norm"),
    opt("repair_samples", "--repair-samples", on=STUDIES, part=REPAIR, parse=int, minimum=1, metavar="N",
        help="REPAIR's statistics on the first N examples of --align-data (default: all)"),
    opt("progress", "--progress", on=MODELS | {"moe", "extract-lora", "demo"}, part="progress",
        choices=PROGRESS_MODES, default="auto",
        help="how progress is shown on stderr: auto (default: bars on a terminal, plain lines otherwise, e.g. in a "
             "log or a pipe), bar, lines (one line per stage with counts and seconds) or none"),
    opt("quiet", "-q", "--quiet", on=MODELS | {"demo"}, part="quiet", form="switch",
        default=False, help="no progress on stderr (as --progress none; every command takes it)"),
    # appended (issue 42 item 3): the learned alignment's α range
    opt("learn_alpha_low", "--learn-alpha-low", on=ALIGNING, part=ALIGNMENT, parse=float, minimum=0, metavar="LO",
        learn="alpha_low",
        help=f"--match learned: each step's mixing weight α is drawn from U(LO, HI) (default {L.alpha_low:g}; "
             "0 <= LO <= HI <= 1; LO = HI: every step at that α). Nearer ½ trains the midpoint harder "
             "(docs/results/quality_learned.md)"),
    opt("learn_alpha_high", "--learn-alpha-high", on=ALIGNING, part=ALIGNMENT, parse=float, minimum=0, metavar="HI",
        learn="alpha_high", help=f"--match learned: the upper end HI of α's range (default {L.alpha_high:g})"),
    # appended (issue 42 item 3, N = 4): the augmented views of the unlabeled images
    opt("learn_augment", "--learn-augment", on=ALIGNING, part=ALIGNMENT, parse=int, minimum=MINIMA["learn_augment"],
        maximum=MAXIMA["learn_augment"],
        metavar="VIEWS", learn="augment",
        help=f"--match learned, images: randomly transformed views of every unlabeled image added to it (default "
             f"{L.augment}; 0: the images alone), the models' predictions on each view its target"),
    opt("learn_augment_style", "--learn-augment-style", on=ALIGNING, part=ALIGNMENT, choices=AUGMENT_STYLES,
        learn="augment_style",
        help=f"--match learned, images: how the views differ from their image: {AUGMENT_STYLES[0]} (default: a flip, "
             "a shift of up to 2 pixels), strong (a shift of up to 4 pixels and a cut-out square) or mixup "
             "(flip-shift, then mixed with another image, weight U(1/2, 1) for its own; "
             "docs/results/quality_learned.md)"),
    # appended (issue 42 item 3, B7): the learned steps' learning rate (the B7 recipe's lr 2e-2 on the CLI)
    opt("learn_lr", "--learn-lr", on=ALIGNING, part=ALIGNMENT, parse=float, metavar="LR", learn="lr",
        help=f"--match learned: Adam's learning rate, decayed to 0 along a cosine (default {L.lr:g}; > 0; "
             "docs/results/b7_llama.md)"),
)

# moe's, extract-lora's and demo's (as mergekit-moe and mergekit-extract-lora spell theirs); each command adds its
# parts in its own order (commands/moe.py, extract_lora.py, demo.py)
MOE, EXTRACT, DEMO = "moe", "extract-lora", "demo"
MOE_MERGEKIT, EXTRACT_NOOPS = "moe-mergekit", "extract-lora-noops"  # their groups of mergekit's other flags
TITLES.update({MOE_MERGEKIT: "mergekit-moe's other flags (accepted)",
               EXTRACT_NOOPS: "mergekit-extract-lora's flags accepted with no effect"})
MOE_NO_OPS = {  # mergekit-moe's flags that change nothing here, and why (--help)
    "--load-in-4bit": "accepted: the hidden-state pass runs the base model in bfloat16 (as mergekit without it)",
    "--load-in-8bit": "accepted: as --load-in-4bit",
    "--i-understand-this-is-not-useful-without-training": "accepted: no effect (mergekit's acknowledgement)",
    "--lazy-unpickle": "accepted: tensors are always read lazily (safetensors)",
    "--low-cpu-memory": "accepted: one tensor at a time is always held",
    "--read-to-gpu": "accepted: tensors are copied on the CPU",
    "--multi-gpu": "accepted: one device at most",
    "--async-write": "accepted: shards are written as the tensors come",
    "--clone-tensors": "accepted: every tensor is written once",
    "--safe-serialization": "accepted: the output is always safetensors",
    "--unsafe-truncate-embeddings": "accepted: the embeddings are the base model's (nothing to truncate)",
    "--write-model-card": "the default: README.md (the model card), symmerge_report.json and "
                          "mergekit_moe_config.yml are written",
    "--no-write-model-card": "no README.md (symmerge_report.json and mergekit_moe_config.yml are still written)",
    "--quiet": "no progress lines (--progress none)",
    "--copy-tokenizer": "accepted: the default",
    "--cuda": "the hidden-state pass on the GPU when there is one (without a GPU, a warning and the CPU)",
    "--gpu-rich": "as --cuda",
}
MOE_VALUE_NO_OPS = {
    "--transformers-cache": "accepted: models are read from local folders only",
    "--lora-merge-cache": "accepted: no LoRA inputs here",
    "--lora-merge-dtype": "accepted: no LoRA inputs here",
    "--write-threads": "accepted: one writer",
}
MOE_HIDDEN = ("--no-cuda", "--no-lazy-unpickle", "--no-low-cpu-memory", "--no-read-to-gpu", "--no-multi-gpu",
              "--no-async-write", "--no-clone-tensors", "--no-safe-serialization", "--no-quiet", "--no-allow-crimes",
              "--no-unsafe-truncate-embeddings")
EXTRACT_NO_OPS = {  # mergekit-extract-lora's flags that change nothing here, and why (accepted so that its scripts run)
    "--transformers-cache": ("models are read from local folders only", "DIR"),
    "--trust-remote-code": ("models are built from transformers' own classes", None),
    "--lazy-unpickle": ("tensors are always read lazily (safetensors)", None),
    "--low-cpu-memory": ("tensors are read a pair at a time", None),
    "--read-to-gpu": ("tensors go to --device for their SVD", None),
    "--multi-gpu": ("one device", None),
    "--async-write": ("the adapter is one file, written at the end", None),
    "--write-threads": ("the adapter is one file, written at the end", "N"),
    "--out-shard-size": ("a PEFT adapter is one file", "SIZE"),
    "--copy-tokenizer": ("an adapter holds no tokenizer", None),
    "--clone-tensors": ("tensors are never shared", None),
    "--safe-serialization": ("always safetensors (--no-safe-serialization is refused)", None),
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


OPTIONS += (
    opt("config", on=MOE, part=MOE, form="positional",
        help="a mergekit-moe YAML config (base_model, experts, gate_mode, dtype, ...)"),
    opt("out", on=MOE, part=MOE, form="positional", nargs="?", help="output folder (absent or empty)"),
    opt("output", "-o", "--output", on=MOE, part=MOE, help="output folder (the same as OUT)"),
    opt("device", "--device", on=MOE, part=MOE, parse=device_name, default="cpu",
        help="where the hidden-state pass (gate_mode hidden) runs: cpu (default), cuda, cuda:N, auto"),
    opt("random_seed", "--random-seed", on=MOE, part=MOE, parse=int, default=0, metavar="N",
        help="seed of gate_mode random's router rows (default 0)"),
    opt("out_shard_size", "--out-shard-size", on=MOE, part=MOE, parse=mergekit_size_text, metavar="SIZE",
        help="largest output shard: 5B (the default; as mergekit: bytes with K/M/B suffixes for thousand, million, "
             "billion) or 2GB"),
    opt("allow_crimes", "--allow-crimes", on=MOE, part=MOE, form="switch", default=False,
        help="experts of another family than the base (Llama experts in a Mistral base), as mergekit"),
    opt("no_copy_tokenizer", "--no-copy-tokenizer", on=MOE, part=MOE, form="switch", default=False,
        help="do not copy the base's tokenizer files"),
    opt("align", "--align", on=MOE, part=MOE, form="switch", default=False,
        help="align every expert to the base model first, so that experts trained apart sit in the base's frame "
             "(with --symmetries and the alignment flags of symmerge align)"),
    opt("symmetries", "--symmetries", on=MOE, part=MOE, parse=symmetry_list, default=RECOMMENDED_NAME,
        help="with --align: the symmetries aligned (as symmerge align; default recommended)"),
    opt("align_stream", "--align-stream", on=MOE, part=MOE, form="switch", default=False,
        help="with --align: align each expert layer by layer from its checkpoint (symmerge align --stream)"),
    *(opt(_dest(f), *(("-q",) if f == "--quiet" else ()), f, on=MOE, part=MOE_MERGEKIT, form="switch", default=False,
          help=why) for f, why in MOE_NO_OPS.items()),
    *(opt(_dest(f), f, on=MOE, part=MOE_MERGEKIT, metavar="VALUE", help=why) for f, why in MOE_VALUE_NO_OPS.items()),
    opt("num_threads", "-j", "--num-threads", on=MOE, part=MOE_MERGEKIT, parse=int, minimum=1, metavar="N",
        help="torch's CPU threads for the hidden-state pass"),
    opt("v", "-v", on=MOE, part=MOE_MERGEKIT, form="count", default=0,
        help="accepted: progress lines are shown by default"),
    *(opt(_dest(f), f, on=MOE, part=MOE_MERGEKIT, form="switch", default=False, hidden=True) for f in MOE_HIDDEN),
    # extract-lora's
    opt("finetune", on=EXTRACT, part=EXTRACT, form="positional", nargs="?",
        help="the fine-tuned model (HF folder, or BASE+ADAPTER)"),
    opt("base", on=EXTRACT, part=EXTRACT, form="positional", nargs="?",
        help="its base model (HF folder, or BASE+ADAPTER)"),
    opt("output", "-o", "--output", "--out-path", on=EXTRACT, part=EXTRACT,
        help="output folder: the PEFT adapter (must not exist or be empty)"),
    opt("rank", "--rank", "--max-rank", on=EXTRACT, part=EXTRACT, parse=int, minimum=1, default=128, metavar="R",
        help="largest rank of a layer's LoRA (default 128, as mergekit)"),
    opt("model_flag", "--model", on=EXTRACT, part=EXTRACT, help="the fine-tuned model (as FINETUNE)"),
    opt("base_flag", "--base-model", on=EXTRACT, part=EXTRACT, help="the base model (as BASE)"),
    opt("distribute_scale", "--distribute-scale", on=EXTRACT, part=EXTRACT, form="onoff", default=True,
        help="split the singular values evenly between A and B (√S each; default) or put them in A"),
    opt("embed_lora", "--embed-lora", on=EXTRACT, part=EXTRACT, form="onoff", default=False,
        help="a LoRA for the embeddings too (default: saved whole, in modules_to_save)"),
    opt("save_module", "--save-module", on=EXTRACT, part=EXTRACT, form="append", default=[], metavar="NAME",
        help="save this module whole (its last name, e.g. lm_head, or the full name of a module of loose parameters, "
             "e.g. vit.embeddings; repeatable)"),
    opt("exclude", "-e", "--exclude-regex", "--exclude-regexes", on=EXTRACT, part=EXTRACT, form="append", default=[],
        metavar="REGEX", help="leave out modules whose name matches (repeatable)"),
    opt("include", "-i", "--include-regex", "--include-regexes", on=EXTRACT, part=EXTRACT, form="append", default=[],
        metavar="REGEX", help="only modules whose name matches (repeatable)"),
    opt("sv_epsilon", "--sv-epsilon", on=EXTRACT, part=EXTRACT, parse=float, minimum=0, default=0.0, metavar="EPS",
        help="drop singular values at or below EPS (a layer's rank may fall below R)"),
    opt("skip_undecomposable", "--skip-undecomposable", on=EXTRACT, part=EXTRACT, form="switch", default=False,
        help="leave out modules that are neither linear layers nor embeddings (norms) instead of saving them whole"),
    opt("svd", "--svd", on=EXTRACT, part=EXTRACT, choices=("full", "lowrank"), default="full",
        help="full: each layer's exact SVD (torch.linalg.svd; mergekit's result, default); lowrank: randomized (R + "
             "10 directions, 4 subspace iterations), much faster when R is small against the layers' sizes, its "
             "error in the report"),
    opt("random_seed", "--random-seed", on=EXTRACT, part=EXTRACT, parse=int, default=0, metavar="N",
        help="seed of --svd lowrank"),
    opt("device", "--device", on=EXTRACT, part=EXTRACT, parse=device_name,
        help="where the SVDs run: cpu (default), cuda, cuda:N"),
    opt("cuda", "--cuda", on=EXTRACT, part=EXTRACT, form="onoff", default=False,
        help="the SVDs on the GPU when there is one (without a GPU, a warning and the CPU)"),
    opt("gpu_rich", "--gpu-rich", on=EXTRACT, part=EXTRACT, form="switch", default=False,
        help="as mergekit: --cuda"),
    opt("quiet", "-q", "--quiet", on=EXTRACT, part=EXTRACT, form="onoff", default=False,
        help="no progress on stderr (as --progress none; mergekit-extract-lora's --quiet)"),
    opt("num_threads", "-j", "--num-threads", on=EXTRACT, part=EXTRACT, parse=int, minimum=1, metavar="N",
        help="torch's CPU threads"),
    opt("write_model_card", "--write-model-card", on=EXTRACT, part=EXTRACT, form="onoff", default=True,
        help="write a README.md model card (default)"),
    opt("verbose", "-v", "--verbose", on=EXTRACT, part=EXTRACT, form="count", default=0,
        help="print every layer's error"),
    opt("allow_crimes", "--allow-crimes", on=EXTRACT, part=EXTRACT, form="onoff", default=False, hidden=True),
    opt("unsafe_truncate_embeddings", "--unsafe-truncate-embeddings", on=EXTRACT, part=EXTRACT, form="onoff",
        default=False, hidden=True),
    *(opt("noop_" + _dest(f), f, on=EXTRACT, part=EXTRACT_NOOPS, form="value" if metavar else "onoff",
          metavar=metavar, help=f"accepted: {why}") for f, (why, metavar) in EXTRACT_NO_OPS.items()),
    # demo's
    opt("output", "-o", "--output", on=DEMO, part=DEMO, default="symmerge-demo",
        help="folder for demo.json and demo.png (default symmerge-demo; an earlier demo's output there is replaced)"),
    opt("seed", "--seed", on=DEMO, part=DEMO, parse=int, default=0,
        help="seed of model A (model B: seed + 1; default 0)"),
    opt("quick", "--quick", on=DEMO, part=DEMO, form="switch", default=False,
        help="a smaller model and shorter training (seconds; for smoke tests)"),
    opt("threads", "--threads", on=DEMO, part=DEMO, parse=int, default=1,
        help="torch threads (default 1: fastest for these tiny models on a shared CPU, and the setting the README's "
             "figures were printed with; 0: torch's default)"),
)
TABLE = Table(OPTIONS)
LEARN_FLAGS = {o.learn: o.flag for o in OPTIONS if o.learn and o.takes_value}  # LearnSettings field → valued flag
LEARN_SWITCHES = {o.learn: o for o in OPTIONS if o.learn and not o.takes_value}  # layerwise: --learn-layerwise
