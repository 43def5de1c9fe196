"""Vectorised CPU dot products of an activation row with one or two rows of a stacked expert weight (the
inner loop of the MoE gather and grouped kernels, models/moe_kernels.py and moe_grouped.py).

Why: the experts are stored NK per expert ([E, N, K] float, or each row's codes and scales as a dense NK
layer stores them), and the kernels' serial per-weight loop (index arithmetic, a shift by a variable, a
scale load and a convert per weight, one fp32 chain) left the MoE's decode at about half the dense model's
speed with the same active weights (benchmarks/moe_decode.py). Here a row is walked LANES weights at a time,
the way the dense GEMVs walk theirs (packed.py's formats: a word's codes masked out of a broadcast word by a
vector of shifts, converted, times x's matching lanes; one scale multiply per group): two partial-sum
chains per row, and the gate and up rows of an expert (same x) walked side by side so x is loaded once.
q8 reads 8 int8 codes per vector; t3 (20 base-3 codes per word, groups of 128 that words straddle) takes a
word's 4 bytes as 4 lanes and peels its 5 digits, one scale per word when the word lies in one group (the
scalar reader otherwise). A row's lanes are summed in a fixed order, then the weights past the last whole
word (a sign packing's padded word) are added one by one with the scalar reader the caller passes, so the
gather and the grouped kernels, which share this macro, give identical numbers.
"""

from __future__ import annotations

from tvm.script import tirx as T

from pipeline.kernels.cpu.packed import LANES, NK_FORMATS

T3_PER_WORD, T3_BYTES, T3_GROUP = 20, 4, 128   # t3: 5 base-3 codes per byte, 4 bytes per uint32 word
_VF = f"float32x{LANES}"


def _load(buf, lead: tuple, kk):
    """buf[*lead, kk] (kk a scalar index or a Ramp)."""
    return buf[(*lead, kk)]


def _pow3(d):
    """3^d as uint32 for an unrolled loop variable d in [0, 5) (folds to a constant once unrolled)."""
    return T.Select(d == 0, T.uint32(1), T.Select(d == 1, T.uint32(3), T.Select(
        d == 2, T.uint32(9), T.Select(d == 3, T.uint32(27), T.uint32(81)))))


def vector_scratch(rows: int) -> tuple[tuple[tuple[int], str], tuple[tuple[int], str]]:
    """(shape, dtype) of the two scratch buffers `expert_row_dot`'s macro needs: vectors, lanes."""
    return ((4 * rows,), _VF), ((LANES,), "float32")


def expert_row_dot(fmt: str, k: int, rows: int, weight_at, pair: int = 0):
    """A macro dot(res, vec, lanes, x, lead, xp, xs, xlead, codes, scales, e, r, stride): res[i] = x[*lead, :k] .
    W[e, row i, :k] in fp32 for i < `rows`, row i = r + (i % pair) * stride + i // pair (`pair` 0: rows; e.g.
    gate_up: 4 rows, pair 2 = gate r, up r, gate r + 1, up r + 1; xp / xs / xlead: `prescale`'s buffers). `weight_at(codes, scales, e, row, kk)`: the
    scalar reader of one weight (for the tail past the last whole word and t3's straddling words); `vec`,
    `lanes`: the caller's scratch (`vector_scratch`), allocated once per work item."""
    pair = pair or rows
    if fmt == "float":
        return _float_dot(k, rows, pair, weight_at)
    if fmt == "q8":
        return _q8_dot(k, rows, pair)
    if fmt == "t3":
        return _t3_dot(k, rows, pair, weight_at)
    return _packed_dot(NK_FORMATS[fmt], k, rows, pair, weight_at)


def _row(r, i, stride, pair: int):
    """Row i of a work item's rows (expert_row_dot)."""
    return r + i % pair * stride + i // pair


@T.macro
def _reduce(res, vec, lanes, rows: T.int32):
    """res[i] += the lanes of vec[4 i] + vec[4 i + 1], summed in lane order."""
    for i in T.unroll(rows):
        lanes[T.Ramp(0, 1, LANES)] = vec[4 * i] + vec[4 * i + 1]
        for j in T.unroll(LANES):
            res[i] = res[i] + lanes[j]


def _tail(k: int, start: int, rows: int, pair: int, weight_at):
    """A macro adding x[kk] * W[kk] for kk in [start, k) one by one (none when start == k)."""

    @T.macro
    def tail(res, x, lead, codes, scales, e, r, stride):
        if start < k:
            for i in T.unroll(rows):
                for kk in range(start, k):
                    res[i] = res[i] + T.Cast("float32", _load(x, lead, kk)) * weight_at(codes, scales, e, _row(r, i, stride, pair), kk)

    return tail


def _float_dot(k: int, rows: int, pair: int, weight_at):
    step = 2 * LANES
    tail = _tail(k, k // step * step, rows, pair, weight_at)

    @T.macro
    def dot(res, vec, lanes, x, lead, xp, xs, xlead, codes, scales, e, r, stride):
        for j in T.unroll(4 * rows):
            vec[j] = T.Broadcast(T.float32(0), LANES)
        for i in T.unroll(rows):
            res[i] = T.float32(0)
        for ko in range(k // step):
            for c in T.unroll(2):
                for i in T.unroll(rows):
                    vec[4 * i + c] = vec[4 * i + c] + T.Cast(_VF, codes[e, _row(r, i, stride, pair), T.Ramp(ko * step + c * LANES, 1, LANES)]) * T.Cast(
                        _VF, _load(x, lead, T.Ramp(ko * step + c * LANES, 1, LANES)))
        _reduce(res, vec, lanes, rows)
        tail(res, x, lead, codes, scales, e, r, stride)

    return dot


def _q8_dot(k: int, rows: int, pair: int):
    group = NK_FORMATS["q8"].group     # k is a multiple of it (moe_kernels._check)

    @T.macro
    def dot(res, vec, lanes, x, lead, xp, xs, xlead, codes, scales, e, r, stride):
        for j in T.unroll(4 * rows):
            vec[j] = T.Broadcast(T.float32(0), LANES)
        for i in T.unroll(rows):
            res[i] = T.float32(0)
        for g in range(k // group):
            for i in T.unroll(rows):
                vec[4 * i + 2] = T.Broadcast(T.float32(0), LANES)
                vec[4 * i + 3] = T.Broadcast(T.float32(0), LANES)
            for c in T.unroll(group // LANES):
                for i in T.unroll(rows):
                    vec[4 * i + 2 + c % 2] = vec[4 * i + 2 + c % 2] + T.Cast(_VF, codes[
                        e, _row(r, i, stride, pair), T.Ramp(g * group + c * LANES, 1, LANES)]) * T.Cast(
                        _VF, _load(x, lead, T.Ramp(g * group + c * LANES, 1, LANES)))
            for i in T.unroll(rows):
                vec[4 * i] = vec[4 * i] + T.Cast(_VF, T.Broadcast(
                    scales[e, _row(r, i, stride, pair), g], LANES)) * (vec[4 * i + 2] + vec[4 * i + 3])
        _reduce(res, vec, lanes, rows)

    return dot


PRESCALED = ("q4", "t2", "b1")   # formats whose dot reads x in fp32 and its offset group sums (`prescale`)


def prescaled_shape(fmt: str, rows, k: int) -> tuple:
    """Shape of the x that `prescale` fills for `rows` activation rows of length k ([1, 1]: none needed)."""
    return (rows, k) if fmt in PRESCALED else (1, 1)


def group_sums_shape(fmt: str, rows, k: int) -> tuple:
    """Shape of the offset group sums that `prescale` fills ([1, 1]: none needed)."""
    return (rows, -(-k // NK_FORMATS[fmt].group)) if fmt in PRESCALED else (1, 1)


def prescale(fmt: str, k: int, split):
    """A macro pre(xp, xs, x, rows): for each activation row (x[*split(row), :k]), xp = x in fp32 (converted
    once, not once per output row) and xs = offset * the sum of x over each group's whole words, so that a
    group's value is scale * (step * sum(code * x) - xs) and the offset costs nothing per weight. Run once per
    call, before the parallel loop; a no-op for formats that read x as it is."""
    if fmt not in PRESCALED:
        @T.macro
        def nothing(xp, xs, x, rows):
            T.evaluate(0)

        return nothing
    spec = NK_FORMATS[fmt]
    end = k // spec.codes * spec.codes          # past the last whole word: the scalar tail reads x itself

    @T.macro
    def pre(xp, xs, x, rows):
        for row in range(rows):
            for g in range(-(-end // spec.group)):
                xs[row, g] = T.float32(0)
                for j in range(T.min(spec.group, end - g * spec.group)):
                    xs[row, g] = xs[row, g] + T.Cast("float32", _load(x, split(row), g * spec.group + j))
                xs[row, g] = xs[row, g] * T.float32(spec.offset)
            for kk in range(k):
                xp[row, kk] = T.Cast("float32", _load(x, split(row), kk))

    return pre


def _codes(spec, word, v: int):
    """Vector v of a word's codes as fp32: each lane's field shifted down by its own amount (one variable
    shift: AVX2 vpsrlvd, NEON ushl) and masked, then converted as int32 (0 .. 2^bits - 1: exact). Masking the
    fields in place instead (code * 2^(bits i), no shift) needs an unsigned convert for the top field, which
    AVX2 lacks: LLVM emulated it with 6 instructions per 8 weights (read from the host-cpu object)."""
    shifts = T.Ramp(T.uint32(spec.bits * v * LANES), T.uint32(spec.bits), LANES)   # constants
    fields = T.bitwise_and(T.shift_right(T.Broadcast(word, LANES), shifts), T.Broadcast(T.uint32((1 << spec.bits) - 1), LANES))
    return T.Cast(_VF, T.Cast(f"int32x{LANES}", fields))


def _packed_dot(spec, k: int, rows: int, pair: int, weight_at):
    """q4 / t2 / b1: per word, codes // LANES vectors of codes (`_codes`: shift, and, convert) against x's
    matching lanes (one FMA per LANES weights); per group scale * (step * sum - xs)."""
    per_word = spec.codes
    vecs = per_word // LANES                 # q4 1, t2 2, b1 4 vectors per word
    per_group = spec.group // per_word       # words per scale group
    words = k // per_word                    # whole words (a sign packing's last word may be padded)
    groups, rest = divmod(words, per_group)  # whole groups, then the words of a short last group
    tail = _tail(k, words * per_word, rows, pair, weight_at)

    @T.macro
    def group_sum(res, vec, xp, xs, xlead, codes, scales, e, r, stride, g, count: T.int32):
        for i in T.unroll(rows):
            vec[4 * i + 2] = T.Broadcast(T.float32(0), LANES)
            vec[4 * i + 3] = T.Broadcast(T.float32(0), LANES)
        for w in T.unroll(count):
            for v in T.unroll(vecs):
                for i in T.unroll(rows):
                    vec[4 * i + 2 + (w * vecs + v) % 2] = vec[4 * i + 2 + (w * vecs + v) % 2] + _codes(
                        spec, codes[e, _row(r, i, stride, pair), g * per_group + w], v) * _load(
                        xp, xlead, T.Ramp((g * per_group + w) * per_word + v * LANES, 1, LANES))
        for i in T.unroll(rows):   # the offset once per group, not per lane: into the row's scalar sum
            vec[4 * i] = vec[4 * i] + T.Cast(_VF, T.Broadcast(
                scales[e, _row(r, i, stride, pair), g], LANES)) * ((vec[4 * i + 2] + vec[4 * i + 3]) * T.Broadcast(
                    T.float32(spec.step), LANES))
            res[i] = res[i] - T.Cast("float32", scales[e, _row(r, i, stride, pair), g]) * _load(xs, xlead, g)

    @T.macro
    def dot(res, vec, lanes, x, lead, xp, xs, xlead, codes, scales, e, r, stride):
        for j in T.unroll(4 * rows):
            vec[j] = T.Broadcast(T.float32(0), LANES)
        for i in T.unroll(rows):
            res[i] = T.float32(0)
        for g in range(groups):
            group_sum(res, vec, xp, xs, xlead, codes, scales, e, r, stride, g, per_group)
        if rest > 0:
            group_sum(res, vec, xp, xs, xlead, codes, scales, e, r, stride, groups, rest)
        _reduce(res, vec, lanes, rows)
        tail(res, x, lead, codes, scales, e, r, stride)

    return dot


def _t3_dot(k: int, rows: int, pair: int, weight_at):
    """t3: a word's 4 bytes in 4 lanes, digit j of each (code = byte // 3^j % 3) against x[20 w + 5 b + j];
    a word inside one scale group takes that group's scale once, a word across two the scalar reader."""
    words = k // T3_PER_WORD
    tail = _tail(k, words * T3_PER_WORD, rows, pair, weight_at)
    v4f = f"float32x{T3_BYTES}"

    @T.macro
    def dot(res, vec, lanes, x, lead, xp, xs, xlead, codes, scales, e, r, stride):
        for j in T.unroll(4 * rows):
            vec[j] = T.Broadcast(T.float32(0), LANES)
        for i in T.unroll(rows):
            res[i] = T.float32(0)
        for w in range(words):
            if w * T3_PER_WORD // T3_GROUP == (w * T3_PER_WORD + T3_PER_WORD - 1) // T3_GROUP:
                for i in T.unroll(rows):
                    lanes[T.Ramp(0, 1, LANES)] = T.Broadcast(T.float32(0), LANES)   # the word's sums: lanes 0-3
                    for d in T.unroll(5):
                        lanes[T.Ramp(0, 1, T3_BYTES)] = lanes[T.Ramp(0, 1, T3_BYTES)] + T.Cast(v4f, T.Cast(
                            f"int32x{T3_BYTES}", T.truncmod(T.truncdiv(T.bitwise_and(T.shift_right(
                                T.Broadcast(codes[e, _row(r, i, stride, pair), w], T3_BYTES), T.Ramp(T.uint32(0), T.uint32(8), T3_BYTES)),
                                T.Broadcast(T.uint32(0xFF), T3_BYTES)), T.Broadcast(_pow3(d), T3_BYTES)),
                                T.Broadcast(T.uint32(3), T3_BYTES))) - T.Broadcast(T.int32(1), T3_BYTES)) * T.Cast(
                            v4f, _load(x, lead, T.Ramp(w * T3_PER_WORD + d, 5, T3_BYTES)))
                    vec[4 * i] = vec[4 * i] + T.Cast(_VF, T.Broadcast(
                        scales[e, _row(r, i, stride, pair), w * T3_PER_WORD // T3_GROUP], LANES)) * lanes[T.Ramp(0, 1, LANES)]
            else:
                for i in T.unroll(rows):
                    for kk in T.unroll(T3_PER_WORD):
                        res[i] = res[i] + T.Cast("float32", _load(x, lead, w * T3_PER_WORD + kk)) * weight_at(
                            codes, scales, e, _row(r, i, stride, pair), w * T3_PER_WORD + kk)
        _reduce(res, vec, lanes, rows)
        tail(res, x, lead, codes, scales, e, r, stride)

    return dot

