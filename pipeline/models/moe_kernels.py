"""TIR kernels of a mixture-of-experts MLP that read only the experts each token was routed to.

A MoE layer holds E expert FFNs but a token uses k of them (Qwen3.5-35B-A3B: 8 of 256), so decode must
read k experts' weights, not E. The experts are stored stacked per layer ([E, N, K] float, or the codes and
scales of each expert's rows, NK: q4 / q8 [E, N, K / 8 or K] + [E, N, K / 32]; the sign packings t2 / t3 / b1
exactly as a dense layer stores a row, quant/ternary.py: [E, N, ceil(K / 16, 20 or 32)] uint32 +
[E, N, ceil(K / 128)], read by the dense TE dequantize's `layers.sign_code`) and each kernel indexes the
expert with the router's choice, so one launch per projection computes the k selected experts and nothing
else (no E masked GEMVs, no gather copy of the weights)::

    moe_route:     logits [n, E] f32  ->  idx [n, k] int32, weight [n, k] f32
                   softmax over E, the k largest (first index among equals), renormalised to sum 1 when
                   `norm_topk` (transformers' TopKRouter computes the same in fp32)
    moe_gate_up:   x [n, K], idx [n, k], W_gu [E, 2I, K]  ->  h [n, k, I] = silu(x W_gate^T) * (x W_up^T)
                   (rows [0, I) of an expert's gate_up are the gate, [I, 2I) the up projection)
    moe_down:      h [n, k, I], idx [n, k], weight [n, k], W_d [E, H, I]  ->  y [n, H]
                   = sum_j weight[t, j] * h[t, j] W_d[idx[t, j]]^T  (the weighted sum fused in)

The token count n (`seq_len`) is symbolic, so the same kernels serve decode (n = 1) and GPU prefill, where
each token gathers its own k experts (CPU prefill groups tokens by expert: moe_grouped.py). ``gpu=True``:
one work item per output element, a serial fp32 dot product over K, bound to blockIdx / threadIdx and
marked scheduled (dlight leaves it alone; a GPU work item reads its own weight row, so neighbouring threads
do not coalesce). Else a ``parallel`` loop over work items of ROWS_PER_ITEM output rows, each dot product
vectorised (kernels/cpu/expert_rows.py: LANES weights per step, x converted once per call), or an integer dot
chosen by `expert_dot` (models/moe.expert_dot decides it from the target): "avx2", q4 rows take
kernels/cpu/expert_x86.py's `pmaddwd` dot, x quantized to int16 once per call; "dotprod" (AArch64), q4 / q8
rows take kernels/cpu/expert_arm.py's `sdot` dot, x quantized to two bytes once per call as the dense sdot
GEMVs quantize it. Other formats and K keep the fp32 form.
"""

from __future__ import annotations

import functools

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import CODES_PER_WORD, FORMATS, GROUP, PACKINGS, SIGN_GROUP, ZERO, n_groups, packed_len
from pipeline.kernels.cpu import expert_arm, expert_x86
from pipeline.kernels.cpu.expert_rows import (
    expert_row_dot,
    group_sums_shape,
    prescale,
    prescaled_shape,
    vector_scratch,
)
from pipeline.models.layers import sign_code

__all__ = ["moe_down", "moe_gate_up", "moe_reference", "moe_route"]

WEIGHT_FORMATS = ("float", "q4", "q8", *PACKINGS)
EXPERT_DOTS = ("avx2", "dotprod")   # integer expert dots by instruction set (None: the fp32 form)


def _integer_dot(expert_dot: str | None, gpu: bool, fmt: str, k: int) -> str | None:
    """The integer dot a CPU kernel of rows `fmt` x k takes for `expert_dot`, or None (the fp32 form)."""
    if expert_dot not in (None, *EXPERT_DOTS):
        raise ValueError(f"expert_dot {expert_dot!r} is not one of {EXPERT_DOTS} or None")
    if gpu or expert_dot is None:
        return None
    module = expert_x86 if expert_dot == "avx2" else expert_arm
    return expert_dot if module.supports(fmt, k) else None


def _loops(gpu: bool, threads: int):
    """(outer, inner) loop kinds over work items: GPU blocks x threads, or a parallel loop x 1 on the CPU."""
    if gpu:
        return (functools.partial(T.thread_binding, thread="blockIdx.x"),
                functools.partial(T.thread_binding, thread="threadIdx.x"), threads)
    return T.parallel, T.serial, 1


def _finish(func: tirx.PrimFunc, name: str, gpu: bool, op_class: str = "moe-gemv",
            reduction: int = 0) -> tirx.PrimFunc:
    # the op class is declared: the coverage report then counts the selected experts' bytes, not all E; the
    # reduction length K gives its FLOPs (a packed row's words do not say K: t3 pads to 20 codes per word)
    func = func.with_attr("global_symbol", name).with_attr("pipeline.op_class", op_class)
    if reduction:
        func = func.with_attr("pipeline.moe_reduction", reduction)
    return func.with_attr("tirx.is_scheduled", True) if gpu else func


def _weight(fmt: str, codes, scales, e, r, kk):
    """Element [e, r, kk] of a stacked expert weight as fp32 (float, or q4 / q8 / sign codes times a scale)."""
    if fmt == "float":
        return T.Cast("float32", codes[e, r, kk])
    if fmt == "q8":
        return T.Cast("float32", codes[e, r, kk]) * T.Cast("float32", scales[e, r, kk // GROUP])
    if fmt in PACKINGS:
        code = sign_code(fmt, lambda i: codes[e, r, i], kk)
        return (T.Cast("float32", code) - T.float32(1)) * T.Cast("float32", scales[e, r, kk // SIGN_GROUP])
    word = codes[e, r, kk // CODES_PER_WORD]
    code = T.bitwise_and(T.shift_right(word, T.Cast("uint32", kk % CODES_PER_WORD * 4)), T.uint32(0xF))
    return (T.Cast("float32", code) - T.float32(ZERO)) * T.Cast("float32", scales[e, r, kk // GROUP])


ROWS_PER_ITEM = 2   # CPU: output rows per work item (gate_up: their gate and up rows, 4 rows walked side by side)


def _rows_per_item(n: int) -> int:
    """ROWS_PER_ITEM when it divides the output rows n, else 1."""
    return ROWS_PER_ITEM if n % ROWS_PER_ITEM == 0 else 1


def _weight_of(fmt: str):
    """`_weight` for one format, as the vectorised CPU dot's scalar reader (kernels/cpu/expert_rows.py)."""
    return lambda codes, scales, e, r, kk: _weight(fmt, codes, scales, e, r, kk)


def weight_shapes(fmt: str, experts: int, rows: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(codes or float weight, scales) shapes of one stacked expert projection [experts, rows, k] (NK)."""
    if fmt == "float":
        return (experts, rows, k), None
    if fmt in PACKINGS:   # a dense layer's NK row (TernaryLinear), per expert: the last group may be short
        return (experts, rows, packed_len(fmt, k)), (experts, rows, n_groups(k))
    per_word = CODES_PER_WORD if fmt == "q4" else 1
    return (experts, rows, k // per_word), (experts, rows, k // GROUP)


def code_dtype(fmt: str, weight_dtype: str) -> str:
    """The dtype of a stacked expert weight's codes (float: the weight itself)."""
    return weight_dtype if fmt == "float" else FORMATS[fmt].code_dtype


def _check(fmt: str, k: int) -> None:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"expert weight format {fmt!r} is not one of {WEIGHT_FORMATS}")
    if fmt in ("q4", "q8") and k % GROUP:
        raise ValueError(f"quantized experts need K ({k}) to be a multiple of the group size {GROUP}")


def moe_route(experts: int, top_k: int, norm_topk: bool, *, gpu: bool = False, max_threads: int = 128,
              name: str = "moe_route") -> tirx.PrimFunc:
    """Softmax router + top-k (see the module docstring); one work item per token."""
    E, K = int(experts), int(top_k)
    if not 0 < K <= E:
        raise ValueError(f"top_k ({K}) must be in [1, {E}]")
    outer, inner, threads = _loops(gpu, max_threads)

    @T.prim_func(s_tir=True)
    def route(logits_h: T.handle, idx_h: T.handle, w_h: T.handle):
        seq_len = T.int64()
        logits = T.match_buffer(logits_h, (seq_len, E), "float32")
        idx = T.match_buffer(idx_h, (seq_len, K), "int32")
        w = T.match_buffer(w_h, (seq_len, K), "float32")
        # a root block: Relax's reshape detection (RewriteDataflowReshape) inspects one-input kernels and
        # requires one; no inner blocks, so no schedule rule touches the loops
        with T.sblock("root"):
            for tb in outer((seq_len + threads - 1) // threads):
                for tx in inner(threads):
                    if tb * threads + tx < seq_len:
                        t = tb * threads + tx
                        best = T.alloc_local((1,), "float32")
                        pick = T.alloc_local((1,), "int32")
                        taken = T.alloc_local((1,), "int32")
                        total = T.alloc_local((1,), "float32")
                        chosen = T.alloc_local((1,), "float32")
                        for j in range(K):
                            best[0] = T.float32(-3.4e38)
                            pick[0] = 0
                            for e in range(E):
                                taken[0] = 0
                                for i in range(j):
                                    if idx[t, i] == T.Cast("int32", e):
                                        taken[0] = 1
                                if taken[0] == 0 and logits[t, e] > best[0]:
                                    best[0] = logits[t, e]
                                    pick[0] = T.Cast("int32", e)
                            idx[t, j] = pick[0]
                        # softmax over all E (max = the first pick), then the picks' probabilities
                        total[0] = T.float32(0)
                        for e in range(E):
                            total[0] = total[0] + T.exp(logits[t, e] - logits[t, idx[t, 0]])
                        chosen[0] = T.float32(0)
                        for j in range(K):
                            w[t, j] = T.exp(logits[t, idx[t, j]] - logits[t, idx[t, 0]]) / total[0]
                            chosen[0] = chosen[0] + w[t, j]
                        if norm_topk:
                            for j in range(K):
                                w[t, j] = w[t, j] / chosen[0]

    return _finish(route, name, gpu, "reduction")


def moe_gate_up(experts: int, inter: int, hidden: int, top_k: int, dtype: str, fmt: str = "float",
                weight_dtype: str = "float32", *, scale_dtype: str = "float16", gpu: bool = False,
                max_threads: int = 128, expert_dot: str | None = None,
                name: str = "moe_gate_up") -> tirx.PrimFunc:
    """h[t, j, r] = silu(x[t] . W[idx[t, j], r]) * (x[t] . W[idx[t, j], inter + r]) for the k selected experts.
    `expert_dot` (a CPU target's integer dot, models/moe.expert_dot): "avx2" q4 rows take expert_x86.py's
    pmaddwd dot, "dotprod" q4 / q8 rows expert_arm.py's sdot dot, where they apply."""
    E, M, H, K = int(experts), int(inter), int(hidden), int(top_k)
    _check(fmt, H)
    wshape, sshape = weight_shapes(fmt, E, 2 * M, H)
    cdtype = code_dtype(fmt, weight_dtype)
    outer, inner, threads = _loops(gpu, max_threads)

    per = _rows_per_item(M)      # output rows per work item: per gate rows and their up rows, one x load
    dot = expert_row_dot(fmt, H, 2 * per, _weight_of(fmt), pair=2)
    (vshape, vdtype), (lshape, ldtype) = vector_scratch(2 * per)
    pre = prescale(fmt, H, lambda row: (row,))

    @T.macro
    def cpu_body(x, idx, codes, scales, out, seq_len):
        xp = T.alloc_buffer(prescaled_shape(fmt, seq_len, H), "float32")
        xs = T.alloc_buffer(group_sums_shape(fmt, seq_len, H), "float32")
        pre(xp, xs, x, seq_len)
        for item in T.parallel(seq_len * K * (M // per)):
            t: T.let[T.int64] = item // (K * (M // per))
            j: T.let[T.int64] = item // (M // per) % K
            r: T.let[T.int64] = item % (M // per) * per
            res = T.alloc_buffer((2 * per,), "float32")
            vec = T.alloc_buffer(vshape, vdtype)
            lanes = T.alloc_buffer(lshape, ldtype)
            dot(res, vec, lanes, x, (t,), xp, xs, (t,), codes, scales, idx[t, j], r, M)
            for i in T.unroll(per):
                out[t, j, r + i] = T.Cast(dtype, res[2 * i] / (T.float32(1) + T.exp(-res[2 * i])) * res[2 * i + 1])

    integer = _integer_dot(expert_dot, gpu, fmt, H)
    if integer == "avx2":
        idot = expert_x86.dot(H, 2 * per, pair=2)
        quant = expert_x86.quantize(H, lambda row: (row,))
        pshape, lshape8 = expert_x86.quantized_shapes(1, H)
        (ashape, adtype), (ishape, idtype), (l8shape, l8dtype) = expert_x86.scratch(2 * per)

    @T.macro
    def x86_body(x, idx, codes, scales, out, seq_len):
        pairs = T.alloc_buffer((seq_len, pshape[1]), "int32")
        steps = T.alloc_buffer((seq_len, lshape8[1]), "float32")
        offs = T.alloc_buffer((seq_len, lshape8[1]), "float32")
        qrow = T.alloc_buffer((H,), "int32")
        quant(pairs, steps, offs, qrow, x, seq_len)
        for item in T.parallel(seq_len * K * (M // per)):
            t: T.let[T.int64] = item // (K * (M // per))
            j: T.let[T.int64] = item // (M // per) % K
            r: T.let[T.int64] = item % (M // per) * per
            res = T.alloc_buffer((2 * per,), "float32")
            acc = T.alloc_buffer(ashape, adtype)
            iacc = T.alloc_buffer(ishape, idtype)
            lanes = T.alloc_buffer(l8shape, l8dtype)
            idot(res, acc, iacc, lanes, pairs, steps, offs, t, codes, scales, idx[t, j], r, M)
            for i in T.unroll(per):
                out[t, j, r + i] = T.Cast(dtype, res[2 * i] / (T.float32(1) + T.exp(-res[2 * i])) * res[2 * i + 1])

    if integer == "dotprod":
        adot = expert_arm.dot(fmt, H, 2 * per, pair=2)
        aquant = expert_arm.quantize(fmt, H, lambda row: (row,))
        (xqshape, dshape, bshape) = expert_arm.quantized_shapes(fmt, 1, H)
        ((accshape, accdtype),) = expert_arm.scratch(2 * per)

    @T.macro
    def arm_body(x, idx, codes, scales, out, seq_len):
        xq = T.alloc_buffer((seq_len, *xqshape[1:]), "int8")
        d = T.alloc_buffer((seq_len, dshape[1]), "float32")
        base = T.alloc_buffer((seq_len, bshape[1]), "int32")
        aquant(xq, d, base, x, seq_len)
        for item in T.parallel(seq_len * K * (M // per)):
            t: T.let[T.int64] = item // (K * (M // per))
            j: T.let[T.int64] = item // (M // per) % K
            r: T.let[T.int64] = item % (M // per) * per
            res = T.alloc_buffer((2 * per,), "float32")
            acc = T.alloc_buffer(accshape, accdtype)
            e: T.let[T.int32] = idx[t, j]
            adot(res, acc, xq, d, base, t, codes, scales, e, r, M)
            for i in T.unroll(per):
                out[t, j, r + i] = T.Cast(dtype, res[2 * i] / (T.float32(1) + T.exp(-res[2 * i])) * res[2 * i + 1])

    @T.macro
    def gpu_body(x, idx, codes, scales, out, seq_len):
        for wb in outer((seq_len * K * M + threads - 1) // threads):
            for tx in inner(threads):
                if wb * threads + tx < seq_len * K * M:
                    t = (wb * threads + tx) // (K * M)
                    j = (wb * threads + tx) // M % K
                    r = (wb * threads + tx) % M
                    e = idx[t, j]
                    g = T.alloc_local((1,), "float32")
                    u = T.alloc_local((1,), "float32")
                    g[0] = T.float32(0)
                    u[0] = T.float32(0)
                    for kk in range(H):
                        g[0] = g[0] + T.Cast("float32", x[t, kk]) * _weight(fmt, codes, scales, e, r, kk)
                        u[0] = u[0] + T.Cast("float32", x[t, kk]) * _weight(fmt, codes, scales, e, M + r, kk)
                    out[t, j, r] = T.Cast(dtype, g[0] / (T.float32(1) + T.exp(-g[0])) * u[0])

    body = gpu_body if gpu else {"avx2": x86_body, "dotprod": arm_body, None: cpu_body}[integer]
    if fmt == "float":
        @T.prim_func
        def kernel(x_h: T.handle, idx_h: T.handle, codes: T.Buffer(wshape, cdtype), out_h: T.handle):
            seq_len = T.int64()
            x = T.match_buffer(x_h, (seq_len, H), dtype)
            idx = T.match_buffer(idx_h, (seq_len, K), "int32")
            out = T.match_buffer(out_h, (seq_len, K, M), dtype)
            body(x, idx, codes, None, out, seq_len)
    else:
        @T.prim_func
        def kernel(x_h: T.handle, idx_h: T.handle, codes: T.Buffer(wshape, cdtype), scales: T.Buffer(sshape, scale_dtype),
                   out_h: T.handle):
            seq_len = T.int64()
            x = T.match_buffer(x_h, (seq_len, H), dtype)
            idx = T.match_buffer(idx_h, (seq_len, K), "int32")
            out = T.match_buffer(out_h, (seq_len, K, M), dtype)
            body(x, idx, codes, scales, out, seq_len)

    return _finish(kernel, name, gpu, reduction=H)


def moe_down(experts: int, hidden: int, inter: int, top_k: int, dtype: str, fmt: str = "float",
             weight_dtype: str = "float32", *, scale_dtype: str = "float16", gpu: bool = False,
             max_threads: int = 128, expert_dot: str | None = None,
             name: str = "moe_down") -> tirx.PrimFunc:
    """y[t, r] = sum_j weight[t, j] * (h[t, j] . W[idx[t, j], r]): the down projections and the routing sum.
    `expert_dot`: as in `moe_gate_up`."""
    E, M, H, K = int(experts), int(inter), int(hidden), int(top_k)
    _check(fmt, M)
    wshape, sshape = weight_shapes(fmt, E, H, M)
    cdtype = code_dtype(fmt, weight_dtype)
    outer, inner, threads = _loops(gpu, max_threads)

    per = _rows_per_item(H)      # output rows per work item (consecutive rows: one load of h per 8 weights)
    dot = expert_row_dot(fmt, M, per, _weight_of(fmt), pair=1)
    (vshape, vdtype), (lshape, ldtype) = vector_scratch(per)
    pre = prescale(fmt, M, lambda row: (row // K, row % K))

    @T.macro
    def cpu_body(h, idx, w, codes, scales, out, seq_len):
        xp = T.alloc_buffer(prescaled_shape(fmt, seq_len * K, M), "float32")
        xs = T.alloc_buffer(group_sums_shape(fmt, seq_len * K, M), "float32")
        pre(xp, xs, h, seq_len * K)
        for item in T.parallel(seq_len * (H // per)):
            t: T.let[T.int64] = item // (H // per)
            r: T.let[T.int64] = item % (H // per) * per
            acc = T.alloc_buffer((per,), "float32")
            res = T.alloc_buffer((per,), "float32")
            vec = T.alloc_buffer(vshape, vdtype)
            lanes = T.alloc_buffer(lshape, ldtype)
            for i in T.unroll(per):
                acc[i] = T.float32(0)
            for j in range(K):
                dot(res, vec, lanes, h, (t, j), xp, xs, (t * K + j,), codes, scales, idx[t, j], r, 0)
                for i in T.unroll(per):
                    acc[i] = acc[i] + w[t, j] * res[i]
            for i in T.unroll(per):
                out[t, r + i] = T.Cast(dtype, acc[i])

    integer = _integer_dot(expert_dot, gpu, fmt, M)
    xper = 4 if H % 4 == 0 else per   # integer dots: 4 rows per item where H allows (x loaded once for 4 rows;
    # x86 moe_down of the benchmark's shape 15.2 vs 18.7 us per call with 2)
    if integer == "avx2":
        idot = expert_x86.dot(M, xper, pair=1)
        quant = expert_x86.quantize(M, lambda row: (row // K, row % K))
        pshape, lshape8 = expert_x86.quantized_shapes(1, M)
        (ashape, adtype), (ishape, idtype), (l8shape, l8dtype) = expert_x86.scratch(xper)

    @T.macro
    def x86_body(h, idx, w, codes, scales, out, seq_len):
        pairs = T.alloc_buffer((seq_len * K, pshape[1]), "int32")
        steps = T.alloc_buffer((seq_len * K, lshape8[1]), "float32")
        offs = T.alloc_buffer((seq_len * K, lshape8[1]), "float32")
        qrow = T.alloc_buffer((M,), "int32")
        quant(pairs, steps, offs, qrow, h, seq_len * K)
        for item in T.parallel(seq_len * (H // xper)):
            t: T.let[T.int64] = item // (H // xper)
            r: T.let[T.int64] = item % (H // xper) * xper
            acc_out = T.alloc_buffer((xper,), "float32")
            res = T.alloc_buffer((xper,), "float32")
            acc = T.alloc_buffer(ashape, adtype)
            iacc = T.alloc_buffer(ishape, idtype)
            lanes = T.alloc_buffer(l8shape, l8dtype)
            for i in T.unroll(xper):
                acc_out[i] = T.float32(0)
            for j in range(K):
                idot(res, acc, iacc, lanes, pairs, steps, offs, t * K + j, codes, scales, idx[t, j], r, 0)
                for i in T.unroll(xper):
                    acc_out[i] = acc_out[i] + w[t, j] * res[i]
            for i in T.unroll(xper):
                out[t, r + i] = T.Cast(dtype, acc_out[i])

    if integer == "dotprod":   # as on x86; here also one vector of 4 rows' sums (expert_arm.dot)
        adot = expert_arm.dot(fmt, M, xper, pair=1)
        aquant = expert_arm.quantize(fmt, M, lambda row: (row // K, row % K))
        (xqshape, dshape, bshape) = expert_arm.quantized_shapes(fmt, 1, M)
        ((accshape, accdtype),) = expert_arm.scratch(xper)

    @T.macro
    def arm_body(h, idx, w, codes, scales, out, seq_len):
        xq = T.alloc_buffer((seq_len * K, *xqshape[1:]), "int8")
        d = T.alloc_buffer((seq_len * K, dshape[1]), "float32")
        base = T.alloc_buffer((seq_len * K, bshape[1]), "int32")
        aquant(xq, d, base, h, seq_len * K)
        for item in T.parallel(seq_len * (H // xper)):
            t: T.let[T.int64] = item // (H // xper)
            r: T.let[T.int64] = item % (H // xper) * xper
            acc_out = T.alloc_buffer((xper,), "float32")
            res = T.alloc_buffer((xper,), "float32")
            acc = T.alloc_buffer(accshape, accdtype)
            for i in T.unroll(xper):
                acc_out[i] = T.float32(0)
            for j in range(K):
                e: T.let[T.int32] = idx[t, j]
                adot(res, acc, xq, d, base, t * K + j, codes, scales, e, r, 0)
                for i in T.unroll(xper):
                    acc_out[i] = acc_out[i] + w[t, j] * res[i]
            for i in T.unroll(xper):
                out[t, r + i] = T.Cast(dtype, acc_out[i])

    @T.macro
    def gpu_body(h, idx, w, codes, scales, out, seq_len):
        for wb in outer((seq_len * H + threads - 1) // threads):
            for tx in inner(threads):
                if wb * threads + tx < seq_len * H:
                    t = (wb * threads + tx) // H
                    r = (wb * threads + tx) % H
                    acc = T.alloc_local((1,), "float32")
                    dot = T.alloc_local((1,), "float32")
                    acc[0] = T.float32(0)
                    for j in range(K):
                        dot[0] = T.float32(0)
                        for kk in range(M):
                            dot[0] = dot[0] + T.Cast("float32", h[t, j, kk]) * _weight(fmt, codes, scales,
                                                                                       idx[t, j], r, kk)
                        acc[0] = acc[0] + w[t, j] * dot[0]
                    out[t, r] = T.Cast(dtype, acc[0])

    body = gpu_body if gpu else {"avx2": x86_body, "dotprod": arm_body, None: cpu_body}[integer]
    if fmt == "float":
        @T.prim_func
        def kernel(h_h: T.handle, idx_h: T.handle, w_h: T.handle, codes: T.Buffer(wshape, cdtype), out_h: T.handle):
            seq_len = T.int64()
            h = T.match_buffer(h_h, (seq_len, K, M), dtype)
            idx = T.match_buffer(idx_h, (seq_len, K), "int32")
            w = T.match_buffer(w_h, (seq_len, K), "float32")
            out = T.match_buffer(out_h, (seq_len, H), dtype)
            body(h, idx, w, codes, None, out, seq_len)
    else:
        @T.prim_func
        def kernel(h_h: T.handle, idx_h: T.handle, w_h: T.handle, codes: T.Buffer(wshape, cdtype),
                   scales: T.Buffer(sshape, scale_dtype), out_h: T.handle):
            seq_len = T.int64()
            h = T.match_buffer(h_h, (seq_len, K, M), dtype)
            idx = T.match_buffer(idx_h, (seq_len, K), "int32")
            w = T.match_buffer(w_h, (seq_len, K), "float32")
            out = T.match_buffer(out_h, (seq_len, H), dtype)
            body(h, idx, w, codes, scales, out, seq_len)

    return _finish(kernel, name, gpu, reduction=M)


def moe_reference(x, router, gate_up, down, top_k: int, norm_topk: bool):
    """NumPy float64 reference of the routed experts: x [n, H], router [E, H], gate_up [E, 2I, H],
    down [E, H, I] -> (y [n, H], idx [n, k])."""
    x, router, gate_up, down = (np.asarray(a, np.float64) for a in (x, router, gate_up, down))
    logits = x @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, idx, -1)
    if norm_topk:
        w /= w.sum(-1, keepdims=True)
    inter = gate_up.shape[1] // 2
    y = np.zeros_like(x)
    for t in range(len(x)):
        for j, e in enumerate(idx[t]):
            g, u = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
            y[t] += w[t, j] * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return y, idx
