"""Hand-written AArch64 kernels for the GEMV / prefill matmul of NK q4 / q8 / t2 weights with `sdot`.

Why: android-cpu's fused dequantize + matmul, left to TVM, wrote the whole dequantized weight to a scratch
buffer on every call and then ran one serial fp16 multiply-add chain per output on one core (~18 instructions
per weight under qemu, no vector instruction). Here, as in llama.cpp's Q4_0 x Q8_0 dot, x is quantized once
per call to int8 in blocks of the weight group (q4 / q8: 32 values, t2: 128) with one fp32 step each (d =
max|x| / 127), and each group of a weight row meets it in `sdot` (armv8.2-a dotprod: 16 byte products summed
4 at a time into the 4 int32 lanes), the integer group sum converted to fp32 and scaled by the row's group
scale times d into fp32 partial sums; no dequantized weight is written anywhere.

NK rows are contiguous (codes [N, K / codes], scales [N, groups]), so a task owns ROWS consecutive output
rows and streams their bytes in order; TVM's parallel loop gives each thread one contiguous range of tasks.
Per group and row, q4: one 16-byte load of 32 codes, `and` (even k: the low nibbles) and `ushr` (odd k: the
high nibbles) against x's group stored as its 16 even values then its 16 odd ones, two `sdot`s started from
the group's offset term (lane 0: -7 sum(q), so the codes need no subtraction), `scvtf`, `fmla` by the row's
scale; the ROWS scales of a group are gathered into one vector and converted / multiplied by d once. q8: two
16-byte loads and two `sdot`s. t2 (16 two-bit codes per word, group 128): two 16-byte loads, each meeting x in
four `sdot`s, one per 2-bit field (x's group stored field by field), offset -1.

A prompt (prefill, x [1, m, K]) runs the same loop for each of its rows inside the task, so a task's weight
rows (ROWS x K / 2 bytes for q4) stay in L1 across the prompt; its rows are quantized in parallel first.

Same result as the fused TE up to x's int8 rounding (at most half a step of its block per value; llama.cpp's
Q8_0 activations) and fp32 summation order; tests/test_arm_kernels.py checks both under qemu-aarch64.
`CPUArmDot` (schedule.py) substitutes these for functions that are exactly that fused pattern
(recognize.match_packed_nk_gemv) on a target with dotprod; anything else is left to the other rules.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import PACKINGS
from pipeline.kernels.cpu.packed import NK_FORMATS, PackedFormat, substitute
from pipeline.kernels.cpu.recognize import match_packed_nk_gemv

ROWS = 4            # output rows per step: their x loads shared, their scales one vector (8: 0.35 vs 0.37 per weight for q4, t2 worse)
Q_MAX = 127.0       # x's int8 steps per block: q = round(x * 127 / max|x|)
SDOT = "llvm.aarch64.neon.sdot"
DOT_FORMATS = ("q4", "q8", "t2")


def dot_layout(spec: PackedFormat, j: int) -> int:
    """Where value j (an int or a TIR expression) of a group of x sits in the quantized group, so that one 16-byte vector of x meets one
    16-byte vector of codes as stored: q4 byte b of a group holds codes 2b (low nibble) and 2b + 1 (high):
    evens, then odds. t2 byte b of each 64-value half holds codes 4b .. 4b + 3 (2-bit fields): field by field.
    q8: as is."""
    if spec.bits == 4:
        return j % 2 * 16 + j // 2
    if spec.bits == 2:
        return j // 64 * 64 + j % 4 * 16 + j % 64 // 4
    return j


def _check(spec: PackedFormat, n: int, k: int) -> None:
    assert spec.bits in (2, 4, 8) and n % ROWS == 0 and n // ROWS >= 2, (spec, n, k)
    # the last t2 group may be a 64-value half (K = 576); q4 / q8 groups are whole
    assert k % (64 if spec.bits == 2 else spec.group) == 0, (spec, k)


def nk_dot_kernel(spec: PackedFormat, n: int, k: int, act: str = "float16", scale_dtype: str = "float16",
                  prompt: bool = False) -> tirx.PrimFunc:
    """out[1, m, n] = x[1, m, k] @ dequantize(codes [n, k / codes], scales [n, groups]) for NK `spec` codes,
    m = 1 (decode) or symbolic (`prompt`), x and out in `act`."""
    _check(spec, n, k)
    group, codes, bits = spec.group, spec.codes, spec.bits
    groups = -(-k // group)
    words = k // codes
    halves = group * bits // 128          # 16-byte code vectors per whole group (q4 1, q8 2, t2 2)
    tail_halves = (k - (groups - 1) * group) * bits // 128   # of the last group (t2 at K = 576: 1)
    fields = 8 // bits if bits < 8 else 1   # codes per byte
    mask = (1 << bits) - 1
    i64 = T.int64
    m = tirx.Var("seq_len", "int64") if prompt else i64(1)
    code_shape = (i64(n), i64(words))
    bytes_per_word = 1 if bits == 8 else 4    # int8 codes: one byte per element; words: four
    per_vector = 16 // bytes_per_word         # buffer elements per 16-byte vector of codes

    def codes_vector(w, row, g, h):
        """Bytes 16 h .. 16 h + 15 of group g's codes of weight row `row`, as int8x16."""
        start = g * (group // codes) + h * per_vector
        if bits == 8:
            return w[row, T.Ramp(start, 1, 16)]
        return T.reinterpret("int8x16", w[row, T.Ramp(start, 1, 4)])

    def field(v, f):
        """Code field f of every byte of v (the low one masked, the top one shifted down, others both)."""
        if bits == 8:
            return v
        if f == 0:
            return T.bitwise_and(v, T.Broadcast(T.int8(mask), 16))
        shifted = T.reinterpret("int8x16", T.shift_right(T.reinterpret("uint8x16", v), T.Broadcast(T.uint8(bits * f), 16)))
        return shifted if f == fields - 1 else T.bitwise_and(shifted, T.Broadcast(T.int8(mask), 16))

    @T.macro
    def quantize_row(x, xq, d, base, r):
        """Row r of x in int8 steps of its blocks (laid out by `dot_layout`), each block's step d and its
        offset term base = [-offset * sum(q), 0, 0, 0]."""
        for g in range(groups):
            amax = T.alloc_buffer((1,), "float32")
            total = T.alloc_buffer((1,), "int32")
            amax[0] = T.float32(0)
            for j in range(T.min(group, k - g * group)):
                amax[0] = T.max(amax[0], T.fabs(T.Cast("float32", x[0, r, g * group + j])))
            d[r, g] = amax[0] * T.float32(1.0 / Q_MAX)
            total[0] = 0
            for j in range(T.min(group, k - g * group)):
                q: T.let[T.int8] = T.Cast("int8", T.round(T.Cast("float32", x[0, r, g * group + j]) * T.if_then_else(
                    amax[0] > T.float32(0), T.float32(Q_MAX) / amax[0], T.float32(0))))
                xq[r, g * group + dot_layout(spec, j)] = q
                total[0] = total[0] + T.Cast("int32", q)
            base[r, g * 4] = total[0] * -spec.offset
            for j in range(1, 4):
                base[r, g * 4 + j] = 0

    def row_scales(s, row, g):
        """The scales of group g of rows row .. row + 3, one vector (NK: a column of the scale matrix)."""
        return T.Cast("float32x4", T.Shuffle([s[row + i, g] for i in range(4)], list(range(4))))

    def group_dot(w, xq, base, row, r, g, count):
        """Group g of weight row `row` times x row r in int32 lanes (sum of the lanes: the group's dot)."""
        acc = base[r, T.Ramp(g * 4, 1, 4)]
        for h in range(count):
            v = codes_vector(w, row, g, h)
            for f in range(fields):
                acc = T.call_llvm_pure_intrin("int32x4", SDOT, acc, field(v, f),
                                              xq[r, T.Ramp(g * group + (h * fields + f) * 16, 1, 16)])
        return acc

    @T.macro
    def group_step(w, s, xq, d, base, acc, task, r, g, count):
        for c in T.unroll(ROWS // 4):
            sc: T.let[T.float32x4] = row_scales(s, task * ROWS + c * 4, g) * T.Broadcast(d[r, g], 4)
            for i in T.unroll(4):
                acc[T.Ramp((c * 4 + i) * 4, 1, 4)] = acc[T.Ramp((c * 4 + i) * 4, 1, 4)] + T.Cast(
                    "float32x4", group_dot(w, xq, base, task * ROWS + c * 4 + i, r, g, count)) * T.Broadcast(
                    T.Shuffle([sc], [i]), 4)

    whole = groups if tail_halves == halves else groups - 1

    @T.prim_func(private=True)
    def kernel(w: T.Buffer(code_shape, spec.code_dtype), s: T.Buffer((i64(n), i64(groups)), scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), act), out: T.Buffer((i64(1), m, i64(n)), act)):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((m, groups * group), "int8")
        d = T.alloc_buffer((m, groups), "float32")
        base = T.alloc_buffer((m, groups * 4), "int32")
        if prompt:
            for r in T.parallel(m):
                quantize_row(x, xq, d, base, r)
        else:
            quantize_row(x, xq, d, base, 0)
        for task in T.parallel(n // ROWS):
            acc = T.alloc_buffer((ROWS * 4,), "float32")
            for r in range(m):
                for i in T.unroll(ROWS):
                    acc[T.Ramp(i * 4, 1, 4)] = T.Broadcast(T.float32(0), 4)
                for g in range(whole):
                    group_step(w, s, xq, d, base, acc, task, r, g, halves)
                if whole < groups:
                    group_step(w, s, xq, d, base, acc, task, r, groups - 1, tail_halves)
                for i in T.unroll(ROWS):
                    out[0, r, task * ROWS + i] = T.Cast(act, acc[i * 4] + acc[i * 4 + 1] + acc[i * 4 + 2] + acc[i * 4 + 3])

    return kernel


def arm_dot_like(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The sdot kernel with `func`'s parameter order when `func` is a fused decode GEMV or prefill matmul of NK
    q4 / q8 / t2 codes this module covers, else None. The caller checks that the target has dotprod."""
    for prompt in (False, True):
        match = match_packed_nk_gemv(func, rows="prompt" if prompt else "one")
        if match is None:
            continue
        fmt, n, k, act, scale_dtype, order = match
        spec = NK_FORMATS[fmt]
        if fmt not in DOT_FORMATS or n % ROWS or n // ROWS < 2 or k % (64 if spec.bits == 2 else spec.group):
            return None
        kernel = nk_dot_kernel(spec, n, k, act, scale_dtype, prompt)
        ternary = fmt in PACKINGS
        op_class = ("dequant-matmul" if prompt else "dequant-gemv") + ("-ternary" if ternary else "")
        return substitute(func, kernel, order, op_class)
    return None
