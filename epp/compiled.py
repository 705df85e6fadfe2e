"""Which of the EPP's modules run compiled, and a guard that never lets a compiled module shadow newer source.

setup.py compiles the request path with Cython when it can and writes `compiled.json` beside the extensions: each
compiled module's name and the SHA-256 of the source it was compiled from. Python's own import system prefers an
extension to a .py file of the same name, so after an edit to an editable install the old extension would run the
old code. `install()` (called by the package's __init__) puts a finder first on `sys.meta_path` that loads a module
from its source when

* its extension is not in the stamp or the stamp's digest differs from the source's (edited since the build; the
  digest covers a .pxd beside the source too, and the modules it cimports from),
* or EPP_PURE_PYTHON is set (profilers such as py-spy see into Python functions only; compiled ones are one frame);

and refuses a stamped module whose source is gone (removed since the build, its extension left behind).

It costs one source read and digest per compiled module at import, nothing afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import sys
from pathlib import Path
from types import ModuleType

STAMP = Path(__file__).with_name("compiled.json")
# after a profile-guided build's step (setup.py's EPP_PGO, epp/bench/pgo.py): {"instrumented": [modules]} or
# {"profile_guided": [modules]}
PGO_STAMP = Path(__file__).with_name("compiled-pgo.json")
EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)

log = logging.getLogger("epp.compiled")


class SourceGuard(importlib.abc.MetaPathFinder):
    """Finds the modules of `package` as the path finder does, but a compiled one whose source is not the one in
    `digests` (or every compiled one, with `pure`) from its source."""

    def __init__(self, package: str, digests: dict[str, str], pure: bool):
        self.prefix = package + "."
        self.digests = digests
        self.pure = pure
        self.from_source: list[str] = []  # the compiled modules it loaded from source

    def find_spec(self, name: str, path=None, target: ModuleType | None = None):
        if not name.startswith(self.prefix):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.origin is None or not spec.origin.endswith(EXTENSION_SUFFIXES):
            return spec
        suffix = next(s for s in EXTENSION_SUFFIXES if spec.origin.endswith(s))
        source = Path(spec.origin.removesuffix(suffix) + ".py")
        if not source.is_file():
            if name in self.digests:  # the module was removed, its extension left behind (editable installs)
                raise ModuleNotFoundError(f"{name} has no source any more; its old extension is not loaded", name=name)
            return spec  # an extension of its own (no source beside it)
        if not self.pure and self.digests.get(name) == digest(source):
            return spec
        self.from_source.append(name)
        if not self.pure:
            log.warning("%s changed since it was compiled: running its source (`make compile` compiles it again)", name)
        return importlib.util.spec_from_file_location(name, source)


_CIMPORTS = re.compile(rb"^\s*from\s+([\w.]+)\s+cimport\s+([\w, ]+)|^\s*cimport\s+([\w.]+)", re.MULTILINE)


def digest(source: Path, _within: frozenset[Path] = frozenset()) -> str:
    """The digest of what a module is compiled from: its source and, where it has one, the .pxd beside it (Cython's
    declarations of C types for some of its functions and classes, as `epp/grpc_h2.pxd`), with the digests of the
    modules of this tree that .pxd cimports (`from epp.requestcontrol.types cimport RequestContext`): their classes'
    C layout is compiled into it, so it must not run beside their changed source, which it would read as that
    layout. Cython's own declarations (`libc`, `cpython`) have no source here and are left out. `_within`: the
    modules whose digest this one is part of (.pxd files may cimport each other; each counts once in a cycle)."""
    content = source.read_bytes()
    declarations = source.with_suffix(".pxd")
    if declarations.is_file():
        text = declarations.read_bytes()
        content += text
        within = _within | {source.resolve()}
        for module in _cimported(source, text):
            if module.resolve() not in within:
                content += digest(module, within).encode()
    return hashlib.sha256(content).hexdigest()


def _cimported(beside: Path, declarations: bytes) -> list[Path]:
    """The sources in the package tree of the module at `beside` of the modules `declarations` cimports: `from
    a.b cimport Name`, `from a cimport b` (b a module of package a) and `cimport a.b`."""
    found = []
    for match in _CIMPORTS.finditer(declarations):
        module = (match.group(1) or match.group(3)).decode()
        names = [n.strip() for n in (match.group(2) or b"").decode().split(",")]
        top = module.split(".")[0]
        root = next((p.parent for p in beside.resolve().parents if p.name == top), None)
        if root is None:
            continue  # not of this tree: Cython's own declarations
        path = root.joinpath(*module.split("."))
        candidates = [path.with_suffix(".py")] + [path / f"{name}.py" for name in names if name]
        found += [c for c in candidates if c.is_file()]
    return found


def _read(stamp: Path) -> dict:
    return json.loads(stamp.read_text()) if stamp.is_file() else {}


def stamped() -> dict[str, str]:
    """The stamp: each compiled module's name and its source's digest when it was compiled (empty: none was)."""
    return _read(STAMP)


def pgo_stamped() -> dict[str, list[str]]:
    """The profile-guided build's stamp (PGO_STAMP; empty: the last build was plain)."""
    return _read(PGO_STAMP)


def install(package: str) -> SourceGuard:
    """The guard for `package`'s modules, first on sys.meta_path (once)."""
    for finder in sys.meta_path:
        if isinstance(finder, SourceGuard) and finder.prefix == package + ".":
            return finder
    guard = SourceGuard(package, stamped(), pure=bool(os.environ.get("EPP_PURE_PYTHON")))
    sys.meta_path.insert(0, guard)
    return guard


def summary() -> str:
    """How this install runs the request path, for logs and benchmark reports: compiled (how many modules) or pure
    Python (and why)."""
    if os.environ.get("EPP_PURE_PYTHON"):
        return "pure Python (EPP_PURE_PYTHON is set)"
    digests = stamped()
    if not digests:
        return "pure Python (not compiled: no C compiler or no Cython when it was installed)"
    root = STAMP.parent.parent
    sources = {name: root / (name.replace(".", "/") + ".py") for name in digests}
    stale = [name for name, d in digests.items() if not sources[name].is_file() or digest(sources[name]) != d]
    changed = f"; {len(stale)} changed since and run from source" if stale else ""
    pgo = pgo_stamped()
    if pgo.get("instrumented"):  # a profile-guided build stopped half way: slow, and counting
        return f"compiled with Cython ({len(digests)} modules{changed}; instrumented for profiling: `make compile`)"
    guided = f", {len(pgo['profile_guided'])} profile-guided" if pgo.get("profile_guided") else ""
    return f"compiled with Cython ({len(digests)} modules{guided}{changed})"
