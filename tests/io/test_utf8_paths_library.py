"""A path that is no UTF-8 given to a library entry (``symmerge.merge``, ``align_to_folder``, ``extract_lora``): one
``UsageError`` naming the argument, before any work. The command line refused it before (``_refuse_empty_paths``);
the library merged, then failed writing the report (``UnicodeEncodeError: surrogates not allowed``)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from factories import make_model
from symmerge.errors import UsageError

BAD = os.fsdecode(b"bad\xffname")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("utf8")
    for i in range(2):
        make_model("llama", dtype=torch.float32, seed=i).save_pretrained(str(root / f"m{i}"))
    return root


def _calls(pair, tmp_path):
    import symmerge
    from symmerge.merge.extract_lora import extract_lora

    a, b = str(pair / "m0"), str(pair / "m1")
    return {
        "merge out": (lambda: symmerge.merge([a, b], out=str(tmp_path / BAD), method="linear", align="none"), "out"),
        "merge model": (lambda: symmerge.merge([str(tmp_path / BAD), b], out=str(tmp_path / "o"), method="linear",
                                               align="none"), "models[0]"),
        "align out": (lambda: symmerge.align_to_folder(a, b, tmp_path / BAD), "out"),
        "extract-lora base": (lambda: extract_lora(a, str(tmp_path / BAD), tmp_path / "o"), "base"),
    }


@pytest.mark.parametrize("which", ["merge out", "merge model", "align out", "extract-lora base"])
def test_a_path_that_is_no_utf8_is_one_error_before_any_work(pair, tmp_path, which):
    call, name = _calls(pair, tmp_path)[which]
    with pytest.raises(UsageError, match=rf"^{re.escape(name)} b'.*': the path is not valid UTF-8"):
        call()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no temporary folder
