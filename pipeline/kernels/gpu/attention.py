"""GPU decode attention over the paged KV cache, split along the KV length, in place of TVM's kernel.

TVM 0.27's GPU decode kernel (`batch_decode_paged_kv`) gives each KV head one work-group walking the whole
sequence: 3 work-groups for SmolLM2 on a GPU of ~12 shader processors, a cross-thread reduction (barriers)
for every key's score, so that at 1K cached tokens it costs more than all the decode GEMVs together. This
one has the same name, signature and outputs (normalised output, lse in base 2 as the attention-state merge
expects), in two launches:

* split: one work-group per (sequence, KV head, part of the pages). `splits` parts per KV head give
  FILL_GROUPS work-groups for one sequence (4 per shader processor of an Adreno 750). The group's query heads
  (GQA) are in local memory; keys come in tiles of W: work-item t scores key t of the tile against every
  query head (each K row read once per work-group, fp32 sums), one barrier, then every work-item takes the
  tile's max per head from local memory and writes its key's weight 2^(s - max), a second barrier, then the
  V rows are summed with the weights: W / (D / VEC) keys in parallel, each key's V row read as D / VEC
  vectors (coalesced), once for all the query heads. Two barriers per W = 64 keys (TVM's: 10 barrier
  statements in its loop over 15-key tiles).
  The key lanes' outputs are added through local memory at the end; the part's unnormalised output, max
  and sum go to a workspace.
* merge: work-groups per (sequence, query head, chunk of its output columns) combine the parts with their
  maxima (flash-decoding); the columns are split so that one sequence gives FILL_GROUPS work-groups too.

It needs rotary_mode 0 (RoPE applied when K / Q are written: every model here) and a head size D with
D / VEC dividing W; other cases (and the sliding-window variant) keep TVM's kernel.
"""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

from pipeline.kernels.gpu import FILL_GROUPS

W = 64            # work-items per work-group of the split launch = keys per tile
VEC = 8           # elements of a K / V row per vector load (16 bytes of fp16)
METAL_VEC = 4     # Metal has no 8-wide float vectors
LOG2E = math.log2(math.e)
NEG = -5e4        # TVM's "minus infinity" for a running max
PLAN_ATTR = "pipeline.gpu_plan"   # the launch, for the coverage report's cost columns (report/gpu_cost.py)


def decode_splits(h_kv: int) -> int:
    """Parts of each KV head's pages: enough for FILL_GROUPS work-groups with one sequence, a power of two (a
    division by 3 or 12 of a value read from memory makes Oclgrind's clang emit `freeze`, which stops its
    uninitialised-value check)."""
    need = -(-FILL_GROUPS // h_kv)
    return 1 << max(0, need - 1).bit_length()


def merge_chunks(heads: int, lanes: int) -> int:
    """Parts of a head's output columns the merge launch splits over work-groups: the least power of two that
    gives FILL_GROUPS work-groups for one sequence (each group re-reads its head's few part maxima and sums),
    at most one per work-item."""
    need = -(-FILL_GROUPS // heads)
    return min(lanes, 1 << max(0, need - 1).bit_length())


def paged_decode_gpu(h_kv: int, h_q: int, d: int, dtype: str, page_size: int = 16, splits: int | None = None,
                     vec: int = VEC):
    """The split-KV decode attention (module docstring); signature of TVM's `batch_decode_paged_kv`. `vec`:
    elements per K / V load (Metal has no 8-wide float vectors: METAL_VEC there)."""
    group = h_q // h_kv
    lanes = d // vec        # work-items sharing one key's V row
    kp = W // lanes         # keys summed in parallel
    splits = splits or decode_splits(h_kv)
    parts = h_kv * splits
    chunks = merge_chunks(h_kv * group, lanes)
    scale = LOG2E

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
                              page_table_values_handle: T.handle, var_length_info: T.handle,
                              k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
                              output_handle: T.handle, lse_handle: T.handle, rotary_mode: T.int32,
                              rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        indptr_off = T.int32()
        values_off = T.int32()
        k_rope_off = T.int32()
        q_rope_off = T.int32()
        length_off = T.int32()
        q = T.match_buffer(q_handle, (B, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)   # no offset: aligned
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=indptr_off)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32", elem_offset=values_off)
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_off)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_off)  # noqa: F841 - in the signature, unused (no inline RoPE)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_off)  # noqa: F841 - in the signature, unused (no inline RoPE)
        output = T.match_buffer(output_handle, (B, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_q), "float32")
        assert rotary_mode == 0, "this attention kernel needs RoPE applied before it (RopeMode.NORMAL)"
        part_o = T.alloc_buffer((B, parts, group, d), "float32")   # unnormalised output of each part
        part_ml = T.alloc_buffer((B, parts, group, 2), "float32")  # its (max, sum of weights)
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for kv_head in T.thread_binding(h_kv, thread="blockIdx.y"):
                for split in T.thread_binding(splits, thread="blockIdx.z"):   # no division: see the merge
                    for tx in T.thread_binding(W, thread="threadIdx.x"):
                        with T.sblock("split"):
                            q_s = T.sblock_alloc_buffer((group * d,), "float32", scope="shared")
                            s_s = T.sblock_alloc_buffer((group * W,), "float32", scope="shared")
                            p_s = T.sblock_alloc_buffer((group * W,), "float32", scope="shared")
                            o_s = T.sblock_alloc_buffer((kp * group * d,), "float32", scope="shared")
                            l_s = T.sblock_alloc_buffer((kp * group,), "float32", scope="shared")
                            score = T.sblock_alloc_buffer((group,), "float32", scope="local")
                            acc = T.sblock_alloc_buffer((group * vec,), "float32", scope="local")
                            m = T.sblock_alloc_buffer((group,), "float32", scope="local")   # running max (same in all)
                            lsum = T.sblock_alloc_buffer((group,), "float32", scope="local")  # this key lane's sum
                            row = T.sblock_alloc_buffer((vec,), "float32", scope="local")
                            top = T.sblock_alloc_buffer((2,), "float32", scope="local")    # tile max, rescale
                            span = T.sblock_alloc_buffer((2,), "int32", scope="local")
                            first: T.let[T.int32] = page_table_indptr[bx]
                            n_pages: T.let[T.int32] = page_table_indptr[bx + 1] - first
                            n_keys: T.let[T.int32] = T.if_then_else(n_pages > 0, (n_pages - 1) * page_size
                                                                    + length_info[bx], 0)
                            per: T.let[T.int32] = (n_pages + splits - 1) // splits * page_size
                            # the part's keys [span[0], span[1]), kept in registers: as let-values TVM would expand
                            # every `key < span[1]` into two comparisons (which Oclgrind's clang turns into `freeze`)
                            span[0] = T.min(split * per, n_keys)
                            span[1] = T.min(span[0] + per, n_keys)
                            lane: T.let[T.int32] = tx // lanes      # key lane of the PV phase
                            col: T.let[T.int32] = tx % lanes * vec  # its first dim
                            for i in range((group * d + W - 1) // W):
                                if i * W + tx < group * d:
                                    q_s[i * W + tx] = T.Cast("float32", q[bx, kv_head * group + (i * W + tx) // d,
                                                                          (i * W + tx) % d]) * (sm_scale * scale)
                            for g in range(group):
                                m[g] = T.float32(NEG)
                                lsum[g] = T.float32(0)
                                for v in range(vec):
                                    acc[g * vec + v] = T.float32(0)
                            T.tvm_storage_sync("shared")
                            for tile in range((span[1] - span[0] + W - 1) // W):
                                key: T.let[T.int32] = span[0] + tile * W + tx
                                for g in range(group):
                                    score[g] = T.float32(0)
                                if key < span[1]:
                                    page: T.let[T.int32] = page_table_values[first + key // page_size]
                                    for x in range(d // vec):
                                        row[T.Ramp(0, 1, vec)] = T.Cast(f"float32x{vec}", pages[
                                            page, 0, kv_head, key % page_size, T.Ramp(x * vec, 1, vec)])
                                        for g in range(group):
                                            for v in T.unroll(vec):
                                                score[g] = score[g] + q_s[g * d + x * vec + v] * row[v]
                                for g in range(group):
                                    s_s[g * W + tx] = T.if_then_else(key < span[1], score[g], T.float32(NEG))
                                T.tvm_storage_sync("shared")
                                for g in range(group):
                                    top[0] = m[g]
                                    for j in range(W):
                                        top[0] = T.max(top[0], s_s[g * W + j])
                                    top[1] = T.exp2(m[g] - top[0])
                                    m[g] = top[0]
                                    lsum[g] = lsum[g] * top[1]
                                    for v in range(vec):
                                        acc[g * vec + v] = acc[g * vec + v] * top[1]
                                    p_s[g * W + tx] = T.if_then_else(key < span[1], T.exp2(score[g] - top[0]), T.float32(0))
                                T.tvm_storage_sync("shared")
                                for jj in range(W // kp):
                                    vkey: T.let[T.int32] = span[0] + tile * W + jj * kp + lane
                                    if vkey < span[1]:
                                        row[T.Ramp(0, 1, vec)] = T.Cast(f"float32x{vec}", pages[
                                            page_table_values[first + vkey // page_size], 1, kv_head, vkey % page_size,
                                            T.Ramp(col, 1, vec)])
                                        for g in range(group):
                                            lsum[g] = lsum[g] + p_s[g * W + jj * kp + lane]
                                            for v in T.unroll(vec):
                                                acc[g * vec + v] = acc[g * vec + v] + p_s[g * W + jj * kp + lane] * row[v]
                            for g in range(group):
                                for v in range(vec):
                                    o_s[(lane * group + g) * d + col + v] = acc[g * vec + v]
                                if col == 0:
                                    l_s[lane * group + g] = lsum[g]
                            T.tvm_storage_sync("shared")
                            if tx < lanes:
                                for g in range(group):
                                    for v in range(vec):
                                        acc[g * vec + v] = T.float32(0)
                                        for r in range(kp):
                                            acc[g * vec + v] = acc[g * vec + v] + o_s[(r * group + g) * d + col + v]
                                        part_o[bx, kv_head * splits + split, g, col + v] = acc[g * vec + v]
                                    if tx == 0:
                                        lsum[g] = T.float32(0)
                                        for r in range(kp):
                                            lsum[g] = lsum[g] + l_s[r * group + g]
                                        part_ml[bx, kv_head * splits + split, g, 0] = m[g]
                                        part_ml[bx, kv_head * splits + split, g, 1] = lsum[g]
        for bx in T.thread_binding(B, thread="blockIdx.x"):
            for head_cols in T.thread_binding(h_kv * chunks, thread="blockIdx.y"):   # chunks: a power of two
                for g in T.thread_binding(group, thread="blockIdx.z"):   # no h // group: Oclgrind stops on it
                    for lane in T.thread_binding(lanes // chunks, thread="threadIdx.x"):
                        with T.sblock("merge"):
                            kv_head: T.let[T.int32] = head_cols // chunks
                            tx: T.let[T.int32] = head_cols % chunks * (lanes // chunks) + lane
                            st = T.sblock_alloc_buffer((3,), "float32", scope="local")   # max, sum, a part's weight
                            o = T.sblock_alloc_buffer((vec,), "float32", scope="local")
                            st[0] = T.float32(NEG)
                            for s in range(splits):
                                if part_ml[bx, kv_head * splits + s, g, 1] > T.float32(0):
                                    st[0] = T.max(st[0], part_ml[bx, kv_head * splits + s, g, 0])
                            st[1] = T.float32(0)
                            for v in range(vec):
                                o[v] = T.float32(0)
                            for s in range(splits):
                                if part_ml[bx, kv_head * splits + s, g, 1] > T.float32(0):
                                    st[2] = T.exp2(part_ml[bx, kv_head * splits + s, g, 0] - st[0])
                                    st[1] = st[1] + part_ml[bx, kv_head * splits + s, g, 1] * st[2]
                                    for v in range(vec):
                                        o[v] = o[v] + part_o[bx, kv_head * splits + s, g, tx * vec + v] * st[2]
                            for v in T.vectorized(vec):
                                output[bx, kv_head * group + g, tx * vec + v] = T.Cast(dtype, T.if_then_else(
                                    st[1] > T.float32(0), o[v] / st[1], T.float32(0)))
                            if tx == 0:
                                lse[bx, kv_head * group + g] = T.if_then_else(
                                    st[1] > T.float32(0), st[0] + T.log2(st[1]), T.float32(NEG))

    # for the coverage report (report/gpu_cost.py): the split launch streams the KV rows; its barriers
    plan = {"work_groups": parts, "work_items": W, "streaming": "split", "splits": splits,
            "merge_work_groups": h_kv * chunks * group, "merge_work_items": lanes // chunks,
            "barriers": f"split: 2 + 2 per {W} keys; merge: 0"}
    return batch_decode_paged_kv.with_attr(PLAN_ATTR, plan)


def _static(dims) -> list[int] | None:
    out = []
    for x in dims:
        if not isinstance(x, tvm.tirx.IntImm):
            return None
        out.append(int(x))
    return out


def decode_for(func: tvm.tirx.PrimFunc, kind: str = "opencl"):
    """Our split-KV kernel for TVM's non-sliding-window GPU decode `func`, or None (shapes it does not cover)."""
    q, pages = func.params[:2]
    length_info = func.params[4]
    qd, pd = _static(q.shape[1:]), _static(pages.shape[1:])
    if not (qd and pd) or len(length_info.shape) != 1 or pd[0] != 2 or qd[1] != pd[3] or qd[0] % pd[1]:
        return None
    d, vec = qd[1], METAL_VEC if kind == "metal" else VEC
    if d % vec or W % (d // vec):
        return None
    return paged_decode_gpu(pd[1], qd[0], d, str(q.dtype), page_size=pd[2], vec=vec)


GPU_KINDS = ("opencl", "metal")


@tvm.transform.module_pass(opt_level=0, name="ReplaceGPUDecodeAttention")
def replace_gpu_attention(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Swap TVM's GPU decode attention for the split-KV kernel above (same name, signature and attributes)
    when compiling for an OpenCL or Metal target; shapes it does not cover keep TVM's."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name not in GPU_KINDS:
        return mod
    for gv, func in list(mod.functions_items()):
        if gv.name_hint != "batch_decode_paged_kv" or not isinstance(func, tvm.tirx.PrimFunc) \
                or len(func.params) != 13:
            continue
        fast = decode_for(func, target.kind.name)
        if fast is None:
            continue
        for key, value in func.attrs.items():
            fast = fast.with_attr(key, value)
        mod[gv] = fast.with_attr("mlp.kernel", "gpu_split_kv_attention")
    return mod
