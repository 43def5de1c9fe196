"""A default CPU schedule for kernels dlight's CPU rules leave alone (e.g. prefill dequantize-matmul).

Unscheduled, a fused dequantize+matmul writes the whole dequantized weight to a scratch buffer on
every call and runs on one core. For one token (decode GEMV) this rule inlines such producer blocks
into their consumer: each weight is used once, so unpacking it in registers is the cheapest. For a
prompt (prefill: a symbolic number of rows) every weight is used by every row, so the weight is
dequantized once per output tile into a small scratch tile (compute_at) and all rows reuse it; the
tiles run in parallel.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule

from pipeline.kernels.cpu.arm import arm_dot_like
from pipeline.kernels.cpu.arm_kn import arm_kn_dot_like
from pipeline.kernels.cpu.arm_kn_q8 import arm_kn_q8_dot_like
from pipeline.kernels.cpu.arm_kn_signs import arm_kn_sign_dot_like
from pipeline.kernels.cpu.arm_mmla import arm_mmla_like
from pipeline.kernels.cpu.arm_rows import arm_rows_like
from pipeline.kernels.cpu.arm_t3 import arm_t3_like
from pipeline.kernels.cpu.gemv import float_nt_gemv_like, packed_kn_gemv_like
from pipeline.kernels.cpu.prefill import packed_kn_matmul_like
from pipeline.kernels.cpu.probe import (
    has_avx2,
    has_dotprod,
    has_i8mm,
    has_vnni,
    host_threads,
    native_prefetch_bytes,
)
from pipeline.kernels.cpu.recognize import block_names


class CPUArmDot(ScheduleRule):
    """AArch64 with dotprod: a fused decode GEMV or prefill matmul of NK q4 / q8 / t2 / b1 codes (android-cpu)
    becomes arm.py's sdot kernel (rows interleaved: arm_rows.py's; their prefill matmul with i8mm: arm_mmla.py's
    smmla kernel), of NK t3 codes arm_t3.py's, of KN q4 codes (android-hexagon's CPU half) arm_kn.py's, of plain KN
    q8 codes arm_kn_q8.py's, of plain KN t2 / b1 codes arm_kn_signs.py's; any other function is left to the next
    rule (or TVM's default schedule)."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not has_dotprod(target):
            return None
        kernel = ((arm_mmla_like(func) if has_i8mm(target) else None) or arm_rows_like(func) or arm_dot_like(func)
                  or arm_t3_like(func) or arm_kn_dot_like(func) or arm_kn_q8_dot_like(func)
                  or arm_kn_sign_dot_like(func))
        return None if kernel is None else s_tir.Schedule(kernel)


class CPUInlineParallel(ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        names = block_names(func)
        kernel = packed_kn_gemv_like(func, int16_dot=has_avx2(target), threads=host_threads(target),
                                     byte_dot=has_vnni(target), prefetch_bytes=native_prefetch_bytes(target))
        if kernel is not None:    # decode q4 / t2 / q8 GEMV (one token, KN codes): the hand-written kernel, gemv.py / x86.py
            return s_tir.Schedule(kernel)
        kernel = packed_kn_matmul_like(func, byte_dot=has_vnni(target), int16_dot=has_avx2(target))
        if kernel is not None:    # prefill q4 / t2 / q8 matmul (a prompt's rows, KN codes): prefill.py
            return s_tir.Schedule(kernel)
        if any(name.startswith("dequantize") for name in names):
            try:
                tiled = _dequant_tiles_for_rows(func)
            except Exception:  # noqa: BLE001 - not this shape: the general path below
                tiled = None
            if tiled is not None:
                return tiled
        else:
            kernel = float_nt_gemv_like(func, SERIAL_WORK)
            if kernel is not None:    # decode q0f16 / q0f32 GEMV (one token, NT float weights): gemv.py
                return s_tir.Schedule(kernel)
            try:
                gemv = _float_gemv(func)
            except Exception:  # noqa: BLE001 - not a float GEMV this rule can split: the general path
                gemv = None
            if gemv is not None:
                return gemv
            try:
                tiled = _float_tiles_for_rows(func)
            except Exception:  # noqa: BLE001 - not a float prefill matmul: the general path
                tiled = None
            if tiled is not None:
                return tiled
            try:
                normed = _row_reduction(func)
            except Exception:  # noqa: BLE001 - not a per-row reduction + epilogue: the general path
                normed = None
            if normed is not None:
                return normed
        prepared = _inline_producers(func)
        if prepared is None:
            return None
        sch, last, spatial, reduction = prepared
        if _work(sch, spatial + reduction) < SERIAL_WORK:   # a decode-step norm / add: no fork-join
            return sch
        # Vector lanes along the output dim: contiguous loads for KN q4 codes; for NK codes they gather,
        # which measured still 2x faster than a scalar loop (the unpacking dominates). Float NT weights
        # stay plain parallel.
        q4_weights = any(name.startswith("dequantize_") for name in names)
        if q4_weights and len(reduction) == 1 and _vectorizable(sch, spatial[-1]):
            try:
                _matmul_vectorized(sch, last, spatial, reduction[0])
                return sch
            except Exception:  # noqa: BLE001 - fall back to the plain parallel form on a fresh schedule
                sch, last, spatial, reduction = _inline_producers(func)
        if not reduction and _vectorizable(sch, spatial[-1]):
            # elementwise (a prompt's SiLU * up, residual adds): whole vectors along the last axis; fused
            # with the rows into one flat loop, its div / mod indexing kept LLVM from vectorizing
            outer, inner = sch.split(spatial[-1], factors=[None, VEC])
            sch.parallel(sch.fuse(*spatial[:-1], outer))
            sch.vectorize(inner)
            return sch
        sch.parallel(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0])
        return sch


def _inline_producers(func: tirx.PrimFunc):
    """Inline every inlinable block into the last one; return (sch, last block, its leading spatial
    loops, the loops after them), or None when there is nothing to parallelize."""
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root") if _has_root(sch) else None
    blocks = sch.get_child_blocks(root) if root is not None else []
    if not blocks:
        return None
    for block in blocks[:-1]:
        try:
            sch.compute_inline(block)
        except Exception:  # noqa: BLE001 - not inlinable (reduction / multi-consumer): keep it
            continue
    last = sch.get_child_blocks(root)[-1]
    loops = sch.get_loops(last)
    spatial = []
    for loop, kind in zip(loops, _iter_kinds(sch, last), strict=False):
        if kind != "S":
            break
        spatial.append(loop)
    if not spatial:
        return None
    return sch, last, spatial, loops[len(spatial):]


# Below this many loop iterations a kernel runs on the calling thread: waking the thread pool costs more
# than it saves (decode's RMSNorm / residual add over one token: 576 elements), and under a loaded CPU a
# fork-join can wait milliseconds for a descheduled worker.
SERIAL_WORK = 1 << 16


def _work(sch, loops) -> float:
    """Product of the loops' extents; infinite when one is symbolic (a prompt's rows)."""
    total = 1
    for loop in loops:
        extent = sch.get(loop).extent
        if not isinstance(extent, tirx.IntImm):
            return float("inf")
        total *= int(extent)
    return total


VEC = 8   # fp32 lanes of an AVX2 / 2×NEON register
TILES = (24, 16, VEC)   # output columns per task: three AVX2 accumulators measured fastest (1.7x vs 8)
CODES_PER_WORD = 8


def _vectorizable(sch, loop) -> bool:
    extent = sch.get(loop).extent
    return isinstance(extent, tirx.IntImm) and int(extent) % VEC == 0 and int(extent) >= 4 * VEC


def _matmul_vectorized(sch, block, spatial, k) -> None:
    """(..., n, k) -> parallel n_o, then (..., k_word, k_code, n_i) with n_i unrolled: the output tile
    stays in registers while k streams; with the KN weight layout each weight load is contiguous, and
    splitting k by the 8 codes of a packed word lets each word be loaded once and shifted by constants.
    """
    n = int(sch.get(spatial[-1]).extent)
    tile = next(t for t in TILES if n % t == 0)
    n_o, n_i = sch.split(spatial[-1], factors=[None, tile])
    k_extent = sch.get(k).extent
    if isinstance(k_extent, tirx.IntImm) and int(k_extent) % CODES_PER_WORD == 0:
        k_word, k_code = sch.split(k, factors=[None, CODES_PER_WORD])
        sch.reorder(n_o, *spatial[:-1], k_word, k_code, n_i)
        sch.unroll(k_code)
        outer_k = k_word
    else:
        sch.reorder(n_o, *spatial[:-1], k, n_i)
        outer_k = k
    sch.parallel(n_o)
    init = sch.decompose_reduction(block, outer_k)
    sch.unroll(n_i)                      # straight-line lanes: LLVM's SLP vectorizer packs them
    sch.vectorize(sch.get_loops(init)[-1])


PREFILL_TILE = 24   # output columns per dequantized weight tile: 3 AVX2 registers per row, measured best


def _dequant_tiles_for_rows(func: tirx.PrimFunc):
    """Prefill dequantize-matmul: parallel over output tiles of PREFILL_TILE columns; per tile, the
    dequantize block writes a (k x tile) scratch tile once (compute_at), then every row runs k with the
    tile's columns unrolled (LLVM packs them into vector FMAs). Only when the rows are symbolic (a
    prompt) and the producers are one dequantize feeding the matmul; else None."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) < 2:
        return None
    matmul = blocks[-1]
    loops = sch.get_loops(matmul)
    kinds = _iter_kinds(sch, matmul)
    if kinds[-1] != "R" or kinds.count("R") != 1 or len(loops) != len(kinds):
        return None
    *spatial, k = loops
    extents = [sch.get(lp).extent for lp in spatial]
    rows_symbolic = any(not isinstance(e, tirx.IntImm) for e in extents[:-1])
    n = extents[-1]
    if not rows_symbolic or not isinstance(n, tirx.IntImm) or int(n) % PREFILL_TILE:
        return None
    for block in blocks[:-1]:
        if not sch.get(block).name_hint.startswith("dequantize"):
            sch.compute_inline(block)   # a cast / transpose producer: fails (-> None) if it cannot
    dequant = [b for b in sch.get_child_blocks(sch.get_sblock("root"))[:-1]]
    if len(dequant) != 1:
        return None
    matmul = sch.get_child_blocks(sch.get_sblock("root"))[-1]
    _tile_rows(sch, dequant[0], matmul, PREFILL_TILE)
    inner = sch.get_loops(dequant[0])[-1]
    if _vectorizable(sch, inner) or isinstance(sch.get(inner).extent, tirx.IntImm):
        sch.vectorize(inner)
    return sch


def _float_tiles_for_rows(func: tirx.PrimFunc):
    """Prefill matmul with float weights widened in the kernel (fp16 NT weights of q0f16): as for q4, per
    output tile of PREFILL_TILE columns the cast writes the tile's weights once into an fp32 scratch, here
    transposed to [k, column] so the tile's columns are contiguous, and every row of the prompt runs k with
    the columns unrolled. Plain, each (row, column) dot product re-read and re-widened its weight row
    (q0f16 prefill at ~2-4 GFLOP/s; tiled ~30, measured on SmolLM2's gate_up shape). Tiles of 24 columns,
    else 16 or 8. Only a lone cast producer, symbolic rows and no epilogue; else None."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 2 or "R" in _iter_kinds(sch, blocks[0]) or len(sch.get_loops(blocks[0])) != 2:
        return None
    cast, matmul = blocks
    loops, kinds = sch.get_loops(matmul), _iter_kinds(sch, matmul)
    if kinds[-1] != "R" or kinds.count("R") != 1 or len(loops) != len(kinds):
        return None
    *spatial, k = loops
    extents = [sch.get(lp).extent for lp in spatial]
    n = extents[-1]
    if not any(not isinstance(e, tirx.IntImm) for e in extents[:-1]):
        return None
    tile = next((t for t in (PREFILL_TILE, 2 * VEC, VEC) if isinstance(n, tirx.IntImm) and int(n) % t == 0), None)
    if tile is None:
        return None
    if not _reads_along_last_axis(sch.get(matmul), sch.get(matmul).iter_vars[-1].var):
        return None                                   # NT weights only (k last)
    sch.transform_layout(cast, ("write", 0), lambda a, b: (b, a))
    _tile_rows(sch, cast, matmul, tile)
    return sch


def _tile_rows(sch, producer, matmul, tile: int) -> None:
    """Parallel output tiles of `tile` columns; the weight producer computed once per tile (compute_at),
    then every row runs k with the tile's columns unrolled (LLVM packs them into vector FMAs)."""
    *spatial, k = sch.get_loops(matmul)
    n_o, n_i = sch.split(spatial[-1], factors=[None, tile])
    sch.reorder(n_o, *spatial[:-1], k, n_i)
    sch.compute_at(producer, n_o)
    sch.parallel(n_o)
    init = sch.decompose_reduction(matmul, k)
    sch.unroll(n_i)
    sch.vectorize(sch.get_loops(init)[-1])


FLOAT_LANES = 16   # partial sums along K per output (two AVX2 registers); measured best of 8 / 16 / 32
FLOAT_ROWS = 4     # outputs per step, unrolled: independent FMA chains (16 x 4: 25x the plain loop in cache)


def _float_gemv(func: tirx.PrimFunc):
    """One-token matmul with float weights read along K (NT: fp32, or fp16 widened in registers): the
    reduction is split into FLOAT_LANES partial sums (rfactor) that LLVM vectorizes, FLOAT_ROWS outputs at a
    time, parallel over output tiles; the partial sums are added per tile. Plain, the K loop stays scalar
    (a float reduction cannot be vectorized without reassociation): 1.7 GB/s. None if not such a kernel."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    reductions = [i for i, b in enumerate(blocks) if "R" in _iter_kinds(sch, b)]
    if len(reductions) != 1:
        return None
    at = reductions[0]
    block = blocks[at]
    for producer in blocks[:at]:
        sch.compute_inline(producer)            # a cast of the weight: widened where it is read
    epilogues = [sch.get(b).name_hint for b in blocks[at + 1:]]   # a bias / residual add
    loops, kinds = sch.get_loops(block), _iter_kinds(sch, block)
    if kinds[-1] != "R" or kinds.count("R") != 1 or len(loops) != len(kinds) or len(loops) < 2:
        return None
    extents = [sch.get(lp).extent for lp in loops]
    if not all(isinstance(e, tirx.IntImm) for e in extents) or any(int(e) != 1 for e in extents[:-2]):
        return None
    n, k = int(extents[-2]), int(extents[-1])
    if n % FLOAT_ROWS or k % FLOAT_LANES or k < 2 * FLOAT_LANES or n * k < SERIAL_WORK:
        return None
    if not _reads_along_last_axis(sch.get(block), sch.get(block).iter_vars[-1].var):
        return None
    n_o, n_i = sch.split(loops[-2], factors=[None, FLOAT_ROWS])
    k_o, k_i = sch.split(loops[-1], factors=[None, FLOAT_LANES])
    sch.reorder(n_o, n_i, k_o, k_i)
    sch.parallel(n_o)
    partial = sch.rfactor(k_i, len(loops) - 1)
    *_, n_o, n_i, k_o, k_i = sch.get_loops(partial)
    sch.reorder(n_o, k_o, n_i, k_i)
    sch.reverse_compute_at(block, n_o)
    for name in epilogues:                       # each tile's outputs finished while in cache
        sch.reverse_compute_at(sch.get_sblock(name), n_o)
    sch.unroll(n_i)
    sch.unroll(k_i)                              # straight-line lanes: LLVM's SLP vectorizer packs them
    sch.decompose_reduction(partial, k_o)
    return sch


ROW_LANES = 8   # partial sums of a row reduction (one AVX2 register)


def _row_reduction(func: tirx.PrimFunc):
    """A per-row reduction over the last axis feeding an elementwise epilogue over the same rows (RMSNorm:
    sum of squares, then x * rsqrt(mean + eps) * w): the reduction computed inside the epilogue's row loop
    (compute_at), rows in parallel (unless it is one small row: decode), the reduction split into ROW_LANES vector partial sums (rfactor) and
    the epilogue's columns vectorized. Left to the general path, the reduction ran as its own serial,
    scalar loop over all rows (~60% of a prompt's RMSNorm). None unless exactly one reduction block
    remains after inlining, with a constant last axis divisible by ROW_LANES."""
    prepared = _inline_producers(func)
    if prepared is None:
        return None
    sch, last, spatial, reduction = prepared
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if reduction or len(blocks) != 2 or len(spatial) < 2:
        return None
    red = blocks[0]
    red_loops, red_kinds = sch.get_loops(red), _iter_kinds(sch, red)
    if red_kinds.count("R") != 1 or red_kinds[-1] != "R" or len(red_loops) != len(spatial):
        return None
    k_extent, n_extent = sch.get(red_loops[-1]).extent, sch.get(spatial[-1]).extent
    if not all(isinstance(e, tirx.IntImm) and int(e) % ROW_LANES == 0 for e in (k_extent, n_extent)):
        return None
    rows = spatial[:-1]
    parallel = _work(sch, spatial) >= SERIAL_WORK   # a prompt's rows; a decode step's norm stays serial
    row = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    sch.compute_at(red, row)
    if parallel:
        sch.parallel(row)
    k_o, k_i = sch.split(sch.get_loops(red)[-1], factors=[None, ROW_LANES])
    partial = sch.rfactor(k_i, len(sch.get(red).writes[0].region))   # lanes last: contiguous partials
    sch.compute_at(partial, row)                 # the row's partial sums inside the same parallel task
    outer, inner = sch.get_loops(partial)[-2:]
    try:
        sch.vectorize(inner)
    except Exception:  # noqa: BLE001 - compute_at put the lanes outside the k steps: swap them
        sch.reorder(inner, outer)
        sch.vectorize(sch.get_loops(partial)[-1])
    sch.decompose_reduction(partial, sch.get_loops(partial)[-2])   # zero the partials once, not per step
    sch.vectorize(sch.get_loops(last)[-1])
    return sch


def _reads_along_last_axis(block, k_var) -> bool:
    """Every buffer the reduction reads with k indexes it by k in its last axis only (contiguous lanes)."""
    def uses_k(expr) -> bool:
        return any(v.same_as(k_var) for v in tirx.analysis.undefined_vars(expr, []))

    for region in block.reads:
        dims = [uses_k(r.min) for r in region.region]
        if any(dims[:-1]):
            return False
    return True


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001
        return False


def _iter_kinds(sch, block) -> list[str]:
    return ["S" if int(iv.iter_type) == 0 else "R" for iv in sch.get(block).iter_vars]
