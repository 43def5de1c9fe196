"""The x86 (AVX2) instruction choice for the MoE expert dot products of q4 rows: integer `pmaddwd` against x
quantized per group of 32 to int16, as the dense q4 GEMVs do (x86.py), in place of expert_rows.py's fp32 form.

Why: an expert row is stored NK (a row's codes consecutive along K), so the dense kernels' KN layouts do
not apply, and the fp32 form spends shift, and, convert and FMA per 8 weights plus a scale step per group
and row: ~0.8 instructions per weight read from the host object, where the dense q4 GEMVs take ~0.2. That
kept the synthetic MoE's q4f16 decode at ~0.63x the dense model with the same active weights
(benchmarks/moe_decode.py, docs/moe.md).

Here K is walked CHUNK = 64 weights (8 code words, two scale groups) at a time per row. A word's 8 codes
sit in 4-bit fields; shifted down by 4c and masked with 0x000F000F, each int32 lane holds code c of its word
in the low int16 half and code c + 4 in the high one, and `pmaddwd` against x's int16 pairs laid out to
match (`quantize`: pairs[c][w] = q[8 w + c] | q[8 w + c + 4] << 16) adds both products: 4 shift / and /
pmaddwd / add steps give each lane (one word) its exact integer sum of 8 code x q products. Lanes 0-3 are
one scale group, 4-7 the next; one convert, a multiply by x's step per lane, the offset's share subtracted
(7 * the group's sum of q * step / 4 per lane: its 4 lanes add up to the group's offset term) and a
multiply-add by the row's two scales (one 2-lane load, shuffled into lanes 0-3 and 4-7) finish the chunk:
21 instructions per 64 weights and row in the host object (0.33 per weight; the fp32 form ~0.8). Exact up to x's int16 steps (~1.5e-5 of a
group's largest |x|), like the dense GEMVs; the sums of a group fit int32 (32 x 15 x 32767 < 2^31).
"""

from __future__ import annotations

from tvm.script import tirx as T

from pipeline.kernels.cpu.packed import INT16_MAX, NK_FORMATS, prefetch_line

# `dot` prefetches each walked row's codes this many rows further on (a thread's work items walk consecutive
# rows of one expert), one line per two chunks. The router picks other experts every token, so decode reads
# them cold: an isolated moe_gate_up (256 experts of 512 x 1024 q4 rows, 2 threads, same process) took 37-47
# us with cold experts against 24 hot; with the prefetch 27-34 cold, hot unchanged (docs/moe.md). Prefetching
# the scale rows too gained nothing.
AHEAD_ROWS = 4
CHUNK = 64                       # weights per step of a row: 8 uint32 words of 8 q4 codes, 2 scale groups
WORDS = 8                        # int32 lanes of one AVX2 vector: one code word each
_Q4 = NK_FORMATS["q4"]
_FIELDS = 0x000F000F             # a code in each int16 half of a lane
_F8, _I8, _H16 = "float32x8", "int32x8", "int16x16"


def supports(fmt: str, k: int) -> bool:
    """Can `dot` take rows of this format and length? (q4, K a multiple of CHUNK)."""
    return fmt == "q4" and k % CHUNK == 0


def quantized_shapes(rows, k: int) -> tuple[tuple, tuple]:
    """Shapes of `quantize`'s outputs for `rows` activation rows of length k: int32 pairs, then the per-lane
    step and offset share (float32, one per lane of each chunk)."""
    return (rows, k // 2), (rows, k // WORDS)


def _load(buf, lead: tuple, kk):
    return buf[(*lead, kk)]


def quantize(k: int, split):
    """A macro quant(pairs, steps, offs, qrow, x, rows): each activation row x[*split(row), :k] quantized per
    group of 32 to int16 (q = round(x * 32767 / max|x|)), laid out for `dot`: pairs[row, (4 ch + c) * 8 + w]
    = q[64 ch + 8 w + c] | q[64 ch + 8 w + c + 4] << 16; steps[row, 4 g + l] = the group's step max|x| /
    32767 and offs[row, 4 g + l] = 7 * sum(q over the group) * step / 4 for its 4 lanes l. qrow: an int32
    scratch of k. Run once per call, before the parallel loop, 8 lanes at a time."""
    group = _Q4.group

    @T.macro
    def quant(pairs, steps, offs, qrow, x, rows):
        vmax = T.alloc_buffer((1,), _F8)
        vsum = T.alloc_buffer((1,), _I8)
        lanes = T.alloc_buffer((WORDS,), "float32")
        ilanes = T.alloc_buffer((WORDS,), "int32")
        big = T.alloc_buffer((1,), "float32")
        total = T.alloc_buffer((1,), "int32")
        for row in range(rows):
            for g in range(k // group):
                vmax[0] = T.Broadcast(T.float32(0), WORDS)
                for v in T.unroll(group // WORDS):
                    vmax[0] = T.max(vmax[0], T.fabs(T.Cast(_F8, _load(x, split(row), T.Ramp(g * group + v * WORDS, 1, WORDS)))))
                lanes[T.Ramp(0, 1, WORDS)] = vmax[0]
                big[0] = lanes[0]
                for j in T.unroll(1, WORDS):
                    big[0] = T.max(big[0], lanes[j])
                vsum[0] = T.Broadcast(T.int32(0), WORDS)
                for v in T.unroll(group // WORDS):
                    qrow[T.Ramp(g * group + v * WORDS, 1, WORDS)] = T.Cast(_I8, T.round(
                        T.Cast(_F8, _load(x, split(row), T.Ramp(g * group + v * WORDS, 1, WORDS))) * T.Broadcast(
                            T.if_then_else(big[0] > T.float32(0), T.float32(INT16_MAX) / big[0], T.float32(0)), WORDS)))
                    vsum[0] = vsum[0] + qrow[T.Ramp(g * group + v * WORDS, 1, WORDS)]
                ilanes[T.Ramp(0, 1, WORDS)] = vsum[0]
                total[0] = ilanes[0]
                for j in T.unroll(1, WORDS):
                    total[0] = total[0] + ilanes[j]
                steps[row, T.Ramp(4 * g, 1, 4)] = T.Broadcast(big[0] * T.float32(1.0 / INT16_MAX), 4)
                offs[row, T.Ramp(4 * g, 1, 4)] = T.Broadcast(T.Cast("float32", total[0] * _Q4.offset) * (
                    big[0] * T.float32(1.0 / INT16_MAX)) * T.float32(0.25), 4)
            for ch in range(k // CHUNK):   # pairs[(4 ch + c) * 8 + w] = q[64 ch + 8 w + c] | q[64 ch + 8 w + c + 4] << 16
                for c in T.unroll(4):
                    pairs[row, T.Ramp((ch * 4 + c) * WORDS, 1, WORDS)] = T.bitwise_or(
                        T.bitwise_and(qrow[T.Ramp(ch * CHUNK + c, WORDS, WORDS)], T.Broadcast(T.int32(65535), WORDS)),
                        T.shift_left(qrow[T.Ramp(ch * CHUNK + c + 4, WORDS, WORDS)], T.Broadcast(T.int32(16), WORDS)))

    return quant


def _row(r, i, stride, pair: int):
    return r + i % pair * stride + i // pair


def _words(codes, e, row, ch):
    """The 8 code words of chunk ch of row `row` of expert e (one 32-byte load)."""
    return codes[e, row, T.Ramp(ch * WORDS, 1, WORDS)]


def _pmadd(codes, e, row, ch, c: int, pairs, plead):
    """pmaddwd of codes c and c + 4 of the chunk's 8 words (one per int16 half of a lane) with x's pairs."""
    fields = T.bitwise_and(T.shift_right(_words(codes, e, row, ch), T.Broadcast(T.uint32(4 * c), WORDS)),
                           T.Broadcast(T.uint32(_FIELDS), WORDS))
    return T.call_llvm_pure_intrin(_I8, "llvm.x86.avx2.pmadd.wd", T.reinterpret(_H16, fields),
                                   T.reinterpret(_H16, pairs[plead, T.Ramp((ch * 4 + c) * WORDS, 1, WORDS)]))


def _group_scales(scales, e, row, ch):
    """The chunk's two group scales of a row in its lanes 0-3 and 4-7 as fp32: one 2-lane load, shuffled (a
    shuffle takes at most its inputs' lanes: the pair four times)."""
    pair = scales[e, row, T.Ramp(2 * ch, 1, 2)]
    return T.Cast(_F8, T.Shuffle([pair, pair, pair, pair], [0, 2, 4, 6, 1, 3, 5, 7]))


def scratch(rows: int) -> tuple[tuple[tuple[int], str], ...]:
    """(shape, dtype) of `dot`'s scratch buffers: fp32 lane sums, int32 chunk sums, 8 fp32 lanes."""
    return ((rows,), _F8), ((rows,), _I8), ((WORDS,), "float32")


def dot(k: int, rows: int, pair: int = 0):
    """A macro dot(res, acc, iacc, lanes, pairs, steps, offs, plead, codes, scales, e, r, stride): res[i] = x .
    W[e, row i, :k] for i < rows, rows as in expert_rows.expert_row_dot (`pair`), x as `quantize` left it at
    row `plead`; acc, iacc, lanes: the caller's `scratch`."""
    pair = pair or rows

    @T.macro
    def dot_(res, acc, iacc, lanes, pairs, steps, offs, plead, codes, scales, e, r, stride):
        for i in T.unroll(rows):
            acc[i] = T.Broadcast(T.float32(0), WORDS)
        for ch in range(k // CHUNK):
            if ch % 2 == 0:   # a 64-byte line of codes is two chunks
                for i in T.unroll(rows):
                    T.evaluate(prefetch_line(codes[e, T.min(_row(r, i, stride, pair) + AHEAD_ROWS, codes.shape[1] - 1),
                                                   ch * WORDS]))
            for i in T.unroll(rows):
                iacc[i] = _pmadd(codes, e, _row(r, i, stride, pair), ch, 0, pairs, plead)
                for c in T.unroll(3):
                    iacc[i] = iacc[i] + _pmadd(codes, e, _row(r, i, stride, pair), ch, c + 1, pairs, plead)
                acc[i] = acc[i] + _group_scales(scales, e, _row(r, i, stride, pair), ch) * (T.Cast(_F8, iacc[i]) * steps[plead, T.Ramp(ch * WORDS, 1, WORDS)]
                                           - offs[plead, T.Ramp(ch * WORDS, 1, WORDS)])
        for i in T.unroll(rows):
            lanes[T.Ramp(0, 1, WORDS)] = acc[i]
            res[i] = T.float32(0)
            for j in T.unroll(WORDS):
                res[i] = res[i] + lanes[j]

    return dot_
