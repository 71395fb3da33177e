"""A report names a ``BASE+ADAPTER`` input as the user wrote it (:mod:`symmerge.io.provenance`): the folder it was
merged into is replaced where it stands as a whole path, never inside a longer name."""

import pytest

from symmerge.io import provenance


@pytest.fixture
def merged(monkeypatch):
    monkeypatch.setattr(provenance, "_written_as", {})
    provenance.remember("/tmp/symmerge-lora-x/base+ad-9ef6", "base+ad")
    return "/tmp/symmerge-lora-x/base+ad-9ef6"


@pytest.mark.parametrize("text, expected", [
    ("{f}", "base+ad"),
    ("{f}/model.safetensors", "base+ad/model.safetensors"),
    ("models: {f}, b", "models: base+ad, b"),
    ("read '{f}'.", "read 'base+ad'."),
    ("merged {f}.", "merged base+ad."),
    ("{f}x", "{f}x"),                    # a longer name that starts with the folder's
    ("{f}-2/a", "{f}-2/a"),
    ("{f}.bak", "{f}.bak"),
    ("/home{f}", "/home{f}"),           # a path that ends with the folder's
    ("x{f}", "x{f}"),
])
def test_the_merged_folder_is_named_as_written_only_as_a_whole_path(merged, text, expected):
    report = {"models": [text.format(f=merged)], "note": {"k": text.format(f=merged)}}
    out = provenance.stamp(report)
    assert out["models"] == [expected.format(f=merged)]
    assert out["note"]["k"] == expected.format(f=merged)
