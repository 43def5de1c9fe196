"""AArch64 `sdot` GEMV / prefill matmul over KN q4 codes: the CPU half of android-hexagon (its lm_head, and the
fallback of every NPU kernel).

Why: android-hexagon stores weights KN (HVX vectors run along the output dim), and its aarch64 library, left to
TVM, dequantized each whole weight into a scratch buffer per call and ran one serial fp16 chain per output —
the lm_head (49152 x 576 for SmolLM2) alone about 510 M instructions per token. arm.py's kernels read NK rows.

KN fits `sdot` without any shuffle: a KN code word holds 8 consecutive k of ONE output column (nibble i = k
8r + i, byte b = k 8r + 2b low, 8r + 2b + 1 high), so a 16-byte load of 4 neighbouring words is 4 columns, one
per 32-bit lane. Its low nibbles (`and`) meet the 4 activations of even k 8r, 8r + 2, 8r + 4, 8r + 6 and its
high nibbles (`ushr`) those of odd k, each a 4-byte word of x broadcast to the 4 lanes: every lane's int32 sum
is one column's, so a group ends in one vector per 4 columns — one `scvtf`, one `fmla` by the 4 columns'
scales (contiguous in KN: one 8-byte load, `fcvtl`) times x's step. x is quantized once per call per group of
32 in arm.py's precision (two signed bytes by default: two `sdot`s per code vector, summed 256 hi + lo in
int32, exact), the codes' zero point folded into the accumulator's start (-7 sum(q)). A task owns COLUMNS
consecutive output columns (4 vectors: a 64-byte run of each code row) over all of K; TVM's parallel loop gives
each thread a contiguous range of tasks. A prompt's rows loop inside the task after being quantized in parallel.

Same result as the fused TE up to x's rounding and fp32 summation order; tests/test_arm_kn_kernels.py runs it
under qemu-aarch64 against numpy.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import GROUP, ZERO
from pipeline.kernels.cpu.arm import Q_MAX, SDOT, X_BYTES, quantize_rows_macro
from pipeline.kernels.cpu.packed import substitute
from pipeline.kernels.cpu.recognize import blocks

COLUMNS = 16         # output columns per task: 4 int32x4 accumulators, a 64-byte run of every code row
WORDS = GROUP // 8   # code rows per group
NIBBLES = 0x0F


def kn_q4_dot_kernel(n: int, k: int, act: str = "float16", scale_dtype: str = "float16", prompt: bool = False,
                     x_bytes: int = X_BYTES) -> tirx.PrimFunc:
    """out[1, m, n] = x[1, m, k] @ dequantize(codes uint32 [k / 8, n], scales [k / 32, n]) (q4 KN), m = 1 or
    symbolic (`prompt`); x in `x_bytes` signed bytes per value."""
    assert k % GROUP == 0 and n % COLUMNS == 0 and x_bytes in (1, 2), (n, k, x_bytes)
    q_max = Q_MAX[x_bytes]
    groups, rows = k // GROUP, k // 8
    vecs = COLUMNS // 4
    i64 = T.int64
    m = tirx.Var("seq_len", "int64") if prompt else i64(1)

    @T.macro
    def quantize_row(x, xw, d, base, r):
        """Row r of x as words of 4 signed bytes: xw[r, b, 2 w + p] holds byte b (two bytes: 0 high, 1 low) of
        the steps of k = 8w + p, 8w + p + 2, 8w + p + 4, 8w + p + 6 (p = 0 even, 1 odd); d[r, g] the step of
        group g; base[r, g] = -7 * the sum of its steps (the codes' zero point)."""
        for g in range(groups):
            amax = T.alloc_buffer((1,), "float32")
            total = T.alloc_buffer((1,), "int32")
            amax[0] = T.float32(0)
            for j in range(GROUP):
                amax[0] = T.max(amax[0], T.fabs(T.Cast("float32", x[0, r, g * GROUP + j])))
            d[r, g] = amax[0] * T.float32(1.0 / q_max)
            total[0] = 0
            for wp in range(2 * WORDS):
                for b in range(x_bytes):
                    xw[r, b, g * 2 * WORDS + wp] = 0
                for j in range(4):
                    q: T.let[T.int32] = T.Cast("int32", T.round(T.Cast("float32", x[0, r, g * GROUP + wp // 2 * 8 + wp % 2 + 2 * j])
                                                           * T.if_then_else(amax[0] > T.float32(0), T.float32(q_max) / amax[0], T.float32(0))))
                    total[0] = total[0] + q
                    if x_bytes == 2:    # static; arithmetic shift: hi = floor((q + 128) / 256) in [-127, 127]
                        xw[r, 0, g * 2 * WORDS + wp] = T.bitwise_or(xw[r, 0, g * 2 * WORDS + wp], T.shift_left(
                            T.bitwise_and(T.shift_right(q + 128, 8), 0xFF), 8 * j))
                        xw[r, 1, g * 2 * WORDS + wp] = T.bitwise_or(xw[r, 1, g * 2 * WORDS + wp], T.shift_left(
                            T.bitwise_and(q - T.shift_right(q + 128, 8) * 256, 0xFF), 8 * j))
                    else:
                        xw[r, 0, g * 2 * WORDS + wp] = T.bitwise_or(xw[r, 0, g * 2 * WORDS + wp],
                                                                     T.shift_left(T.bitwise_and(q, 0xFF), 8 * j))
            base[r, g] = total[0] * -ZERO

    def x_lanes(xw, r, b, g, wp):
        """Word wp of group g of x row r (byte b), broadcast to the 4 lanes as int8x16: a lane of a 16-byte load
        of 4 words, which LLVM folds into the indexed `sdot v.4s, v.16b, v.4b[lane]`."""
        words = xw[r, b, T.Ramp(g * 2 * WORDS + wp // 4 * 4, 1, 4)]
        return T.reinterpret("int8x16", T.Shuffle([words], [wp % 4] * 4))

    def group_sums(w, xw, base, r, g, col):
        """Group g of columns col .. col + 3 times x row r: int32x4, lane j = column col + j."""
        acc = [T.Broadcast(0, 4)] * (x_bytes - 1) + [T.Broadcast(base[r, g], 4)]
        for wi in range(WORDS):
            v = T.reinterpret("int8x16", w[g * WORDS + wi, T.Ramp(col, 1, 4)])
            low = T.bitwise_and(v, T.Broadcast(T.int8(NIBBLES), 16))
            high = T.reinterpret("int8x16", T.shift_right(T.reinterpret("uint8x16", v), T.Broadcast(T.uint8(4), 16)))
            for b in range(x_bytes):
                acc[b] = T.call_llvm_pure_intrin("int32x4", SDOT, acc[b], low, x_lanes(xw, r, b, g, 2 * wi))
                acc[b] = T.call_llvm_pure_intrin("int32x4", SDOT, acc[b], high, x_lanes(xw, r, b, g, 2 * wi + 1))
        return acc[0] if x_bytes == 1 else acc[0] * T.Broadcast(256, 4) + acc[1]

    quantize_rows = quantize_rows_macro(quantize_row, prompt)

    @T.prim_func(private=True)
    def kernel(w: T.Buffer((i64(rows), i64(n)), "uint32"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), act), out: T.Buffer((i64(1), m, i64(n)), act)):
        T.func_attr({"tirx.noalias": True})
        xw = T.alloc_buffer((m, x_bytes, groups * 2 * WORDS), "int32")
        d = T.alloc_buffer((m, groups), "float32")
        base = T.alloc_buffer((m, groups), "int32")
        quantize_rows(x, xw, d, base, m)
        for task in T.parallel(n // COLUMNS):
            acc = T.alloc_buffer((COLUMNS,), "float32")
            for r in range(m):
                for c in T.unroll(vecs):
                    acc[T.Ramp(c * 4, 1, 4)] = T.Broadcast(T.float32(0), 4)
                for g in range(groups):
                    for c in T.unroll(vecs):
                        col: T.let[T.int32] = task * COLUMNS + c * 4
                        acc[T.Ramp(c * 4, 1, 4)] = acc[T.Ramp(c * 4, 1, 4)] + T.Cast(
                            "float32x4", group_sums(w, xw, base, r, g, col)) * (
                            T.Cast("float32x4", s[g, T.Ramp(col, 1, 4)]) * T.Broadcast(d[r, g], 4))
                for c in T.unroll(vecs):
                    out[0, r, T.Ramp(task * COLUMNS + c * 4, 1, 4)] = T.Cast(f"{act}x4", acc[T.Ramp(c * 4, 1, 4)])

    return kernel


def match_q4_kn(func: tirx.PrimFunc) -> tuple[int, int, str, str, bool, tuple[str, ...]] | None:
    """(N, K, activation dtype, scale dtype, prompt, role of each parameter) when `func` is the fused
    dequantize + matmul of q4 KN codes (codes uint32 [K / 8, N], scales [K / 32, N], x [1, 1 or m, K], out last)
    in fp16 or fp32; None otherwise."""
    match = match_kn(func, "dequantize_kn", 8, GROUP)
    if match is None or match[1] % GROUP or match[0] % COLUMNS:
        return None
    return match


def match_kn(func: tirx.PrimFunc, block: str, per_word: int, group: int,
             code_dtype: str = "uint32") -> tuple[int, int, str, str, bool, tuple[str, ...]] | None:
    """`match_q4_kn` for the dequantize block `block` of codes `per_word` to a `code_dtype` element (rows padded
    to whole words: [ceil(K / per_word), N]; int8 q8 codes: per_word 1) and one scale per `group` along K
    ([ceil(K / group), N]); the kernel checks which K and N it takes."""
    found = blocks(func)
    if [b.name_hint for b in found] != [block, "matmul"] or len(func.params) != 4:
        return None
    params = list(func.params)
    out = params[-1]
    if len(out.shape) != 3 or str(out.dtype) not in ("float16", "float32") or not isinstance(out.shape[2], tirx.IntImm):
        return None
    act, n = str(out.dtype), int(out.shape[2])
    prompt = not (isinstance(out.shape[1], tirx.IntImm) and int(out.shape[1]) == 1)
    if prompt and not isinstance(out.shape[1], tirx.Var):
        return None
    def is_x(p) -> bool:
        if str(p.dtype) != act or len(p.shape) != 3:
            return False
        rows = p.shape[1]
        return rows.same_as(out.shape[1]) if prompt else isinstance(rows, tirx.IntImm) and int(rows) == 1

    roles = []
    for p in params[:-1]:
        if str(p.dtype) == code_dtype and len(p.shape) == 2:
            roles.append("codes")
        elif is_x(p):
            roles.append("x")
        elif str(p.dtype) in ("float16", "float32") and len(p.shape) == 2:
            roles.append("scales")
        else:
            return None
    if sorted(roles) != ["codes", "scales", "x"]:
        return None
    by_role = dict(zip(roles, params[:-1], strict=True))
    if not all(isinstance(dim, tirx.IntImm) for role in ("codes", "scales") for dim in by_role[role].shape):
        return None
    k = int(by_role["x"].shape[2])
    if ([int(v) for v in by_role["codes"].shape] != [-(-k // per_word), n]
            or [int(v) for v in by_role["scales"].shape] != [-(-k // group), n]):
        return None
    return n, k, act, str(by_role["scales"].dtype), prompt, (*roles, "out")


def arm_kn_dot_like(func: tirx.PrimFunc, x_bytes: int = X_BYTES) -> tirx.PrimFunc | None:
    """This module's kernel with `func`'s parameter order when `func` is a fused q4 KN GEMV or prefill matmul it
    covers, else None. The caller checks that the target has dotprod."""
    match = match_q4_kn(func)
    if match is None:
        return None
    n, k, act, scale_dtype, prompt, order = match
    kernel = kn_q4_dot_kernel(n, k, act, scale_dtype, prompt, x_bytes)
    return substitute(func, kernel, order, "dequant-matmul" if prompt else "dequant-gemv")
