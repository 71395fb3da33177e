"""Command-line entry point: ``symmerge <command> ...``. Each command lives in symmerge/commands/.

The entry point imports nothing heavy before it is guarded: a Ctrl-C while torch and transformers are
being imported (the first seconds) ends with one line, as a Ctrl-C later does (exit 130); a closed
stdout (``symmerge specs | head -1``) ends quietly with exit 141, as other command-line tools do; a
user's mistake (:class:`~symmerge.errors.SymmergeError`) is one ``symmerge: error:`` line, exit 2.
(The package's own ``__init__`` guards its imports the same way when it runs as this command:
``symmerge._entry``.)"""

from __future__ import annotations

import os
import sys

from ._version import __version__
from .options.paths import PATHS, expand_home
from .errors import SymmergeError, did_you_mean

# command name -> module in symmerge.commands defining add_arguments(parser) and run(args)
COMMANDS = {
    "align": "align",
    "barrier": "barrier",
    "demo": "demo",
    "extract-lora": "extract_lora",
    "merge": "merge",
    "moe": "moe",
    "run": "run",
    "specs": "specs",
}

INTERRUPTED, BROKEN_PIPE = 130, 141


def _one_line_parser():
    """The class of every parser of the command line: argparse's own, whose refusal (an unknown flag, a bad choice,
    a bad number, a missing argument, an unknown command) is one stderr line, ``symmerge COMMAND: error: MESSAGE
    (see symmerge COMMAND --help)``, exit 2, instead of the command's whole usage block and then the line; a bad
    choice close to a known one gets its did-you-mean. A command's unknown flags are named first, with a close
    known one (``merge --metod x``: ``unrecognized arguments: --metod (did you mean --method?)``, not the
    ``--method`` it leaves missing). ``--help`` is argparse's, unchanged."""
    import argparse

    class OneLineParser(argparse.ArgumentParser):
        def parse_known_args(self, args=None, namespace=None):
            self.given_args = list(sys.argv[1:] if args is None else args)  # a command's: those after its name
            return super().parse_known_args(args, namespace)

        def error(self, message):
            command = self.prog.partition(" ")[2]
            if command and not message.startswith("unrecognized arguments"):
                unknown = _unknown_flags(command, getattr(self, "given_args", ()), self.allow_abbrev)
                if unknown:
                    message = (f"unrecognized arguments: {' '.join(unknown)}{_close_flag(command, unknown)}"
                               f"{_dash_hint(unknown)}")
            self.exit(2, f"{self.prog}: error: {one_line(message)}{_close_choice(self.prog, message)} "
                         f"(see {self.prog} --help)\n")

    return OneLineParser


def _flags(command: str) -> list[str]:
    """Every flag ``command`` takes, as its declarations (:mod:`symmerge.options.declared`) make them: their
    spellings, the ``--no-`` twin of an on/off switch, ``-h``/``--help``."""
    from .options.declared import TABLE

    flags = ["-h", "--help"]
    for option in TABLE.of(command):
        flags += option.flags
        if option.form == "onoff":
            flags += [f"--no-{f[2:]}" for f in option.flags if f.startswith("--")]
    return flags


def _unknown_flags(command: str, args, abbreviations: bool = True) -> list[str]:
    """The ``--flags`` of ``args`` that ``command`` does not take (nor abbreviates, when argparse takes a unique
    prefix: ``abbreviations``); the arguments after a ``--`` are positional."""
    known, unknown = _flags(command), []
    for arg in args:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and not any(
                k == name or (abbreviations and k.startswith(name)) for k in known):
            unknown.append(arg)
        elif _dash_name(arg, known):
            unknown.append(arg)
    return unknown


def _dash_name(arg: str, known) -> bool:
    """``arg`` is a name beginning with one ``-`` that is no short flag (``-lead``, a folder's name), nor a number."""
    if not arg.startswith("-") or arg.startswith("--") or len(arg) < 3 or arg[:2] in known:
        return False
    try:
        float(arg)
    except ValueError:
        return True
    return False


def _dash_hint(unknown) -> str:
    """For a name beginning with ``-`` (argparse reads it as a flag, then missed the model it is): how to give it."""
    name = next((u for u in unknown if u.startswith("-") and not u.startswith("--") and len(u) > 2), None)
    return "" if name is None else f" (a path that begins with '-': write ./{name}, or give it after --)"


def _close_choice(prog: str, message: str) -> str:
    """`` (did you mean 'merge'?)`` after argparse's "invalid choice" of a command (``prog`` ``symmerge``) or of a
    flag's value (``prog`` ``symmerge COMMAND``: the choices its declaration lists), else ``''``."""
    import re

    from .options.declared import TABLE

    bad = re.match(r"argument (\S+): invalid choice: '([^']*)'", message)
    if not bad:
        return ""
    command, names = prog.partition(" ")[2], set(bad.group(1).split("/"))
    if not command:
        choices = COMMANDS if "COMMAND" in names else ()
    else:
        choices = next((o.choices for o in TABLE.of(command) if names & set(o.flags) and o.choices), ())
    return did_you_mean(bad.group(2), choices) if choices else ""


def plain_text(doc: str) -> str:
    """A command module's text as ``--help`` shows it: the reStructuredText markup of its source (double
    backquotes, ``:mod:`` and ``:func:`` roles) left out, the words kept."""
    import re

    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    return re.sub(r"``([^`]+)``", r"\1", text)


def build_parser():
    import argparse
    import importlib

    parser = _one_line_parser()(prog="symmerge", description="Symmetry-aware fusion of transformer models.")
    parser.add_argument("--version", action="version", version=f"symmerge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")  # its parsers: the same class
    parser.set_defaults(subparsers=sub.choices)  # a command's own parser: its name on a bad argument
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"symmerge.commands.{module_name}")
        text = plain_text(module.__doc__)
        p = sub.add_parser(name, help=text.strip().splitlines()[0], description=text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(handler=module.run, memory_way_out=getattr(module, "memory_way_out", None)
                       or getattr(module, "MEMORY_WAY_OUT", ""))
    return parser


def _quiet(args) -> None:
    """``-q`` / ``--quiet`` of every command: ``--progress none`` (with another ``--progress`` given, one error:
    which of the two was meant is not clear); run and moe read their mergekit ``--quiet`` themselves (beside
    mergekit's ``-v``), after the same check."""
    if getattr(args, "quiet", False) is True:
        if getattr(args, "progress", "auto") not in ("auto", "none"):
            args.subparsers[args.command].error(f"--quiet and --progress {args.progress}: give one")
        if args.command not in ("run", "moe"):
            args.progress = "none"


def _run(argv) -> int:
    from ._entry import guarded_imports
    from .progress import configure

    with guarded_imports():  # the commands' modules (the package's names are lazy): guarded as the package's imports
        parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # an argument the command does not take: the command's own name, not the top level's
        args.subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}"
                                            f"{_close_flag(args.command, extra)}{_dash_hint(extra)}")
    args = expand_home(args, args.command)  # a quoted ~ is the home folder (symmerge.options.paths)
    _refuse_empty_paths(args)
    from .core.parallel import threads_kept
    from .io.hf import trust_remote_code
    from .progress import kept

    _quiet(args)
    with kept():  # the caller's progress setting back after the command (main run in a caller's process)
        configure(getattr(args, "progress", "auto"))  # also starts the clock of progress lines and final timings
        with trust_remote_code(getattr(args, "trust_remote_code", False)), \
                threads_kept():  # the caller's thread count back after --num-threads (run, moe, extract-lora)
            code = _handled(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the guard, not at the interpreter's exit
    return code


def linalg_fault(e: BaseException) -> str | None:
    """The one line of torch's linear-algebra error (an SVD, eigendecomposition or solve that did not converge:
    seen on finite weights near float32's range, whose products overflow the alignment's costs), or None."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(e, torch.linalg.LinAlgError):
        return None
    detail = str(e).split(":")[0].strip() or type(e).__name__
    return (f"a linear-algebra solve failed on these weights ({detail} did not converge): an input's values are too "
            "large or too ill-conditioned for float32 (look for values near 1e30 or beyond in the checkpoints), or "
            "leave out what solves them (--align none, --symmetries none); nothing was written")


def _handled(args) -> int:
    """The command run; running out of memory (:func:`~symmerge.io.output.memory_fault`: Python's, numpy's, torch's
    allocators) is one :class:`~symmerge.errors.OutOfMemory` line naming what was asked for and the command's way out
    (its module's ``memory_way_out(args)`` or ``MEMORY_WAY_OUT``), raised after the command's own cleanup ran (its
    temporary folders, in the ``finally`` blocks the error passed through). A library error raised while the memory
    fault was handled (an input's mapping refused read as "truncated or corrupt") is that memory fault."""
    from .errors import OutOfMemory
    from .io.output import memory_fault

    try:
        return args.handler(args) or 0
    except OutOfMemory:
        raise
    except Exception as e:  # a SymmergeError too: one raised while a memory fault was handled ("corrupt file")
        words = memory_fault(e)
        if words is None:
            raise
        way_out = args.memory_way_out(args) if callable(args.memory_way_out) else args.memory_way_out
        raise OutOfMemory(f"{words}; nothing was written{f'; {way_out}' if way_out else ''}") from None


def _refuse_empty_paths(args) -> None:
    """One error for an empty path (``-o ""`` from an empty shell variable), for a path that is no UTF-8 (the file
    system takes any bytes, but the reports and model cards that name it are UTF-8 text and safetensors opens UTF-8
    paths only: it was a traceback after the work), and for the current folder as the output (``-o .``: the written
    folder is renamed into the output's place; ``demo`` writes its two files into a folder)."""
    from .io.arguments import utf8_path
    from .options.declared import TABLE

    for option in TABLE.of(args.command):
        value = getattr(args, option.attr, None) if option.attr in PATHS else None
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            raise SymmergeError(f"{option.flag}: an empty path ({value!r})")
        bad = next((v for v in values if isinstance(v, str) and not utf8_path(v)), None)
        if bad is not None:
            raise SymmergeError(f"{option.flag} {os.fsencode(bad)!r}: the path is not valid UTF-8 (symmerge names its "
                                "inputs and output in UTF-8 reports and model cards): rename it")
        if option.attr in ("output", "out") and args.command != "demo" and isinstance(value, str) and _is_cwd(value):
            raise SymmergeError(f"{option.flag} {value}: the current folder cannot be the output (the written folder "
                                "takes the output's place): give a new folder, e.g. -o merged")


def _is_cwd(path: str) -> bool:
    try:
        return os.path.samefile(path, os.getcwd())
    except OSError:
        return False


def _close_flag(command: str, extra) -> str:
    """`` (did you mean --symmetries?)`` for the first flag of ``extra`` close to one ``command`` takes, else ``''``."""
    flags = [f for f in _flags(command) if f.startswith("--")]
    for arg in extra:
        close = did_you_mean(arg.split("=")[0], flags, quoted=False) if arg.startswith("--") else ""
        if close:
            return close
    return ""


def one_line(message) -> str:
    """``message`` on one line: a message that quotes another library's (transformers' several-line ones) keeps
    its words, its lines joined by a space, so that an error is always the one ``symmerge: error:`` line."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass


def _one_line_warnings():
    """A warning the library raises with :func:`warnings.warn` (the descent's cap) shown on the command line as every
    other warning of it, one ``symmerge: warning:`` line (Python's form adds the source file and its code line);
    other packages' warnings as Python shows them. Returns the ``showwarning`` to put back."""
    import warnings

    shown = warnings.showwarning
    package = os.path.dirname(os.path.abspath(__file__))

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(str(filename)).startswith(package + os.sep):
            print(f"symmerge: warning: {one_line(message)}", file=sys.stderr if file is None else file)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return shown


def main(argv=None) -> int:
    from ._entry import Terminated, interrupted_line, restore_interrupts, was_interrupted, watch_interrupts
    from .io.output import describe_fault, os_fault, release_claims
    from .io.provenance import COMMAND_LINE

    handlers = watch_interrupts()  # put back when the command ends (main in a caller's process)
    line = COMMAND_LINE.set(["symmerge", *(sys.argv[1:] if argv is None else [str(a) for a in argv])])
    shown = _one_line_warnings()
    try:
        return _run(argv)
    except SymmergeError as e:
        if was_interrupted():
            print("symmerge: interrupted", file=sys.stderr)
            return INTERRUPTED
        print(f"symmerge: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Terminated as e:  # SIGTERM, SIGHUP: cleaned up as a Ctrl-C is
        print(interrupted_line(e.signum), file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("symmerge: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE
    except Exception as e:
        if was_interrupted():  # a lazy import the Ctrl-C cut in half, failing as another error
            print("symmerge: interrupted", file=sys.stderr)
            return INTERRUPTED
        words = linalg_fault(e)  # a solver that did not converge on the weights given: one line, not torch's trace
        if words is not None:
            print(f"symmerge: error: {one_line(words)}", file=sys.stderr)
            return 2
        fault = os_fault(e)  # the operating system's refusal (a full disk, a permission...): one line
        if fault is None:
            raise
        name = getattr(fault, "filename", None)
        print(f"symmerge: error: {one_line(f'{name}: {describe_fault(fault)}' if name else describe_fault(fault))}",
              file=sys.stderr)
        return 2
    finally:
        release_claims()  # the output's claim, if the run ended before writing it
        COMMAND_LINE.reset(line)
        import warnings

        warnings.showwarning = shown
        restore_interrupts(handlers)


if __name__ == "__main__":
    sys.exit(main())
