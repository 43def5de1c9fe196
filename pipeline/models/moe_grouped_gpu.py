"""Prefill of a mixture-of-experts MLP grouped by expert, bound to GPU threads (android-adreno, ios-metal).

The same three kernels as `moe_grouped` (names, signatures, results), for GPU targets: before them a GPU
prefill gathered each token's k experts on its own (moe_kernels), reading n x k expert matrices per chunk
(the 35B's 512-token chunk: 7.3 GB of expert rows per layer, against at most the layer's 0.45 GB of q4
experts grouped). Here:

- `moe_sort`: one work item per expert e (and one for the end): its start in `order` is the number of slots
  routed to a smaller expert, then it writes its own slots in ascending order. No cursor and no atomics, so
  `order` is the CPU counting sort's exactly; each item scans the chunk's n x k ids twice (a few thousand
  int32 reads, all in parallel);
- `moe_grouped_gate_up` / `moe_grouped_down`: one work item per (expert, output row), running that row over
  every slot routed to the expert: the row is read from memory once per chunk and from cache after. The dot
  product is the GPU gather kernels' (serial over K in fp32, `moe_kernels._weight`), so the grouped path
  gives their numbers. Not tuned: a work item reads its own row (no coalescing across work items), as the
  gather kernels do.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.models.moe_grouped import down_kernel, gate_up_kernel
from pipeline.models.moe_kernels import _check, _finish, _loops, _weight, code_dtype, weight_shapes

__all__ = ["moe_grouped_down_gpu", "moe_grouped_gate_up_gpu", "moe_sort_gpu"]


def moe_sort_gpu(experts: int, top_k: int, max_threads: int = 128, name: str = "moe_sort") -> tirx.PrimFunc:
    """offsets [E + 1], order [n k] from idx [n, k] (module docstring): one work item per expert."""
    E, K = int(experts), int(top_k)
    outer, inner, threads = _loops(True, max_threads)

    @T.prim_func(s_tir=True)
    def sort(idx_h: T.handle, offsets: T.Buffer((E + 1,), "int32"), order_h: T.handle):
        seq_len = T.int64()
        idx = T.match_buffer(idx_h, (seq_len, K), "int32")
        order = T.match_buffer(order_h, (seq_len * K,), "int32")
        with T.sblock("root"):   # Relax's reshape analysis expects a block at the top of a one-input kernel
            for eb in outer((E + threads) // threads):
                for tx in inner(threads):
                    if eb * threads + tx <= E:
                        e = eb * threads + tx
                        start = T.alloc_local((1,), "int32")
                        start[0] = 0
                        for s in range(seq_len * K):
                            if idx[s // K, s % K] < e:
                                start[0] = start[0] + 1
                        offsets[e] = start[0]
                        if e < E:
                            for s in range(seq_len * K):
                                if idx[s // K, s % K] == e:
                                    order[start[0]] = T.Cast("int32", s)
                                    start[0] = start[0] + 1

    return _finish(sort, name, True, op_class="reduction")


def moe_grouped_gate_up_gpu(experts: int, inter: int, hidden: int, top_k: int, dtype: str, fmt: str = "float",
                            weight_dtype: str = "float32", *, scale_dtype: str = "float16", max_threads: int = 128,
                            name: str = "moe_grouped_gate_up") -> tirx.PrimFunc:
    """h[t, j, r] = silu(x[t] . W[e, r]) * (x[t] . W[e, I + r]) for every slot (t, j) routed to e, by expert."""
    E, M, H, K = int(experts), int(inter), int(hidden), int(top_k)
    _check(fmt, H)
    wshape, sshape = weight_shapes(fmt, E, 2 * M, H)
    cdtype = code_dtype(fmt, weight_dtype)
    outer, inner, threads = _loops(True, max_threads)

    @T.macro
    def body(x, offsets, order, codes, scales, out, seq_len):   # seq_len: the shared signature's
        for wb in outer((E * M + threads - 1) // threads):
            for tx in inner(threads):
                if wb * threads + tx < E * M:
                    e = (wb * threads + tx) // M
                    r = (wb * threads + tx) % M
                    g = T.alloc_local((1,), "float32")
                    u = T.alloc_local((1,), "float32")
                    for s in range(offsets[e + 1] - offsets[e]):
                        t = order[offsets[e] + s] // K
                        g[0] = T.float32(0)
                        u[0] = T.float32(0)
                        for kk in range(H):
                            g[0] = g[0] + T.Cast("float32", x[t, kk]) * _weight(fmt, codes, scales, e, r, kk)
                            u[0] = u[0] + T.Cast("float32", x[t, kk]) * _weight(fmt, codes, scales, e, M + r, kk)
                        out[t, order[offsets[e] + s] % K, r] = T.Cast(dtype, g[0] / (T.float32(1) + T.exp(-g[0])) * u[0])

    return _finish(gate_up_kernel(body, E, M, H, K, dtype, fmt, wshape, sshape, cdtype, scale_dtype), name, True)


def moe_grouped_down_gpu(experts: int, hidden: int, inter: int, top_k: int, dtype: str, fmt: str = "float",
                         weight_dtype: str = "float32", *, scale_dtype: str = "float16", max_threads: int = 128,
                         name: str = "moe_grouped_down") -> tirx.PrimFunc:
    """o[t, j, r] = h[t, j] . W[e, r] for every slot (t, j) routed to e, by expert (unweighted, fp32)."""
    E, M, H, K = int(experts), int(inter), int(hidden), int(top_k)
    _check(fmt, M)
    wshape, sshape = weight_shapes(fmt, E, H, M)
    cdtype = code_dtype(fmt, weight_dtype)
    outer, inner, threads = _loops(True, max_threads)

    @T.macro
    def body(h, offsets, order, codes, scales, out, seq_len):
        for wb in outer((E * H + threads - 1) // threads):
            for tx in inner(threads):
                if wb * threads + tx < E * H:
                    e = (wb * threads + tx) // H
                    r = (wb * threads + tx) % H
                    acc = T.alloc_local((1,), "float32")
                    for s in range(offsets[e + 1] - offsets[e]):
                        t = order[offsets[e] + s] // K
                        j = order[offsets[e] + s] % K
                        acc[0] = T.float32(0)
                        for kk in range(M):
                            acc[0] = acc[0] + T.Cast("float32", h[t, j, kk]) * _weight(fmt, codes, scales, e, r, kk)
                        out[t, j, r] = acc[0]

    return _finish(down_kernel(body, E, H, M, K, dtype, fmt, wshape, sshape, cdtype, scale_dtype), name, True)
