"""Replacements for TVM library kernels that are wrong under the OpenCL memory model.

TVM 0.27's GPU attention-state merge (`tir_attention_merge_state`, used by the paged KV cache to combine
attention over cached pages with attention over new tokens) lets every work-item of a head read the
head's log-sum-exp S[n, h] and then write it, with no barrier between. It gives the right answer only
when those work-items run in lockstep (one GPU wave, as on Adreno today); PoCL, which runs them one
after another, shows the race (execution.py's KV runs; tests/test_kernel_fixes.py pins it). The
replacement below computes the same merge with one work-item reading S and S_other into local memory and,
after a barrier, the only one to write S: its result does not depend on how the driver schedules
work-items. (A first version let every work-item read S from global memory and one write it after a
`barrier(CLK_LOCAL_MEM_FENCE)`, which orders only local memory: Oclgrind reported that as a global-memory
race, pipeline/verify/oclgrind.py.)

On LLVM (CPU) targets, TVM's script-written KV-cache kernels come without `tirx.noalias`, and one such
function in the module makes LLVM leave every other kernel of the library unvectorized: SmolLM2's decode
GEMV went from 0.14 ms compiled alone to 3.5 ms compiled beside `tree_attn_paged_kv_cpu`. Their buffer
arguments are distinct tensors (pages, queries, outputs, position maps), so they are marked noalias too.

TVM's KV append (`tir_kv_cache_transpose_append`) tests `position_map[token] != -1` outside its block, so
once the GPU schedule fuses (token, head, element) over 256-wide work-groups, the work-items past the last
element read `position_map` beyond its end before the bounds check (Oclgrind: one invalid read per such
work-item of every prefill and decode step). `bounded_transpose_append` checks the bound first.

TVM's tree-attention kernels (`batch_tree_attn`, `tree_attn_paged_kv`: speculative decoding, which MLC's engine
calls with a draft model) evaluate their tree-order test for the padding query rows of the last 32-row tile
too, reading the tree table (`mask` / `tree_order`, [rows, 2] int32) past its end (Oclgrind: 126 invalid
reads per call on SmolLM2's shape); the result is discarded, but an out-of-bounds read on a phone GPU can fault.
`bounded_table_reads` keeps their code and makes each read of that table yield 0 outside its rows (a lazy
`?:` in the OpenCL C: the load happens only in range).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm.script import tirx as T
from tvm_ffi.structural import structural_map

from pipeline.kernels.cpu.attention import append_shapes

TABLES_READ_PAST_END = {"batch_tree_attn": "mask", "tree_attn_paged_kv": "tree_order"}   # kernel: its table
RACY_MERGE_STATE = ("tir_attention_merge_state", "tir_attention_merge_state_mla")
UNBOUNDED_APPEND = "tir_kv_cache_transpose_append"
THREADS = 32   # work-items per head, striding over the head dimension
APPEND_THREADS = 256   # work-items per work-group of the KV append: one element of K and of V each


def race_free_merge_state(v_dtype: str, threads: int = THREADS):
    """V <- (V * 2^S + V_other * 2^S_other) / (2^S + 2^S_other), S <- log2(2^S + 2^S_other), per (n, head).

    One work-group per (n, head); S is read by all work-items before the barrier and written by
    work-item 0 after it."""

    @T.prim_func(s_tir=True)
    def merge_state(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        N, H, D = T.int32(), T.int32(), T.int32()
        V = T.match_buffer(v, (N, H, D), v_dtype)
        S = T.match_buffer(s, (N, H), "float32")
        V_other = T.match_buffer(v_other, (N, H, D), v_dtype)
        S_other = T.match_buffer(s_other, (N, H), "float32")
        for bx in T.thread_binding(N, thread="blockIdx.x"):
            for by in T.thread_binding(H, thread="blockIdx.y"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    with T.sblock("merge"):
                        m = T.sblock_alloc_buffer((3,), "float32", scope="local")   # max, 2^(S-max), 2^(So-max)
                        both = T.sblock_alloc_buffer((2,), "float32", scope="shared")   # S, S_other
                        if tx == 0:
                            both[0] = S[bx, by]
                            both[1] = S_other[bx, by]
                        T.tvm_storage_sync("shared")
                        m[0] = T.max(both[0], both[1])
                        m[1] = T.exp2(both[0] - m[0])
                        m[2] = T.exp2(both[1] - m[0])
                        for i in range(T.ceildiv(D, threads)):
                            if i * threads + tx < D:
                                V[bx, by, i * threads + tx] = T.Cast(
                                    v_dtype,
                                    (T.Cast("float32", V[bx, by, i * threads + tx]) * m[1]
                                     + T.Cast("float32", V_other[bx, by, i * threads + tx]) * m[2]) / (m[1] + m[2]))
                        if tx == 0:
                            S[bx, by] = T.log2(m[1] + m[2]) + m[0]

    return merge_state


def bounded_transpose_append(h_kv: int, d: int, dtype: str, page_size: int = 16):
    """Copy each new token's K and V into its page slot (position -1: not stored), one work-item per
    (token, head, element), the bounds check before any read. Signature of TVM's kernel."""

    @T.prim_func(s_tir=True)
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
        for bx in T.thread_binding(T.ceildiv(ntoken * (h_kv * d), APPEND_THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(APPEND_THREADS, thread="threadIdx.x"):
                with T.sblock("append"):
                    T.reads()
                    T.writes()
                    i: T.let[T.int64] = bx * APPEND_THREADS + tx
                    if i < ntoken * (h_kv * d):
                        t: T.let[T.int64] = i // (h_kv * d)
                        h: T.let[T.int64] = i % (h_kv * d) // d
                        f: T.let[T.int64] = i % d
                        position: T.let[T.int32] = position_map[t]
                        if position != -1:
                            pages[T.floordiv(position, page_size), 0, h, T.floormod(position, page_size), f] = \
                                k_data[t, h, f]
                            pages[T.floordiv(position, page_size), 1, h, T.floormod(position, page_size), f] = \
                                v_data[t, h, f]

    return tir_kv_cache_transpose_append


def bounded_table_reads(func: tirx.PrimFunc, table_name: str) -> tirx.PrimFunc:
    """`func` with every load of its parameter buffer `table_name` guarded by the buffer's row count."""

    def guard(node: TensorLoad):   # TVM 0.27's buffer load: `source` is the buffer's variable
        if node.source.name != table_name:
            return node
        row = node.indices[0]
        index_dtype = str(row.ty.dtype)
        rows = tirx.Cast(index_dtype, node.source.ty.shape[0])
        return tirx.if_then_else(tirx.all(row >= tirx.const(0, index_dtype), row < rows), node,
                                 tirx.const(0, str(node.ty.dtype)))

    return func.with_body(structural_map(func.body, [(TensorLoad, guard)]))


@tvm.transform.module_pass(opt_level=0, name="MarkNoAlias")
def mark_noalias(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Give the PrimFuncs that lack it `tirx.noalias` when compiling for an LLVM target (see above)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return mod
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tvm.tirx.PrimFunc) and not (func.attrs and "tirx.noalias" in func.attrs):
            mod[gv] = func.with_attr("tirx.noalias", True)
    return mod


@tvm.transform.module_pass(opt_level=0, name="ReplaceRacyKernels")
def replace_racy_kernels(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Swap the GPU merge-state kernels for race_free_merge_state and TVM's KV append for
    bounded_transpose_append (same name, signature and attributes); guard the tree-attention kernels' table
    reads (bounded_table_reads). LLVM targets keep theirs (their KV append
    is replaced by kernels/cpu/attention.py)."""
    target = tvm.target.Target.current(allow_none=True)
    gpu = target is not None and target.kind.name != "llvm"
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        shapes = append_shapes(func) if gv.name_hint == UNBOUNDED_APPEND and gpu else None
        if shapes is not None:
            h_kv, d, page_size = shapes
            fixed = bounded_transpose_append(h_kv, d, str(func.params[1].dtype), page_size)
        elif gv.name_hint in RACY_MERGE_STATE:
            fixed = race_free_merge_state(str(func.params[0].dtype))
        elif gv.name_hint in TABLES_READ_PAST_END and gpu:
            mod[gv] = bounded_table_reads(func, TABLES_READ_PAST_END[gv.name_hint])
            continue
        else:
            continue
        for key, value in func.attrs.items():
            fixed = fixed.with_attr(key, value)
        mod[gv] = fixed
    return mod
