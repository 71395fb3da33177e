"""``--lora-merge-cache DIR``: a run killed while it builds one entry leaves that entry's temporary folder
(``.<entry>.symmerge-tmp-PID-*``, :func:`symmerge.io.model.atomic_dir`) in DIR. Before, only a later build of that
same entry removed it (``clean_stale`` looks at one output's name); now a later run's clean-up removes the temporary
folders of gone processes whatever entry it builds (``io.output.clean_stale_in``, each judged under its entry's claim,
as ``clean_stale`` judges them), and leaves alone the one of an entry another process is building. Shown to fail
before the fix."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from forked import holder  # noqa: E402
from test_lora import make_adapter, make_base  # noqa: E402

from symmerge.io import checkpoint, lora  # noqa: E402
from symmerge.io.output import TAG  # noqa: E402


@pytest.fixture()
def specs(tmp_path):
    base = make_base(tmp_path / "base")
    return [f"{base}+{make_adapter(base, tmp_path / f'ad{i}', seed=i + 1, r=2, lora_alpha=2, target_modules=['q_proj'])}"
            for i in range(2)]


def _temps(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if TAG in p.name)


def _killed_building(spec: str, cache: Path) -> None:
    """A child that starts building ``spec``'s entry in ``cache`` and dies (``os._exit``: no clean-up) after writing
    its first tensor."""

    def start():
        real = checkpoint.PlannedWriter.add

        def add(self, name, tensor):
            real(self, name, tensor)
            os._exit(0)

        checkpoint.PlannedWriter.add = add
        return lora.resolve_input(spec, cache=cache)

    holder(start, wait=False)


def test_a_killed_build_of_one_entry_is_cleaned_by_the_build_of_another(specs, tmp_path, capsys):
    cache = tmp_path / "cache"
    _killed_building(specs[0], cache)
    left = _temps(cache)
    assert len(left) == 1, left  # the killed child's temporary folder of entry 0
    built = Path(lora.resolve_input(specs[1], cache=cache))
    assert (built / "config.json").is_file()
    assert _temps(cache) == [], _temps(cache)
    assert f"removed {cache / left[0]}" in capsys.readouterr().err
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [built.name]


def test_the_temporary_folder_of_an_entry_being_built_is_left(specs, tmp_path):
    """Another process building entry 0 now (its claim held, inside its writer): building entry 1 leaves its folder."""
    import threading

    cache = tmp_path / "cache"

    def start():  # in the child: a thread builds entry 0 and stays inside its writer until the child ends
        inside = threading.Event()

        def add(self, name, tensor):
            inside.set()
            threading.Event().wait()

        checkpoint.PlannedWriter.add = add
        threading.Thread(target=lora.resolve_input, args=(specs[0],), kwargs={"cache": cache}, daemon=True).start()
        return inside.wait(60)

    said, end = holder(start)
    try:
        assert said == "True"
        live = _temps(cache)
        assert len(live) == 1, live
        lora.resolve_input(specs[1], cache=cache)
        assert _temps(cache) == live
    finally:
        end()
