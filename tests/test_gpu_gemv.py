"""The GPU decode GEMV of KN-packed weights (pipeline/kernels/gpu/gemv.py): its launch shapes at the shapes of
the supported models, its emitted OpenCL (split-K, float accumulators, 16-byte code loads), and its results
executed on PoCL (fp32 twin: PoCL has no fp16) against the same fused PrimFunc built by LLVM and against numpy
on weights packed by the project's own quantizers. Tolerance: 1e-4 of the output's largest magnitude."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import te

from pipeline.compiler.schedule import schedule_module
from pipeline.kernels.gpu import gemv
from pipeline.verify.opencl import find_opencl_device, run_on_llvm, run_on_pocl
from pipeline.verify.opencl_plan import ADRENO_TARGET, opencl_kernels

TOL = 1e-4
# (K, N) of every decode GEMV of the supported families: SmolLM2-135M (qkv, o, gate_up, down, the 49152
# lm_head), Qwen3 0.6B / 32B, qwen27b (attention with its gate, GDN in_proj_qkvz / in_proj_ba / out_proj, MLP,
# the 248320-wide lm_head whole and split in two by max_buffer_bytes).
MODEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152),
                (1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936),
                (5120, 10240), (8192, 5120), (5120, 51200), (25600, 5120), (5120, 151936),
                (5120, 14336), (6144, 5120), (5120, 34816), (17408, 5120), (5120, 16384), (5120, 96),
                (5120, 248320), (5120, 124160)]


def fused_gemv(fmt: str, k: int, n: int, dtype: str = "float32"):
    """The fused one-token GEMV as models/layers.py's TE and the fuse stage make it: (codes, scales, x, out)."""
    from pipeline.formats import FORMATS
    from pipeline.models import layers

    spec = FORMATS[fmt]
    words = -(-k // spec.codes_per_word)
    codes = te.placeholder((words, n), spec.code_dtype, name="codes")
    scales = te.placeholder((-(-k // spec.group), n), dtype, name="scales")
    if fmt == "q4":
        deq = layers.dequantize_te(codes, scales, "KN", k, n, dtype)
    elif fmt == "q8":
        deq = layers.dequantize_q8_te(codes, scales, "KN", k, n, dtype)
    else:
        deq = layers.dequantize_ternary_te(codes, scales, fmt, "KN", k, n, dtype)
    x = te.placeholder((1, 1, k), dtype, name="x")
    r = te.reduce_axis((0, k), name="k")
    out = te.compute((1, 1, n), lambda a, b, j: te.sum(x[a, b, r] * deq[r, j], axis=r), name="matmul")
    return te.create_prim_func([codes, scales, x, out]).with_attr("global_symbol", "main")


def packed_weights(fmt: str, k: int, n: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, fp32 scales, dense W^T [K, N] float64) of a random weight, packed KN by the project's quantizers."""
    from pipeline.quant import quantize, ternary

    w = rng.standard_normal((n, k)).astype(np.float32)
    if fmt == "q4":
        codes, scales = quantize.quantize_q4(w, "KN")
        dense = quantize.dequantize_q4(codes, scales, "KN")
    elif fmt == "q8":
        codes, scales = quantize.quantize_q8(w, "KN")
        dense = quantize.dequantize_q8(codes, scales, "KN")
    else:
        codes, scales = ternary.quantize_ternary(w, fmt, "KN")
        dense = ternary.dequantize_ternary(codes, scales, fmt, k, "KN")
    dense = np.asarray(dense, np.float64).T      # the dequantizers answer [N, K]
    assert dense.shape == (k, n)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scales.astype(np.float32)), dense


@pytest.mark.parametrize("fmt", ["q4", "t2", "b1"])
def test_every_model_shape_fills_the_gpu_with_16_byte_loads(fmt):
    for k, n in MODEL_SHAPES:
        p = gemv.plan(fmt, n, k)
        assert p is not None, (fmt, k, n)
        assert p.groups >= gemv.MIN_GROUPS, (fmt, k, n, p.describe())
        if n % 64 == 0:     # every shape but qwen27b's 96-wide in_proj_ba, where 8-byte loads give 48 groups
            assert p.v * p.spec.code_bytes == 16, (fmt, k, n, p.describe())
        assert p.tk > 1 and p.tn * p.tk <= gemv.WG_ITEMS, (fmt, k, n, p.describe())


def test_q8_plans():
    """q8 codes are one byte: 16 columns per load where N leaves 48 work-groups, else narrower loads."""
    assert gemv.plan("q8", 49152, 576).v == 16
    assert gemv.plan("q8", 5120, 17408).v == 16 and gemv.plan("q8", 5120, 17408).groups >= gemv.MIN_GROUPS
    small = gemv.plan("q8", 576, 576)
    assert small.groups >= gemv.MIN_GROUPS and small.v == 8


def _source(fmt: str, k: int, n: int, dtype: str) -> tuple[str, list]:
    func = fused_gemv(fmt, k, n, dtype)
    mod, records = schedule_module(tvm.IRModule({"main": func}), tvm.target.Target(ADRENO_TARGET),
                                   ("dequant_gemv", "fallback"), "gpu")
    assert [r.rule for r in records] == ["dequant_gemv"], records
    program = opencl_kernels(mod, ADRENO_TARGET)
    return program.source, program.launches("main")


@pytest.mark.parametrize("fmt,k,n", [("q4", 576, 960), ("q4", 5120, 2048), ("t2", 576, 576), ("q8", 576, 3072)])
def test_fp16_source_accumulates_in_float(fmt, k, n):
    """The phone's build (fp16 x, scales, out): codes widened to float, a float accumulator, one barrier,
    16-byte code loads, the launch of the plan."""
    source, launches = _source(fmt, k, n, "float16")
    p = gemv.plan(fmt, n, k)
    assert len(launches) == 1
    glob, local = launches[0].sizes()
    assert glob[0] // local[0] == p.groups and local[0] * local[1] == p.tn * p.tk
    assert re.search(r"\bfloat\d* acc_ptr\[", source) and not re.search(r"\bhalf\d* (acc|part|total)_ptr", source)
    assert source.count("barrier(") == 1
    vec = {"q8": f"char{p.v}"}.get(fmt, f"uint{p.v}")
    assert f"{vec} word_ptr" in source and f"vload{p.v}(0, w_ptr" in source
    assert "convert_half(total_ptr[0])" in source


needs_pocl = pytest.mark.skipif(find_opencl_device() is None, reason="no OpenCL platform (install pocl-opencl-icd)")


@needs_pocl
@pytest.mark.parametrize("fmt,k,n", [("q4", 576, 960), ("q4", 576, 576), ("q4", 1536, 576), ("q4", 5120, 256),
                                     ("q4", 17408, 96), ("q8", 576, 576), ("q8", 5120, 128), ("t2", 576, 960),
                                     ("t2", 5120, 256), ("b1", 576, 576)])
def test_kernel_on_pocl_matches_llvm_and_numpy(fmt, k, n):
    rng = np.random.default_rng(k + n)
    codes, scales, dense = packed_weights(fmt, k, n, rng)
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    func = fused_gemv(fmt, k, n)
    mod, records = schedule_module(tvm.IRModule({"main": func}), tvm.target.Target(ADRENO_TARGET),
                                   ("dequant_gemv", "fallback"), "gpu")
    assert records[0].rule == "dequant_gemv"
    args = [codes, scales, x, np.zeros((1, 1, n), np.float32)]
    got = run_on_pocl(opencl_kernels(mod, ADRENO_TARGET), "main", [a.copy() for a in args])[-1]
    ref = run_on_llvm(func, [a.copy() for a in args])[-1]
    exact = x[0, 0].astype(np.float64) @ dense
    scale = float(np.abs(exact).max())
    assert scale > 0
    assert float(np.abs(got[0, 0] - exact).max()) <= TOL * scale, "PoCL vs numpy"
    assert float(np.abs(got - ref).max()) <= TOL * scale, "PoCL vs LLVM"


def test_other_functions_are_left_to_the_next_rule():
    """A prompt (symbolic rows), an NK layout and an LLVM target: the rule answers None."""
    rule = gemv.GPUDequantGEMV()
    target = tvm.target.Target(ADRENO_TARGET)
    assert rule.apply(fused_gemv("q4", 576, 960), target, False) is not None
    assert rule.apply(fused_gemv("q4", 576, 960), tvm.target.Target({"kind": "llvm"}), False) is None
    m = te.var("m")
    codes = te.placeholder((72, 960), "uint32", name="codes")
    scales = te.placeholder((18, 960), "float32", name="scales")
    from pipeline.models import layers

    deq = layers.dequantize_te(codes, scales, "KN", 576, 960, "float32")
    x = te.placeholder((1, m, 576), "float32", name="x")
    r = te.reduce_axis((0, 576), name="k")
    out = te.compute((1, m, 960), lambda a, b, j: te.sum(x[a, b, r] * deq[r, j], axis=r), name="matmul")
    assert rule.apply(te.create_prim_func([codes, scales, x, out]), target, False) is None
    nk, nk_scales = te.placeholder((960, 72), "uint32", name="codes"), te.placeholder((960, 18), "float32", name="s")
    deq = layers.dequantize_te(nk, nk_scales, "NK", 576, 960, "float32")
    x = te.placeholder((1, 1, 576), "float32", name="x")
    out = te.compute((1, 1, 960), lambda a, b, j: te.sum(x[a, b, r] * deq[r, j], axis=r), name="matmul")
    assert rule.apply(te.create_prim_func([nk, nk_scales, x, out]), target, False) is None


# ------------------------------------------------------------------------------------------- fp32 sums
def smollm2_fp16_kernels() -> dict[str, tuple[str, str]]:
    """{function: (rule, OpenCL C)} of every dequantize + matmul / GEMV of the SmolLM2 android-adreno q4f16
    build (the real shapes, one layer, the 49152-wide lm_head): the build's own stages and rules."""
    import dataclasses

    from test_model_kernels_pocl import SMOLLM2_SHAPE
    from tvm import tirx

    from pipeline.config import load_target
    from pipeline.models.layers import LayerFactory
    from pipeline.models.llama import DecoderConfig, DecoderLM
    from pipeline.stages import Defined, fuse

    shape = {**SMOLLM2_SHAPE, "vocab_size": 49152, "num_hidden_layers": 1}
    target = load_target("android-adreno")
    target = dataclasses.replace(target, tvm_target={**target.tvm_target, "host": {"kind": "llvm"}})
    module = DecoderLM(DecoderConfig.from_hf(shape), LayerFactory("float16", "q4", "float16", "KN", scale_dtype="float16"),
                       target.tvm())
    mod, params = module.export_tvm(spec=module.export_spec())
    fused = fuse(Defined(module, params, mod, "KN", "float16"), target)
    out = {}
    for gv, func in fused.functions_items():
        name = gv.name_hint
        if isinstance(func, tirx.PrimFunc) and "matmul" in name:
            single = tvm.IRModule({name: func.with_attr("global_symbol", name)})
            scheduled, records = schedule_module(single, target.tvm(), target.schedule_rules, "gpu")
            out[name] = (records[0].rule, opencl_kernels(scheduled, target.tvm()).source)
    return out


def test_smollm2_fp16_gemv_and_matmul_kernels_sum_in_float():
    """Each GEMV (decode) and matmul (prefill) kernel of the phone build keeps its sums in float registers:
    read from the emitted OpenCL C (private arrays updated from themselves with a `+`)."""
    from pipeline.verify.opencl_plan import accumulators

    kernels = smollm2_fp16_kernels()
    rules = sorted(rule for rule, _ in kernels.values())
    assert rules.count("dequant_gemv") == 5 and rules.count("matmul_f32") == 5, rules   # qkv, o, gate_up, down, lm_head
    for name, (rule, source) in kernels.items():
        acc = {v: t for per in accumulators(source).values() for v, t in per.items()}
        assert acc, f"{name} ({rule}): no accumulator found in its OpenCL"
        assert all(re.fullmatch(r"float\d*", t) for t in acc.values()), f"{name} ({rule}): {acc}"
        if rule == "dequant_gemv":     # ours holds no half registers at all
            assert not re.search(r"\bhalf\d* \w+\[\d+\];", source), name


def test_widened_prefill_matmul_is_closer_to_exact_than_fp16_sums():
    """matmul_f32's function (float32 dequantize and sums, one cast) built by LLVM in fp16 against float64
    numpy: within the output's fp16 rounding, and no worse than the fused function's fp16 sums."""
    from pipeline.compiler.matmul_f32 import widened

    k, n, m = 1536, 64, 3
    rng = np.random.default_rng(3)
    codes, scales, _ = packed_weights("q4", k, n, rng)
    x = rng.standard_normal((1, m, k)).astype(np.float16)
    seq = te.var("seq_len", "int64")
    from pipeline.models import layers

    c = te.placeholder(codes.shape, "uint32", name="codes")
    s = te.placeholder(scales.shape, "float16", name="scales")
    xt = te.placeholder((1, seq, k), "float16", name="x")
    deq = layers.dequantize_te(c, s, "KN", k, n, "float16")
    r = te.reduce_axis((0, k), name="k")
    out = te.compute((1, seq, n), lambda a, b, j: te.sum(xt[a, b, r] * deq[r, j], axis=r), name="matmul")
    fused = te.create_prim_func([c, s, xt, out])
    wide = widened(fused)
    assert wide is not None
    args = [codes, scales.astype(np.float16), x, np.zeros((1, m, n), np.float16)]
    exact = x[0].astype(np.float64) @ quantized_dense(codes, scales.astype(np.float16))
    got = run_on_llvm(wide.with_attr("global_symbol", "main"), [a.copy() for a in args])[-1][0].astype(np.float64)
    half = run_on_llvm(fused.with_attr("global_symbol", "main"), [a.copy() for a in args])[-1][0].astype(np.float64)
    scale = float(np.abs(exact).max())
    assert float(np.abs(got - exact).max()) <= 2e-3 * scale
    assert float(np.abs(got - exact).max()) <= float(np.abs(half - exact).max())


def quantized_dense(codes: np.ndarray, scales16: np.ndarray) -> np.ndarray:
    from pipeline.quant import quantize

    return np.asarray(quantize.dequantize_q4(codes, scales16, "KN"), np.float64).T


def test_kernel_keeps_the_fused_functions_buffer_shapes():
    """The build's PoCL verdicts pair a build kernel with its fp32 twin by name and printed buffer shapes; the
    fused functions relax makes have int64 dims, and so does the kernel."""
    kernel, _ = gemv.kn_gemv_like(fused_gemv("q4", 576, 960))
    shapes = [[d for d in p.shape] for p in kernel.params]
    assert [[int(d) for d in dims] for dims in shapes] == [[72, 960], [18, 960], [1, 1, 576], [1, 1, 960]]
    assert all(str(d.ty) == "int64" for dims in shapes for d in dims)


def _prompt_matmul(k: int, n: int, dtype: str):
    """A prompt's fused KN q4 dequantize + matmul as the fuse stage makes it (seq_len symbolic)."""
    from pipeline.models import layers

    i64 = lambda v: tvm.tirx.IntImm("int64", v)   # noqa: E731 - every dim int64, as the fused function's
    seq = te.var("seq_len", "int64")
    c = te.placeholder((i64(k // 8), i64(n)), "uint32", name="codes")
    s = te.placeholder((i64(k // 32), i64(n)), dtype, name="scales")
    xt = te.placeholder((i64(1), seq, i64(k)), dtype, name="x")
    deq = layers.dequantize_te(c, s, "KN", i64(k), i64(n), dtype)
    r = te.reduce_axis((i64(0), i64(k)), name="k")
    out = te.compute((i64(1), seq, i64(n)), lambda a, b, j: te.sum(xt[a, b, r] * deq[r, j], axis=r), name="matmul")
    return te.create_prim_func([c, s, xt, out]).with_attr("global_symbol", "main")


@pytest.mark.parametrize("n", [16480, 96])
def test_prefill_matmul_with_n_an_odd_multiple_of_32_sums_in_float(n):
    """qwen27b's GDN in_proj (16480 = 515 x 32 outputs) and in_proj_ba (96): dlight's Adreno Matmul config
    cannot vectorize their widened store; matmul_f32 schedules them with its narrower config, fp32 sums."""
    mod, records = schedule_module(tvm.IRModule({"main": _prompt_matmul(5120, n, "float16")}),
                                   tvm.target.Target(ADRENO_TARGET), ("matmul_f32", "fallback"), "gpu")
    assert [r.rule for r in records] == ["matmul_f32"], records
    source = opencl_kernels(mod, ADRENO_TARGET).source
    assert re.search(r"\bfloat\d* matmul\w*_local_ptr\[", source) and not re.search(r"\bhalf\d* matmul\w*_ptr\[", source)


@needs_pocl
def test_narrow_matmul_config_matches_numpy_on_pocl():
    """The narrower config's schedule (the fp32 function: PoCL has no fp16) at N = 96 and a prompt of 5 rows."""
    from pipeline.compiler.matmul_f32 import _NarrowMatmul
    from pipeline.verify.opencl import run_on_pocl

    k, n, m = 256, 96, 5
    rng = np.random.default_rng(5)
    codes, scales, dense = packed_weights("q4", k, n, rng)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    func = _prompt_matmul(k, n, "float32")
    sch = _NarrowMatmul().apply(func, tvm.target.Target(ADRENO_TARGET), False)
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("tirx.is_scheduled", True)})
    got = run_on_pocl(opencl_kernels(mod, ADRENO_TARGET), "main",
                      [codes, scales, x, np.zeros((1, m, n), np.float32)])[-1][0]
    exact = x[0].astype(np.float64) @ dense
    assert float(np.abs(got - exact).max()) <= TOL * float(np.abs(exact).max())
