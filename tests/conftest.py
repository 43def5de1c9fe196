"""Shared fixtures: an isolated build cache per test session and helpers to build bundles once."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Builds in tests never read or write the developer's .cache."""
    cache = tmp_path_factory.mktemp("build-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLP_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="session", autouse=True)
def no_quick_oclgrind():
    """The default build's quick Oclgrind pass stays off in the suite's builds (tests/test_oclgrind.py runs
    Oclgrind on the kernels itself; tests/test_execution.py the default pass, with this variable removed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLP_QUICK_OCLGRIND", "0")
        yield


@pytest.fixture(scope="session")
def dist_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="session")
def build_bundle(dist_dir, tmp_path_factory, worker_id):
    """build_bundle(model, target, quant) -> bundle path; each combination is built once per session.
    `verify=False` skips the build-time PoCL run of a GPU target's kernels (tests/test_execution.py pins it)
    for tests that check other things; such a bundle goes to its own folder.

    Under pytest-xdist a registry model's bundle is built once for all workers: into a folder beside the
    workers' own, under a lock per bundle, so the second worker finds it up to date (a request-key hit)
    instead of building it again. A model given as a folder stays in the worker's own dist_dir (two workers'
    temporary models may share a name)."""
    from filelock import FileLock

    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    built: dict[tuple, Path] = {}
    shared = None if worker_id == "master" else tmp_path_factory.getbasetemp().parent / "shared-dist"

    def _build(model: str, target: str = "host-cpu", quant: str = "q0f32", verify: bool | None = None) -> Path:
        key = (str(model), target, quant, verify)
        if key not in built:
            registry_name = isinstance(model, str) and not Path(model).exists()
            root = shared if shared is not None and registry_name else dist_dir
            out = root if verify is None else root / f"verify-{verify}"
            out.mkdir(parents=True, exist_ok=True)
            with FileLock(str(out / f".{model}-{quant}-{target}.lock")):
                built[key] = run_pipeline(str(model), target, quant, out=str(out), verify=verify,
                                          report=Reporter(quiet=True)).bundle
        return built[key]

    return _build


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from pipeline.config import load_model

    return load_model("smollm2-135m").weights
