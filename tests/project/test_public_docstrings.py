"""Every public name (``symmerge.__all__``) says what it is and, when called, what it takes and returns: a docstring
of its own (``help(symmerge.merge)`` shows the library entry first, not only the methods' registry)."""

from __future__ import annotations

import inspect

import symmerge


def test_every_public_name_has_a_docstring_of_its_own():
    missing = [n for n in symmerge.__all__ if n != "SPECS" and not (getattr(symmerge, n).__doc__ or "").strip()]
    assert missing == []


def test_the_merge_entry_documents_its_call_first():
    doc = inspect.getdoc(symmerge.merge)
    assert doc.startswith("``symmerge.merge(models, out, options=None, **keywords) -> report``")
    assert "MergeOptions" in doc.split("\n\n")[0]


def test_the_family_lookups_say_what_they_return():
    assert "model_type" in symmerge.spec_for.__doc__ and "SymmergeError" in symmerge.spec_for.__doc__
    assert "model_type" in symmerge.supported_model_types.__doc__
