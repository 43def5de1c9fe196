"""Hand-written CPU kernels for the prefill matmul of quantized weights (a prompt's rows times KN q4, t2 or
q8 codes, fp32 activations).

Why not the schedule: `cpu_schedule` dequantizes a tile of 24 weight columns once per task and then runs
every prompt row over it with the 24 columns in registers: per k, one broadcast of x, three loads of the
tile and three FMAs — as many loads as FMAs, and the tile (K x 24 fp32: 55 KB at K = 576) is streamed once
per row. Here, per tile, rows go MR at a time: MR x 3 accumulators (12 of AVX2's 16 registers at MR = 4),
so per k the three tile loads and MR broadcasts feed 3 * MR FMAs, and the tile is streamed once per MR
rows. Rows left over (the prompt length mod MR) run one at a time. Each task dequantizes its tile into a
local scratch first (the same expression as the fused TE: (code - offset) * scale), so the formats differ
only there.

`CPUInlineParallel` substitutes this kernel for a function that is exactly the fused pattern with a
symbolic row count (`match_packed_kn_gemv(..., rows="prompt")`); anything else keeps the schedules. Same
result as the fused TE up to fp32 summation order (the sum over k runs in the same order per output).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .cpu_gemv import FORMATS, LANES, PackedFormat, match_packed_kn_gemv, substitute

ROWS = 4           # prompt rows per register tile (x 3 vectors: 12 accumulators)
TILE_VECTORS = (3, 2, 1)   # 24 weight columns per task when N allows, else 16 / 8


def packed_kn_matmul(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16", rows: int = ROWS):
    """The kernel for out[1, m, n] = x[1, m, k] @ dequantize(codes, scales), m symbolic (a prompt)."""
    vecs = next(v for v in TILE_VECTORS if n % (v * LANES) == 0)
    tile = vecs * LANES
    codes, bits, group = spec.codes, spec.bits, spec.group
    groups = -(-k // group)
    word_rows = k // codes
    mask = (1 << bits) - 1
    i64 = T.int64
    vf = f"float32x{LANES}"
    m = tirx.Var("seq_len", "int64")
    code_shape = (i64(k), i64(n)) if bits == 8 else (i64(word_rows), i64(n))

    def weight(w, s, kk, col):
        """Dequantized weight [kk, col] (scalar; vectorized over col by the caller's loop)."""
        if bits == 8:
            code = T.Cast("float32", w[kk, col])
        else:
            code = T.Cast("float32", T.bitwise_and(
                T.shift_right(w[kk // codes, col], T.Cast("uint32", kk % codes * bits)), T.uint32(mask)))
            code = code - T.float32(spec.offset)
        return code * T.Cast("float32", s[kk // group, col])

    @T.macro
    def row_block(x, out, wt, acc, first, count, col):
        """Rows first .. first + count - 1 (count a Python int) over the task's dequantized tile."""
        for j in T.unroll(count * vecs):
            acc[j] = T.Broadcast(T.float32(0), LANES)
        for kk in range(k):
            for r in T.unroll(count):
                for j in T.unroll(vecs):
                    acc[r * vecs + j] = acc[r * vecs + j] + T.Broadcast(x[0, first + r, kk], LANES) * wt[
                        kk, T.Ramp(j * LANES, 1, LANES)]
        for r in T.unroll(count):
            for j in T.unroll(vecs):
                out[0, first + r, T.Ramp(col + j * LANES, 1, LANES)] = acc[r * vecs + j]

    @T.prim_func(private=True)
    def matmul(w: T.Buffer(code_shape, spec.code_dtype), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), "float32"), out: T.Buffer((i64(1), m, i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for task in T.parallel(n // tile):
            wt = T.alloc_buffer((k, tile), "float32")        # this task's columns, dequantized
            acc = T.alloc_buffer((rows * vecs,), vf, scope="local")
            col: T.let[T.int64] = T.Cast("int64", task) * tile
            for kk in range(k):
                for j in T.vectorized(tile):
                    wt[kk, j] = weight(w, s, kk, col + j)
            for b in range(m // rows):
                row_block(x, out, wt, acc, b * rows, rows, col)
            for r in range(m % rows):
                row_block(x, out, wt, acc, m // rows * rows + r, 1, col)

    return matmul


def packed_kn_matmul_like(func: tirx.PrimFunc, text: str | None = None) -> tirx.PrimFunc | None:
    """The hand-written prefill kernel with `func`'s parameter order, or None when `func` is not one."""
    match = match_packed_kn_gemv(func, text, rows="prompt")
    if match is None:
        return None
    fmt, n, k, scale_dtype, order = match
    kernel = packed_kn_matmul(FORMATS[fmt], n, k, scale_dtype)
    return substitute(func, kernel, order, "dequant-matmul-ternary" if fmt == "t2" else "dequant-matmul")
