"""Hand-written CPU kernels for the decode GEMV of quantized weights (one token times KN q4, t2 or q8 codes).

Why not a schedule: the fused dequantize + matmul computes sum_k x_k * s_g * (c_k - 7) per output. As a
schedule of that expression every 8 weights cost shift, and, -7, convert, scale multiply and FMA (plus a
broadcast), and a task owned 24 columns over all of K: 72+ code rows read 96 bytes at a time, far apart
(the row stride is N * 4 bytes), which no hardware prefetcher follows — SmolLM2's decode read weights at
~6 GB/s of the machine's 28. Regrouped per group g of 32,

    out_n = sum_g s_gn * (sum_{k in g} c_kn * x_k  -  7 * sum_{k in g} x_k)

and with x prescaled once per call by 16^-i for the code at nibble i (exact: a power of two), a code
masked in place (w & (15 << 4i) = c * 16^i, exact in fp32) needs no shift: and, convert, FMA per 8 weights
(the top nibble is shifted down instead: masked it would be negative as int32). The group sums of x are
computed once per call too. A task owns a span of up to SPAN_MAX output columns (accumulators in L1) and
walks it group by group, so each group's 4 code rows and its scale row are read in long sequential runs.
Within the span, 24 columns at a time are 3 AVX2 vectors with two partial sums each (even / odd codes):
6 independent FMA chains hide the FMA latency; they live in small vector-typed buffers of the default
scope, which become stack slots that LLVM keeps in registers (scalar lanes were split by SROA and
re-packed), and scalars inside a task are let-bound: scope="local" buffers and plain scalar assignments
became per-task TVMBackendAllocWorkspace allocations whose stores all stayed in the loop (fixed
2026-12-03: SmolLM2 decode 1.16x q4f16, 1.28x q8f16, 1.09x ternary_ptq side by side). Measured with
weights not in cache, 2 threads: 1.5-2.7x the scheduled GEMV on SmolLM2's shapes (lm_head 6 -> 16-19 GB/s).

Ternary t2 (16 two-bit codes per word, value (c - 1) * s per group of 128) is the same kernel with 2-bit
fields, x prescaled by 4^-i and an offset of 1; a last group shorter than 128 (K = 576) is handled. q8
(int8 codes [K, N], value c * s) walks the same spans: sign-extend 8 codes, convert, FMA.

On x86 with AVX2, x is quantized per weight group to int16 and the codes meet it in integer dot products
(`packed_kn_gemv_int16`, pmaddwd); with AVX-512 VNNI (e.g. Zen 4) in byte dot products, x split into two
signed bytes at the same precision (`packed_kn_gemv_bytes` for q4 / t2, `q8_kn_gemv_vnni` for q8, whose KN
rows are interleaved 4 at a time first): fewer instructions per weight, which is what bounded these
kernels at 2 threads (ternary_ptq decode 7.15 -> 6.14 ms per token side by side on SmolLM2, most of it the
q8 lm_head). q8 on AVX2 without VNNI takes `q8_kn_gemv_int16` (row pairs interleaved, pmaddwd); t2 / b1 there
the byte kernel with `pmaddubsw` (`packed_kn_gemv_bytes(dot="avx2")`: 16-bit sums per group).

host-cpu stores q8 codes tiled instead (target `q8_tile: 16`, quantize.tile_q8): 16 columns per tile, a
column's codes for rows 2i and 2i + 1 side by side, each tile contiguous over K. `q8_tiled_gemv_int16` then
feeds pmaddwd from one load per 8 columns and streams a few long runs (side by side on Zen 3, same tokens:
SmolLM2 q8f16 decode 1.56x, ternary_ptq 1.33x, the 0.49B Qwen3's ternary_ptq 1.13x); the KN q8 kernels stay
for shapes that do not tile and targets that keep plain KN codes. q4 and t2 the same way (targets' `q4_tile:
24`, `t2_tile: 24`, quantize.tile_kn): codes and scales in tiles of up to 24 columns (the widest of 24 / 16 / 8
dividing N into two tiles or more), each contiguous over K; `packed_tiled_gemv_int16` gives each thread one
range of whole tiles (two long streams) where the KN walk read a group's code rows and its scale row side by
side, 96 bytes at a time (an AVX-512 VNNI EPYC, 2 threads, weights not in cache, SmolLM2's shapes: q4
1.01-1.23x the KN VNNI kernel this CPU took before, t2 1.24-1.45x; side by side there: SmolLM2 q4f16 decode
1.13-1.18x, same tokens, ternary_ptq 1.22x; not measured on an AVX2-only CPU).

Same result as the fused TE up to fp32 summation order (the integer kernels: up to x's int16 rounding).
`CPUInlineParallel` substitutes this kernel for a function that is exactly that fused pattern
(recognize.match_packed_kn_gemv); anything else keeps the schedules.

This module holds the portable fp32 kernels and the choice among all of them (`packed_kn_gemv_like`); the
x86 integer forms are in x86.py, the formats, tilings and shared TIR pieces in packed.py, the CPU facts
the choice depends on (threads, vendor, ISA) in probe.py.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import PACKINGS
from pipeline.kernels.cpu.packed import (
    FLOAT_NT_CHAINS,
    FLOAT_NT_ROWS,
    FORMATS,
    LANES,
    TILED_PACKED,
    TILED_Q8,
    PackedFormat,
    k_splits,
    prefetch_line,
    q8_tile_of,
    split_task,
    substitute,
    sum_parts,
    tiled_dims,
    tiling,
)
from pipeline.kernels.cpu.recognize import match_float_nt_gemv, match_packed_kn_gemv
from pipeline.kernels.cpu.x86 import (
    Q8_INT16_BLOCK,
    Q8_TILE,
    packed_kn_gemv_bytes,
    packed_kn_gemv_int16,
    packed_tiled_gemv_int16,
    q8_kn_gemv_int16,
    q8_kn_gemv_vnni,
    q8_tiled_gemv_int16,
)

INT16_FORMATS = ("q4", "t2")   # packed_kn_gemv_int16 (decode t2 on AVX2 takes AVX2_BYTE_FORMATS' kernel first)
VNNI_FORMATS = ("q4", "t2", "b1")
# AVX2 without VNNI: packed_kn_gemv_bytes(dot="avx2") (pmaddubsw). Not q4: 1.0-1.06x the pmaddwd kernel per GEMV
# on Zen 3 and no decode difference outside the machine's noise (0.94-1.13x side by side, either way).
AVX2_BYTE_FORMATS = ("t2", "b1")


def packed_kn_gemv_like(func: tirx.PrimFunc, int16_dot: bool = False, threads: int = 1, byte_dot: bool = False, prefetch_bytes: int = 0) -> tirx.PrimFunc | None:
    """The hand-written kernel with `func`'s parameter order, or None when `func` is not such a GEMV.
    `int16_dot`: the target has AVX2's pmaddwd (q4 / t2 then take `packed_kn_gemv_int16`, q8
    `q8_kn_gemv_int16`); `byte_dot`: it
    has AVX-512 VNNI's vpdpbusd on 256-bit vectors (then `packed_kn_gemv_bytes`, q8 `q8_kn_gemv_vnni`). `threads`: the
    threads the library runs with when known (host-cpu: `build_threads`), K split that many ways (int16 and
    q8 kernels); 1 keeps column spans (a cross-compiled target: the phone's thread count is not known).
    `prefetch_bytes`: the tiled q4 / t2 int16 kernel's software prefetch distance (`native_prefetch_bytes`)."""
    match = match_packed_kn_gemv(func)
    if match is None:
        return None
    fmt, n, k, scale_dtype, order = match
    if fmt in TILED_PACKED:
        base = TILED_PACKED[fmt]
        tile = int(func.params[order.index("codes")].shape[2])
        # AVX-512 VNNI CPUs have AVX2 too: the tiled walk is the int16 kernel's (vpdpbusd over it: not written)
        if int16_dot or byte_dot:
            kernel = packed_tiled_gemv_int16(FORMATS[base], n, k, tile, scale_dtype, prefetch_bytes)
        else:
            kernel = packed_tiled_gemv(FORMATS[base], n, k, tile, scale_dtype)
        return substitute(func, kernel, order, "dequant-gemv-ternary" if base in PACKINGS else "dequant-gemv")
    if fmt == TILED_Q8:
        tile = q8_tile_of(tuple(int(d) for d in func.params[order.index("codes")].shape), n, k)
        # AVX-512 VNNI CPUs have AVX2 too: the tiled layout's streams mattered more than vpdpbusd (not measured there)
        int16 = (int16_dot or byte_dot) and tile == 2 * LANES and n >= 2 * tile   # one tile: see _tiled_blocks
        kernel = q8_tiled_gemv_int16(n, k, tile, scale_dtype) if int16 else q8_tiled_gemv(n, k, tile, scale_dtype)
        return substitute(func, kernel, order, "dequant-gemv")
    if fmt in VNNI_FORMATS and byte_dot and k % LANES == 0:
        kernel = packed_kn_gemv_bytes(FORMATS[fmt], n, k, scale_dtype, k_splits(n, k, threads, fmt))
    elif fmt in AVX2_BYTE_FORMATS and int16_dot and k % LANES == 0:
        kernel = packed_kn_gemv_bytes(FORMATS[fmt], n, k, scale_dtype, k_splits(n, k, threads, fmt), dot="avx2")
    elif fmt in INT16_FORMATS and int16_dot and k % LANES == 0:
        kernel = packed_kn_gemv_int16(FORMATS[fmt], n, k, scale_dtype, k_splits(n, k, threads, fmt))
    elif fmt == "q8" and byte_dot and n % Q8_TILE == 0 and FORMATS[fmt].group % 4 == 0:
        kernel = q8_kn_gemv_vnni(FORMATS[fmt], n, k, scale_dtype, k_splits(n, k, threads, fmt))
    elif fmt == "q8" and int16_dot and n % (2 * Q8_INT16_BLOCK) == 0 and FORMATS[fmt].group % 2 == 0:
        kernel = q8_kn_gemv_int16(FORMATS[fmt], n, k, scale_dtype, k_splits(n, k, threads, fmt))
    elif fmt == "q8":
        kernel = q8_kn_gemv(FORMATS[fmt], n, k, scale_dtype, k_splits(n, k, threads, fmt))
    else:
        kernel = packed_kn_gemv(FORMATS[fmt], n, k, scale_dtype)
    return substitute(func, kernel, order, "dequant-gemv-ternary" if fmt in PACKINGS else "dequant-gemv")


def packed_kn_gemv(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16") -> tirx.PrimFunc:
    """The kernel for out[1, 1, n] = x[1, 1, k] @ dequantize(codes [k / codes, n], scales [groups, n])."""
    vecs, tile, span = tiling(n)
    codes, bits = spec.codes, spec.bits
    words, groups, per_group = k // codes, -(-k // spec.group), spec.group // codes   # words per group
    top = 32 - bits                       # the top code is shifted down (masked it would be negative)
    mask = (1 << bits) - 1
    i64 = T.int64
    vf, vi, vu = f"float32x{LANES}", f"int32x{LANES}", f"uint32x{LANES}"

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(words), i64(n)), "uint32"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        xp = T.alloc_buffer((k,), "float32")        # x_k * 2^-(bits * i) for code i of its word, x_k for the top
        xs = T.alloc_buffer((groups,), "float32")   # offset * sum of x over each group
        for g in range(groups):
            xs[g] = T.float32(0)
            for j in range(T.min(spec.group, k - g * spec.group)):
                xs[g] = xs[g] + x[0, 0, g * spec.group + j]
            xs[g] = xs[g] * T.float32(spec.offset)
        for kw in range(words):
            for c in T.unroll(codes):
                xp[kw * codes + c] = x[0, 0, kw * codes + c] * T.Select(
                    c == codes - 1, T.float32(1),
                    T.Cast("float32", T.shift_left(T.int64(1), T.Cast("int64", top - bits * c))) * T.float32(2.0 ** -top))
        for task in T.parallel(n // span):
            acc = T.alloc_buffer((span,), "float32")
            part = T.alloc_buffer((2 * vecs,), vf)
            word = T.alloc_buffer((vecs,), vu)
            for j in T.vectorized(span):
                acc[j] = T.float32(0)
            for g in range(groups):
                for t in range(span // tile):
                    col: T.let[T.int32] = task * span + t * tile
                    for j in T.unroll(2 * vecs):
                        part[j] = T.Broadcast(T.float32(0), LANES)
                    for kw in range(T.min(per_group, words - g * per_group)):
                        for j in T.unroll(vecs):
                            word[j] = w[g * per_group + kw, T.Ramp(col + j * LANES, 1, LANES)]
                        for c in T.unroll(codes):
                            for j in T.unroll(vecs):
                                part[c % 2 * vecs + j] = part[c % 2 * vecs + j] + T.Cast(vf, T.Cast(vi, T.Select(
                                    c == codes - 1,
                                    T.shift_right(word[j], T.Broadcast(T.uint32(top), LANES)),
                                    T.bitwise_and(word[j], T.Broadcast(
                                        T.shift_left(T.uint32(mask), T.Cast("uint32", bits * c)), LANES))))) * T.Broadcast(
                                    xp[(g * per_group + kw) * codes + c], LANES)
                    for j in T.unroll(vecs):
                        acc[T.Ramp(t * tile + j * LANES, 1, LANES)] = acc[T.Ramp(t * tile + j * LANES, 1, LANES)] + T.Cast(
                            vf, s[g, T.Ramp(col + j * LANES, 1, LANES)]) * (
                            (part[j] + part[vecs + j]) * T.Broadcast(T.float32(spec.step), LANES)
                            - T.Broadcast(xs[g], LANES))
            for j in T.vectorized(span):
                out[0, 0, task * span + j] = acc[j]

    return gemv


def q8_kn_gemv(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16", splits: int = 1) -> tirx.PrimFunc:
    """The same walk for int8 codes [k, n] (value code * scale): sign-extend 8 codes, convert, FMA.
    `splits` > 1: K split into that many parts over all n outputs, partial sums added at the end (as in
    `packed_kn_gemv_int16`; 1.4x column spans at 2 threads on a 49152-wide lm_head)."""
    vecs, tile, span = tiling(n)
    if splits > 1:
        span = n
    group, groups = spec.group, k // spec.group
    col_tasks = n // span
    i64 = T.int64
    vf, vi, vc = f"float32x{LANES}", f"int32x{LANES}", f"int8x{LANES}"

    @T.macro
    def accumulate(w, s, x, partial, part, row, g, col, end):
        for j in T.unroll(2 * vecs):
            part[j] = T.Broadcast(T.float32(0), LANES)
        for kk in range(group // 2):
            for c in T.unroll(2):
                for j in T.unroll(vecs):
                    part[c * vecs + j] = part[c * vecs + j] + T.Cast(vf, T.Cast(vi, T.Cast(
                        vc, w[g * group + kk * 2 + c, T.Ramp(col + j * LANES, 1, LANES)]))) * T.Broadcast(
                        x[0, 0, g * group + kk * 2 + c], LANES)
        for j in T.unroll(vecs):
            partial[row, T.Ramp(col + j * LANES, 1, LANES)] = partial[row, T.Ramp(col + j * LANES, 1, LANES)] + T.Cast(
                vf, s[g, T.Ramp(col + j * LANES, 1, LANES)]) * (part[j] + part[vecs + j])

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(k), i64(n)), "int8"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        partial = T.alloc_buffer((splits, n), "float32")
        for task in T.parallel(splits * col_tasks):
            part = T.alloc_buffer((2 * vecs,), vf)
            split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate, (w, s, x, partial, part))
        sum_parts(out, partial, splits, n)

    return gemv


def q8_tiled_gemv(n: int, k: int, tile: int = 16, scale_dtype: str = "float16") -> tirx.PrimFunc:
    """The tiled q8 GEMV in fp32 for CPUs without AVX2's pmaddwd: per row pair, each of the tile's columns
    takes its two codes (converted) times x's two values, into fp32 sums per group that the scale multiplies.
    Same walk as `q8_tiled_gemv_int16` (contiguous tiles, column blocks split over the threads)."""
    group, groups = FORMATS["q8"].group, k // FORMATS["q8"].group
    i64 = T.int64

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(n // tile), i64(k // 2), i64(2 * tile)), "int8"),
             s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for b in T.parallel(n // tile):
            acc = T.alloc_buffer((tile,), "float32")
            part = T.alloc_buffer((tile,), "float32")
            for j in T.vectorized(tile):
                acc[j] = T.float32(0)
            for g in range(groups):
                for j in T.vectorized(tile):
                    part[j] = T.float32(0)
                for kk in range(group // 2):
                    for j in T.vectorized(tile):
                        part[j] = part[j] + T.Cast("float32", w[b, g * group // 2 + kk, 2 * j]) * x[
                            0, 0, g * group + 2 * kk] + T.Cast("float32", w[b, g * group // 2 + kk, 2 * j + 1]) * x[
                            0, 0, g * group + 2 * kk + 1]
                for j in T.vectorized(tile):
                    acc[j] = acc[j] + T.Cast("float32", s[g, b * tile + j]) * part[j]
            for j in T.vectorized(tile):
                out[0, 0, b * tile + j] = acc[j]

    return gemv


def packed_tiled_gemv(spec: PackedFormat, n: int, k: int, tile: int = 24, scale_dtype: str = "float16") -> tirx.PrimFunc:
    """The tiled q4 / t2 GEMV in fp32 for CPUs without AVX2's pmaddwd: the same walk as
    `packed_tiled_gemv_int16` (whole tiles per task, sums in registers over K), per code a mask, convert and
    FMA against x, per group out += s * (sum - offset * sum of the group's x)."""
    bits, group, codes = spec.bits, spec.group, spec.codes
    words, groups, per_group, vecs, tiles = tiled_dims(spec, n, k, tile)
    i64 = T.int64
    vu, vf, vi = f"uint32x{LANES}", f"float32x{LANES}", f"int32x{LANES}"

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(tiles), i64(words), i64(tile)), "uint32"),
             s: T.Buffer((i64(tiles), i64(groups), i64(tile)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        xs = T.alloc_buffer((groups,), "float32")   # offset * sum of x over each group
        for g in range(groups):
            xs[g] = T.float32(0)
            for j in range(T.min(group, k - g * group)):
                xs[g] = xs[g] + x[0, 0, g * group + j]
            xs[g] = xs[g] * T.float32(spec.offset)
        for t in T.parallel(tiles):
            part = T.alloc_buffer((vecs,), vf)
            word = T.alloc_buffer((vecs,), vu)
            acc = T.alloc_buffer((vecs,), vf)
            for j in T.unroll(vecs):
                acc[j] = T.Broadcast(T.float32(0), LANES)
            for g in range(groups):
                for j in T.unroll(vecs):
                    part[j] = T.Broadcast(T.float32(0), LANES)
                for kw in range(T.min(per_group, words - g * per_group)):
                    for j in T.unroll(vecs):
                        word[j] = w[t, g * per_group + kw, T.Ramp(j * LANES, 1, LANES)]
                    for c in T.unroll(codes):
                        for j in T.unroll(vecs):
                            part[j] = part[j] + T.Cast(vf, T.Cast(vi, T.bitwise_and(
                                T.shift_right(word[j], T.Broadcast(T.uint32(bits * c), LANES)),
                                T.Broadcast(T.uint32((1 << bits) - 1), LANES)))) * T.Broadcast(
                                x[0, 0, (g * per_group + kw) * codes + c], LANES)
                for j in T.unroll(vecs):
                    acc[j] = acc[j] + T.Cast(vf, s[t, g, T.Ramp(j * LANES, 1, LANES)]) * (
                        part[j] - T.Broadcast(xs[g], LANES))
            for j in T.unroll(vecs):
                out[0, 0, T.Ramp(t * tile + j * LANES, 1, LANES)] = acc[j]

    return gemv


# ----------------------------------------------------------------------------- float weights (q0f16 / q0f32)

FLOAT_NT_AHEAD = 8       # rows: each step prefetches the same columns of the rows this far ahead


def float_nt_gemv(n: int, k: int, weight_dtype: str = "float16") -> tirx.PrimFunc:
    """out[1, 1, n] = x[1, 1, k] @ w[n, k]^T with w widened to fp32 in registers. The dlight-style schedule
    (K in 16 partial sums by rfactor) streamed SmolLM2's f16 weights at 23-38 GB/s of the machine's ~47:
    NT rows are short (1-3 KB), so the hardware prefetchers kept restarting. Here 4 rows are read side by
    side into 8 register accumulators, and each step prefetches the same columns FLOAT_NT_AHEAD rows ahead:
    1.2-1.8x on those shapes with 160 MB of distinct weights (none from the L3). The tasks are blocks of 4
    rows, which TVM's pool hands out as one contiguous range per thread."""
    rows, chains, ahead = FLOAT_NT_ROWS, FLOAT_NT_CHAINS, FLOAT_NT_AHEAD
    step, blocks = LANES * chains, n // rows
    i64 = T.int64
    vf = f"float32x{LANES}"

    @T.prim_func(private=True)
    def gemv(x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), w: T.Buffer((i64(n), i64(k)), weight_dtype),
             out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        for b in T.parallel(blocks):
            acc = T.alloc_buffer((rows * chains,), vf)
            lanes = T.alloc_buffer((LANES,), "float32")
            for j in T.unroll(rows * chains):
                acc[j] = T.Broadcast(T.float32(0), LANES)
            for ko in range(k // step):
                for r in T.unroll(rows):
                    T.evaluate(prefetch_line(w[T.min(b * rows + ahead + r, n - 1), ko * step]))
                for c in T.unroll(chains):
                    for r in T.unroll(rows):
                        acc[r * chains + c] = acc[r * chains + c] + T.Cast(
                            vf, w[b * rows + r, T.Ramp(ko * step + c * LANES, 1, LANES)]) * x[
                            0, 0, T.Ramp(ko * step + c * LANES, 1, LANES)]
            for r in T.unroll(rows):
                for c in T.unroll(1, chains):
                    acc[r * chains] = acc[r * chains] + acc[r * chains + c]
                lanes[T.Ramp(0, 1, LANES)] = acc[r * chains]
                out[0, 0, b * rows + r] = T.float32(0)
                for j in T.unroll(LANES):
                    out[0, 0, b * rows + r] = out[0, 0, b * rows + r] + lanes[j]

    return gemv


def float_nt_gemv_like(func: tirx.PrimFunc, min_work: int = 0) -> tirx.PrimFunc | None:
    """`float_nt_gemv` with `func`'s parameter order and attributes, or None when `func` is not such a GEMV
    (`match_float_nt_gemv`)."""
    match = match_float_nt_gemv(func, min_work)
    if match is None:
        return None
    n, k, weight_dtype, order = match
    return substitute(func, float_nt_gemv(n, k, weight_dtype), order, "gemv", roles=("x", "w", "out"))
