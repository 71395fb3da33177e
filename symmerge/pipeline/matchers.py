"""Matchers: what a pairwise alignment's group elements are fitted to, one plug-in each behind one
protocol. A matcher is a function

    match(ctx: MatchContext) -> {instance name: element}

that finds, for the instances active under ``ctx.opts``, the elements moving ``ctx.model`` (in the
canonical form ``ctx.ca``) towards ``ctx.anchor`` (``ctx.cb``). It reads only the group kinds'
declared capabilities (:mod:`symmerge.groups.base`), never a kind's name, and adds its report fields to
``ctx.fields``. Registered here by name (``--match NAME``):

* ``weights`` — data-free weight matching (:func:`symmerge.pipeline.engine.solve`: every kind's exact
  solver, coordinate descent with the model-wide groups);
* ``activations`` — the kinds' solvers on both models' activation statistics over unlabeled data
  (:mod:`symmerge.pipeline.activations`);
* ``learned`` — from a closed form, the kinds' continuous parameterisations optimised so that the
  interpolated model matches the interpolated predictions (:mod:`symmerge.pipeline.learn`).

Adding a matcher: write ``match(ctx)``, declare what it can do in a :class:`Matcher` (``streams``, ``joint``,
``needs_data``, ``learns``) and register it in :data:`MATCHERS`; ``AlignOptions`` and the
CLI's ``--match`` accept its name (``options.MATCH_MODES`` is this registry's keys), and ``align``,
``merge`` and ``barrier`` then run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import SymmergeError


@dataclass
class MatchContext:
    """What a matcher is given: the bound instances, both models and their canonical state dicts, the
    alignment options (``options``) and the solvers' options (``opts``), a progress callback or None,
    and the report fields it may add to."""

    instances: list
    model: object
    anchor: object
    ca: dict
    cb: dict
    options: object
    opts: object
    progress: object = None
    fields: dict = field(default_factory=dict)
    history: list = field(default_factory=list)  # the weight matcher's objective per descent sweep
    bound: object = None  # the model's BoundModel (symmerge.pipeline.bound), where the caller bound it

    def data(self):
        """The unlabeled alignment data (loaded once, recorded in the report)."""
        if "_data" not in self.__dict__:
            from .data import load_align_data

            self._data = load_align_data(self.options, self.model, sources=[self.model, self.anchor])
            self.fields["align_samples_used"] = self._data.n
            self.fields["align_data"] = self._data.path  # the file, or generate:N:LEN:SEED
        return self._data


def match_weights(ctx: MatchContext) -> dict:
    from .engine import Restarts, search

    o = ctx.options
    elements, record = search(ctx.instances, ctx.ca, ctx.cb, ctx.opts, progress=ctx.progress, history=ctx.history,
                              max_sweeps=o.max_sweeps, tol=o.descent_tol,
                              starts=Restarts.of(o))
    if record is not None:  # which start won, and the objective of each (the report's ``solver``)
        ctx.fields["solver"] = record
    return elements


def match_activations(ctx: MatchContext) -> dict:
    from .activations import match_activations as fit
    from .verify import with_state_dict

    # both models in their canonical form, sharing the canonical tensors (no copy of any weight: only read)
    return fit(ctx.instances, with_state_dict(ctx.model, ctx.ca, share=True),
               with_state_dict(ctx.anchor, ctx.cb, share=True), ctx.data(),
               ctx.opts, progress=ctx.progress, timings=ctx.fields.setdefault("activation_seconds", {}),
               bound=ctx.bound)


def match_learned(ctx: MatchContext) -> dict:
    from .learn import learn_alignment

    if getattr(ctx.model.config, "is_encoder_decoder", False) and \
            not all("decoder_input_ids" in b.inputs for b in ctx.data().batches):
        # its loss scores the decoder's predictions: text files are read as reconstruction (io.data)
        raise SymmergeError(f"learned alignment on an encoder-decoder ({type(ctx.model).__name__}) scores the "
                            "decoder's predictions, and the alignment data carries no decoder inputs "
                            "(decoder_input_ids); give --align-data a .txt or .jsonl file (read as reconstruction)")
    start = match_activations(ctx) if ctx.options.learn.start == "activations" else None  # else: from the weights
    elements, ctx.fields["learned"] = learn_alignment(ctx.instances, ctx.model, ctx.anchor, ctx.ca, ctx.cb, ctx.data(),
                                                      ctx.options, progress=ctx.progress, start=start)
    if start is not None:  # the closed form given is the one --learn-start names
        ctx.fields["learned"]["start"] = ctx.options.learn.start
    return elements


@dataclass(frozen=True)
class Matcher:
    """A matcher plug-in and what it can do, read by every caller instead of its name:

    * ``streams`` — it runs in the streamed engine (:mod:`symmerge.pipeline.stream`: one part of a layer at a
      time, on the weights read from the files); a plan that streams refuses a matcher without it;
    * ``joint`` — it takes an arbitrary anchor, so the joint alignment of N models
      (:mod:`symmerge.pipeline.joint`) can run it;
    * ``needs_data`` — it reads unlabeled ``--align-data``; without it a step of the joint alignment is one
      sweep of the engine's descent on the state dicts;
    * ``learns`` — it trains the continuous elements (:class:`~symmerge.pipeline.options.LearnSettings`
      apply; the joint alignment hands over to :mod:`symmerge.pipeline.learn_joint`);
    * ``searches`` — it runs the data-free solver's search over the model-wide groups (``--restarts`` and the
      objective's weights apply: :func:`search_refusal`); a learning matcher searches when its start does."""

    name: str
    fit: Callable
    streams: bool = False
    joint: bool = True
    needs_data: bool = True
    learns: bool = False
    searches: bool = False

    def __call__(self, ctx: MatchContext) -> dict:
        return self.fit(ctx)


DEFAULT_MATCHER = "weights"  # data-free: what ``--match`` is when not given

MATCHERS = {m.name: m for m in (
    Matcher("weights", match_weights, streams=True, joint=True, needs_data=False, searches=True),
    Matcher("activations", match_activations, streams=False, joint=True, needs_data=True),
    Matcher("learned", match_learned, streams=False, joint=True, needs_data=True, learns=True),
)}


def matcher(name: str) -> Matcher:
    """The registered matcher ``name`` (its capabilities), or one clear error naming the known ones."""
    try:
        return MATCHERS[name]
    except KeyError:
        raise SymmergeError(f"unknown match mode {name!r}; choose one of {', '.join(MATCHERS)}") from None


# the data-free search's options (AlignOptions field -> flag): read only where the search runs
SEARCH_OPTIONS = {"restarts": "--restarts", "solver_budget": "--solver-budget", "solver_seed": "--solver-seed",
                  "ends_weight": "--ends-weight", "depth_decay": "--depth-decay"}


def search_refusal(options, wide: bool, aligned) -> str | None:
    """Why the data-free search options given in ``options`` (an AlignOptions: :data:`SEARCH_OPTIONS` away from
    their defaults) would be read by nothing (None: they are read, or none was given). ``wide``: a model-wide group
    (the residual stream) is aligned — the search restarts the descent over it; without one the per-layer groups are
    solved exactly, with nothing to search. ``aligned``: the symmetries resolved (for the message)."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(options)}
    given = [flag for name, flag in SEARCH_OPTIONS.items() if getattr(options, name) != defaults[name]]
    if not given:
        return None
    what = f"{', '.join(given)}: {'an option' if len(given) == 1 else 'options'} of the data-free solver's search"
    way_out = f"leave {'it' if len(given) == 1 else 'them'} out"
    m = matcher(options.match)
    start = matcher(options.learn.start) if m.learns else m
    if not start.searches:
        searching = ", ".join(n for n, x in MATCHERS.items() if x.searches)
        how = f"--match {m.name}" + (f" from --learn-start {start.name}" if m.learns else "")
        return f"{what}, which runs with --match {searching} (or --learn-start {searching}); {how} does not ({way_out})"
    if not wide:
        return (f"{what}, which restarts the descent over the residual stream's group; it is not aligned here "
                f"({','.join(aligned) or 'nothing'}), so the per-layer groups are solved exactly, with nothing to "
                f"search ({way_out}, or align residual in memory)")
    return None


def streaming_refusal(name: str, flag: str = "streaming") -> str | None:
    """Why the matcher ``name`` cannot run on a streamed alignment (None: it can); ``flag``: how the text
    names the streamed mode (``--stream``, ``--mode stream``)."""
    if matcher(name).streams:
        return None
    able = ", ".join(n for n, m in MATCHERS.items() if m.streams)
    return (f"{flag} matches {able} only (data-free): --match {name} runs the models on --align-data, so it "
            "needs them in memory (--mode memory; align without --stream)")
