"""Hand-written CPU kernels for the prefill matmul of quantized weights (a prompt's rows times KN q4, t2 or
q8 codes, fp32 activations).

Why not the schedule: `schedule.py` dequantizes a tile of 24 weight columns once per task and then runs
every prompt row over it with the 24 columns in registers: per k, one broadcast of x, three loads of the
tile and three FMAs — as many loads as FMAs, and the tile (K x 24 fp32: 55 KB at K = 576) is streamed once
per row. Here, per tile, rows go MR at a time: MR x 3 accumulators (12 of AVX2's 16 registers at MR = 4),
so per k the three tile loads and MR broadcasts feed 3 * MR FMAs, and the tile is streamed once per MR
rows. Rows left over (the prompt length mod MR) run one at a time. Each task dequantizes its tile into a
local scratch first (the same expression as the fused TE: (code - offset) * scale), so the formats differ
only there.

On x86 the codes meet x quantized per row and group (int16 precision, ~2e-5 of the fp32 result) in
integer dot products instead: AVX2's `pmaddwd` (`packed_kn_matmul_int16`) or, with AVX-512 VNNI, `vpdpbusd`
(`packed_kn_matmul_vnni`), for q4 and t2; q8 codes stored tiled (host-cpu, quantize.tile_q8) take the
pmaddwd kernel on any AVX2 CPU; KN q8 and b1 keep the fp32 kernel without VNNI.

`CPUInlineParallel` substitutes this kernel for a function that is exactly the fused pattern with a
symbolic row count (`match_packed_kn_gemv(..., rows="prompt")`); anything else keeps the schedules. Same
result as the fused TE up to fp32 summation order (the sum over k runs in the same order per output).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import PACKINGS, tiled_kn_index, tiled_q8_index
from pipeline.kernels.cpu.gemv import INT16_FORMATS, VNNI_FORMATS
from pipeline.kernels.cpu.packed import (
    FORMATS,
    INT16_MAX,
    LANES,
    TILED_PACKED,
    TILED_Q8,
    VNNI_Q_MAX,
    PackedFormat,
    q8_tile_of,
    substitute,
)
from pipeline.kernels.cpu.recognize import match_packed_kn_gemv
from pipeline.kernels.cpu.x86 import quad_bytes, quad_low_bytes

ROWS = 4           # prompt rows per register tile (x 3 vectors: 12 accumulators)
TILE_VECTORS = (3, 2, 1)   # 24 weight columns per task when N allows, else 16 / 8


@T.macro
def _row_tiles(row_block, buffers: tuple, m, rows: T.int32, col):
    """A task's prompt rows over its columns: `row_block(*buffers, first, count, col)` (the kernel's macro for
    `count` rows from `first`, count a Python int) `rows` at a time, then the rest one at a time."""
    for b in range(m // rows):
        row_block(*buffers, b * rows, rows, col)
    for r in range(m % rows):
        row_block(*buffers, m // rows * rows + r, 1, col)


@T.macro
def _quantize_row(x: T.Buffer, q: T.Buffer, hi: T.Buffer, d: T.Buffer, off: T.Buffer, row, group: T.int32,
                  k: T.int32, groups: T.int32, q_max: T.float32, code_offset: T.int32, split_bytes: bool):
    """Row `row` of x [1, m, k] in integer steps of its groups of `group` (the last one may be shorter):
    q = round(x * q_max / max|x|), d[row, g] = the step max|x| / q_max, off[row, g] = code_offset * sum(q);
    with `split_bytes` (static) also hi = floor((q + 128) / 256), so q = 256 hi + lo in two signed bytes."""
    for g in range(groups):
        d[row, g] = T.float32(0)
        for j in range(T.min(group, k - g * group)):
            d[row, g] = T.max(d[row, g], T.fabs(x[0, row, g * group + j]))
        off[row, g] = 0
        for j in range(T.min(group, k - g * group)):
            q[g * group + j] = T.Cast("int32", T.round(x[0, row, g * group + j] * T.if_then_else(
                d[row, g] > T.float32(0), T.float32(q_max) / d[row, g], T.float32(0))))
            if split_bytes:
                hi[g * group + j] = T.shift_right(q[g * group + j] + 128, 8)
            off[row, g] = off[row, g] + q[g * group + j]
        off[row, g] = off[row, g] * code_offset
        d[row, g] = d[row, g] * T.float32(1.0 / q_max)


@T.macro
def _unpack_codes(wq: T.Buffer, w: T.Buffer, col, words: T.int32, per_word: T.int32, bits: T.int32,
                  mask: T.int32, tile: T.int32):
    """A task's `tile` columns of codes from col, unpacked once: wq[kw * per_word + c, j] = the word's bits
    from bits * c on, masked (`mask`: one field per byte or per int16 half)."""
    for kw in range(words):
        for c in T.unroll(per_word):
            for j in T.vectorized(tile):
                wq[kw * per_word + c, j] = T.bitwise_and(T.shift_right(w[kw, col + j], T.uint32(bits * c)),
                                                         T.uint32(mask))


@T.macro
def _unpack_tiled_codes(wq: T.Buffer, w: T.Buffer, col, words: T.int32, per_word: T.int32, bits: T.int32,
                        mask: T.int32, tile: T.int32, code_tile: T.int32):
    """`_unpack_codes` from q4 codes stored tiled (quantize.tile_kn, `code_tile` columns per tile): 8 columns
    at a time, which never straddle two code tiles (code_tile is a multiple of 8)."""
    for kw in range(words):
        for c in T.unroll(per_word):
            for v in range(tile // LANES):
                for j in T.vectorized(LANES):
                    wq[kw * per_word + c, v * LANES + j] = T.bitwise_and(T.shift_right(
                        w[(col + v * LANES) // code_tile, kw, (col + v * LANES) % code_tile + j], T.uint32(bits * c)),
                        T.uint32(mask))


def packed_kn_matmul(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16", rows: int = ROWS,
                     q8_tile: int = 0, packed_tile: int = 0):
    """The kernel for out[1, m, n] = x[1, m, k] @ dequantize(codes, scales), m symbolic (a prompt).
    `q8_tile`: q8 codes stored tiled (quantize.tile_q8, [N / q8_tile, K / 2, 2 q8_tile]), read by index
    arithmetic in the task's dequantization: the kernel for CPUs without AVX2 (0.8-0.93x this kernel over KN
    codes on Zen 3, 128 rows; AVX2 takes `packed_kn_matmul_int16`, 1.1-1.4x). `packed_tile`: q4 / t2 codes
    and scales stored tiled (quantize.tile_kn, [N / packed_tile, rows, packed_tile]), read the same way."""
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
    scale_shape = (i64(groups), i64(n))
    if q8_tile:
        code_shape = (i64(n // q8_tile), i64(k // 2), i64(2 * q8_tile))
    if packed_tile:
        code_shape, scale_shape = ((i64(n // packed_tile), i64(word_rows), i64(packed_tile)),
                                   (i64(n // packed_tile), i64(groups), i64(packed_tile)))

    def weight(w, s, kk, col):
        """Dequantized weight [kk, col] (scalar; vectorized over col by the caller's loop)."""
        if packed_tile:
            code = T.Cast("float32", T.bitwise_and(T.shift_right(
                w[tiled_kn_index(col, kk // codes, packed_tile)], T.Cast("uint32", kk % codes * bits)), T.uint32(mask)))
            return (code - T.float32(spec.offset)) * T.Cast("float32", s[tiled_kn_index(col, kk // group, packed_tile)])
        if q8_tile:
            code = T.Cast("float32", w[tiled_q8_index(col, kk, q8_tile)])
        elif bits == 8:
            code = T.Cast("float32", w[kk, col])
        else:
            code = T.Cast("float32", T.bitwise_and(
                T.shift_right(w[kk // codes, col], T.Cast("uint32", kk % codes * bits)), T.uint32(mask)))
            code = code * T.float32(spec.step) - T.float32(spec.offset)
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
    def matmul(w: T.Buffer(code_shape, spec.code_dtype), s: T.Buffer(scale_shape, scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), "float32"), out: T.Buffer((i64(1), m, i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for task in T.parallel(n // tile):
            wt = T.alloc_buffer((k, tile), "float32")        # this task's columns, dequantized
            acc = T.alloc_buffer((rows * vecs,), vf)
            col: T.let[T.int64] = T.Cast("int64", task) * tile
            for kk in range(k):
                for j in T.vectorized(tile):
                    wt[kk, j] = weight(w, s, kk, col + j)
            _row_tiles(row_block, (x, out, wt, acc), m, rows, col)

    return matmul


def packed_kn_matmul_like(func: tirx.PrimFunc, byte_dot: bool = False, int16_dot: bool = False) -> tirx.PrimFunc | None:
    """The hand-written prefill kernel with `func`'s parameter order, or None when `func` is not one.
    `byte_dot`: the target has AVX-512 VNNI (q4 / t2 then take `packed_kn_matmul_vnni`); `int16_dot`: it has
    AVX2's pmaddwd (q4 / t2 then take `packed_kn_matmul_int16`)."""
    match = match_packed_kn_gemv(func, rows="prompt")
    if match is None:
        return None
    fmt, n, k, scale_dtype, order = match
    if fmt in TILED_PACKED:
        base = TILED_PACKED[fmt]
        tile = int(func.params[order.index("codes")].shape[2])
        if byte_dot:
            kernel = packed_kn_matmul_vnni(FORMATS[base], n, k, scale_dtype, packed_tile=tile)
        elif int16_dot:
            kernel = packed_kn_matmul_int16(FORMATS[base], n, k, scale_dtype, packed_tile=tile,
                                            vectors=(tile // LANES,))
        else:
            kernel = packed_kn_matmul(FORMATS[base], n, k, scale_dtype, packed_tile=tile)
        return substitute(func, kernel, order,
                          "dequant-matmul-ternary" if base in PACKINGS else "dequant-matmul")
    if fmt == TILED_Q8:
        tile = q8_tile_of(tuple(int(d) for d in func.params[order.index("codes")].shape), n, k)
        if tile % LANES:
            return None
        if (int16_dot or byte_dot) and tile == 2 * LANES:   # VNNI CPUs have AVX2's pmaddwd too
            kernel = packed_kn_matmul_int16(FORMATS["q8"], n, k, scale_dtype, q8_tile=tile)
        else:
            kernel = packed_kn_matmul(FORMATS["q8"], n, k, scale_dtype, q8_tile=tile)
        return substitute(func, kernel, order, "dequant-matmul")
    if byte_dot and fmt in VNNI_FORMATS and n % LANES == 0:
        kernel = packed_kn_matmul_vnni(FORMATS[fmt], n, k, scale_dtype)
    elif int16_dot and fmt in INT16_FORMATS and n % LANES == 0 and k % 2 == 0:
        kernel = packed_kn_matmul_int16(FORMATS[fmt], n, k, scale_dtype)
    else:
        kernel = packed_kn_matmul(FORMATS[fmt], n, k, scale_dtype)
    return substitute(func, kernel, order, "dequant-matmul-ternary" if fmt in PACKINGS else "dequant-matmul")


VNNI_ROWS = 4      # prompt rows per register tile of the byte kernel (x 2 vectors x hi/lo: 16 int32 sums)
# int32 lanes of the byte kernel's vectors: 512-bit (AVX-512 VNNI has that form wherever it has the 256-bit one).
# Zen 5 runs them at full width: 1.6-1.9x the 256-bit kernel per matmul on SmolLM2's and the 0.32B model's shapes,
# SmolLM2 q4f16 prefill-128 1.56x side by side (bit-identical); Zen 4 splits them in two halves (no loss).
WIDE_LANES = 16


def packed_kn_matmul_vnni(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16", rows: int = VNNI_ROWS,
                          packed_tile: int = 0):
    """The q4 / t2 prefill with byte dot products (AVX-512 VNNI), x at the int16 kernels' precision as in
    `x86.packed_kn_gemv_bytes`: the fp32 kernel above is FMA-bound (8 multiply-adds per instruction);
    `vpdpbusd` does 32, two per 4 multiply-adds of a lane with x in two bytes (hi, lo).

    Every prompt row's x is quantized per group first (rows in parallel): its step d and, per word of codes
    and shift c, the hi / lo bytes of the 4 x that meet that word's codes at shift c (x86.py's "quads").
    A task unpacks its 16 (or 8) columns of codes once — per word and shift, the 4 codes of each column as
    the 4 bytes of a uint32 — then runs the prompt's rows `rows` at a time over them: per quad of k, one
    `vpdpbusd` per row, vector and byte half; at the end of each group the int32 sums become fp32 (exact,
    as in the decode kernel) and out += s * d * (step * (256 hi + lo) - offset * sum(q)) (step 2 for b1's
    sign bits, 1 otherwise). `packed_tile` (q4 / t2 codes and scales stored tiled, quantize.tile_kn): the
    task's codes unpacked and its scales copied 8 columns at a time from their tiles (a task's 16 or 32
    columns may span two). On an AVX-512 VNNI EPYC, 2 threads, 128 rows, q4 shapes of SmolLM2 / the 0.49B
    Qwen3: 1.0-1.02x this kernel over KN codes, where the int16 kernel over tiled codes was 0.92-0.99x."""
    lanes = WIDE_LANES if n % WIDE_LANES == 0 else LANES
    vecs = 2 if n % (2 * lanes) == 0 else 1
    tile = vecs * lanes
    bits, group, codes = spec.bits, spec.group, spec.codes
    shifts = codes // 4
    words, groups = k // codes, -(-k // group)
    quads_n = words * shifts
    mask = ((1 << bits) - 1) * 0x01010101
    i64 = T.int64
    vf, vi, vb = f"float32x{lanes}", f"int32x{lanes}", f"int8x{4 * lanes}"
    dot = f"llvm.x86.avx512.vpdpbusd.{32 * lanes}"
    m = tirx.Var("seq_len", "int64")

    def scales(s, g, col, j):
        """Group g's scales of vector j of the task's columns from col (KN rows, or the task's copy `ss` of
        its tiled scales, passed as `s`, indexed from 0)."""
        return s[g, T.Ramp((0 if packed_tile else col) + j * lanes, 1, lanes)]

    @T.macro
    def row_block(xq, d, off, s, out, wq, iacc, facc, first, count, col):
        """Rows first .. first + count - 1 (count a Python int) over the task's unpacked codes."""
        for j in T.unroll(count * vecs):
            facc[j] = T.Broadcast(T.float32(0), lanes)
        for g in range(groups):
            for j in T.unroll(2 * count * vecs):
                iacc[j] = T.Broadcast(0, lanes)
            for qd in range(T.min(group, k - g * group) // 4):
                for r in T.unroll(count):
                    for h in T.unroll(2):
                        for j in T.unroll(vecs):
                            iacc[(r * 2 + h) * vecs + j] = T.call_llvm_pure_intrin(
                                vi, dot, iacc[(r * 2 + h) * vecs + j],
                                T.reinterpret(vb, wq[g * group // 4 + qd, T.Ramp(j * lanes, 1, lanes)]),
                                T.reinterpret(vb, T.Broadcast(xq[first + r, h, g * group // 4 + qd], lanes)))
            for r in T.unroll(count):
                for j in T.unroll(vecs):
                    facc[r * vecs + j] = facc[r * vecs + j] + T.Cast(vf, scales(s, g, col, j)) * (
                        T.Broadcast(d[first + r, g], lanes) * T.Cast(
                            vf, (iacc[r * 2 * vecs + j] * T.Broadcast(256, lanes) + iacc[(r * 2 + 1) * vecs + j])
                            * T.Broadcast(spec.step, lanes) - T.Broadcast(off[first + r, g], lanes)))
        for r in T.unroll(count):
            for j in T.unroll(vecs):
                out[0, first + r, T.Ramp(col + j * lanes, 1, lanes)] = facc[r * vecs + j]

    code_shape, scale_shape = (i64(words), i64(n)), (i64(groups), i64(n))
    tiled = packed_tile > 0
    if tiled:
        assert packed_tile % LANES == 0 and n % packed_tile == 0, (n, packed_tile)
        code_shape = (i64(n // packed_tile), i64(words), i64(packed_tile))
        scale_shape = (i64(n // packed_tile), i64(groups), i64(packed_tile))

    @T.prim_func(private=True)
    def matmul(w: T.Buffer(code_shape, "uint32"), s: T.Buffer(scale_shape, scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), "float32"), out: T.Buffer((i64(1), m, i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((m, 2, quads_n), "int32")     # per row: [hi | lo] bytes of x per word and shift
        d = T.alloc_buffer((m, groups), "float32")
        off = T.alloc_buffer((m, groups), "int32")         # the code offset times the sum of the group's q
        for row in T.parallel(m):
            q = T.alloc_buffer((k,), "int32", scope="local")
            hi = T.alloc_buffer((k,), "int32", scope="local")
            _quantize_row(x, q, hi, d, off, row, group, k, groups, VNNI_Q_MAX, spec.offset, True)
            for kw in range(words):
                for c in range(shifts):
                    xq[row, 0, kw * shifts + c] = quad_bytes(hi, kw * codes + c, shifts)
                    xq[row, 1, kw * shifts + c] = quad_low_bytes(q, hi, kw * codes + c, shifts)
        for task in T.parallel(n // tile):
            wq = T.alloc_buffer((quads_n, tile), "uint32")   # per word and shift: 4 codes of each column as bytes
            iacc = T.alloc_buffer((2 * rows * vecs,), vi)
            facc = T.alloc_buffer((rows * vecs,), vf)
            col: T.let[T.int64] = T.Cast("int64", task) * tile
            if tiled:   # static
                ss = T.alloc_buffer((groups, tile), scale_dtype)   # the task's scales, from their tiles
                _unpack_tiled_codes(wq, w, col, words, shifts, bits, mask, tile, packed_tile)
                for g in range(groups):
                    for v in range(tile // LANES):
                        for j in T.vectorized(LANES):
                            ss[g, v * LANES + j] = s[(col + v * LANES) // packed_tile, g,
                                                     (col + v * LANES) % packed_tile + j]
                _row_tiles(row_block, (xq, d, off, ss, out, wq, iacc, facc), m, rows, col)
            else:
                _unpack_codes(wq, w, col, words, shifts, bits, mask, tile)
                _row_tiles(row_block, (xq, d, off, s, out, wq, iacc, facc), m, rows, col)

    return matmul


INT16_ROWS = 4     # prompt rows per register tile of the int16 kernel (x 2 vectors: 8 int32 sums)
INT16_VECTORS = (2, 1)


def packed_kn_matmul_int16(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16", rows: int = INT16_ROWS,
                           vectors: tuple[int, ...] = INT16_VECTORS, q8_tile: int = 0, packed_tile: int = 0):
    """The q4 / t2 prefill with int16 dot products (x86 AVX2 `pmaddwd`, no VNNI), x at the int16 decode
    kernel's precision (`x86.packed_kn_gemv_int16`): the fp32 kernel above does 8 multiply-adds per
    FMA; `pmaddwd` does 16 (two int16 products per int32 lane) and Zen 3 issues two a cycle.

    Every prompt row's x is quantized per group of the weights first (rows in parallel): q = round(x * 32767
    / max|x|), its step d, offset * sum(q), and per word of C codes and c < C/2 the int16 pair (q[C w + c],
    q[C w + c + C/2]). A task unpacks its 24 (16, 8) columns of codes once — per word and c, codes c and c +
    C/2 of each column in the two int16 halves of a lane (shift by bits * c, one mask) — then runs the
    prompt's rows `rows` at a time over them: per pair, one `pmaddwd` and one add per row and vector. At the
    end of each group the int32 sums (below 2^24, as in the decode kernel) become fp32 exactly and out += s *
    d * (sum - offset * sum(q)).

    `q8_tile` (q8 codes stored tiled, quantize.tile_q8: [N / 16, K / 2, 32]): a task owns one code tile, whose
    row pairs already hold each column's codes for rows 2p and 2p + 1 side by side — sign-extended to int16,
    they are the lanes' pairs as they are (x's pairs are then q[2p], q[2p + 1], no offset). On Zen 3, 2
    threads, 128 rows: 1.1-1.4x the fp32 kernel over KN q8 codes on SmolLM2's and the 0.49B Qwen3's shapes.
    `packed_tile` (q4 / t2 codes and scales stored tiled, quantize.tile_kn): the same kernel, codes unpacked and scales
    read 8 columns at a time from their tile (`_unpack_tiled_codes`)."""
    assert spec.step == 1, spec
    if q8_tile:
        assert spec.bits == 8 and q8_tile == 2 * LANES, (spec, q8_tile)
        vectors = (2,)
    if packed_tile:
        assert spec.bits in (4, 2) and packed_tile % LANES == 0 and n % packed_tile == 0, (spec, packed_tile)
    vecs = next(v for v in vectors if n % (v * LANES) == 0)
    tile = vecs * LANES
    bits, group, codes = spec.bits, spec.group, spec.codes if not q8_tile else 2
    half = codes // 2
    words, groups = k // codes, -(-k // group)
    pairs_n = words * half
    mask = ((1 << bits) - 1) * 0x00010001          # one code in each int16 half of a lane
    i64 = T.int64
    vf, vi, vh = f"float32x{LANES}", f"int32x{LANES}", f"int16x{2 * LANES}"
    m = tirx.Var("seq_len", "int64")

    def scales(s, g, col):
        """The 8 scales of group g from column col (KN rows, or inside col's tile when tiled)."""
        if packed_tile:
            return s[col // packed_tile, g, T.Ramp(col % packed_tile, 1, LANES)]
        return s[g, T.Ramp(col, 1, LANES)]

    @T.macro
    def row_block(xp, d, off, s, out, wq, iacc, facc, first, count, col):
        """Rows first .. first + count - 1 (count a Python int) over the task's unpacked codes."""
        for j in T.unroll(count * vecs):
            facc[j] = T.Broadcast(T.float32(0), LANES)
        for g in range(groups):
            for j in T.unroll(count * vecs):
                iacc[j] = T.Broadcast(0, LANES)
            for p in range(T.min(group, k - g * group) // 2):
                for r in T.unroll(count):
                    for j in T.unroll(vecs):
                        iacc[r * vecs + j] = iacc[r * vecs + j] + T.call_llvm_pure_intrin(
                            vi, "llvm.x86.avx2.pmadd.wd",
                            T.reinterpret(vh, wq[g * group // 2 + p, T.Ramp(j * LANES, 1, LANES)]),
                            T.reinterpret(vh, T.Broadcast(xp[first + r, g * group // 2 + p], LANES)))
            for r in T.unroll(count):
                for j in T.unroll(vecs):
                    facc[r * vecs + j] = facc[r * vecs + j] + T.Cast(vf, scales(s, g, col + j * LANES)) * (
                        T.Broadcast(d[first + r, g], LANES) * T.Cast(
                            vf, iacc[r * vecs + j] - T.Broadcast(off[first + r, g], LANES)))
        for r in T.unroll(count):
            for j in T.unroll(vecs):
                out[0, first + r, T.Ramp(col + j * LANES, 1, LANES)] = facc[r * vecs + j]

    tiled = q8_tile > 0
    code_shape, code_dtype = (((i64(n // q8_tile), i64(words), i64(2 * q8_tile)), "int8") if tiled
                              else ((i64(words), i64(n)), "uint32"))
    scale_shape = (i64(groups), i64(n))
    tiled_packed = packed_tile > 0
    if packed_tile:
        code_shape, scale_shape = (i64(n // packed_tile), i64(words), i64(packed_tile)), (i64(n // packed_tile), i64(groups), i64(packed_tile))

    @T.prim_func(private=True)
    def matmul(w: T.Buffer(code_shape, code_dtype), s: T.Buffer(scale_shape, scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), "float32"), out: T.Buffer((i64(1), m, i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        xp = T.alloc_buffer((m, pairs_n), "int32")        # per row: int16 q[C w + c] | q[C w + c + C/2] << 16
        d = T.alloc_buffer((m, groups), "float32")
        off = T.alloc_buffer((m, groups), "int32")         # the code offset times the sum of the group's q
        for row in T.parallel(m):
            q = T.alloc_buffer((k,), "int32", scope="local")
            _quantize_row(x, q, q, d, off, row, group, k, groups, INT16_MAX, spec.offset, False)
            for kw in range(words):
                for c in range(half):
                    xp[row, kw * half + c] = T.bitwise_or(T.bitwise_and(q[kw * codes + c], 65535),
                                                          T.shift_left(q[kw * codes + c + half], 16))
        for task in T.parallel(n // tile):
            wq = T.alloc_buffer((pairs_n, tile), "uint32")   # per word and c: codes c, c + C/2 of each column
            iacc = T.alloc_buffer((rows * vecs,), vi)
            facc = T.alloc_buffer((rows * vecs,), vf)
            col: T.let[T.int64] = T.Cast("int64", task) * tile
            if tiled:   # static: the tile's row pairs, sign-extended to int16 (column j's two codes in lane j)
                for p in range(words):
                    wq[p, T.Ramp(0, 1, tile)] = T.reinterpret(f"uint32x{tile}", T.Cast(
                        f"int16x{2 * tile}", w[task, p, T.Ramp(0, 1, 2 * tile)]))
            elif tiled_packed:   # static
                _unpack_tiled_codes(wq, w, col, words, half, bits, mask, tile, packed_tile)
            else:
                _unpack_codes(wq, w, col, words, half, bits, mask, tile)
            _row_tiles(row_block, (xp, d, off, s, out, wq, iacc, facc), m, rows, col)

    return matmul
