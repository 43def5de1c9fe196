"""exp, exp2 and sigmoid in float32 arithmetic that LLVM vectorizes, for CPU kernels.

LLVM lowers TIR's `exp` (and `sigmoid`, 1 / (1 + exp(-x))) to a libm `expf` call per lane: the SiLU of
SmolLM2's MLP (`fused_split_silu_multiply`) made ~200 k scalar calls per layer of a 128-token prefill,
~9% of the prefill. On LLVM targets this pass rewrites each float32 `exp(x)` in the fused kernels into

    n = round(x log2 e),  r = x - n ln2_hi - n ln2_lo   (|r| <= ln2 / 2, Cody-Waite split of ln 2)
    e^r by its degree-7 Taylor polynomial (relative error < 1e-8 on that range),  times 2^n built in the
    exponent bits (as two halves, so the top of the range and gradual underflow come out right),

+inf above ~88.72 and 0 below ~-103.9, as IEEE exp. Within a few float32 ulps of libm's expf (tests/test_fast_math.py).
exp2 (the CPU attention kernels' softmax) the same way with n = round(x), r = (x - n) ln 2. float16 exp /
sigmoid (android-cpu's fp16 SiLU, which LLVM also widened to one expf call per lane: 8 call sites in each
decode CPU region) are computed in float32 and rounded once to float16, as the libm path does.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

LOG2E = 1.0 / math.log(2.0)
LN2_HI = 0.693145751953125          # ln 2 with its low mantissa bits cleared: n * LN2_HI is exact
LN2_LO = math.log(2.0) - LN2_HI
EXP_MAX = 88.72                     # e^x overflows float32 just above
EXP_MIN = -103.9                    # and is 0 (below the smallest denormal) just below
EXP2_MAX = 127.999                  # the same bounds for 2^x
EXP2_MIN = -149.9


def lanes_reduce(v, lanes: int, op):
    """op over the `lanes` lanes of vector v, halving by shuffles (NEON: pairwise / across-lane instructions;
    x86: shuffles), in place of a scalar loop over the lanes."""
    while lanes > 1:
        lanes //= 2
        v = op(tirx.Shuffle([v], list(range(lanes))), tirx.Shuffle([v], list(range(lanes, 2 * lanes))))
    return v


def _f32(value: float):
    return tirx.const(value, "float32")


def _pow2(e):
    """2^e for an int32 PrimExpr e in [-126, 127], from the exponent bits."""
    return tirx.reinterpret("float32", tirx.shift_left(e + 127, 23))


def _times_pow2(r, n, x, top, bottom):
    """e^r (|r| <= ln2 / 2, degree-7 Taylor polynomial) times 2^n (n a float32 integer), with IEEE +inf / 0
    where x is beyond [bottom, top]."""
    p = _f32(1.0 / math.factorial(7))
    for k in range(6, -1, -1):
        p = p * r + _f32(1.0 / math.factorial(k))
    n_int = tirx.Cast("int32", n)
    half = tirx.shift_right(n_int, 1)      # 2^n as 2^half * 2^(n - half): both normal for |n| <= 252, so
    value = p * _pow2(half) * _pow2(n_int - half)   # the top of the range and gradual underflow stay right
    return tirx.Select(x > _f32(top), _f32(math.inf), tirx.Select(x < _f32(bottom), _f32(0.0), value))


def vector_exp(x):
    """e^x for a float32 PrimExpr, in vectorizable arithmetic."""
    clamped = tirx.max(tirx.min(x, _f32(EXP_MAX)), _f32(EXP_MIN))
    n = tirx.round(clamped * _f32(LOG2E))
    return _times_pow2(clamped - n * _f32(LN2_HI) - n * _f32(LN2_LO), n, x, EXP_MAX, EXP_MIN)


def vector_exp2(x):
    """2^x for a float32 PrimExpr, in vectorizable arithmetic (x - round(x) is exact)."""
    clamped = tirx.max(tirx.min(x, _f32(EXP2_MAX)), _f32(EXP2_MIN))
    n = tirx.round(clamped)
    return _times_pow2((clamped - n) * _f32(math.log(2.0)), n, x, EXP2_MAX, EXP2_MIN)


_EXP = tvm.ir.Op.get("tirx.exp")
_EXP2 = tvm.ir.Op.get("tirx.exp2")
_SIGMOID = tvm.ir.Op.get("tirx.sigmoid")


def _float32_form(op, x):
    """op(x) for a float32 x in vectorizable arithmetic, or None for an op this module leaves alone."""
    if op.same_as(_EXP):
        return vector_exp(x)
    if op.same_as(_EXP2):
        return vector_exp2(x)
    if op.same_as(_SIGMOID):
        return _f32(1.0) / (_f32(1.0) + vector_exp(-x))
    return None


def _rewrite(node):
    dtype = str(node.ty)
    if dtype not in ("float32", "float16") or len(node.args) != 1:
        return node
    x = node.args[0] if dtype == "float32" else tirx.Cast("float32", node.args[0])
    value = _float32_form(node.op, x)
    if value is None:
        return node
    return value if dtype == "float32" else tirx.Cast("float16", value)


def rewrite_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its float32 / float16 exp, exp2 and sigmoid calls replaced (unchanged if it has none)."""
    body = tvm_ffi.structural_map(func.body, [(tvm.ir.expr.Call, _rewrite)], order="post")
    return func if body.same_as(func.body) else func.with_body(body)


@tvm.transform.module_pass(opt_level=0, name="VectorizableExp")
def vectorizable_exp(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """On LLVM targets, every PrimFunc's float32 / float16 exp, exp2 and sigmoid in vectorizable arithmetic
    (GPU targets keep their native ones)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return mod
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            new = rewrite_func(func)
            if not new.same_as(func):
                mod[gv] = new
    return mod
