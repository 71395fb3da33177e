"""``benchmarks/bench_keeps_models.py`` measures what it says: a row per size with positive seconds, and the note +
restore it times leaves the model's tensors the very ones it had."""

from benchmarks import bench_keeps_models as bench


def test_a_tiny_row_is_measured_and_printed(capsys):
    row = bench.measured("tiny", repeat=2, batch=1, tokens=4)
    assert row["params"] > 0 and row["kept_s"] > 0 and row["forward_s"] > 0
    assert row["ratio"] == row["kept_s"] / row["forward_s"]
    assert bench.main(["--sizes", "tiny", "--repeat", "2", "--tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].split()[0] == "tiny" and len(lines[-1].split()) == 5
