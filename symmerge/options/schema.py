"""The record every command-line option and config key is generated from: one :class:`Option` per option
(its name — the config key and the parsed attribute —, its flag spellings, how a value is read from text, its
choices and range, its default, its help text, which commands have it). The declarations are in
:mod:`symmerge.options.declared`; ``symmerge/commands/schema_args.py`` turns them into argparse arguments and
:mod:`symmerge.config.schema` into config keys, so that a flag and its key read and check a value the same way
(one function, :meth:`Option.read`), with the same error text.

No argparse here: a value the option cannot read raises :class:`OptionValueError` (the command line shows it
as argparse shows a bad value, a config names the key and its line); a value outside the option's range
raises :class:`~symmerge.errors.SymmergeError` with the flag's name, the same line from either side."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..option_ranges import SEEDS, in_range, seed as check_seed

# how an option takes its value: one value; a switch (present: True); a switch whose absence is None (present:
# True); a repeatable value (a list); a switch with a --no- twin; a counted flag (-v -v); a positional argument
FORMS = ("value", "switch", "const", "append", "onoff", "count", "positional")


class OptionValueError(ValueError):
    """A value an option cannot read (not a number, not one of its choices): argparse's "invalid value"."""


@dataclass(frozen=True)
class Option:
    """One option of one or more commands. ``name``: the config key and the attribute of the parsed
    arguments (``align_data`` for ``--align-data``); ``flags``: its spellings on the command line (none for a
    positional argument); ``form``: one of :data:`FORMS`; ``parse``: text → value (None: the text itself);
    ``choices``; ``minimum``/``maximum``: the smallest/largest value accepted (None: no bound; an option named in
    :data:`~symmerge.option_ranges.SEEDS` is a seed, 0 … 2**64 − 1); ``default``; ``required``;
    ``help``; ``metavar``; ``nargs`` (positionals: ``+`` or ``?``); ``commands``: the commands that have it;
    ``joins``: a YAML list given for it is joined with commas (a comma list on the command line);
    ``part``: the shared part it belongs to
    (``alignment``, ``repair``, ``lora``, ``progress``: added together by the commands that have them);
    ``learn``: the :class:`~symmerge.pipeline.options.LearnSettings` field it sets; ``hidden``: accepted but not
    shown by ``--help`` (mergekit's spellings that change nothing)."""

    name: str
    flags: tuple = ()
    form: str = "value"
    parse: object = None
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    default: object = None
    required: bool = False
    help: str | None = None
    metavar: str | None = None
    nargs: str | None = None
    commands: frozenset = frozenset()
    joins: bool = False
    part: str | None = None
    learn: str | None = None
    hidden: bool = False  # accepted, left out of --help

    def __post_init__(self):
        if self.form not in FORMS:  # pragma: no cover - a declaration's mistake
            raise ValueError(f"option {self.name}: unknown form {self.form!r}")
        object.__setattr__(self, "commands", frozenset(self.commands))

    @property
    def attr(self) -> str:
        """The attribute of the parsed arguments the option sets (``-v``: ``verbose``)."""
        return self.name

    @property
    def flag(self) -> str:
        """The long spelling (``--joint-rounds``), or the name of a positional argument."""
        return next((f for f in self.flags if f.startswith("--")), self.flags[0] if self.flags else self.name)

    @property
    def takes_value(self) -> bool:
        return self.form in ("value", "append", "positional")

    def read(self, text: str):
        """One value from its text, as the flag reads it: converted (:class:`OptionValueError` when it cannot
        be), its choices and its range checked (a value out of range: :meth:`in_range`)."""
        try:
            value = self.parse(text) if self.parse is not None else text
        except OptionValueError:
            raise
        except (TypeError, ValueError) as e:
            raise OptionValueError(f"invalid value {text!r} ({e})") from None
        if self.choices is not None and value not in self.choices:
            choices = ", ".join(repr(c) for c in self.choices)
            raise OptionValueError(f"invalid choice: {value!r} (choose from {choices})")
        return self.in_range(value)

    def in_range(self, value):
        """``value``, or one :class:`SymmergeError` naming the flag when it is below the option's minimum (the
        same text from a flag, a config key and the command line a config stands for)."""
        if self.name in SEEDS and value is not None:
            return check_seed(self.flag, value)
        return in_range(self.flag, self.minimum, value, self.maximum)


@dataclass(frozen=True)
class Table:
    """The options of every command, in the order their help shows them."""

    options: tuple = field(default_factory=tuple)

    def of(self, command: str) -> list[Option]:
        return [o for o in self.options if command in o.commands]

    def get(self, command: str, name: str) -> Option | None:
        """The option of ``command`` named ``name`` (its config key), or None."""
        return next((o for o in self.of(command) if o.name == name), None)

    def names(self, command: str) -> tuple:
        """The config keys of ``command``'s options (its positional arguments aside)."""
        return tuple(sorted(o.name for o in self.of(command) if o.form != "positional"))

    def defaults(self, command: str) -> dict:
        """attribute → default of every option of ``command`` (what the command line sets when not given)."""
        return {o.attr: (list(o.default) if isinstance(o.default, list) else o.default) for o in self.of(command)}
