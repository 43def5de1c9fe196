"""benchmarks/hexagon_hvx.py on one small GEMV shape: the kernel runs under qemu-hexagon, is checked against numpy,
and its counts come from its own symbols (HVX packets among them)."""

from __future__ import annotations

import pytest

from benchmarks import hexagon_hvx
from benchmarks import qemu_counter as qc
from pipeline.verify import qemu_hexagon as qh

pytestmark = pytest.mark.skipif(bool(qh.missing_tools() + qc.missing_tools(("gcc",))),
                                reason=f"needs Debian packages {qh.missing_tools() + qc.missing_tools(('gcc',))}")


def test_counts_one_gemv(tmp_path):
    rows = hexagon_hvx.measure({"small": (64, 64)}, tmp_path)
    r = rows["small"]
    assert r["rel_err_vs_numpy"] < 2e-2
    # 2 column blocks x 2 groups x 8 vrmpy at least are HVX packets; the per-call work bounds the total
    assert 32 <= r["hvx_packets"] < r["packets"] < 50 * r["weights"]
    assert r["load_bytes"] >= r["weight_bytes"]                  # every code word and scale is read
    s = hexagon_hvx.summary(rows, layers=2, contexts=4)
    assert s["packets_per_token"] == 2 * r["packets"] and s["prediction"]["gemv_ms_per_token"] > 0
    assert "PREDICTION" in hexagon_hvx.markdown({"date": "d", "commit": "c", "model": "m",
                                                 "kinds": {"q4 decode": {"kernels": rows, "per_token": s}}})


def test_counts_q8_prefill_per_row(tmp_path):
    """A q8 prefill of 5 prompt rows (one full pass of 4 and a partial one): checked against numpy, counted per
    weight and row."""
    rows = hexagon_hvx.measure({"small": (64, 128)}, tmp_path, "q8", rows=5)
    r = rows["small"]
    assert r["rel_err_vs_numpy"] < 2e-2 and r["rows"] == 5
    assert 0 < r["hvx_packets"] < r["packets"] and r["packets_per_weight"] == r["packets"] / (r["weights"] * 5)
    s = hexagon_hvx.summary(rows, layers=2, contexts=4)
    assert s["packets_per_token"] == 2 * r["packets"] / 5
