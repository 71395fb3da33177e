"""``align_data`` given to the Python API with a data-free matcher and nothing else that reads it (REPAIR,
distillation, temperature calibration) was dropped in silence, where ``--align-data`` with ``--match weights`` is
one error; the API now says the same, before any model is read. With a reader it is taken."""

from __future__ import annotations

import pytest
from conftest import npz_file, vit_folder


def test_align_refuses_data_nothing_reads(tmp_path):
    from symmerge.errors import UsageError
    from symmerge.io.model import load_model
    from symmerge.pipeline.align import align

    models = [load_model(str(vit_folder(tmp_path / f"v{s}", s)), spec=False) for s in range(2)]
    npz = npz_file(tmp_path / "d.npz", n=8)
    with pytest.raises(UsageError, match=r"align_data: nothing reads it with match='weights'"):
        align(models[0], models[1], align_data=str(npz))
    aligned, report = align(models[0], models[1], symmetries="attn", align_data=str(npz), match="activations")
    assert report["match"] == "activations"


def test_merge_models_refuses_it_unless_repair_reads_it(tmp_path):
    from symmerge.errors import UsageError
    from symmerge.merge.fuse import merge_models
    from symmerge.pipeline.options import AlignOptions

    folders = [str(vit_folder(tmp_path / f"v{s}", s)) for s in range(2)]
    npz = str(npz_file(tmp_path / "d.npz", n=8))
    with pytest.raises(UsageError, match="align_data: nothing reads it"):
        merge_models(folders, align=AlignOptions(symmetries="attn", align_data=npz), progress=False)
    _, report = merge_models(folders, align=AlignOptions(symmetries="attn", align_data=npz), repair=True,
                             progress=False)
    assert report["repair"] is not None


def test_barrier_refuses_it_unless_temperature_reads_it(tmp_path):
    from symmerge.errors import UsageError
    from symmerge.merge.barrier import barrier_study
    from symmerge.pipeline.options import AlignOptions

    a, b = (str(vit_folder(tmp_path / f"v{s}", s)) for s in range(2))
    npz = str(npz_file(tmp_path / "d.npz", n=8))
    with pytest.raises(UsageError, match="align_data: nothing reads it"):
        barrier_study(a, b, npz, aligns=["attn"], align=AlignOptions(align_data=npz), points=3, progress=False)
    res = barrier_study(a, b, npz, aligns=["attn"], align=AlignOptions(align_data=npz), temperature=True, points=3,
                        progress=False)
    assert res["curves"]
