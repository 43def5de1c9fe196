"""AArch64 `sdot` GEMV / prefill matmul over KN q8 codes: android-hexagon's CPU half with q8 weights (QUANT=q8f16,
or a q8 lm_head a phone plan picks); arm_kn.py is its q4 counterpart.

Why: left to TVM, a fused KN q8 dequantize + matmul dequantized its whole weight into a scratch buffer per call
and multiplied in mostly scalar code ("cpu-default": 7.6 instructions per weight, 20% of them vector). Here no
weight is ever dequantized: x is quantized once per call per group of 32 (arm.quantize_row_macro: two signed
bytes by default, q = 256 hi + lo, one fp32 step per group), the int8 codes meet it in `sdot`, and each group's
int32 sums take one fp32 scale step.

KN q8 codes are int8 [K, N] (android-hexagon sets no q8_tile): a row holds one k of every column, while `sdot`
sums 4 neighbouring bytes of a 32-bit lane. So 4 rows k .. k + 3 of 16 columns (four 16-byte loads) are
transposed by two rounds of zips (bytes, then halfwords: 8 `zip1` / `zip2`) into 4 vectors whose lane c holds
the 4 k of one column, and each meets x's word k .. k + 3 broadcast to the lanes (the indexed `sdot v.4s,
v.16b, v.4b[lane]`): every lane's int32 sum is one column's, as in arm_kn.py. q8's zero point is 0, so the sums
need no offset term. Per group, a 16-column block ends in 4 int32x4 vectors (two bytes: 256 hi + lo, exact:
32 * 127 * 32512 < 2^31), `scvtf`, and an `fmla` by the 4 columns' fp16 scales (contiguous in KN) times x's
step. A task owns SPAN consecutive columns (64: whole cache lines of every code row, its 16-column blocks run
one after another per group while those lines are in L1; 16 where 64 leaves fewer than 8 tasks) over all of K;
TVM's parallel loop gives each thread a contiguous range of tasks. A prompt's rows, quantized in parallel first,
run in pairs inside the task, both rows meeting each transpose (an odd last row alone).

Counted under qemu-aarch64 (benchmarks/kn_q8_counts.py: whole calls, one thread, x's quantization included;
benchmarks/results/kn_q8_counts.md), SmolLM2's shapes: 0.41 instructions per weight for every layer's decode GEMV
(qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536) against 7.6-7.7 for cpu-default (18-19x
fewer), the 49152 x 576 lm_head 0.47 against 7.69 (its rows 48 KB apart: LLVM materializes the row offsets);
prompts of 8 rows 0.33 per weight and row against 7.07 (22x). The decode hot loop (objdump): 824 instructions
per 4 blocks x 32 rows = 0.40 per weight with two-byte x, 0.31 with int8 x, 98% vector; 0.31 of the 0.40 are
the 4 loads, 8 zips and 8 sdots per 64 codes, the rest each group's zeroing, 256 hi + lo and scale step. (One
4-register shuffle per vector instead of the zips became `tbl` pairs and spills: 0.62.)

Same result as the fused TE up to x's rounding and fp32 summation order; tests/test_arm_kn_q8_kernels.py runs it
under qemu-aarch64 against numpy.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import GROUP
from pipeline.kernels.cpu.arm import SDOT, X_BYTES, quantize_row_macro, quantize_rows_macro
from pipeline.kernels.cpu.arm_kn import match_kn
from pipeline.kernels.cpu.packed import substitute

BLOCK = 16           # columns per block: 4 int32x4 sums per byte of x (8 registers with two bytes)
SPAN = 64            # columns per task where that leaves MIN_TASKS: a 64-byte line of every code row
MIN_TASKS = 8
STEP = 4             # code rows per sdot


def task_span(n: int) -> int:
    """Columns per parallel task for n outputs."""
    return SPAN if n % SPAN == 0 and n // SPAN >= MIN_TASKS else BLOCK


def _zip(a, b, unit: int, high: bool):
    """`zip1` / `zip2` (high) of int8x16 a, b in units of `unit` bytes: a's and b's units of the low (high) half
    interleaved."""
    units = range(8 // unit * high, 8 // unit * (high + 1))
    return T.Shuffle([a, b], [off + i * unit + j for i in units for off in (0, 16) for j in range(unit)])


def _columns(w, row, col):
    """Codes [row .. row + 3, col .. col + 15] as 4 int8x16, vector v lane c byte j = code [row + j, col + 4 v + c]."""
    r = [w[row + j, T.Ramp(col, 1, 16)] for j in range(STEP)]
    pairs = [[_zip(r[0], r[1], 1, h), _zip(r[2], r[3], 1, h)] for h in (False, True)]   # columns 0-7, 8-15
    return [_zip(*pairs[v // 2], 2, bool(v % 2)) for v in range(4)]


def kn_q8_dot_kernel(n: int, k: int, act: str = "float16", scale_dtype: str = "float16", prompt: bool = False,
                     x_bytes: int = X_BYTES) -> tirx.PrimFunc:
    """out[1, m, n] = x[1, m, k] @ dequantize(codes int8 [k, n], scales [k / 32, n]) (q8 KN), m = 1 or
    symbolic (`prompt`); x in `x_bytes` signed bytes per value."""
    assert k % GROUP == 0 and n % BLOCK == 0 and x_bytes in (1, 2), (n, k, x_bytes)
    groups = k // GROUP
    span = task_span(n)
    i64 = T.int64
    m = tirx.Var("seq_len", "int64") if prompt else i64(1)
    quantize_rows = quantize_rows_macro(quantize_row_macro(GROUP, k, x_bytes, 0, lambda g, j: g * GROUP + j), prompt)

    def x_lanes(xq, r, b, g, i):
        """x row r's values g 32 + 4 i .. + 3 (byte b) as one word broadcast to the 4 lanes: a lane of a 16-byte
        load, which LLVM folds into the indexed sdot."""
        words = T.reinterpret("int32x4", xq[r, b, T.Ramp(g * GROUP + i // 4 * 16, 1, 16)])
        return T.reinterpret("int8x16", T.Shuffle([words], [i % 4] * 4))

    def lanes(slot, b, v):
        """Where isum holds the int32x4 of x row slot's byte b and the block's columns 4 v .. 4 v + 3."""
        return T.Ramp(((slot * x_bytes + b) * 4 + v) * 4, 1, 4)

    def dot(isum, codes, xq, r, g, i, slot, b, v):
        """That int32x4 + sdot(codes, x row r + slot's word i of group g)."""
        return T.call_llvm_pure_intrin("int32x4", SDOT, isum[lanes(slot, b, v)], codes, x_lanes(xq, r + slot, b, g, i))

    def sums(isum, slot, v):
        """The group's int32 sums of columns 4 v .. 4 v + 3 of the block, x row slot (two bytes: 256 hi + lo, exact)."""
        if x_bytes == 1:
            return isum[lanes(slot, 0, v)]
        return isum[lanes(slot, 0, v)] * T.Broadcast(256, 4) + isum[lanes(slot, 1, v)]

    def macros(rows: int):
        """A macro computing `rows` output rows of a task at once (2: a prompt's pairs, which share each
        transpose: 0.33 instead of 0.41 instructions per weight and row)."""

        @T.macro
        def step(w, xq, isum, r, g, col, i):
            """Code rows g 32 + 4 i .. + 3 of the block's 16 columns into isum: the 4 transposed vectors, each
            met by x's word in every byte of each row (i static: x's lane)."""
            row: T.let[T.int32] = g * GROUP + STEP * i
            c0: T.let[T.int8x16] = _columns(w, row, col)[0]
            c1: T.let[T.int8x16] = _columns(w, row, col)[1]
            c2: T.let[T.int8x16] = _columns(w, row, col)[2]
            c3: T.let[T.int8x16] = _columns(w, row, col)[3]
            for slot in T.unroll(rows):
                for b in T.unroll(x_bytes):
                    isum[lanes(slot, b, 0)] = dot(isum, c0, xq, r, g, i, slot, b, 0)
                    isum[lanes(slot, b, 1)] = dot(isum, c1, xq, r, g, i, slot, b, 1)
                    isum[lanes(slot, b, 2)] = dot(isum, c2, xq, r, g, i, slot, b, 2)
                    isum[lanes(slot, b, 3)] = dot(isum, c3, xq, r, g, i, slot, b, 3)

        @T.macro
        def block_group(w, s, xq, d, acc, isum, r, g, blk, col):
            """acc[rows of the block's 16 columns] += group g's sums * their scales * x's steps (8 steps of 4
            code rows)."""
            for j in T.unroll(rows * x_bytes * 4):
                isum[T.Ramp(j * 4, 1, 4)] = T.Broadcast(0, 4)
            step(w, xq, isum, r, g, col, 0)   # one line each: x's lane must be a Python int, not a loop variable
            step(w, xq, isum, r, g, col, 1)
            step(w, xq, isum, r, g, col, 2)
            step(w, xq, isum, r, g, col, 3)
            step(w, xq, isum, r, g, col, 4)
            step(w, xq, isum, r, g, col, 5)
            step(w, xq, isum, r, g, col, 6)
            step(w, xq, isum, r, g, col, 7)
            for slot in T.unroll(rows):
                for v in T.unroll(4):
                    acc[T.Ramp(slot * span + blk * BLOCK + v * 4, 1, 4)] = acc[
                        T.Ramp(slot * span + blk * BLOCK + v * 4, 1, 4)] + T.Cast("float32x4", sums(isum, slot, v)) * (
                        T.Cast("float32x4", s[g, T.Ramp(col + v * 4, 1, 4)]) * T.Broadcast(d[r + slot, g], 4))

        @T.macro
        def rows_pass(w, s, xq, d, out, acc, isum, task, r):
            """Output rows r .. r + rows - 1 of the task's columns over all of K."""
            for c in T.unroll(rows * span // 4):
                acc[T.Ramp(c * 4, 1, 4)] = T.Broadcast(T.float32(0), 4)
            for g in range(groups):
                for blk in T.unroll(span // BLOCK):   # unrolled: x's lanes stay in the sdot (LICM hoisted and spilled them)
                    col: T.let[T.int32] = task * span + blk * BLOCK
                    block_group(w, s, xq, d, acc, isum, r, g, blk, col)
            for slot in T.unroll(rows):
                for c in T.unroll(span // 4):
                    out[0, r + slot, T.Ramp(task * span + c * 4, 1, 4)] = T.Cast(
                        f"{act}x4", acc[T.Ramp(slot * span + c * 4, 1, 4)])

        return rows_pass

    one_row, two_rows = macros(1), macros(2)
    pair_rows = 2 if prompt else 1

    @T.prim_func(private=True)
    def kernel(w: T.Buffer((i64(k), i64(n)), "int8"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), act), out: T.Buffer((i64(1), m, i64(n)), act)):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((m, x_bytes, k), "int8")
        d = T.alloc_buffer((m, groups), "float32")
        base = T.alloc_buffer((m, groups * 4), "int32")   # quantize_row's offset terms: 0 for q8, unread
        quantize_rows(x, xq, d, base, m)
        for task in T.parallel(n // span):
            acc = T.alloc_buffer((pair_rows * span,), "float32")
            isum = T.alloc_buffer((pair_rows * x_bytes * BLOCK,), "int32")
            if prompt:
                for pair in range(m // 2):
                    two_rows(w, s, xq, d, out, acc, isum, task, pair * 2)
                if m % 2 == 1:
                    one_row(w, s, xq, d, out, acc, isum, task, m - 1)
            else:
                one_row(w, s, xq, d, out, acc, isum, task, 0)

    return kernel


def arm_kn_q8_dot_like(func: tirx.PrimFunc, x_bytes: int = X_BYTES) -> tirx.PrimFunc | None:
    """This module's kernel with `func`'s parameter order when `func` is a fused KN q8 GEMV or prefill matmul
    (codes int8 [K, N], scales [K / 32, N], K a whole number of groups, N of BLOCK) in fp16 or fp32, else None
    (tiled q8 codes included: they stay on the other rules). The caller checks that the target has dotprod."""
    match = match_kn(func, "dequantize_q8_kn", 1, GROUP, code_dtype="int8")
    if match is None or match[1] % GROUP or match[0] % BLOCK:
        return None
    n, k, act, scale_dtype, prompt, order = match
    kernel = kn_q8_dot_kernel(n, k, act, scale_dtype, prompt, x_bytes)
    return substitute(func, kernel, order, "dequant-matmul" if prompt else "dequant-gemv")
