"""``symmerge run --no-write-model-card`` holds for every card the command writes: a config of symmerge's own keys
runs ``merge`` or ``align`` (docs/configs.md), whose writers each wrote their README.md whatever the flag said;
a mergekit config's merge writes none either (as mergekit-yaml's flag). ``symmerge_report.json`` is always
written; without the flag the card and the config's copy are there."""

from __future__ import annotations

import pytest

from conftest import run_cli, save_folder
from factories import make_model

CONFIGS = {  # the config's keys after its models: each a writer of its own
    "merge-memory": "method: average\nalign: [attn, ffn]\nmode: memory\n",
    "merge-stream": "method: average\nalign: none\nmode: stream\n",
    "align-memory": "command: align\n",
    "align-stream": "command: align\nstream: true\n",
    "mergekit": "merge_method: linear\nparameters: {weight: 0.5}\ndtype: float32\n",
}
COPY = {"mergekit": "mergekit_config.yml"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    return [save_folder(make_model("llama", head=True, seed=s), root / f"m{s}") for s in (0, 1)]


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("card", [True, False], ids=["default", "no-card"])
def test_the_flag_holds_for_every_card_the_command_writes(models, tmp_path, capsys, kind, card):
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"models: [{models[0]}, {models[1]}]\n{CONFIGS[kind]}")
    out = tmp_path / "out"
    flags = [] if card else ["--no-write-model-card"]
    assert run_cli("run", cfg, out, "--progress", "none", *flags) == 0, capsys.readouterr().err
    names = {p.name for p in out.iterdir()}
    assert "symmerge_report.json" in names and any(n.endswith(".safetensors") for n in names), names
    assert ("README.md" in names) == card, names
    assert (COPY.get(kind, "symmerge_config.yml") in names) == card, names
