"""The x86 instruction choices of the decode GEMVs: integer dot products (AVX2 `pmaddwd`, `pmaddubsw`;
AVX-512 VNNI `vpdpbusd`) over q4 / t2 / b1 / q8 codes against x quantized per group, and the shuffles that
feed them. Which kernel a function gets is gemv.py's choice (`packed_kn_gemv_like`); the measurements
behind each form are in its docstring.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.kernels.cpu.packed import (
    FORMATS,
    INT16_MAX,
    LANES,
    VNNI_Q_MAX,
    PackedFormat,
    add_scaled,
    column_span,
    load_words,
    prefetch_line,
    prefetch_row,
    prefetches,
    quantize_groups,
    split_task,
    sum_parts,
    tiled_dims,
    tiling,
)


def quad_bytes(src: T.Buffer, base, stride):
    """The int32 whose byte b is src[base + b * stride] (low 8 bits): x's values for the 4 codes one vpdpbusd
    lane multiplies."""
    return T.bitwise_or(
        T.bitwise_or(T.bitwise_and(src[base], 255), T.shift_left(T.bitwise_and(src[base + stride], 255), 8)),
        T.bitwise_or(T.shift_left(T.bitwise_and(src[base + 2 * stride], 255), 16), T.shift_left(src[base + 3 * stride], 24)))


def quad_low_bytes(q: T.Buffer, hi: T.Buffer, base, stride):
    """`quad_bytes` of lo = q - 256 hi (the low byte of q split as 256 hi + lo)."""
    return T.bitwise_or(
        T.bitwise_or(T.bitwise_and(q[base] - hi[base] * 256, 255),
                     T.shift_left(T.bitwise_and(q[base + stride] - hi[base + stride] * 256, 255), 8)),
        T.bitwise_or(T.shift_left(T.bitwise_and(q[base + 2 * stride] - hi[base + 2 * stride] * 256, 255), 16),
                     T.shift_left(q[base + 3 * stride] - hi[base + 3 * stride] * 256, 24)))


@T.macro
def _q8_x_pairs(x: T.Buffer, q: T.Buffer, pairs: T.Buffer, d: T.Buffer, offset: T.Buffer, lanes_f: T.Buffer,
                lanes_i: T.Buffer, group: T.int32, k: T.int32):
    """x quantized per group to int16 (`quantize_groups`; q8 codes have no offset: 0 there), then the
    consecutive pairs pmaddwd takes against a column's codes for rows 2i, 2i + 1: pairs[i] = int16 q[2 i] |
    q[2 i + 1] << 16 (8 lanes at a time: one k // 2-lane vector took LLVM minutes)."""
    quantize_groups(x, q, d, offset, lanes_f, lanes_i, group, k, INT16_MAX, 0)
    for i0 in range(k // 2 // LANES):
        for i1 in T.vectorized(LANES):
            pairs[i0 * LANES + i1] = T.bitwise_or(T.bitwise_and(q[2 * (i0 * LANES + i1)], 65535),
                                                  T.shift_left(q[2 * (i0 * LANES + i1) + 1], 16))


Q8_INT16_BLOCK = 16   # columns per pair of row loads in the AVX2 q8 kernel: two int32x8 sums
Q8_INT16_BLOCKS = 3   # blocks per step when N allows (48 columns: 6 sums in registers), else 2 (one block
# alone failed TVM's storage rewrite: "index_lanes == value_dtype.lanes()"; N not a multiple of 32 keeps fp32)
Q8_INT16_AHEAD = 512   # columns (bytes) ahead in the same two rows that each step prefetches (0: none)
# bytes 0-7 (8-15) of rows k and k + 1 interleaved: column j's two codes side by side, then sign-extended to int16
_PAIR_LO = [i // 2 + (Q8_INT16_BLOCK if i % 2 else 0) for i in range(Q8_INT16_BLOCK)]
_PAIR_HI = [8 + c for c in _PAIR_LO]


def q8_kn_gemv_int16(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16", splits: int = 1,
                     ahead: int = Q8_INT16_AHEAD) -> tirx.PrimFunc:
    """The q8 GEMV with integer dot products on AVX2 (no VNNI): x quantized per group to int16 as in
    `packed_kn_gemv_int16` (~2e-5 relative to the fp32 kernel). `pmaddwd` multiplies pairs of int16 lanes, but
    KN codes hold a column's consecutive k in different rows: rows k and k + 1 of 16 columns are interleaved
    byte by byte (one unpack) and sign-extended to int16, so each int32 lane gets c[k, j] q[k] + c[k+1, j]
    q[k+1] against the broadcast pair (q[k], q[k+1]). A group's sum is exact in int32 (32 x 127 x 32767 <
    2^31) before its conversion to fp32. 10 instructions per 2 x 16 codes (load, unpack, extend, pmaddwd, add
    per half) instead of 12 (sign-extend, convert, FMA per 8), and half the multiplies: the fp32 kernel was
    compute-bound on Zen 3 (q8f16 decode 8.5 GB/s, the ternary schemes' q8 lm_head). Side by side there, 2
    threads: decode 1.12x on SmolLM2 q8f16, 1.15x ternary_ptq, 1.07x ternary_ptq on the 0.49B Qwen3 (whose
    q8 lm_head still streams at only 7.7 GB/s: a third of its step).

    Each step prefetches `ahead` columns further along its two rows (`Q8_INT16_AHEAD`): a group walks its
    32 rows side by side, 48 bytes of each per step, more streams than the hardware prefetchers follow. On
    Zen 3, 2 threads, the weights rotated over 3 copies (not in cache): 1.6x on a 49152 x 1024 lm_head (9.9 ->
    16.0 GB/s), 1.25x at 49152 x 576, 1.2x at 6144 x 1024, no change beyond noise on shapes that fit the
    cache. In the 0.49B Qwen3's ternary_ptq decode (perf) its lm_head region 4.46 -> 3.87 ms, the step 1.02-1.035x
    side by side (10 alternated rounds, same tokens); SmolLM2 q8f16 1.01-1.08x."""
    blocks = next(b for b in (Q8_INT16_BLOCKS, 2) if n % (b * Q8_INT16_BLOCK) == 0)
    tile = blocks * Q8_INT16_BLOCK
    span = n if splits > 1 else column_span(n, tile)
    group, groups = spec.group, k // spec.group
    col_tasks = n // span
    i64 = T.int64
    vi, vh = f"int32x{LANES}", f"int16x{2 * LANES}"

    @T.macro
    def pair_dot(part, j, w, row, col, pair, order):
        """part[j] += the pmaddwd of rows row, row + 1 of 16 columns from col, interleaved by `order`, with x's
        int16 pair."""
        part[j] = part[j] + T.call_llvm_pure_intrin(vi, "llvm.x86.avx2.pmadd.wd", T.Cast(vh, T.Shuffle(
            [w[row, T.Ramp(col, 1, Q8_INT16_BLOCK)], w[row + 1, T.Ramp(col, 1, Q8_INT16_BLOCK)]], order)),
            T.reinterpret(vh, T.Broadcast(pair, LANES)))

    @T.macro
    def accumulate(w, s, pairs, d, partial, part, row, g, col, end):
        for j in T.unroll(2 * blocks):
            part[j] = T.Broadcast(0, LANES)
        for kk in range(group // 2):
            if ahead > 0:
                prefetch_row(w, g * group + 2 * kk, col + ahead, k, n, 1, 64)
                prefetch_row(w, g * group + 2 * kk + 1, col + ahead, k, n, 1, 64)
            for b in T.unroll(blocks):    # the block's columns 0-7, then 8-15
                pair_dot(part, 2 * b, w, g * group + 2 * kk, col + b * Q8_INT16_BLOCK, pairs[g * group // 2 + kk], _PAIR_LO)
                pair_dot(part, 2 * b + 1, w, g * group + 2 * kk, col + b * Q8_INT16_BLOCK, pairs[g * group // 2 + kk],
                         _PAIR_HI)
        for j in T.unroll(2 * blocks):
            add_scaled(partial, row, col + j * LANES, s, g, d, part[j])

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(k), i64(n)), "int8"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        q = T.alloc_buffer((k,), "int32")            # x in int16 steps of its group
        pairs = T.alloc_buffer((k // 2,), "int32")   # int16 q[2 i] | q[2 i + 1] << 16
        d = T.alloc_buffer((groups,), "float32")
        offset = T.alloc_buffer((groups,), "int32")  # `quantize_groups` writes 0 there: q8 codes have no offset
        partial = T.alloc_buffer((splits, n), "float32")
        lanes_f = T.alloc_buffer((LANES,), "float32")
        lanes_i = T.alloc_buffer((LANES,), "int32")
        _q8_x_pairs(x, q, pairs, d, offset, lanes_f, lanes_i, group, k)
        for task in T.parallel(splits * col_tasks):
            part = T.alloc_buffer((2 * blocks,), vi)
            split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate,
                        (w, s, pairs, d, partial, part))
        sum_parts(out, partial, splits, n)

    return gemv


Q8_TILED_BLOCKS = (3, 2, 1)   # column tiles per step of the tiled q8 kernels (48 columns in registers if N allows)


def _tiled_blocks(n: int, tile: int) -> int:
    """Tiles per step: the most of Q8_TILED_BLOCKS that divide n into at least two steps (a parallel loop of
    one iteration, which TVM drops, left its vector buffers to a storage rewrite that fails on them)."""
    return next((b for b in Q8_TILED_BLOCKS if n % (b * tile) == 0 and n // (b * tile) >= 2), 1)


def q8_tiled_gemv_int16(n: int, k: int, tile: int = 16, scale_dtype: str = "float16") -> tirx.PrimFunc:
    """The q8 GEMV on AVX2 over tiled codes (`quantize.tile_q8`, host-cpu's q8 storage): a tile's 16 columns
    keep their codes for rows 2i and 2i + 1 side by side, 32 bytes per row pair, and each tile is one
    contiguous run over K. So a step's pmaddwd takes 8 columns' row pairs straight from one load (sign-
    extended to int16; no interleaving shuffle) against x's broadcast int16 pair, and a task reads a few long
    sequential streams (the tiles of its columns) instead of 32 rows of the KN matrix side by side, whose
    48-byte pieces the prefetchers did not follow. The int32 group sums are scaled into fp32 accumulators
    that stay in registers over all of K; the parallel loop splits the column blocks, so no partial rows.
    x is quantized per group to int16 as in `q8_kn_gemv_int16` (same numerics, ~2e-5 of the fp32 kernel).
    On Zen 3, 2 threads, weights not in cache: 49152 x 1024 lm_head 14-15 -> 24-26 GB/s, 6144 x 1024 and
    1536 x 576 1.2-1.4x the KN kernel; in cache ~2x."""
    if tile != 2 * LANES:
        raise ValueError(f"the AVX2 tiled q8 kernel takes tiles of {2 * LANES} columns, not {tile}")
    group, groups = FORMATS["q8"].group, k // FORMATS["q8"].group
    blocks = _tiled_blocks(n, tile)
    width = blocks * tile
    i64 = T.int64
    vi, vh, vf = f"int32x{LANES}", f"int16x{2 * LANES}", f"float32x{LANES}"

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(n // tile), i64(k // 2), i64(2 * tile)), "int8"),
             s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        q = T.alloc_buffer((k,), "int32")            # x in int16 steps of its group
        pairs = T.alloc_buffer((k // 2,), "int32")   # int16 q[2 i] | q[2 i + 1] << 16
        d = T.alloc_buffer((groups,), "float32")
        offset = T.alloc_buffer((groups,), "int32")  # `quantize_groups` writes 0 there: q8 codes have no offset
        lanes_f = T.alloc_buffer((LANES,), "float32")
        lanes_i = T.alloc_buffer((LANES,), "int32")
        _q8_x_pairs(x, q, pairs, d, offset, lanes_f, lanes_i, group, k)
        for b in T.parallel(n // width):
            part = T.alloc_buffer((2 * blocks,), vi)
            acc = T.alloc_buffer((2 * blocks,), vf)
            for j in T.unroll(2 * blocks):
                acc[j] = T.Broadcast(T.float32(0), LANES)
            for g in range(groups):
                for j in T.unroll(2 * blocks):
                    part[j] = T.Broadcast(0, LANES)
                for kk in range(group // 2):
                    for j in T.unroll(2 * blocks):   # tile j // 2's columns 0-7, then 8-15
                        part[j] = part[j] + T.call_llvm_pure_intrin(
                            vi, "llvm.x86.avx2.pmadd.wd",
                            T.Cast(vh, w[b * blocks + j // 2, g * group // 2 + kk, T.Ramp(j % 2 * 2 * LANES, 1, 2 * LANES)]),
                            T.reinterpret(vh, T.Broadcast(pairs[g * group // 2 + kk], LANES)))
                for j in T.unroll(2 * blocks):
                    acc[j] = acc[j] + T.Cast(vf, s[g, T.Ramp(b * width + j * LANES, 1, LANES)]) * T.Broadcast(
                        d[g], LANES) * T.Cast(vf, part[j])
            for j in T.unroll(2 * blocks):
                out[0, 0, T.Ramp(b * width + j * LANES, 1, LANES)] = acc[j]

    return gemv


@T.macro
def _masked_dot(sums: T.Buffer, j: T.int32, word, shift: T.int32, field_mask: T.int32, pair):
    """sums[j] += the pmaddwd of `word` (LANES uint32 code words) shifted down by `shift`, masked to one field
    per int16 half, with x's int16 pair (`_packed_x_pairs`) broadcast to every lane."""
    sums[j] = sums[j] + T.call_llvm_pure_intrin(
        f"int32x{LANES}", "llvm.x86.avx2.pmadd.wd", T.reinterpret(
            f"int16x{2 * LANES}", T.bitwise_and(T.shift_right(word, T.Broadcast(T.uint32(shift), LANES)),
                                                T.Broadcast(T.uint32(field_mask), LANES))),
        T.reinterpret(f"int16x{2 * LANES}", T.Broadcast(pair, LANES)))


@T.macro
def _packed_x_pairs(x: T.Buffer, q: T.Buffer, pairs: T.Buffer, d: T.Buffer, offset: T.Buffer, lanes_f: T.Buffer,
                    lanes_i: T.Buffer, group: T.int32, k: T.int32, codes: T.int32, code_offset: T.int32):
    """x quantized per group to int16 (`quantize_groups`), then per word of `codes` codes and c < codes / 2
    the pair pmaddwd takes against codes c and c + codes / 2 of a lane: pairs = int16 q[C w + c] |
    q[C w + c + C/2] << 16 (the q4 / t2 int16 GEMVs, KN and tiled)."""
    quantize_groups(x, q, d, offset, lanes_f, lanes_i, group, k, INT16_MAX, code_offset)
    for kw in range(k // codes):
        for c in T.vectorized(codes // 2):
            pairs[kw * (codes // 2) + c] = T.bitwise_or(T.bitwise_and(q[kw * codes + c], 65535),
                                                        T.shift_left(q[kw * codes + c + codes // 2], 16))


def packed_kn_gemv_int16(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16",
                         splits: int = 1) -> tirx.PrimFunc:
    """The q4 / t2 GEMV with integer dot products (x86 AVX2 `pmaddwd`), for q4 13 vector instructions per
    8 x 8 codes (mask, pmaddwd, add per pair of codes, a shift per two) instead of 24 (mask, convert, FMA per code),
    which is what bounded the fp32 kernel: one core ran it at 10-14 GB/s with the weights in cache, this at
    16-20.

    x is quantized once per call, per group of the weights (32 for q4, 128 for t2), to int16: q = round(x *
    32767 / max|x|), an error of at most 2^-16 of the group's largest activation — 30x finer than the fp16
    activations of the GPU targets (measured ~2e-5 relative to the fp32 kernel's result). Per word of C
    codes (code i = k C w + i) a shift by bits * c and a mask of one code in each int16 half leave codes c
    and c + C/2 in the two halves of each lane; `pmaddwd` against the broadcast pair (q_c, q_c+C/2) adds both
    products into the lane's int32. One shift serves two pairs: the pair after it is masked in place (codes
    times 2^bits, at most 240 in an int16 half) into a second sum, shifted down by `bits` at the group's end
    (exact: every term is a multiple of 2^bits); 13 instructions per q4 word instead of 16, 27 per t2 word
    instead of 32, the same integer sums (logits bit-identical). Side by side on Zen 3, 2 threads: decode
    1.17x SmolLM2 q4f16, 1.07x ternary_ptq, 1.04x the 0.49B Qwen3's ternary_ptq (2026-12-04). A group's sum
    of c * q stays below 2^24 (q4: 32 * 15 * 32767, t2: 128 * 2 * 32767; the second sum 2^bits times
    that), so subtracting offset * sum(q) and converting to fp32 are exact; then out += s * d * that, d =
    max|x| / 32767. A last group shorter than the group (t2 at K = 576) is handled.

    `splits` > 1 (`k_splits`): task p sums groups [p G / splits, (p + 1) G / splits) over all n outputs
    into its own row of partial sums, added up at the end; 1: tasks own column spans over all of K."""
    vecs, tile, span = tiling(n)
    if splits > 1:
        span = n
    bits, group, codes = spec.bits, spec.group, spec.codes
    half = codes // 2
    words, groups, per_group = k // codes, -(-k // group), group // codes
    mask = ((1 << bits) - 1) * 0x00010001          # one code in each int16 half of a lane
    col_tasks = n // span
    prefetch = prefetches(per_group * n * 4)
    i64 = T.int64
    vi, vu = f"int32x{LANES}", f"uint32x{LANES}"

    @T.macro
    def accumulate(w, s, pairs, d, offset, partial, part, high, word, row, g, col, end):
        for j in T.unroll(vecs):
            part[j] = T.Broadcast(0, LANES)
            high[j] = T.Broadcast(0, LANES)
        for kw in range(T.min(per_group, words - g * per_group)):
            load_words(word, w, g * per_group + kw, col, vecs, prefetch and g + 1 < end, (g + 1) * per_group + kw,
                        words, n)
            for c2 in T.unroll(half // 2):
                for j in T.unroll(vecs):
                    _masked_dot(part, j, word[j], 2 * bits * c2, mask, pairs[(g * per_group + kw) * half + 2 * c2])
                    _masked_dot(high, j, word[j], 2 * bits * c2, mask << bits,
                               pairs[(g * per_group + kw) * half + 2 * c2 + 1])
        for j in T.unroll(vecs):
            add_scaled(partial, row, col + j * LANES, s, g, d, part[j] + T.shift_right(
                high[j], T.Broadcast(bits, LANES)) - T.Broadcast(offset[g], LANES))

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(words), i64(n)), "uint32"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        q = T.alloc_buffer((k,), "int32")            # x in int16 steps of its group
        pairs = T.alloc_buffer((k // 2,), "int32")   # per word, c < C/2: int16 q[C w + c] | q[C w + c + C/2] << 16
        d = T.alloc_buffer((groups,), "float32")     # the group's step, max|x| / 32767
        offset = T.alloc_buffer((groups,), "int32")  # the code offset times the sum of the group's q
        partial = T.alloc_buffer((splits, n), "float32")
        lanes_f = T.alloc_buffer((LANES,), "float32")    # a group's vectors folded into one, lane by lane
        lanes_i = T.alloc_buffer((LANES,), "int32")
        _packed_x_pairs(x, q, pairs, d, offset, lanes_f, lanes_i, group, k, codes, spec.offset)
        for task in T.parallel(splits * col_tasks):
            part = T.alloc_buffer((vecs,), vi)       # even codes c of the pairs
            high = T.alloc_buffer((vecs,), vi)       # odd codes, masked in place: 2^bits times their sum
            word = T.alloc_buffer((vecs,), vu)
            split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate,
                        (w, s, pairs, d, offset, partial, part, high, word))
        sum_parts(out, partial, splits, n)

    return gemv


def packed_tiled_gemv_int16(spec: PackedFormat, n: int, k: int, tile: int = 24,
                            scale_dtype: str = "float16", prefetch_bytes: int = 0) -> tirx.PrimFunc:
    """The q4 / t2 GEMV on AVX2 over tiled codes and scales (`quantize.tile_kn`, host-cpu's q4 / t2 storage:
    each tile of `tile` output columns one contiguous run over K, its scales another). A task owns whole
    tiles; per tile the `tile` / 8 column vectors' sums stay in registers over all of K, per group the int16
    pmaddwd sums of `packed_kn_gemv_int16` (same x quantization, same integer sums: outputs equal up to fp32
    summation order; a last t2 group shorter than 128 is handled). The parallel loop's static split gives
    each thread one contiguous range of tiles: two sequential streams per thread instead of a group's code
    rows (4 for q4, 8 for t2) and its scale row side by side in pieces of 96 bytes, which the prefetchers
    followed poorly on narrow layers (rows of 2.3 KB at N = 576). Measured on an AVX-512 VNNI EPYC (Zen 4
    class; no AVX2-only CPU was at hand), weights not in cache, alternated rounds, SmolLM2's and the 0.49B
    Qwen3's shapes, against the KN kernels with the same pmaddwd arithmetic (`packed_kn_gemv_int16`): q4 1
    thread 1.4-1.7x, 2 threads 1.05-1.2x; against what that CPU took for KN codes (`packed_kn_gemv_bytes`,
    vpdpbusd), 2 threads: q4 1.01-1.23x, t2 1.24-1.45x (t2 against the AVX2 pmaddubsw form 1.25-1.8x). On
    VNNI CPUs this kernel is taken too (a tiled vpdpbusd form: not written).

    `prefetch_bytes` > 0: per row of codes, a software prefetch of the row that far ahead in the thread's
    stream (past a tile's end: the next tile's, which the same task reads next; `GEMV_PREFETCH_BYTES`)."""
    bits, group, codes = spec.bits, spec.group, spec.codes
    half = codes // 2
    words, groups, per_group, vecs, tiles = tiled_dims(spec, n, k, tile)
    ahead = prefetch_bytes // (4 * tile) if prefetch_bytes > 0 else 0     # rows of `tile` uint32
    two_lines = 4 * tile > 64     # a row of 96 bytes (tile 24) starts at byte 0 or 32 of a line: 2 lines
    mask = ((1 << bits) - 1) * 0x00010001          # one code in each int16 half of a lane
    i64 = T.int64
    vi, vu, vf = f"int32x{LANES}", f"uint32x{LANES}", f"float32x{LANES}"

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(tiles), i64(words), i64(tile)), "uint32"),
             s: T.Buffer((i64(tiles), i64(groups), i64(tile)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        q = T.alloc_buffer((k,), "int32")            # x in int16 steps of its group
        pairs = T.alloc_buffer((k // 2,), "int32")   # per word, c < C/2: int16 q[C w + c] | q[C w + c + C/2] << 16
        d = T.alloc_buffer((groups,), "float32")
        offset = T.alloc_buffer((groups,), "int32")  # the code offset times the sum of the group's q
        lanes_f = T.alloc_buffer((LANES,), "float32")
        lanes_i = T.alloc_buffer((LANES,), "int32")
        _packed_x_pairs(x, q, pairs, d, offset, lanes_f, lanes_i, group, k, codes, spec.offset)
        for t in T.parallel(tiles):
            part = T.alloc_buffer((vecs,), vi)       # even codes of the pairs
            high = T.alloc_buffer((vecs,), vi)       # odd codes, masked in place: 2^bits times their sum
            word = T.alloc_buffer((vecs,), vu)
            acc = T.alloc_buffer((vecs,), vf)
            for j in T.unroll(vecs):
                acc[j] = T.Broadcast(T.float32(0), LANES)
            for g in range(groups):
                for j in T.unroll(vecs):
                    part[j] = T.Broadcast(0, LANES)
                    high[j] = T.Broadcast(0, LANES)
                for kw in range(T.min(per_group, words - g * per_group)):
                    if ahead > 0:   # never faults: past the last tile it names memory it does not read
                        T.evaluate(prefetch_line(w[t, g * per_group + kw + ahead, 0]))
                        if two_lines:
                            T.evaluate(prefetch_line(w[t, g * per_group + kw + ahead, 16]))
                    for j in T.unroll(vecs):
                        word[j] = w[t, g * per_group + kw, T.Ramp(j * LANES, 1, LANES)]
                    for c2 in T.unroll(half // 2):
                        for j in T.unroll(vecs):
                            _masked_dot(part, j, word[j], 2 * bits * c2, mask, pairs[(g * per_group + kw) * half + 2 * c2])
                            _masked_dot(high, j, word[j], 2 * bits * c2, mask << bits,
                                       pairs[(g * per_group + kw) * half + 2 * c2 + 1])
                for j in T.unroll(vecs):
                    acc[j] = acc[j] + T.Cast(vf, s[t, g, T.Ramp(j * LANES, 1, LANES)]) * T.Broadcast(d[g], LANES) * T.Cast(
                        vf, part[j] + T.shift_right(high[j], T.Broadcast(bits, LANES)) - T.Broadcast(offset[g], LANES))
            for j in T.unroll(vecs):
                out[0, 0, T.Ramp(t * tile + j * LANES, 1, LANES)] = acc[j]

    return gemv


def packed_kn_gemv_bytes(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16",
                        splits: int = 1, dot: str = "vnni") -> tirx.PrimFunc:
    """The q4 / t2 GEMV with byte dot products (AVX-512 VNNI `vpdpbusd`: 4 unsigned bytes times 4 signed
    bytes added into an int32 lane), x at the int16 kernel's precision: for q4 7 vector instructions per
    word (8 codes) instead of 11, for t2 15 instead of 23, which is what bounded the int16 kernel (1.4-1.6x
    at 2 threads on SmolLM2's shapes, weights not in cache).

    x is quantized per group as in `packed_kn_gemv_int16`, to q = round(x * 32512 / max|x|), then split
    into two signed bytes, q = 256 hi + lo (hi = floor((q + 128) / 256) in [-127, 127], lo in [-128, 127]):
    a single int8 step would be 1/254 of the group's largest |x|, which moved a test model's decode logits
    by 4% of their scale. Shifted by bits * c and masked to one code per byte, a word of C codes leaves in
    byte b of each lane code b C/4 + c; one `vpdpbusd` against the broadcast hi bytes of those four codes'
    q, one against their lo bytes; at the end of a group 256 * hi sums + lo sums - offset * sum(q) is at
    most 128 * 3 * 32512 (t2) or 32 * 15 * 32512 (q4) < 2^24, so converting to fp32 is exact; then out +=
    s * d * that, d = max|x| / 32512.

    `dot="avx2"` (AVX2 without VNNI, e.g. Zen 3): `pmaddubsw` in place of `vpdpbusd` — two byte products
    added into each int16 half of a lane, then a 16-bit add into the group's sums, widened to int32 at the
    group's end (pmaddwd with ones: the lane's halves are the same column). No sum can wrap: a pmaddubsw
    output is at most 2 * 15 * 128 = 3840 (q4; t2 768, b1 256) and a group adds 8 (q4) or 32 (t2, b1) of
    them per half, at most 30720 < 2^15; so the integer sums, and the outputs, equal the VNNI form's. Per
    t2 word and 8 columns 23 vector instructions instead of the pmaddwd kernel's 28 (which is near the issue
    width of Zen 3 there: ~42 G multiply-adds/s per thread, weights in cache). Zen 3, 2 threads, weights not
    in cache, the 7 t2 shapes of SmolLM2 and the 0.49B Qwen3, alternated rounds: 1.04-1.12x per GEMV (best
    of 7 rounds; 1.01-1.09x median); ternary_ptq decode side by side 1.02x (0.49B) and 1.06x (SmolLM2),
    within the machine's noise at the time."""
    assert dot in ("vnni", "avx2"), dot
    vecs, tile, span = tiling(n)
    if splits > 1:
        span = n
    bits, group, codes = spec.bits, spec.group, spec.codes
    shifts = codes // 4                           # after shift c, byte b of a lane holds code b * shifts + c
    words, groups, per_group = k // codes, -(-k // group), group // codes
    mask = ((1 << bits) - 1) * 0x01010101          # one code in each byte of a lane
    col_tasks = n // span
    prefetch = prefetches(per_group * n * 4)
    i64 = T.int64
    vi, vu, vb, vh = f"int32x{LANES}", f"uint32x{LANES}", f"int8x{4 * LANES}", f"int16x{2 * LANES}"
    acc_vector = vi if dot == "vnni" else vh

    def byte_dot(acc, codes, xs):
        """acc + the products of `codes` (unsigned bytes) and x's signed bytes `xs`: 4 per int32 lane (vnni: one
        vpdpbusd) or 2 per int16 half of a lane (avx2: pmaddubsw, then a 16-bit add)."""
        if dot == "vnni":
            return T.call_llvm_pure_intrin(vi, "llvm.x86.avx512.vpdpbusd.256", acc, T.reinterpret(vb, codes),
                                           T.reinterpret(vb, xs))
        return acc + T.call_llvm_pure_intrin(vh, "llvm.x86.avx2.pmadd.ub.sw", T.reinterpret(vb, codes),
                                             T.reinterpret(vb, xs))

    def widened(acc):
        """A group's sums per int32 lane (avx2: the lane's two int16 halves added by pmaddwd with ones)."""
        if dot == "vnni":
            return acc
        return T.call_llvm_pure_intrin(vi, "llvm.x86.avx2.pmadd.wd", acc, T.Broadcast(T.int16(1), 2 * LANES))

    @T.macro
    def accumulate(w, s, quads, d, offset, partial, part, word, row, g, col, end):
        for j in T.unroll(2 * vecs):
            part[j] = T.reinterpret(acc_vector, T.Broadcast(0, LANES))
        for kw in range(T.min(per_group, words - g * per_group)):
            load_words(word, w, g * per_group + kw, col, vecs, prefetch and g + 1 < end, (g + 1) * per_group + kw,
                        words, n)
            for c in T.unroll(shifts):
                for h in T.unroll(2):
                    for j in T.unroll(vecs):
                        part[h * vecs + j] = byte_dot(
                            part[h * vecs + j],
                            T.bitwise_and(T.shift_right(word[j], T.Broadcast(T.uint32(bits * c), LANES)),
                                          T.Broadcast(T.uint32(mask), LANES)),
                            T.Broadcast(quads[h, (g * per_group + kw) * shifts + c], LANES))
        for j in T.unroll(vecs):
            add_scaled(partial, row, col + j * LANES, s, g, d, (widened(part[j]) * T.Broadcast(256, LANES)
                                                                 + widened(part[vecs + j]))
                        * T.Broadcast(spec.step, LANES) - T.Broadcast(offset[g], LANES))

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(words), i64(n)), "uint32"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        q = T.alloc_buffer((k,), "int32")            # x in steps of its group
        hi = T.alloc_buffer((k,), "int32")           # q = 256 hi + lo
        quads = T.alloc_buffer((2, words * shifts), "int32")   # [hi | lo] bytes of the 4 codes at shift c
        d = T.alloc_buffer((groups,), "float32")     # the group's step, max|x| / 32512
        offset = T.alloc_buffer((groups,), "int32")  # the code offset times the sum of the group's q
        partial = T.alloc_buffer((splits, n), "float32")
        lanes_f = T.alloc_buffer((LANES,), "float32")
        lanes_i = T.alloc_buffer((LANES,), "int32")
        quantize_groups(x, q, d, offset, lanes_f, lanes_i, group, k, VNNI_Q_MAX, spec.offset)
        for v in range(k // LANES):
            for j in T.vectorized(LANES):                 # arithmetic shift: floor((q + 128) / 256)
                hi[v * LANES + j] = T.shift_right(q[v * LANES + j] + 128, 8)
        for kw in range(words):
            for c in T.vectorized(shifts):
                quads[0, kw * shifts + c] = quad_bytes(hi, kw * codes + c, shifts)
                quads[1, kw * shifts + c] = quad_low_bytes(q, hi, kw * codes + c, shifts)
        for task in T.parallel(splits * col_tasks):
            part = T.alloc_buffer((2 * vecs,), acc_vector)   # hi sums, then lo sums
            word = T.alloc_buffer((vecs,), vu)
            split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate,
                        (w, s, quads, d, offset, partial, part, word))
        sum_parts(out, partial, splits, n)

    return gemv


Q8_TILE = 32     # output columns per step of the q8 byte kernel: one 32-byte row load per k


def _unpack_order(elems: int, high: bool) -> list[int]:
    """A 2-input shuffle that interleaves the low (or high) halves of each 128-bit lane of two vectors of
    `elems` elements (x86's `vpunpckl*` / `vpunpckh*`, which LLVM emits for exactly this order)."""
    per_lane = elems // 2
    first = per_lane // 2 if high else 0
    return [src * elems + lane * per_lane + first + i
            for lane in range(2) for i in range(per_lane // 2) for src in range(2)]


_BYTES_LO, _BYTES_HI = _unpack_order(4 * LANES, False), _unpack_order(4 * LANES, True)
_WORDS_LO, _WORDS_HI = _unpack_order(2 * LANES, False), _unpack_order(2 * LANES, True)
_LANE_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])   # 128-bit halves of two int32x8
# vector v of `_interleave` holds columns 4 v .. 4 v + 3 (low lane) and 16 + 4 v .. 16 + 4 v + 3 (high lane):
# columns 0-7 are the low halves of vectors 0 and 1, 8-15 those of 2 and 3, 16-23 / 24-31 their high halves
_BYTES, _INT16S = f"int8x{4 * LANES}", f"int16x{2 * LANES}"


@T.macro
def _interleave(codes: T.Buffer, pairs: T.Buffer, w: T.Buffer, row: T.int32, col: T.int32):
    """codes[0..3] = the bytes of w[row: row + 4, col: col + 32], 4 rows of a column per int32 lane (byte b
    from row b), sign bits flipped (int8 c -> unsigned c + 128). Two rounds of in-lane unpacks (bytes of rows
    0/1 and 2/3, then their 16-bit pairs): 8 single-cycle shuffles for 128 codes. The columns come out in
    lane order (see `_LANE_HALVES`), which the group's sums undo once."""
    for p in T.unroll(2):
        pairs[2 * p] = T.reinterpret(_INT16S, T.Shuffle([w[row + 2 * p, T.Ramp(col, 1, Q8_TILE)],
                                                    w[row + 2 * p + 1, T.Ramp(col, 1, Q8_TILE)]], _BYTES_LO))
        pairs[2 * p + 1] = T.reinterpret(_INT16S, T.Shuffle([w[row + 2 * p, T.Ramp(col, 1, Q8_TILE)],
                                                        w[row + 2 * p + 1, T.Ramp(col, 1, Q8_TILE)]], _BYTES_HI))
    for h in T.unroll(2):
        codes[2 * h] = T.bitwise_xor(T.reinterpret(_BYTES, T.Shuffle([pairs[h], pairs[2 + h]], _WORDS_LO)),
                                     T.Broadcast(T.int8(-128), Q8_TILE))
        codes[2 * h + 1] = T.bitwise_xor(T.reinterpret(_BYTES, T.Shuffle([pairs[h], pairs[2 + h]], _WORDS_HI)),
                                         T.Broadcast(T.int8(-128), Q8_TILE))


def q8_kn_gemv_vnni(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16",
                    splits: int = 1) -> tirx.PrimFunc:
    """The q8 GEMV with byte dot products (AVX-512 VNNI `vpdpbusd`), x at the int16 kernels' precision as in
    `packed_kn_gemv_bytes`. A `vpdpbusd` lane adds 4 byte products of one column, but KN int8 codes hold a
    column's consecutive k in different rows: 4 rows of 32 columns are loaded and interleaved by in-lane
    unpacks (`_interleave`) into 4 vectors whose int32 lanes each hold the 4 codes of one column. The signed
    codes become unsigned bytes by flipping the sign bit (c + 128), so a group's sum is corrected by 128 *
    sum(q) in int32, exactly (|sum c q| <= 32 * 127 * 32512 < 2^31) before its conversion to fp32. For the
    lm_head of the ternary schemes (28 of SmolLM2's 61 MB per token) and q8f16: 16 instructions per 128
    codes instead of 48 (sign-extend, convert, FMA per 8). A single 4-input shuffle per vector (columns in
    natural order) compiled to 8 `vpermt2b` + 4 blends per 128 codes: 1.3-1.4x slower on the 49152-wide
    lm_head (2 threads, 30-53 MB of codes)."""
    tile = Q8_TILE
    span = n if splits > 1 else column_span(n, tile)
    group, groups = spec.group, k // spec.group
    quads_n = k // 4
    col_tasks = n // span
    prefetch = prefetches(group * n)
    i64 = T.int64
    vi, vb = f"int32x{LANES}", f"int8x{4 * LANES}"

    @T.macro
    def accumulate(w, s, quads, d, offset, partial, part, codes, pairs, sums, row, g, col, end):
        for j in T.unroll(8):
            part[j] = T.Broadcast(0, LANES)
        for m in range(group // 4):
            if prefetch and g + 1 < end:
                for r in T.unroll(4):
                    prefetch_row(w, (g + 1) * group + m * 4 + r, col, k, n, 1, 64)
            _interleave(codes, pairs, w, g * group + m * 4, col)
            for h in T.unroll(2):
                for v in T.unroll(4):
                    part[h * 4 + v] = T.call_llvm_pure_intrin(
                        vi, "llvm.x86.avx512.vpdpbusd.256", part[h * 4 + v], codes[v],
                        T.reinterpret(vb, T.Broadcast(quads[h, g * group // 4 + m], LANES)))
        for v in T.unroll(4):    # exact in int32, columns still in lane order
            sums[v] = part[v] * T.Broadcast(256, LANES) + part[4 + v] - T.Broadcast(offset[g], LANES)
        _add_group(partial, row, col + 0 * LANES, s, g, d, sums[0], sums[1], _LANE_HALVES[0])
        _add_group(partial, row, col + 1 * LANES, s, g, d, sums[2], sums[3], _LANE_HALVES[0])
        _add_group(partial, row, col + 2 * LANES, s, g, d, sums[0], sums[1], _LANE_HALVES[1])
        _add_group(partial, row, col + 3 * LANES, s, g, d, sums[2], sums[3], _LANE_HALVES[1])

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(k), i64(n)), "int8"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        q = T.alloc_buffer((k,), "int32")            # x in steps of its group
        hi = T.alloc_buffer((k,), "int32")           # q = 256 hi + lo
        quads = T.alloc_buffer((2, quads_n), "int32")   # [hi | lo] bytes of x[4 m: 4 m + 4]
        d = T.alloc_buffer((groups,), "float32")
        offset = T.alloc_buffer((groups,), "int32")  # 128 * the sum of the group's q
        partial = T.alloc_buffer((splits, n), "float32")
        lanes_f = T.alloc_buffer((LANES,), "float32")
        lanes_i = T.alloc_buffer((LANES,), "int32")
        quantize_groups(x, q, d, offset, lanes_f, lanes_i, group, k, VNNI_Q_MAX, 128)
        for v in range(k // LANES):
            for j in T.vectorized(LANES):                 # arithmetic shift: floor((q + 128) / 256)
                hi[v * LANES + j] = T.shift_right(q[v * LANES + j] + 128, 8)
        for m in range(quads_n):
            quads[0, m] = quad_bytes(hi, 4 * m, 1)
            quads[1, m] = quad_low_bytes(q, hi, 4 * m, 1)
        for task in T.parallel(splits * col_tasks):
            part = T.alloc_buffer((8,), vi)      # hi sums of the 4 vectors, then lo sums
            codes = T.alloc_buffer((4,), vb)
            pairs = T.alloc_buffer((4,), f"int16x{2 * LANES}")
            sums = T.alloc_buffer((4,), vi)
            split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate,
                        (w, s, quads, d, offset, partial, part, codes, pairs, sums))
        sum_parts(out, partial, splits, n)

    return gemv


@T.macro
def _add_group(partial: T.Buffer, row: T.int32, col: T.int32, s: T.Buffer, g: T.int32, d: T.Buffer,
               first, second, halves: list):
    """partial[row, col: col + 8] += scale * step * the group's integer sums of those 8 columns, which are
    the `halves` (`_LANE_HALVES`) of two of `_interleave`'s vectors."""
    add_scaled(partial, row, col, s, g, d, T.Shuffle([first, second], halves))

