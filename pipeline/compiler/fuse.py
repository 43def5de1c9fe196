"""Operator fusion: dequantize into matmul, transpose into matmul, then TVM's FuseOps/FuseTIR.

Stock FuseOps never fuses a producer (the int4 / int8 / ternary dequantize) into a matmul, so without our pattern the
fp16 weights would be materialised in memory on every call — the opposite of what a bandwidth-bound
phone needs. The pattern runs after legalization, when both sides are `call_tir`s.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, is_tuple, wildcard

from pipeline.kernels.cpu.attention import replace_cpu_attention
from pipeline.kernels.cpu.fast_math import vectorizable_exp
from pipeline.kernels.cpu.rope import replace_cpu_rope
from pipeline.kernels.gpu.add_norm import fuse_add_rms_norm
from pipeline.kernels.gpu.attention import replace_gpu_attention
from pipeline.kernels.gpu.kernel_fixes import mark_noalias, replace_racy_kernels

# dequantize functions of every packed weight format (layers.py): q4 / q8 groups, t2 / t3 ternary
DEQUANTIZE_PREFIXES = ("dequantize_q4", "dequantize_q8", "dequantize_t2", "dequantize_t3", "dequantize_b1")
# a dtype cast feeding a matmul: fp16 weights computed in fp32 (q0f16 on a CPU target) — fused, the matmul
# reads the fp16 weight and widens it in registers instead of a separate kernel writing an fp32 copy
CAST_PREFIX = "cast"


def _callee_name(call: relax.Call) -> str:
    gv = call.args[0]
    return gv.name_hint if hasattr(gv, "name_hint") else str(gv)


def _dequant_matmul_pattern():
    dequant = is_op("relax.call_tir")(wildcard(), wildcard())
    matmul = is_op("relax.call_tir")(wildcard(), is_tuple([wildcard(), dequant]))
    return matmul, {"dequant": dequant, "matmul": matmul}


def _is_dequant_matmul(ctx: relax.transform.PatternCheckContext) -> bool:
    dq = ctx.annotated_expr["dequant"]
    mm = ctx.annotated_expr["matmul"]
    return _callee_name(dq).startswith((*DEQUANTIZE_PREFIXES, CAST_PREFIX)) and "matmul" in _callee_name(mm)


def fuse_dequantize_matmul() -> tvm.transform.Pass:
    pattern, annotations = _dequant_matmul_pattern()
    return relax.transform.FuseOpsByPattern(
        [("dequantize_matmul", pattern, annotations, _is_dequant_matmul)], bind_constants=False)


def fusion_passes() -> list[tvm.transform.Pass]:
    """The fuse stage, in order. Each pass is a plain TVM pass so it can be inspected and reordered."""
    return [
        replace_racy_kernels,                     # TVM's GPU merge-state kernel races (kernel_fixes.py)
        replace_cpu_attention,                    # TVM's CPU attention kernels are serial (cpu_attention.py)
        replace_gpu_attention,                    # TVM's GPU decode attention: 1 work-group per KV head (gpu/attention.py)
        replace_cpu_rope,                         # TVM's RoPE evaluates cos/sin per element (cpu_rope.py)
        mark_noalias,                             # else LLVM leaves the CPU kernels unvectorized
        relax.transform.FuseTransposeMatmul(),   # nn.Linear's matmul(x, permute(W)) -> one NT matmul
        relax.transform.LegalizeOps(),
        relax.transform.ConvertToDataflow(),
        fuse_dequantize_matmul(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),                # split+silu*up, casts into consumers, ... (not the residual
                                                  # add into RMSNorm: the sum has two consumers; see below)
        relax.transform.FuseTIR(),
        fuse_add_rms_norm,                        # GPU: residual add + its RMSNorm in one launch (gpu/add_norm.py)
        relax.transform.DeadCodeElimination(),
        vectorizable_exp,                         # libm expf per lane on CPU (fast_math.py)
    ]
