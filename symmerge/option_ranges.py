"""The ranges of the options whose values the Python API's options objects refuse too, declared once: the
schema's declarations (:mod:`symmerge.options.declared`, ``minimum=``) and the dataclasses'
constructors (``AlignOptions``, ``LearnSettings``, ``MergeOptions.check``) read them here, and both refuse a value
below its minimum with the one line :func:`in_range` words (naming the flag). A module of its own beside the
``options`` package, importing nothing of symmerge but its error: the options objects (``pipeline``, ``merge``)
read it, and ``options`` reads them (their defaults), so it cannot live inside either."""

from __future__ import annotations

from numbers import Integral

from .errors import SymmergeError

MINIMA = {  # config key (= the option's name) -> the smallest value accepted
    "joint_rounds": 0,
    "align_samples": 1,
    "max_sweeps": 1,
    "solver_budget": 0,
    "learn_steps": 1,
    "learn_batch": 1,
    "learn_positions": 0,
    "learn_max_length": 2,
    "learn_check_batches": 0,
    "learn_augment": 0,
}
FRACTIONAL = ("solver_budget",)  # of MINIMA, the options that take a fraction (seconds); the others count
MAXIMA = {  # config key -> the largest value accepted, where a larger one ran out of memory or overflowed (a
    # count >= 2**63 was an OverflowError in the progress bar; 10**20 augmented views filled 7 GB in 40 s)
    "learn_steps": 10 ** 9,
    "learn_augment": 64,
}
SEED_MAX = 2 ** 64 - 1  # a seed, as torch's generators take it (and numpy's: not negative)
SEEDS = ("solver_seed", "learn_seed", "random_seed", "seed")  # the options that are seeds: 0 … SEED_MAX


def in_range(flag: str, minimum, value, maximum=None):
    """``value``, or one :class:`SymmergeError` naming ``flag`` when it is below ``minimum`` or above ``maximum``
    (None: no bound, or the value unset); a value that is no number (a str, a bool, NaN) is refused with the same
    flag."""
    if (minimum is None and maximum is None) or value is None:
        return value
    low = f">= {minimum:g}" if minimum is not None else None
    high = f"<= {maximum:g}" if maximum is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise SymmergeError(f"{flag} must be a number {' and '.join(b for b in (low, high) if b)}, got {value!r}")
    if minimum is not None and value < minimum:
        raise SymmergeError(f"{flag} must be {low}, got {value}")
    if maximum is not None and value > maximum:
        raise SymmergeError(f"{flag} must be {high}, got {value}")
    return value


def seed(flag: str, value):
    """``value``, a seed (``--learn-seed``, ``--solver-seed``, ``--random-seed``): a whole number 0 … 2**64 − 1,
    else one :class:`SymmergeError` naming ``flag`` (2**64 was a ValueError traceback out of torch's generator,
    a negative one out of numpy's)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value <= SEED_MAX:
        raise SymmergeError(f"{flag} must be a whole number from 0 to 2**64 - 1, got {value!r}")
    return value


def model_index(index, n: int, what: str = "anchor index", among: str | None = None) -> int:
    """``index``, a model's index as a user gives it (``--anchor``, a config's ``anchor``, the API's ``anchor=``):
    a whole number 0..n-1, counted from 0; else one :class:`SymmergeError` naming the range. A negative index is
    refused, not counted from the end as Python's indexing would (``--anchor=-1`` was the last model, undocumented).
    ``among``: the models' description in the line (default ``N models``)."""
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
        raise SymmergeError(f"{what} {index!r} out of range for {among or f'{n} models'}: give 0..{n - 1} (0-based)")
    return index


def whole_in_range(flag: str, minimum, value):
    """``value``, a count (``--batch-size``, ``--max-examples``): :func:`in_range`, and a whole number (2.5 reached
    torch as a batch size and a slice index)."""
    in_range(flag, minimum, value)
    if value is not None and not isinstance(value, int):
        raise SymmergeError(f"{flag} must be a whole number >= {minimum:g}, got {value!r}")
    return value


def check(name: str, value):
    """``value`` of the option ``name`` (its config key and flag: ``max_sweeps``, ``--max-sweeps``) in its declared
    range (:data:`MINIMA`; a whole number unless :data:`FRACTIONAL`), else the flag's one line."""
    flag = "--" + name.replace("_", "-")
    if name not in FRACTIONAL and value is not None and isinstance(value, float):
        raise SymmergeError(f"{flag} must be a whole number >= {MINIMA[name]:g}, got {value!r}")
    return in_range(flag, MINIMA[name], value, MAXIMA.get(name))
