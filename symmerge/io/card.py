"""The model card (``README.md``) of every folder symmerge writes a model or an adapter into: ``align``,
``merge``, each merge of ``run``, ``moe`` and ``extract-lora`` — one writer, :func:`write_card`, from the report.

An input's own card describes the input, not the aligned or merged model, so it is never copied
(:data:`symmerge.io.model.REPLACED`). The output's card is written from the run's report instead: the
inputs (with the names and licences their cards declare, quoted from their YAML front matter or first
heading), the method, the alignment, what was measured (distances, verification, evaluation), the
tokenizer check, the sentence-transformers pipeline, and the symmerge version. The report
(``symmerge_report.json``) beside it has every figure in full.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from pathlib import Path

CARD = "README.md"
_WRITTEN = ContextVar("symmerge_cards_written", default=True)  # False inside cards_off(): write_card writes none


@contextlib.contextmanager
def cards_off(off: bool = True):
    """Within the block (``off``), :func:`write_card` writes no card: ``run --no-write-model-card`` of a config that
    runs ``merge`` or ``align``, whose writers each write one."""
    token = _WRITTEN.set(False) if off else None
    try:
        yield
    finally:
        if token is not None:
            _WRITTEN.reset(token)


def _front_matter(text: str) -> dict:
    """The YAML front matter of a model card (``---`` ... ``---``), ``{}`` if absent or unreadable."""
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    from .yaml_bounded import parse_bounded

    try:  # bounded as a config is: a card's aliases could otherwise expand to gigabytes when quoted
        docs = parse_bounded(CARD, text[3:end])
    except Exception:  # a malformed card is quoted as having no metadata, not an error
        return {}
    data = docs[0][0] if len(docs) == 1 else None
    return data if isinstance(data, dict) else {}


def input_card(folder) -> dict | None:
    """What an input's card says of itself: ``name`` (``model_name``, the model index's name, or the
    first heading) and ``license``; ``None`` for an input without a card (or not a folder)."""
    if not isinstance(folder, (str, Path)) or not (Path(folder) / CARD).is_file():
        return None
    try:
        text = (Path(folder) / CARD).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    meta = _front_matter(text)
    name = meta.get("model_name")
    index = meta.get("model-index")
    if not name and isinstance(index, list) and index and isinstance(index[0], dict):
        name = index[0].get("name")
    if not name:
        name = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), None)
    licence = meta.get("license")
    return {"name": str(name) if name else None,
            "license": ", ".join(map(str, licence)) if isinstance(licence, list) else licence}


def _fmt(x, digits: int = 4) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-3 and x else f"{x:.{digits}f}"
    return "–" if x is None else str(x).replace("|", "\\|")  # a table cell: pipes escaped


def _inputs(report: dict) -> list[tuple[str, str]]:
    """(folder or name, role) of every input the report names."""
    if "method" in report:  # a merge
        rows = [(m, "merged") for m in report.get("models") or []]
        anchor = (report.get("alignment") or {}).get("anchor") or {}
        if anchor.get("name") is not None:
            rows = [(m, role + (" (anchor)" if i == anchor.get("index") else "")) for i, (m, role) in enumerate(rows)]
            if anchor.get("index") is None and anchor.get("name") != report.get("base"):
                rows.append((anchor["name"], "anchor"))
        if report.get("base"):
            rows.append((report["base"], "base (task vectors)"))
        return rows
    return [(report[k], role) for k, role in (("model", "aligned (its function is kept)"),
                                               ("anchor", "anchor (the target)")) if report.get(k)]


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def _align_sections(r: dict) -> list[str]:
    out = ["## Method", "",
           f"`symmerge align{' --stream' if r.get('streamed') else ''}`: the model was moved inside its symmetry "
           "orbit — transformations that leave its outputs unchanged — as close as possible (L2) to the anchor. "
           "It computes the same function as the input model.", "",
           f"- symmetries aligned: `{','.join(r.get('symmetries') or []) or 'none'}` (requested: "
           f"`{r.get('symmetries_requested', '–')}`)",
           f"- rescale: `{r.get('rescale', '–')}`; match: `{r.get('match', 'weights')}`"]
    if r.get("residual_variant"):
        out.append(f"- residual stream: `{r['residual_variant']}` ({r.get('residual_group', '')})")
    out += ["", "## Measured", "",
            *_table(["quantity", "value"], [
                ["L2 distance to the anchor, before", r.get("distance_before")],
                ["L2 distance to the anchor, after", r.get("distance_after")],
                ["output difference to the input model, max abs", r.get("verify_max_abs_diff")],
                ["output difference to the input model, max relative", r.get("verify_max_rel_diff")],
                ["verification tolerance", r.get("verify_tolerance")],
                ["seconds", r.get("seconds")]]), ""]
    return out


def _saved_head(head: dict) -> str:
    """Which task head the saved folder carries, in words."""
    policy = head.get("policy")
    if policy == "keep" and head.get("from"):
        return f"this folder carries the task head of `{head['from']}`"
    if policy == "merge":
        return "this folder carries the merged task head (the inputs' heads merged like the body)"
    if policy == "none":
        return "this folder has no task head (base models)"
    return "the report does not say which task head this folder carries"


def _head_used(entry: dict, head: dict) -> str:
    """The task head one evaluation row of the merged model used, and whether it is the saved one."""
    used = entry.get("head_from")
    if used is None:
        return "–"
    if used == "merged":
        return "merged (this folder's)"
    if used == head.get("from"):
        return f"`{used}`'s (this folder's)"
    return f"`{used}`'s (*not in this folder*)"


def _merge_sections(r: dict) -> list[str]:
    a = r.get("alignment") or {}
    params = ", ".join(f"{k}={v}" for k, v in (r.get("params") or {}).items()) or "none"
    cfg = r.get("config")
    how = (f"`symmerge run {Path(cfg['path']).name}`: a mergekit config, `merge_method: {cfg.get('merge_method')}` "
           f"({cfg.get('tensors')} tensors, {cfg.get('layers')} layers; its parameters, gradients and filters as "
           f"written in `mergekit_config.yml`)." if cfg else
           f"`symmerge merge --method {r['method']}` (parameters: {params}; weights: {r.get('weights') or 'equal'}).")
    out = ["## Method", "", how, "",
           f"- alignment before merging: `{','.join(a.get('symmetries') or []) or 'none'}` (requested: "
           f"`{a.get('requested', '–')}`), rescale `{a.get('rescale', '–')}`; anchor: "
           f"{(a.get('anchor') or {}).get('name') or '–'} ({(a.get('anchor') or {}).get('rule') or 'no alignment'})"]
    if a.get("note"):
        out.append(f"- note: {a['note']}")
    if a.get("joint"):
        j = a["joint"]
        line = (f"- joint alignment into one frame: {j['rounds']} round(s) after the star, spread "
                f"{j['objective'][0]:.6g} → {j['objective'][-1]:.6g}")
        if j.get("learned"):
            lj = j["learned"]
            line += (f"; then learned ({lj['steps']} steps on {j['align_samples_used']} unlabeled examples, random "
                     f"convex combinations of the models): objective {lj['held_out_start']:.4f} → "
                     f"{lj['held_out_best']:.4f}")
        out.append(line)
    head = r.get("head") or {}
    out.append(f"- task head: {head.get('policy', '–')}" + (f" (from {head['from']})" if head.get("from") else ""))
    if r.get("statistics"):
        out.append(f"- statistics: {r['statistics'].get('kind')} on "
                   + ", ".join(f"{s['data']} ({s['examples']} examples)" for s in r["statistics"]["per_model"]))
    if r.get("repair"):
        out.append("- REPAIR: channel statistics reset to the endpoints' interpolation")
    out += ["", "## Measured", ""]
    rows = [[m.get("model"), "anchor" if m.get("anchor") else "aligned", m.get("distance_before"),
             m.get("distance_after"), m.get("verify_max_rel_diff")] for m in a.get("models") or []]
    if rows:
        out += ["Alignment (L2 distance to the anchor over the body; output difference of the aligned model to its "
                "input):", "", *_table(["model", "role", "distance before", "distance after",
                                        "max relative output difference"], rows), ""]
    pairs = r.get("distances_between_inputs") or {}
    if pairs.get("before_alignment"):
        out += ["Distances between the inputs (L2, body):", "",
                *_table(["pair", "before alignment", "after alignment"],
                        [[k, v, (pairs.get("after_alignment") or {}).get(k)]
                         for k, v in pairs["before_alignment"].items()]),
                ""]
    ev = r.get("evaluation") or {}
    if ev.get("merged"):
        saved = _saved_head(head)
        rows = [["merged", e.get("data"), e.get("loss"), e.get("accuracy"), e.get("n"), _head_used(e, head)]
                for e in ev["merged"]]
        rows += [[e.get("model"), e.get("data"), e.get("loss"), e.get("accuracy"), e.get("n"), "its own"]
                 for e in ev.get("models") or [] if "skipped" not in e]
        out += [f"Evaluation ({ev.get('data_role', 'data')}). {saved[0].upper() + saved[1:]}; the last column "
                "names the task head each score used:", "",
                *_table(["model", "data", "loss", "accuracy", "examples", "head used"], rows), ""]
        if any(e.get("head_from") not in (None, "merged", head.get("from")) for e in ev["merged"]):
            out += ["A merged row marked *not in this folder* scored the merged body with another input's head "
                    "(one data file per model: each file with its own model's head). Loading this folder gives "
                    f"{saved}, so its scores on that data differ.", ""]
        cut = [e for e in ev["merged"] + (ev.get("models") or []) if e.get("examples_in_file")]
        for path in dict.fromkeys(e.get("data") for e in cut):
            e = next(x for x in cut if x.get("data") == path)
            out += [f"Evaluation data cut: `{path}`: only its first examples were scored ({e.get('cut_by')}; "
                    f"{e['examples_in_file']} in the file).", ""]
        if ev.get("note"):
            out += [f"Note: {ev['note']}", ""]
    return out


def kind_of(report: dict | None) -> str | None:
    """Which command wrote ``report``: ``merge`` (``run``'s merges too), ``align``, ``moe``, ``extract-lora``, or
    None (no card: the demo's trained models)."""
    if not report:
        return None
    if "method" in report:
        return "merge"
    if "distance_before" in report:
        return "align"
    if report.get("command") == "moe":
        return "moe"
    if "finetune" in report and "rank" in report:
        return "extract-lora"
    return None


def _moe_text(r: dict, folder_name: str, version: str) -> str:
    experts = ", ".join(f"`{e}`" for e in r.get("experts") or [])
    shared = r.get("shared_experts") or []
    lines = ["---", "library_name: transformers", "tags:", "- symmerge", "- moe", "---", "", f"# {folder_name}", "",
             f"A mixture of experts assembled by symmerge {version} (`symmerge moe`, mergekit-moe's config in "
             "`mergekit_moe_config.yml`): the base model's attention, embeddings and norms, and each layer's feed-"
             "forward blocks taken from the experts. It is not any of its inputs; every figure is in "
             "`symmerge_report.json`.", "",
             *_table(["quantity", "value"], [
                 ["architecture", r.get("architecture")], ["base model", r.get("base_model")],
                 ["experts", len(r.get("experts") or [])], ["shared experts", len(shared)],
                 ["experts per token", r.get("experts_per_token")], ["gate mode", r.get("gate_mode")],
                 ["dtype", r.get("dtype")],
                 ["experts aligned to the base first", "yes" if r.get("aligned") else "no"]]), "",
             f"Experts: {experts or '–'}" + (f"; shared: {', '.join(f'`{e}`' for e in shared)}" if shared else "")
             + "."]
    return "\n".join(lines) + "\n"


def _lora_text(r: dict, version: str) -> str:
    err = r.get("relative_error") or {}
    return (f"---\nlibrary_name: peft\nbase_model: {r['base']}\ntags: [symmerge, lora, extract-lora]\n---\n\n"
            f"# LoRA adapter extracted by symmerge\n\nThe task vector of `{r['finetune']}` over `{r['base']}`,"
            f" as a PEFT LoRA adapter of rank {r.get('r')} (`symmerge extract-lora` {version}, at most rank "
            f"{r['rank']}): {len(r.get('modules') or [])} modules, relative reconstruction error mean "
            f"{err.get('mean', 0.0):.4g}, max {err.get('max', 0.0):.4g} (per module in `symmerge_report.json`).\n")


def card_text(report: dict, folder_name: str = "model") -> str:
    """The model card of an output folder, from its report (:func:`kind_of`)."""
    from .._version import __version__

    kind = kind_of(report)
    if kind == "moe":
        text = _moe_text(report, folder_name, __version__)
    elif kind == "extract-lora":
        text = _lora_text(report, __version__)
    else:
        text = _model_text(report, folder_name, __version__)
    return text + _command_section(report)


def _command_section(report: dict) -> str:
    """The command line that made the output, as the user gave it (the report's ``command_line``; none from the
    Python API)."""
    import shlex

    line = report.get("command_line")
    return f"\n## Command\n\n```\n{shlex.join(line)}\n```\n" if line else ""


def _model_text(report: dict, folder_name: str, version: str) -> str:
    """The card of an aligned or merged model."""
    r = report
    inputs = _inputs(r)
    cards = [(name, role, input_card(name)) for name, role in inputs]
    licences = {c["license"] for _, _, c in cards if c and c.get("license")}
    pipeline = r.get("sentence_transformers")
    tags = ["symmerge", "merge" if "method" in r else "aligned"] + (["sentence-transformers"] if pipeline else [])
    front = ["---", f"library_name: {'sentence-transformers' if pipeline else 'transformers'}"]
    if len(licences) == 1:
        front.append(f"license: {next(iter(licences))}")
    front += ["tags:", *[f"- {t}" for t in tags], "---", ""]
    what = "merged" if "method" in r else "aligned"
    lines = front + [f"# {folder_name}", "",
                     f"This model was {what} by symmerge {version}"
                     f"{' (symmetry-aware fusion of transformer models)' if what == 'merged' else ''}. It is not any "
                     "of its inputs: their model cards are not copied; what they declare is quoted below. Every "
                     "figure of the run is in `symmerge_report.json`.", ""]
    if r.get("model_type"):
        lines += [f"Architecture: `{r['model_type']}`" + (f" ({r['family']} family)" if r.get("family") else "")
                  + (f"; sentence-transformers pipeline: {', '.join(pipeline['modules'])}" if pipeline else "") + ".",
                  ""]
    if inputs:
        lines += ["## Inputs", "",
                  *_table(["model", "role", "its card's name", "its card's licence"],
                          [[f"`{n}`", role, (c or {}).get("name"), (c or {}).get("license")] for n, role, c in cards]),
                  ""]
        if len(licences) > 1:
            lines += ["The inputs declare different licences: check each before using or sharing this model.", ""]
    lines += _merge_sections(r) if "method" in r else _align_sections(r)
    tok = r.get("tokenizer")
    if tok:
        source = "those of the model whose head is kept" if "method" in r else "the aligned model's"
        lines += ["## Tokenizer", "", f"Tokenizer check: `{tok.get('status')}`"
                  + (f" ({tok['note']})" if tok.get("note") else "") + f". The tokenizer files are {source}.", ""]
        lines += [f"- {m['models'][0]} vs {m['models'][1]}: " + "; ".join(m["differences"])
                  for m in tok.get("mismatches") or []]
    if pipeline:
        merged = pipeline.get("merged_modules")
        lines += ["## sentence-transformers", "",
                  f"Modules: {', '.join(pipeline['modules'])} (`modules.json` and the module configs copied"
                  + (f"; {', '.join(merged)} merged with `{pipeline.get('weighted_method')}`" if merged else "")
                  + "). Load it with `SentenceTransformer(folder)`.", ""]
        if pipeline.get("note"):
            lines += [f"Note: {pipeline['note']}", ""]
    return "\n".join(lines).rstrip() + "\n"


def _output_name(folder: Path) -> str:
    """The name of the output folder being written: atomic writes happen in a temporary folder beside it,
    ``.<out>.symmerge-tmp-<pid>-XXXX`` (:func:`symmerge.io.output.temp_prefix`) or ``.<out>.tmp-XXXX``."""
    from .output import TAG

    name = folder.name
    for tag in (TAG, ".tmp-"):
        if name.startswith(".") and tag in name:
            name = name[1:].split(tag)[0]
    return name or "model"


def write_card(folder, report: dict | None) -> Path | None:
    """Write ``folder/README.md`` (the output's model card) from ``report``, the report of an align, merge (``run``'s
    included), moe or extract-lora; other folders written by :func:`~symmerge.io.model.save_model` (the demo's
    trained models) get none, and none is written inside :func:`cards_off`."""
    from .provenance import stamp

    if kind_of(report) is None or not _WRITTEN.get():
        return None
    stamp(report)  # the version and command line, as the report written beside it has them
    folder = Path(folder)
    name = _output_name(folder)
    path = folder / CARD
    path.write_text(card_text(report, name), encoding="utf-8")
    return path
