"""Prefill of a mixture-of-experts MLP grouped by expert (CPU targets).

The gather kernels (`moe_kernels`) compute each token's k experts on their own: a prefill chunk of n tokens
reads n x k expert matrices, the same expert's rows again for every token routed to it. Here the chunk's
(token, slot) pairs are first sorted by expert (a counting sort: `moe_sort`), then each work item takes one
row of one expert and runs it over every token routed to that expert, so the row is read from memory once
per chunk and reused from cache across its tokens — one grouped matmul per projection::

    moe_sort:             idx [n, k] int32  ->  offsets [E + 1] int32, order [n * k] int32
                          order[offsets[e] : offsets[e + 1]] = the slots t * k + j with idx[t, j] = e, ascending
    moe_grouped_gate_up:  x [n, H], offsets, order, W_gu [E, 2I, H]  ->  h [n, k, I]   (as moe_gate_up)
    moe_grouped_down:     h [n, k, I], offsets, order, W_d [E, H, I] ->  o [n, k, H]   (one row per slot)

The routing-weighted sum over the k slots (`y[t] = sum_j weight[t, j] o[t, j]`) is left to the caller. Each
dot product is the gather kernels' vectorised one (kernels/cpu/expert_rows.py: same lanes, same order), so
the grouped path gives the same numbers. Loop TIR with a `parallel` outer loop over (expert, row) pairs; the slots of an expert are a
data-dependent inner loop (experts get unequal shares: the parallel loop balances rows, not tokens).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.kernels.cpu.expert_rows import (
    expert_row_dot,
    group_sums_shape,
    prescale,
    prescaled_shape,
    vector_scratch,
)
from pipeline.models.moe_kernels import _check, _weight_of, code_dtype, weight_shapes

__all__ = ["moe_grouped_down", "moe_grouped_gate_up", "moe_sort"]


def _finish(func: tirx.PrimFunc, name: str, op_class: str) -> tirx.PrimFunc:
    return func.with_attr("global_symbol", name).with_attr("pipeline.op_class", op_class)


def moe_sort(experts: int, top_k: int, name: str = "moe_sort") -> tirx.PrimFunc:
    """Counting sort of the chunk's n x k slots by expert (one serial work item: n x k is small)."""
    E, K = int(experts), int(top_k)

    @T.prim_func(s_tir=True)
    def sort(idx_h: T.handle, offsets: T.Buffer((E + 1,), "int32"), order_h: T.handle):
        seq_len = T.int64()
        idx = T.match_buffer(idx_h, (seq_len, K), "int32")
        order = T.match_buffer(order_h, (seq_len * K,), "int32")
        with T.sblock("root"):   # Relax's reshape analysis expects a block at the top of a one-input kernel
            cursor = T.alloc_buffer((E,), "int32")
            for e in range(E + 1):
                offsets[e] = 0
            for s in range(seq_len * K):
                offsets[idx[s // K, s % K] + 1] = offsets[idx[s // K, s % K] + 1] + 1
            for e in range(E):
                offsets[e + 1] = offsets[e + 1] + offsets[e]
                cursor[e] = offsets[e]
            for s in range(seq_len * K):
                order[cursor[idx[s // K, s % K]]] = T.Cast("int32", s)
                cursor[idx[s // K, s % K]] = cursor[idx[s // K, s % K]] + 1

    return _finish(sort, name, "reduction")


def gate_up_kernel(body, E: int, M: int, H: int, K: int, dtype: str, fmt: str, wshape, sshape, cdtype: str,
                   scale_dtype: str) -> tirx.PrimFunc:
    """The grouped gate_up's signature (x, offsets, order, codes[, scales], out) around `body`, a macro
    (x, offsets, order, codes, scales or None, out, seq_len): shared by the CPU and GPU (moe_grouped_gpu) forms."""
    if fmt == "float":
        @T.prim_func
        def kernel(x_h: T.handle, offsets: T.Buffer((E + 1,), "int32"), order_h: T.handle,
                   codes: T.Buffer(wshape, cdtype), out_h: T.handle):
            seq_len = T.int64()
            x = T.match_buffer(x_h, (seq_len, H), dtype)
            order = T.match_buffer(order_h, (seq_len * K,), "int32")
            out = T.match_buffer(out_h, (seq_len, K, M), dtype)
            body(x, offsets, order, codes, None, out, seq_len)
    else:
        @T.prim_func
        def kernel(x_h: T.handle, offsets: T.Buffer((E + 1,), "int32"), order_h: T.handle,
                   codes: T.Buffer(wshape, cdtype), scales: T.Buffer(sshape, scale_dtype), out_h: T.handle):
            seq_len = T.int64()
            x = T.match_buffer(x_h, (seq_len, H), dtype)
            order = T.match_buffer(order_h, (seq_len * K,), "int32")
            out = T.match_buffer(out_h, (seq_len, K, M), dtype)
            body(x, offsets, order, codes, scales, out, seq_len)
    return kernel


def down_kernel(body, E: int, H: int, M: int, K: int, dtype: str, fmt: str, wshape, sshape, cdtype: str,
                scale_dtype: str) -> tirx.PrimFunc:
    """The grouped down projection's signature (h, offsets, order, codes[, scales], out) around `body`."""
    if fmt == "float":
        @T.prim_func
        def kernel(h_h: T.handle, offsets: T.Buffer((E + 1,), "int32"), order_h: T.handle,
                   codes: T.Buffer(wshape, cdtype), out_h: T.handle):
            seq_len = T.int64()
            h = T.match_buffer(h_h, (seq_len, K, M), dtype)
            order = T.match_buffer(order_h, (seq_len * K,), "int32")
            out = T.match_buffer(out_h, (seq_len, K, H), "float32")
            body(h, offsets, order, codes, None, out, seq_len)
    else:
        @T.prim_func
        def kernel(h_h: T.handle, offsets: T.Buffer((E + 1,), "int32"), order_h: T.handle,
                   codes: T.Buffer(wshape, cdtype), scales: T.Buffer(sshape, scale_dtype), out_h: T.handle):
            seq_len = T.int64()
            h = T.match_buffer(h_h, (seq_len, K, M), dtype)
            order = T.match_buffer(order_h, (seq_len * K,), "int32")
            out = T.match_buffer(out_h, (seq_len, K, H), "float32")
            body(h, offsets, order, codes, scales, out, seq_len)
    return kernel


def moe_grouped_gate_up(experts: int, inter: int, hidden: int, top_k: int, dtype: str, fmt: str = "float",
                        weight_dtype: str = "float32", *, scale_dtype: str = "float16",
                        name: str = "moe_grouped_gate_up") -> tirx.PrimFunc:
    """h[t, j, r] = silu(x[t] . W[e, r]) * (x[t] . W[e, I + r]) for every slot (t, j) routed to e, by expert."""
    E, M, H, K = int(experts), int(inter), int(hidden), int(top_k)
    _check(fmt, H)
    wshape, sshape = weight_shapes(fmt, E, 2 * M, H)
    cdtype = code_dtype(fmt, weight_dtype)

    dot = expert_row_dot(fmt, H, 2, _weight_of(fmt))
    (vshape, vdtype), (lshape, ldtype) = vector_scratch(2)

    pre = prescale(fmt, H, lambda row: (row,))

    @T.macro
    def body(x, offsets, order, codes, scales, out, seq_len):
        xp = T.alloc_buffer(prescaled_shape(fmt, seq_len, H), "float32")
        xs = T.alloc_buffer(group_sums_shape(fmt, seq_len, H), "float32")
        pre(xp, xs, x, seq_len)
        for er in T.parallel(E * M):
            e: T.let[T.int32] = er // M
            res = T.alloc_buffer((2,), "float32")
            vec = T.alloc_buffer(vshape, vdtype)
            lanes = T.alloc_buffer(lshape, ldtype)
            for s in range(offsets[e + 1] - offsets[e]):
                slot: T.let[T.int32] = order[offsets[e] + s]
                dot(res, vec, lanes, x, (slot // K,), xp, xs, (slot // K,), codes, scales, e, er % M, M)
                out[slot // K, slot % K, er % M] = T.Cast(dtype, res[0] / (T.float32(1) + T.exp(-res[0])) * res[1])

    return _finish(gate_up_kernel(body, E, M, H, K, dtype, fmt, wshape, sshape, cdtype, scale_dtype), name,
                   "moe-gemv")


def moe_grouped_down(experts: int, hidden: int, inter: int, top_k: int, dtype: str, fmt: str = "float",
                     weight_dtype: str = "float32", *, scale_dtype: str = "float16",
                     name: str = "moe_grouped_down") -> tirx.PrimFunc:
    """o[t, j, r] = h[t, j] . W[e, r] for every slot (t, j) routed to e, by expert (unweighted, fp32)."""
    E, M, H, K = int(experts), int(inter), int(hidden), int(top_k)
    _check(fmt, M)
    wshape, sshape = weight_shapes(fmt, E, H, M)
    cdtype = code_dtype(fmt, weight_dtype)

    dot = expert_row_dot(fmt, M, 1, _weight_of(fmt))
    (vshape, vdtype), (lshape, ldtype) = vector_scratch(1)

    pre = prescale(fmt, M, lambda row: (row // K, row % K))

    @T.macro
    def body(h, offsets, order, codes, scales, out, seq_len):
        xp = T.alloc_buffer(prescaled_shape(fmt, seq_len * K, M), "float32")
        xs = T.alloc_buffer(group_sums_shape(fmt, seq_len * K, M), "float32")
        pre(xp, xs, h, seq_len * K)
        for er in T.parallel(E * H):
            e: T.let[T.int32] = er // H
            res = T.alloc_buffer((1,), "float32")
            vec = T.alloc_buffer(vshape, vdtype)
            lanes = T.alloc_buffer(lshape, ldtype)
            for s in range(offsets[e + 1] - offsets[e]):
                slot: T.let[T.int32] = order[offsets[e] + s]
                dot(res, vec, lanes, h, (slot // K, slot % K), xp, xs, (slot,), codes, scales, e, er % H, 0)
                out[slot // K, slot % K, er % H] = res[0]

    return _finish(down_kernel(body, E, H, M, K, dtype, fmt, wshape, sshape, cdtype, scale_dtype), name, "moe-gemv")
