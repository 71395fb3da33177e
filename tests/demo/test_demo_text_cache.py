"""Issue 35 leftover: the text demo's cache folders follow the output convention of symmerge.io.output."""

from __future__ import annotations


def test_the_text_demo_cache_uses_the_output_convention(tmp_path, capsys):
    """symmerge/demo/text.py's cache folders: built in ``.<name>.symmerge-tmp-<pid>-*``, a stale one (its process
    gone) removed with one note, the published folder given the umask's permissions."""
    import os

    from symmerge.demo.text import cache_entry
    from symmerge.io.output import current_umask

    out = tmp_path / "splits" / "abc"
    stale = tmp_path / "splits" / ".abc.symmerge-tmp-999999999-xyz"
    stale.mkdir(parents=True)
    with cache_entry(out) as tmp:
        assert tmp.name.startswith(f".abc.symmerge-tmp-{os.getpid()}-")
        (tmp / "manifest.json").write_text("{}")
    assert not stale.exists() and "removed" in capsys.readouterr().err
    assert (out / "manifest.json").is_file() and sorted(p.name for p in out.parent.iterdir()) == ["abc"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~current_umask()
