"""AArch64 `sdot` GEMV / prefill matmul over KN t2 (ternary) and b1 (binary) codes: android-hexagon's CPU half
with a ternary / binary scheme (QUANT=ternary_ptq, binary_ptq, a phone plan's t2 / b1 layers); arm_kn.py and
arm_kn_q8.py are its q4 / q8 counterparts.

Why: left to TVM, a fused KN t2 / b1 dequantize + matmul dequantized its whole weight into a scratch buffer per
call and multiplied in scalar code ("cpu-default"). Here no weight is dequantized: x is quantized once per call
per group of 128 (arm.quantize_row_macro: two signed bytes by default, q = 256 hi + lo, one fp32 step per
group), the codes meet it in `sdot`, and each group's int32 sums take one fp32 scale step.

A KN code word holds per_word consecutive k of ONE output column (t2: 16 two-bit codes, byte b = k 4b .. 4b + 3,
field f at bits 2f; b1: 32 sign bits, byte b = k 8b .. 8b + 7, bit p), so a 16-byte load of 4 neighbouring
words is 4 columns, one per 32-bit lane, as in arm_kn.py. Field f of every byte (t2: `and` / `ushr`, 6 ops for
4 fields; b1: one `cmtst` per bit plane, -1 where set) meets x's word of the 4 k that field holds in those
bytes, broadcast to the lanes (the indexed `sdot v.4s, v.16b, v.4b[lane]`): every lane's int32 sum is one
column's. x is stored in that order (value k of a word at word * per_word + 4 f + b), so one 16-byte load of x
holds the words of 4 fields. t2's value is code - 1: the accumulator starts at -sum(q). b1's is 2 bit - 1: the
sdot sums S = -sum of q over set bits, the group's dot -2 S - sum(q). Both are exact in int32 with two-byte x
(|sum| <= 128 * 3 * 32512 < 2^31). A group ends in one vector per 4 columns: `scvtf`, one `fmla` by the
columns' fp16 scales (contiguous in KN) times x's step. The last group may be 64 values (K = 576): it reads
its 4 (t2) / 2 (b1) code rows only. A task owns COLUMNS consecutive output columns (4 vectors, a 64-byte run
of every code row) over all of K; TVM's parallel loop gives each thread a contiguous range of tasks. A
prompt's rows, quantized in parallel first, loop inside the task (t2: in pairs sharing each code load and
field extraction, see PAIRED).

Counted under qemu-aarch64 (benchmarks/kn_sign_counts.py: whole calls, one thread, x's quantization included;
benchmarks/results/kn_sign_counts.md), SmolLM2's layer shapes: decode GEMVs 0.27-0.32 instructions per weight
for t2 and b1 against 8.9-9.2 for cpu-default (28-34x fewer), prompts of 8 rows 0.28-0.31 per weight and row
against 7.2-7.3 (23-26x). The decode hot loop (objdump) is 0.26 per weight with two-byte x for both, 98%
vector; the rest of a call is mostly x's scalar quantization (about 30 instructions per value, 0.05 per weight
at N = 576). t2's loop is 6 field ops + 8 sdots per 64 codes; b1's 8 cmtst + 16 sdots per 128 codes, but LLVM
rematerializes the 8 bit masks (`movi`, ~10% of the loop). (Tried: t2 fields 1 / 2 masked in place into a
second, 4 x scaled sum (5 field ops instead of 6): no gain, the extra sums spill.)

Same result as the fused TE up to x's rounding and fp32 summation order; tests/test_arm_kn_sign_kernels.py runs
it under qemu-aarch64 against numpy.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.kernels.cpu.arm import SDOT, X_BYTES, quantize_row_macro, quantize_rows_macro
from pipeline.kernels.cpu.arm_kn import match_kn
from pipeline.kernels.cpu.packed import FORMATS, substitute

COLUMNS = 16         # output columns per task: 4 int32x4 sums per byte of x, a 64-byte run of every code row
SIGN_FORMATS = ("t2", "b1")
# a prompt's rows in pairs sharing each code load and field extraction: t2 0.23 instead of 0.25 instructions per
# weight and row in the hot loop; b1's 8 bit masks and 16 sums then spill (0.27 instead of 0.26): one row at a time
PAIRED = ("t2",)


def x_position(fmt: str, j):
    """Where value j (int or TIR expression) of a group of x sits in the quantized group: word j // per_word,
    then field by field (field f's 4 bytes together), so x's word of field f meets that field of a code word."""
    spec = FORMATS[fmt]
    per_word, fields = spec.codes, 8 // spec.bits
    return j // per_word * per_word + j % fields * 4 + j % per_word // fields


def kn_sign_dot_kernel(fmt: str, n: int, k: int, act: str = "float16", scale_dtype: str = "float16",
                       prompt: bool = False, x_bytes: int = X_BYTES) -> tirx.PrimFunc:
    """out[1, m, n] = x[1, m, k] @ dequantize(codes uint32 [k / per_word, n], scales [ceil(k / 128), n]) for KN
    `fmt` (t2 / b1) codes, m = 1 or symbolic (`prompt`); x in `x_bytes` signed bytes per value."""
    spec = FORMATS[fmt]
    per_word, fields, group = spec.codes, 8 // spec.bits, spec.group
    assert fmt in SIGN_FORMATS and k % per_word == 0 and n % COLUMNS == 0 and x_bytes in (1, 2), (fmt, n, k)
    groups, rows = -(-k // group), k // per_word
    words = group // per_word                  # code rows per whole group (t2 8, b1 4)
    tail = rows - (groups - 1) * words         # ... of the last one (K = 576: t2 4, b1 2)
    whole = groups if tail == words else groups - 1
    vecs = COLUMNS // 4
    i64 = T.int64
    m = tirx.Var("seq_len", "int64") if prompt else i64(1)
    quantize_rows = quantize_rows_macro(quantize_row_macro(
        group, k, x_bytes, spec.offset, lambda g, j: g * group + x_position(fmt, j)), prompt)

    def field(v, f):
        """Field f of every byte of code vector v as int8x16: t2 the 2-bit code (`and` / `ushr`: 6 ops for 4
        fields), b1 -1 where bit f is set (one `cmtst`)."""
        if spec.bits == 1:
            bit = T.Broadcast(T.int8(1 << f if f < 7 else -128), 16)
            return T.Select(T.bitwise_and(v, bit) != T.Broadcast(T.int8(0), 16), T.Broadcast(T.int8(-1), 16),
                            T.Broadcast(T.int8(0), 16))
        if f == 0:
            return T.bitwise_and(v, T.Broadcast(T.int8(3), 16))
        shifted = T.reinterpret("int8x16", T.shift_right(T.reinterpret("uint8x16", v), T.Broadcast(T.uint8(2 * f), 16)))
        return shifted if f == fields - 1 else T.bitwise_and(shifted, T.Broadcast(T.int8(3), 16))

    def x_lanes(xq, r, b, g, wi, f):
        """x row r's word of field f of code row wi of group g (byte b), broadcast to the 4 lanes: a lane of a
        16-byte load, which LLVM folds into the indexed sdot."""
        words16 = T.reinterpret("int32x4", xq[r, b, T.Ramp(g * group + wi * per_word + f // 4 * 16, 1, 16)])
        return T.reinterpret("int8x16", T.Shuffle([words16], [f % 4] * 4))

    def lanes(slot, b, c):
        """Where isum holds the int32x4 of x row slot's byte b and the task's columns 4 c .. 4 c + 3."""
        return T.Ramp(((slot * x_bytes + b) * vecs + c) * 4, 1, 4)

    def row_dot(isum_bc, w, xq, r, b, g, wi, col):
        """isum_bc + code row wi of group g of columns col .. col + 3, field by field, times x row r (byte b)."""
        v = T.reinterpret("int8x16", w[g * words + wi, T.Ramp(col, 1, 4)])
        for f in range(fields):
            isum_bc = T.call_llvm_pure_intrin("int32x4", SDOT, isum_bc, field(v, f), x_lanes(xq, r, b, g, wi, f))
        return isum_bc

    def group_dot(isum, base, r, g, slot, c):
        """The group's dot of columns 4 c .. + 3 and x row r + slot (two bytes: 256 hi + lo), the codes' offset
        included: t2 + -sum(q), b1 -2 S - sum(q)."""
        hi, lo = isum[lanes(slot, 0, c)], isum[lanes(slot, x_bytes - 1, c)]
        total = lo if x_bytes == 1 else hi * T.Broadcast(256, 4) + lo
        offset = T.Broadcast(base[r + slot, g * 4], 4)     # -sum(q)
        return total + offset if spec.step == 1 else total * T.Broadcast(-2, 4) + offset

    def macros(nrows: int):
        """A macro computing `nrows` output rows of a task at once (2: a prompt's pairs, which share each code
        load and field extraction)."""

        @T.macro
        def group_step(w, s, xq, d, base, acc, isum, task, r, g, count):
            """acc[rows of the task's columns] += group g's dots (its first `count` code rows) * their scales *
            x's steps: code row by code row, each met by x's words in all 4 column vectors."""
            for j in T.unroll(nrows * x_bytes * vecs):
                isum[T.Ramp(j * 4, 1, 4)] = T.Broadcast(0, 4)
            for wi in T.unroll(count):
                for c in T.unroll(vecs):
                    for slot in T.unroll(nrows):
                        for b in T.unroll(x_bytes):
                            isum[lanes(slot, b, c)] = row_dot(isum[lanes(slot, b, c)], w, xq, r + slot, b, g, wi,
                                                              task * COLUMNS + c * 4)
            for slot in T.unroll(nrows):
                for c in T.unroll(vecs):
                    acc[T.Ramp((slot * vecs + c) * 4, 1, 4)] = acc[T.Ramp((slot * vecs + c) * 4, 1, 4)] + T.Cast(
                        "float32x4", group_dot(isum, base, r, g, slot, c)) * (T.Cast(
                            "float32x4", s[g, T.Ramp(task * COLUMNS + c * 4, 1, 4)]) * T.Broadcast(d[r + slot, g], 4))

        @T.macro
        def rows_pass(w, s, xq, d, base, out, acc, isum, task, r):
            """Output rows r .. r + nrows - 1 of the task's columns over all of K."""
            for c in T.unroll(nrows * vecs):
                acc[T.Ramp(c * 4, 1, 4)] = T.Broadcast(T.float32(0), 4)
            for g in range(whole):
                group_step(w, s, xq, d, base, acc, isum, task, r, g, words)
            if whole < groups:
                group_step(w, s, xq, d, base, acc, isum, task, r, groups - 1, tail)
            for slot in T.unroll(nrows):
                for c in T.unroll(vecs):
                    out[0, r + slot, T.Ramp(task * COLUMNS + c * 4, 1, 4)] = T.Cast(
                        f"{act}x4", acc[T.Ramp((slot * vecs + c) * 4, 1, 4)])

        return rows_pass

    one_row, two_rows = macros(1), macros(2)
    pair_rows = 2 if prompt and fmt in PAIRED else 1

    @T.prim_func(private=True)
    def kernel(w: T.Buffer((i64(rows), i64(n)), "uint32"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), act), out: T.Buffer((i64(1), m, i64(n)), act)):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((m, x_bytes, groups * group), "int8")
        d = T.alloc_buffer((m, groups), "float32")
        base = T.alloc_buffer((m, groups * 4), "int32")
        quantize_rows(x, xq, d, base, m)
        for task in T.parallel(n // COLUMNS):
            acc = T.alloc_buffer((pair_rows * COLUMNS,), "float32")
            isum = T.alloc_buffer((pair_rows * x_bytes * COLUMNS,), "int32")
            if pair_rows == 2:
                for pair in range(m // 2):
                    two_rows(w, s, xq, d, base, out, acc, isum, task, pair * 2)
                if m % 2 == 1:
                    one_row(w, s, xq, d, base, out, acc, isum, task, m - 1)
            else:
                for r in range(m):
                    one_row(w, s, xq, d, base, out, acc, isum, task, r)

    return kernel


def arm_kn_sign_dot_like(func: tirx.PrimFunc, x_bytes: int = X_BYTES) -> tirx.PrimFunc | None:
    """This module's kernel with `func`'s parameter order when `func` is a fused KN t2 / b1 GEMV or prefill matmul
    (plain codes [K / per_word, N], K a whole number of words, N of COLUMNS) in fp16 or fp32, else None (tiled t2
    codes included: they stay on the other rules). The caller checks that the target has dotprod."""
    for fmt in SIGN_FORMATS:
        spec = FORMATS[fmt]
        match = match_kn(func, spec.block, spec.codes, spec.group)
        if match is None:
            continue
        if match[1] % spec.codes or match[0] % COLUMNS:
            return None
        n, k, act, scale_dtype, prompt, order = match
        kernel = kn_sign_dot_kernel(fmt, n, k, act, scale_dtype, prompt, x_bytes)
        return substitute(func, kernel, order, ("dequant-matmul" if prompt else "dequant-gemv") + "-ternary")
    return None
