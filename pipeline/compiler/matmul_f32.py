"""Prefill matmuls of KN-packed weights on the GPU, summed in float32: dlight's Matmul schedule over the fused
function rebuilt to dequantize into float32, accumulate in float32 and cast once to the output dtype.

The fused function (models/layers.py's dequantize, then the matmul) accumulates in its output dtype; on the
phone that is float16, and dlight's Matmul kept the sums of all K terms in `half2` / `half8` registers.
Rebuilt here with the same TE dequantize (models/layers.py) but in float32, a float32 matmul block and a cast
block after it, which dlight's Matmul takes as the epilogue of a matmul whose registers are float.
Functions that already sum in float32 (the fp32 twin) and anything else are left to the next rule.
"""

from __future__ import annotations

import dataclasses

from tvm import te, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.base import ScheduleRule

from pipeline.errors import CompileError
from pipeline.kernels.gpu.gemv import GPU_KINDS, OP_CLASS_ATTR, match_kn_gemv
from pipeline.models import layers  # the same TE dequantize as the model's, here in float32

RULE = "matmul_f32"


def _dequantize(fmt: str, codes: te.Tensor, scales: te.Tensor, k: int, n: int) -> te.Tensor:
    if fmt == "q4":
        return layers.dequantize_te(codes, scales, "KN", k, n, "float32")
    if fmt == "q8":
        return layers.dequantize_q8_te(codes, scales, "KN", k, n, "float32")
    return layers.dequantize_ternary_te(codes, scales, fmt, "KN", k, n, "float32")


def widened(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """`func` (a prompt's KN dequantize + matmul with a float16 output) with float32 dequantize and sums and a
    cast to float16 last; same parameter order, shapes and attributes. None for anything else."""
    found = match_kn_gemv(func, rows="prompt")
    if found is None:
        return None
    fmt, n, k, order, dtypes = found
    if dtypes["out"] != "float16":
        return None
    by_role = {role: p for role, p in zip(order, func.params, strict=True)}
    rows = by_role["out"].shape[1]
    m = tirx.Var(str(rows.name), str(rows.ty))
    i64 = lambda v: tirx.IntImm("int64", int(v))   # noqa: E731 - every dim int64, as the fused function's
    static = {role: [i64(d) for d in by_role[role].shape] for role in ("codes", "scales")}
    codes = te.placeholder(static["codes"], dtypes["codes"], name="codes")
    scales = te.placeholder(static["scales"], dtypes["scales"], name="scales")
    x = te.placeholder((i64(1), m, i64(k)), dtypes["x"], name="x")
    deq = _dequantize(fmt, codes, scales, i64(k), i64(n))
    r = te.reduce_axis((i64(0), i64(k)), name="k")
    acc = te.compute((i64(1), m, i64(n)), lambda a, b, j: te.sum(x[a, b, r].astype("float32") * deq[r, j], axis=r),
                     name="matmul")
    out = te.compute((i64(1), m, i64(n)), lambda a, b, j: acc[a, b, j].astype("float16"), name="cast")
    tensors = {"codes": codes, "scales": scales, "x": x, "out": out}
    new = te.create_prim_func([tensors[role] for role in order])
    return tirx.PrimFunc(new.params, new.body, new.ret_type, func.attrs).with_attr(OP_CLASS_ATTR, "dequant-matmul")


class _NarrowMatmul(dl.gpu.Matmul):
    """dlight's Matmul with half as many work-items along N per work-group as the target's config.

    dlight 0.27's Adreno config (32 x 8 outputs along N per work-group, float8 stores) cannot vectorize the
    store of a widened matmul whose N is an odd multiple of 32 (qwen27b's GDN in_proj, 16480 = 515 x 32; 96):
    "vectorize cannot be fulfilled ... not a data parallel block iter". 16 x 8 schedules every such N."""

    def get_configs(self, target):
        config = super().get_configs(target)
        return dataclasses.replace(config, block_size_x=max(1, config.block_size_x // 2))


class GPUMatmulF32(ScheduleRule):
    """A prompt's KN dequantize + matmul with a float16 output: dlight's Matmul over `widened` (or, where its
    target config cannot vectorize the store, `_NarrowMatmul`); the rest is left to the next rule. A widened
    function neither can schedule fails the build with the reason."""

    def apply(self, func: tirx.PrimFunc, target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name not in GPU_KINDS:
            return None
        wide = widened(func)
        if wide is None:
            return None
        try:
            space = dl.gpu.Matmul().apply(wide, target, tunable)
        except Exception:  # noqa: BLE001 - dlight's vectorize check (above): the narrower config, else the reason
            try:
                space = _NarrowMatmul().apply(wide, target, tunable)
            except Exception as err:  # noqa: BLE001 - re-raised with the reason, not as an error the caller skips
                raise CompileError(f"the {RULE} rule could not schedule a float32-sum prefill matmul: "
                                   f"{str(err).strip().splitlines()[-1]}") from err
        if space is None:
            raise CompileError(f"the {RULE} rule widened a prefill matmul that dlight's Matmul then declined")
        return space
