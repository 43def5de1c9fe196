"""A q4 (KN) decode GEMV for Hexagon HVX from byte dot products: no dequantized weights, no soft-float.

The generic HVX schedule (hexagon.py) turns the fused dequantize + matmul into HVX code that unpacks every
weight to fp32 and accumulates in HVX float (qf32); qemu-hexagon 7.2 cannot run that code. This kernel
follows the integer route (the approach of llama.cpp's Hexagon backend, written here from the ISA):

1. the fp16 activations are quantized per group of 32 to int8 (scale max|x| / 127, round half away from
   zero) — K scalar steps per call, with fp16 read by integer bit arithmetic (no `__extendhfsf2` call);
2. for each 32 outputs and each group, the 4 code words of a KN row are one 128-byte HVX vector (32 columns
   x 8 nibbles); `v & 0x0f0f0f0f` holds the codes of the even k, `(v >> 4) & 0x0f0f0f0f` those of the odd k,
   and `vrmpy(Vu.ub, Rt.b)` adds, per column, four code x activation products, Rt holding 4 int8
   activations: 8 vrmpy per group and 32 columns, int32 accumulators;
3. per group: the accumulators start at -7 x the group's activation sum (the codes' zero point), and the 32
   columns' fp16 scales are turned into fp32 bit patterns in HVX integer lanes (sign, then exponent and mantissa
   shifted into place without rebasing: scale x 2^-112, exact, subnormal fp16 included; the activation scale
   carries the 2^112); then per column one int -> float conversion and the scaling by weight scale x activation
   scale into an fp32 accumulator, in scalar Hexagon floating point;
4. the fp32 sums are rounded to fp16 (nearest even) by integer bit arithmetic (no `__truncsfhf2` call).

Step 3's float part is scalar on purpose: HVX float (qf32, v68+) would be the fast choice on a v73 phone, but qemu-hexagon
7.2 does not decode it, and a kernel that cannot be executed here could not be checked against numpy.
Numerics: the int8 activations add an error of about 0.5% of max|x| per group (llama.cpp's Q8 activations).
"""

from __future__ import annotations

from tvm import ir, tirx
from tvm.script import tirx as T

from pipeline.formats import GROUP, ZERO
from pipeline.kernels.cpu.packed import ROLES, substitute
from pipeline.kernels.cpu.recognize import blocks

HAND_WRITTEN = "hvx.hand_written"   # PrimFunc attribute: written with HVX vectors already, not to be rescheduled
RULE = "hvx-q4-vrmpy"               # the placement rule of the kernels this module replaces

LANES = 32           # int32 lanes of one 128-byte HVX vector = output columns per block
WORDS = GROUP // 8   # KN code rows per group (8 nibbles per uint32)
VRMPY_ACC = "llvm.hexagon.V6.vrmpybus.acc.128B"
NIBBLES = 0x0F0F0F0F


def f16_bits_to_f32(h):
    """fp16 bits (an int32 expression, 0..0xffff) as a float32 value, exactly, with integer operations and
    one int -> float conversion for subnormals."""
    sign = T.shift_left(T.bitwise_and(h, 0x8000), 16)
    exp = T.bitwise_and(T.shift_right(h, 10), 0x1F)
    man = T.bitwise_and(h, 0x3FF)
    normal = T.bitwise_or(sign, T.bitwise_or(T.shift_left(exp + 112, 23), T.shift_left(man, 13)))
    special = T.bitwise_or(sign, T.bitwise_or(0x7F800000, T.shift_left(man, 13)))
    bits = T.if_then_else(exp == 31, special, normal)
    tiny = T.Cast("float32", man) * T.float32(2.0 ** -24)
    negative = T.bitwise_and(h, 0x8000) != 0   # not `sign != 0`: TVM folds that shifted test away
    return T.if_then_else(exp == 0, T.if_then_else(negative, -tiny, tiny), T.reinterpret("float32", bits))


def f32_to_f16_bits(f):
    """The fp16 bits (int32, 0..0xffff) nearest to a float32 value (ties to even; overflow to inf, NaN kept)."""
    u = T.reinterpret("int32", f)
    sign = T.bitwise_and(T.shift_right(u, 16), 0x8000)
    mag = T.bitwise_and(u, 0x7FFFFFFF)
    rebased = mag - 0x38000000                      # exponent bias 127 -> 15
    normal = T.shift_right(rebased + 0xFFF + T.bitwise_and(T.shift_right(rebased, 13), 1), 13)
    # below 2^-14: the fp16 subnormal round(|f| * 2^24), i.e. the 24-bit significand shifted right by
    # 126 - exponent, rounded to nearest even in integers
    shift = T.min(126 - T.shift_right(mag, 23), 31)
    significand = T.bitwise_or(T.bitwise_and(mag, 0x7FFFFF), 0x800000)
    kept = T.shift_right(significand, shift)
    rest = T.bitwise_and(significand, T.shift_left(1, shift) - 1)
    half = T.shift_left(1, shift - 1)
    subnormal = kept + T.if_then_else(T.Or(rest > half, T.And(rest == half, T.bitwise_and(kept, 1) == 1)), 1, 0)
    big = T.if_then_else(mag > 0x7F800000, 0x7E00, 0x7C00)
    return T.bitwise_or(sign, T.if_then_else(mag >= 0x47800000, big,
                                             T.if_then_else(mag >= 0x38800000, normal, subnormal)))


def _load_f16(x, i):
    """x[0, 0, i] (fp16) as float32, by bit arithmetic."""
    return f16_bits_to_f32(T.Cast("int32", T.reinterpret("uint16", x[0, 0, i])))


def _to_int8(s):
    """Round half away from zero (|s| <= 127 here) with a truncating conversion, no libm call."""
    return T.Cast("int32", T.if_then_else(s >= T.float32(0), s + T.float32(0.5), s - T.float32(0.5)))


def q4_gemv(k: int, n: int) -> tirx.PrimFunc:
    """y[1, 1, n] (fp16) = x[1, 1, k] (fp16) @ W, W stored q4 KN: codes uint32 [k / 8, n], scales fp16
    [k / 32, n] — the parameter order of the build's fused dequantize + matmul decode kernels."""
    if k % GROUP or n % LANES:
        raise ValueError(f"q4 HVX GEMV needs k % {GROUP} == 0 and n % {LANES} == 0, got k={k}, n={n}")
    groups, rows = k // GROUP, k // 8

    @T.prim_func
    def gemv(codes: T.Buffer((rows, n), "uint32"), scales: T.Buffer((groups, n), "float16"),
             x: T.Buffer((1, 1, k), "float16"), y: T.Buffer((1, 1, n), "float16")):
        T.func_attr({"tirx.noalias": True, HAND_WRITTEN: True})
        x_even = T.alloc_buffer((rows,), "int32")     # 4 int8 activations of k = 8r, 8r+2, 8r+4, 8r+6
        x_odd = T.alloc_buffer((rows,), "int32")      # and of k = 8r+1, ..., 8r+7
        x_scale = T.alloc_buffer((groups,), "float32")
        x_sum = T.alloc_buffer((groups,), "int32")
        acc = T.alloc_buffer((LANES,), "int32")
        w_bits = T.alloc_buffer((LANES,), "int32")     # a group's 32 weight scales, as fp32 bits of scale x 2^-112
        out = T.alloc_buffer((LANES,), "float32")
        # 1. int8 activations per group, packed 4 to a word as vrmpy reads them
        for g in range(groups):
            x_scale[g] = T.float32(0)      # max |x| of the group until its codes are made
            for i in range(GROUP):
                v = T.meta_var(_load_f16(x, g * GROUP + i))
                x_scale[g] = T.max(x_scale[g], T.max(v, -v))
            inv = T.meta_var(T.if_then_else(x_scale[g] > T.float32(0), T.float32(127) / x_scale[g], T.float32(0)))
            x_sum[g] = 0
            for w in range(WORDS):
                x_even[g * WORDS + w] = 0
                x_odd[g * WORDS + w] = 0
                for j in range(4):
                    q_even = T.meta_var(_to_int8(_load_f16(x, g * GROUP + 8 * w + 2 * j) * inv))
                    q_odd = T.meta_var(_to_int8(_load_f16(x, g * GROUP + 8 * w + 2 * j + 1) * inv))
                    x_even[g * WORDS + w] = T.bitwise_or(x_even[g * WORDS + w],
                                                         T.shift_left(T.bitwise_and(q_even, 0xFF), 8 * j))
                    x_odd[g * WORDS + w] = T.bitwise_or(x_odd[g * WORDS + w],
                                                        T.shift_left(T.bitwise_and(q_odd, 0xFF), 8 * j))
                    x_sum[g] = x_sum[g] + q_even + q_odd
            x_scale[g] = x_scale[g] / T.float32(127) * T.float32(2.0 ** 112)   # x 2^112: see w_bits
        # 2.-4. per block of 32 output columns
        for nb in range(n // LANES):
            for j in range(LANES):
                out[j] = T.float32(0)
            for g in range(groups):
                acc[T.ramp(0, 1, LANES)] = T.broadcast(T.int32(ZERO) * -x_sum[g], LANES)   # the zero point
                for w in T.unroll(WORDS):
                    v = T.meta_var(T.reinterpret("int32x32", codes.vload([g * WORDS + w, nb * LANES], "uint32x32")))
                    even = T.meta_var(T.bitwise_and(v, T.broadcast(T.int32(NIBBLES), LANES)))
                    odd = T.meta_var(T.bitwise_and(T.shift_right(v, T.broadcast(T.int32(4), LANES)),
                                                   T.broadcast(T.int32(NIBBLES), LANES)))
                    acc[T.ramp(0, 1, LANES)] = T.call_llvm_pure_intrin(
                        "int32x32", VRMPY_ACC, acc.vload([0], "int32x32"), even, x_even[g * WORDS + w])
                    acc[T.ramp(0, 1, LANES)] = T.call_llvm_pure_intrin(
                        "int32x32", VRMPY_ACC, acc.vload([0], "int32x32"), odd, x_odd[g * WORDS + w])
                # the group's fp16 scales as fp32 bits in HVX integer lanes: sign, then exponent and mantissa
                # shifted into place unrebased, i.e. scale x 2^-112 (an fp32 denormal when the fp16 is subnormal:
                # exact either way); x_scale carries the 2^112 back. Scales are finite (NaN / inf are refused
                # when a bundle is converted).
                h = T.meta_var(T.Cast("int32x32", T.reinterpret("uint16x32", scales.vload([g, nb * LANES],
                                                                                           "float16x32"))))
                w_bits[T.ramp(0, 1, LANES)] = T.bitwise_or(
                    T.shift_left(T.bitwise_and(h, T.broadcast(T.int32(0x8000), LANES)), T.broadcast(T.int32(16), LANES)),
                    T.shift_left(T.bitwise_and(h, T.broadcast(T.int32(0x7FFF), LANES)), T.broadcast(T.int32(13), LANES)))
                for j in range(LANES):
                    out[j] = out[j] + T.Cast("float32", acc[j]) * (T.reinterpret("float32", w_bits[j]) * x_scale[g])
            for j in range(LANES):
                y[0, 0, nb * LANES + j] = T.reinterpret("float16", T.Cast("uint16", f32_to_f16_bits(out[j])))

    return gemv


def _dequantizes_q4_fp16(block) -> bool:
    """The block stores (float16(code nibble) - 7) * scale in fp16 (the fused TE dequantize of q4)."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Mul):
        return False
    code, scale = store.value.a, store.value.b
    return (str(store.value.ty) == "float16" and isinstance(code, tirx.Sub) and isinstance(code.a, tirx.Cast)
            and isinstance(code.b, tirx.FloatImm) and float(code.b.value) == float(ZERO)
            and isinstance(scale, ir.expr.TensorLoad) and str(scale.ty) == "float16")   # a BufferLoad in 0.27


def match_q4_kn_gemv(func: tirx.PrimFunc) -> tuple[int, int, tuple[str, ...]] | None:
    """(K, N, role of each parameter) when `func` is the build's fused fp16 one-token q4 KN GEMV: blocks
    dequantize then matmul, codes uint32 [K / 8, N], scales fp16 [K / 32, N], x fp16 [1, 1, K], out fp16
    [1, 1, N] (last); None otherwise (prefill rows, tiled or other formats, fp32)."""
    found = blocks(func)
    if len(found) != 2 or found[1].name_hint != "matmul" or not _dequantizes_q4_fp16(found[0]):
        return None
    params = list(func.params)
    if len(params) != 4 or not all(isinstance(d, tirx.IntImm) for p in params for d in p.shape):
        return None
    shapes = [tuple(int(d) for d in p.shape) for p in params]
    dtypes = [str(p.dtype) for p in params]
    if dtypes[-1] != "float16" or len(shapes[-1]) != 3 or shapes[-1][:2] != (1, 1):
        return None
    n = shapes[-1][2]
    roles = []
    for shape, dtype in zip(shapes[:-1], dtypes[:-1], strict=True):
        roles.append("codes" if dtype == "uint32" else "x" if len(shape) == 3 else "scales")
    if sorted(roles) != sorted(ROLES[:3]) or dtypes[roles.index("scales")] != "float16":
        return None
    by_role = dict(zip(roles, shapes[:-1], strict=True))
    k = by_role["x"][2] if by_role["x"][:2] == (1, 1) else -1
    if (k <= 0 or k % GROUP or n % LANES or by_role["codes"] != (k // 8, n)
            or by_role["scales"] != (k // GROUP, n)):
        return None
    return k, n, (*roles, "out")


def q4_gemv_like(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """This module's kernel with `func`'s parameter order and attributes, or None when `func` is not a q4 KN
    decode GEMV it computes."""
    match = match_q4_kn_gemv(func)
    if match is None:
        return None
    k, n, order = match
    return substitute(func, q4_gemv(k, n), order, "dequant-gemv").with_attr(HAND_WRITTEN, True)
