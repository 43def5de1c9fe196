"""CPU schedules of the dequantize-matmul (cpu_schedule.py): decode keeps the unpack in registers, prefill
dequantizes each output tile once for all rows; KN codes get the hand-written kernels (gemv.py / x86.py for one
token, prefill.py for a prompt); all compute what the unscheduled function computes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from pipeline.config import load_target
from pipeline.kernels.cpu import gemv as cpu_gemv
from pipeline.kernels.cpu import packed, probe, recognize, x86
from pipeline.kernels.cpu.probe import has_avx2, has_vnni
from pipeline.kernels.cpu.schedule import CPUInlineParallel
from pipeline.models.layers import dequantize_q8_te, dequantize_te
from pipeline.op_classes import classify

K, N = 96, 72   # K: 3 groups of 32; N: 3 prefill tiles


def _dequant_matmul(layout: str, bits: int, rows):
    x = te.placeholder((1, rows, K), "float32", name="x")
    if bits == 4:
        shape = (N, K // 8) if layout == "NK" else (K // 8, N)
        w = te.placeholder(shape, "uint32", name="w")
        deq = dequantize_te
    else:
        w = te.placeholder((N, K) if layout == "NK" else (K, N), "int8", name="w")
        deq = dequantize_q8_te
    s = te.placeholder((N, K // 32) if layout == "NK" else (K // 32, N), "float16", name="s")
    wt = deq(w, s, layout, K, N, "float32")
    k = te.reduce_axis((0, K), name="k")
    out = te.compute((1, rows, N), lambda b, i, j: te.sum(x[b, i, k] * wt[k, j], axis=k), name="matmul")
    return te.create_prim_func([x, w, s, out]).with_attr("global_symbol", "main")


def _run(func, rows: int, target=None) -> np.ndarray:
    rng = np.random.default_rng(0)
    args = []
    for p in func.params:
        shape = [rows if not isinstance(d, tirx.IntImm) else int(d) for d in p.shape]
        dt = str(p.dtype)
        if dt == "uint32":
            a = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
        elif dt == "int8":
            a = rng.integers(-127, 128, shape).astype(np.int8)
        else:
            a = (rng.standard_normal(shape) * (0.05 if dt == "float16" else 1)).astype(dt)
        args.append(tvm.runtime.tensor(a))
    tvm.compile(tvm.IRModule({"main": func}), target=target or tvm.target.Target({"kind": "llvm"}))["main"](*args)
    return args[-1].numpy()


@pytest.mark.parametrize("layout,bits", [("NK", 4), ("NK", 8)])
def test_prefill_tiles_dequantize_once_per_tile(layout, bits):
    """NK codes (KN ones get the hand-written kernel below): the schedule's scratch tile per task."""
    rows = tirx.Var("seq_len", "int64")
    func = _dequant_matmul(layout, bits, rows)
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    text = sch.mod["main"].script()
    # the dequantize block sits inside the parallel tile loop, writing a (K x tile) scratch only
    assert "T.parallel" in text and text.index("T.parallel") < text.index('sblock("dequantize')
    for n_rows in (1, 7, 33):
        want = _run(func, n_rows)
        got = _run(sch.mod["main"], n_rows)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _prompt_matmul(fmt: str, k: int, n: int, relax_order: bool):
    """A prompt's rows (symbolic) times KN codes of `fmt` (q4, q8, t2, b1)."""
    from pipeline.models.layers import dequantize_ternary_te
    from pipeline.quant import ternary as tern

    rows = tirx.Var("seq_len", "int64")
    x = te.placeholder((1, rows, k), "float32", name="x")
    if fmt in ("t2", "b1"):
        w = te.placeholder((tern.packed_len(fmt, k), n), "uint32", name="w")
        s = te.placeholder((tern.n_groups(k), n), "float16", name="s")
        wt = dequantize_ternary_te(w, s, fmt, "KN", k, n, "float32")
    elif fmt == "q4":
        w = te.placeholder((k // 8, n), "uint32", name="w")
        s = te.placeholder((k // 32, n), "float16", name="s")
        wt = dequantize_te(w, s, "KN", k, n, "float32")
    else:
        w = te.placeholder((k, n), "int8", name="w")
        s = te.placeholder((k // 32, n), "float16", name="s")
        wt = dequantize_q8_te(w, s, "KN", k, n, "float32")
    r = te.reduce_axis((0, k), name="k")
    out = te.compute((1, rows, n), lambda b, i, j: te.sum(x[b, i, r] * wt[r, j], axis=r), name="matmul")
    return te.create_prim_func([w, s, x, out] if relax_order else [x, w, s, out]).with_attr("global_symbol", "main")


@pytest.mark.parametrize("fmt,k,n", [("q4", 96, 72), ("q4", 64, 40), ("q8", 96, 80), ("t2", 192, 48),
                                     ("b1", 192, 48)])
@pytest.mark.parametrize("relax_order", [False, True])
def test_prefill_kn_matmul_is_the_hand_written_kernel(fmt, k, n, relax_order):
    """A prompt times KN codes becomes cpu_prefill's kernel (rows four at a time over a dequantized tile,
    the rest one at a time): the fused TE's outputs up to fp32 summation order, for row counts below, at
    and past the register tile (t2 with K = 192: a short last group of 64)."""
    from pipeline.kernels.cpu.recognize import match_packed_kn_gemv

    func = _prompt_matmul(fmt, k, n, relax_order)
    assert match_packed_kn_gemv(func, rows="prompt")[0] == fmt and match_packed_kn_gemv(func) is None
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    text = sch.mod["main"].script()
    assert 'sblock("dequantize' not in text and "float32x8" in text and "T.parallel" in text
    want_class = "dequant-matmul-ternary" if fmt in ("t2", "b1") else "dequant-matmul"
    assert classify(f"fused_dequantize_{fmt}_kn_matmul", sch.mod["main"]) == want_class
    for n_rows in (1, 4, 7, 33):
        want = _run(func, n_rows)
        np.testing.assert_allclose(_run(sch.mod["main"], n_rows), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_decode_keeps_the_unpack_in_registers():
    """One row (a constant): no scratch tile, the dequantize is inlined into the GEMV."""
    func = _dequant_matmul("KN", 4, 1)
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    text = sch.mod["main"].script()
    assert 'sblock("dequantize' not in text
    np.testing.assert_allclose(_run(sch.mod["main"], 1), _run(func, 1), rtol=1e-5, atol=1e-4)


def _float_gemv_func(weight_dtype: str, k_last: bool = True, bias: bool = False, relax_order: bool = False):
    """One token times float weights: NT (W[n, k], read along K) or NN (W[k, n]), widened to fp32 in a
    separate cast block (as q0f16 on a CPU target fuses it), optionally with a bias-add epilogue;
    `relax_order`: the weight first, as relax's fused functions take it."""
    x = te.placeholder((1, 1, K), "float32", name="x")
    w = te.placeholder((N, K) if k_last else (K, N), weight_dtype, name="w")
    wide = te.compute(w.shape, lambda a, b: w[a, b].astype("float32"), name="cast")
    k = te.reduce_axis((0, K), name="k")
    out = te.compute((1, 1, N), lambda b, i, j: te.sum(x[b, i, k] * (wide[j, k] if k_last else wide[k, j]), axis=k),
                     name="NT_matmul")
    args = [w, x] if relax_order else [x, w]
    if bias:
        bvec = te.placeholder((N,), "float32", name="bias")
        out = te.compute((1, 1, N), lambda b, i, j: out[b, i, j] + bvec[j], name="add")
        args.append(bvec)
    return te.create_prim_func([*args, out]).with_attr("global_symbol", "main")


@pytest.mark.parametrize("weight_dtype,relax_order", [("float16", True), ("float16", False), ("float32", True)])
def test_float_gemv_is_the_hand_written_kernel(weight_dtype, relax_order, monkeypatch):
    """q0f16 / q0f32 decode GEMVs without an epilogue: gemv.float_nt_gemv (4 rows at a time, the rows
    ahead prefetched), declared a gemv, with the function's own parameter order; same result as the
    unscheduled function up to fp32 reassociation."""
    import pipeline.kernels.cpu.schedule as cs

    monkeypatch.setattr(cs, "SERIAL_WORK", 1)     # this test's 72 x 96 GEMV is below the fork-join size
    func = _float_gemv_func(weight_dtype, relax_order=relax_order)
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    text = sch.mod["main"].script()
    assert "llvm.prefetch" in text and "T.parallel" in text and "sblock(" not in text.replace('sblock("root"', "")
    assert [str(p.dtype) for p in sch.mod["main"].params] == [str(p.dtype) for p in func.params]
    assert classify("fused_cast_NT_matmul", sch.mod["main"]) == "gemv"
    np.testing.assert_allclose(_run(sch.mod["main"], 1), _run(func, 1), rtol=1e-5, atol=1e-4)


def test_float_gemv_below_the_fork_join_size_is_left_to_the_schedules():
    """A GEMV smaller than SERIAL_WORK multiply-adds is not worth two threads: not the hand-written kernel."""
    from pipeline.kernels.cpu.recognize import match_float_nt_gemv

    func = _float_gemv_func("float16")
    assert match_float_nt_gemv(func, min_work=N * K + 1) is None
    assert match_float_nt_gemv(func, min_work=N * K) == (N, K, "float16", ("x", "w", "out"))


@pytest.mark.parametrize("weight_dtype,bias", [("float16", False), ("float32", False), ("float16", True)])
def test_float_gemv_splits_k_into_vector_partial_sums(weight_dtype, bias, monkeypatch):
    """q0f16 / q0f32 decode GEMVs the hand-written kernel does not take (a bias-add epilogue; any, called
    directly): K split into FLOAT_LANES partial sums (rfactor), the weight's cast inlined and a bias add done
    per output tile, same result as the unscheduled function (fp32 reassociation only)."""
    import pipeline.kernels.cpu.schedule as cs

    monkeypatch.setattr(cs, "SERIAL_WORK", 1)     # this test's 72 x 96 GEMV is below the fork-join size
    func = _float_gemv_func(weight_dtype, bias=bias)
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False) if bias else cs._float_gemv(func)
    text = sch.mod["main"].script()
    assert 'sblock("NT_matmul_rf' in text and "T.parallel" in text
    assert 'sblock("cast"' not in text
    if bias:
        assert text.index("T.parallel") < text.index('sblock("add"')
    np.testing.assert_allclose(_run(sch.mod["main"], 1), _run(func, 1), rtol=1e-5, atol=1e-4)


def test_float_gemv_leaves_weights_read_across_k_alone(monkeypatch):
    """W[k, n] read along K would gather: not split (the general path handles it)."""
    import pipeline.kernels.cpu.schedule as cs

    monkeypatch.setattr(cs, "SERIAL_WORK", 1)
    func = _float_gemv_func("float32", k_last=False)
    assert cs._float_gemv(func) is None
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    np.testing.assert_allclose(_run(sch.mod["main"], 1), _run(func, 1), rtol=1e-5, atol=1e-4)


def _float_prefill_func(weight_dtype: str, rows):
    """A prompt's rows times NT float weights widened in a cast block (q0f16 / q0f32 prefill on a CPU)."""
    x = te.placeholder((1, rows, K), "float32", name="x")
    w = te.placeholder((N, K), weight_dtype, name="w")
    wide = te.compute(w.shape, lambda a, b: w[a, b].astype("float32"), name="cast")
    k = te.reduce_axis((0, K), name="k")
    out = te.compute((1, rows, N), lambda b, i, j: te.sum(x[b, i, k] * wide[j, k], axis=k), name="NT_matmul")
    return te.create_prim_func([x, w, out]).with_attr("global_symbol", "main")


@pytest.mark.parametrize("weight_dtype", ["float16", "float32"])
def test_float_prefill_widens_each_weight_tile_once(weight_dtype):
    """q0f16 prefill: the cast writes a transposed [k, tile] fp32 scratch inside the parallel tile loop and
    every row reuses it; the result is the unscheduled function's (the same k order: bit-for-bit up to
    LLVM's contraction of multiply + add)."""
    rows = tirx.Var("seq_len", "int64")
    func = _float_prefill_func(weight_dtype, rows)
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    text = sch.mod["main"].script()
    assert "T.parallel" in text and text.index("T.parallel") < text.index('sblock("cast"')
    for n_rows in (1, 5, 33):
        np.testing.assert_allclose(_run(sch.mod["main"], n_rows), _run(func, n_rows), rtol=1e-5, atol=1e-5)


def _q4_gemv_func(n: int, relax_order: bool):
    """One token times KN q4 codes, parameters in a te test's order (x, codes, scales, out) or in the order
    relax's fusion gives them (codes, scales, x, out)."""
    x = te.placeholder((1, 1, K), "float32", name="x")
    w = te.placeholder((K // 8, n), "uint32", name="w")
    s = te.placeholder((K // 32, n), "float16", name="s")
    wt = dequantize_te(w, s, "KN", K, n, "float32")
    k = te.reduce_axis((0, K), name="k")
    out = te.compute((1, 1, n), lambda b, i, j: te.sum(x[b, i, k] * wt[k, j], axis=k), name="matmul")
    args = [w, s, x, out] if relax_order else [x, w, s, out]
    return te.create_prim_func(args).with_attr("global_symbol", "main")


# 3, 2 and 1 AVX2 vectors of outputs in registers; 192: a task's span holds 4 of those 24-column tiles
@pytest.mark.parametrize("n", [72, 80, 40, 192])
@pytest.mark.parametrize("relax_order", [False, True])
def test_decode_q4_gemv_is_the_hand_written_kernel(n, relax_order):
    """The one-token KN q4 GEMV becomes gemv.py's kernel (codes masked in place against prescaled x, group
    sums of x, vector-typed tiles): the same outputs as the fused TE up to fp32 summation order."""
    from pipeline.kernels.cpu.recognize import match_packed_kn_gemv

    func = _q4_gemv_func(n, relax_order)
    assert match_packed_kn_gemv(func) is not None
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    text = sch.mod["main"].script()
    assert 'sblock("dequantize' not in text and "float32x8" in text and "T.parallel" in text
    assert classify("fused_dequantize_q4_kn_matmul", sch.mod["main"]) == "dequant-gemv"   # coverage's class
    want = _run(func, 1)
    np.testing.assert_allclose(_run(sch.mod["main"], 1), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


HOST = load_target("host-cpu").tvm()     # this machine's -mcpu
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})   # AVX2 without AVX-512 VNNI: the int16 kernels


@pytest.mark.skipif(not has_avx2(HOST), reason="the int16 dot-product GEMV needs x86 AVX2; this CPU has none")
@pytest.mark.parametrize("n", [72, 40, 192])
@pytest.mark.parametrize("threads", [1, 3])    # 3: K's 3 groups split 3 ways, partial sums added at the end
def test_decode_q4_gemv_takes_int16_dot_products_on_avx2(n, threads, monkeypatch):
    """With AVX2 (host-cpu's -mcpu here) the q4 GEMV is the pmaddwd kernel: x quantized per group of 32 to
    int16, so the result matches the fp32 TE within 2^-15 of each group's largest |x| times the weights'
    magnitude — measured ~2e-5 relative; bounded here at 2e-4 of the largest output."""
    from pipeline.kernels.cpu.packed import k_splits

    monkeypatch.setattr(probe, "build_threads", lambda: threads)
    assert k_splits(n, K, threads) == threads
    func = _q4_gemv_func(n, relax_order=True)
    sch = CPUInlineParallel().apply(func, AVX2, False)
    text = sch.mod["main"].script()
    assert "pmadd.wd" in text and 'sblock("dequantize' not in text and "T.parallel" in text
    assert "pmadd.wd" not in CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False).mod["main"].script()
    want = _run(func, 1)
    got = _run(sch.mod["main"], 1, AVX2)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_hand_written_gemv_only_replaces_its_own_pattern():
    """NK codes and a prompt's rows keep the schedules (their functions are not that GEMV)."""
    from pipeline.kernels.cpu.recognize import match_packed_kn_gemv

    for bits in (4, 8):
        assert match_packed_kn_gemv(_dequant_matmul("NK", bits, 1)) is None
        assert match_packed_kn_gemv(_dequant_matmul("KN", bits, tirx.Var("seq_len", "int64"))) is None
        assert match_packed_kn_gemv(_dequant_matmul("NK", bits, tirx.Var("seq_len", "int64")), rows="prompt") is None
        assert match_packed_kn_gemv(_dequant_matmul("KN", bits, 1), rows="prompt") is None
    assert match_packed_kn_gemv(_dequant_matmul("KN", 4, 1))[0] == "q4"
    assert match_packed_kn_gemv(_dequant_matmul("KN", 8, 1))[0] == "q8"


@pytest.mark.parametrize("threads", [1, 2, 3])   # K's 3 groups in 1 / 2 (unequal) / 3 parts
def test_decode_q8_gemv_is_the_hand_written_kernel(threads, monkeypatch):
    """int8 codes (q8f16, and the lm_head of the ternary schemes): the same span walk, sign-extended codes;
    K split one part per thread of a library built for this computer."""

    monkeypatch.setattr(probe, "build_threads", lambda: threads)
    func = _dequant_matmul("KN", 8, 1)
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    assert 'sblock("dequantize' not in sch.mod["main"].script()
    want = _run(func, 1)
    np.testing.assert_allclose(_run(sch.mod["main"], 1), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _t2_gemv_func(k: int, n: int = 48, fmt: str = "t2"):
    """One token times KN ternary t2 (or binary b1) codes, as layers' fused TE."""
    from pipeline.models.layers import dequantize_ternary_te
    from pipeline.quant import ternary as tern

    x = te.placeholder((1, 1, k), "float32", name="x")
    w = te.placeholder((tern.packed_len(fmt, k), n), "uint32", name="w")
    s = te.placeholder((tern.n_groups(k), n), "float16", name="s")
    wt = dequantize_ternary_te(w, s, fmt, "KN", k, n, "float32")
    r = te.reduce_axis((0, k), name="k")
    out = te.compute((1, 1, n), lambda b, i, j: te.sum(x[b, i, r] * wt[r, j], axis=r), name="matmul")
    return te.create_prim_func([w, s, x, out]).with_attr("global_symbol", "main")


@pytest.mark.skipif(not has_avx2(HOST), reason="the byte dot-product GEMV needs x86 AVX2; this CPU has none")
@pytest.mark.parametrize("fmt,n,k", [("q4", 72, K), ("q4", 40, K), ("q4", 192, K), ("t2", 48, 256),
                                     ("t2", 48, 192), ("t2", 48, 576), ("b1", 48, 256), ("b1", 48, 576)])
@pytest.mark.parametrize("threads", [1, 3])   # 3: K in up to 3 parts, of unequal group counts at K = 576
def test_decode_gemv_takes_pmaddubsw_on_avx2(fmt, n, k, threads, monkeypatch):
    """With AVX2 and no VNNI, t2 and b1 take the byte kernel in its `pmaddubsw` form (q4 keeps the pmaddwd
    kernel; its byte form is checked here too): x split into two signed bytes as for VNNI, products of 2
    codes added into int16 halves, 16-bit sums over a group, widened at its end: the same integer sums as
    the vpdpbusd form, so the same bound: within 2e-4 of the largest output of the fp32 TE."""

    monkeypatch.setattr(probe, "build_threads", lambda: threads)
    func = _q4_gemv_func(n, relax_order=True) if fmt == "q4" else _t2_gemv_func(k, n, fmt)   # q4: K = 96
    if fmt in cpu_gemv.AVX2_BYTE_FORMATS:
        kernel = CPUInlineParallel().apply(func, AVX2, False).mod["main"]
    else:
        assert "pmadd.ub.sw" not in CPUInlineParallel().apply(func, AVX2, False).mod["main"].script()
        kernel = x86.packed_kn_gemv_bytes(packed.FORMATS[fmt], n, k, "float16",
                                               packed.k_splits(n, k, threads, fmt), dot="avx2")
        kernel = packed.substitute(func, kernel, recognize.match_packed_kn_gemv(func)[4], "dequant-gemv")
    text = kernel.script()
    assert "pmadd.ub.sw" in text and "vpdpbusd" not in text
    want = _run(func, 1)
    got = _run(kernel, 1, AVX2)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    if has_vnni(HOST):   # the same integer sums as the vpdpbusd form: identical outputs
        vnni = CPUInlineParallel().apply(func, HOST, False).mod["main"]
        np.testing.assert_array_equal(_run(vnni, 1, HOST), got)


@pytest.mark.skipif(not has_vnni(HOST), reason="the byte dot-product GEMV needs AVX-512 VNNI; this CPU has none")
@pytest.mark.parametrize("fmt,n,k", [("q4", 72, K), ("q4", 40, K), ("q4", 192, K), ("t2", 48, 256),
                                     ("t2", 48, 192), ("t2", 48, 576), ("b1", 48, 256), ("b1", 48, 576)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_gemv_takes_byte_dot_products_with_vnni(fmt, n, k, threads, monkeypatch):
    """With AVX-512 VNNI (this machine's znver4, if it is one) q4 and t2 take the vpdpbusd kernel: x at the
    int16 kernel's precision, split into two signed bytes, so the same bound holds: within 2e-4 of the
    largest output of the fp32 TE (measured 2e-5 to 7e-5)."""

    monkeypatch.setattr(probe, "build_threads", lambda: threads)
    func = _q4_gemv_func(n, relax_order=True) if fmt == "q4" else _t2_gemv_func(k, n, fmt)   # q4: K = 96
    sch = CPUInlineParallel().apply(func, HOST, False)
    text = sch.mod["main"].script()
    assert "vpdpbusd" in text and "pmadd.wd" not in text
    want = _run(func, 1)
    np.testing.assert_allclose(_run(sch.mod["main"], 1, HOST), want, rtol=0, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("k", [256, 192])     # 192: the last group of 128 holds only 64 weights (K = 576-like)
@pytest.mark.parametrize("fmt", ["t2", "b1"])
def test_decode_t2_gemv_is_the_hand_written_kernel(k, fmt):
    """Ternary t2 (16 two-bit codes per word, (code - 1) * scale per 128): the same kernel with 2-bit fields;
    binary b1 (32 sign bits per word, (2 bit - 1) * scale): with 1-bit fields and a step of 2."""
    from pipeline.kernels.cpu.recognize import match_packed_kn_gemv

    func = _t2_gemv_func(k, fmt=fmt)
    assert match_packed_kn_gemv(func)[0] == fmt
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    assert 'sblock("dequantize' not in sch.mod["main"].script()
    assert classify(f"fused_dequantize_{fmt}_kn_matmul", sch.mod["main"]) == "dequant-gemv-ternary"
    want = _run(func, 1)   # random words: code 3 (unused by real packings) is still computed alike
    np.testing.assert_allclose(_run(sch.mod["main"], 1), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _rms_norm_func(rows):
    x = te.placeholder((1, rows, 64), "float32", name="x")
    w = te.placeholder((64,), "float32", name="w")
    k = te.reduce_axis((0, 64), name="k")
    red = te.compute((1, rows), lambda a, b: te.sum(x[a, b, k] * x[a, b, k], axis=k), name="T_multiply_red")
    out = te.compute((1, rows, 64), lambda a, b, c: tirx.rsqrt(red[a, b] / 64.0 + 1e-5) * x[a, b, c] * w[c],
                     name="T_rms_norm")
    return te.create_prim_func([x, w, out]).with_attr("global_symbol", "main")


@pytest.mark.parametrize("symbolic_rows", [True, False])
def test_rms_norm_reduces_each_row_inside_its_task(symbolic_rows):
    """RMSNorm: the sum of squares runs inside the epilogue's row loop (rows in parallel for a prompt, serial
    for one token) as 8 vector partial sums, not as its own serial scalar loop over all rows."""
    func = _rms_norm_func(tirx.Var("seq_len", "int64") if symbolic_rows else 1)
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    text = sch.mod["main"].script()
    assert "_rf" in text and text.count("T.vectorized") >= 2
    assert ("T.parallel" in text) == symbolic_rows
    if symbolic_rows:    # one parallel loop holding both the reduction and the epilogue
        assert text.count("T.parallel") == 1 and text.index("T.parallel") < text.index('sblock("T_multiply_red_rf')
    for n_rows in ((1, 5, 33) if symbolic_rows else (1,)):
        want = _run(func, n_rows)
        np.testing.assert_allclose(_run(sch.mod["main"], n_rows), want, rtol=1e-5, atol=1e-5)


def _q8_gemv_func(n: int, k: int):
    x = te.placeholder((1, 1, k), "float32", name="x")
    w = te.placeholder((k, n), "int8", name="w")
    s = te.placeholder((k // 32, n), "float16", name="s")
    wt = dequantize_q8_te(w, s, "KN", k, n, "float32")
    r = te.reduce_axis((0, k), name="k")
    out = te.compute((1, 1, n), lambda b, i, j: te.sum(x[b, i, r] * wt[r, j], axis=r), name="matmul")
    return te.create_prim_func([w, s, x, out]).with_attr("global_symbol", "main")


@pytest.mark.skipif(not has_avx2(HOST), reason="the int16 dot-product GEMV needs x86 AVX2; this CPU has none")
@pytest.mark.parametrize("n,k", [(96, 96), (64, 576), (48, 64), (80, 64)])
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_q8_gemv_takes_int16_dot_products_on_avx2(n, k, threads, monkeypatch):
    """q8 on AVX2 without VNNI: rows k / k+1 interleaved per column and sign-extended, pmaddwd against x's
    int16 pair: within 2e-4 of the fp32 TE's largest output (measured ~2e-5); 3 or 2 blocks of 16 columns
    per step; N not a multiple of 32 keeps the fp32 kernel. Codes at -127 / 127 with x at one value: the
    largest group sums, exact."""
    monkeypatch.setattr(probe, "build_threads", lambda: threads)
    func = _q8_gemv_func(n, k)
    sch = CPUInlineParallel().apply(func, AVX2, False)
    text = sch.mod["main"].script()
    assert ("pmadd.wd" in text) == (n % 32 == 0) and "vpdpbusd" not in text
    if n % 32:
        return
    want = _run(func, 1)
    np.testing.assert_allclose(_run(sch.mod["main"], 1, AVX2), want, rtol=0, atol=2e-4 * np.abs(want).max())
    for code in (127, -127):
        args = [np.full((k, n), code, np.int8), np.ones((k // 32, n), "float16"), np.full((1, 1, k), 0.5, "float32")]
        got = []
        for f, target in ((sch.mod["main"], AVX2), (func, None)):
            t = [tvm.runtime.tensor(a) for a in args] + [tvm.runtime.tensor(np.zeros((1, 1, n), "float32"))]
            tvm.compile(tvm.IRModule({"main": f}), target=target or tvm.target.Target({"kind": "llvm"}))["main"](*t)
            got.append(t[-1].numpy())
        np.testing.assert_allclose(got[0], got[1], rtol=1e-6)


def _q8_tiled_func(n: int, k: int, rows=1, tile: int = 16):
    """x [1, rows, k] times q8 codes stored tiled (quantize.tile_q8, host-cpu's q8 storage), as layers' TE."""
    x = te.placeholder((1, rows, k), "float32", name="x")
    w = te.placeholder((n // tile, k // 2, 2 * tile), "int8", name="w")
    s = te.placeholder((k // 32, n), "float16", name="s")
    wt = dequantize_q8_te(w, s, "KN", k, n, "float32")
    r = te.reduce_axis((0, k), name="k")
    out = te.compute((1, rows, n), lambda b, i, j: te.sum(x[b, i, r] * wt[r, j], axis=r), name="matmul")
    return te.create_prim_func([w, s, x, out]).with_attr("global_symbol", "main")


def _tiled_inputs(n: int, k: int, rows: int, seed: int = 0, tile: int = 16):
    from pipeline.quant.quantize import tile_q8

    rng = np.random.default_rng(seed)
    codes = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = (rng.standard_normal((k // 32, n)) * 0.05).astype("float16")
    x = rng.standard_normal((1, rows, k)).astype("float32")
    want = x[0] @ (codes.astype(np.float32) * np.repeat(scale.astype(np.float32), 32, axis=0))
    return [tile_q8(codes, tile), scale, x], want


def _call(func, args, rows: int, n: int, target) -> np.ndarray:
    f = tvm.compile(tvm.IRModule({"main": func}), target=target)["main"]
    out = tvm.runtime.tensor(np.zeros((1, rows, n), "float32"))
    f(*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()[0]


@pytest.mark.parametrize("n,k", [(96, 96), (64, 576), (80, 64), (48, 64), (16, 64)])   # 3 / 2 / 1 tiles per step;
# 48: two steps of 1 tile (no parallel loop of one iteration), 16: one tile in all (the fp32 kernel)
@pytest.mark.parametrize("kind", ["int16", "fp32"])
def test_decode_q8_gemv_over_tiled_codes(n, k, kind):
    """host-cpu's q8 codes are tiled (16 columns, row pairs side by side): the TE reads them so (against
    numpy on the untiled codes), and the decode GEMV is the tiled kernel — pmaddwd straight from each 32-byte
    row pair on AVX2 (x in int16 per group: within 2e-4 of the largest output, measured ~2e-5), fp32 where
    there is no AVX2 (within fp32 summation order)."""
    if kind == "int16" and not has_avx2(HOST):
        pytest.skip("the int16 dot-product GEMV needs x86 AVX2; this CPU has none")
    func = _q8_tiled_func(n, k)
    args, want = _tiled_inputs(n, k, 1)
    target = AVX2 if kind == "int16" else tvm.target.Target({"kind": "llvm"})
    np.testing.assert_allclose(_call(func, args, 1, n, target), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    sch = CPUInlineParallel().apply(func, target, False)
    text = sch.mod["main"].script()
    assert 'sblock("dequantize' not in text and ("pmadd.wd" in text) == (kind == "int16" and n > 16)
    assert sch.mod["main"].attrs[packed.OP_CLASS_ATTR] == "dequant-gemv"
    tol = 2e-4 if kind == "int16" and n > 16 else 1e-5
    np.testing.assert_allclose(_call(sch.mod["main"], args, 1, n, target), want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.skipif(not has_avx2(HOST), reason="the int16 dot-product GEMV needs x86 AVX2; this CPU has none")
def test_tiled_q8_gemv_group_sums_are_exact_at_the_extremes():
    """Codes at -127 / 127 against x at one value: the largest int32 group sums the kernel forms, exact (x's
    int16 step is then exact), so the result equals the fp32 kernel's to fp32 rounding."""
    n, k = 48, 256
    func = _q8_tiled_func(n, k)
    sch = CPUInlineParallel().apply(func, AVX2, False)
    for code in (127, -127):
        args = [np.full((n // 16, k // 2, 32), code, np.int8), np.ones((k // 32, n), "float16"),
                np.full((1, 1, k), 0.5, "float32")]
        np.testing.assert_allclose(_call(sch.mod["main"], args, 1, n, AVX2), np.full((1, n), code * 0.5 * k), rtol=1e-6)


@pytest.mark.parametrize("kind", ["int16", "fp32"])
@pytest.mark.parametrize("n,k,rows", [(48, 96, 7), (64, 576, 4)])   # 7: a block of 4 rows and 3 single ones
def test_prefill_q8_matmul_over_tiled_codes(kind, n, k, rows):
    """A prompt's rows times tiled q8 codes: on AVX2 the pmaddwd prefill with one code tile per task (its row
    pairs sign-extended are the lanes' pairs; x in int16 per group: within 2e-4 of the largest output),
    elsewhere the fp32 kernel (within fp32 summation order); against numpy on the untiled codes."""
    if kind == "int16" and not has_avx2(HOST):
        pytest.skip("the int16 dot-product prefill needs x86 AVX2; this CPU has none")
    m = tirx.Var("seq_len", "int64")
    func = _q8_tiled_func(n, k, rows=m)
    target = AVX2 if kind == "int16" else tvm.target.Target({"kind": "llvm"})
    sch = CPUInlineParallel().apply(func, target, False)
    text = sch.mod["main"].script()
    assert 'sblock("dequantize' not in text and ("pmadd.wd" in text) == (kind == "int16")
    assert sch.mod["main"].attrs[packed.OP_CLASS_ATTR] == "dequant-matmul"
    args, want = _tiled_inputs(n, k, rows, seed=3)
    tol = 2e-4 if kind == "int16" else 1e-5
    np.testing.assert_allclose(_call(sch.mod["main"], args, rows, n, target), want, rtol=0,
                               atol=tol * np.abs(want).max())


def test_tiled_q8_codes_need_whole_tiles():
    """Only codes that are exactly tile_q8's shape of the [K, N] weight are taken as tiled."""
    from pipeline.kernels.cpu.packed import q8_tile_of

    assert q8_tile_of((6, 48, 32), 96, 96) == 16
    assert q8_tile_of((6, 48, 32), 80, 96) == 0 and q8_tile_of((6, 47, 32), 96, 96) == 0
    assert q8_tile_of((96, 96), 96, 96) == 0


def _packed_tiled_func(fmt: str, n: int, k: int, tile: int, rows=1):
    """x [1, rows, k] times q4 / t2 codes and scales stored tiled (quantize.tile_kn, host-cpu's storage), as
    layers' TE."""
    from pipeline.models.layers import dequantize_ternary_te
    from pipeline.quant import ternary as tern

    x = te.placeholder((1, rows, k), "float32", name="x")
    words, groups = (k // 8, k // 32) if fmt == "q4" else (tern.packed_len("t2", k), tern.n_groups(k))
    w = te.placeholder((n // tile, words, tile), "uint32", name="w")
    s = te.placeholder((n // tile, groups, tile), "float16", name="s")
    if fmt == "q4":
        wt = dequantize_te(w, s, "KN", k, n, "float32")
    else:
        wt = dequantize_ternary_te(w, s, "t2", "KN", k, n, "float32")
    r = te.reduce_axis((0, k), name="k")
    out = te.compute((1, rows, n), lambda b, i, j: te.sum(x[b, i, r] * wt[r, j], axis=r), name="matmul")
    return te.create_prim_func([w, s, x, out]).with_attr("global_symbol", "main")


def _packed_tiled_inputs(fmt: str, n: int, k: int, tile: int, rows: int, seed: int = 0):
    """Tiled codes / scales and x, and numpy's product on the plain KN codes (quantize.dequantize_q4 /
    ternary.dequantize_ternary)."""
    from pipeline.quant import ternary as tern
    from pipeline.quant.quantize import dequantize_q4, tile_kn

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, rows, k)).astype("float32")
    if fmt == "q4":
        codes = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint64).astype(np.uint32)
        scale = (rng.standard_normal((k // 32, n)) * 0.05).astype("float16")
        w = dequantize_q4(codes, scale, "KN")
    else:
        codes = np.ascontiguousarray(tern.pack(rng.integers(-1, 2, (n, k)).astype(np.int8), "t2", k).T)
        scale = (rng.standard_normal((tern.n_groups(k), n)) * 0.05).astype("float16")
        w = tern.dequantize_ternary(codes, scale, "t2", k, "KN")
        assert np.array_equal(tern.dequantize_ternary(tile_kn(codes, tile), tile_kn(scale, tile), "t2", k, "KN"), w)
    return [tile_kn(codes, tile), tile_kn(scale, tile), x], x[0] @ w.T


TILED_CASES = [("q4", 576, 96, 24), ("q4", 96, 64, 16), ("q4", 48, 576, 8), ("q4", 48, 64, 24),   # 24 / 2 / 6 / 2 tiles
               ("t2", 72, 576, 24), ("t2", 96, 256, 16), ("t2", 48, 64, 8)]   # t2 K = 576: a last group of 64


@pytest.mark.parametrize("fmt,n,k,tile", TILED_CASES)
@pytest.mark.parametrize("kind", ["int16", "fp32"])
def test_decode_gemv_over_tiled_codes(fmt, n, k, tile, kind):
    """host-cpu's q4 and t2 codes and scales are tiled (up to 24 columns, each tile contiguous over K): the
    TE reads them so (against numpy on the plain KN codes), and the decode GEMV is the tiled kernel — pmaddwd
    on AVX2 (x in int16 per group: within 2e-4 of the largest output, measured ~2e-5), fp32 elsewhere
    (within fp32 summation order); either way one parallel task per tile, not the KN kernels' split K."""
    if kind == "int16" and not has_avx2(HOST):
        pytest.skip("the int16 dot-product GEMV needs x86 AVX2; this CPU has none")
    func = _packed_tiled_func(fmt, n, k, tile)
    args, want = _packed_tiled_inputs(fmt, n, k, tile, 1)
    target = AVX2 if kind == "int16" else tvm.target.Target({"kind": "llvm"})
    np.testing.assert_allclose(_call(func, args, 1, n, target), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    sch = CPUInlineParallel().apply(func, target, False)
    text = sch.mod["main"].script()
    assert 'sblock("dequantize' not in text and ("pmadd.wd" in text) == (kind == "int16")
    assert f"T.parallel({n // tile})" in text
    assert sch.mod["main"].attrs[packed.OP_CLASS_ATTR] == ("dequant-gemv" if fmt == "q4" else "dequant-gemv-ternary")
    tol = 2e-4 if kind == "int16" else 1e-5
    np.testing.assert_allclose(_call(sch.mod["main"], args, 1, n, target), want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.skipif(not has_avx2(HOST), reason="the int16 dot-product GEMV needs x86 AVX2; this CPU has none")
def test_tiled_q4_gemv_group_sums_are_exact_at_the_extremes():
    """Every code 15 (or 0) against x at one value: the largest int32 group sums the kernel forms (the high
    codes' sum 16 times theirs), exact, so the result equals (code - 7) * 0.5 * K to fp32 rounding."""
    n, k, tile = 48, 256, 24
    sch = CPUInlineParallel().apply(_packed_tiled_func("q4", n, k, tile), AVX2, False)
    for code in (15, 0):
        args = [np.full((n // tile, k // 8, tile), code * 0x11111111, np.uint32),
                np.ones((n // tile, k // 32, tile), "float16"), np.full((1, 1, k), 0.5, "float32")]
        np.testing.assert_allclose(_call(sch.mod["main"], args, 1, n, AVX2), np.full((1, n), (code - 7) * 0.5 * k),
                                   rtol=1e-6)


def test_tiled_gemv_prefetch_distance_follows_the_cpu_vendor(monkeypatch):
    """The tiled GEMV's software prefetch is the table's for this machine's CPU vendor (Intel: on; AMD and
    unknown: off) and only for a library built for this computer: a cross-compiled one's CPU is unknown."""
    cross = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-android"})
    for vendor, want in [("GenuineIntel", probe.GEMV_PREFETCH_BYTES["GenuineIntel"]), ("AuthenticAMD", 0), ("", 0)]:
        monkeypatch.setattr(probe, "cpu_vendor", lambda v=vendor: v)
        assert probe.native_prefetch_bytes(AVX2) == want and probe.native_prefetch_bytes(cross) == 0
        text = CPUInlineParallel().apply(_packed_tiled_func("q4", 96, 256, 24), AVX2, False).mod["main"].script()
        assert ("llvm.prefetch" in text) == (want > 0)
    assert probe.GEMV_PREFETCH_BYTES["GenuineIntel"] > 0


@pytest.mark.skipif(not has_avx2(HOST), reason="the int16 dot-product GEMV needs x86 AVX2; this CPU has none")
@pytest.mark.parametrize("fmt,n,k,tile", [("q4", 576, 96, 24), ("q4", 96, 1024, 16), ("q4", 48, 576, 8),
                                          ("t2", 72, 576, 24)])
def test_prefetching_tiled_gemv_gives_the_same_outputs(fmt, n, k, tile):
    """A software prefetch changes no result: the same outputs bit for bit as without it, and numpy's within
    the int16 kernel's tolerance, with the prefetch running past the last tile (6 KB ahead of these weights'
    ends) and within one (K = 1024: 64 rows of 16 columns ahead in a 128-row tile)."""
    args, want = _packed_tiled_inputs(fmt, n, k, tile, 1, seed=5)
    outs = []
    for ahead in (0, probe.GEMV_PREFETCH_BYTES["GenuineIntel"]):
        fmt_spec = packed.FORMATS[fmt]
        kernel = x86.packed_tiled_gemv_int16(fmt_spec, n, k, tile, prefetch_bytes=ahead)
        func = kernel.with_attr("global_symbol", "main")
        assert ("llvm.prefetch" in func.script()) == (ahead > 0)
        outs.append(_call(func, args, 1, n, AVX2))
    assert np.array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[1], want, rtol=0, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("kind", ["int16", "fp32", "vnni"])
@pytest.mark.parametrize("fmt,n,k,tile,rows", [("q4", 72, 96, 24, 7), ("q4", 64, 576, 16, 4), ("q4", 48, 64, 8, 5),
                                               ("q4", 96, 64, 24, 4), ("t2", 48, 576, 24, 5)])   # 7: 4 + 3 rows
def test_prefill_matmul_over_tiled_codes(kind, fmt, n, k, tile, rows):
    """A prompt's rows times tiled q4 / t2 codes: on AVX2 the pmaddwd prefill with one code tile per task
    (its columns unpacked once, then every row; x in int16 per group: within 2e-4 of the largest output),
    with AVX-512 VNNI the vpdpbusd prefill (16 / 32 columns a task, which may span two code tiles: codes and
    scales copied 8 columns at a time), elsewhere the fp32 kernel reading the tiles by index (within fp32
    summation order); against numpy on the plain KN codes."""
    if kind == "int16" and not has_avx2(HOST):
        pytest.skip("the int16 dot-product prefill needs x86 AVX2; this CPU has none")
    if kind == "vnni" and not has_vnni(HOST):
        pytest.skip("the byte dot-product prefill needs AVX-512 VNNI; this CPU has none")
    m = tirx.Var("seq_len", "int64")
    func = _packed_tiled_func(fmt, n, k, tile, rows=m)
    target = {"int16": AVX2, "vnni": HOST}.get(kind, tvm.target.Target({"kind": "llvm"}))
    sch = CPUInlineParallel().apply(func, target, False)
    text = sch.mod["main"].script()
    assert 'sblock("dequantize' not in text and ("pmadd.wd" in text) == (kind == "int16")
    assert ("vpdpbusd" in text) == (kind == "vnni")
    assert sch.mod["main"].attrs[packed.OP_CLASS_ATTR] == ("dequant-matmul" if fmt == "q4" else "dequant-matmul-ternary")
    args, want = _packed_tiled_inputs(fmt, n, k, tile, rows, seed=3)
    tol = 1e-5 if kind == "fp32" else 2e-4
    np.testing.assert_allclose(_call(sch.mod["main"], args, rows, n, target), want, rtol=0,
                               atol=tol * np.abs(want).max())


def test_tiled_q4_codes_need_whole_tiles_and_tiled_scales():
    """Only codes and scales that are exactly tile_kn's shapes of the [K, N] weight, in at least two tiles,
    are taken as tiled; anything else keeps the schedules (or the KN kernels for plain KN codes)."""
    from pipeline.kernels.cpu.packed import TILED_Q4, TILED_T2
    from pipeline.kernels.cpu.recognize import match_packed_kn_gemv

    assert match_packed_kn_gemv(_packed_tiled_func("q4", 96, 64, 24))[0] == TILED_Q4
    assert match_packed_kn_gemv(_packed_tiled_func("t2", 96, 576, 24))[0] == TILED_T2

    def gemv(w_shape, s_shape):
        x = te.placeholder((1, 1, 64), "float32", name="x")
        w = te.placeholder(w_shape, "uint32", name="w")
        s = te.placeholder(s_shape, "float16", name="s")
        n = w_shape[0] * w_shape[2]
        wt = dequantize_te(w, s, "KN", 64, n, "float32")
        r = te.reduce_axis((0, 64), name="k")
        out = te.compute((1, 1, n), lambda b, i, j: te.sum(x[b, i, r] * wt[r, j], axis=r), name="matmul")
        return te.create_prim_func([w, s, x, out])

    for w_shape, s_shape in [((4, 8, 24), (2, 4, 48)), ((4, 7, 24), (4, 2, 24)), ((1, 8, 24), (1, 2, 24))]:
        assert match_packed_kn_gemv(gemv(w_shape, s_shape)) is None, (w_shape, s_shape)


@pytest.mark.skipif(not has_vnni(HOST), reason="the byte dot-product GEMV needs AVX-512 VNNI; this CPU has none")
@pytest.mark.parametrize("n,k", [(192, 96), (96, 576), (64, 64)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_q8_gemv_takes_byte_dot_products_with_vnni(n, k, threads, monkeypatch):
    """q8 with VNNI: 4 rows of codes interleaved per column, sign bits flipped, vpdpbusd against x in two
    bytes: within 2e-4 of the fp32 TE's largest output (measured ~2e-5); N not a multiple of 32 keeps the
    fp32 kernel."""

    monkeypatch.setattr(probe, "build_threads", lambda: threads)
    func = _q8_gemv_func(n, k)
    sch = CPUInlineParallel().apply(func, HOST, False)
    assert "vpdpbusd" in sch.mod["main"].script()
    want = _run(func, 1)
    np.testing.assert_allclose(_run(sch.mod["main"], 1, HOST), want, rtol=0, atol=2e-4 * np.abs(want).max())
    assert "vpdpbusd" not in CPUInlineParallel().apply(_q8_gemv_func(72, k), HOST, False).mod["main"].script()


def test_runtime_uses_every_cpu_by_default():
    """TVM's pool alone takes half the CPUs on x86; importing the package first gives it all of them (what
    the library was built for), unless TVM_NUM_THREADS says otherwise."""
    import os
    import subprocess
    import sys

    code = "import pipeline, tvm; print(tvm.get_global_func('runtime.NumThreads')())"
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert int(out.split()[-1]) == len(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, TVM_NUM_THREADS="1"), capture_output=True,
                         text=True, check=True).stdout
    assert int(out.split()[-1]) == 1


@pytest.mark.skipif(not has_avx2(HOST), reason="the int16 dot-product prefill needs x86 AVX2; this CPU has none")
@pytest.mark.parametrize("fmt,k,n", [("q4", 96, 72), ("q4", 64, 40), ("q4", 96, 48), ("t2", 192, 48), ("t2", 576, 16),
                                     ("t2", 192, 64)])
def test_prefill_takes_int16_dot_products_on_avx2(fmt, k, n):
    """With AVX2 and no VNNI a prompt times KN q4 / t2 codes is the pmaddwd kernel (x per row and group in
    int16, codes c and c + C/2 paired per lane, rows 4 at a time, the rest one at a time): within 2e-4 of the
    fp32 TE's largest output (measured ~3e-5), for row counts below, at and past the register tile, t2's short
    last group (K = 576) included; q8 and b1 keep the fp32 kernel."""
    func = _prompt_matmul(fmt, k, n, relax_order=True)
    text = CPUInlineParallel().apply(func, AVX2, False).mod["main"].script()
    assert "pmadd.wd" in text and "vpdpbusd" not in text
    for n_rows in (1, 4, 7, 33):
        want = _run(func, n_rows)
        got = _run(CPUInlineParallel().apply(func, AVX2, False).mod["main"], n_rows, AVX2)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    for other in ("q8", "b1"):
        func = _prompt_matmul(other, 192, 48, relax_order=True)
        assert "pmadd.wd" not in CPUInlineParallel().apply(func, AVX2, False).mod["main"].script()


@pytest.mark.skipif(not has_vnni(HOST), reason="the byte dot-product prefill needs AVX-512 VNNI; this CPU has none")
@pytest.mark.parametrize("fmt,k,n", [("q4", 96, 72), ("q4", 64, 40), ("q4", 96, 48), ("q4", 96, 96), ("t2", 192, 48),
                                     ("t2", 576, 16), ("t2", 192, 64), ("b1", 192, 48), ("b1", 576, 16)])
def test_prefill_takes_byte_dot_products_with_vnni(fmt, k, n):
    """With AVX-512 VNNI a prompt times KN q4 / t2 codes is the vpdpbusd kernel (x per row and group in two
    bytes, rows 4 at a time, the rest one at a time): within 2e-4 of the fp32 TE's largest output (measured
    ~2e-5, x's int16 rounding), for row counts below, at and past the register tile; q8 keeps the fp32 one.
    512-bit vectors when 16 divides N (one or two per task), else 256-bit."""
    func = _prompt_matmul(fmt, k, n, relax_order=True)
    sch = CPUInlineParallel().apply(func, HOST, False)
    text = sch.mod["main"].script()
    assert ("vpdpbusd.512" in text) == (n % 16 == 0) and ("vpdpbusd.256" in text) == (n % 16 != 0)
    for n_rows in (1, 4, 7, 33):
        want = _run(func, n_rows)
        np.testing.assert_allclose(_run(sch.mod["main"], n_rows, HOST), want, rtol=0, atol=2e-4 * np.abs(want).max())
    assert "vpdpbusd" not in CPUInlineParallel().apply(_prompt_matmul("q8", 96, 80, True), HOST, False).mod["main"].script()


def _silu_multiply_func(rows, n: int = 40):
    """A prompt's SiLU(gate) * up over the fused [rows, 2 n] gate|up output, as the MLP fuses it."""
    gu = te.placeholder((1, rows, 2 * n), "float32", name="gate_up")
    out = te.compute((1, rows, n), lambda a, b, c: gu[a, b, c] * tirx.sigmoid(gu[a, b, c]) * gu[a, b, c + n],
                     name="T_multiply")
    return te.create_prim_func([gu, out]).with_attr("global_symbol", "main")


def test_prompt_elementwise_runs_whole_vectors_per_task():
    """An elementwise prompt kernel (SiLU * up): rows and vector blocks of the last axis in parallel, each
    block one 8-lane vector (fused into one flat loop, its div / mod indexing kept LLVM scalar: the prefill's
    SiLU took 10% of a 0.32B model's 128-token prefill); same values."""
    from pipeline.kernels.cpu.fast_math import rewrite_func

    func = rewrite_func(_silu_multiply_func(tirx.Var("seq_len", "int64")))
    sch = CPUInlineParallel().apply(func, tvm.target.Target({"kind": "llvm"}), False)
    text = sch.mod["main"].script()
    assert text.count("T.parallel") == 1 and re.search(r"T\.vectorized\((T\.int64\()?8\b", text)
    for n_rows in (1, 3, 17):
        np.testing.assert_allclose(_run(sch.mod["main"], n_rows), _run(func, n_rows), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind,fmt", [("int16", "q4"), ("vnni", "q4"), ("vnni", "t2"), ("vnni", "b1"),
                                      ("q8vnni", "q8"), ("avx2bytes", "t2"), ("avx2bytes", "q4")])
@pytest.mark.parametrize("splits", [1, 2])
def test_integer_gemvs_prefetch_the_next_group_only_when_near(kind, fmt, splits, monkeypatch):
    """The integer GEMVs prefetch the next group's code rows of their tile (the task's own next group: a part
    of K ends at its last) when a group of rows spans at most PREFETCH_MAX_AHEAD bytes, never for a 49152-wide
    lm_head; the prefetch changes no result (bit-identical to the same kernel without it)."""

    builder = {"int16": x86.packed_kn_gemv_int16, "vnni": x86.packed_kn_gemv_bytes, "q8vnni": x86.q8_kn_gemv_vnni,
               "avx2bytes": lambda *a: x86.packed_kn_gemv_bytes(*a, dot="avx2")}[kind]
    spec = packed.FORMATS[fmt]
    assert "llvm.prefetch" in builder(spec, 3072, 576, "float16", splits).script()
    assert "llvm.prefetch" not in builder(spec, 49152, 576, "float16", splits).script()
    n, k = 96, 640 if fmt != "q8" else 256   # t2 / b1: 5 groups of 128, q4 / q8: 20 / 8 groups of 32
    avx2 = kind in ("int16", "avx2bytes")
    target = AVX2 if avx2 else HOST
    if (avx2 and not has_avx2(HOST)) or (not avx2 and not has_vnni(HOST)):
        pytest.skip("this CPU cannot run the kernel")
    outs = []
    for ahead in (packed.PREFETCH_MAX_AHEAD, 0):
        monkeypatch.setattr(packed, "PREFETCH_MAX_AHEAD", ahead)
        func = builder(spec, n, k, "float16", splits).with_attr("global_symbol", "main")
        assert ("llvm.prefetch" in func.script()) == (ahead > 0)
        outs.append(_run(func, 1, target))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.skipif(not has_avx2(HOST), reason="the int16 dot-product GEMV needs x86 AVX2; this CPU has none")
@pytest.mark.parametrize("splits", [1, 2])
def test_q8_int16_gemv_prefetches_ahead_in_its_rows(splits):
    """The AVX2 q8 GEMV prefetches Q8_INT16_AHEAD columns ahead in the two rows each step reads (clamped to
    the buffer, so near a row's end it re-fetches its last line), for every width; the prefetch changes no
    result (bit-identical to the kernel without it)."""

    spec = packed.FORMATS["q8"]
    n, k = 96, 256
    outs = []
    for ahead in (x86.Q8_INT16_AHEAD, 0):
        func = x86.q8_kn_gemv_int16(spec, n, k, "float16", splits, ahead).with_attr("global_symbol", "main")
        assert ("llvm.prefetch" in func.script()) == (ahead > 0)
        outs.append(_run(func, 1, AVX2))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert "llvm.prefetch" in x86.q8_kn_gemv_int16(spec, 49152, 576, "float16", splits).script()


def _parallel_tasks_ir(func, target) -> str:
    """The LLVM IR of the compiled function's parallel task bodies (TVM's `__tvm_parallel_lambda`s)."""
    ir = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target).mod.inspect_source("ll")
    bodies = re.findall(r"^define [^\n]*@__tvm_parallel_lambda[^\n]*\{\n(.*?)^\}", ir, re.M | re.S)
    assert bodies, "no parallel task in the compiled kernel"
    return "\n".join(bodies)


@pytest.mark.parametrize("kind", ["q4", "q8", "float16"] + (["q4-vnni", "q8-vnni"] if has_vnni(HOST) else []))
def test_decode_gemv_tasks_keep_their_accumulators_off_the_heap(kind, monkeypatch):
    """A hand-written GEMV's per-task vectors (accumulators, loaded words) are small default-scope buffers,
    which become stack slots that LLVM promotes to registers, and their scalars are let-bound. Declared
    scope="local", TVM allocated the vectors per task with TVMBackendAllocWorkspace and every store to them
    stayed in the loop (SmolLM2 decode 1.16x q4f16, 1.28x q8f16, 1.09x ternary_ptq side by side once they
    were not); a plain scalar assignment (`col = ...`) is such a one-element allocation too."""
    from pipeline.kernels.cpu import schedule as cs

    monkeypatch.setattr(probe, "build_threads", lambda: 2)
    monkeypatch.setattr(cs, "SERIAL_WORK", 1)
    func = {"q4": lambda: _q4_gemv_func(72, relax_order=True), "q4-vnni": lambda: _q4_gemv_func(72, relax_order=True),
            "q8": lambda: _q8_gemv_func(64, K), "q8-vnni": lambda: _q8_gemv_func(64, K),
            "float16": lambda: _float_gemv_func("float16")}[kind]()
    target = HOST if kind.endswith("-vnni") else AVX2
    sch = CPUInlineParallel().apply(func, target, False)
    assert "TVMBackendAllocWorkspace" not in _parallel_tasks_ir(sch.mod["main"], target)
