"""AArch64 `sdot` GEMV / prefill matmul over q4 / q8 / t2 codes stored row-interleaved (android-cpu's
`q4_interleave` / `q8_interleave` / `t2_interleave`).

Why: over plain NK rows (arm.py) each row's 4-lane accumulator holds partial sums of ONE row, so every row and
group needs its own horizontal reduction, convert and scale, and x is re-loaded per 4 rows (0.52 instructions
per q4 weight in the hot loop, llama.cpp's Q4_0: ~0.29). Here the codes of `tile` consecutive output rows are
interleaved 4 bytes at a time (q4: quantize.tile_kn of the NK words, [N / tile, K / 8, tile] uint32, the same
arrays as host-cpu's KN tiles; q8: quantize.interleave_q8, [N / tile, K / 4, 4 tile] int8; scales [N / tile,
groups, tile]), so one 16-byte load holds 4 bytes of each of 4 rows, and `sdot` by element (`sdot v.4s,
codes.16b, x.4b[lane]`) adds each row's 4-byte dot into its own int32 lane: a group's 4 rows end in ONE
vector, converted and scaled by the 4 rows' scales (one load, `fcvtl`) at once; no horizontal add anywhere.
A tile of 8 rows (two such vectors per word) shares each x load between 8 rows.

Per q4 group of 32 weights and 4 rows (x in two bytes, the default): 4 code loads, 4 `and` (low nibbles: even
k) + 4 `ushr` (high nibbles: odd k), 16 `sdot` (8 per byte plane), then 256 * hi + lo (one `mla`), `scvtf`,
the 4 scales times x's step, `fmla` (q8: 8 code loads, 16 `sdot`, no unpacking). x is quantized per call in
NEON vectors, to the same values as arm.py's scalar loop; each q4 group's 32 values placed so that 4-byte
lane 2 w + p holds x[8 w + p], x[8 w + 2 + p], x[8 w + 4 + p], x[8 w + 6 + p] (p = 0: the even values a
word's low nibbles meet, 1: the odd ones; q8: in order), the high bytes of a group next to its low ones, and
the zero point folded in as in arm.py (-7 sum q per group, the low plane's accumulator starts from it).
Read from the object: 0.293 instructions per q4 weight (0.215 with int8 x), 0.246 per q8 weight (0.168),
about 90% vector instructions.

t2 (ternary, 16 two-bit codes per word, group 128) the same way as q4: the KN tiles of the NK words
([N / tile, K / 16, tile]), so a 16-byte load holds one word of each of 4 rows; each 2-bit field f (`and`;
`ushr` + `and`; `ushr` for the top one) meets x's lane f of that word, which holds the 4 values the field's
4 bytes meet (x[16 w + 4 b + f]): per word and 4 rows 1 load, 6 unpacking instructions, 4 `sdot` per byte
plane. The last group may be shorter (K = 576: 64 values). Over plain NK rows (arm.py) each row paid its own
group reduction and x was shared by 4 rows only: 0.332 instructions per weight in the hot loop there, 0.256
here (SmolLM2 shapes, whole calls with x's quantization: 0.36-0.40 there, 0.27-0.28 here).

A q4 / q8 prompt's x is quantized to int8 (PROMPT_X_BYTES: one sdot per code vector and row, as llama.cpp and
the smmla prefill do; decode and t2 prompts keep two-byte x) and runs PROMPT_ROWS[1] = 4 rows per pass over a
tile's codes: 0.141 instructions per q4 weight and row, 0.130 q8 (two-byte x, 2 rows: 0.255 / 0.227; t2 0.218).
A prompt runs every row of x inside the task (a task's tile of weights, tile x K / 2 bytes, stays in L1);
each task owns one tile of output rows, TVM's parallel loop gives each thread a contiguous range of tiles,
so 1 and 4 threads compute every output identically.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import PACKINGS
from pipeline.kernels.cpu.arm import Q_MAX, SDOT, X_BYTES
from pipeline.kernels.cpu.fast_math import lanes_reduce
from pipeline.kernels.cpu.packed import NK_FORMATS, TILED_PACKED, TILED_Q8, PackedFormat, substitute
from pipeline.kernels.cpu.recognize import match_packed_nk_gemv

# prefill x by code bits: q4 / q8 in int8 (step max|x| / 127 per group of 32: llama.cpp's Q8_0, the i8mm class's
# smmla prefill): one sdot per code vector and prompt row instead of two; decode keeps arm.X_BYTES. t2 keeps two
# bytes: its groups are 128 wide, and one int8 step per 128 values moved the ternary_ptq model's logits by 0.24 of
# their scale under qemu (two-byte: 0.011). Accuracy: docs/kernels.md.
PROMPT_X_BYTES = {4: 1, 8: 1, 2: 2}
# prefill: prompt rows per pass over a tile's codes, by x's bytes. Counted under qemu-aarch64 (whole calls, 1536 x
# 576, 32 prompt rows, 8-row tiles), instructions per weight and row: two-byte x q4 0.255 with 2 rows (3 rows
# 0.258: the accumulators spill); int8 x q4 0.167 / 0.152 / 0.141 / 0.156 with 2 / 3 / 4 / 5 rows, q8 0.141 ->
# 0.130 and t2 0.136 -> 0.114 from 2 to 4 rows.
PROMPT_ROWS = {2: 2, 1: 4}


def interleaved_position(j, bits: int = 4):
    """Where value j (an int or a TIR expression) of a q4 group of x sits in the quantized group: 4-byte lane
    2 w + p (w = j // 8 the code word, p = j % 2 the nibble), byte (j % 8) // 2 of it. t2: lane 4 w + f of the
    group's word w (16 codes) holds the values its 2-bit field f meets, x[16 w + 4 b + f] in byte b. q8: as is
    (lane w holds the 4 values a row's 4 codes of word w meet)."""
    if bits == 2:
        return j // 16 * 16 + j % 4 * 4 + j % 16 // 4
    return j // 8 * 8 + j % 2 * 4 + j % 8 // 2 if bits == 4 else j


def unit(bits: int) -> int:
    """Values of x per code word (the span `interleaved_position` permutes within): q4 8, t2 16, q8 8 (two words)."""
    return 16 if bits == 2 else 8


def check_rows(spec: PackedFormat, n: int, k: int, tile: int) -> bool:
    """Whether the interleaved kernel takes this shape: q4 / q8 whole groups, t2 whole words (the last group of
    128 may be shorter, as K = 576's 64), a tile of 4 or 8 rows, two tiles or more (TVM drops a parallel loop of
    one iteration)."""
    whole = k % 16 == 0 if spec.bits == 2 else k % spec.group == 0
    return spec.bits in (2, 4, 8) and whole and tile in (4, 8) and n % tile == 0 and n // tile >= 2


def group_sizes(spec: PackedFormat, k: int) -> tuple[int, int]:
    """(whole groups, values of the last group when it is shorter, else 0)."""
    return k // spec.group, k % spec.group


def quantize_row_vector_macro(spec: PackedFormat, k: int, x_bytes: int, q_max: float, pair_rows: bool = False):
    """A TIR macro quantize_row(x, xq, base, r) in NEON vectors: row r of x in integer steps of each group of
    the weight's (q4 / q8 32, t2 128; t2's last may be shorter) (step max|x| / q_max, q = round(x / step) as
    arm.nk_dot_kernel's scalar loop computes it, value for value), stored at `interleaved_position` (two bytes:
    the group's high bytes, then its low ones, each group `spec.group` bytes apart), base[r, 2 g] = -offset
    sum(q), base[r, 2 g + 1] the step's fp32 bits. The scalar form cost ~37 instructions per value, 3.6 M of
    a SmolLM2 decode step's 43 M in the GEMVs.

    `pair_rows` (int8 q4 / q8 only; arm_mmla.py's smmla operands): quantize_row(x, xq, base, r, src) stores row
    src of x as row r % 2 of pair r // 2, each 8 values of a group next to the other row's same 8 (xq [pairs,
    k / 8, 16]), and base [pairs, groups, 8] = the pair's offset terms as [r0, r0, r1, r1], then their steps'
    bits so."""
    group = spec.group
    whole, tail = group_sizes(spec, k)
    span = unit(spec.bits)
    order = [interleaved_position(j, spec.bits) for j in range(span)]    # within each code word's values
    gather = [order.index(p) for p in range(span)]                       # stored byte p <- value gather[p]
    per = span // 8                                                      # int32x8 vectors per code word

    def bytes_of(q):
        """int8 vectors of `span` values in stored order from int32x8 steps q (span // 8 of them)."""
        return T.Shuffle([T.Cast("int8x8", v) for v in q], gather)

    @T.macro
    def store(xq, r, g, i, q):
        """Values span i .. span (i + 1) - 1 of group g (int32x8 steps q, span // 8 vectors) into their bytes."""
        if pair_rows:         # static; span 8
            xq[r // 2, g * (group // 8) + i, T.Ramp(r % 2 * 8, 1, 8)] = bytes_of(q)
        elif x_bytes == 2:    # static; arithmetic shift: hi = floor((q + 128) / 256) in [-127, 127]
            hi = [T.shift_right(v + T.Broadcast(128, 8), T.Broadcast(8, 8)) for v in q]
            xq[r, 0, T.Ramp(2 * g * group + span * i, 1, span)] = bytes_of(hi)
            xq[r, 0, T.Ramp((2 * g + 1) * group + span * i, 1, span)] = bytes_of(
                [v - h * T.Broadcast(256, 8) for v, h in zip(q, hi, strict=True)])
        else:
            xq[r, 0, T.Ramp(g * group + span * i, 1, span)] = bytes_of(q)

    def tree(values, op):
        while len(values) > 1:
            values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
        return values[0]

    @T.macro
    def quantize_group(x, xq, base, r, src, g, size):
        """Group g of row src of x, its `size` values (static), as row r."""
        v = [T.Cast("float32x8", x[0, src, T.Ramp(g * group + 8 * i, 1, 8)]) for i in range(size // 8)]
        amax: T.let[T.float32] = lanes_reduce(tree([T.fabs(u) for u in v], T.max), 8, T.max)
        inv: T.let[T.float32] = T.if_then_else(amax > T.float32(0), T.float32(q_max) / amax, T.float32(0))
        q = [T.Cast("int32x8", T.round(u * T.Broadcast(inv, 8))) for u in v]
        # one store per code word's values: 4 per q4 / q8 group and t2 half group
        store(xq, r, g, 0, q[0:per])
        store(xq, r, g, 1, q[per:2 * per])
        store(xq, r, g, 2, q[2 * per:3 * per])
        store(xq, r, g, 3, q[3 * per:4 * per])
        if size // span > 4:     # static: a whole t2 group
            store(xq, r, g, 4, q[4 * per:5 * per])
            store(xq, r, g, 5, q[5 * per:6 * per])
            store(xq, r, g, 6, q[6 * per:7 * per])
            store(xq, r, g, 7, q[7 * per:8 * per])
        total: T.let[T.int32] = lanes_reduce(tree(q, lambda a, b: a + b), 8, lambda a, b: a + b)
        if pair_rows:
            base[r // 2, g, T.Ramp(r % 2 * 2, 1, 2)] = T.Broadcast(total * -spec.offset, 2)
            base[r // 2, g, T.Ramp(4 + r % 2 * 2, 1, 2)] = T.Broadcast(
                T.reinterpret("int32", amax * T.float32(1.0 / q_max)), 2)
        else:
            base[r, g * 2] = total * -spec.offset
            base[r, g * 2 + 1] = T.reinterpret("int32", amax * T.float32(1.0 / q_max))

    @T.macro
    def quantize_row(x, xq, base, r):
        for g in range(whole):
            quantize_group(x, xq, base, r, r, g, group)
        if tail > 0:      # static
            quantize_group(x, xq, base, r, r, whole, tail)

    @T.macro
    def quantize_pair_row(x, xq, base, r, src):
        for g in range(whole):
            quantize_group(x, xq, base, r, src, g, group)
        if tail > 0:      # static
            quantize_group(x, xq, base, r, src, whole, tail)

    assert not pair_rows or (x_bytes == 1 and span == 8), "smmla operands: int8 x of q4 / q8 groups"
    return quantize_pair_row if pair_rows else quantize_row


def rows_dot_kernel(spec: PackedFormat, n: int, k: int, tile: int, act: str = "float16",
                    scale_dtype: str = "float16", prompt: bool = False, x_bytes: int | None = None) -> tirx.PrimFunc:
    """out[1, m, n] = x[1, m, k] @ dequantize(codes, scales [n / tile, groups, tile]) for row-interleaved codes
    (q4: uint32 [n / tile, k / 8, tile]; q8: int8 [n / tile, k / 4, 4 tile], quantize.interleave_q8); m = 1
    (decode) or symbolic (`prompt`); x in `x_bytes` signed bytes (None: PROMPT_X_BYTES of the codes' bits for a
    prompt, else X_BYTES)."""
    assert check_rows(spec, n, k, tile), (spec, n, k, tile)
    x_bytes = x_bytes or (PROMPT_X_BYTES[spec.bits] if prompt else X_BYTES)
    assert x_bytes in (1, 2), x_bytes
    prompt_rows = PROMPT_ROWS[x_bytes]
    i64 = T.int64
    whole, tail = group_sizes(spec, k)
    groups = whole + bool(tail)
    q8, t2 = spec.bits == 8, spec.bits == 2
    words = k // 4 if q8 else k // spec.codes       # 4-byte words of a row: q8 4 codes, q4 8, t2 16
    group_words = spec.group * spec.bits // 32
    code_shape = (i64(n // tile), i64(words), i64(4 * tile if q8 else tile))
    quads = tile // 4            # 4-row vectors per tile
    m = tirx.Var("seq_len", "int64") if prompt else i64(1)
    quantize_row = quantize_row_vector_macro(spec, k, x_bytes, Q_MAX[x_bytes])
    low = T.Broadcast(T.int8(0xF), 16)
    four = T.Broadcast(T.uint8(4), 16)
    two_bits = T.Broadcast(T.int8(3), 16)

    def t2_field(v, f):
        """2-bit field f of every byte of the int8x16 v (the top one shifted down only, the low one masked only)."""
        if f == 0:
            return T.bitwise_and(v, two_bits)
        shifted = T.reinterpret("int8x16", T.shift_right(T.reinterpret("uint8x16", v), T.Broadcast(T.uint8(2 * f), 16)))
        return shifted if f == 3 else T.bitwise_and(shifted, two_bits)

    def lane(xv, index):
        """4-byte lane `index` of the int8x16 vector xv, repeated into all four lanes (sdot by element)."""
        return T.reinterpret("int8x16", T.Shuffle([T.reinterpret("int32x4", xv)], [index] * 4))

    def group_sums(w, xq, base, radix, t, r, g, q, n_words):
        """int32x4: lane i = the dot of group g (its n_words code words, static) of row 4 q + i of tile t with x
        row r, offset included."""
        acc = [T.Broadcast(0, 4)] * (x_bytes - 1) + [T.Broadcast(base[r, g * 2], 4)]
        if t2:      # one 16-byte x vector per code word and plane, lane f for the words' field f
            for u in range(n_words):
                xv = [xq[r, 0, T.Ramp((g * x_bytes + b) * spec.group + u * 16, 1, 16)] for b in range(x_bytes)]
                v = T.reinterpret("int8x16", w[t, g * group_words + u, T.Ramp(q * 4, 1, 4)])
                for f in range(4):
                    field = t2_field(v, f)
                    for b in range(x_bytes):
                        acc[b] = T.call_llvm_pure_intrin("int32x4", SDOT, acc[b], field, lane(xv[b], f))
            return acc[0] if x_bytes == 1 else acc[0] * T.Broadcast(radix[0], 4) + acc[1]
        per_vector = group_words // 2             # 16 bytes of x per plane: q4 2 words (even + odd lanes), q8 4
        for h in range(2):
            xv = [xq[r, 0, T.Ramp((g * x_bytes + b) * spec.group + h * 16, 1, 16)] for b in range(x_bytes)]
            for u in range(per_vector):
                word = g * group_words + h * per_vector + u
                if q8:      # python-level: 4 codes of each of rows 4 q .. 4 q + 3
                    for b in range(x_bytes):
                        acc[b] = T.call_llvm_pure_intrin("int32x4", SDOT, acc[b], w[t, word, T.Ramp(q * 16, 1, 16)],
                                                         lane(xv[b], u))
                    continue
                v = T.reinterpret("int8x16", w[t, word, T.Ramp(q * 4, 1, 4)])
                lo = T.bitwise_and(v, low)
                hi = T.reinterpret("int8x16", T.shift_right(T.reinterpret("uint8x16", v), four))
                for b in range(x_bytes):
                    acc[b] = T.call_llvm_pure_intrin("int32x4", SDOT, acc[b], lo, lane(xv[b], u * 2))
                    acc[b] = T.call_llvm_pure_intrin("int32x4", SDOT, acc[b], hi, lane(xv[b], u * 2 + 1))
        # 256 read from memory written outside the parallel body: LLVM cannot fold it into shl + add, so the
        # combine is one `mla` (256 * hi + lo, exact in int32: |sum| <= 32 * 127 * 32512 per row)
        return acc[0] if x_bytes == 1 else acc[0] * T.Broadcast(radix[0], 4) + acc[1]

    def row_step(w, s, xq, base, radix, acc, t, r, i, g, q, n_words=group_words):
        """acc (row i of the pair, rows 4 q .. 4 q + 3 of the tile) += group g's sums x scales x x's step."""
        at = T.Ramp(i * tile + q * 4, 1, 4)
        step = T.Broadcast(T.reinterpret("float32", base[r, g * 2 + 1]), 4)
        return acc[at] + T.Cast("float32x4", group_sums(w, xq, base, radix, t, r, g, q, n_words)) * (
            T.Cast("float32x4", s[t, g, T.Ramp(q * 4, 1, 4)]) * step)

    @T.macro
    def tile_rows(w, s, xq, base, radix, out, acc, t, r, count):
        """Rows r .. r + count - 1 of x (count static) against tile t; in one loop over the groups, so LLVM loads
        and unpacks each code vector once for all of them."""
        for q in T.unroll(quads * count):
            acc[T.Ramp(q * 4, 1, 4)] = T.Broadcast(T.float32(0), 4)
        for g in range(whole):
            for q in T.unroll(quads):
                for i in T.unroll(count):
                    acc[T.Ramp(i * tile + q * 4, 1, 4)] = row_step(w, s, xq, base, radix, acc, t, r + i, i, g, q)
        if tail > 0:      # static: t2's shorter last group
            for q in T.unroll(quads):
                for i in T.unroll(count):
                    acc[T.Ramp(i * tile + q * 4, 1, 4)] = row_step(w, s, xq, base, radix, acc, t, r + i, i, whole, q,
                                                                   tail // spec.codes)
        for q in T.unroll(quads):
            for i in T.unroll(count):
                out[0, r + i, T.Ramp(t * tile + q * 4, 1, 4)] = T.Cast(f"{act}x4", acc[T.Ramp(i * tile + q * 4, 1, 4)])

    @T.prim_func(private=True)
    def kernel(w: T.Buffer(code_shape, spec.code_dtype),
               s: T.Buffer((i64(n // tile), i64(groups), i64(tile)), scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), act), out: T.Buffer((i64(1), m, i64(n)), act)):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((m, 1, x_bytes * groups * spec.group), "int8")   # per group: its high bytes, then its low ones
        base = T.alloc_buffer((m, groups * 2), "int32")   # per group: -offset sum q, the step's fp32 bits
        radix = T.alloc_buffer((1,), "int32")
        radix[0] = 256
        if prompt:
            for r in T.parallel(m):
                quantize_row(x, xq, base, r)
        else:
            quantize_row(x, xq, base, 0)
        for t in T.parallel(n // tile):
            acc = T.alloc_buffer((prompt_rows * tile,), "float32")
            if prompt:     # prompt_rows rows of the prompt at a time: each code load and unpack serves them all
                for pair in range(m // prompt_rows):
                    tile_rows(w, s, xq, base, radix, out, acc, t, pair * prompt_rows, prompt_rows)
                for r in range(m // prompt_rows * prompt_rows, m):
                    tile_rows(w, s, xq, base, radix, out, acc, t, r, 1)
            else:
                tile_rows(w, s, xq, base, radix, out, acc, t, 0, 1)

    return kernel


def rows_base(fmt: str) -> str:
    """The NK format (NK_FORMATS key) of a row-interleaved recognize format (TILED_Q4 / TILED_Q8 / TILED_T2)."""
    return "q8" if fmt == TILED_Q8 else TILED_PACKED[fmt]


def arm_rows_like(func: tirx.PrimFunc, x_bytes: int | None = None) -> tirx.PrimFunc | None:
    """The interleaved-rows sdot kernel with `func`'s parameter order when `func` is a fused decode GEMV or prefill
    matmul of row-interleaved q4 / q8 / t2 codes (recognize: TILED_Q4 / TILED_Q8 / TILED_T2) of a shape it takes,
    else None (x's bytes: rows_dot_kernel's). The caller checks that the target has dotprod."""
    for prompt in (False, True):
        match = match_packed_nk_gemv(func, rows="prompt" if prompt else "one")
        if match is None or match[0] not in (*TILED_PACKED, TILED_Q8):
            continue
        fmt, n, k, act, scale_dtype, order = match
        tile = int(func.params[order.index("scales")].shape[2])
        base = rows_base(fmt)
        if not check_rows(NK_FORMATS[base], n, k, tile):
            return None
        kernel = rows_dot_kernel(NK_FORMATS[base], n, k, tile, act, scale_dtype, prompt, x_bytes)
        op_class = ("dequant-matmul" if prompt else "dequant-gemv") + ("-ternary" if base in PACKINGS else "")
        return substitute(func, kernel, order, op_class)
    return None
