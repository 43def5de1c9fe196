"""benchmarks/decode_profile.py's parsing and arithmetic, on made-up perf reports: no perf, no timing."""

from __future__ import annotations

import pytest

from benchmarks import decode_profile as dp

LIB = "model.so"

REPORT = """
# Overhead  Pid:Command  Shared Object  Symbol
    20.00%       100:python   model.so   [.] gemv_a_compute_
    10.00%       100:python   model.so   [.] 0x0000000000000150
    10.00%       100:python   [kernel.kallsyms]   [k] __schedule
     6.00%       100:python   libtvm_runtime.so   [.] 0x00000000000f2581
     4.00%       100:python   libpython3.11.so.1.0   [.] _PyEval_EvalFrameDefault
    14.00%       101:python   model.so   [.] gemv_a_compute_
    14.00%       101:python   model.so   [.] 0x0000000000000110
    22.00%       101:python   [kernel.kallsyms]   [k] __schedule
"""

COVERAGE = {"summary": {"decode_step": {"total": {"bytes": 2_000_000}}},
            "kernels": [{"name": "gemv_a", "decode_step": {"calls": 4, "bytes": 1_000_000}},
                        {"name": "attn", "decode_step": {"calls": 2, "bytes": None}},
                        {"name": "unused", "decode_step": {"calls": 0, "bytes": 0}}]}

SYMBOLS = ([0x100, 0x200], ["__tvm_ffi_attn", "other_compute_"])


def test_parses_perf_rows_per_thread():
    rows = dp.parse_perf_report(REPORT)
    assert rows[0] == (20.0, "100", "model.so   [.] gemv_a_compute_")
    assert [r[1] for r in rows] == ["100"] * 5 + ["101"] * 3


def test_kernel_names_match_the_coverage_report():
    assert dp.kernel_name("fused_dequantize_q4_kn2_matmul2_compute_") == "fused_dequantize_q4_kn2_matmul2"
    assert dp.kernel_name("__tvm_ffi_batch_decode_paged_kv_cpu") == "batch_decode_paged_kv_cpu"


def test_shares_are_of_the_main_threads_wall_and_bytes_become_gb_s():
    res = dp.analyse(dp.parse_perf_report(REPORT), SYMBOLS, COVERAGE, LIB, main_tid="100", ms_per_token=2.0)
    main = res["threads"]["main"]
    assert main["kernels"] == pytest.approx(0.6)                 # 30 of the main thread's 50
    assert main["kernel mode (pool waits)"] == pytest.approx(0.2)
    assert res["threads"]["thread 101"]["kernels"] == pytest.approx(28 / 50)
    kernels = {k["kernel"]: k for k in res["kernels"]}
    # the slower thread's time: max(20, 14) of the main thread's 50 -> 40% of 2 ms = 0.8 ms for 1 MB
    assert kernels["gemv_a"]["share_of_step"] == pytest.approx(0.4)
    assert kernels["gemv_a"]["gb_s"] == pytest.approx(1e6 / 0.8e-3 / 1e9)
    # bare addresses fall in the function whose address precedes them; no bytes -> no GB/s
    assert kernels["attn"]["share_of_step"] == pytest.approx(14 / 50)
    assert kernels["attn"]["gb_s"] is None
    assert "__schedule" not in kernels
    text = dp.report(res, bandwidth_gbs=2.0)
    assert "| gemv_a | 40.0% | 200.0 | 4 | 1.00 | 1.2 |" in text
    assert "(50% of 2.0)" in text        # 2 MB per 2 ms = 1 GB/s


def test_a_merged_region_gets_its_kernels_bytes():
    """A region kernel (pipeline/kernels/cpu/regions.py) reads the bytes of the kernels merged into it, per call of
    the greedy step the child times."""
    coverage = {**COVERAGE, "kernels": [*COVERAGE["kernels"],
                                        {"name": "rms", "decode_step": {"calls": 0, "bytes": 0, "bytes_per_call": 1000}},
                                        {"name": "gemv_b", "decode_step": {"calls": 0, "bytes": 0,
                                                                           "bytes_per_call": 249_000}}],
                "cpu_regions": {"regions": {"cpu_region0": {"kernels": ["rms", "gemv_b"],
                                                            "calls": {"decode": 3, "decode_greedy": 4}}}}}
    report = "\n    30.00%       100:python   model.so   [.] cpu_region0_compute_\n" + REPORT
    res = dp.analyse(dp.parse_perf_report(report), SYMBOLS, coverage, LIB, main_tid="100", ms_per_token=2.0)
    region = {k["kernel"]: k for k in res["kernels"]}["cpu_region0"]
    assert region["calls_per_token"] == 4 and region["bytes_per_token"] == 4 * 250_000
    assert region["share_of_step"] == pytest.approx(30 / 80)


def test_missing_main_thread_is_an_error():
    with pytest.raises(ValueError, match="main thread"):
        dp.analyse(dp.parse_perf_report(REPORT), SYMBOLS, COVERAGE, LIB, main_tid="999", ms_per_token=1.0)


def test_without_perf_it_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(dp.shutil, "which", lambda name: None)
    assert dp.main([str(tmp_path)]) == 2
    assert "needs Linux `perf`" in capsys.readouterr().err


def test_a_folder_that_is_no_bundle_is_named(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(dp.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert dp.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "not a built bundle" in err
