"""The GPU fallback rule sizes each launch's work-groups to fill an Adreno 750 at one token (kernels/gpu/fill_fallback.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from pipeline.kernels.gpu.fill_fallback import FILL_GROUPS, MIN_THREADS, GPUFillFallback, group_size
from pipeline.report.gpu_cost import launches
from pipeline.verify.opencl_plan import ADRENO_TARGET


def _split(n_parts: list[int]):
    """A split of one [1, sum] row into its parts (qwen27b's in_proj output: conv channels, z, b, a)."""
    total = sum(n_parts)
    x = te.placeholder((1, total), "float32", name="x")
    starts = np.cumsum([0, *n_parts[:-1]]).tolist()
    outs = [te.compute((1, part), _shifted(x, at), name=f"part{i}")
            for i, (part, at) in enumerate(zip(n_parts, starts, strict=True))]
    return te.create_prim_func([x, *outs])


def _shifted(x, at: int):
    return lambda r, c: x[r, c + at] * 2.0


def _schedule(func):
    target = tvm.target.Target(ADRENO_TARGET)
    with target:
        sch = GPUFillFallback().apply(func, target, False)
    return sch.mod["main"]


def test_group_size_fills_where_the_elements_allow():
    assert group_size(10240, 256) == 128 and 10240 // 128 >= FILL_GROUPS
    assert group_size(6144, 256) == 128 and group_size(2048, 256) == MIN_THREADS
    assert group_size(1 << 20, 256) == 256                     # a prompt-sized launch: the target's maximum
    assert group_size(48, 256) == MIN_THREADS                  # 48 gates: too few elements to fill at all
    assert group_size(None, 256) == 256                        # symbolic: the maximum


def test_qwen27b_in_proj_split_launches():
    """The four launches of qwen27b's in_proj split at one token: the big two fill 48 work-groups (256 work-items
    each gave 40 and 24), the 48-wide gate inputs take the smallest group; every element written once."""
    func = _schedule(_split([10240, 6144, 48, 48]))
    assert launches(func) == [(80, 128), (48, 128), (2, 32), (2, 32)]


def test_symbolic_extent_keeps_the_largest_group():
    n = tirx.Var("seq_len", "int64")
    x = te.placeholder((n, 576), "float32", name="x")
    y = te.compute((n, 576), lambda i, j: x[i, j] + 1.0, name="y")
    func = _schedule(te.create_prim_func([x, y]))
    assert launches(func, {"seq_len": 1}) == [(3, 256)]


def test_scheduled_split_runs_on_pocl():
    """The scheduled kernel, compiled to OpenCL C and run on PoCL: each part equals numpy's."""
    from pipeline.verify.opencl import find_opencl_device, run_on_pocl
    from pipeline.verify.opencl_plan import opencl_kernels

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)")
    parts = [3000, 2048, 48, 37]
    func = _schedule(_split(parts)).with_attr("global_symbol", "main")
    x = np.random.default_rng(0).standard_normal((1, sum(parts))).astype(np.float32)
    outs = [np.zeros((1, p), np.float32) for p in parts]
    got = run_on_pocl(opencl_kernels(tvm.IRModule({"main": func}), ADRENO_TARGET), "main", [x, *outs])
    at = 0
    for i, p in enumerate(parts):
        np.testing.assert_array_equal(got[1 + i], x[:, at:at + p] * 2.0)
        at += p


def test_prediction_shares_a_kernels_bytes_among_its_launches():
    """A kernel of several launches: each launch's share of the bytes (by work-items) at its own fill. The 48-wide
    gate parts of the split above cost their 0.8% of the bytes at 2 of 48 work-groups, not all 65920 bytes."""
    from pipeline.report.gpu_cost import predicted_us

    bw = 76.8
    assert predicted_us(48_000, [(24, 64)], bw) == pytest.approx(48_000 / (bw * 1e3) * 2)
    assert predicted_us(65920, [(80, 128), (48, 128)], bw) == pytest.approx(65920 / (bw * 1e3))
    shape = [(80, 128), (48, 128), (2, 32), (2, 32)]
    small = 65920 * 128 / (80 * 128 + 48 * 128 + 128)             # the two gate launches' bytes
    want = (65920 - small) / (bw * 1e3) + small / (bw * 1e3 * 2 / 48)
    assert predicted_us(65920, shape, bw) == pytest.approx(want)
    assert predicted_us(65920, shape, bw, streaming_groups=48) == pytest.approx(65920 / (bw * 1e3))
