"""Argmax of one step's logits on the CPU, for the greedy step (`decode_greedy`): vectorized, one root block.

TOPI's argmax compiles to one scalar loop carrying (index, value) pairs (~40 us over a 49152-wide vocab,
1% of a SmolLM2 decode step, more than numpy's argmax it replaces); here two passes over lanes of
LANES columns: the largest value per lane, then the first index per lane that holds the overall largest,
the smallest of those last — numpy's answer (the first of equal maxima). A vocab that is not a multiple
of LANES finishes its last columns in scalar code.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

LANES = 16          # fp32 lanes per step: two AVX2 registers, one AVX-512 register
OP_CLASS = "reduction"


def argmax_kernel(n: int) -> tirx.PrimFunc:
    """x [n] float32 -> out [1] int32: the first index of x's largest value (NaN-free logits)."""
    rows, tail = n // LANES, n % LANES
    i64 = T.int64
    assert rows >= 1, f"argmax kernel: {n} values, fewer than one vector of {LANES}"

    @T.prim_func(private=True, s_tir=True)
    def argmax(x: T.Buffer((i64(n),), "float32"), out: T.Buffer((i64(1),), "int32")):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True,
                     "pipeline.op_class": OP_CLASS})   # op_pattern 8: opaque, fused with nothing
        with T.sblock("root"):   # Relax's reshape analysis expects a block at the top
            best = T.alloc_buffer((LANES,), "float32")
            first = T.alloc_buffer((LANES,), "int32")
            top = T.alloc_buffer((1,), "float32")
            pick = T.alloc_buffer((1,), "int32")
            for j in T.vectorized(LANES):
                best[j] = x[j]
            for i in range(1, rows):
                for j in T.vectorized(LANES):
                    best[j] = T.max(best[j], x[i * LANES + j])
            top[0] = best[0]
            for j in range(1, LANES):
                top[0] = T.max(top[0], best[j])
            for t in range(tail):
                top[0] = T.max(top[0], x[rows * LANES + t])
            for j in T.vectorized(LANES):
                first[j] = n
            for i in range(rows):
                for j in T.vectorized(LANES):
                    first[j] = T.Select(x[i * LANES + j] == top[0], T.min(first[j], i * LANES + j), first[j])
            pick[0] = first[0]
            for j in range(1, LANES):
                pick[0] = T.min(pick[0], first[j])
            for t in range(tail):
                if x[rows * LANES + t] == top[0]:
                    pick[0] = T.min(pick[0], rows * LANES + t)
            out[0] = pick[0]

    return argmax
