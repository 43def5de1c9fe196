"""The q4 / q8 decode GEMVs and prefill matmuls of kernels/npu/hvx_int8_matmul.py, run under qemu-hexagon through
the freestanding harness against a bit-exact numpy model of their arithmetic and against the exact product."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from pipeline.compiler.schedule import KernelSchedule
from pipeline.config import load_target
from pipeline.kernels.npu import hexagon
from pipeline.kernels.npu.hvx_int8_matmul import GEMV_RULES, PREFILL_RULES, ROWS, int8_matmul
from pipeline.quant.quantize import dequantize_q4, dequantize_q8, quantize_q4, quantize_q8
from pipeline.verify.qemu_hexagon import hexagon_kernels, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()}")

NPU = load_target("android-hexagon").npu
INT8_TOLERANCE = 2e-2     # int8 activations per group of 32 vs the exact product (as for the q4 GEMV)
QUANTIZE = {"q4": quantize_q4, "q8": quantize_q8}
DEQUANTIZE = {"q4": dequantize_q4, "q8": dequantize_q8}


def _int_weights(fmt: str, codes: np.ndarray) -> np.ndarray:
    """Integer weights [K, N] the kernel multiplies: q8 codes, or q4 nibbles minus the zero point 7."""
    if fmt == "q8":
        return codes.astype(np.int64)
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, :, None]
    return ((codes[:, None, :] >> shifts) & np.uint32(15)).reshape(-1, codes.shape[1]).astype(np.int64) - 7


def _model(fmt: str, codes, scales, x):
    """The kernels' arithmetic in numpy, bit for bit, per prompt row: int8 activations per group of 32 with a step of
    16 significant bits (by a 30-bit reciprocal and a rounding shift), exact integer dot products, then each group's term (dot x 11-bit weight-scale mantissa x
    16-bit step mantissa / 2^16) shifted into a per-column frame (the largest weight + step exponent) and summed in
    int32; one conversion to fp32 and to fp16 (nearest even) at the end."""
    w = _int_weights(fmt, codes)
    groups = codes.shape[0] * (1 if fmt == "q8" else 8) // 32
    headroom = max(1, (groups - 1).bit_length())
    h = scales.view(np.uint16).astype(np.int64)
    e5 = (h >> 10) & 31
    w_mant = ((h & 1023) | (np.minimum(e5, 1) << 10)) * np.where(h & 0x8000, -1, 1)
    w_exp = np.maximum(e5, 1) - 25
    rows = []
    for xr in x.reshape(-1, x.shape[-1]):
        hx = xr.view(np.uint16).astype(np.int64).reshape(-1, 32)
        amax = np.abs(xr.reshape(-1, 32).astype(np.float32)).max(1)
        bits = (amax / np.float32(127)).astype(np.float32).view(np.int32).astype(np.int64)
        x_mant = np.where(amax > 0, ((bits & 0x7FFFFF) | 0x800000) >> 8, 0)
        x_exp = ((bits >> 23) & 0xFF) - 142
        with np.errstate(divide="ignore"):
            recip = np.where(x_mant > 0, np.float32(2.0**45) / x_mant.astype(np.float32), 0).astype(np.int64)
        e = (hx >> 10) & 31
        scaled = (recip[:, None] * ((hx & 1023) | (np.minimum(e, 1) << 10))) >> 16
        shift = np.clip(x_exp[:, None] + 54 - np.maximum(e, 1), 1, 31)
        q = np.minimum((scaled + (1 << (shift - 1))) >> shift, 127) * np.where(hx & 0x8000, -1, 1)
        dots = np.einsum("gik,gi->gk", w.reshape(groups, 32, -1), q)
        term = (dots * w_mant * x_mant[:, None]) >> 16
        exps = w_exp + x_exp[:, None]
        frame = exps.max(0)
        total = (term >> np.minimum(frame - exps + headroom, 31)).sum(0)
        assert np.abs(total).max() < 2**31
        unit = np.ldexp(np.float32(1), frame + headroom + 16).astype(np.float32)
        rows.append((total.astype(np.float32) * unit).astype(np.float16))
    return np.stack(rows)


def _check(kernels, name: str, fmt: str, k: int, n: int, m: int, rng) -> float:
    codes, scales = QUANTIZE[fmt]((rng.standard_normal((n, k)) * 0.05).astype(np.float32), "KN")
    # whole columns of an fp16 subnormal scale (subnormal outputs), zero, the smallest normal, one whose outputs
    # overflow to inf, and a negative one
    scales[:, :5] = [6e-8, 0, 6.1e-5, 3e4, -0.01]
    codes[:, [0, 3]] = 0 if fmt == "q8" else 0x77777777   # columns 0 and 3: one weight of 3 steps, the others 0
    codes[0, [0, 3]] = 3 if fmt == "q8" else 0x7777777A
    x = rng.standard_normal((1, m, k)).astype(np.float16)
    x[0, 0, 32:64] = 0                        # a group of zeros: activation scale 0
    x[0, :, 0] = 2                            # what those weights meet: a subnormal output, an inf
    got = kernels.call(name, [codes, scales, x, np.zeros((1, m, n), np.float16)])[-1][0]
    model = _model(fmt, codes, scales, x)
    assert (got.view(np.uint16) == model.view(np.uint16)).all(), (name, m, np.flatnonzero(got != model)[:8])
    subnormal = (got != 0) & (np.abs(got) < 6.1e-5)
    assert np.isinf(got[:, 3]).any() and subnormal[:, 0].any(), "the edge columns lost their meaning"
    exact = x[0].astype(np.float64) @ DEQUANTIZE[fmt](codes, scales, "KN").astype(np.float64).T
    err = float(np.abs(got - exact)[:, 5:].max() / np.abs(exact[:, 5:]).max())   # the edge columns: the model
    assert err < INT8_TOLERANCE, (name, m, err)
    return err


def test_gemvs_and_prefill_matmuls_match_numpy(tmp_path):
    """Decode GEMVs at SmolLM2's shapes (q8: N not a multiple of 128, the overlapping last block, and one that is;
    q4: the four layer GEMVs), q4 / q8 prefills over 1, ROWS + 1 (a partial pass) and 2 ROWS prompt rows: bit for
    bit the numpy model, within 2e-2 of the exact product. Objects: vrmpy, the q8 row shuffles, no soft-float."""
    decode = {"q8_qkv": (576, 960), "q8_gate_up": (576, 3072), "q4_qkv": (576, 960), "q4_o_proj": (576, 576),
              "q4_gate_up": (576, 3072), "q4_down": (1536, 576)}
    prefill = {"q4_prefill": (64, 96), "q8_prefill": (96, 160)}
    funcs = {name: int8_matmul(name[:2], k, n, False) for name, (k, n) in decode.items()}
    funcs |= {name: int8_matmul(name[:2], k, n, True) for name, (k, n) in prefill.items()}
    rules = {n: (PREFILL_RULES if "prefill" in n else GEMV_RULES)[n[:2]] for n in funcs}
    kernels = hexagon_kernels(tvm.IRModule(funcs), [KernelSchedule(n, r, True) for n, r in rules.items()], NPU,
                              tmp_path)
    dis = hexagon._disassemble(hexagon.find_objdump() or "llvm-objdump", tmp_path / "objects" / "lib0.o",
                               "hexagonv73", ["+hvxv73", "+hvx-length128b"])
    assert dis.count("vrmpy(") >= 4 * len(funcs) and "vshuff(" in dis and "vcl0(" in dis
    assert not re.search(r"call .*(__extendhfsf2|__truncsfhf2)", dis)
    rng = np.random.default_rng(0)
    for name, (k, n) in decode.items():
        _check(kernels, name, name[:2], k, n, 1, rng)
    for name, (k, n) in prefill.items():
        for m in (1, ROWS + 1, 2 * ROWS):
            _check(kernels, name, name[:2], k, n, m, rng)


def test_recognises_q8_decode_and_prefill_functions():
    """The build's fused fp16 KN functions map to these kernels: one token -> the GEMV, a symbolic prompt -> the
    prefill matmul, for q4 and q8."""
    from tvm import te

    from pipeline.kernels.npu.hvx_int8_matmul import int8_matmul_like

    def fused(fmt: str, rows, k=64, n=128):
        x = te.placeholder((1, rows, k), "float16", name="x")
        if fmt == "q8":
            codes = te.placeholder((k, n), "int8", name="codes")
        else:
            codes = te.placeholder((k // 8, n), "uint32", name="codes")
        scales = te.placeholder((k // 32, n), "float16", name="scales")
        if fmt == "q8":
            w = te.compute((k, n), lambda i, j: codes[i, j].astype("float16") * scales[i // 32, j], name="dequantize_q8_kn")
        else:
            def nibble(i, j):
                return ((codes[i // 8, j] >> (i % 8 * 4).astype("uint32")) & tvm.tirx.const(15, "uint32")).astype("float16")
            w = te.compute((k, n), lambda i, j: (nibble(i, j) - tvm.tirx.const(7.0, "float16")) * scales[i // 32, j],
                           name="dequantize_kn")
        r = te.reduce_axis((0, k), name="k")
        y = te.compute((1, rows, n), lambda a, b, c: te.sum(x[a, b, r] * w[r, c], axis=r), name="matmul")
        return te.create_prim_func([codes, scales, x, y])

    seq = tvm.tirx.Var("seq_len", "int64")
    assert int8_matmul_like(fused("q8", 1))[1] == GEMV_RULES["q8"]
    assert int8_matmul_like(fused("q4", 1))[1] == GEMV_RULES["q4"]
    assert int8_matmul_like(fused("q8", seq))[1] == PREFILL_RULES["q8"]
    assert int8_matmul_like(fused("q4", seq))[1] == PREFILL_RULES["q4"]
    assert int8_matmul_like(fused("q8", 1, n=96)) is None     # fewer columns than one 128-column q8 block
