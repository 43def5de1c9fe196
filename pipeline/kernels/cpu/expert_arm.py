"""The AArch64 (dotprod) instruction choice for the MoE expert dot products of q4 / q8 rows: `sdot` against x
quantized per group of 32 as the dense sdot GEMVs quantize it (arm.py), in place of expert_rows.py's fp32 form.

Why: an expert row is stored NK (a row's codes consecutive along K, one expert's rows chosen by the router's
index), so android-cpu's interleaved-rows layout (arm_rows.py) does not apply, and the fp32 form compiles to
NEON with 4 fp32 lanes: per 4 weights a variable shift (`ushl`), `and`, `ucvtf` and `fmla`, plus the x load
and a scale step per group and row: 1.8-1.95 instructions per weight in its hot loop (read from the object,
docs/moe.md), where the dense q4 GEMVs take 0.29.

Here, as over arm.py's plain NK rows, each row's group of 32 weights is one 16-byte load (q4: 4 code words;
q8: two loads of 16 int8 codes) met by x's group in `sdot`s: q4's low nibbles (`and`) meet x's 16 even
values, its high nibbles (`ushr`) the 16 odd ones (arm.dot_layout). x is held in two signed bytes per value
(q = round(x * 32512 / max|x|) = 256 hi + lo, arm.X_BYTES; int8 x cost too much accuracy: arm.Q_MAX), so a
q4 group is 4 `sdot`s (two per byte plane), the high plane's int32 sums times 256 plus the low plane's (one
`mla`: the 256 is read from memory) started from the group's offset term (-7 sum(q) in lane 0, so the codes
are not re-centred), one `scvtf` and one `fmla` by the row's scale times x's step (the rows' scales of a
group gathered into one vector, converted and multiplied by the step once). A row's 4 lanes are added at
the end. x is quantized once per call by arm.quantize_row_macro (the same steps and rounding as every
android-cpu sdot kernel), so the results are exact up to x's steps (half of max|x| / 32512 per value) and
fp32 summation order. The integer sums fit int32 (32 x 127 x 32512 per group for q8).
"""

from __future__ import annotations

from tvm.script import tirx as T

from pipeline.kernels.cpu.arm import SDOT, X_BYTES, dot_layout, quantize_row_macro
from pipeline.kernels.cpu.packed import NK_FORMATS

FORMATS = ("q4", "q8")
_F4, _I4 = "float32x4", "int32x4"
ADDP = "llvm.aarch64.neon.addp"


def supports(fmt: str, k: int) -> bool:
    """Can `dot` take rows of this format and length? (q4 / q8: whole groups of 32, which moe_kernels requires of
    every q4 / q8 expert weight, so every K they take.)"""
    return fmt in FORMATS and k % NK_FORMATS[fmt].group == 0


def quantized_shapes(fmt: str, rows, k: int, x_bytes: int = X_BYTES) -> tuple[tuple, tuple, tuple]:
    """Shapes of `quantize`'s outputs for `rows` activation rows of length k: the int8 bytes of x (per row, its
    byte planes, each group in arm.dot_layout's order), each group's step (fp32), each group's offset term (4
    int32 lanes per group)."""
    groups = k // NK_FORMATS[fmt].group
    return (rows, x_bytes, k), (rows, groups), (rows, 4 * groups)


def quantize(fmt: str, k: int, split, x_bytes: int = X_BYTES):
    """A macro quant(xq, d, base, x, rows): each activation row x[*split(row), :k] quantized per group of 32 by
    arm.quantize_row_macro (the dense sdot kernels' rounding) into `quantized_shapes`' buffers. Run once per
    call, before the parallel loop over the outputs; rows in parallel (moe_down's n x k slots)."""
    spec = NK_FORMATS[fmt]
    row = quantize_row_macro(spec.group, k, x_bytes, spec.offset,
                             lambda g, j: g * spec.group + dot_layout(spec, j),
                             lambda x, r, kk: x[(*split(r), kk)])

    @T.macro
    def quant(xq, d, base, x, rows):
        for r in T.parallel(rows):
            row(x, xq, d, base, r)

    return quant


def _row(r, i, stride, pair: int):
    """Row i of a work item's rows (expert_rows.expert_row_dot's order)."""
    return r + i % pair * stride + i // pair


def _codes(fmt: str, codes, e, row, g, h):
    """Bytes 16 h .. 16 h + 15 of group g of row `row` of expert e, as int8x16 (q4: 4 words; q8: 16 codes)."""
    if fmt == "q8":
        return codes[e, row, T.Ramp(g * 32 + h * 16, 1, 16)]
    return T.reinterpret("int8x16", codes[e, row, T.Ramp(g * 4, 1, 4)])


def _planes(fmt: str, v):
    """The code vectors one 16-byte load gives, in x's order: q4 the low nibbles (even k), then the high (odd k)."""
    if fmt == "q8":
        return [v]
    return [T.bitwise_and(v, T.Broadcast(T.int8(0xF), 16)),
            T.reinterpret("int8x16", T.shift_right(T.reinterpret("uint8x16", v), T.Broadcast(T.uint8(4), 16)))]


def _row_sums(fmt: str, x_bytes: int, codes, e, row, g, xq, xrow):
    """int32x4 whose lanes add up to group g's integer dot of row `row` with x row `xrow`, offset term left out.
    Two bytes: the high plane's sdot's, shifted left by 8 (x 256, exact: |sum| <= 32 x 127 x 127 for q8), then
    the low plane's into the same lanes: one `shl` per row and group instead of a second accumulator and an `mla`."""
    vectors = [p for h in range(2 if fmt == "q8" else 1) for p in _planes(fmt, _codes(fmt, codes, e, row, g, h))]
    acc = T.Broadcast(T.int32(0), 4)
    for b in range(x_bytes):
        if b:
            acc = T.shift_left(acc, T.Broadcast(T.int32(8), 4))
        for u, v in enumerate(vectors):
            acc = T.call_llvm_pure_intrin(_I4, SDOT, acc, v, xq[xrow, b, T.Ramp(g * 32 + u * 16, 1, 16)])
    return acc


def _addp(a, b):
    """[a0 + a1, a2 + a3, b0 + b1, b2 + b3] (one `addp`)."""
    return T.call_llvm_pure_intrin(_I4, ADDP, a, b)


def _scales(scales, e, rows: list, g):
    """The group-g scales of `rows` (4 row indices), as fp32 lanes (one load per distinct row, one convert)."""
    return T.Cast(_F4, T.Shuffle([scales[e, row, g] for row in rows], list(range(4))))


def scratch(rows: int) -> tuple[tuple[tuple[int], str], ...]:
    """(shape, dtype) of `dot`'s scratch: one fp32 vector per 4 rows (its lanes: the rows' sums)."""
    return (((-(-rows // 4),), _F4),)


def dot(fmt: str, k: int, rows: int, pair: int = 0, x_bytes: int = X_BYTES):
    """A macro dot(res, acc, xq, d, base, xrow, codes, scales, e, r, stride): res[i] = x . W[e, row i, :k] for
    i < rows, rows as in expert_rows.expert_row_dot (`pair`), x as `quantize` left it at row `xrow`; acc: the
    caller's `scratch`. `rows`: 1, 2 or a multiple of 4.

    Per group and 4 rows: each row's `_row_sums`, the 4 rows' lanes reduced by 3 `addp` to one vector (lane i:
    row i's integer group dot), the offset term added (x's group sum, `ld1r`), `scvtf`, one `fmla` by the 4
    rows' scales times x's step. No per-row convert, scale or horizontal add."""
    assert supports(fmt, k) and x_bytes in (1, 2), (fmt, k, x_bytes)
    assert rows in (1, 2) or rows % 4 == 0, rows
    pair = pair or rows
    groups = k // NK_FORMATS[fmt].group
    count = min(4, rows)                 # rows per vector (fewer than 4: repeated, CSE'd by LLVM)

    def quad_sums(codes, e, g, xq, xrow, base, rows_at):
        sums = [_row_sums(fmt, x_bytes, codes, e, rows_at[i % count], g, xq, xrow) for i in range(4)]
        return _addp(_addp(sums[0], sums[1]), _addp(sums[2], sums[3])) + T.Broadcast(base[xrow, g * 4], 4)

    @T.macro
    def dot_(res, acc, xq, d, base, xrow, codes, scales, e, r, stride):
        for q in T.unroll(rows // count):
            acc[q] = T.Broadcast(T.float32(0), 4)
        for g in range(groups):
            for q in T.unroll(rows // count):
                acc[q] = acc[q] + T.Cast(_F4, quad_sums(
                    codes, e, g, xq, xrow, base, [_row(r, q * count + i % count, stride, pair) for i in range(4)])) * (
                    _scales(scales, e, [_row(r, q * count + i % count, stride, pair) for i in range(4)], g)
                    * T.Broadcast(d[xrow, g], 4))
        for i in T.unroll(rows):
            res[i] = T.Shuffle([acc[i // count]], [i % count])

    return dot_
