"""Merge configs: a YAML file read once into a plain description of what to run, every error (naming the
key and its line) before anything is read or written.

* A **mergekit config** (only mergekit's keys: ``models`` or ``slices``, ``merge_method``, ``base_model``,
  ``parameters`` with scalars, gradients and filters, ``dtype``, ``out_dtype``, ``tokenizer_source`` /
  ``tokenizer``, ``chat_template``, ``name`` and several documents for mergekit-multi) becomes
  :class:`~symmerge.config.mergekit.Job` s: per-tensor :class:`~symmerge.merge.steps.TensorStep` s merged
  exactly as mergekit would, without any alignment.
* The same config with alignment asked for (``align:`` and the merge command's alignment options, or run with
  ``--align``) is planned the same way and run on the models aligned into one frame first (:mod:`.aligned`).
* A config with other keys of symmerge's (``eval_data``, ``data``, ``method``, ``command: align``, ...)
  becomes the ``symmerge merge`` (``align``, ``barrier``) command line it stands for (:mod:`.command`).

What a file is comes from what it holds: symmerge's own options by name make it symmerge's; a key that is
neither mergekit's nor an option of symmerge's (``tokenzer_source``) changes nothing — it is ignored with
one warning line (:mod:`.lenient`), as mergekit ignores it. A mergekit-moe config (``experts``,
``gate_mode``) is one error pointing to ``symmerge moe``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SymmergeError
from . import aligned
from .command import is_option, symmerge_config
from .mergekit import KEYS, OUTPUT_KEYS, Job, Planner
from .source import Doc, read_documents


@dataclass
class Description:
    """What a config runs: ``jobs`` (a mergekit config) or ``command`` and its ``config`` (a symmerge one:
    :class:`~symmerge.config.command.SymmergeConfig`)."""

    path: Path
    output: Path | None = None
    jobs: list = field(default_factory=list)
    command: str | None = None
    config: object = None
    # an aligned mergekit config: how its models are aligned (symmerge.config.aligned.Alignment), the
    # documents re-planned on the aligned copies, the seed
    alignment: object = None
    docs: list = field(default_factory=list)
    seed: int | None = None
    warnings: list = field(default_factory=list)  # one line per key or parameter ignored, as mergekit ignores it
    trust_remote_code: bool = False  # the config's ``trust_remote_code: true`` (as --trust-remote-code)

    @property
    def mergekit(self) -> bool:
        return self.command is None

    @property
    def argv(self) -> list:
        """The arguments of the ``symmerge COMMAND`` command line a symmerge config stands for (printed by
        ``--print-command``; the config itself builds the command's options directly)."""
        from .command import command_line

        return command_line(self.config)[1:] if self.config is not None else []


MOE_KEYS = ("experts", "gate_mode", "experts_per_token", "shared_experts")


REMOTE_CODE_KEY = "trust_remote_code"


def _remote_code_key(docs) -> bool:
    """Whether the config says ``trust_remote_code: true`` (in any document; a boolean), taken out of the
    documents: it is the command line's ``--trust-remote-code``, neither a mergekit key nor an option of a
    merge."""
    trust = False
    for d in docs:
        if REMOTE_CODE_KEY in d.data:
            value = d.data[REMOTE_CODE_KEY]
            if not isinstance(value, bool):
                raise d.error(f"{REMOTE_CODE_KEY!r} is true or false, got {value!r}", REMOTE_CODE_KEY)
            trust = trust or value
            d.data = {k: v for k, v in d.data.items() if k != REMOTE_CODE_KEY}
    return trust


def _symmerge_key(doc: Doc):
    """The first key of ``doc`` that is an option of symmerge's own (not mergekit's), or None. ``align: none``
    asks for no alignment: the mergekit meaning. A key that is neither is no sign of either (a typo): the
    mergekit reading warns of it."""
    command = doc.data.get("command", "merge")
    for k, v in doc.data.items():
        if k in KEYS or k in OUTPUT_KEYS:
            continue
        if k == "align" and (v is False or (isinstance(v, str) and v.strip().lower() == "none")):
            continue
        if k == "command" or is_option(command, k):
            return k
    return None


def _moe(doc: Doc) -> None:
    """A mergekit-moe config (``experts``, ``gate_mode``; no ``merge_method``) is one error naming its command."""
    found = [k for k in doc.data if k in MOE_KEYS]
    if found and "merge_method" not in doc.data:
        raise doc.error(f"a mergekit-moe config ({', '.join(found)}): it builds a mixture of experts, which "
                        "'symmerge moe CONFIG OUT' runs (symmerge run takes mergekit-yaml configs)", found[0])


def describe(path, output=None, align=None, seed=None, truncate_embeddings=False, merge_adapters=True,
             needs_output: bool = True) -> Description:
    """The description of config ``path``; ``output``: the output folder given on the command line (else the
    config's ``output``); ``align``: ``--align`` given on the command line (asks for symmerge's merge);
    ``truncate_embeddings``: mergekit-yaml's ``--unsafe-truncate-embeddings``. The config's
    ``trust_remote_code: true`` lets model folders' code run while it is planned (and, through
    ``Description.trust_remote_code``, while it runs). ``merge_adapters=False``: a ``BASE+ADAPTER`` input planned
    on its base's folder, no adapter merged (every refusal of the plan, and of the output, before any merge:
    ``symmerge run``); its description is for checking, not for running. ``needs_output=False``: a mergekit config
    without an output folder is described with none (``--print-plan``, ``--print-command``: nothing is written)."""
    from ..io.hf import remote_code_allowed, trust_remote_code

    docs = read_documents(path)
    for d in docs:
        _moe(d)
    trust = _remote_code_key(docs)
    with trust_remote_code(trust or remote_code_allowed()):
        return _describe(docs, Path(path), output, align, seed, trust, truncate_embeddings, merge_adapters,
                         needs_output)


def _describe(docs, path: Path, output, align, seed, trust: bool, truncate_embeddings: bool,
              merge_adapters: bool = True, needs_output: bool = True) -> Description:
    keyed = [(d, _symmerge_key(d)) for d in docs]
    symmerge = [(d, k) for d, k in keyed if k is not None]
    spec = None
    if len(docs) == 1 and aligned.applies(docs[0], align):
        spec = aligned.alignment_of(docs[0], align)
        docs = [aligned.without_alignment_keys(docs[0])]
        symmerge = []
    elif (symmerge or (align is not None and str(align).lower() != "none")) and len(docs) == 1:
        config = symmerge_config(docs[0], output=output, align=align,
                                 symmerge_key=symmerge[0][1] if symmerge else None)
        return Description(path, None, command=config.command, config=config, trust_remote_code=trust)
    if symmerge:
        d, k = symmerge[0]
        raise d.error(f"{k!r} is not a mergekit key, and a file of several merges is a mergekit config "
                      "(symmerge's own keys are for one-document configs)", k)
    if spec is None and align is not None and str(align).lower() != "none":
        raise SymmergeError("--align: a file of several merges is a mergekit config, merged without alignment")
    if needs_output and output is None and not any(k in d.data for d in docs for k in OUTPUT_KEYS):
        raise SymmergeError(f"{path}: no output folder: symmerge run CONFIG.yml OUT (or -o OUT, or 'output:' in "
                            "the config)")
    planner = Planner(docs, seed=seed, truncate_embeddings=truncate_embeddings, merge_adapters=merge_adapters)
    try:
        jobs = planner.plan()
    except SymmergeError as e:
        raise _naming_ignored(e, planner.warnings, path) from None
    if spec is not None:
        aligned.check_one_architecture(docs[0], planner, jobs[0])
    final = next(j for j in jobs if j.final)
    final_doc = next(d for d in docs if d.data.get("name") == final.name) if final.name else \
        next(d for d in docs if d.data.get("name") is None)
    out = _output(docs, final_doc, output, needs_output)
    final.output = out
    for d in docs:
        if d is not final_doc:
            for k in OUTPUT_KEYS:
                if k in d.data:
                    raise d.error("only the final merge has an output folder (the others are written to a temporary "
                                  "folder and removed)", k)
    return Description(path, out, jobs=jobs, alignment=spec, docs=docs, seed=seed, warnings=list(planner.warnings),
                       trust_remote_code=trust)


def _naming_ignored(error: SymmergeError, warnings: list, path: Path) -> SymmergeError:
    """``error`` with the keys ignored before it (a misspelt ``merge_methd``, ``parameter``: mostly why it failed)
    named in its one line; ``error`` itself when none was."""
    if not warnings:
        return error
    from .lenient import IGNORED

    shown = [w.removeprefix(f"{path} ").removesuffix(IGNORED) for w in warnings[:IGNORED_NAMED]]
    more = f"; and {len(warnings) - IGNORED_NAMED} more" if len(warnings) > IGNORED_NAMED else ""
    return SymmergeError(f"{error}; keys ignored, perhaps misspelt: {'; '.join(shown)}{more}")


IGNORED_NAMED = 10  # ignored keys an error names (a file of 60 000 unknown keys made a line of 2.3 MB)


def _output(docs, doc, output, needs_output: bool = True):
    given = [(k, doc.data[k]) for k in OUTPUT_KEYS if k in doc.data]
    if len(given) > 1:
        raise doc.error(f"give one of {', '.join(k for k, _ in given)}", given[1][0])
    if given:
        k, v = given[0]
        if not isinstance(v, str) or not v.strip():
            raise doc.error(f"{k!r} is the output folder, got {v!r}", k)
        if output is not None and Path(v) != Path(output):
            raise doc.error(f"the config writes to {v!r} and the command line to {str(output)!r}: give one", k)
        return Path(v)
    if output is None and not needs_output:
        return None
    if output is None:
        raise SymmergeError(f"{docs[0].path}: no output folder: symmerge run CONFIG.yml OUT (or -o OUT, or "
                            "'output:' in the config)")
    return Path(output)


__all__ = ["Description", "Job", "describe", "read_documents"]
