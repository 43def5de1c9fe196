"""MLC-LLM's own engine (built by `make mlc-engine`) serves our bundles: the checks of `make conformance`.

They run in the default suite whenever the engine library is built for this checkout's inputs (a few seconds on
top of the bundle builds the suite shares); without it they skip, naming `make mlc-engine`. The hybrid and the
other schemes are slow tests."""

from __future__ import annotations

import pytest

from clients.mlc_engine import build, conformance


@pytest.fixture(scope="module")
def engine_lib():
    lib = build.cached_library()
    if lib is None:
        pytest.skip("the MLC engine is not built for this checkout (`make mlc-engine`)")
    return lib


@pytest.fixture(scope="module")
def host_bundle(build_bundle):
    return build_bundle("smollm2-135m", "host-cpu", "q4f16")


def test_served_answer_and_greedy_ids_equal_pipeline_run(engine_lib, host_bundle, capsys):
    conformance.check_served_answer(engine_lib, host_bundle)
    out = capsys.readouterr().out
    assert "Paris" in out and "equal" in out


def test_four_concurrent_requests_equal_each_served_alone(engine_lib, host_bundle, capsys):
    conformance.check_concurrent(engine_lib, host_bundle)
    assert "all 4 started before the first finished: yes" in capsys.readouterr().out


@pytest.mark.slow
def test_hybrid_greedy_ids_equal_transformers(engine_lib, tmp_path):
    conformance.check_hybrid(engine_lib, tmp_path)


@pytest.mark.slow
def test_ternary_and_q8_bundles_decode_like_our_runner(engine_lib, dist_dir):
    conformance.check_other_schemes(engine_lib, dist_dir)
