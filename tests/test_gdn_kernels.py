"""Gated DeltaNet recurrence kernels (pipeline/models/gdn_kernels.py) against numpy and transformers.

The LLVM builds are checked against a float64 numpy reference and against transformers' own torch
reference (``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` of Qwen3.5); prefill
must equal successive decode steps and be splittable into chunks; the GPU variants must build for the
Adreno OpenCL target with every function in device kernels and, where PoCL is installed, give the same
numbers when executed.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import tvm

from pipeline.models.gdn_kernels import gdn_decode, gdn_prefill, gdn_reference

TOL = 1e-4
SHAPES = [(2, 6, 16, 16), (2, 4, 32, 32)]  # (Hk, Hv, Dk, Dv)
LLVM = {"kind": "llvm"}
ADRENO = {"kind": "opencl", "device": "adreno", "host": {"kind": "llvm"}}


def _check(out, ref, what: str) -> None:
    """max |out - ref| relative to the output scale (at least 1)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert np.isfinite(out).all(), f"{what}: non-finite values"
    err = float(np.abs(out - ref).max()) if out.size else 0.0
    scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
    assert err <= TOL * scale, f"{what}: max abs diff {err:.3g} > {TOL} * {scale:.3g}"


def _inputs(shape, n: int, seed: int = 0):
    """Random inputs shaped like the model's: unit-norm q/k, g = -exp(A)*softplus(.) < 0, beta in (0, 1)."""
    hk, hv, dk, dv = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, hk, dk))
    k = rng.standard_normal((n, hk, dk))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((n, hv, dv))
    g = -np.exp(rng.uniform(-2.0, 0.5, (n, hv))) * np.log1p(np.exp(rng.standard_normal((n, hv))))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((n, hv))))
    state = 0.5 * rng.standard_normal((hv, dk, dv))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, state)]


@functools.cache
def _built(kind: str, shape):
    make = gdn_prefill if kind == "prefill" else gdn_decode
    func = make(*shape, "float32")
    return tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(LLVM))["main"]


def _run_prefill(shape, q, k, v, g, beta, state):
    dev = tvm.cpu()
    n, hv, dv = v.shape
    o = tvm.runtime.tensor(np.zeros((n, hv, dv), np.float32), dev)
    s_out = tvm.runtime.tensor(np.zeros_like(state), dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(x), dev) for x in (q, k, v, g, beta, state)]
    _built("prefill", shape)(*args, o, s_out)
    return o.numpy(), s_out.numpy()


def _run_decode(shape, q, k, v, g, beta, state):
    dev = tvm.cpu()
    o = tvm.runtime.tensor(np.zeros(v.shape, np.float32), dev)
    s_out = tvm.runtime.tensor(np.zeros_like(state), dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(x), dev) for x in (q, k, v, g, beta, state)]
    _built("decode", shape)(*args, o, s_out)
    return o.numpy(), s_out.numpy()


def _torch_reference(fn_name: str, q, k, v, g, beta, state, **kw):
    torch = pytest.importorskip("torch")
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    fn = getattr(mod, fn_name)
    t = [torch.from_numpy(np.ascontiguousarray(x)).double()[None] for x in (q, k, v, g, beta)]
    s0 = torch.from_numpy(state).double()[None]
    # q and k are already L2-normalised (the model does it with use_qk_l2norm_in_kernel=True).
    o, s = fn(*t, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=False, **kw)
    return o[0].numpy(), s[0].numpy()


# --------------------------------------------------------------------------------------------------
# LLVM numerics
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [1, 5, 33])
def test_prefill_matches_numpy_and_transformers(shape, n):
    q, k, v, g, beta, state = _inputs(shape, n, seed=n)
    o, s = _run_prefill(shape, q, k, v, g, beta, state)
    o_np, s_np = gdn_reference(q, k, v, g, beta, state)
    _check(o, o_np, "o vs numpy")
    _check(s, s_np, "state vs numpy")
    o_t, s_t = _torch_reference("torch_recurrent_gated_delta_rule", q, k, v, g, beta, state)
    _check(o, o_t, "o vs transformers recurrent")
    _check(s, s_t, "state vs transformers recurrent")
    if n == 33:
        o_c, s_c = _torch_reference("torch_chunk_gated_delta_rule", q, k, v, g, beta, state, chunk_size=16)
        _check(o, o_c, "o vs transformers chunked")
        _check(s, s_c, "state vs transformers chunked")


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_references(shape):
    q, k, v, g, beta, state = _inputs(shape, 1, seed=7)
    o, s = _run_decode(shape, q[0], k[0], v[0], g[0], beta[0], state)
    o_np, s_np = gdn_reference(q, k, v, g, beta, state)
    _check(o, o_np[0], "decode o vs numpy")
    _check(s, s_np, "decode state vs numpy")
    o_t, s_t = _torch_reference("torch_recurrent_gated_delta_rule", q, k, v, g, beta, state)
    _check(o, o_t[0], "decode o vs transformers")
    _check(s, s_t, "decode state vs transformers")


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_equals_successive_decodes(shape):
    n = 9
    q, k, v, g, beta, state = _inputs(shape, n, seed=3)
    o_p, s_p = _run_prefill(shape, q, k, v, g, beta, state)
    s = state
    for t in range(n):
        o_t, s = _run_decode(shape, q[t], k[t], v[t], g[t], beta[t], s)
        _check(o_t, o_p[t], f"decode step {t} vs prefill")
    _check(s, s_p, "state after decodes vs prefill")


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_in_two_chunks(shape):
    n, cut = 20, 7
    q, k, v, g, beta, state = _inputs(shape, n, seed=5)
    o_all, s_all = _run_prefill(shape, q, k, v, g, beta, state)
    o1, s1 = _run_prefill(shape, q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state)
    o2, s2 = _run_prefill(shape, q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], s1)
    _check(np.concatenate([o1, o2]), o_all, "chunked prefill o")
    _check(s2, s_all, "chunked prefill state")


def test_zero_tokens_keeps_state():
    shape = SHAPES[0]
    q, k, v, g, beta, state = _inputs(shape, 0)
    o, s = _run_prefill(shape, q, k, v, g, beta, state)
    assert o.shape == (0, shape[1], shape[3])
    np.testing.assert_array_equal(s, state)


def test_gqa_sharing_and_bad_shapes():
    # Value heads 0..2 share key head 0 and 3..5 key head 1: swapping the key heads' inputs must swap
    # the two halves of the output.
    shape = SHAPES[0]
    q, k, v, g, beta, state = _inputs(shape, 4, seed=11)
    o, _ = _run_prefill(shape, q, k, v, g, beta, state)
    perm = [3, 4, 5, 0, 1, 2]
    o_sw, _ = _run_prefill(shape, q[:, ::-1], k[:, ::-1], v[:, perm], g[:, perm], beta[:, perm], state[perm])
    _check(o_sw, o[:, perm], "GQA head mapping")
    with pytest.raises(ValueError):
        gdn_decode(4, 6, 16, 16)
    with pytest.raises(ValueError):
        gdn_prefill(2, 6, 0, 16)


# --------------------------------------------------------------------------------------------------
# GPU (Adreno OpenCL)
# --------------------------------------------------------------------------------------------------


def _gpu_module(hk, hv, dk, dv, **kw) -> tvm.IRModule:
    return tvm.IRModule({"gdn_prefill": gdn_prefill(hk, hv, dk, dv, "float32", gpu=True, **kw),
                         "gdn_decode": gdn_decode(hk, hv, dk, dv, "float32", gpu=True, **kw)})


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_build_adreno_all_kernels(dtype):
    hk, hv, dk, dv = 16, 48, 128, 128  # the Qwen3.5-27B GDN layer
    mod = tvm.IRModule({"gdn_prefill": gdn_prefill(hk, hv, dk, dv, dtype, gpu=True),
                        "gdn_decode": gdn_decode(hk, hv, dk, dv, dtype, gpu=True)})
    for gv, func in mod.functions_items():
        assert int(func.attrs["tirx.is_scheduled"]) == 1, gv
        text = func.script()
        assert "blockIdx.x" in text and "threadIdx.x" in text, gv
    lib = tvm.tirx.build(mod, target=tvm.target.Target(ADRENO))
    kinds = [m.kind for m in lib.imports]
    assert kinds == ["opencl"], kinds
    src = lib.imports[0].inspect_source()
    for name in ("gdn_prefill", "gdn_decode"):
        assert f"__kernel void {name}_kernel(" in src, name
    # No host fallback: the host LLVM module only unpacks arguments and launches the kernels; the math
    # (exp of the decay) lives in the OpenCL code alone (a CPU build of the same kernel calls llvm.exp).
    host_ir = lib.inspect_source("ll")
    assert not re.search(r"@llvm\.exp|@expf?\b", host_ir)
    cpu_ir = tvm.tirx.build(tvm.IRModule({"main": gdn_decode(hk, hv, dk, dv, dtype)}), target="llvm")
    assert re.search(r"@llvm\.exp|@expf?\b", cpu_ir.inspect_source("ll"))


def test_gpu_build_guarded_columns():
    # Dv not a multiple of the block width: the column loop is guarded.
    mod = _gpu_module(1, 2, 8, 24, max_threads=16)
    lib = tvm.tirx.build(mod, target=tvm.target.Target(ADRENO))
    assert lib.imports[0].inspect_source().count("__kernel void") >= 2


def test_gpu_decode_state_tiles_at_qwen27b_shape():
    """qwen27b's GDN decode (16 key / 48 value heads, Dk = Dv = 128) as emitted for Adreno in fp16: 192 work-groups
    (48 heads x 4 tiles of 32 columns) of 128 work-items, each keeping 8 rows x 4 columns of the state in a
    32-float register array (the loop kernel's was a whole 128-float column), state read and written as
    16-byte float4 vectors, three barriers, every sum in float and only o stored as half."""
    from pipeline.kernels.gpu.gdn import FILL_GROUPS, plan
    from pipeline.verify.opencl_plan import ADRENO_TARGET, accumulators, opencl_kernels

    func = gdn_decode(16, 48, 128, 128, "float16", gpu=True, max_threads=256, gate_dtype="float32")
    program = opencl_kernels(func.with_attr("global_symbol", "main"), ADRENO_TARGET)
    (launch,) = program.launches("main")
    assert "grid=(4, 3, 16) block=(8, 16, 1)" in launch.describe(), launch.describe()
    p = plan(48, 128, 128, 256)
    assert (p.groups, p.work_items, p.rows * p.vc) == (192, 128, 32) and p.groups >= FILL_GROUPS
    src = program.source
    arrays = {m[1]: (m[0], int(m[2])) for m in re.findall(r"^\s*(?:__local )?(\w+) (\w+)\[(\d+)\];", src, re.M)}
    assert arrays["st_ptr"] == ("float", 32) and arrays["part_kv_ptr"] == ("float", 16 * 32), arrays
    assert max(n for name, (_, n) in arrays.items() if name != "part_kv_ptr") == 32, arrays   # no 128-float column
    assert src.count("vload4(0, state_in_ptr") == 8 and src.count("state_out_ptr +") == 8
    assert src.count("barrier(") == 3
    sums = {v: t for per in accumulators(src).values() for v, t in per.items()}
    assert {"acc_ptr", "st_ptr"} <= set(sums) and set(sums.values()) == {"float"}, sums
    assert re.search(r"o_ptr\[[^\n]*\] = \(convert_half\(", src)


def test_gpu_decode_builds_for_metal():
    """ios-metal gets the same tiled kernel (float4 state vectors and threadgroup barriers exist in Metal)."""
    metal = tvm.target.Target({"kind": "metal", "max_threads_per_block": 1024, "host": {"kind": "llvm"}})
    func = gdn_decode(2, 6, 32, 32, "float16", gpu=True, gate_dtype="float32").with_attr("global_symbol", "main")
    src = tvm.tirx.build(tvm.IRModule({"main": func}), target=metal).imports[0].inspect_source()
    assert "kernel void" in src and src.count("threadgroup_barrier") == 3 and "float4" in src


def _pocl():
    from pipeline.verify.opencl import find_opencl_device

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform found (install pocl-opencl-icd)")
    from pipeline.verify.opencl import run_on_pocl
    from pipeline.verify.opencl_plan import opencl_kernels

    return opencl_kernels, run_on_pocl


# (Hk, Hv, Dk, Dv), max_threads; decode (kernels/gpu/gdn.py): rows past Dk in the last row group (36 = 8 x 5 - 4),
# columns past Dv in the last tile with 2- and 1-column vectors (30, 27 columns)
@pytest.mark.parametrize("shape,max_threads", [(SHAPES[0], 128), ((1, 2, 8, 24), 16), ((1, 2, 36, 30), 256),
                                               ((1, 3, 20, 27), 256)])
def test_gpu_kernels_on_pocl(shape, max_threads):
    opencl_kernels, run_on_pocl = _pocl()
    hk, hv, dk, dv = shape
    n = 6
    q, k, v, g, beta, state = _inputs(shape, n, seed=2)
    o_np, s_np = gdn_reference(q, k, v, g, beta, state)

    prog = opencl_kernels(gdn_prefill(*shape, "float32", gpu=True, max_threads=max_threads), ADRENO)
    o = np.zeros((n, hv, dv), np.float32)
    s = np.zeros_like(state)
    run_on_pocl(prog, "main", [q, k, v, g, beta, state.copy(), o, s])
    _check(o, o_np, "pocl prefill o")
    _check(s, s_np, "pocl prefill state")

    prog = opencl_kernels(gdn_decode(*shape, "float32", gpu=True, max_threads=max_threads), ADRENO)
    o1 = np.zeros((hv, dv), np.float32)
    s1 = np.zeros_like(state)
    run_on_pocl(prog, "main", [q[0], k[0], v[0], g[0], beta[0], state.copy(), o1, s1])
    o_ref, s_ref = gdn_reference(q[:1], k[:1], v[:1], g[:1], beta[:1], state)
    _check(o1, o_ref[0], "pocl decode o")
    _check(s1, s_ref, "pocl decode state")


def test_gpu_decode_on_pocl_at_qwen27b_shape():
    """qwen27b's GDN decode (16 / 48 heads of 128: 192 work-groups of 128) on PoCL against float64 numpy (~1 s)."""
    opencl_kernels, run_on_pocl = _pocl()
    shape = (16, 48, 128, 128)
    q, k, v, g, beta, state = _inputs(shape, 1, seed=21)
    prog = opencl_kernels(gdn_decode(*shape, "float32", gpu=True, max_threads=256), ADRENO)
    out = run_on_pocl(prog, "main", [q[0], k[0], v[0], g[0], beta[0], state.copy(), np.zeros(v.shape[1:], np.float32),
                                     np.zeros_like(state)])
    o_ref, s_ref = gdn_reference(q, k, v, g, beta, state)
    _check(out[6], o_ref[0], "pocl decode o (qwen27b)")
    _check(out[7], s_ref, "pocl decode state (qwen27b)")


def test_float16_activations_llvm():
    # fp16 q/k/v/g/beta/o with the fp32 state; compare with the reference on the fp16-rounded inputs.
    shape, n = SHAPES[0], 5
    q, k, v, g, beta, state = _inputs(shape, n, seed=13)
    half = [x.astype(np.float16) for x in (q, k, v, g, beta)]
    func = gdn_prefill(*shape, "float16")
    fn = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(LLVM))["main"]
    dev = tvm.cpu()
    o = tvm.runtime.tensor(np.zeros((n, shape[1], shape[3]), np.float16), dev)
    s = tvm.runtime.tensor(np.zeros_like(state), dev)
    fn(*[tvm.runtime.tensor(x, dev) for x in [*half, state]], o, s)
    o_np, s_np = gdn_reference(*half, state)
    assert float(np.abs(o.numpy().astype(np.float64) - o_np).max()) <= 2e-3 * max(1.0, np.abs(o_np).max())
    _check(s.numpy(), s_np, "fp16 prefill state")


def test_relax_call_tir_and_dlight_keep_gpu_kernel():
    from tvm import relax
    from tvm.s_tir import dlight as dl

    # dlight leaves the hand-scheduled GPU variant untouched.
    gpu_mod = tvm.IRModule({"gdn_prefill": gdn_prefill(*SHAPES[0], gpu=True)})
    with tvm.target.Target(ADRENO):
        out = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(gpu_mod)
    tvm.ir.assert_structural_equal(out["gdn_prefill"], gpu_mod["gdn_prefill"])

    # The kernel is a call_tir callee with outputs (o, new state), symbolic in the token count.
    hk, hv, dk, dv = SHAPES[0]
    n = tvm.tirx.Var("n", "int64")
    ins = [relax.Var(name, relax.TensorType(shp, "float32")) for name, shp in (
        ("q", (n, hk, dk)), ("k", (n, hk, dk)), ("v", (n, hv, dv)), ("g", (n, hv)), ("beta", (n, hv)),
        ("state", (hv, dk, dv)))]
    bb = relax.BlockBuilder()
    with bb.function("main", ins):
        gv = bb.add_func(gdn_prefill(hk, hv, dk, dv), "gdn_prefill")
        with bb.dataflow():
            res = bb.emit(relax.call_tir(gv, ins, out_ty=[relax.TensorType((n, hv, dv), "float32"),
                                                          relax.TensorType((hv, dk, dv), "float32")]))
            res = bb.emit_output(res)
        bb.emit_func_output(res)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target=tvm.target.Target(LLVM)), tvm.cpu())
    data = _inputs(SHAPES[0], 4, seed=17)
    o, s = vm["main"](*[tvm.runtime.tensor(x) for x in data])
    o_np, s_np = gdn_reference(*data)
    _check(o.numpy(), o_np, "relax o")
    _check(s.numpy(), s_np, "relax state")
