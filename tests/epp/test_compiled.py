"""The compiled request path (setup.py, epp/compiled.py): an install with a compiler runs the request path compiled,
a compiled module never runs code older than its source, and EPP_PURE_PYTHON runs everything from source."""

import hashlib
import importlib.machinery
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epp import compiled

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
STAMPED = compiled.stamped()
needs_compiled = pytest.mark.skipif(not STAMPED, reason=compiled.summary())


def package_with_an_extension(tmp_path: Path, source: str) -> Path:
    """A package `guarded` whose module `mod` has its source and an extension file beside it (never loaded)."""
    package = tmp_path / "guarded"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(source)
    (package / f"mod{SUFFIX}").write_bytes(b"not loaded")
    return package


@pytest.fixture
def guarded_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n == "guarded" or n.startswith("guarded.")]:
        del sys.modules[name]


def test_a_module_whose_source_changed_since_it_was_compiled_runs_from_source(guarded_path, caplog):
    package_with_an_extension(guarded_path, "VALUE = 2\n")
    compiled_from = hashlib.sha256(b"VALUE = 1\n").hexdigest()
    guard = compiled.SourceGuard("guarded", {"guarded.mod": compiled_from}, pure=False)
    sys.meta_path.insert(0, guard)
    try:
        with caplog.at_level(logging.WARNING, logger="epp.compiled"):
            from guarded import mod
    finally:
        sys.meta_path.remove(guard)
    assert mod.VALUE == 2 and mod.__file__.endswith("mod.py")
    assert guard.from_source == ["guarded.mod"]
    assert "guarded.mod changed since it was compiled" in caplog.text


def test_a_module_runs_from_source_when_a_module_its_pxd_cimports_from_changed(guarded_path):
    """director.pxd cimports RequestContext from types: compiled, the director reads a context as that class's C
    layout, so with types.py edited (and run from source) the director must run from source too."""
    package = package_with_an_extension(guarded_path, "VALUE = 1\n")
    (package / "mod.pxd").write_text("from guarded.dep cimport Thing\n")
    (package / "dep.py").write_text("class Thing:\n    pass\n")
    guard = compiled.SourceGuard("guarded", {"guarded.mod": compiled.digest(package / "mod.py")}, pure=False)
    assert guard.find_spec("guarded.mod", [str(package)]).origin.endswith(SUFFIX)
    (package / "dep.py").write_text("class Thing:\n    size = 2\n")
    assert guard.find_spec("guarded.mod", [str(package)]).origin.endswith("mod.py")


def test_a_pxd_cimporting_cythons_own_declarations_or_a_package_member_is_digested(guarded_path):
    """`from libc.math cimport sqrt` has no source in the tree (left out, no error); `from guarded cimport dep` names
    a module of the package (covered as `from guarded.dep cimport ...` is)."""
    package = package_with_an_extension(guarded_path, "VALUE = 1\n")
    (package / "mod.pxd").write_text("from libc.math cimport sqrt\nfrom guarded cimport dep\n")
    (package / "dep.py").write_text("class Thing:\n    pass\n")
    before = compiled.digest(package / "mod.py")
    (package / "dep.py").write_text("class Thing:\n    size = 2\n")
    assert compiled.digest(package / "mod.py") != before


def test_pxd_files_that_cimport_each_other_are_digested_once_each(guarded_path):
    """Cython takes .pxd files that cimport each other; their digests end, and each covers both sources."""
    package = package_with_an_extension(guarded_path, "VALUE = 1\n")
    (package / "mod.pxd").write_text("from guarded.dep cimport Thing\n")
    (package / "dep.py").write_text("class Thing:\n    pass\n")
    (package / "dep.pxd").write_text("from guarded.mod cimport Other\n")
    before = {name: compiled.digest(package / f"{name}.py") for name in ("mod", "dep")}
    (package / "dep.py").write_text("class Thing:\n    size = 2\n")
    after = {name: compiled.digest(package / f"{name}.py") for name in ("mod", "dep")}
    assert all(after[name] != before[name] for name in ("mod", "dep"))


def test_a_module_compiled_from_its_current_source_is_found_as_its_extension(guarded_path):
    source = "VALUE = 1\n"
    package = package_with_an_extension(guarded_path, source)
    current = {"guarded.mod": hashlib.sha256(source.encode()).hexdigest()}
    spec = compiled.SourceGuard("guarded", current, pure=False).find_spec("guarded.mod", [str(package)])
    assert spec.origin.endswith(SUFFIX)
    # pure: from source whatever the stamp says; an extension with no stamp entry: from source too
    for guard in (compiled.SourceGuard("guarded", current, pure=True), compiled.SourceGuard("guarded", {}, False)):
        assert guard.find_spec("guarded.mod", [str(package)]).origin.endswith("mod.py")
    # other packages are not its business
    assert compiled.SourceGuard("guarded", current, pure=False).find_spec("json", None) is None


def test_a_stamped_module_whose_source_was_removed_is_not_loaded_from_its_old_extension(guarded_path):
    package = package_with_an_extension(guarded_path, "VALUE = 1\n")
    (package / "mod.py").unlink()
    guard = compiled.SourceGuard("guarded", {"guarded.mod": "0" * 64}, pure=False)
    with pytest.raises(ModuleNotFoundError, match="no source any more"):
        guard.find_spec("guarded.mod", [str(package)])
    # an extension that was never ours to stamp (no source beside it) is found as it is
    assert (
        compiled.SourceGuard("guarded", {}, pure=False).find_spec("guarded.mod", [str(package)]).origin.endswith(SUFFIX)
    )


def run(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k != "EPP_PURE_PYTHON"}, **env},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


HOT = "epp.grpc_h2", "epp.handlers.extproc", "epp.requestcontrol.director", "epp.scheduling.scheduler"
PRINT_FILES = f"import importlib\nfor m in {HOT!r}: print(importlib.import_module(m).__file__)"


@needs_compiled
def test_the_request_path_runs_compiled_and_pure_python_on_demand():
    assert set(HOT) <= set(STAMPED), sorted(STAMPED)
    files = run(PRINT_FILES).splitlines()
    assert all(f.endswith(SUFFIX) for f in files), files
    guided = compiled.pgo_stamped().get("profile_guided")
    assert (
        compiled.summary()
        == f"compiled with Cython ({len(STAMPED)} modules{f', {len(guided)} profile-guided' if guided else ''})"
    )
    files = run(PRINT_FILES, EPP_PURE_PYTHON="1").splitlines()
    assert all(f.endswith(".py") for f in files), files
    assert run("from epp import compiled; print(compiled.summary())", EPP_PURE_PYTHON="1").startswith("pure Python")


def test_a_none_where_a_pxd_declares_a_class_raises_as_python_does():
    """The .pxd files type some arguments as classes (director.pxd: the request's context); compiled with nonecheck,
    a None there raises AttributeError, as the pure Python does, instead of being read as that class."""
    from epp.requestcontrol.director import Director
    from tests.epp.test_server import make_picker

    director = make_picker()
    assert isinstance(director, Director)
    for call in (lambda: director.on_complete(None), lambda: director.route(None, {"model": "m"}, b"{}")):
        with pytest.raises(AttributeError):
            call()


def test_the_per_request_dataclasses_import_nothing_and_default_to_their_own_containers(monkeypatch):
    """Compiled, a dataclass field with a default_factory made Cython's __init__ import the dataclasses module on
    every call (types.py writes those __init__ itself): building a request's scheduling objects imports nothing."""
    import builtins

    from epp.requestcontrol.types import RoutingDecision
    from epp.scheduling.types import ResponseInfo, SchedulingRequest, SchedulingResult

    imported = []
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *rest: imported.append(name) or real_import(name, *rest))
    requests = [SchedulingRequest("r", "m"), SchedulingRequest("r", "m", "prompt", 1, headers={"a": "b"})]
    results = [SchedulingResult([]), SchedulingResult([], "p", [], {}, [], None)]
    RoutingDecision("r", [], None, False)
    ResponseInfo("200")
    monkeypatch.undo()
    assert imported == []
    assert requests[0].headers == {} and requests[0].headers is not SchedulingRequest("s", "m").headers
    assert requests[1].headers == {"a": "b"} and requests[1].prompt_tokens_estimate == 1
    assert results[0].candidates == [] and results[0].raw_scores == {} and results[0].timings == []
    assert results[0].cycle_state is not results[1].cycle_state and results[0].profile == "default"


def test_endpoints_keep_their_own_containers_and_the_load_estimates_read_their_fields():
    """Compiled, Endpoint is a C class (endpoint.pxd) and the load estimates read its fields typed (load.pxd): the
    same values and errors as the pure Python's, each endpoint with containers of its own."""
    from dataclasses import fields

    from epp.datalayer.endpoint import INTER_TOKEN_SAMPLES, Endpoint, EndpointSpec
    from epp.scheduling.load import queue_depth, queue_depths, running_requests
    from epp.scheduling.types import CycleState
    from protocol.metrics import EndpointMetrics

    a, b = Endpoint(EndpointSpec("a", "10.0.0.1", 8000)), Endpoint(EndpointSpec("b", "10.0.0.2", 8000))
    assert a.inter_token_totals is not b.inter_token_totals and a.inter_token_totals.maxlen == INTER_TOKEN_SAMPLES
    assert a.recent_adapters is not b.recent_adapters and a.stale and a.recent_ttft == 0.0
    assert {"spec", "metrics", "in_flight_requests", "recent_ttft"} <= {f.name for f in fields(Endpoint)}
    a.metrics = EndpointMetrics(waiting=3, running=2)
    a.in_flight_requests, a.in_flight_at_scrape = 4, 6  # two finished since the scrape: two waiting took their place
    assert queue_depth(a) == 2 and queue_depth(b) == 0  # its own 4 in flight against the scrape's 2 running
    assert queue_depths(CycleState(), [a, b]) == [2, 0] and running_requests(a) == 2
    with pytest.raises(AttributeError):
        queue_depth(None)


@needs_compiled
def test_the_summary_says_how_a_profile_guided_build_left_the_modules(tmp_path, monkeypatch):
    """setup.py's EPP_PGO builds stamp which modules they instrumented or built with the training's counts; one that
    stopped half way (instrumented modules: slow, and writing counts at every exit) is named as such."""
    monkeypatch.setattr(compiled, "PGO_STAMP", tmp_path / "compiled-pgo.json")
    assert compiled.summary() == f"compiled with Cython ({len(STAMPED)} modules)"
    compiled.PGO_STAMP.write_text(json.dumps({"profile_guided": sorted(STAMPED)[:3]}))
    assert compiled.summary() == f"compiled with Cython ({len(STAMPED)} modules, 3 profile-guided)"
    compiled.PGO_STAMP.write_text(json.dumps({"instrumented": sorted(STAMPED)}))
    assert "instrumented for profiling: `make compile`" in compiled.summary()


def test_this_install_is_not_left_instrumented():
    """A profile-guided build (epp/bench/pgo.py) ends with the modules built for use, or built plain again."""
    stamp = compiled.pgo_stamped()
    assert not stamp.get("instrumented"), stamp
