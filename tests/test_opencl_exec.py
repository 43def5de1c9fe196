"""Execute the OpenCL C that TVM generates for Adreno on PoCL (CPU OpenCL) and check the numbers.

Each kernel is scheduled with dlight for the Adreno target, built to OpenCL C, launched on PoCL with the
launch plan read from the host TIR, and compared with the same PrimFunc built for LLVM (or with numpy for
the paged decode attention, which has no plain LLVM twin). fp32 only: PoCL has no cl_khr_fp16.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from pipeline.errors import CompileError
from pipeline.verify.opencl import find_opencl_device, run_on_llvm, run_on_pocl
from pipeline.verify.opencl_plan import ADRENO_TARGET, opencl_kernels, schedule_for_gpu

if find_opencl_device() is None:
    pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)",
                allow_module_level=True)

TOL = 1e-4


def _check(out: np.ndarray, ref: np.ndarray, what: str) -> None:
    """max |out - ref| relative to the output scale (at least 1)."""
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{what}: non-finite values"
    err = float(np.abs(out.astype(np.float64) - ref).max())
    scale = max(1.0, float(np.abs(ref).max()))
    assert err <= TOL * scale, f"{what}: max abs diff {err:.3g} > {TOL} * {scale:.3g}"


def _run_both(func: tirx.PrimFunc, program, args: list[np.ndarray], **kw) -> tuple[list, list]:
    gpu = run_on_pocl(program, "main", [a.copy() for a in args], **kw)
    cpu = run_on_llvm(func, [a.copy() for a in args])
    return gpu, cpu


def _only_launch(program):
    launches = program.launches("main")
    assert len(launches) == 1, [launch.describe() for launch in launches]
    assert f"__kernel void {launches[0].kernel}(" in program.source
    return launches[0]


# --------------------------------------------------------------------------------------------------
# 1. fp32 GEMV, scheduled by dlight GEMV
# --------------------------------------------------------------------------------------------------


def test_gemv_fp32():
    from tvm.s_tir import dlight as dl

    n_out, k_in = 1024, 576
    w = te.placeholder((n_out, k_in), "float32", name="W")
    x = te.placeholder((k_in,), "float32", name="x")
    k = te.reduce_axis((0, k_in), name="k")
    y = te.compute((n_out,), lambda n: te.sum(w[n, k] * x[k], axis=k), name="y")
    func = te.create_prim_func([w, x, y])

    mod = schedule_for_gpu(func, ADRENO_TARGET, rules=[dl.gpu.GEMV()])   # GEMV must claim it
    program = opencl_kernels(mod, ADRENO_TARGET)
    launch = _only_launch(program)
    assert {a.name for a in launch.args if a.kind == "buffer"} == {"W", "x", "y"}
    glob, local = launch.sizes()
    assert int(np.prod(glob)) >= n_out and int(np.prod(local)) > 1

    rng = np.random.default_rng(0)
    args = [rng.standard_normal((n_out, k_in), dtype=np.float32),
            rng.standard_normal(k_in, dtype=np.float32), np.zeros(n_out, np.float32)]
    gpu, cpu = _run_both(func, program, args)
    _check(gpu[2], cpu[2], "gemv OpenCL vs LLVM")
    _check(cpu[2], args[0].astype(np.float64) @ args[1], "gemv LLVM vs numpy")


# --------------------------------------------------------------------------------------------------
# 2. q4 dequantize fused into the GEMV reduction, KN and NK layouts
# --------------------------------------------------------------------------------------------------


def _q4_gemv_func(layout: str, n_out: int, k_in: int) -> tirx.PrimFunc:
    """y[n] = sum_k x[k] * (code(k, n) - 7) * scale(k // 32, n), the unpacking inlined in the sum."""
    x = te.placeholder((k_in,), "float32", name="x")
    if layout == "KN":
        packed = te.placeholder((k_in // 8, n_out), "uint32", name="w_packed")
        scale = te.placeholder((k_in // 32, n_out), "float32", name="w_scale")

        def word(n, k):
            return packed[k // 8, n]

        def group_scale(n, k):
            return scale[k // 32, n]
    else:
        packed = te.placeholder((n_out, k_in // 8), "uint32", name="w_packed")
        scale = te.placeholder((n_out, k_in // 32), "float32", name="w_scale")

        def word(n, k):
            return packed[n, k // 8]

        def group_scale(n, k):
            return scale[n, k // 32]

    def dequant(n, k):
        shift = tirx.Cast("uint32", k % 8) * tirx.const(4, "uint32")
        code = (word(n, k) >> shift) & tirx.const(0xF, "uint32")
        return (tirx.Cast("float32", code) - tirx.const(7.0, "float32")) * group_scale(n, k)

    k = te.reduce_axis((0, k_in), name="k")
    y = te.compute((n_out,), lambda n: te.sum(x[k] * dequant(n, k), axis=k), name="y")
    return te.create_prim_func([x, packed, scale, y])


def _pack_q4(codes_kn: np.ndarray) -> np.ndarray:
    """[K, N] codes 0..15 -> [K/8, N] uint32, code of row k at nibble k % 8 of word k // 8."""
    k_in, n_out = codes_kn.shape
    packed = np.zeros((k_in // 8, n_out), np.uint32)
    for j in range(8):
        packed |= codes_kn[j::8].astype(np.uint32) << np.uint32(4 * j)
    return packed


@pytest.mark.parametrize("layout", ["KN", "NK"])
def test_q4_dequant_gemv(layout):
    from tvm.s_tir import dlight as dl

    n_out, k_in = 1024, 576
    func = _q4_gemv_func(layout, n_out, k_in)
    mod = schedule_for_gpu(func, ADRENO_TARGET, rules=[dl.gpu.GEMV()])
    program = opencl_kernels(mod, ADRENO_TARGET)
    launch = _only_launch(program)
    assert {a.name for a in launch.args} == {"x", "w_packed", "w_scale", "y"}

    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(k_in, n_out), dtype=np.uint32)
    scales = (rng.random((k_in // 32, n_out), dtype=np.float32) * 0.1 + 0.01).astype(np.float32)
    packed = _pack_q4(codes)
    dense = (codes.astype(np.float64) - 7) * np.repeat(scales, 32, axis=0)          # [K, N]
    if layout == "NK":
        packed, scales = np.ascontiguousarray(packed.T), np.ascontiguousarray(scales.T)
    x = rng.standard_normal(k_in, dtype=np.float32)
    args = [x, packed, scales, np.zeros(n_out, np.float32)]
    gpu, cpu = _run_both(func, program, args)
    _check(gpu[3], cpu[3], f"q4 {layout} OpenCL vs LLVM")
    _check(cpu[3], x.astype(np.float64) @ dense, f"q4 {layout} LLVM vs numpy dequant")


# --------------------------------------------------------------------------------------------------
# 3. RMSNorm with a symbolic row count
# --------------------------------------------------------------------------------------------------


def test_rmsnorm_symbolic_rows():
    hidden, eps = 576, 1e-5
    n = te.var("n")
    x = te.placeholder((n, hidden), "float32", name="x")
    w = te.placeholder((hidden,), "float32", name="weight")
    k = te.reduce_axis((0, hidden), name="k")
    sq = te.compute((n,), lambda i: te.sum(x[i, k] * x[i, k], axis=k), name="sq_sum")
    y = te.compute(
        (n, hidden),
        lambda i, j: x[i, j] * w[j]
        * tirx.rsqrt(sq[i] / tirx.const(hidden, "float32") + tirx.const(eps, "float32")),
        name="y")
    func = te.create_prim_func([x, w, y])

    program = opencl_kernels(schedule_for_gpu(func, ADRENO_TARGET), ADRENO_TARGET)
    launch = _only_launch(program)
    assert any("n" in str(e) for e in launch.grid + launch.block), launch.describe()   # symbolic grid
    assert launch.sizes({"n": 7})[0] != launch.sizes({"n": 1})[0]

    rng = np.random.default_rng(2)
    weight = rng.standard_normal(hidden, dtype=np.float32)
    for rows in (1, 7):
        xs = rng.standard_normal((rows, hidden), dtype=np.float32)
        args = [xs, weight, np.zeros((rows, hidden), np.float32)]
        gpu, cpu = _run_both(func, program, args, scalar_vars={"n": rows})
        _check(gpu[2], cpu[2], f"rmsnorm n={rows} OpenCL vs LLVM")
        x64 = xs.astype(np.float64)
        ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * weight
        _check(cpu[2], ref, f"rmsnorm n={rows} LLVM vs numpy")


# --------------------------------------------------------------------------------------------------
# 4. Paged decode attention (TVM's MLC-style kernel) vs a numpy softmax reference
# --------------------------------------------------------------------------------------------------


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE on the last axis of x [..., L, D] at positions pos [L]."""
    d = x.shape[-1]
    inv = theta ** (-(np.arange(d) * 2 % d) / d)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(ang) + half * np.sin(ang)


@pytest.mark.parametrize("rotary_mode", [0, 1])
def test_paged_decode_attention(rotary_mode):
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode

    kv_heads, qo_heads, head_dim, page_size, seq_len = 3, 9, 64, 16, 37
    rope_theta, sm_scale = 10000.0, 1.0 / np.sqrt(head_dim)
    target = tvm.target.Target(ADRENO_TARGET)
    func = _attention_decode(kv_heads, qo_heads, head_dim, "float32", False, rope_scaling={}, target=target)
    program = opencl_kernels(schedule_for_gpu(func, target), target)
    _only_launch(program)

    rng = np.random.default_rng(3)
    num_pages = -(-seq_len // page_size)
    page_ids = np.array([3, 0, 4], np.int32)                  # non-contiguous pages of the one sequence
    assert len(page_ids) == num_pages
    pages = rng.standard_normal((5, 2, kv_heads, page_size, head_dim), dtype=np.float32)
    q = rng.standard_normal((1, qo_heads, head_dim), dtype=np.float32)
    last_page_len = seq_len - (num_pages - 1) * page_size
    args = [
        q, pages,
        np.array([0, num_pages], np.int32),                   # page_table_indptr
        page_ids,                                             # page_table_values
        np.array([last_page_len], np.int32),                  # length_info (last page length)
        np.zeros(1, np.int32),                                # k_rope_pos_offset
        np.array([seq_len - 1], np.int32),                    # q_rope_position
        np.zeros((1, qo_heads, head_dim), np.float32),        # output
        np.zeros((1, qo_heads), np.float32),                  # lse (log2 domain)
        rotary_mode, 1.0, rope_theta, float(sm_scale),
    ]
    out = run_on_pocl(program, "main", args)

    keys = np.concatenate([pages[p, 0] for p in page_ids], axis=1)[:, :seq_len].astype(np.float64)
    values = np.concatenate([pages[p, 1] for p in page_ids], axis=1)[:, :seq_len].astype(np.float64)
    q64 = q[0].astype(np.float64)
    if rotary_mode == 1:
        keys = _rope(keys, np.arange(seq_len), rope_theta)
        q64 = _rope(q64[:, None, :], np.array([seq_len - 1]), rope_theta)[:, 0]
    group = qo_heads // kv_heads
    ref = np.zeros((qo_heads, head_dim))
    ref_lse = np.zeros(qo_heads)
    for h in range(qo_heads):
        s = keys[h // group] @ q64[h] * sm_scale
        p = np.exp(s - s.max())
        ref[h] = p @ values[h // group] / p.sum()
        ref_lse[h] = (s.max() + np.log(p.sum())) / np.log(2)
    _check(out[7][0], ref, f"decode attention (rotary {rotary_mode}) output")
    _check(out[8][0], ref_lse, f"decode attention (rotary {rotary_mode}) lse")


# --------------------------------------------------------------------------------------------------
# Several kernels with device workspaces in between (softmax split by the Fallback rule)
# --------------------------------------------------------------------------------------------------


def test_multi_kernel_softmax_with_workspaces():
    from tvm.s_tir import dlight as dl

    cols = 100
    n = te.var("n")
    x = te.placeholder((n, cols), "float32", name="x")
    k1 = te.reduce_axis((0, cols), name="k1")
    row_max = te.compute((n,), lambda i: te.max(x[i, k1], axis=k1), name="row_max")
    ex = te.compute((n, cols), lambda i, j: te.exp(x[i, j] - row_max[i]), name="ex")
    k2 = te.reduce_axis((0, cols), name="k2")
    row_sum = te.compute((n,), lambda i: te.sum(ex[i, k2], axis=k2), name="row_sum")
    y = te.compute((n, cols), lambda i, j: ex[i, j] / row_sum[i], name="y")
    func = te.create_prim_func([x, y])

    program = opencl_kernels(schedule_for_gpu(func, ADRENO_TARGET, rules=[dl.gpu.Fallback()]), ADRENO_TARGET)
    entry = program.entry("main")
    assert len(entry.launches) >= 2
    assert any(a.name.startswith("workspace:") for launch in entry.launches for a in launch.args)
    assert len(entry.work_sizes({"n": 5})) == len(entry.launches)

    xs = np.random.default_rng(4).standard_normal((5, cols), dtype=np.float32) * 4
    gpu, cpu = _run_both(func, program, [xs, np.zeros((5, cols), np.float32)])
    _check(gpu[1], cpu[1], "softmax OpenCL vs LLVM")
    ref = np.exp(xs - xs.max(1, keepdims=True))
    _check(cpu[1], ref / ref.sum(1, keepdims=True), "softmax LLVM vs numpy")


# --------------------------------------------------------------------------------------------------
# Guard rails
# --------------------------------------------------------------------------------------------------


def test_unscheduled_function_is_rejected():
    from tvm.s_tir import dlight as dl

    a = te.placeholder((64,), "float32", name="a")
    b = te.compute((64,), lambda i: a[i] * 2.0, name="b")
    func = te.create_prim_func([a, b])
    with pytest.raises(CompileError, match="not scheduled"):
        schedule_for_gpu(func, ADRENO_TARGET, rules=[dl.gpu.Matmul()])
    with pytest.raises(CompileError, match="no GPU thread bindings"):
        opencl_kernels(tvm.IRModule({"main": func}), ADRENO_TARGET)


def test_harness_checks_inputs_and_uses_the_launch_plan():
    size = 4096
    a = te.placeholder((size,), "float32", name="a")
    b = te.compute((size,), lambda i: a[i] + 1.0, name="b")
    func = te.create_prim_func([a, b])
    program = opencl_kernels(schedule_for_gpu(func, ADRENO_TARGET), ADRENO_TARGET)
    src = np.arange(size, dtype=np.float32)
    with pytest.raises(TypeError, match="float32"):
        run_on_pocl(program, "main", [src.astype(np.float64), np.zeros(size, np.float64)])
    out = run_on_pocl(program, "main", [src.copy(), np.zeros(size, np.float32)])
    np.testing.assert_array_equal(out[1], src + 1)

    # A launch plan with a too-small grid must leave outputs unwritten: the plan is really used.
    entry = program.entry("main")
    launch = entry.launches[0]
    assert launch.sizes()[0][0] >= size
    short = dataclasses.replace(launch, grid=(1, 1, 1))
    entry.steps = [("launch", short) if step[0] == "launch" else step for step in entry.steps]
    out = run_on_pocl(program, "main", [src.copy(), np.zeros(size, np.float32)])
    assert (out[1][-1] == 0) and not np.array_equal(out[1], src + 1)
