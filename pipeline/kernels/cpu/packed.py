"""The packed weight formats as the CPU kernels see them, their register / task tilings, and the TIR
building blocks (split-K tasks, x's per-group quantization, prefetches) that the portable kernels (gemv.py)
and the x86 ones (x86.py) share: one place, so neither imports the other's dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

LANES = 8                      # fp32 lanes of an AVX2 register (two NEON registers on aarch64)
VECTORS_PER_TASK = (3, 2, 1)   # 24 output columns in registers when N allows (measured best), else 16 / 8
SPAN_MAX = 1024                # output columns per task: 4 KB of accumulators; 512-2048 measured alike
ROLES = ("codes", "scales", "x", "out")   # the kernel's own parameter order
OP_CLASS_ATTR = "pipeline.op_class"
FLOAT_NT_ROWS = 4        # float NT GEMV: output rows per step, 4 weight rows read side by side, 2 FMA chains each
FLOAT_NT_CHAINS = 2
SPLIT_K_MAX_N = 65536   # up to this many outputs a task's partial sums (256 KB) stay in L2: split K, not N
INT16_MAX = 32767.0   # x's steps in the int16 kernels: q = round(x * INT16_MAX / max|x|) per group
VNNI_Q_MAX = 32512.0     # 127 * 256 + 127: x's steps as two signed bytes (x86.packed_kn_gemv_bytes)


@dataclass(frozen=True)
class PackedFormat:
    block: str      # the fused TE's dequantize block (its name: models/layers.py gives it, fusion keeps it)
    bits: int       # per code; 32 // bits codes per uint32, code i at bits [bits * i, bits * (i + 1)); 8: int8
    group: int      # weights per scale along K
    offset: int     # value = (step * code - offset) * scale
    step: int = 1   # b1: a sign bit b stands for 2 b - 1
    per_word: int = 0   # codes per uint32 when they are no bit fields (t3: 20 in base 3, rows padded to whole words)

    @property
    def codes(self) -> int:
        return self.per_word or (1 if self.bits == 8 else 32 // self.bits)

    @property
    def code_dtype(self) -> str:
        return "int8" if self.bits == 8 else "uint32"



TILED_Q8 = "q8t"   # what `match_packed_kn_gemv` calls q8 codes stored tiled (quantize.tile_q8); FORMATS["q8"] otherwise
TILED_Q4 = "q4t"   # ... and q4 codes and scales stored tiled (quantize.tile_kn); FORMATS["q4"] otherwise
TILED_T2 = "t2t"   # ... and t2 codes and scales stored tiled the same way
TILED_PACKED = {TILED_Q4: "q4", TILED_T2: "t2"}
TILED_T3 = "t3t"   # what `match_packed_nk_gemv` calls NK t3 rows interleaved (targets' t3_interleave; arm_t3.py)
FORMATS = {"q4": PackedFormat("dequantize_kn", 4, 32, 7), "t2": PackedFormat("dequantize_t2_kn", 2, 128, 1),
           "q8": PackedFormat("dequantize_q8_kn", 8, 32, 0), "b1": PackedFormat("dequantize_b1_kn", 1, 128, 1, 2)}
# The same formats stored NK (MLC's plain layout: codes [N, K / codes], scales [N, groups]; android-cpu),
# their TE dequantize blocks named for that layout (models/layers.py).
NK_FORMATS = {"q4": PackedFormat("dequantize_nk", 4, 32, 7), "t2": PackedFormat("dequantize_t2_nk", 2, 128, 1),
              "q8": PackedFormat("dequantize_q8_nk", 8, 32, 0), "b1": PackedFormat("dequantize_b1_nk", 1, 128, 1, 2),
              "t3": PackedFormat("dequantize_t3_nk", 0, 128, 1, per_word=20)}   # bits 0: base 3 (arm_t3.py)


def substitute(func: tirx.PrimFunc, kernel: tirx.PrimFunc, order: tuple[str, ...], op_class: str,
               roles: tuple[str, ...] = ROLES) -> tirx.PrimFunc:
    """`kernel` (parameters in `roles` order) with `func`'s parameter order and attributes (its symbol, if
    any), so the substitute is built exactly as the original would be, and its op class declared (it has no
    blocks to read it from; coverage.classify honours it)."""
    params = [kernel.params[roles.index(role)] for role in order]
    return (tirx.PrimFunc(params, kernel.body, kernel.ret_type, func.attrs).with_attr("tirx.noalias", True)
            .with_attr(OP_CLASS_ATTR, op_class))


def column_span(n: int, tile: int) -> int:
    """Output columns per parallel task: the most tiles within SPAN_MAX that divide n into an even number of
    tasks (two threads split them evenly; an odd count, e.g. 3, leaves one thread a third of the work)."""
    tiles = n // tile
    fits = [t for t in range(1, tiles // 2 + 1) if tiles % t == 0 and t * tile <= SPAN_MAX]
    even = [t for t in fits if (tiles // t) % 2 == 0]
    return max(even or fits or [1]) * tile


def tiling(n: int) -> tuple[int, int, int]:
    """(vectors held in registers, their columns, columns per task) for n output columns."""
    vecs = next(v for v in VECTORS_PER_TASK if n % (v * LANES) == 0)
    return vecs, vecs * LANES, column_span(n, vecs * LANES)


def k_splits(n: int, k: int, threads: int, fmt: str = "q4") -> int:
    """Parts of K for `packed_kn_gemv_int16`: one per thread (each reads one contiguous block of rows, the
    layout's whole width, which the prefetchers stream; 1.2-1.5x column spans at 2 threads on SmolLM2's
    layer shapes and its 49152-wide lm_head, while more parts than threads measured slower), at most one
    per group; 1 (split the columns) for outputs too wide for a partial row in L2."""
    groups = -(-k // FORMATS[fmt].group)
    if n > SPLIT_K_MAX_N or threads < 2:
        return 1
    return min(threads, groups)


def q8_tile_of(codes_shape: tuple[int, ...], n: int, k: int) -> int:
    """The column tile of q8 codes stored tiled (`quantize.tile_q8`: [N / tile, K / 2, 2 tile]), or 0 when the
    shape is not that layout of an [K, N] weight."""
    if len(codes_shape) != 3 or codes_shape[2] % 2:
        return 0
    tile = codes_shape[2] // 2
    return tile if tile and n % tile == 0 and k % 2 == 0 and codes_shape[:2] == (n // tile, k // 2) else 0


def tiled_dims(spec: PackedFormat, n: int, k: int, tile: int) -> tuple[int, int, int, int, int]:
    """(words, groups, per_group, vecs, tiles) of a tiled q4 / t2 GEMV (`quantize.tile_kn`), after checking
    the shapes it needs."""
    assert spec.step == 1 and tile % LANES == 0 and n % tile == 0 and k % spec.codes == 0, (spec, n, k, tile)
    return k // spec.codes, -(-k // spec.group), spec.group // spec.codes, tile // LANES, n // tile


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
def split_task(out: T.Buffer, partial: T.Buffer, task, col_tasks: T.int32, span: T.int32, tile: T.int32,
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
def sum_parts(out: T.Buffer, partial: T.Buffer, splits: T.int32, n: T.int32):
    """After the tasks of a K split: out = the sum of the parts' rows of partial sums (none for column spans)."""
    if splits > 1:
        _copy_row(out, partial, 0, 0, n)
        for p in range(1, splits):
            _add_row(out, partial, p, n)


_FLOATS = f"float32x{LANES}"


@T.macro
def add_scaled(partial: T.Buffer, row: T.int32, col: T.int32, s: T.Buffer, g: T.int32, d: T.Buffer, sums):
    """partial[row, col: col + 8] += scale * x's step * a group's integer sums of those columns."""
    partial[row, T.Ramp(col, 1, LANES)] = partial[row, T.Ramp(col, 1, LANES)] + T.Cast(
        _FLOATS, s[g, T.Ramp(col, 1, LANES)]) * T.Broadcast(d[g], LANES) * T.Cast(_FLOATS, sums)


PREFETCH_MAX_AHEAD = 256 * 1024   # bytes: one group ahead farther than this is left to the hardware


def prefetches(group_bytes: int) -> bool:
    """Whether a kernel prefetches the next group's code rows (`prefetch_row`): not when a group of rows is
    wider than PREFETCH_MAX_AHEAD (the 49152-wide lm_heads: 0.8-1.5 MB ahead, evicted before use, 2x slower
    measured; their long rows stream well without it)."""
    return group_bytes <= PREFETCH_MAX_AHEAD


def prefetch_line(element):
    """A software prefetch of the cache line holding `element` (a buffer load) for reading, into all cache
    levels (llvm.prefetch: read, locality 3, data cache); it never faults and changes no result."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(element), T.int32(0), T.int32(3),
                              T.int32(1))


@T.macro
def prefetch_row(w: T.Buffer, row: T.int32, col: T.int32, rows: T.int32, n: T.int32, lines: T.int32,
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
def load_words(word: T.Buffer, w: T.Buffer, row, col, vecs: T.int32, prefetch, next_row, words: T.int32,
                n: T.int32):
    """word[j] = w[row, col + 8 j: col + 8 j + 8] for the tile's `vecs` vectors of code words; first, where
    `prefetch` holds (static False, or the task's next group exists), the same columns of `next_row`, the row
    one group further on (`prefetch_row`)."""
    if prefetch:
        prefetch_row(w, next_row, col, words, n, 2, 16)
    for j in T.unroll(vecs):
        word[j] = w[row, T.Ramp(col + j * LANES, 1, LANES)]


@T.macro
def quantize_groups(x: T.Buffer, q: T.Buffer, d: T.Buffer, offset: T.Buffer, lanes_f: T.Buffer, lanes_i: T.Buffer,
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

