"""``symmerge.cli.main([...])`` called inside someone else's process (a notebook, a service, a training script)
leaves that process as it found it: its signal handlers, its torch thread count
(benchmarks/procstate_audit.py, docs/results/procstate_audit.md)."""

from __future__ import annotations

import signal

import pytest
import torch
import yaml

from conftest import run_cli, save_folder
from factories import make_model

SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


def _handlers() -> dict:
    return {s: signal.getsignal(s) for s in SIGNALS}


@pytest.mark.parametrize("argv", [["specs"], ["align", "/nonexistent/a", "/nonexistent/b", "-o", "/nonexistent/o"]],
                         ids=["ok", "error"])
def test_main_puts_the_callers_signal_handlers_back(argv, capsys):
    """The command turns SIGTERM and SIGHUP into a clean-up and an exit line while it runs; after it, a SIGTERM to the
    caller's process (a service's) ends it as it did before (the handlers stayed symmerge's: a later SIGTERM raised
    ``Terminated`` inside the caller's code), and a host's own handler is untouched."""
    saved = _handlers()
    try:
        for s in SIGNALS:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        before = _handlers()
        run_cli(*argv)
        assert _handlers() == before

        def host(signum, frame):  # a host's own handler: kept during the command and after it
            pass

        signal.signal(signal.SIGTERM, host)
        run_cli(*argv)
        assert signal.getsignal(signal.SIGTERM) is host
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    capsys.readouterr()


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    base = save_folder(make_model("llama", head=True, seed=0), root / "base")
    ft = save_folder(make_model("llama", head=True, seed=1), root / "ft")
    config = root / "run.yml"
    config.write_text(yaml.safe_dump({"models": [{"model": str(ft), "parameters": {"weight": 0.5}},
                                                 {"model": str(base), "parameters": {"weight": 0.5}}],
                                      "merge_method": "linear", "dtype": "float32"}))
    moe = root / "moe.yml"
    moe.write_text(yaml.safe_dump({"base_model": str(base), "gate_mode": "random", "dtype": "float32",
                                   "experts": [{"source_model": str(ft), "positive_prompts": ["a"]},
                                               {"source_model": str(base), "positive_prompts": ["b"]}]}))
    return {"base": base, "ft": ft, "run": config, "moe": moe}


@pytest.mark.parametrize("command", ["run", "moe", "extract-lora"])
def test_num_threads_is_the_commands_not_the_callers(llamas, command, tmp_path, capsys):
    """mergekit's ``--num-threads N`` (run, moe, extract-lora) sets torch's threads for the command; the caller's
    count is back after it (it stayed N for the rest of the caller's process, every later torch op included)."""
    argv = {"run": [llamas["run"], tmp_path / "o", "--quiet"], "moe": [llamas["moe"], tmp_path / "o", "--quiet"],
            "extract-lora": [llamas["ft"], llamas["base"], "-o", tmp_path / "o", "--rank", "2", "-q"]}[command]
    caller = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert run_cli(command, *argv, "--num-threads", "2") == 0, capsys.readouterr().err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(caller)
