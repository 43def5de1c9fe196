"""Hand-written AArch64 kernels for the GEMV / prefill matmul of NK q4 / q8 / t2 / b1 weights with `sdot`.

Why: android-cpu's fused dequantize + matmul, left to TVM, wrote the whole dequantized weight to a scratch
buffer on every call and then ran one serial fp16 multiply-add chain per output on one core (~18 instructions
per weight under qemu, no vector instruction). Here, as in llama.cpp's Q4_0 x Q8_0 dot, x is quantized once
per call in blocks of the weight group (q4 / q8: 32 values, t2: 128) with one fp32 step each, and each group
of a weight row meets it in `sdot` (armv8.2-a dotprod: 16 byte products summed 4 at a time into the 4 int32
lanes), the integer group sum converted to fp32 and scaled by the row's group scale times the step into fp32
partial sums; no dequantized weight is written anywhere. x is held in two signed bytes per value by default
(q = round(x * 32512 / max|x|) = 256 hi + lo, x86.py's precision: two sdot's per code vector, summed as 256 *
hi sums + lo sums) or, X_BYTES = 1, in one (int8, step max|x| / 127: llama.cpp's Q8_0), which moved SmolLM2's
logits visibly (see Q_MAX).

NK rows are contiguous (codes [N, K / codes], scales [N, groups]), so a task owns ROWS consecutive output
rows and streams their bytes in order; TVM's parallel loop gives each thread one contiguous range of tasks.
Per group and row, q4: one 16-byte load of 32 codes, `and` (even k: the low nibbles) and `ushr` (odd k: the
high nibbles) against x's group stored as its 16 even values then its 16 odd ones, two `sdot`s started from
the group's offset term (lane 0: -7 sum(q), so the codes need no subtraction), `scvtf`, `fmla` by the row's
scale; the ROWS scales of a group are gathered into one vector and converted / multiplied by d once (two
bytes: twice the sdot's). q8: two 16-byte loads and two `sdot`s. t2 (16 two-bit codes per word, group 128): two 16-byte loads, each meeting x in
four `sdot`s, one per 2-bit field (x's group stored field by field), offset -1. b1 (32 sign bits per word,
group 128, weight 2 bit - 1): one 16-byte load per group, each bit plane turned into -1 / 0 bytes by one
`cmtst` and met by x's 16 values of that bit in one `sdot` (S = -sum over set bits); the group's dot is
-2 S - sum(q) (0.32 instructions per weight in the hot loop, two-byte x). Its last group of 64 (K = 576) is
an 8-byte load, the upper 8 bytes zero (their products vanish).

A prompt (prefill, x [1, m, K]) runs the same loop for each of its rows inside the task, so a task's weight
rows (ROWS x K / 2 bytes for q4) stay in L1 across the prompt; its rows are quantized in parallel first.

Same result as the fused TE up to x's rounding (at most half a step of its block per value) and fp32 summation
order; tests/test_arm_kernels.py checks both under qemu-aarch64, for one and two bytes.
`CPUArmDot` (schedule.py) substitutes these for functions that are exactly that fused pattern
(recognize.match_packed_nk_gemv) on a target with dotprod; anything else is left to the other rules.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import PACKINGS
from pipeline.kernels.cpu.packed import NK_FORMATS, PackedFormat, substitute
from pipeline.kernels.cpu.recognize import match_packed_nk_gemv

# x's steps per block by bytes per value: int8 q = round(x * 127 / max|x|) (llama.cpp's Q8_0), or two bytes
# q = round(x * 32512 / max|x|) = 256 hi + lo (x86.py's precision). SmolLM2-135M, this bundle's q4 weights, every
# linear layer's x so quantized (torch, 61 prompt tokens) against fp32 x: int8 max |dlogit| 1.5 of a scale of 33,
# top-1 agreement 0.934; two bytes 0.011, 1.000. Two bytes cost two more sdot per 32 q4 codes. q8 weights the same
# (benchmarks/q8_activation_accuracy.py, 384 teacher-forced positions): top-1 agreement with fp32 0.951 with int8 x,
# 0.990 with two bytes (docs/kernels.md), so q8 keeps two bytes too.
Q_MAX = {1: 127.0, 2: 32512.0}
X_BYTES = 2
ROWS = 4            # output rows per step: their x loads shared, their scales one vector (8: 0.35 vs 0.37 per weight for q4, t2 worse)
SDOT = "llvm.aarch64.neon.sdot"
DOT_FORMATS = ("q4", "q8", "t2", "b1")


def dot_layout(spec: PackedFormat, j: int) -> int:
    """Where value j (an int or a TIR expression) of a group of x sits in the quantized group, so that one 16-byte vector of x meets one
    16-byte vector of codes as stored: q4 byte b of a group holds codes 2b (low nibble) and 2b + 1 (high):
    evens, then odds. t2 byte b of each 64-value half holds codes 4b .. 4b + 3 (2-bit fields): field by field.
    b1 byte b of a group holds codes 8b .. 8b + 7 (sign bits): bit by bit. q8: as is."""
    if spec.bits == 4:
        return j % 2 * 16 + j // 2
    if spec.bits == 2:
        return j // 64 * 64 + j % 4 * 16 + j % 64 // 4
    if spec.bits == 1:
        return j // 128 * 128 + j % 8 * 16 + j % 128 // 8
    return j


def _check(spec: PackedFormat, n: int, k: int) -> None:
    assert spec.bits in (1, 2, 4, 8) and n % ROWS == 0 and n // ROWS >= 2, (spec, n, k)
    # the last t2 / b1 group may be 64 values (K = 576); q4 / q8 groups are whole
    assert k % (64 if spec.bits <= 2 else spec.group) == 0, (spec, k)


def quantize_row_macro(group: int, k: int, x_bytes: int, offset: int, position, load=None):
    """A TIR macro quantize_row(x, xq, d, base, r): row r of x in integer steps of its blocks of `group` values
    (the last one may be shorter), value j of block g stored at xq[r, b, position(g, j)] (a kernel's own
    layout; two bytes: b = 0 the high bytes, 1 the low), each block's step d[r, g] and its offset term
    base[r, 4 g .. 4 g + 3] = [-offset * sum(q), 0, 0, 0]. One rounding for every sdot kernel of this module,
    arm_t3.py and expert_arm.py. `load(x, r, kk)`: value kk of row r (default x[0, r, kk]: a GEMV's [1, m, k])."""
    groups = -(-k // group)
    q_max = Q_MAX[x_bytes]
    if load is None:
        def load(x, r, kk):
            return x[0, r, kk]

    @T.macro
    def quantize_row(x, xq, d, base, r):
        for g in range(groups):
            amax = T.alloc_buffer((1,), "float32")
            total = T.alloc_buffer((1,), "int32")
            amax[0] = T.float32(0)
            for j in range(T.min(group, k - g * group)):
                amax[0] = T.max(amax[0], T.fabs(T.Cast("float32", load(x, r, g * group + j))))
            d[r, g] = amax[0] * T.float32(1.0 / q_max)
            total[0] = 0
            for j in range(T.min(group, k - g * group)):
                q: T.let[T.int32] = T.Cast("int32", T.round(T.Cast("float32", load(x, r, g * group + j)) * T.if_then_else(
                    amax[0] > T.float32(0), T.float32(q_max) / amax[0], T.float32(0))))
                if x_bytes == 2:    # static; arithmetic shift: hi = floor((q + 128) / 256) in [-127, 127]
                    xq[r, 0, position(g, j)] = T.Cast("int8", T.shift_right(q + 128, 8))
                    xq[r, 1, position(g, j)] = T.Cast("int8", q - T.shift_right(q + 128, 8) * 256)
                else:
                    xq[r, 0, position(g, j)] = T.Cast("int8", q)
                total[0] = total[0] + q
            base[r, g * 4] = total[0] * -offset
            for j in range(1, 4):
                base[r, g * 4 + j] = 0

    return quantize_row


def quantize_rows_macro(quantize_row, prompt: bool):
    """A TIR macro quantize_rows(x, xq, d, base, m) around a quantize_row macro (quantize_row_macro or a kernel's
    own): a prompt's m rows quantized in parallel before the tasks read them, one token's row 0 alone."""

    @T.macro
    def quantize_rows(x, xq, d, base, m):
        if prompt:
            for r in T.parallel(m):
                quantize_row(x, xq, d, base, r)
        else:
            quantize_row(x, xq, d, base, 0)

    return quantize_rows


def nk_dot_kernel(spec: PackedFormat, n: int, k: int, act: str = "float16", scale_dtype: str = "float16",
                  prompt: bool = False, x_bytes: int = X_BYTES) -> tirx.PrimFunc:
    """out[1, m, n] = x[1, m, k] @ dequantize(codes [n, k / codes], scales [n, groups]) for NK `spec` codes,
    m = 1 (decode) or symbolic (`prompt`), x and out in `act`; x in `x_bytes` signed bytes per value (1:
    int8, 2: q = 256 hi + lo, two sdot's per code vector)."""
    _check(spec, n, k)
    assert x_bytes in (1, 2), x_bytes
    group, codes, bits = spec.group, spec.codes, spec.bits
    groups = -(-k // group)
    words = k // codes
    halves = group * bits // 128          # 16-byte code vectors per whole group (q4 1, q8 2, t2 2, b1 1)
    tail_halves = (k - (groups - 1) * group) * bits // 128   # of the last group (t2 at K = 576: 1, b1: 0)
    short_tail = tail_halves == 0         # b1's last group of 64: one 8-byte vector, its top half zero codes
    fields = 8 // bits if bits < 8 else 1   # codes per byte
    mask = (1 << bits) - 1
    i64 = T.int64
    m = tirx.Var("seq_len", "int64") if prompt else i64(1)
    code_shape = (i64(n), i64(words))
    bytes_per_word = 1 if bits == 8 else 4    # int8 codes: one byte per element; words: four
    per_vector = 16 // bytes_per_word         # buffer elements per 16-byte vector of codes

    def codes_vector(w, row, g, h, short=False):
        """Bytes 16 h .. 16 h + 15 of group g's codes of weight row `row`, as int8x16 (`short`: bytes 16 h ..
        16 h + 7, the rest zero)."""
        start = g * (group // codes) + h * per_vector
        if bits == 8:
            return w[row, T.Ramp(start, 1, 16)]
        if short:
            return T.Shuffle([T.reinterpret("int8x8", w[row, T.Ramp(start, 1, 2)]), T.Broadcast(T.int8(0), 8)],
                             list(range(16)))
        return T.reinterpret("int8x16", w[row, T.Ramp(start, 1, 4)])

    def field(v, f):
        """Code field f of every byte of v (the low one masked, the top one shifted down, others both). b1: -1
        where bit f is set, else 0 (one `cmtst`): minus the code's bit."""
        if bits == 8:
            return v
        if bits == 1:
            bit = T.Broadcast(T.int8(1 << f if f < 7 else -128), 16)
            return T.Select(T.bitwise_and(v, bit) != T.Broadcast(T.int8(0), 16), T.Broadcast(T.int8(-1), 16),
                            T.Broadcast(T.int8(0), 16))
        if f == 0:
            return T.bitwise_and(v, T.Broadcast(T.int8(mask), 16))
        shifted = T.reinterpret("int8x16", T.shift_right(T.reinterpret("uint8x16", v), T.Broadcast(T.uint8(bits * f), 16)))
        return shifted if f == fields - 1 else T.bitwise_and(shifted, T.Broadcast(T.int8(mask), 16))

    quantize_rows = quantize_rows_macro(quantize_row_macro(
        group, k, x_bytes, spec.offset, lambda g, j: g * group + dot_layout(spec, j)), prompt)

    def row_scales(s, row, g):
        """The scales of group g of rows row .. row + 3, one vector (NK: a column of the scale matrix)."""
        return T.Cast("float32x4", T.Shuffle([s[row + i, g] for i in range(4)], list(range(4))))

    def group_dot(w, xq, base, row, r, g, count, short=False):
        """Group g of weight row `row` times x row r in int32 lanes (sum of the lanes: the group's dot, the
        offset term included). Two bytes: 256 * (the high bytes' sums) + the low bytes' sums, exact in int32
        (|sum| <= 32 * 15 * 32512 for q4, 128 * 2 * 32512 for t2, 32 * 128 * 32512 for q8 < 2^31). b1: the
        sdot's sum minus-bits x q = -S, the weights 2 bit - 1: the dot = -2 S - sum(q) (base: -sum(q))."""
        if spec.step == 2:
            acc = [T.Broadcast(0, 4)] * x_bytes
        else:
            acc = [T.Broadcast(0, 4)] * (x_bytes - 1) + [base[r, T.Ramp(g * 4, 1, 4)]]
        for h in range(count):
            v = codes_vector(w, row, g, h, short)
            for f in range(fields):
                for b in range(x_bytes):
                    acc[b] = T.call_llvm_pure_intrin("int32x4", SDOT, acc[b], field(v, f),
                                                     xq[r, b, T.Ramp(g * group + (h * fields + f) * 16, 1, 16)])
        total = acc[0] if x_bytes == 1 else acc[0] * T.Broadcast(256, 4) + acc[1]
        if spec.step == 2:
            return total * T.Broadcast(-2, 4) + base[r, T.Ramp(g * 4, 1, 4)]
        return total

    @T.macro
    def group_step(w, s, xq, d, base, acc, task, r, g, count, short):
        for c in T.unroll(ROWS // 4):
            sc: T.let[T.float32x4] = row_scales(s, task * ROWS + c * 4, g) * T.Broadcast(d[r, g], 4)
            for i in T.unroll(4):
                acc[T.Ramp((c * 4 + i) * 4, 1, 4)] = acc[T.Ramp((c * 4 + i) * 4, 1, 4)] + T.Cast(
                    "float32x4", group_dot(w, xq, base, task * ROWS + c * 4 + i, r, g, count, short)) * T.Broadcast(
                    T.Shuffle([sc], [i]), 4)

    whole = groups if tail_halves == halves else groups - 1
    tail_count = max(tail_halves, 1)

    @T.prim_func(private=True)
    def kernel(w: T.Buffer(code_shape, spec.code_dtype), s: T.Buffer((i64(n), i64(groups)), scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), act), out: T.Buffer((i64(1), m, i64(n)), act)):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((m, x_bytes, groups * group), "int8")
        d = T.alloc_buffer((m, groups), "float32")
        base = T.alloc_buffer((m, groups * 4), "int32")
        quantize_rows(x, xq, d, base, m)
        for task in T.parallel(n // ROWS):
            acc = T.alloc_buffer((ROWS * 4,), "float32")
            for r in range(m):
                for i in T.unroll(ROWS):
                    acc[T.Ramp(i * 4, 1, 4)] = T.Broadcast(T.float32(0), 4)
                for g in range(whole):
                    group_step(w, s, xq, d, base, acc, task, r, g, halves, False)
                if whole < groups:
                    group_step(w, s, xq, d, base, acc, task, r, groups - 1, tail_count, short_tail)
                for i in T.unroll(ROWS):
                    out[0, r, task * ROWS + i] = T.Cast(act, acc[i * 4] + acc[i * 4 + 1] + acc[i * 4 + 2] + acc[i * 4 + 3])

    return kernel


def arm_dot_like(func: tirx.PrimFunc, x_bytes: int = X_BYTES) -> tirx.PrimFunc | None:
    """The sdot kernel with `func`'s parameter order when `func` is a fused decode GEMV or prefill matmul of NK
    q4 / q8 / t2 / b1 codes this module covers, else None. The caller checks that the target has dotprod."""
    for prompt in (False, True):
        match = match_packed_nk_gemv(func, rows="prompt" if prompt else "one")
        if match is None:
            continue
        fmt, n, k, act, scale_dtype, order = match
        if fmt not in DOT_FORMATS:      # q4 / q8 rows interleaved: arm_rows.py
            return None
        spec = NK_FORMATS[fmt]
        if n % ROWS or n // ROWS < 2 or k % (64 if spec.bits <= 2 else spec.group):
            return None
        kernel = nk_dot_kernel(spec, n, k, act, scale_dtype, prompt, x_bytes)
        ternary = fmt in PACKINGS
        op_class = ("dequant-matmul" if prompt else "dequant-gemv") + ("-ternary" if ternary else "")
        return substitute(func, kernel, order, op_class)
    return None
