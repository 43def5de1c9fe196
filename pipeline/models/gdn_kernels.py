"""TIR kernels for the gated delta rule recurrence of Gated DeltaNet (GDN) layers (Qwen3.5 / Qwen3-Next).

Per value head ``h`` (``Hv`` value heads; key head ``h // (Hv // Hk)`` provides q and k), with the fp32 state
``S[h]`` of shape ``[Dk, Dv]`` and, for every token ``t``::

    S      = S * exp(g[t, h])                      # g is a log-space decay (g <= 0 in the model)
    kv_mem = S^T k_t                               # [Dv]
    delta  = (v_t - kv_mem) * beta[t, h]
    S      = S + outer(k_t, delta)
    o_t    = (S^T q_t) * scale                     # scale = Dk ** -0.5 by default

This is transformers' ``torch_recurrent_gated_delta_rule`` (``models/qwen3_5/modeling_qwen3_5.py``): q and
k are L2-normalised before the recurrence (the model does that, the kernels take normalised inputs), then
q is divided by ``sqrt(Dk)``; ``g = -exp(A_log) * softplus(a + dt_bias)`` and the state is multiplied by
``exp(g)`` before the delta update of each token. The chunked form in transformers computes the same.

Every (value head, value column ``j``) pair is independent given the column ``S[h, :, j]``: one work item
per pair keeps its ``Dk`` column in local (private) memory and scans the tokens sequentially, so the
prefill kernel is exact, not a chunked approximation. The same TIR serves both CPU and GPU: with
``gpu=True`` the (head, column-block) loop is bound to ``blockIdx.x`` and the column loop to
``threadIdx.x`` and the function is marked ``tirx.is_scheduled`` (dlight leaves it alone); with
``gpu=False`` the head loop is ``parallel`` for LLVM. The CPU variant is plain loop TIR without sblocks,
so dlight does not schedule it: on a GPU target build the ``gpu=True`` variant (a thread-bound function
cannot be built for LLVM). Work items per block are ``min(Dv, max_threads)`` with a guard when that does
not divide ``Dv``. Not tuned: each work item keeps ``Dk`` floats in private memory and every work item of a
head re-reads the same q/k rows (served by the cache), acceptable for a sequential, token-by-token prefill.
The GPU decode step is not this loop kernel: ``gdn_decode(gpu=True)`` is ``kernels/gpu/gdn.py``'s, with
the state split into tiles per work-group held in registers (a 128-float private column per work item is
more than a GPU work item's registers, and 48 heads were 48 work-groups).

Buffers (``dtype`` for activations, float32 for the state; g and beta in ``gate_dtype``, default ``dtype`` —
the model passes float32 so the log-space decay keeps its precision under fp16 activations)::

    gdn_decode:  q [Hk, Dk], k [Hk, Dk], v [Hv, Dv], g [Hv], beta [Hv],
                 state_in [Hv, Dk, Dv] f32  ->  o [Hv, Dv], state_out [Hv, Dk, Dv] f32
    gdn_prefill: q [n, Hk, Dk], k [n, Hk, Dk], v [n, Hv, Dv], g [n, Hv], beta [n, Hv],
                 state_in [Hv, Dk, Dv] f32  ->  o [n, Hv, Dv], state_out [Hv, Dk, Dv] f32

``state_out`` may alias ``state_in`` (every work item reads its whole column before writing it back), so
a caller may update the state in place; the output buffers are the last two parameters, which is the
``call_tir`` convention (``out_ty=[o, state]``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from pipeline.kernels.gpu.gdn import gdn_decode_gpu

__all__ = ["gdn_decode", "gdn_prefill", "gdn_reference", "gdn_segments"]


def _check(Hk: int, Hv: int, Dk: int, Dv: int) -> None:
    for name, value in (("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv)):
        if int(value) <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if Hv % Hk:
        raise ValueError(f"the number of value heads ({Hv}) must be a multiple of the key heads ({Hk})")


def _setup(Hk: int, Hv: int, Dk: int, Dv: int, scale: float | None, gpu: bool, max_threads: int):
    """What both kernels need before their body: value heads per key head, the output scale, the loop
    constructors and extents of the (head x column-block, column-in-block) loops, and whether the last
    column block needs a bounds guard."""
    _check(Hk, Hv, Dk, Dv)
    threads = min(Dv, max_threads)
    blocks_per_head = -(-Dv // threads)
    if gpu:
        outer = functools.partial(T.thread_binding, thread="blockIdx.x")
        inner = functools.partial(T.thread_binding, thread="threadIdx.x")
    else:
        outer, inner = T.parallel, T.serial
    scale = float(Dk) ** -0.5 if scale is None else float(scale)
    return Hv // Hk, scale, outer, inner, threads, blocks_per_head, Dv % threads != 0


def _finish(func: tirx.PrimFunc, name: str, gpu: bool) -> tirx.PrimFunc:
    # TVMScript would name it after the Python function; keep it equal to the intended module key.
    func = func.with_attr("global_symbol", name)
    if gpu:
        func = func.with_attr("tirx.is_scheduled", True)
    return func


def gdn_decode(Hk: int, Hv: int, Dk: int, Dv: int, dtype: str = "float32", *, scale: float | None = None,
               gpu: bool = False, max_threads: int = 128, name: str = "gdn_decode",
               gate_dtype: str | None = None) -> tirx.PrimFunc:
    """One-token gated delta rule step (see the module docstring for buffers and math)."""
    gdt = gate_dtype or dtype
    group, scale, outer, inner, threads, bph, guard = _setup(Hk, Hv, Dk, Dv, scale, gpu, max_threads)
    if gpu:   # state tiles per work-group (kernels/gpu/gdn.py); the loop kernel below is the CPU one
        return _finish(gdn_decode_gpu(Hk, Hv, Dk, Dv, dtype, scale, gdt, max_threads), name, gpu)

    @T.prim_func
    def gdn_decode_func(q: T.Buffer((Hk, Dk), dtype), k: T.Buffer((Hk, Dk), dtype),
                        v: T.Buffer((Hv, Dv), dtype), g: T.Buffer((Hv,), gdt), beta: T.Buffer((Hv,), gdt),
                        state_in: T.Buffer((Hv, Dk, Dv), "float32"), o: T.Buffer((Hv, Dv), dtype),
                        state_out: T.Buffer((Hv, Dk, Dv), "float32")):
        for hb in outer(Hv * bph):
            for tx in inner(threads):
                if (not guard) or (hb % bph) * threads + tx < Dv:
                    h = hb // bph
                    j = (hb % bph) * threads + tx
                    kh = h // group
                    col = T.alloc_local((Dk,), "float32")
                    decay = T.exp(T.Cast("float32", g[h]))
                    mem = T.float32(0)
                    for i in range(Dk):
                        col[i] = state_in[h, i, j] * decay
                        mem = mem + col[i] * T.Cast("float32", k[kh, i])
                    delta = (T.Cast("float32", v[h, j]) - mem) * T.Cast("float32", beta[h])
                    acc = T.float32(0)
                    for i in range(Dk):
                        col[i] = col[i] + T.Cast("float32", k[kh, i]) * delta
                        acc = acc + col[i] * T.Cast("float32", q[kh, i])
                        state_out[h, i, j] = col[i]
                    o[h, j] = T.Cast(dtype, acc * T.float32(scale))

    return _finish(gdn_decode_func, name, gpu)


def gdn_prefill(Hk: int, Hv: int, Dk: int, Dv: int, dtype: str = "float32", *, scale: float | None = None,
                gpu: bool = False, max_threads: int = 128, name: str = "gdn_prefill",
                gate_dtype: str | None = None) -> tirx.PrimFunc:
    """Exact gated delta rule over a symbolic number of tokens ``n`` (sequential scan per work item)."""
    gdt = gate_dtype or dtype
    group, scale, outer, inner, threads, bph, guard = _setup(Hk, Hv, Dk, Dv, scale, gpu, max_threads)

    @T.prim_func
    def gdn_prefill_func(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, beta_h: T.handle,
                         state_in: T.Buffer((Hv, Dk, Dv), "float32"), o_h: T.handle,
                         state_out: T.Buffer((Hv, Dk, Dv), "float32")):
        n = T.int64()
        q = T.match_buffer(q_h, (n, Hk, Dk), dtype)
        k = T.match_buffer(k_h, (n, Hk, Dk), dtype)
        v = T.match_buffer(v_h, (n, Hv, Dv), dtype)
        g = T.match_buffer(g_h, (n, Hv), gdt)
        beta = T.match_buffer(beta_h, (n, Hv), gdt)
        o = T.match_buffer(o_h, (n, Hv, Dv), dtype)
        for hb in outer(Hv * bph):
            for tx in inner(threads):
                if (not guard) or (hb % bph) * threads + tx < Dv:
                    h = hb // bph
                    j = (hb % bph) * threads + tx
                    kh = h // group
                    col = T.alloc_local((Dk,), "float32")
                    for i in range(Dk):
                        col[i] = state_in[h, i, j]
                    for t in range(n):
                        decay = T.exp(T.Cast("float32", g[t, h]))
                        mem = T.float32(0)
                        for i in range(Dk):
                            col[i] = col[i] * decay
                            mem = mem + col[i] * T.Cast("float32", k[t, kh, i])
                        delta = (T.Cast("float32", v[t, h, j]) - mem) * T.Cast("float32", beta[t, h])
                        acc = T.float32(0)
                        for i in range(Dk):
                            col[i] = col[i] + T.Cast("float32", k[t, kh, i]) * delta
                            acc = acc + col[i] * T.Cast("float32", q[t, kh, i])
                        o[t, h, j] = T.Cast(dtype, acc * T.float32(scale))
                    for i in range(Dk):
                        state_out[h, i, j] = col[i]

    return _finish(gdn_prefill_func, name, gpu)


def gdn_reference(q, k, v, g, beta, state, scale: float | None = None):
    """NumPy float64 reference of the recurrence; q/k [n, Hk, Dk], v [n, Hv, Dv], g/beta [n, Hv].

    Returns ``(o [n, Hv, Dv], final state [Hv, Dk, Dv])`` as float64 arrays.
    """
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    s = np.array(state, dtype=np.float64, copy=True)
    n, hk, dk = k.shape
    hv = v.shape[1]
    group = hv // hk
    scale = dk ** -0.5 if scale is None else scale
    o = np.zeros(v.shape, dtype=np.float64)
    for t in range(n):
        for h in range(hv):
            kt, qt = k[t, h // group], q[t, h // group]
            s[h] *= math.exp(g[t, h])
            delta = (v[t, h] - kt @ s[h]) * beta[t, h]
            s[h] += np.outer(kt, delta)
            o[t, h] = (qt @ s[h]) * scale
    return o, s


def gdn_segments(Hk: int, Hv: int, Dk: int, Dv: int, dtype: str = "float32", *, scale: float | None = None,
                 gpu: bool = False, max_threads: int = 128, name: str = "gdn_segments",
                 gate_dtype: str | None = None) -> tirx.PrimFunc:
    """gdn_prefill over a chunk of ``b`` sequences back to back (MLC's batch_prefill / batch_decode): token
    rows ``[ends[s-1] + 1, ends[s]]`` are sequence ``s``, scanned from its own state ``state_in[s]``.

    Buffers: q/k [n, Hk, Dk], v [n, Hv, Dv], g/beta [n, Hv], state_in [b, Hv, Dk, Dv] f32, ends [b] int32
    -> o [n, Hv, Dv], state_out [b, Hv, Dk, Dv] f32. One work item per (sequence, head, column)."""
    gdt = gate_dtype or dtype
    group, scale, outer, inner, threads, bph, guard = _setup(Hk, Hv, Dk, Dv, scale, gpu, max_threads)

    @T.prim_func
    def gdn_segments_func(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, beta_h: T.handle,
                          state_in_h: T.handle, ends_h: T.handle, o_h: T.handle, state_out_h: T.handle):
        n, b = T.int64(), T.int64()
        q = T.match_buffer(q_h, (n, Hk, Dk), dtype)
        k = T.match_buffer(k_h, (n, Hk, Dk), dtype)
        v = T.match_buffer(v_h, (n, Hv, Dv), dtype)
        g = T.match_buffer(g_h, (n, Hv), gdt)
        beta = T.match_buffer(beta_h, (n, Hv), gdt)
        state_in = T.match_buffer(state_in_h, (b, Hv, Dk, Dv), "float32")
        ends = T.match_buffer(ends_h, (b,), "int32")
        o = T.match_buffer(o_h, (n, Hv, Dv), dtype)
        state_out = T.match_buffer(state_out_h, (b, Hv, Dk, Dv), "float32")
        for shb in outer(b * Hv * bph):
            for tx in inner(threads):
                if (not guard) or (shb % bph) * threads + tx < Dv:
                    s = shb // (Hv * bph)
                    h = (shb // bph) % Hv
                    j = (shb % bph) * threads + tx
                    kh = h // group
                    start = T.if_then_else(s == 0, 0, ends[T.max(s, 1) - 1] + 1)
                    col = T.alloc_local((Dk,), "float32")
                    for i in range(Dk):
                        col[i] = state_in[s, h, i, j]
                    for t in range(T.Cast("int64", ends[s] + 1 - start)):
                        r = T.Cast("int64", start) + t
                        decay = T.exp(T.Cast("float32", g[r, h]))
                        mem = T.float32(0)
                        for i in range(Dk):
                            col[i] = col[i] * decay
                            mem = mem + col[i] * T.Cast("float32", k[r, kh, i])
                        delta = (T.Cast("float32", v[r, h, j]) - mem) * T.Cast("float32", beta[r, h])
                        acc = T.float32(0)
                        for i in range(Dk):
                            col[i] = col[i] + T.Cast("float32", k[r, kh, i]) * delta
                            acc = acc + col[i] * T.Cast("float32", q[r, kh, i])
                        o[r, h, j] = T.Cast(dtype, acc * T.float32(scale))
                    for i in range(Dk):
                        state_out[s, h, i, j] = col[i]

    return _finish(gdn_segments_func, name, gpu)
