"""Sampling on the device: the functions MLC's engine calls where it samples on the GPU (Metal, Vulkan, CUDA).

cpp/serve/sampler/gpu_sampler.cc: probabilities stay on the device; the engine draws uniform numbers on the host
and calls `multinomial_from_uniform` (no top-p), or `argsort_probs` then `sample_with_top_p`, and
`sampler_take_probs` when log-probabilities are requested. Kernels written here from those calls' contracts,
thread-bound for any GPU target (marked scheduled); tests run them on PoCL as OpenCL C.

- multinomial_from_uniform(probs [b, V], u [n], rows [n]) -> ids [n]: the first token whose running sum of
  probs[rows[i]] exceeds u[i] (one block per sample: per-thread chunk sums in shared memory, then one thread
  walks the chunks and the chosen chunk);
- argsort_probs(probs [b, V]) -> (sorted [b, V], indices [b, V]), descending and stable: ceil(log2 V) merge
  passes, each element placed by a binary search for its rank in the neighbouring run;
- sample_with_top_p(sorted, indices, u [n], rows [n], top_p [b]) -> ids [n]: the smallest prefix of the sorted
  row holding top_p of the mass, sampled at u times that mass (one thread per sample, stops at the cut);
- sampler_take_probs(probs, indices, rows [n], ids [n], offsets [m]) -> (p [n], top_p [m], top_ids [m]):
  the sampled tokens' probabilities and the top-ranked ones at offsets row * V + rank.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

THREADS = 256


OPAQUE = 8   # relax's OpPatternKind kOpaque: fusion and the reshape rewrite leave these kernels alone


def _scheduled(func: tirx.PrimFunc) -> tirx.PrimFunc:
    return func.with_attrs({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})


def multinomial_from_uniform(vocab: int) -> tirx.PrimFunc:
    chunk = -(-vocab // THREADS)

    @T.prim_func
    def multinomial_kernel(probs_h: T.handle, u_h: T.handle, rows_h: T.handle, out_h: T.handle):
        batch, n = T.int64(), T.int64()
        probs = T.match_buffer(probs_h, (batch, vocab), "float32")
        u = T.match_buffer(u_h, (n,), "float32")
        rows = T.match_buffer(rows_h, (n,), "int32")
        out = T.match_buffer(out_h, (n,), "int32")
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                part = T.alloc_shared((THREADS,), "float32")
                acc = T.alloc_local((1,), "float32")
                walk = T.alloc_local((1,), "float32")
                pick = T.alloc_local((1,), "int32")
                done = T.alloc_local((1,), "int32")
                acc[0] = T.float32(0)
                for c in range(chunk):
                    if tx * chunk + c < vocab:
                        acc[0] = acc[0] + probs[rows[i], tx * chunk + c]
                part[tx] = acc[0]
                T.tvm_storage_sync("shared")
                if tx == 0:
                    walk[0] = T.float32(0)
                    pick[0] = -1
                    for t in range(THREADS):   # the chunk where the running sum passes u
                        acc[0] = part[t]   # (a shared load may not sit in a condition: TVM's sync analysis)
                        if pick[0] < 0:
                            if walk[0] + acc[0] > u[i]:
                                pick[0] = T.Cast("int32", t)
                            else:
                                walk[0] = walk[0] + acc[0]
                    out[i] = T.int32(vocab - 1)   # the sum stayed at or below u (rounding): the last token
                    if pick[0] >= 0:
                        out[i] = T.min(pick[0] * chunk + chunk - 1, vocab - 1)
                        done[0] = 0
                        for c in range(chunk):
                            if done[0] == 0 and pick[0] * chunk + c < vocab:
                                walk[0] = walk[0] + probs[rows[i], pick[0] * chunk + c]
                                if walk[0] > u[i]:
                                    out[i] = pick[0] * chunk + c
                                    done[0] = 1

    return _scheduled(multinomial_kernel)


def _merge_pass(vocab: int, width: int, first: bool) -> tirx.PrimFunc:
    """One pass of the descending, stable merge sort: runs of `width` become runs of 2 * width. The first pass
    takes the probabilities alone (indices are the positions)."""
    steps = max(1, width.bit_length() + 1)
    blocks = -(-vocab // THREADS)

    @T.prim_func(s_tir=True)
    def merge_kernel(vals_h: T.handle, idx_h: T.handle, vals_out_h: T.handle, idx_out_h: T.handle):
        batch = T.int64()
        vals = T.match_buffer(vals_h, (batch, vocab), "float32")
        idx = T.match_buffer(idx_h, (batch, vocab), "int32")
        vals_out = T.match_buffer(vals_out_h, (batch, vocab), "float32")
        idx_out = T.match_buffer(idx_out_h, (batch, vocab), "int32")
        # (a root block: relax's reshape detection, run on every call between passes, requires one)
        with T.sblock("root"):
            for bx in T.thread_binding(batch * blocks, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    lo = T.alloc_local((1,), "int32")
                    hi = T.alloc_local((1,), "int32")
                    if (bx % blocks) * THREADS + tx < vocab:
                        r = bx // blocks
                        e = T.Cast("int32", (bx % blocks) * THREADS + tx)
                        x = vals[r, e]
                        base = e // (2 * width) * (2 * width)
                        left = e < base + width
                        # the neighbouring run [lo, hi): the right one for a left element, the left one else
                        lo[0] = T.if_then_else(left, T.min(base + width, vocab), base)
                        hi[0] = T.if_then_else(left, T.min(base + 2 * width, vocab), base + width)
                        start = lo[0]
                        for _ in range(steps):   # first index of the run whose value is below x (ties: left first)
                            if lo[0] < hi[0]:
                                mid = (lo[0] + hi[0]) // 2
                                if T.if_then_else(left, vals[r, mid] > x, vals[r, mid] >= x):
                                    lo[0] = mid + 1
                                else:
                                    hi[0] = mid
                        own = T.if_then_else(left, e - base, e - base - width)
                        dest = base + own + (lo[0] - start)
                        vals_out[r, dest] = x
                        idx_out[r, dest] = T.if_then_else(first, e, idx[r, e])

    return _scheduled(merge_kernel)


def argsort_passes(vocab: int) -> list[tirx.PrimFunc]:
    """The merge passes of argsort_probs, widths 1, 2, 4, ... below the vocabulary."""
    widths, w = [], 1
    while w < vocab:
        widths.append(w)
        w *= 2
    return [_merge_pass(vocab, w, i == 0).with_attr("global_symbol", f"argsort_merge_{i}")
            for i, w in enumerate(widths)]


def sample_with_top_p(vocab: int) -> tirx.PrimFunc:
    @T.prim_func
    def top_p_kernel(sorted_h: T.handle, idx_h: T.handle, u_h: T.handle, rows_h: T.handle, top_p_h: T.handle,
                     out_h: T.handle):
        batch, n = T.int64(), T.int64()
        probs = T.match_buffer(sorted_h, (batch, vocab), "float32")
        idx = T.match_buffer(idx_h, (batch, vocab), "int32")
        u = T.match_buffer(u_h, (n,), "float32")
        rows = T.match_buffer(rows_h, (n,), "int32")
        top_p = T.match_buffer(top_p_h, (batch,), "float32")
        out = T.match_buffer(out_h, (n,), "int32")
        for bx in T.thread_binding((n + 63) // 64, thread="blockIdx.x"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                mass = T.alloc_local((1,), "float32")
                kept = T.alloc_local((1,), "int32")
                walk = T.alloc_local((1,), "float32")
                k = T.alloc_local((1,), "int32")
                if bx * 64 + tx < n:
                    i = bx * 64 + tx
                    r = rows[i]
                    mass[0] = T.float32(0)
                    kept[0] = 0
                    while kept[0] < vocab and mass[0] < top_p[r]:   # the smallest prefix with top_p of the mass
                        mass[0] = mass[0] + probs[r, kept[0]]
                        kept[0] = kept[0] + 1
                    walk[0] = probs[r, 0]
                    k[0] = 0
                    while k[0] + 1 < kept[0] and walk[0] <= u[i] * mass[0]:
                        k[0] = k[0] + 1
                        walk[0] = walk[0] + probs[r, k[0]]
                    out[i] = idx[r, k[0]]

    return _scheduled(top_p_kernel)


def sampler_take_probs(vocab: int) -> tirx.PrimFunc:
    @T.prim_func
    def take_probs_kernel(probs_h: T.handle, idx_h: T.handle, rows_h: T.handle, ids_h: T.handle,
                          offsets_h: T.handle, p_h: T.handle, top_h: T.handle, top_ids_h: T.handle):
        batch, n, m = T.int64(), T.int64(), T.int64()
        probs = T.match_buffer(probs_h, (batch, vocab), "float32")
        idx = T.match_buffer(idx_h, (batch, vocab), "int32")
        rows = T.match_buffer(rows_h, (n,), "int32")
        ids = T.match_buffer(ids_h, (n,), "int32")
        offsets = T.match_buffer(offsets_h, (m,), "int32")
        p = T.match_buffer(p_h, (n,), "float32")
        top = T.match_buffer(top_h, (m,), "float32")
        top_ids = T.match_buffer(top_ids_h, (m,), "int32")
        for bx in T.thread_binding((n + 63) // 64, thread="blockIdx.x"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                if bx * 64 + tx < n:
                    p[bx * 64 + tx] = probs[rows[bx * 64 + tx], ids[bx * 64 + tx]]
        for bx in T.thread_binding((m + 63) // 64, thread="blockIdx.x"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                if bx * 64 + tx < m:
                    j = bx * 64 + tx
                    top_ids[j] = idx[offsets[j] // vocab, offsets[j] % vocab]
                    top[j] = probs[offsets[j] // vocab, idx[offsets[j] // vocab, offsets[j] % vocab]]

    return _scheduled(take_probs_kernel)
