"""How an option's text becomes its value, for the options whose value is more than a number or a word: the
same functions read a flag and a config key (:mod:`symmerge.options.declared`) and build the options objects
(:mod:`symmerge.options.build`)."""

from __future__ import annotations

from ..errors import SymmergeError
from .schema import OptionValueError


def concentration(text: str):
    """``--learn-dirichlet``: a number, ``auto``, or ``uniform`` (``inf`` reads the same: every step at the plain
    average); a number's range (> 0) is :class:`~symmerge.pipeline.options.LearnSettings`' check."""
    from ..pipeline.options import DIRICHLET_AUTO, DIRICHLET_UNIFORM

    if text in (DIRICHLET_AUTO, DIRICHLET_UNIFORM):
        return text
    try:
        value = float(text)
    except ValueError:
        raise OptionValueError(f"expected a number, 'auto' or 'uniform', got {text!r}") from None
    return DIRICHLET_UNIFORM if value == float("inf") else value


def distill_steps(text):
    """``--distill STEPS``: a whole number of steps >= 0 (0: none), refused in one line naming the flag (the API's
    check, :func:`symmerge.pipeline.distill.check_steps`)."""
    from ..pipeline.distill import check_steps

    return check_steps(int(text) if isinstance(text, str) and text.strip().lstrip("+-").isdigit() else text)


def distill_lr(text):
    """``--distill-lr LR``: a positive number (the API's check, :func:`symmerge.pipeline.distill.check_lr`)."""
    from ..pipeline.distill import check_lr

    return check_lr(text)


def positive(text) -> float:
    """``--ends-weight``, ``--depth-decay``: a finite number > 0 (the API's range,
    :class:`~symmerge.pipeline.options.AlignOptions`)."""
    import math

    try:
        value = float(text)
    except (TypeError, ValueError):
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise OptionValueError(f"must be a finite number > 0, got {text!r}")
    return value


def mergekit_size(text):
    """mergekit's ``--out-shard-size`` (``5B``: 5e9 bytes; K, M, B suffixes) or symmerge's (``2GB``); None: 5GB,
    mergekit's default."""
    if text is None:
        return "5GB"
    t = str(text).strip().upper()
    for suffix, mult in (("K", 10 ** 3), ("M", 10 ** 6), ("B", 10 ** 9)):
        if t.endswith(suffix) and t[:-1].replace(".", "", 1).isdigit():
            return str(int(float(t[:-1]) * mult))
    return text


def _kept(check, name: str):
    """A flag's reader that refuses what ``check`` refuses and keeps the text (the option's value stays the text its
    users read): the refusal is argparse's line naming the command and the flag, and a config key's line."""
    def read(text):
        check(text)
        return text

    read.__name__ = name
    return read


def _device(text):
    from ..device import resolve_device

    resolve_device(text)


def _symmetries(text):
    from ..pipeline.options import parse_symmetries

    parse_symmetries(text)


def _channels(text):
    from ..merge.repair import parse_channels

    parse_channels(text)


def _size(text):
    from ..io.checkpoint import parse_size

    parse_size(text)


def _method(text):
    from ..merge.registry import get_method

    get_method(text)  # an unknown name: its one line, with the close name


def _lora_dtype(text):
    from ..io.lora import parse_dtype

    parse_dtype(text)


# the readers of the options whose value is text checked for its form before any work (their refusals were the
# commands' own ``symmerge: error:`` lines, after parsing: ``--weights x``, ``--device bogus``...)
device_name = _kept(_device, "device")  # cpu, cuda, cuda:N or auto, a GPU there for cuda
symmetry_list = _kept(_symmetries, "symmetries")
weight_list = _kept(lambda text: parse_weights(text), "weights")
param_item = _kept(lambda text: parse_params([text]), "KEY=VALUE")
layer_list = _kept(lambda text: parse_layers(text), "layers")
channel_list = _kept(_channels, "channels")
size_text = _kept(_size, "size")
mergekit_size_text = _kept(lambda text: _size(mergekit_size(text)), "size")
lora_dtype = _kept(_lora_dtype, "dtype")
method_name = _kept(_method, "method")  # --method NAME: a method of the registry (a config's method key: its line)


def parse_value(text: str):
    """A method parameter's value: true/false, an int, a float, a comma list of numbers (one value per model:
    ``density=0.7,0.4``, as a config's list), else the text (``units=ffn,attn`` stays one value)."""
    if "," in text:
        parts = [parse_value(p) for p in text.split(",")]
        numbers = all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parts)
        return parts if numbers else text
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_params(items) -> dict:
    """``--param KEY=VALUE`` (repeated) → {key: value}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SymmergeError(f"--param expects KEY=VALUE, got {item!r}")
        out[key.strip()] = parse_value(value)
    return out


def parse_weights(text):
    """``--weights 0.7,0.3`` → [0.7, 0.3] (None: not given)."""
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise SymmergeError(f"--weights expects comma-separated numbers, got {text!r}") from None


def parse_anchor(text, models=()):
    """``--anchor``: a model's index, or a folder. A number that also names a folder is one error unless it is that
    model's folder (``--anchor 2`` beside a folder ``2``: write ``./2`` for the folder)."""
    from pathlib import Path

    if text is None:
        return None
    try:
        index = int(text)
    except ValueError:
        return text
    folder = Path(text).expanduser()
    if folder.is_dir() and not (0 <= index < len(models) and Path(models[index]).expanduser().resolve()
                                == folder.resolve()):
        model = f"model {index} ({models[index]})" if 0 <= index < len(models) else f"model index {index}"
        raise SymmergeError(f"--anchor {text} reads as both {model} and the folder {text!r}: write ./{text} for the "
                            "folder, or rename it")
    return index


def parse_layers(value):
    """``--layers 0,1,5`` → [0, 1, 5] (None: every layer)."""
    if value is None:
        return None
    try:
        layers = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise SymmergeError(f"--layers expects comma-separated integers, got {value!r}") from None
    if not layers:  # an empty shell variable: no layer would be aligned, and the output an unaligned copy
        raise SymmergeError(f"--layers expects comma-separated integers, got {value!r} (no layer; leave --layers out "
                            "to align every layer)")
    twice = sorted({i for i in layers if layers.count(i) > 1})
    if twice:
        raise SymmergeError(f"--layers {value}: layer {twice[0]} is named twice; give each layer once")
    return layers
