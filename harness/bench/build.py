"""How the EPP a benchmark measures was built: which of its modules run compiled (a release build) and which as
Python source, for the reports' header lines."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import pkgutil

import epp


def summary() -> str:
    """'pure Python' or 'compiled: N of M modules', from where each module of `epp` would be imported from."""
    names = [info.name for info in pkgutil.walk_packages(epp.__path__, "epp.")]
    extensions = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    compiled = [name for name in names if (importlib.util.find_spec(name).origin or "").endswith(extensions)]
    return f"compiled: {len(compiled)} of {len(names)} modules" if compiled else "pure Python"
