"""Parallel, vectorized CPU attention kernels for the paged KV cache, in place of TVM's serial ones.

TVM 0.27's KV cache gives LLVM targets its `*_cpu` attention kernels: one thread, scalar loops, and a
rotary-mode select evaluated per element. On SmolLM2-135M they are most of a prefill (a 512-token prompt
spends ~9 G scalar multiply-adds in attention across 30 layers) and a growing share of every decode step.
The kernels here compute the same thing with the same names, signatures and outputs, so the runtime's KV
cache calls them unchanged:

* prefill: every pair of consecutive query rows of a head is an independent task of a parallel loop,
  sharing each K / V row load (`_row_block`); decode: every (KV head, part of the pages), all the query
  heads of that KV head together (GQA), the parts' softmax states merged at the end (`paged_decode`);
* keys are taken in tiles of TILE: the tile's scores (dot products split into LANES vector partial sums,
  since LLVM will not reorder a float reduction itself), one rescale of the running output per tile
  (online softmax, base 2 like TVM's: scores carry log2(e) * sm_scale), then the tile's weighted values
  added to the output vector one LANES-wide chunk at a time (a loop over the chunks, the tile's keys unrolled
  inside: the rows' sums of one chunk stay in registers; holding all of them spilled on NEON: the V loop had
  a load and a store per multiply-add). Counted under qemu-aarch64 (SmolLM2's heads, a 128-token causal
  prompt): 1.11 -> 0.92 instructions per multiply-add; the same sums in the same order (x86 output
  bit-identical, 512 tokens 28.4 -> 26.0 ms here). The decode kernel likewise (its keys past a page's valid
  slots read the last valid one at weight 0): 129 keys 1.05 -> 0.84 (155 k -> 124 k instructions per layer
  call), x86 bit-identical, 4 sequences of 17-700 keys 300 -> 264 us. A tile's max and its weights' sum
  are reduced across vector lanes (`fast_math.lanes_reduce`) instead of by a scalar loop over the 16 keys:
  prefill 0.92 -> 0.82, decode 124 k -> 116 k (x86 outputs within 5e-7; the sum's order changed);
* the weights 2^(s - max) of a tile come from a polynomial exp2 that vectorizes (`_exp2`; LLVM turns
  `exp2` into one libm call per lane);
* prefill tasks are head-major: with TVM's static split of a parallel loop into one contiguous range
  per thread, row-major tasks gave one thread the short early causal rows and the other the long late
  ones (1.8x faster at 512 tokens together with the vector exp2);
* the output is the normalised sum and lse = max + log2(sum), as TVM's kernels return them for the
  attention-state merge.

The KV append (`tir_kv_cache_transpose_append`) and the attention-state merge are replaced too: TVM's
allocate per element / run serially (below).

They need rotary_mode 0 (RoPE applied when K/Q are written, RopeMode.NORMAL: every model here) and
head dims that are a multiple of LANES; other cases keep TVM's kernels (see `replace_cpu_attention`).
A kernel called with rotary_mode 1 stops with an error instead of computing without RoPE.
"""

from __future__ import annotations

import functools
import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from pipeline.kernels.cpu.fast_math import lanes_reduce
from pipeline.kernels.cpu.packed import prefetch_line
from pipeline.kernels.cpu.probe import has_avx2, native_threads

TILE = 16      # keys per online-softmax step
LANES = 8      # fp32 lanes of an AVX2 / 2x NEON register: partial sums of a dot product
LOG2E = math.log2(math.e)
NEG = -5e4     # TVM's "minus infinity" for the running max


LN2 = math.log(2.0)


def _exp2(x):
    """2^x for x <= 0 in float32 arithmetic that vectorizes (LLVM calls libm's exp2f once per lane): round
    to n + f with |f| <= 1/2, e^(f ln 2) by its degree-7 Taylor polynomial (relative error < 1e-8 there),
    times 2^n built in the exponent bits. Below 2^-126 it flushes to ~0 like the weights it scales."""
    x = tirx.max(x, tirx.const(-126.0, "float32"))
    n = tirx.round(x)
    y = (x - n) * tirx.const(LN2, "float32")
    p = tirx.const(1.0 / 5040, "float32")
    for c in (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * y + tirx.const(c, "float32")
    scale = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return p * scale


PREFILL_ROWS = 2    # query rows per task of the ragged prefill kernel


def _pair_sums(a, b, lo: list[int], hi: list[int]):
    return T.Shuffle([a, b], lo) + T.Shuffle([a, b], hi)


def _lane_sums(part: T.Buffer, base):
    """[sum of part[base + LANES j: + LANES] for j < LANES] as one vector: the horizontal sums of LANES
    partial-sum vectors in three rounds of shuffles and adds (LANES = 8) instead of 7 scalar adds each."""
    v = [part[T.Ramp(base + LANES * j, 1, LANES)] for j in range(LANES)]
    v = [_pair_sums(v[2 * i], v[2 * i + 1], [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]) for i in range(4)]
    v = [_pair_sums(v[2 * i], v[2 * i + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]) for i in range(2)]
    return _pair_sums(v[0], v[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


@T.macro
def _softmax_step(part: T.Buffer, sc: T.Buffer, st: T.Buffer, acc: T.Buffer, i: int, t: T.int32, n_valid: T.int32,
                  d_v: int):
    """Online softmax over key tile t for row i of a block (a query row, or a query head of a GQA group): its
    TILE scores from their LANES partial sums in `part` (`_lane_sums`), the running output acc[i] and sum
    rescaled once if the running max grew, then the scores turned into weights 2^(s - max) (keys at or past
    n_valid weigh 0) and added to the sum. st holds (running max, running sum, tile max) per row."""
    for g in T.unroll(TILE // LANES):
        sc[T.Ramp(i * TILE + g * LANES, 1, LANES)] = _lane_sums(part, (i * TILE + g * LANES) * LANES)
    valid = T.Ramp(t * TILE, 1, TILE) < T.Broadcast(n_valid, TILE)
    st[i * 3 + 2] = lanes_reduce(T.Select(valid, sc[T.Ramp(i * TILE, 1, TILE)], T.Broadcast(T.float32(NEG), TILE)),
                                 TILE, T.max)
    if st[i * 3 + 2] > st[i * 3]:
        st[i * 3 + 1] = st[i * 3 + 1] * T.exp2(st[i * 3] - st[i * 3 + 2])
        for x in T.vectorized(d_v):
            acc[i * d_v + x] = acc[i * d_v + x] * T.exp2(st[i * 3] - st[i * 3 + 2])
        st[i * 3] = st[i * 3 + 2]
    for jj in T.vectorized(TILE):
        sc[i * TILE + jj] = T.Select(t * TILE + jj < n_valid, _exp2(sc[i * TILE + jj] - st[i * 3]), T.float32(0))
    st[i * 3 + 1] = st[i * 3 + 1] + lanes_reduce(sc[T.Ramp(i * TILE, 1, TILE)], TILE, lambda a, b: a + b)


def _ragged_kv(k: T.Buffer, v: T.Buffer, kv0, head, which: int, key, c):
    """Vector c of key `key`'s K (which 0) or V row in ragged [token, head, dim] K / V arrays."""
    return (k if which == 0 else v)[kv0 + key, head, T.Ramp(c * LANES, 1, LANES)]


def _paged_kv(pages: T.Buffer, page_values: T.Buffer, first, page_size: int, head, which: int, key, c):
    """Vector c of key `key`'s K (which 0) or V row in the page pool [page, K|V, head, slot, dim]."""
    return pages[page_values[first + key // page_size], which, head, key % page_size, T.Ramp(c * LANES, 1, LANES)]


@T.macro
def _row_block(q: T.Buffer, q0: T.int32, q_n: T.int32, first: T.int32, h: T.int32, kv_n: T.int32, causal: T.int32,
               sm_scale: T.float32, output: T.Buffer, lse: T.Buffer, kv, rows: int, d_qk: int, d_v: int, dtype: str):
    """Rows first .. first + rows - 1 of a sequence's q_n queries (from q[q0]), head h, over its kv_n keys
    (`kv(which, key, c)`: vector c of a key's K or V row): each key's K and V vectors loaded once for all the
    rows; the rows' running outputs (acc) only ever at constant offsets, so they stay in registers; per row its
    own causal length masks the tile and keeps its own online softmax. Rows past q_n repeat the last row and
    are not written."""
    acc = T.decl_buffer((rows * d_v,), "float32")
    qv = T.decl_buffer((rows * d_qk,), "float32")
    sc = T.decl_buffer((rows * TILE,), "float32")
    part = T.decl_buffer((rows * TILE * LANES,), "float32")
    pv = T.decl_buffer((rows,), f"float32x{LANES}")
    pa = T.decl_buffer((rows,), f"float32x{LANES}")
    st = T.decl_buffer((rows * 3,), "float32")   # per row: running max, running sum, tile max
    nk = T.decl_buffer((rows,), "int32")
    for i in T.unroll(rows):
        qi: T.let[T.int32] = T.min(first + i, q_n - 1)
        nk[i] = T.max(T.if_then_else(causal > 0, T.min(kv_n - q_n + qi + 1, kv_n), kv_n), 0)
        for x in T.vectorized(d_qk):
            qv[i * d_qk + x] = T.Cast("float32", q[q0 + qi, h, x]) * (sm_scale * LOG2E)
        for x in T.vectorized(d_v):
            acc[i * d_v + x] = T.float32(0)
        st[i * 3] = T.float32(NEG)
        st[i * 3 + 1] = T.float32(1)     # as TVM's kernels: no keys gives output 0 and lse NEG
    n_keys: T.let[T.int32] = nk[rows - 1]
    for t in range((n_keys + TILE - 1) // TILE):
        for jj in range(TILE):          # keys past the end read the last key; masked below
            key: T.let[T.int32] = T.min(t * TILE + jj, n_keys - 1)
            for i in T.unroll(rows):
                pv[i] = T.Broadcast(T.float32(0), LANES)
            for c in T.unroll(d_qk // LANES):
                for i in T.unroll(rows):
                    pv[i] = pv[i] + qv[T.Ramp(i * d_qk + c * LANES, 1, LANES)] * T.Cast(
                        f"float32x{LANES}", kv(0, key, c))
            for i in T.unroll(rows):
                part[T.Ramp((i * TILE + jj) * LANES, 1, LANES)] = pv[i]
        for i in T.unroll(rows):
            _softmax_step(part, sc, st, acc, i, t, nk[i], d_v)
        for c in range(d_v // LANES):   # a loop, not unrolled: acc stays in memory, one chunk's sums in registers
            for i in T.unroll(rows):
                pa[i] = acc[T.Ramp(i * d_v + c * LANES, 1, LANES)]
            for jj in T.unroll(TILE):   # keys past the end read the last key at weight 0
                vv: T.let = T.Cast(f"float32x{LANES}", kv(1, T.min(t * TILE + jj, n_keys - 1), c))
                for i in T.unroll(rows):
                    pa[i] = pa[i] + T.Broadcast(sc[i * TILE + jj], LANES) * vv
            for i in T.unroll(rows):
                acc[T.Ramp(i * d_v + c * LANES, 1, LANES)] = pa[i]
    for i in T.unroll(rows):
        if first + i < q_n:
            for x in T.vectorized(d_v):
                output[q0 + first + i, h, x] = T.Cast(dtype, acc[i * d_v + x] / st[i * 3 + 1])
            lse[q0 + first + i, h] = st[i * 3] + T.log2(st[i * 3 + 1])


def ragged_prefill(h_kv: int, h_q: int, d_qk: int, d_v: int, dtype: str, rows: int = PREFILL_ROWS):
    """Attention of each sequence's new tokens over its new tokens (causal or not): the prefill of a chunk
    with nothing cached yet. Signature of TVM's `tir_attention_prefill_ragged_cpu`.

    A task is `rows` consecutive query rows of one head: each key's K and V row is loaded once for all of
    them, and their running outputs stay in registers (every access to them unrolled to a constant offset);
    per row its own causal length masks the tile and keeps its own online softmax. Rows past the chunk's end
    repeat its last row and are not written. 2 rows measured best (1.4x one row at 128 and 512 tokens, 16
    heads of 64; 3: the same at 128, slower at 512; 4: spills)."""
    group = h_q // h_kv

    @T.prim_func
    def batch_prefill_ragged_kv(var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle,
                                var_kv_indptr: T.handle, var_q_rope_position: T.handle,
                                var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
                                causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32,
                                rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_off = T.int32()
        kv_indptr_off = T.int32()
        q_rope_off = T.int32()
        k_rope_off = T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d_qk), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_off)
        k = T.match_buffer(var_k, (kv_len, h_kv, d_qk), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d_v), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_off)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_off)  # noqa: F841 - in the signature, unused (no inline RoPE)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_off)  # noqa: F841 - in the signature, unused (no inline RoPE)
        output = T.match_buffer(var_output, (qo_len, h_q, d_v), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        assert rotary_mode == 0, "this attention kernel needs RoPE applied before it (RopeMode.NORMAL)"
        for b in range(batch_size):
            for task in T.parallel((q_indptr[b + 1] - q_indptr[b] + rows - 1) // rows * h_q):
                q_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                blocks: T.let[T.int32] = (q_n + rows - 1) // rows
                h: T.let[T.int32] = task // blocks   # head-major: each thread's contiguous share of tasks
                _row_block(q, q_indptr[b], q_n, task % blocks * rows, h, kv_indptr[b + 1] - kv_indptr[b], causal,
                           sm_scale, output, lse, functools.partial(_ragged_kv, k, v, kv_indptr[b], h // group),
                           rows, d_qk, d_v, dtype)

    return batch_prefill_ragged_kv


DECODE_SPLITS = 4   # parts of a sequence's pages per KV head in decode when the thread count is not known here


def decode_splits(h_kv: int, threads: int | None) -> int:
    """Parts of each KV head's pages in decode: the fewest that give every thread as many tasks (each task
    streams one run of pages; more, shorter tasks measured slower with the pages out of cache: 8 KV heads,
    2 threads, 190 keys: 1 part 29 us, 4 parts 40 us per call; 3 KV heads: 2 parts; decode 1.03-1.04x side by
    side on the three speed models); DECODE_SPLITS for a library built for another machine (a phone's thread
    count is not known here)."""
    if not threads:
        return DECODE_SPLITS
    return next((s for s in range(1, DECODE_SPLITS + 1) if h_kv * s % threads == 0), DECODE_SPLITS)


@T.macro
def _gqa_decode_part(q: T.Buffer, pages: T.Buffer, page_values: T.Buffer, b: T.int32, kv_head: T.int32,
                     first: T.int32, n_keys: T.int32, t0: T.int32, t1: T.int32, sm_scale: T.float32,
                     part_acc: T.Buffer, part_st: T.Buffer, task: T.int32, group: int, d: int, prefetch: bool):
    """Pages t0 .. t1 - 1 (one page = one tile of TILE keys) of a sequence for the `group` query heads that
    read KV head `kv_head`: each K / V vector is loaded once for all of them, and the next page's rows are
    prefetched while this one's are summed (a page holds 4 KB of a head's keys, one memory page: the
    hardware prefetcher starts over at each). Leaves each head's unnormalised output and (max, sum) in
    part_acc / part_st[task] (sum 0 when the part has no keys)."""
    acc = T.decl_buffer((group * d,), "float32")
    qv = T.decl_buffer((group * d,), "float32")
    sc = T.decl_buffer((group * TILE,), "float32")
    part = T.decl_buffer((group * TILE * LANES,), "float32")
    pv = T.decl_buffer((group,), f"float32x{LANES}")
    pa = T.decl_buffer((group,), f"float32x{LANES}")
    st = T.decl_buffer((group * 3,), "float32")   # per head: running max, running sum, tile max
    for i in T.unroll(group):
        for x in T.vectorized(d):
            qv[i * d + x] = T.Cast("float32", q[b, kv_head * group + i, x]) * (sm_scale * LOG2E)
        for x in T.vectorized(d):
            acc[i * d + x] = T.float32(0)
        st[i * 3] = T.float32(NEG)
        st[i * 3 + 1] = T.float32(0)
    for t in range(t0, t1):
        page: T.let[T.int32] = page_values[first + t]
        ahead: T.let[T.int32] = page_values[first + T.min(t + 1, t1 - 1)]
        for jj in range(TILE):          # slots past the sequence's end hold stale values; masked below
            if prefetch and t + 1 < t1:
                for which in T.unroll(2):
                    for line in T.unroll(d // 16):
                        T.evaluate(prefetch_line(pages[ahead, which, kv_head, jj, line * 16]))
            for i in T.unroll(group):
                pv[i] = T.Broadcast(T.float32(0), LANES)
            for c in T.unroll(d // LANES):
                for i in T.unroll(group):
                    pv[i] = pv[i] + qv[T.Ramp(i * d + c * LANES, 1, LANES)] * T.Cast(
                        f"float32x{LANES}", pages[page, 0, kv_head, jj, T.Ramp(c * LANES, 1, LANES)])
            for i in T.unroll(group):
                part[T.Ramp((i * TILE + jj) * LANES, 1, LANES)] = pv[i]
        for i in T.unroll(group):
            _softmax_step(part, sc, st, acc, i, t, n_keys, d)
        n_in: T.let[T.int32] = T.min(TILE, n_keys - t * TILE)
        for c in range(d // LANES):     # as _row_block: one chunk's sums in registers, acc in memory
            for i in T.unroll(group):
                pa[i] = acc[T.Ramp(i * d + c * LANES, 1, LANES)]
            for jj in T.unroll(TILE):   # slots past the end read the page's last valid one at weight 0
                vv: T.let = T.Cast(f"float32x{LANES}",
                                   pages[page, 1, kv_head, T.min(jj, n_in - 1), T.Ramp(c * LANES, 1, LANES)])
                for i in T.unroll(group):
                    pa[i] = pa[i] + T.Broadcast(sc[i * TILE + jj], LANES) * vv
            for i in T.unroll(group):
                acc[T.Ramp(i * d + c * LANES, 1, LANES)] = pa[i]
    for i in T.unroll(group):
        for x in T.vectorized(d):
            part_acc[task, i, x] = acc[i * d + x]
        part_st[task, i, 0] = st[i * 3]
        part_st[task, i, 1] = st[i * 3 + 1]


def paged_decode(h_kv: int, h_q: int, d: int, dtype: str, page_size: int = 16, splits: int = DECODE_SPLITS,
                 prefetch: bool = True):
    """One new token per sequence over the sequence's cached pages (no sliding window). Signature of TVM's
    `tir_attention_decode_cpu`; pages are [page, K|V, head, slot, dim].

    A task is (sequence, KV head, part of the pages): the query heads sharing that KV head go together
    (GQA: one load of each K / V vector serves all of them, `_gqa_decode_part`), and each KV head's pages
    come in `splits` parts, so that 3 KV heads still make enough tasks for the threads; the parts' online-
    softmax states are merged at the end (flash-decoding). SmolLM2 (3 KV heads, 9 query heads), 30 layers'
    pages, not in cache: 2-3x the kernel of one task per query head from 512 keys on. `prefetch`: the next
    page's rows (x86 builds, where it was measured; TVM 0.27's system-lib symbol pass cannot rename a
    kernel that takes an element's address, so the android-* tar builds go without)."""
    if page_size != TILE:
        return None
    group = h_q // h_kv

    @T.prim_func
    def batch_decode_paged_kv(q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
                              page_table_values_handle: T.handle, var_length_info: T.handle,
                              k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
                              output_handle: T.handle, lse_handle: T.handle, rotary_mode: T.int32,
                              rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        indptr_off = T.int32()
        values_off = T.int32()
        k_rope_off = T.int32()
        q_rope_off = T.int32()
        length_off = T.int32()
        q = T.match_buffer(q_handle, (B, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=indptr_off)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32", elem_offset=values_off)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_off)  # noqa: F841 - in the signature, unused (no inline RoPE)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_off)  # noqa: F841 - in the signature, unused (no inline RoPE)
        output = T.match_buffer(output_handle, (B, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_q), "float32")
        last_page_len = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_off)
        assert rotary_mode == 0, "this attention kernel needs RoPE applied before it (RopeMode.NORMAL)"
        part_acc = T.alloc_buffer((B * h_kv * splits, group, d), "float32")
        part_st = T.alloc_buffer((B * h_kv * splits, group, 2), "float32")
        for task in T.parallel(B * h_kv * splits):
            b: T.let[T.int32] = task // (h_kv * splits)
            first: T.let[T.int32] = page_table_indptr[b]
            n_pages: T.let[T.int32] = page_table_indptr[b + 1] - first
            n_keys: T.let[T.int32] = T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)
            per: T.let[T.int32] = (n_pages + splits - 1) // splits
            t0: T.let[T.int32] = T.min(task % splits * per, n_pages)
            _gqa_decode_part(q, pages, page_table_values, b, task // splits % h_kv, first, n_keys, t0,
                             T.min(t0 + per, n_pages), sm_scale, part_acc, part_st, task, group, d, prefetch)
        for row in range(B * h_q):      # merge the parts' states: a few hundred multiply-adds per head
            stat = T.decl_buffer((2,), "float32")   # max, then the sum of 2^(max_p - max) * sum_p
            merged = T.decl_buffer((d,), "float32")
            b: T.let[T.int32] = row // h_q
            h: T.let[T.int32] = row % h_q
            i: T.let[T.int32] = h % group            # the head's place in its KV head's group
            base: T.let[T.int32] = b * h_kv * splits + h // group * splits
            stat[0] = T.float32(NEG)
            for p in range(splits):
                if part_st[base + p, i, 1] > T.float32(0):
                    stat[0] = T.max(stat[0], part_st[base + p, i, 0])
            stat[1] = T.float32(0)
            for p in range(splits):
                stat[1] = stat[1] + part_st[base + p, i, 1] * T.exp2(part_st[base + p, i, 0] - stat[0])
            for x in T.vectorized(d):
                merged[x] = T.float32(0)
            for p in range(splits):
                if part_st[base + p, i, 1] > T.float32(0):
                    for x in T.vectorized(d):
                        merged[x] = merged[x] + part_acc[base + p, i, x] * (
                            T.exp2(part_st[base + p, i, 0] - stat[0]) / stat[1])
            for x in T.vectorized(d):
                output[b, h, x] = T.Cast(dtype, merged[x])
            lse[b, h] = T.if_then_else(stat[1] > T.float32(0), stat[0] + T.log2(stat[1]), T.float32(NEG))

    return batch_decode_paged_kv


def paged_prefill(h_kv: int, h_q: int, d: int, dtype: str, page_size: int = 16, rows: int = PREFILL_ROWS):
    """Each sequence's new tokens over the tokens already in its pages (no sliding window; causal aligns the
    last query with the last key). Signature of TVM's `tir_attention_prefill_cpu`. TVM's kernel walks the
    whole page pool (max_num_pages x page_size rows) for every query and head and rescales its output
    with an out-of-bounds read of a 1-element buffer; this one reads the sequence's keys only, `rows` query
    rows of a head per task as in the ragged kernel (`_row_block`)."""
    group = h_q // h_kv

    @T.prim_func
    def batch_prefill_paged_kv_cpu(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                                   var_page_indptr: T.handle, var_page_values: T.handle,
                                   var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
                                   var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
                                   causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32,
                                   rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_off = T.int32()
        page_indptr_off = T.int32()
        page_values_off = T.int32()
        k_rope_off = T.int32()
        q_rope_off = T.int32()
        length_off = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_off)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_off)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_off)
        last_page_len = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_off)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_off)  # noqa: F841 - in the signature, unused (no inline RoPE)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=q_rope_off)  # noqa: F841 - in the signature, unused (no inline RoPE)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        assert rotary_mode == 0, "this attention kernel needs RoPE applied before it (RopeMode.NORMAL)"
        for b in range(batch_size):
            for task in T.parallel((q_indptr[b + 1] - q_indptr[b] + rows - 1) // rows * h_q):
                q_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                page0: T.let[T.int32] = page_indptr[b]
                n_pages: T.let[T.int32] = page_indptr[b + 1] - page0
                kv_n: T.let[T.int32] = T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)
                blocks: T.let[T.int32] = (q_n + rows - 1) // rows
                h: T.let[T.int32] = task // blocks   # head-major, as in the ragged kernel
                _row_block(q, q_indptr[b], q_n, task % blocks * rows, h, kv_n, causal, sm_scale, output, lse,
                           functools.partial(_paged_kv, pages, page_values, page0, page_size, h // group),
                           rows, d, d, dtype)

    return batch_prefill_paged_kv_cpu


APPEND_PARALLEL_TOKENS = 8   # fewer new tokens (a decode step) are copied on the calling thread


def transpose_append(h_kv: int, d: int, dtype: str, page_size: int = 16):
    """Copy each new token's K and V into its slot of the page pool (position -1: not stored). Signature
    of TVM's `tir_kv_cache_transpose_append`, whose per-element `position` binding becomes a 4-byte
    workspace allocation per element on CPU: 1.5 M allocations per 128-token prefill of SmolLM2, 11 k per
    decode step. Here: one slot lookup per token, vector copies of each head's row."""

    @T.macro
    def one_token(pages, k_data, v_data, position_map, t):
        position: T.let[T.int32] = position_map[t]
        if position != -1:
            for h in range(h_kv):
                for i in T.vectorized(d):
                    pages[T.floordiv(position, page_size), 0, h, T.floormod(position, page_size), i] = k_data[t, h, i]
                for i in T.vectorized(d):
                    pages[T.floordiv(position, page_size), 1, h, T.floormod(position, page_size), i] = v_data[t, h, i]

    @T.prim_func
    def tir_kv_cache_transpose_append(var_pages: T.handle, var_k_data: T.handle, var_v_data: T.handle,
                                      var_position_map: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        ntoken = T.int64()
        num_pages = T.int64()
        pages_elem_offset = T.int64()
        position_map_elem_offset = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, h_kv, page_size, d), dtype, elem_offset=pages_elem_offset)
        k_data = T.match_buffer(var_k_data, (ntoken, h_kv, d), dtype)
        v_data = T.match_buffer(var_v_data, (ntoken, h_kv, d), dtype)
        position_map = T.match_buffer(var_position_map, (ntoken,), "int32", elem_offset=position_map_elem_offset)
        if ntoken >= APPEND_PARALLEL_TOKENS:
            for t in T.parallel(ntoken):
                one_token(pages, k_data, v_data, position_map, t)
        else:
            for t in range(ntoken):
                one_token(pages, k_data, v_data, position_map, t)

    return tir_kv_cache_transpose_append


MERGE_PARALLEL_ROWS = 64   # fewer (token, head) rows (a decode step's 1 x heads) merge on the calling thread


def merge_state(dtype: str):
    """V <- (V 2^S + V' 2^S') / (2^S + 2^S'), S <- log2(2^S + 2^S') per (token, head): the merge of
    attention over cached pages with attention over the new tokens. Signature of TVM's
    `merge_state_inplace_cpu`, which is serial, keeps its five scalars in one-element buffers and runs
    unvectorized (its buffers may alias); here rows run in parallel when there are many, D stays a loop
    LLVM vectorizes."""

    @T.macro
    def one_row(V, S, V_other, S_other, n, h, d):
        top: T.let[T.float32] = T.max(S[n, h], S_other[n, h])
        mine: T.let[T.float32] = T.exp2(S[n, h] - top)
        theirs: T.let[T.float32] = T.exp2(S_other[n, h] - top)
        for i in range(d):
            V[n, h, i] = T.Cast(dtype, (T.Cast("float32", V[n, h, i]) * mine + T.Cast("float32", V_other[n, h, i])
                                        * theirs) / (mine + theirs))
        S[n, h] = T.log2(mine + theirs) + top

    @T.prim_func
    def merge_state_inplace_cpu(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        N = T.int32()
        H = T.int32()
        D = T.int32()
        V = T.match_buffer(v, (N, H, D), dtype)
        S = T.match_buffer(s, (N, H), "float32")
        V_other = T.match_buffer(v_other, (N, H, D), dtype)
        S_other = T.match_buffer(s_other, (N, H), "float32")
        if N * H >= MERGE_PARALLEL_ROWS:
            for row in T.parallel(N * H):
                one_row(V, S, V_other, S_other, row // H, row % H, D)
        else:
            for row in range(N * H):
                one_row(V, S, V_other, S_other, row // H, row % H, D)

    return merge_state_inplace_cpu


def _static(dims) -> list[int] | None:
    out = []
    for x in dims:
        if not isinstance(x, tvm.tirx.IntImm):
            return None
        out.append(int(x))
    return out


def _ragged_for(func: tvm.tirx.PrimFunc):
    """Our ragged prefill kernel for TVM's `func` (shapes read off its buffer parameters), or None."""
    q, _, k, v = func.params[:4]
    qd, kd, vd = _static(q.shape[1:]), _static(k.shape[1:]), _static(v.shape[1:])
    if (not (qd and kd and vd) or qd[1] % LANES or vd[1] % LANES or qd[1] != kd[1] or qd[0] % kd[0]
            or vd[0] != kd[0]):
        return None
    return ragged_prefill(kd[0], qd[0], qd[1], vd[1], str(q.dtype))


def _decode_for(func: tvm.tirx.PrimFunc):
    """Our paged decode kernel for TVM's non-sliding-window `func`, or None; it prefetches on x86."""
    q, pages = func.params[:2]
    length_info = func.params[4]
    qd, pd = _static(q.shape[1:]), _static(pages.shape[1:])
    if not (qd and pd) or len(length_info.shape) != 1 or pd[0] != 2 or qd[1] != pd[3] or qd[1] % LANES \
            or qd[0] % pd[1]:
        return None
    target = tvm.target.Target.current(allow_none=True)
    return paged_decode(pd[1], qd[0], qd[1], str(q.dtype), page_size=pd[2], prefetch=has_avx2(target),
                        splits=decode_splits(pd[1], native_threads(target)))


def _paged_prefill_for(func: tvm.tirx.PrimFunc):
    """Our paged prefill kernel for TVM's non-sliding-window `func`, or None."""
    q, _, pages = func.params[:3]
    length_info = func.params[5]
    qd, pd = _static(q.shape[1:]), _static(pages.shape[1:])
    if not (qd and pd) or len(length_info.shape) != 1 or pd[0] != 2 or qd[1] != pd[3] or qd[1] % LANES \
            or qd[0] % pd[1]:
        return None
    return paged_prefill(pd[1], qd[0], qd[1], str(q.dtype), page_size=pd[2])


def append_shapes(func: tvm.tirx.PrimFunc) -> tuple[int, int, int] | None:
    """(KV heads, head size, page size) of TVM's KV append `func` when static and as expected, else None
    (also kernels/gpu/kernel_fixes.py's bounded GPU append)."""
    if len(func.params) != 4:
        return None
    pages, k = func.params[:2]
    pd, kd = _static(pages.shape[1:]), _static(k.shape[1:])
    if not (pd and kd) or pd[0] != 2 or pd[1] != kd[0] or pd[3] != kd[1]:
        return None
    return kd[0], kd[1], pd[2]


def _append_for(func: tvm.tirx.PrimFunc):
    """Our KV append for TVM's `func`, or None."""
    shapes = append_shapes(func)
    if shapes is None:
        return None
    h_kv, d, page_size = shapes
    return transpose_append(h_kv, d, str(func.params[1].dtype), page_size=page_size)


def _merge_for(func: tvm.tirx.PrimFunc):
    """Our state merge for TVM's `func`, or None."""
    return merge_state(str(func.params[0].dtype))


# module names of TVM's CPU kernels (their global symbols; the KV cache registers them as
# tir_attention_prefill_ragged_cpu / tir_attention_decode_cpu / tir_attention_prefill_cpu /
# tir_kv_cache_transpose_append / tir_attention_merge_state_cpu); the *_sliding_window variants are kept
REPLACEMENTS = {"batch_prefill_ragged_kv": _ragged_for, "batch_decode_paged_kv_cpu": _decode_for,
                "batch_prefill_paged_kv_cpu": _paged_prefill_for, "tir_kv_cache_transpose_append": _append_for,
                "merge_state_inplace_cpu": _merge_for}
_PARAMS = {"batch_prefill_ragged_kv": 14, "batch_decode_paged_kv_cpu": 13, "batch_prefill_paged_kv_cpu": 15,
           "tir_kv_cache_transpose_append": 4, "merge_state_inplace_cpu": 4}


@tvm.transform.module_pass(opt_level=0, name="ReplaceSerialCPUAttention")
def replace_cpu_attention(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Swap TVM's serial CPU attention kernels for the ones above (same name, signature and attributes)
    when compiling for an LLVM target; a kernel whose shapes they do not cover is kept."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return mod
    for gv, func in list(mod.functions_items()):
        make = REPLACEMENTS.get(gv.name_hint)
        if make is None or not isinstance(func, tvm.tirx.PrimFunc) or len(func.params) != _PARAMS[gv.name_hint]:
            continue
        fast = make(func)
        if fast is None:
            continue
        for key, value in func.attrs.items():
            fast = fast.with_attr(key, value)
        mod[gv] = fast.with_attr("mlp.kernel", "cpu_attention")
    return mod
