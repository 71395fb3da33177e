"""benchmarks/learned_scale.py --from-files (issue 42, item 6): a size saved as two safetensors folders and
learned from them layer by layer, the steps counted, the alignment verified, the row's figures consistent; and
the command line's refusal of ``--start none`` without ``--from-files``; ``--command``: the size aligned by
``symmerge align --match learned --stream``, written, verified and removed."""

from __future__ import annotations

import pytest

from benchmarks import learned_scale

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("start", ["activations", "none"])
def test_one_size_from_files_is_measured_and_verified(tmp_path, start):
    learned_scale.save("tiny", str(tmp_path), 32)
    assert (tmp_path / "a" / "config.json").exists() and (tmp_path / "b" / "config.json").exists()
    row = learned_scale.one_from_files("tiny", str(tmp_path), steps=2, texts=8, length=32, batch=4,
                                       precision="float32", start=start, positions=16)
    assert row["parameters"] == 106816 and row["steps"] == 2 and row["from_files"]
    assert row["verify_max_rel_diff"] < 1e-5
    assert row["seconds_per_step"] > 0 and row["closed_form_seconds"] >= 0
    assert row["peak_rss_gb"] >= row["start_peak_rss_gb"] >= row["models_rss_gb"] > 0


def test_start_none_needs_from_files(capsys):
    with pytest.raises(SystemExit):
        learned_scale.main(["--sizes", "tiny", "--start", "none"])
    assert "--from-files" in capsys.readouterr().err


def test_one_size_by_the_command_is_measured_written_and_verified(tmp_path):
    learned_scale.save("tiny", str(tmp_path), 16)
    row = learned_scale.one_command("tiny", str(tmp_path), steps=2, texts=4, length=16, batch=2, precision="float32",
                                    start="weights", positions=0)
    assert row["command"] and row["steps"] == 2 and row["verify_max_rel_diff"] < 1e-5
    assert row["written_gb"] * 1e9 == pytest.approx(row["parameters"] * 4, rel=0.01)  # the model, float32, written
    assert row["write_verify_seconds"] > 0 and row["peak_rss_gb"] >= row["models_rss_gb"] > 0
    assert not (tmp_path / "aligned").exists()  # the output removed after the measurement


def test_command_needs_from_files_and_a_closed_form_start(capsys):
    for argv in (["--command"], ["--command", "--from-files", "--start", "none"]):
        with pytest.raises(SystemExit):
            learned_scale.main(["--sizes", "tiny", *argv])
        assert "--command needs" in capsys.readouterr().err


def test_a_pair_stored_in_bfloat16_is_learned_and_verified_at_its_rounding(tmp_path):
    """``--stored bfloat16``: the pair saved in bfloat16 (half the disk), learned in float32 from the files; the
    verification's tolerance is bfloat16's (the aligned tensors are rounded to it), recorded in the row."""
    from safetensors import safe_open

    learned_scale.save("tiny", str(tmp_path), 32, dtype="bfloat16")
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    row = learned_scale.one_from_files("tiny", str(tmp_path), steps=1, texts=4, length=16, batch=2,
                                       precision="float32", start="weights", positions=8)
    assert row["stored"] == "bfloat16" and row["steps"] == 1
    assert 0 < row["verify_max_rel_diff"] < 1e-2  # bfloat16 rounding (the row allows 5e-2)
