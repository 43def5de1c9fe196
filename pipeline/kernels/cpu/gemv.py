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

Same result as the fused TE up to fp32 summation order (the integer kernels: up to x's int16 rounding). `CPUInlineParallel` substitutes this kernel for a
function that is exactly that fused pattern (`match_packed_kn_gemv`); anything else keeps the schedules.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import PACKINGS

LANES = 8                      # fp32 lanes of an AVX2 register (two NEON registers on aarch64)
VECTORS_PER_TASK = (3, 2, 1)   # 24 output columns in registers when N allows (measured best), else 16 / 8
SPAN_MAX = 1024                # output columns per task: 4 KB of accumulators; 512-2048 measured alike
ROLES = ("codes", "scales", "x", "out")   # the kernel's own parameter order
OP_CLASS_ATTR = "pipeline.op_class"


@dataclass(frozen=True)
class PackedFormat:
    block: str      # the fused TE's dequantize block
    bits: int       # per code; 32 // bits codes per uint32, code i at bits [bits * i, bits * (i + 1)); 8: int8
    group: int      # weights per scale along K
    offset: int     # value = (step * code - offset) * scale
    step: int = 1   # b1: a sign bit b stands for 2 b - 1

    @property
    def codes(self) -> int:
        return 1 if self.bits == 8 else 32 // self.bits

    @property
    def code_dtype(self) -> str:
        return "int8" if self.bits == 8 else "uint32"

    @property
    def pattern(self) -> str:   # how the fused function's dequantize expression prints
        if self.bits == 8:
            return ']) * T.Cast("float32", '
        return f'- T.float32({float(self.offset)})) * T.Cast("float32"'


TILED_Q8 = "q8t"   # what `match_packed_kn_gemv` calls q8 codes stored tiled (quantize.tile_q8); FORMATS["q8"] otherwise
TILED_Q4 = "q4t"   # ... and q4 codes and scales stored tiled (quantize.tile_kn); FORMATS["q4"] otherwise
TILED_T2 = "t2t"   # ... and t2 codes and scales stored tiled the same way
TILED_PACKED = {TILED_Q4: "q4", TILED_T2: "t2"}
FORMATS = {"q4": PackedFormat("dequantize_kn", 4, 32, 7), "t2": PackedFormat("dequantize_t2_kn", 2, 128, 1),
           "q8": PackedFormat("dequantize_q8_kn", 8, 32, 0), "b1": PackedFormat("dequantize_b1_kn", 1, 128, 1, 2)}


def match_packed_kn_gemv(func: tirx.PrimFunc, text: str | None = None, rows: str = "one"
                         ) -> tuple[str, int, int, str, tuple[str, ...]] | None:
    """(format, N, K, scale dtype, the role of each parameter in order) when `func` is a fused one-token KN
    GEMV of packed codes: blocks dequantize then matmul, tensors codes uint32 [K / codes per word, N],
    scales [groups, N], x float32 [1, 1, K] and out float32 [1, 1, N] (the last parameter, as in every
    function TE / relax fusion makes). rows="prompt": the same with a symbolic row count instead of 1
    (x [1, m, K], out [1, m, N]: a prefill). `text`: func.script(), when the caller has it. q8 codes tiled
    (quantize.tile_q8) are TILED_Q8; q4 / t2 codes and scales tiled (quantize.tile_kn, in two tiles or more)
    TILED_Q4 / TILED_T2."""
    text = text if text is not None else func.script()
    blocks = [b for b in re.findall(r'T\.sblock\("(\w+)"\)', text) if b != "root"]
    fmt = next((f for f, spec in FORMATS.items() if blocks == [spec.block, "matmul"]), None)
    if fmt is None or FORMATS[fmt].pattern not in text:
        return None
    spec = FORMATS[fmt]
    params = list(func.params)   # tensor parameters carry shape and dtype
    if len(params) != 4:
        return None
    shapes, row_vars = [], []
    for p in params:
        dims = []
        for i, d in enumerate(p.shape):
            if isinstance(d, tirx.IntImm):
                dims.append(int(d))
            elif rows == "prompt" and i == 1 and isinstance(d, tirx.Var) and len(p.shape) == 3:
                dims.append(1)             # the prompt's rows: one symbolic variable shared by x and out
                row_vars.append(d)
            else:
                return None
        shapes.append(tuple(dims))
    if rows == "prompt" and (len(row_vars) != 2 or not row_vars[0].same_as(row_vars[1])):
        return None             # x and out both [1, m, .] over the same m
    dtypes = [str(p.dtype) for p in params]
    out = shapes[-1]
    if dtypes[-1] != "float32" or len(out) != 3 or out[:2] != (1, 1):
        return None
    n = out[2]
    roles = []
    tiled_packed = fmt in TILED_PACKED.values()   # q4 / t2 codes + scales may be tiled (3-d)
    for shape, dtype in zip(shapes[:-1], dtypes[:-1], strict=True):
        if dtype == spec.code_dtype and (len(shape) == 2 or ((spec.bits == 8 or tiled_packed) and len(shape) == 3)):
            roles.append("codes")      # 3-d: q8 codes tiled (quantize.tile_q8) or q4 / t2 (quantize.tile_kn)
        elif dtype == "float32" and len(shape) == 3 and shape[:2] == (1, 1):
            roles.append("x")
        elif dtype in ("float16", "float32") and (len(shape) == 2 or (tiled_packed and len(shape) == 3)):
            roles.append("scales")
        else:
            return None
    if sorted(roles) != sorted(ROLES[:3]):
        return None
    by_role = dict(zip(roles, shapes[:-1], strict=True))
    k = by_role["x"][2]
    groups = -(-k // spec.group)
    if len(by_role["codes"]) == 3 and tiled_packed:
        tile = by_role["codes"][2]
        if (n % tile or tile % LANES or n // tile < 2 or by_role["codes"] != (n // tile, k // spec.codes, tile)
                or by_role["scales"] != (n // tile, groups, tile) or k % LANES):
            return None
        return next(t for t, f in TILED_PACKED.items() if f == fmt), n, k, dtypes[roles.index("scales")], (*roles, "out")
    if len(by_role["codes"]) == 3:
        if not q8_tile_of(by_role["codes"], n, k) or by_role["scales"] != (groups, n):
            return None
        return TILED_Q8, n, k, dtypes[roles.index("scales")], (*roles, "out")
    if k % spec.codes or n % LANES or by_role["codes"] != (k // spec.codes, n) or by_role["scales"] != (groups, n):
        return None
    return fmt, n, k, dtypes[roles.index("scales")], (*roles, "out")


def packed_kn_gemv_like(func: tirx.PrimFunc, text: str | None = None, int16_dot: bool = False,
                        threads: int = 1, byte_dot: bool = False, prefetch_bytes: int = 0) -> tirx.PrimFunc | None:
    """The hand-written kernel with `func`'s parameter order, or None when `func` is not such a GEMV.
    `int16_dot`: the target has AVX2's pmaddwd (q4 / t2 then take `packed_kn_gemv_int16`, q8
    `q8_kn_gemv_int16`); `byte_dot`: it
    has AVX-512 VNNI's vpdpbusd on 256-bit vectors (then `packed_kn_gemv_bytes`, q8 `q8_kn_gemv_vnni`). `threads`: the
    threads the library runs with when known (host-cpu: `build_threads`), K split that many ways (int16 and
    q8 kernels); 1 keeps column spans (a cross-compiled target: the phone's thread count is not known).
    `prefetch_bytes`: the tiled q4 / t2 int16 kernel's software prefetch distance (`native_prefetch_bytes`)."""
    match = match_packed_kn_gemv(func, text)
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


def substitute(func: tirx.PrimFunc, kernel: tirx.PrimFunc, order: tuple[str, ...], op_class: str,
               roles: tuple[str, ...] = ROLES) -> tirx.PrimFunc:
    """`kernel` (parameters in `roles` order) with `func`'s parameter order and attributes (its symbol, if
    any), so the substitute is built exactly as the original would be, and its op class declared (it has no
    blocks to read it from; coverage.classify honours it)."""
    params = [kernel.params[roles.index(role)] for role in order]
    return (tirx.PrimFunc(params, kernel.body, kernel.ret_type, func.attrs).with_attr("tirx.noalias", True)
            .with_attr(OP_CLASS_ATTR, op_class))


def _span(n: int, tile: int) -> int:
    """Output columns per parallel task: the most tiles within SPAN_MAX that divide n into an even number of
    tasks (two threads split them evenly; an odd count, e.g. 3, leaves one thread a third of the work)."""
    tiles = n // tile
    fits = [t for t in range(1, tiles // 2 + 1) if tiles % t == 0 and t * tile <= SPAN_MAX]
    even = [t for t in fits if (tiles // t) % 2 == 0]
    return max(even or fits or [1]) * tile


def _tiling(n: int) -> tuple[int, int, int]:
    """(vectors held in registers, their columns, columns per task) for n output columns."""
    vecs = next(v for v in VECTORS_PER_TASK if n % (v * LANES) == 0)
    return vecs, vecs * LANES, _span(n, vecs * LANES)


def packed_kn_gemv(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16") -> tirx.PrimFunc:
    """The kernel for out[1, 1, n] = x[1, 1, k] @ dequantize(codes [k / codes, n], scales [groups, n])."""
    vecs, tile, span = _tiling(n)
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


@T.macro
def _zero_row(partial: T.Buffer, row: T.int32, start: T.int32, length: T.int32):
    """partial[row, start:start + length] = 0, LANES at a time (one length-wide vector crashed LLVM)."""
    for jo in range(length // LANES):
        for ji in T.vectorized(LANES):
            partial[row, start + jo * LANES + ji] = T.float32(0)


@T.macro
def _copy_row(out: T.Buffer, partial: T.Buffer, row: T.int32, start: T.int32, length: T.int32):
    """out[0, 0, start:start + length] = partial[row, start:start + length]."""
    for jo in range(length // LANES):
        for ji in T.vectorized(LANES):
            out[0, 0, start + jo * LANES + ji] = partial[row, start + jo * LANES + ji]


@T.macro
def _add_row(out: T.Buffer, partial: T.Buffer, row: T.int32, length: T.int32):
    """out[0, 0, :length] += partial[row, :length]: one K part's sums into the result."""
    for jo in range(length // LANES):
        for ji in T.vectorized(LANES):
            out[0, 0, jo * LANES + ji] = out[0, 0, jo * LANES + ji] + partial[row, jo * LANES + ji]


@T.macro
def _split_task(out: T.Buffer, partial: T.Buffer, task, col_tasks: T.int32, span: T.int32, tile: T.int32,
                groups: T.int32, splits: T.int32, accumulate, buffers: tuple):
    """One parallel task of a split GEMV: with `splits` > 1 part task // col_tasks of K's groups over all
    outputs (span = n, col_tasks = 1), else its own column span over all of K. Zeroes its row of partial
    sums, then per group g of its part and per `tile` columns calls `accumulate(*buffers, row, g, col, end)`
    (the kernel's own macro: adds the group's sums into partial[row, col: col + tile]; `buffers`: the ones
    it reads and writes, the task's own scratch included; end: the part's last group + 1, for prefetching);
    a column span's sums are its outputs at once."""
    _zero_row(partial, task // col_tasks, task % col_tasks * span, span)
    for g in range(task // col_tasks * groups // splits, (task // col_tasks + 1) * groups // splits):
        for t in range(span // tile):
            col: T.let[T.int32] = task % col_tasks * span + t * tile
            accumulate(*buffers, task // col_tasks, g, col, (task // col_tasks + 1) * groups // splits)
    if splits == 1:     # static: the columns' own sums are the result
        _copy_row(out, partial, 0, task * span, span)


@T.macro
def _sum_parts(out: T.Buffer, partial: T.Buffer, splits: T.int32, n: T.int32):
    """After the tasks of a K split: out = the sum of the parts' rows of partial sums (none for column spans)."""
    if splits > 1:
        _copy_row(out, partial, 0, 0, n)
        for p in range(1, splits):
            _add_row(out, partial, p, n)


_FLOATS = f"float32x{LANES}"


@T.macro
def _add_scaled(partial: T.Buffer, row: T.int32, col: T.int32, s: T.Buffer, g: T.int32, d: T.Buffer, sums):
    """partial[row, col: col + 8] += scale * x's step * a group's integer sums of those columns."""
    partial[row, T.Ramp(col, 1, LANES)] = partial[row, T.Ramp(col, 1, LANES)] + T.Cast(
        _FLOATS, s[g, T.Ramp(col, 1, LANES)]) * T.Broadcast(d[g], LANES) * T.Cast(_FLOATS, sums)


PREFETCH_MAX_AHEAD = 256 * 1024   # bytes: one group ahead farther than this is left to the hardware


def _prefetches(group_bytes: int) -> bool:
    """Whether a kernel prefetches the next group's code rows (`_prefetch_row`): not when a group of rows is
    wider than PREFETCH_MAX_AHEAD (the 49152-wide lm_heads: 0.8-1.5 MB ahead, evicted before use, 2x slower
    measured; their long rows stream well without it)."""
    return group_bytes <= PREFETCH_MAX_AHEAD


def prefetch_line(element):
    """A software prefetch of the cache line holding `element` (a buffer load) for reading, into all cache
    levels (llvm.prefetch: read, locality 3, data cache); it never faults and changes no result."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(element), T.int32(0), T.int32(3),
                              T.int32(1))


@T.macro
def _prefetch_row(w: T.Buffer, row: T.int32, col: T.int32, rows: T.int32, n: T.int32, lines: T.int32,
                  per_line: T.int32):
    """Software prefetch of `lines` cache lines (`per_line` elements each) of w[row, col:], clamped into the
    buffer, into all cache levels. The integer GEMVs walk a group's few code rows side by side, a tile's
    bytes of each at a time: with the weights not in cache the loads and the arithmetic hardly overlapped
    (cold time ~ hot time + bytes / bandwidth), and fetching the next group's rows while this group's are
    summed measured 1.1-1.8x per GEMV on SmolLM2's shapes (160 MB of distinct weights, none from the L3;
    VNNI and int16 kernels, q4 / t2 / b1 / q8), decode 1.07-1.22x side by side (q4f16, ternary_ptq)."""
    for j in T.unroll(lines):
        T.evaluate(prefetch_line(w[T.min(row, rows - 1), T.min(col + j * per_line, n - 1)]))


@T.macro
def _load_words(word: T.Buffer, w: T.Buffer, row, col, vecs: T.int32, prefetch, next_row, words: T.int32,
                n: T.int32):
    """word[j] = w[row, col + 8 j: col + 8 j + 8] for the tile's `vecs` vectors of code words; first, where
    `prefetch` holds (static False, or the task's next group exists), the same columns of `next_row`, the row
    one group further on (`_prefetch_row`)."""
    if prefetch:
        _prefetch_row(w, next_row, col, words, n, 2, 16)
    for j in T.unroll(vecs):
        word[j] = w[row, T.Ramp(col + j * LANES, 1, LANES)]


@T.macro
def _quantize_groups(x: T.Buffer, q: T.Buffer, d: T.Buffer, offset: T.Buffer, lanes_f: T.Buffer, lanes_i: T.Buffer,
                     group: T.int32, k: T.int32, q_max: T.float32, code_offset: T.int32):
    """x [1, 1, k] in integer steps of its group of `group` (the last one may be shorter): q = round(x * q_max /
    max|x|), d = the step max|x| / q_max, offset = code_offset * sum(q); lanes_f / lanes_i: LANES scratch."""
    for g in range((k + group - 1) // group):
        lanes_f[T.Ramp(0, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
        lanes_i[T.Ramp(0, 1, LANES)] = T.Broadcast(0, LANES)
        for v in range(T.min(group, k - g * group) // LANES):
            lanes_f[T.Ramp(0, 1, LANES)] = T.max(lanes_f[T.Ramp(0, 1, LANES)],
                                                 T.fabs(x[0, 0, T.Ramp(g * group + v * LANES, 1, LANES)]))
        d[g] = lanes_f[0]
        for j in range(1, LANES):
            d[g] = T.max(d[g], lanes_f[j])
        for v in range(T.min(group, k - g * group) // LANES):
            for j in T.vectorized(LANES):
                q[g * group + v * LANES + j] = T.Cast("int32", T.round(x[0, 0, g * group + v * LANES + j] * T.if_then_else(
                    d[g] > T.float32(0), q_max / d[g], T.float32(0))))
            lanes_i[T.Ramp(0, 1, LANES)] = lanes_i[T.Ramp(0, 1, LANES)] + q[T.Ramp(g * group + v * LANES, 1, LANES)]
        offset[g] = lanes_i[0]
        for j in range(1, LANES):
            offset[g] = offset[g] + lanes_i[j]
        offset[g] = offset[g] * code_offset
        d[g] = d[g] * T.float32(1.0 / q_max)


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


def q8_kn_gemv(spec: PackedFormat, n: int, k: int, scale_dtype: str = "float16", splits: int = 1) -> tirx.PrimFunc:
    """The same walk for int8 codes [k, n] (value code * scale): sign-extend 8 codes, convert, FMA.
    `splits` > 1: K split into that many parts over all n outputs, partial sums added at the end (as in
    `packed_kn_gemv_int16`; 1.4x column spans at 2 threads on a 49152-wide lm_head)."""
    vecs, tile, span = _tiling(n)
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
            _split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate, (w, s, x, partial, part))
        _sum_parts(out, partial, splits, n)

    return gemv


INT16_MAX = 32767.0   # x's steps in the int16 kernels: q = round(x * INT16_MAX / max|x|) per group


@T.macro
def _q8_x_pairs(x: T.Buffer, q: T.Buffer, pairs: T.Buffer, d: T.Buffer, offset: T.Buffer, lanes_f: T.Buffer,
                lanes_i: T.Buffer, group: T.int32, k: T.int32):
    """x quantized per group to int16 (`_quantize_groups`; q8 codes have no offset: 0 there), then the
    consecutive pairs pmaddwd takes against a column's codes for rows 2i, 2i + 1: pairs[i] = int16 q[2 i] |
    q[2 i + 1] << 16 (8 lanes at a time: one k // 2-lane vector took LLVM minutes)."""
    _quantize_groups(x, q, d, offset, lanes_f, lanes_i, group, k, INT16_MAX, 0)
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
    span = n if splits > 1 else _span(n, tile)
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
                _prefetch_row(w, g * group + 2 * kk, col + ahead, k, n, 1, 64)
                _prefetch_row(w, g * group + 2 * kk + 1, col + ahead, k, n, 1, 64)
            for b in T.unroll(blocks):    # the block's columns 0-7, then 8-15
                pair_dot(part, 2 * b, w, g * group + 2 * kk, col + b * Q8_INT16_BLOCK, pairs[g * group // 2 + kk], _PAIR_LO)
                pair_dot(part, 2 * b + 1, w, g * group + 2 * kk, col + b * Q8_INT16_BLOCK, pairs[g * group // 2 + kk],
                         _PAIR_HI)
        for j in T.unroll(2 * blocks):
            _add_scaled(partial, row, col + j * LANES, s, g, d, part[j])

    @T.prim_func(private=True)
    def gemv(w: T.Buffer((i64(k), i64(n)), "int8"), s: T.Buffer((i64(groups), i64(n)), scale_dtype),
             x: T.Buffer((i64(1), i64(1), i64(k)), "float32"), out: T.Buffer((i64(1), i64(1), i64(n)), "float32")):
        T.func_attr({"tirx.noalias": True})
        q = T.alloc_buffer((k,), "int32")            # x in int16 steps of its group
        pairs = T.alloc_buffer((k // 2,), "int32")   # int16 q[2 i] | q[2 i + 1] << 16
        d = T.alloc_buffer((groups,), "float32")
        offset = T.alloc_buffer((groups,), "int32")  # `_quantize_groups` writes 0 there: q8 codes have no offset
        partial = T.alloc_buffer((splits, n), "float32")
        lanes_f = T.alloc_buffer((LANES,), "float32")
        lanes_i = T.alloc_buffer((LANES,), "int32")
        _q8_x_pairs(x, q, pairs, d, offset, lanes_f, lanes_i, group, k)
        for task in T.parallel(splits * col_tasks):
            part = T.alloc_buffer((2 * blocks,), vi)
            _split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate,
                        (w, s, pairs, d, partial, part))
        _sum_parts(out, partial, splits, n)

    return gemv


Q8_TILED_BLOCKS = (3, 2, 1)   # column tiles per step of the tiled q8 kernels (48 columns in registers if N allows)


def q8_tile_of(codes_shape: tuple[int, ...], n: int, k: int) -> int:
    """The column tile of q8 codes stored tiled (`quantize.tile_q8`: [N / tile, K / 2, 2 tile]), or 0 when the
    shape is not that layout of an [K, N] weight."""
    if len(codes_shape) != 3 or codes_shape[2] % 2:
        return 0
    tile = codes_shape[2] // 2
    return tile if tile and n % tile == 0 and k % 2 == 0 and codes_shape[:2] == (n // tile, k // 2) else 0


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
        offset = T.alloc_buffer((groups,), "int32")  # `_quantize_groups` writes 0 there: q8 codes have no offset
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


SPLIT_K_MAX_N = 65536   # up to this many outputs a task's partial sums (256 KB) stay in L2: split K, not N
INT16_FORMATS = ("q4", "t2")   # packed_kn_gemv_int16 (decode t2 on AVX2 takes AVX2_BYTE_FORMATS' kernel first)
VNNI_FORMATS = ("q4", "t2", "b1")
# AVX2 without VNNI: packed_kn_gemv_bytes(dot="avx2") (pmaddubsw). Not q4: 1.0-1.06x the pmaddwd kernel per GEMV
# on Zen 3 and no decode difference outside the machine's noise (0.94-1.13x side by side, either way).
AVX2_BYTE_FORMATS = ("t2", "b1")
VNNI_Q_MAX = 32512.0     # 127 * 256 + 127: x's steps as two signed bytes (packed_kn_gemv_bytes)


def build_threads() -> int:
    """The threads a host-cpu library will run with: TVM_NUM_THREADS, else the CPUs this process may use
    (TVM's own default). Part of the build key (stages.build), since `k_splits` depends on it."""
    env = os.environ.get("TVM_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))


def native_threads(target) -> int | None:
    """`build_threads()` for a library built for this computer (an LLVM target without a foreign triple),
    else None: a cross-compiled library's thread count is the phone's, not known here."""
    if target is None or "llvm" not in str(target.kind):
        return None
    triple = str(target.attrs.get("mtriple", "") or "")
    return build_threads() if not triple or triple.startswith(platform.machine()) else None


# How far ahead (bytes of a thread's code stream) the tiled q4 / t2 GEMV prefetches, by the CPU's vendor; 0 or
# absent: no software prefetch. Intel: measured on a Xeon with AMX and a 480 MiB L3 (one core streams ~11 GB/s,
# latency-bound), decode side by side against the same code without it, same tokens: the 0.49B Qwen3's q4f16
# 2.41x, ternary_ptq 3.11x, SmolLM2 q4f16 1.22x; against 1.9 KB ahead, 1 KB 0.89x, 3 KB 1.07x, 4.6-12 KB 1.11x (a
# plateau). AMD: a software prefetch of the same stream measured 0.73-0.98x per GEMV on a Zen 4 EPYC (2026-12-05,
# an earlier form, not this one), so none there until measured.
GEMV_PREFETCH_BYTES = {"GenuineIntel": 6144}


@functools.cache
def cpu_vendor() -> str:
    """This machine's CPU vendor as /proc/cpuinfo names it (e.g. GenuineIntel, AuthenticAMD); "" unknown.
    Read once per process: the schedule rule asks for every function of a build."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def native_prefetch_bytes(target) -> int:
    """`GEMV_PREFETCH_BYTES` of this machine's CPU for a library built for this computer (an x86 LLVM
    target without a foreign triple), else 0 (a cross-compiled library's CPU is not known here)."""
    if native_threads(target) is None:
        return 0
    return GEMV_PREFETCH_BYTES.get(cpu_vendor(), 0)


def k_splits(n: int, k: int, threads: int, fmt: str = "q4") -> int:
    """Parts of K for `packed_kn_gemv_int16`: one per thread (each reads one contiguous block of rows, the
    layout's whole width, which the prefetchers stream; 1.2-1.5x column spans at 2 threads on SmolLM2's
    layer shapes and its 49152-wide lm_head, while more parts than threads measured slower), at most one
    per group; 1 (split the columns) for outputs too wide for a partial row in L2."""
    groups = -(-k // FORMATS[fmt].group)
    if n > SPLIT_K_MAX_N or threads < 2:
        return 1
    return min(threads, groups)


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
    """x quantized per group to int16 (`_quantize_groups`), then per word of `codes` codes and c < codes / 2
    the pair pmaddwd takes against codes c and c + codes / 2 of a lane: pairs = int16 q[C w + c] |
    q[C w + c + C/2] << 16 (the q4 / t2 int16 GEMVs, KN and tiled)."""
    _quantize_groups(x, q, d, offset, lanes_f, lanes_i, group, k, INT16_MAX, code_offset)
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
    vecs, tile, span = _tiling(n)
    if splits > 1:
        span = n
    bits, group, codes = spec.bits, spec.group, spec.codes
    half = codes // 2
    words, groups, per_group = k // codes, -(-k // group), group // codes
    mask = ((1 << bits) - 1) * 0x00010001          # one code in each int16 half of a lane
    col_tasks = n // span
    prefetch = _prefetches(per_group * n * 4)
    i64 = T.int64
    vi, vu = f"int32x{LANES}", f"uint32x{LANES}"

    @T.macro
    def accumulate(w, s, pairs, d, offset, partial, part, high, word, row, g, col, end):
        for j in T.unroll(vecs):
            part[j] = T.Broadcast(0, LANES)
            high[j] = T.Broadcast(0, LANES)
        for kw in range(T.min(per_group, words - g * per_group)):
            _load_words(word, w, g * per_group + kw, col, vecs, prefetch and g + 1 < end, (g + 1) * per_group + kw,
                        words, n)
            for c2 in T.unroll(half // 2):
                for j in T.unroll(vecs):
                    _masked_dot(part, j, word[j], 2 * bits * c2, mask, pairs[(g * per_group + kw) * half + 2 * c2])
                    _masked_dot(high, j, word[j], 2 * bits * c2, mask << bits,
                               pairs[(g * per_group + kw) * half + 2 * c2 + 1])
        for j in T.unroll(vecs):
            _add_scaled(partial, row, col + j * LANES, s, g, d, part[j] + T.shift_right(
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
            _split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate,
                        (w, s, pairs, d, offset, partial, part, high, word))
        _sum_parts(out, partial, splits, n)

    return gemv




def _tiled_dims(spec: PackedFormat, n: int, k: int, tile: int) -> tuple[int, int, int, int, int]:
    """(words, groups, per_group, vecs, tiles) of a tiled q4 / t2 GEMV (`quantize.tile_kn`), after checking
    the shapes it needs."""
    assert spec.step == 1 and tile % LANES == 0 and n % tile == 0 and k % spec.codes == 0, (spec, n, k, tile)
    return k // spec.codes, -(-k // spec.group), spec.group // spec.codes, tile // LANES, n // tile


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
    words, groups, per_group, vecs, tiles = _tiled_dims(spec, n, k, tile)
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


def packed_tiled_gemv(spec: PackedFormat, n: int, k: int, tile: int = 24, scale_dtype: str = "float16") -> tirx.PrimFunc:
    """The tiled q4 / t2 GEMV in fp32 for CPUs without AVX2's pmaddwd: the same walk as
    `packed_tiled_gemv_int16` (whole tiles per task, sums in registers over K), per code a mask, convert and
    FMA against x, per group out += s * (sum - offset * sum of the group's x)."""
    bits, group, codes = spec.bits, spec.group, spec.codes
    words, groups, per_group, vecs, tiles = _tiled_dims(spec, n, k, tile)
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
    vecs, tile, span = _tiling(n)
    if splits > 1:
        span = n
    bits, group, codes = spec.bits, spec.group, spec.codes
    shifts = codes // 4                           # after shift c, byte b of a lane holds code b * shifts + c
    words, groups, per_group = k // codes, -(-k // group), group // codes
    mask = ((1 << bits) - 1) * 0x01010101          # one code in each byte of a lane
    col_tasks = n // span
    prefetch = _prefetches(per_group * n * 4)
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
            _load_words(word, w, g * per_group + kw, col, vecs, prefetch and g + 1 < end, (g + 1) * per_group + kw,
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
            _add_scaled(partial, row, col + j * LANES, s, g, d, (widened(part[j]) * T.Broadcast(256, LANES)
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
        _quantize_groups(x, q, d, offset, lanes_f, lanes_i, group, k, VNNI_Q_MAX, spec.offset)
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
            _split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate,
                        (w, s, quads, d, offset, partial, part, word))
        _sum_parts(out, partial, splits, n)

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
    span = n if splits > 1 else _span(n, tile)
    group, groups = spec.group, k // spec.group
    quads_n = k // 4
    col_tasks = n // span
    prefetch = _prefetches(group * n)
    i64 = T.int64
    vi, vb = f"int32x{LANES}", f"int8x{4 * LANES}"

    @T.macro
    def accumulate(w, s, quads, d, offset, partial, part, codes, pairs, sums, row, g, col, end):
        for j in T.unroll(8):
            part[j] = T.Broadcast(0, LANES)
        for m in range(group // 4):
            if prefetch and g + 1 < end:
                for r in T.unroll(4):
                    _prefetch_row(w, (g + 1) * group + m * 4 + r, col, k, n, 1, 64)
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
        _quantize_groups(x, q, d, offset, lanes_f, lanes_i, group, k, VNNI_Q_MAX, 128)
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
            _split_task(out, partial, task, col_tasks, span, tile, groups, splits, accumulate,
                        (w, s, quads, d, offset, partial, part, codes, pairs, sums))
        _sum_parts(out, partial, splits, n)

    return gemv


@T.macro
def _add_group(partial: T.Buffer, row: T.int32, col: T.int32, s: T.Buffer, g: T.int32, d: T.Buffer,
               first, second, halves: list):
    """partial[row, col: col + 8] += scale * step * the group's integer sums of those 8 columns, which are
    the `halves` (`_LANE_HALVES`) of two of `_interleave`'s vectors."""
    _add_scaled(partial, row, col, s, g, d, T.Shuffle([first, second], halves))


# ----------------------------------------------------------------------------- float weights (q0f16 / q0f32)

FLOAT_NT_ROWS = 4        # output rows per step: 4 weight rows read side by side, 2 FMA chains each
FLOAT_NT_CHAINS = 2
FLOAT_NT_AHEAD = 8       # rows: each step prefetches the same columns of the rows this far ahead
_NT_CAST = re.compile(r'^\s*(\w+)\[(\w+), (\w+)\] = (?:T\.Cast\("float32", )?(\w+)\[\2, \3\]\)?$', re.M)  # or a copy
_NT_MATMUL = re.compile(r'(\w+)\[(\w+), (\w+), (\w+)\] = \1\[\2, \3, \4\] \+ (\w+)\[\2, \3, (\w+)\] \* (\w+)\[\4, \6\]')


def match_float_nt_gemv(func: tirx.PrimFunc, text: str | None = None, min_work: int = 0
                        ) -> tuple[int, int, str, tuple[str, ...]] | None:
    """(N, K, weight dtype, each parameter's role) when `func` is exactly a one-token NT matmul of float
    weights, out[0, 0, n] = sum_k x[0, 0, k] * float32(w[n, k]), the widening in its own block or none
    (q0f16 / q0f32 decode as relax fuses it: x float32 [1, 1, K], w float16 / float32 [N, K], out float32
    [1, 1, N], out last) of at least `min_work` multiply-adds; None for anything else (a bias or residual
    epilogue included)."""
    text = text if text is not None else func.script()
    blocks = [b for b in re.findall(r'T\.sblock\("(\w+)"\)', text) if b != "root"]
    matmul = _NT_MATMUL.findall(text)
    if len(blocks) not in (1, 2) or len(matmul) != 1 or 'T.axis.remap("SSSR"' not in text or "T.init()" not in text:
        return None
    out_name, *_, x_name, _, w_name = matmul[0]
    params = list(func.params)
    if len(params) != 3 or any(not all(isinstance(d, tirx.IntImm) for d in p.shape) for p in params):
        return None
    names = [p.name for p in params]
    if len(blocks) == 2:   # the widening block: w_name is its output, cast from a parameter
        cast = _NT_CAST.findall(text)
        if len(cast) != 1 or cast[0][0] != w_name:
            return None
        w_name = cast[0][3]
    if sorted(names[:2]) != sorted([x_name, w_name]) or out_name != names[2]:
        return None
    shapes = {p.name: tuple(int(d) for d in p.shape) for p in params}
    dtypes = {p.name: str(p.dtype) for p in params}
    if len(shapes[w_name]) != 2:
        return None
    n, k = shapes[w_name]
    if (dtypes[x_name], dtypes[names[2]]) != ("float32", "float32") or dtypes[w_name] not in ("float16", "float32"):
        return None
    if shapes[x_name] != (1, 1, k) or shapes[names[2]] != (1, 1, n) or n * k < min_work:
        return None
    if n % FLOAT_NT_ROWS or k % (FLOAT_NT_CHAINS * LANES):
        return None
    return n, k, dtypes[w_name], tuple("x" if nm == x_name else "w" for nm in names[:2]) + ("out",)


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


def float_nt_gemv_like(func: tirx.PrimFunc, text: str | None = None, min_work: int = 0) -> tirx.PrimFunc | None:
    """`float_nt_gemv` with `func`'s parameter order and attributes, or None when `func` is not such a GEMV
    (`match_float_nt_gemv`)."""
    match = match_float_nt_gemv(func, text, min_work)
    if match is None:
        return None
    n, k, weight_dtype, order = match
    return substitute(func, float_nt_gemv(n, k, weight_dtype), order, "gemv", roles=("x", "w", "out"))
