"""The GPU fallback schedule, with each launch's work-group size chosen so that a decode launch fills the GPU.

dlight's Fallback maps the spatial loops of every block that no other rule takes (splits, gathers, the GDN
conv1d step and gates, elementwise tails) onto work-groups of the target's maximum size, 256 work-items on
Adreno. At one token those launches are small: qwen27b's 10240-channel conv1d step made 40 work-groups, a
2048-wide split 8, where an Adreno 750 wants FILL_GROUPS = 48 (4 per shader processor, 12 SPs). Here each
block's fused spatial extent n picks its own size: the largest power of two with n / size >= FILL_GROUPS,
between MIN_THREADS (one 32-wide half wave: smaller groups waste the wave they occupy) and the target's
maximum. A launch of fewer than FILL_GROUPS x MIN_THREADS elements (qwen27b's 48 gates) cannot fill the GPU
with useful work-items at all and gets one group per MIN_THREADS elements. A symbolic extent (a prompt's
tokens) keeps the maximum size.

The mapping itself is dlight's (inline what can be inlined, fuse the spatial loops, split into blockIdx.x /
threadIdx.x, reductions decomposed): only the split factor differs per block. A kernel with a block this rule
does not map (no loops, or threads of its own) is left to dlight's Fallback, the next rule in the list.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight import base as dl_base
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from pipeline.kernels.gpu import FILL_GROUPS

MIN_THREADS = 32


def group_size(extent: int | None, max_threads: int) -> int:
    """Work-items per work-group for a launch of `extent` elements (None: symbolic), module docstring."""
    if extent is None:
        return max_threads
    size = MIN_THREADS
    while size * 2 <= max_threads and extent // (size * 2) >= FILL_GROUPS:
        size *= 2
    return size


class GPUFillFallback(GPUScheduleRule):
    """Every block's spatial loops onto work-groups sized to fill the GPU at their extent (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        max_threads = dl_base.max_threads_per_block(target)
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline(sch, infos)
        reductions = []
        for info in infos:
            block = info.block_rv
            loops = sch.get_loops(block)
            if not loops or any(sch.get(loop).thread_binding is not None for loop in loops):
                return None   # a scalar block or one that binds its own threads: dlight's Fallback's case
            kinds: dict[str, list] = {"S": [], "R": [], "O": []}
            for loop, kind in zip(loops, info.dom_kind(), strict=False):
                kinds[kind].append(loop)
            spatial = kinds["S"] or [sch.add_unit_loop(block)]
            sch.reorder(*spatial, *kinds["R"], *kinds["O"])
            fused = sch.fuse(*spatial)
            extent = sch.get(fused).extent
            size = group_size(int(extent) if isinstance(extent, tirx.IntImm) else None, max_threads)
            bx, tx = sch.split(fused, factors=[None, size])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            if kinds["R"]:
                reductions.append((block, kinds["R"][0]))
        for block, loop in reductions:
            sch.decompose_reduction(block, loop)
        return sch
