"""The q8 decode GEMV and the q4 / q8 prefill matmuls of kernels/npu/hvx_int8_matmul.py, run under qemu-hexagon
through the freestanding harness against a numpy model of their arithmetic and against the exact product."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from pipeline.compiler.schedule import KernelSchedule
from pipeline.config import load_target
from pipeline.kernels.npu import hexagon
from pipeline.kernels.npu.hvx_int8_matmul import PREFILL_RULES, Q8_GEMV_RULE, ROWS, int8_matmul
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
    """The kernels' arithmetic in numpy, per prompt row: int8 activations per group of 32 (float32 steps as the
    kernel takes them), exact integer dot products, fp32 scaling summed in group order."""
    w = _int_weights(fmt, codes)
    rows = []
    for xr in x.reshape(-1, x.shape[-1]):
        xg = xr.reshape(-1, 32).astype(np.float32)
        amax = np.abs(xg).max(1)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        s = xg * inv[:, None]
        q = np.trunc(np.where(s >= 0, s + np.float32(0.5), s - np.float32(0.5))).astype(np.int64)
        dots = np.einsum("gik,gi->gk", w.reshape(len(q), 32, -1), q)
        out = np.zeros(codes.shape[1], np.float32)
        for g in range(len(q)):
            out = out + dots[g].astype(np.float32) * (scales[g].astype(np.float32) * (amax[g] / np.float32(127)))
        rows.append(out)
    return np.stack(rows).astype(np.float16)


def _check(kernels, name: str, fmt: str, k: int, n: int, m: int, rng) -> float:
    codes, scales = QUANTIZE[fmt]((rng.standard_normal((n, k)) * 0.05).astype(np.float32), "KN")
    scales[:, :3] = [6e-8, 0, 6.1e-5]         # whole columns from an fp16 subnormal, zero, the smallest normal
    x = rng.standard_normal((1, m, k)).astype(np.float16)
    x[0, 0, 32:64] = 0                        # a group of zeros: activation scale 0
    got = kernels.call(name, [codes, scales, x, np.zeros((1, m, n), np.float16)])[-1][0]
    model = _model(fmt, codes, scales, x).astype(np.float64)
    # one fp16 ulp, or fp32 rounding over the group sums where they cancel (Hexagon fuses the steps into FMAs)
    off = np.abs(got.astype(np.float64) - model)
    ulp = np.spacing(np.abs(model).astype(np.float16)).astype(np.float64)
    assert (off <= np.maximum(ulp, 1e-5 * np.abs(model).max())).all(), (name, m, (off / ulp).max())
    exact = x[0].astype(np.float64) @ DEQUANTIZE[fmt](codes, scales, "KN").astype(np.float64).T
    err = float(np.abs(got - exact).max() / np.abs(exact).max())
    assert err < INT8_TOLERANCE, (name, m, err)
    return err


def test_q8_gemv_and_prefill_matmuls_match_numpy(tmp_path):
    """q8 decode GEMVs at SmolLM2 shapes whose N is not a multiple of 128 (the overlapping last block) and one
    that is; q4 / q8 prefills over 1, ROWS + 1 (a partial pass) and 2 ROWS prompt rows. Objects: vrmpy, the q8
    row shuffles, no soft-float fp16 call."""
    decode = {"q8_qkv": (576, 960), "q8_gate_up": (576, 3072)}
    prefill = {"q4_prefill": (64, 96), "q8_prefill": (96, 160)}
    funcs = {name: int8_matmul("q8", k, n, False) for name, (k, n) in decode.items()}
    funcs |= {name: int8_matmul(name[:2], k, n, True) for name, (k, n) in prefill.items()}
    rules = {n: PREFILL_RULES[n[:2]] if "prefill" in n else Q8_GEMV_RULE for n in funcs}
    kernels = hexagon_kernels(tvm.IRModule(funcs), [KernelSchedule(n, r, True) for n, r in rules.items()], NPU,
                              tmp_path)
    dis = hexagon._disassemble(hexagon.find_objdump() or "llvm-objdump", tmp_path / "objects" / "lib0.o",
                               "hexagonv73", ["+hvxv73", "+hvx-length128b"])
    assert dis.count("vrmpy(") >= 4 * len(funcs) and "vshuff(" in dis
    assert not re.search(r"call .*(__extendhfsf2|__truncsfhf2)", dis)
    rng = np.random.default_rng(0)
    for name, (k, n) in decode.items():
        _check(kernels, name, "q8", k, n, 1, rng)
    for name, (k, n) in prefill.items():
        for m in (1, ROWS + 1, 2 * ROWS):
            _check(kernels, name, name[:2], k, n, m, rng)


def test_recognises_q8_decode_and_prefill_functions():
    """The build's fused fp16 KN functions map to these kernels: q8 one-token -> the q8 GEMV, a symbolic prompt
    of q4 or q8 -> the prefill matmul; the q4 one-token GEMV stays hvx_q4_gemv.py's."""
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
    assert int8_matmul_like(fused("q8", 1))[1] == Q8_GEMV_RULE
    assert int8_matmul_like(fused("q8", seq))[1] == PREFILL_RULES["q8"]
    assert int8_matmul_like(fused("q4", seq))[1] == PREFILL_RULES["q4"]
    assert int8_matmul_like(fused("q4", 1)) is None
    assert int8_matmul_like(fused("q8", 1, n=96)) is None     # fewer columns than one 128-column q8 block
