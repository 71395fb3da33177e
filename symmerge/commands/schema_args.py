"""argparse arguments generated from the options' declarations (:mod:`symmerge.options.declared`): a command's
``add_arguments`` is :func:`add_options`; no flag is written out by hand twice. A value is read by the
option's own function (:meth:`~symmerge.options.schema.Option.read`'s parts), so that the command line and a
config key accept, refuse and word their errors alike."""

from __future__ import annotations

import argparse
import re

from ..errors import SymmergeError
from ..options.declared import TABLE
from ..options.schema import OptionValueError

ACTIONS = {"switch": "store_true", "append": "append", "count": "count", "onoff": argparse.BooleanOptionalAction}


def _type(option):
    """The argparse ``type`` of ``option``: its parse function with the range checked. A value it cannot read
    is argparse's "invalid int value" (or the parse's own words); a value the parse or the range refuses (a
    :class:`SymmergeError`: ``--distill-lr fast``, ``--joint-rounds -1``, ``--method nope``) is argparse's refusal
    too, so that the line names the command and the flag as every other refusal of a command-line value does
    (``symmerge merge: error: argument --distill-lr: must be a positive number, got 'fast' (see ...)``)."""
    parse = option.parse

    def read(text):
        try:
            return option.in_range(parse(text) if parse is not None else text)
        except OptionValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        except SymmergeError as e:
            raise argparse.ArgumentTypeError(_without_flag(option, str(e))) from None

    read.__name__ = getattr(parse, "__name__", "str")
    return read


def _without_flag(option, message: str) -> str:
    """``message`` without the flag that heads it (``--distill-lr must be ...``: ``must be ...``): argparse's line
    names the flag already (``argument --distill-lr: must be ...``)."""
    for flag in option.flags:
        for head in (f"{flag}: ", f"{flag} "):
            if message.startswith(head):
                return message[len(head):]
    return message


def add_option(parser, option) -> None:
    """One option as argparse takes it."""
    kw = {"help": argparse.SUPPRESS if option.hidden else option.help}
    if option.form == "positional":
        if option.nargs:
            kw["nargs"] = option.nargs
        if option.default is not None:
            kw["default"] = option.default
        if option.metavar:
            kw["metavar"] = option.metavar
        parser.add_argument(option.name, **kw)
        return
    if option.form == "const":
        kw.update(action="store_const", const=True)
    elif option.form in ACTIONS:
        kw["action"] = ACTIONS[option.form]
    if option.form in ("value", "append") and (option.parse is not None or option.minimum is not None):
        kw["type"] = _type(option)
    if option.form in ("value", "append") and option.choices is not None:
        kw["choices"] = list(option.choices)
    if option.metavar:
        kw["metavar"] = option.metavar
    if option.required:
        kw["required"] = True
    else:
        kw["default"] = list(option.default) if isinstance(option.default, list) else option.default
    parser.add_argument(*option.flags, dest=option.attr, **kw)


# a comma list of numbers whose first is negative (``--weights -0.5,1.5``: linear extrapolates): argparse's own
# pattern for an argument that is a value although it begins with '-' takes one number only (``-0.5``), and read the
# list as an unknown flag
NUMBER_LIST = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?(,\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)*$")


def add_options(parser, command: str, part=None, skip=()) -> None:
    """Every option of ``command`` in declaration order (``part``: only those of one shared part; ``skip``:
    parts left out). A negative number or a comma list of numbers beginning with one is a value, not a flag (no
    flag of symmerge looks like a number)."""
    for option in TABLE.of(command):
        if (part is None or option.part == part) and option.part not in skip:
            add_option(parser, option)
    parser._negative_number_matcher = NUMBER_LIST  # argparse's own attribute: it has no public setting for it


def add_part(parser, part: str) -> None:
    """The options of one shared part (``lora``, ``progress``, ...), as their first command declares them."""
    seen = set()
    for option in TABLE.options:
        if option.part == part and option.name not in seen:
            seen.add(option.name)
            add_option(parser, option)
