"""GPU decode step of the gated delta rule (Gated DeltaNet), state tiles per work-group.

The math is `models/gdn_kernels.py`'s (per value head h with its fp32 state S [Dk, Dv]: decay by exp(g),
kv_mem = S^T k, delta = (v - kv_mem) * beta, S += outer(k, delta), o = S^T q * scale). Decode is a pass over
the state: qwen27b's 48 value heads x 128 x 128 fp32 are 3 MiB per GDN layer read and 3 MiB written per
token, 48 layers. The loop kernel gave one work-item a whole state column (a `float[128]` private array, more
than a work-item's registers: clang for an AMD GPU spills it, docs/kernels.md) and one work-group per head. Here:

* a work-group owns one value head's column tile of TC = L x VC columns, all Dk rows; L column lanes of
  VC (4: one 16-byte `float4` load / store of the state) x RG row groups of work-items. A work-item keeps
  RPT = Dk / RG rows x VC columns of the state in registers (qwen27b: 8 x 4 = 32 floats; every index
  constant after unrolling), reads them once, writes them once;
* the two sums over Dk go through local memory: each work-item's partial kv_mem of its VC columns, a
  barrier, then every work-item of a lane adds the RG partials in the same order (the same delta in each,
  no barrier to hand it out); its partial o, a barrier, and the lane's first row group adds them. 3
  barriers in the kernel: TVM's storage rewrite puts o's partials in kv_mem's local memory and its thread
  sync a barrier before they are written (two buffers or one of twice the size: the same);
* L shrinks (TC = 32, 16, 8 columns) until the launch has FILL_GROUPS work-groups where the heads allow
  (qwen27b: 48 heads x 4 tiles = 192 of 128 work-items); the grid is (column tile, value head of the key
  head's group, key head), so no division by the GQA group (3 for qwen27b: Oclgrind stops on it);
* every sum is fp32; q / k / v are widened on load, only o is stored in the activation dtype.

Each state element is read and written by the same work-item, read first, so `state_out` may alias
`state_in`. Columns past Dv and rows past Dk are guarded (zeros in the sums).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from pipeline.kernels.gpu import FILL_GROUPS

ROWS = 8           # state rows per work-item aimed for (x VC columns: 32 floats of registers at VC 4)
PLAN_ATTR = "pipeline.gpu_plan"   # the launch, for the coverage report's cost columns (report/gpu_cost.py)


@dataclass(frozen=True)
class Plan:
    """vc columns per vector, lanes x vc = the tile's columns, row_groups x rows >= Dk, tiles per head."""

    vc: int
    lanes: int
    row_groups: int
    rows: int
    tiles: int
    groups: int

    @property
    def work_items(self) -> int:
        return self.lanes * self.row_groups


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def plan(hv: int, dk: int, dv: int, max_threads: int = 256) -> Plan:
    """The tile of each work-group (module docstring)."""
    vc = 4 if dv % 4 == 0 else 2 if dv % 2 == 0 else 1
    widest = min(8, _pow2_at_least(-(-dv // vc)))
    lanes = next((n for n in (8, 4, 2) if n <= widest and hv * -(-dv // (n * vc)) >= FILL_GROUPS),
                 min(2, widest))
    lanes = max(1, min(lanes, max_threads))
    row_groups = max(1, min(_pow2_at_least(-(-dk // ROWS)), max_threads // lanes))
    tiles = -(-dv // (lanes * vc))
    return Plan(vc, lanes, row_groups, -(-dk // row_groups), tiles, hv * tiles)


def gdn_decode_gpu(Hk: int, Hv: int, Dk: int, Dv: int, dtype: str, scale: float, gate_dtype: str,
                   max_threads: int = 256) -> tirx.PrimFunc:
    """One-token gated delta rule, buffers as `gdn_kernels.gdn_decode` (q, k, v, g, beta, state_in, o, state_out),
    scheduled for a GPU (`tirx.is_scheduled`)."""
    p = plan(Hv, Dk, Dv, max_threads)
    group, vc, lanes, rg, rows, tiles = Hv // Hk, p.vc, p.lanes, p.row_groups, p.rows, p.tiles
    tc = lanes * vc
    col_guard, row_guard = Dv % tc != 0, Dk % rg != 0

    @T.prim_func(s_tir=True)
    def gdn_decode(q: T.Buffer((Hk, Dk), dtype), k: T.Buffer((Hk, Dk), dtype), v: T.Buffer((Hv, Dv), dtype),
                   g: T.Buffer((Hv,), gate_dtype), beta: T.Buffer((Hv,), gate_dtype),
                   state_in: T.Buffer((Hv, Dk, Dv), "float32"), o: T.Buffer((Hv, Dv), dtype),
                   state_out: T.Buffer((Hv, Dk, Dv), "float32")):
        T.func_attr({"tirx.is_scheduled": True})
        for tile in T.thread_binding(tiles, thread="blockIdx.x"):
            for gi in T.thread_binding(group, thread="blockIdx.y"):
                for kh in T.thread_binding(Hk, thread="blockIdx.z"):
                    for ry in T.thread_binding(rg, thread="threadIdx.y"):
                        for lx in T.thread_binding(lanes, thread="threadIdx.x"):
                            with T.sblock("gdn_decode_tile"):
                                # partial sums over the row groups (TVM's storage rewrite gives o's the same
                                # local memory as kv_mem's, and its thread sync a barrier before o's writes)
                                part_kv = T.sblock_alloc_buffer((rg * tc,), "float32", scope="shared")
                                part_o = T.sblock_alloc_buffer((rg * tc,), "float32", scope="shared")
                                st = T.sblock_alloc_buffer((rows * vc,), "float32", scope="local")
                                kr = T.sblock_alloc_buffer((rows,), "float32", scope="local")
                                qr = T.sblock_alloc_buffer((rows,), "float32", scope="local")
                                acc = T.sblock_alloc_buffer((vc,), "float32", scope="local")
                                delta = T.sblock_alloc_buffer((vc,), "float32", scope="local")
                                h: T.let[T.int32] = kh * group + gi
                                col: T.let[T.int32] = tile * tc + lx * vc
                                decay: T.let[T.float32] = T.exp(T.Cast("float32", g[h]))
                                for c in T.unroll(vc):
                                    acc[c] = T.float32(0)
                                for r in T.unroll(rows):
                                    if ((not row_guard) or r * rg + ry < Dk) and ((not col_guard) or col < Dv):
                                        kr[r] = T.Cast("float32", k[kh, r * rg + ry])
                                        qr[r] = T.Cast("float32", q[kh, r * rg + ry])
                                        for c in T.vectorized(vc):
                                            st[r * vc + c] = state_in[h, r * rg + ry, col + c] * decay
                                        for c in T.unroll(vc):
                                            acc[c] = acc[c] + st[r * vc + c] * kr[r]
                                for c in T.unroll(vc):
                                    part_kv[ry * tc + lx * vc + c] = acc[c]
                                T.tvm_storage_sync("shared")
                                for c in T.unroll(vc):
                                    acc[c] = T.float32(0)
                                    for j in range(rg):
                                        acc[c] = acc[c] + part_kv[j * tc + lx * vc + c]
                                    delta[c] = T.float32(0)
                                    if (not col_guard) or col < Dv:
                                        delta[c] = (T.Cast("float32", v[h, col + c]) - acc[c]) \
                                            * T.Cast("float32", beta[h])
                                    acc[c] = T.float32(0)
                                for r in T.unroll(rows):
                                    if ((not row_guard) or r * rg + ry < Dk) and ((not col_guard) or col < Dv):
                                        for c in T.unroll(vc):
                                            st[r * vc + c] = st[r * vc + c] + kr[r] * delta[c]
                                            acc[c] = acc[c] + st[r * vc + c] * qr[r]
                                        for c in T.vectorized(vc):
                                            state_out[h, r * rg + ry, col + c] = st[r * vc + c]
                                for c in T.unroll(vc):
                                    part_o[ry * tc + lx * vc + c] = acc[c]
                                T.tvm_storage_sync("shared")
                                if ry == 0 and ((not col_guard) or col < Dv):
                                    for c in T.unroll(vc):
                                        acc[c] = T.float32(0)
                                        for j in range(rg):
                                            acc[c] = acc[c] + part_o[j * tc + lx * vc + c]
                                        o[h, col + c] = T.Cast(dtype, acc[c] * T.float32(scale))

    launch = {"work_groups": p.groups, "work_items": p.work_items, "loads": rows, "load_bytes": 4 * vc,
              "barriers": 3, "state_floats_per_work_item": rows * vc}
    return gdn_decode.with_attr(PLAN_ATTR, launch)
