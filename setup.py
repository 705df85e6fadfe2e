"""Compiles the EPP's request path with Cython when a C compiler is at hand; pure Python otherwise.

The source stays plain Python: Cython turns each module below into a C extension with the same behaviour, which
takes the EPP's handler path from ~95 to ~29 µs of CPU per request (`epp-bench handler-cpu`, 04ae1f1). A build
without a compiler, or with EPP_PURE_PYTHON=1 set, installs the same modules as Python, and the EPP runs them as
they are. At run time, `epp.compiled` loads a module from its source instead when the source has changed since it
was compiled (an editable install that was not rebuilt), or for every module when EPP_PURE_PYTHON=1 is set
(profilers see into Python functions only).

Annotations document; they do not become C types. Cython's C types are in .pxd files beside nine modules, each where
untyped code measured slower: `epp/handlers/wire.pxd`, for the loops that read and compose protobuf wire bytes
(ext_proc messages, access-log records, the answers); `epp/metrics.pxd`, for the counters and histograms a request
updates (~20 updates); `epp/scheduling/scheduler.pxd`, for the weighted sum of the scorers' scores;
`epp/grpc_h2.pxd`, `epp/handlers/extproc.pxd`, `epp/requestcontrol/director.pxd` and `types.pxd` beside it, for the
objects every frame, message and request goes through (the HTTP/2 connection, its streams, the ext_proc handler, the
director, the request's context): their fields as C fields, their own calls as C calls; `epp/scheduling/types.pxd`
and `epp/predictor/features.pxd` (and RoutingDecision in `epp/requestcontrol/types.pxd`) for the dataclasses every
request builds, which declared become Cython's dataclasses with a compiled `__init__` (the dataclasses module's is
generated Python, interpreted). The modules themselves stay plain Python and run as such when not compiled.
`epp/cli.py` is compiled for its wiring's closures, which the request path calls (the stream factory, flow control's
room check).

`make` then builds them a second time with GCC's profile-guided optimisation (`python -m epp.bench.pgo`, which sets
EPP_PGO for the two builds below): the request path's code laid out as a training run of it took it, which a live
EPP, its code evicted from the caches between Envoy's requests, fetches fewer lines of (README, "The compiled request
path").
"""

import importlib.util
import json
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The modules every request and every scrape goes through. Package __init__ files stay Python.
COMPILED = [
    "epp/cli.py",
    "epp/grpc_h2.py",
    "epp/flowcontrol.py",
    "epp/metrics.py",
    "epp/handlers/*.py",
    "epp/requestcontrol/*.py",
    "epp/scheduling/*.py",
    "epp/scheduling/plugins/*.py",
    "epp/predictor/*.py",
    "epp/datalayer/*.py",
]
GENERATED = Path("build/cython")  # Cython's C, each file with the digest of what it was generated from beside it
# Profile-guided optimisation, in two builds that `python -m epp.bench.pgo` drives: EPP_PGO=generate compiles the
# modules instrumented (each run adds its branch counts to PGO_DIR), EPP_PGO=use compiles each module whose source
# the training ran (TRAINED: the instrumented build's stamp) with those counts, and the rest as usual
PGO = os.environ.get("EPP_PGO", "")
PGO_DIR = Path("build/pgo").resolve()
TRAINED = PGO_DIR / "trained.json"


def _guard():
    """epp/compiled.py, whose guard checks the stamps this build writes (the module loaded alone: it needs only the
    standard library)."""
    spec = importlib.util.spec_from_file_location("epp_compiled_guard", "epp/compiled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GUARD = _guard()
STAMP = GUARD.STAMP.name  # in the epp package: each compiled module's source digest (what epp.compiled checks)
PGO_STAMP = GUARD.PGO_STAMP.name  # beside STAMP after an EPP_PGO build: how it built which modules


def sources() -> dict[str, str]:
    """Each compiled module's name and the digest of what it is compiled from (`epp.compiled.digest`)."""
    paths = sorted(p for pattern in COMPILED for p in Path().glob(pattern) if p.name != "__init__.py")
    return {".".join(p.with_suffix("").parts): GUARD.digest(p) for p in paths}


DIGESTS = sources()  # read once: what Cython compiles is what the stamp records


class BuildCompiledModules(build_ext):
    """build_ext on every core, then the stamp of what it compiled beside the extensions."""

    def finalize_options(self):
        super().finalize_options()
        self.parallel = self.parallel or os.cpu_count()
        if PGO:  # the counts are filed under each object's path: the same in both builds, not a fresh temporary one
            self.build_temp = str(PGO_DIR / "objects")
            self.force = True

    def run(self):
        super().run()
        built = {e.name: DIGESTS[e.name] for e in self.extensions if self._up_to_date(e)}
        stamp = Path(self.get_ext_fullpath("epp.stamp")).with_name(STAMP)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(built, indent=0, sort_keys=True))
        pgo_stamp = stamp.with_name(PGO_STAMP)
        guided = sorted(e.name for e in self.extensions if e.name in built and getattr(e, "profile_guided", False))
        if PGO == "generate":
            pgo_stamp.write_text(json.dumps({"instrumented": sorted(built)}, indent=0))
        elif PGO == "use":
            pgo_stamp.write_text(json.dumps({"profile_guided": guided}, indent=0))
        else:
            pgo_stamp.unlink(missing_ok=True)  # a plain build: no earlier build's claim stays

    def _up_to_date(self, ext) -> bool:
        """Built from the C that Cython generated from the current source (a failed optional build may leave an
        older extension behind)."""
        library = Path(self.get_ext_fullpath(ext.name))
        return library.is_file() and library.stat().st_mtime >= Path(ext.sources[0]).stat().st_mtime


def extensions() -> list:
    if os.environ.get("EPP_PURE_PYTHON"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    generated = {name: GENERATED.joinpath(*name.split(".")).with_suffix(".c") for name in DIGESTS}
    for name, c_file in generated.items():
        # Cython regenerates C older than its .py and the .pxd files it finds, but not after a .pxd was removed:
        # the digest (which covers them, and the modules a .pxd cimports from) decides instead
        recorded = c_file.with_suffix(".digest")
        if not recorded.is_file() or recorded.read_text() != DIGESTS[name]:
            c_file.unlink(missing_ok=True)
    modules = cythonize(
        [name.replace(".", "/") + ".py" for name in DIGESTS],
        build_dir=str(GENERATED),  # the generated C stays out of the packages
        language_level=3,
        quiet=True,
        # Python semantics throughout: annotations document, they do not become C types; a None where a .pxd
        # declares a class raises (AttributeError, TypeError) as Python would, rather than being read as one
        compiler_directives={"annotation_typing": False, "binding": True, "nonecheck": True},
    )
    for name, c_file in generated.items():
        if c_file.is_file():
            c_file.with_suffix(".digest").write_text(DIGESTS[name])
    for module in modules:
        module.optional = True  # no compiler, or a compiler error: that module stays Python
        # no debug information: a fifth of the size (symbols stay for profilers). Python's -O3 stays: -Os, a fifth
        # smaller again, measured 0.037x of plain Envoy's p50 slower (`epp-bench overhead --against`, 2 x 6 pairs)
        module.extra_compile_args = ["-g0"]
    trained = json.loads(TRAINED.read_text()) if PGO == "use" and TRAINED.is_file() else {}
    # (GCC files each object's counts under PGO_DIR by the object's own path)
    counted = {path.as_posix() for path in PGO_DIR.rglob("*.gcda")} if trained else set()
    for module in modules:
        if PGO == "generate":
            # (single-threaded counter updates: the training runs the request path on one thread)
            flags = [f"-fprofile-generate={PGO_DIR}", "-fprofile-update=single"]
            module.extra_compile_args += flags
            module.extra_link_args = flags
        elif trained.get(module.name) == DIGESTS[module.name] and any(
            path.endswith("/" + module.name.replace(".", "/") + ".gcda") for path in counted
        ):
            # a function the training never ran is compiled as without a profile, not as cold code; counts that do
            # not fit the C (another Cython generated it) are left out with a warning, not a failed module
            module.extra_compile_args += [
                f"-fprofile-use={PGO_DIR}",
                "-fprofile-partial-training",
                "-Wno-error=coverage-mismatch",
            ]
            module.profile_guided = True
    return modules


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildCompiledModules})
