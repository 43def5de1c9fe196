"""AArch64 `sdot` GEMV / prefill matmul over NK t3 codes (base 3: five trits per byte, 20 per uint32 word,
formats.T3_PER_WORD; one scale per 128 weights along K): android-cpu's (rows interleaved by 4, target
t3_interleave, or plain NK) and android-hexagon's CPU half's (KN).

Why: t3 is the smallest ternary packing (1.725 bits per weight), but its groups of 128 do not end on a byte
(128 / 5 = 25.6), so arm.py's per-group code vectors do not exist; before this kernel no rule took t3 GEMVs
(`cpu-default`: TVM's default lowering of the fused TE, a division by 3^j and a modulo per weight).

Rows: a task owns ROWS = 4 consecutive output rows. A "word vector" holds one word of each of the 4 rows
(32-bit lane i: row i), and `sdot` by element (`sdot v.4s, codes.16b, x.4b[lane]`) adds each row's 4-byte dot
into its own int32 lane: a group's 4 rows end in one vector, no horizontal add (arm_rows.py's form). Rows
interleaved by 4 ([N / 4, words, 4], quantize.tile_kn of the transposed words, as t2's) and KN codes give a
word vector per 16-byte load; plain NK rows take one 16-byte load of 4 words per row and a 4 x 4 transpose of
32-bit lanes (`zip` / `uzp` / `ext`), which with its register pressure cost ~40% more instructions.

Groups: group g's 128 trits lie in the 8 words from word 128 g // 20 on (its window: two loads per row),
the first and last words shared with the neighbouring groups. x is quantized per group of 128 (the steps and
rounding of the q4 / t2 / b1 kernels: arm_rows.py's vector macro into t2's order, then one constant shuffle
per group into its slots, where 16 divides K; else arm.py's scalar quantize_row_macro) into 160 bytes per
group laid out as the window's word vectors meet them (`x_position`), the slots of other groups' trits zero,
so a group is
the same code for every g (a runtime loop, small enough for LLVM to keep mostly in registers; one static body
for all of K spilled ~300 vectors) at the price of 160 decoded trits per 128. One sdot chain per byte of x
through the window (two per byte, plain NK: 395 instructions per group, spilling; one: 322). The last one or
two groups, whose window runs past the row, are unrolled with their missing words left out.

Decoding a byte b = c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4 (codes c = trit + 1 in {0, 1, 2}) in NEON, 16 bytes at
once, without division: -c4 = (b > 80) + (b > 161) as two `cmhi` masks (-1 each) and an `add`; b - 81 c4 by
one `mla` (mod 256, exact); the same for c3 with 26 / 53 and 27, leaving r = c0 + 3 c1 + 9 c2 in [0, 26];
then each of -c2, -c1, -c0 is one `tbl` of r in a 32-byte table: 11 instructions per 16 bytes (80 codes).
(Successive trits by multiplying by 3 mod 256 and taking the high byte needs the bytes rescaled by 256 / 243
at pack time and still costs `mul` + 2 `cmhi` + `add` per trit, 19; a 243-entry table does not fit `tbl`'s
64 bytes.) Every plane is -c: the sums start from +sum(q) of x's group and are scaled by -step, so (c - 1) q
= -((-c) q + q) costs nothing extra.

KN codes (android-hexagon's CPU half: [ceil(K / 20), N]) are the same kernel without the transpose: a 16-byte
load of a code row is one word of 4 consecutive outputs, and their 4 scales one load.

A prompt (x [1, m, K]) runs the rows of x inside the task two at a time (PROMPT_ROWS; the task's 4 weight
rows stay in L1, each code load and decoding serves both rows), after its rows are quantized in parallel.
Each task owns 4 output rows, so 1 and 4 threads give identical outputs; N need not divide by 4 (the last
task's missing rows read row N - 1 and are not stored).

Read from the object (the group loop: 4 rows x 128 weights, two-byte x): interleaved rows 238 instructions
(80 `sdot`, 88 decoding), 0.46 per weight; KN 229, 0.45; plain NK 322-331, 0.63-0.65 (int8 x: 213-215, 0.42).
t2 over interleaved rows: 0.256. Prefill, interleaved rows, two prompt rows per pass: 474 per group and pair,
0.46 per weight and row (one row per pass: 253, 0.49; the pair spills ~40 vectors).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.formats import SIGN_GROUP, T3_PER_BYTE, T3_PER_WORD
from pipeline.kernels.cpu.arm import Q_MAX, SDOT, X_BYTES, quantize_row_macro
from pipeline.kernels.cpu.arm_kn import match_kn
from pipeline.kernels.cpu.arm_rows import interleaved_position, quantize_row_vector_macro
from pipeline.kernels.cpu.packed import NK_FORMATS, TILED_T3, substitute
from pipeline.kernels.cpu.recognize import match_packed_nk_gemv

ROWS = 4                  # output rows per task: one int32 lane each
UNIT = 4                  # words per row load (16 bytes), transposed into UNIT word vectors
WINDOW = 8                # words a group of 128 trits touches, at most (two units)
SLOTS = WINDOW * T3_PER_WORD       # 160 bytes of x per group and byte plane
TBL2 = "llvm.aarch64.neon.tbl2"
WORD_BYTES = 4
PROMPT_ROWS = 2           # prefill: prompt rows per pass over a task's codes (arm_rows.py's choice)


def window_start(g):
    """The first word of group g (an int or a TIR expression): the one holding its trit 128 g."""
    return g * SIGN_GROUP // T3_PER_WORD


def x_position(g, j):
    """Where value j of group g (ints or TIR expressions) sits in the quantized row: group g's 160 slots, then
    the unit of its word in the group's window, its trit plane (digit of its byte), the word within the unit
    (the 4-byte lane), its byte within the word."""
    t = g * SIGN_GROUP + j
    rel = t // T3_PER_WORD - window_start(g)
    return (g * SLOTS + rel // UNIT * (UNIT * T3_PER_WORD) + t % T3_PER_BYTE * 16 + rel % UNIT * WORD_BYTES
            + t % T3_PER_WORD // T3_PER_BYTE)


def _bytes(values) -> tirx.PrimExpr:
    """An int8x16 constant."""
    return T.Shuffle([T.int8(v) for v in values], list(range(16)))


def _neg_above(v, threshold: int):
    """-1 where the uint8 lane exceeds `threshold`, else 0 (one `cmhi`)."""
    return T.Select(v > T.Broadcast(T.uint8(threshold), 16), T.Broadcast(T.int8(-1), 16), T.Broadcast(T.int8(0), 16))


# -c of the trit of weight 3^j (j = 2, 1, 0) of r = c0 + 3 c1 + 9 c2 in [0, 26], two 16-byte halves each
_TABLES = {j: [-(r // 3 ** j % 3) if r < 27 else 0 for r in range(32)] for j in (2, 1, 0)}


def decode_planes(v) -> list:
    """[-c0, .., -c4] as int8x16 from the uint8x16 v of base-3 bytes (see the module docstring)."""
    neg = {}
    rest = v
    for j, (low, high) in ((4, (80, 161)), (3, (26, 53))):
        neg[j] = _neg_above(rest, low) + _neg_above(rest, high)
        rest = rest + T.reinterpret("uint8x16", neg[j]) * T.Broadcast(T.uint8(3 ** j), 16)
    index = T.reinterpret("int8x16", rest)
    for j, table in _TABLES.items():
        neg[j] = T.call_llvm_pure_intrin("int8x16", TBL2, _bytes(table[:16]), _bytes(table[16:]), index)
    return [neg[j] for j in range(T3_PER_BYTE)]


def _lane(xv, index: int):
    """4-byte lane `index` of the int8x16 xv in all four lanes (sdot by element)."""
    return T.reinterpret("int8x16", T.Shuffle([T.reinterpret("int32x4", xv)], [index] * 4))


def t3_dot_kernel(n: int, k: int, act: str = "float16", scale_dtype: str = "float16", prompt: bool = False,
                  x_bytes: int = X_BYTES, layout: str = "NK") -> tirx.PrimFunc:
    """out[1, m, n] = x[1, m, k] @ dequantize(codes uint32 [n, ceil(k / 20)], scales [n, groups]) for NK t3
    codes, m = 1 (decode) or symbolic (`prompt`); x in `x_bytes` signed bytes per value. layout="KN" (android-
    hexagon's CPU half): codes [ceil(k / 20), n], scales [groups, n]; "rows" (android-cpu's t3_interleave: 4):
    codes [n / 4, ceil(k / 20), 4], scales [n / 4, groups, 4]; both n a multiple of 4: a 16-byte load is
    already a word vector of 4 outputs, no transpose."""
    kn, rows4 = layout == "KN", layout == "rows"
    assert layout in ("NK", "KN", "rows"), layout
    assert n > ROWS and x_bytes in (1, 2) and (layout == "NK" or n % ROWS == 0), (n, x_bytes, layout)
    i64 = T.int64
    words = -(-k // T3_PER_WORD)
    groups = -(-k // SIGN_GROUP)
    tasks = -(-n // ROWS)
    # groups whose whole window of 8 words is stored: a runtime loop; the rest (the last one or two) unrolled
    looped = sum(window_start(g) + WINDOW <= words for g in range(groups))
    m = tirx.Var("seq_len", "int64") if prompt else i64(1)
    code_shape = {"NK": (i64(n), i64(words)), "KN": (i64(words), i64(n)), "rows": (i64(n // ROWS), i64(words), i64(ROWS))}[layout]
    scale_shape = {"NK": (i64(n), i64(groups)), "KN": (i64(groups), i64(n)), "rows": (i64(n // ROWS), i64(groups), i64(ROWS))}[layout]
    quantize_row = quantize_row_macro(SIGN_GROUP, k, x_bytes, NK_FORMATS["t3"].offset, x_position)
    # K a multiple of 16: x quantized in NEON vectors by arm_rows.py's macro (t2's order within each group), then
    # each group's 128 bytes moved into its 160 slots by one constant shuffle per byte plane
    vector_rows = k % 16 == 0
    quantize_vector = quantize_row_vector_macro(NK_FORMATS["t2"], k, x_bytes, Q_MAX[x_bytes]) if vector_rows else None
    full = k // SIGN_GROUP

    def slot_sources(rho: int, size: int) -> list[int]:
        """For a group g = rho mod 5 of `size` values: where each of its 160 slots takes its byte from the
        group's 128 quantized bytes in t2's order (128: a zero)."""
        a = rho * SIGN_GROUP % T3_PER_WORD          # the group's first trit's place in its first word
        out = []
        for slot in range(SLOTS):
            unit, plane, lane, byte = slot // 80, slot % 80 // 16, slot % 16 // 4, slot % 4
            t = (unit * UNIT + lane) * T3_PER_WORD + byte * T3_PER_BYTE + plane - a
            out.append(interleaved_position(t, 2) if 0 <= t < size else SIGN_GROUP)
        return out

    @T.macro
    def place_group(xt, xq, r, g, rho, size):
        """Group g's 128 quantized bytes of each byte plane (xt, t2's order) into its 160 slots of xq."""
        xq[r, 0, T.Ramp(g * SLOTS, 1, SLOTS)] = T.Shuffle(
            [xt[r, 0, T.Ramp(g * x_bytes * SIGN_GROUP, 1, SIGN_GROUP)], T.Broadcast(T.int8(0), 32)], slot_sources(rho, size))
        if x_bytes == 2:      # static
            xq[r, 1, T.Ramp(g * SLOTS, 1, SLOTS)] = T.Shuffle(
                [xt[r, 0, T.Ramp((g * 2 + 1) * SIGN_GROUP, 1, SIGN_GROUP)], T.Broadcast(T.int8(0), 32)],
                slot_sources(rho, size))

    @T.macro
    def place_five(xt, xq, r, g5, rho):
        if g5 * 5 + rho < full:
            place_group(xt, xq, r, g5 * 5 + rho, rho, SIGN_GROUP)

    @T.macro
    def quantize_vectors(x, xq, xt, steps, d, base, r):
        quantize_vector(x, xt, steps, r)
        for g5 in range((full + 4) // 5):
            place_five(xt, xq, r, g5, 0)
            place_five(xt, xq, r, g5, 1)
            place_five(xt, xq, r, g5, 2)
            place_five(xt, xq, r, g5, 3)
            place_five(xt, xq, r, g5, 4)
        if full < groups:     # static: the shorter last group
            place_group(xt, xq, r, full, full % 5, k - full * SIGN_GROUP)
        for g in range(groups):
            base[r, g * 4] = steps[r, g * 2]
            d[r, g] = T.reinterpret("float32", steps[r, g * 2 + 1])

    def group_sums(w, s, xq, d, base, row0, rs, g, stored=WINDOW):
        """[float32x4 per prompt row r of `rs`]: group g's dot for output rows row0 .. row0 + 3 (its int32 sums,
        -x's step, the rows' scales), the code loads and decoding shared by the rows of `rs` (static: one or
        two); `stored`: the words of its window that exist (static; the others' x is zero and are skipped)."""
        rows = [T.min(row0 + i, n - 1) for i in range(ROWS)]
        first = window_start(g)
        accs = [[T.Broadcast(0, 4)] * (x_bytes - 1) + [T.Broadcast(-base[r, g * 4], 4)] for r in rs]  # +sum(q)
        for unit in range(WINDOW // UNIT):
            if unit * UNIT >= stored:
                continue
            if kn or rows4:      # static: word `first + unit * UNIT + lane` of the 4 outputs, one load each
                vectors = [w[first + unit * UNIT + lane, T.Ramp(row0, 1, ROWS)] if kn else
                           w[row0 // ROWS, first + unit * UNIT + lane, T.Ramp(0, 1, ROWS)]
                           for lane in range(min(UNIT, stored - unit * UNIT))]
            elif (unit + 1) * UNIT <= stored:      # static: one 16-byte load per row, transposed
                loads = [w[row, T.Ramp(first + unit * UNIT, 1, UNIT)] for row in rows]
                vectors = [T.Shuffle(loads, [lane + UNIT * i for i in range(ROWS)]) for lane in range(UNIT)]
            else:
                vectors = [T.Shuffle([w[row, first + unit * UNIT + lane] for row in rows], list(range(ROWS)))
                           for lane in range(stored - unit * UNIT)]
            for lane, vec in enumerate(vectors):
                planes = decode_planes(T.reinterpret("uint8x16", vec))     # the planes are -c
                for plane, codes in enumerate(planes):
                    for acc, r in zip(accs, rs, strict=True):
                        for b in range(x_bytes):
                            xv = xq[r, b, T.Ramp(g * SLOTS + unit * UNIT * T3_PER_WORD + plane * 16, 1, 16)]
                            acc[b] = T.call_llvm_pure_intrin("int32x4", SDOT, acc[b], codes, _lane(xv, lane))
        scales = T.Cast("float32x4", s[g, T.Ramp(row0, 1, ROWS)] if kn else s[row0 // ROWS, g, T.Ramp(0, 1, ROWS)]
                        if rows4 else T.Shuffle([s[row, g] for row in rows], list(range(ROWS))))
        sums = [acc[0] if x_bytes == 1 else acc[0] * T.Broadcast(256, 4) + acc[1] for acc in accs]
        return [T.Cast("float32x4", total) * (scales * T.Broadcast(-d[r, g], 4)) for total, r in zip(sums, rs, strict=True)]

    @T.macro
    def prepare_row(x, xq, xt, steps, d, base, r):
        if vector_rows:       # static
            quantize_vectors(x, xq, xt, steps, d, base, r)
        else:
            for i in range(groups * SLOTS * x_bytes // 16):      # the slots no value fills meet zero
                xq[r, i // (groups * SLOTS // 16), T.Ramp(i % (groups * SLOTS // 16) * 16, 1, 16)] = T.Broadcast(
                    T.int8(0), 16)
            quantize_row(x, xq, d, base, r)

    @T.macro
    def add_group(w, s, xq, d, base, acc, task, r, count, g, stored):
        """acc (rows r .. r + count - 1 of x, count static: 1 or 2) += group g's dots."""
        if count == 2:    # static: one expression per row, the decoding shared (LLVM merges it)
            acc[T.Ramp(0, 1, ROWS)] = acc[T.Ramp(0, 1, ROWS)] + group_sums(
                w, s, xq, d, base, task * ROWS, [r, r + 1], g, stored)[0]
            acc[T.Ramp(ROWS, 1, ROWS)] = acc[T.Ramp(ROWS, 1, ROWS)] + group_sums(
                w, s, xq, d, base, task * ROWS, [r, r + 1], g, stored)[1]
        else:
            acc[T.Ramp(0, 1, ROWS)] = acc[T.Ramp(0, 1, ROWS)] + group_sums(
                w, s, xq, d, base, task * ROWS, [r], g, stored)[0]

    @T.macro
    def rows_pass(w, s, xq, d, base, out, acc, task, r, count):
        """Rows r .. r + count - 1 of x (count static) against the task's 4 output rows, in one pass over its codes."""
        for i in T.unroll(count * ROWS):
            acc[i] = T.float32(0)
        for g in range(looped):
            add_group(w, s, xq, d, base, acc, task, r, count, g, WINDOW)
        if looped < groups:       # static
            add_group(w, s, xq, d, base, acc, task, r, count, looped, min(WINDOW, words - window_start(looped)))
        if looped + 1 < groups:   # static: a short last group can leave two windows unstored
            add_group(w, s, xq, d, base, acc, task, r, count, looped + 1,
                      min(WINDOW, words - window_start(looped + 1)))
        for j in T.unroll(count * ROWS):
            if task * ROWS + j % ROWS < n:
                out[0, r + j // ROWS, task * ROWS + j % ROWS] = T.Cast(act, acc[j])

    @T.prim_func(private=True)
    def kernel(w: T.Buffer(code_shape, "uint32"), s: T.Buffer(scale_shape, scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), act), out: T.Buffer((i64(1), m, i64(n)), act)):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((m, x_bytes, groups * SLOTS), "int8")
        d = T.alloc_buffer((m, groups), "float32")
        base = T.alloc_buffer((m, groups * 4), "int32")
        xt = T.alloc_buffer((m, 1, x_bytes * groups * SIGN_GROUP if vector_rows else 1), "int8")   # t2's order
        steps = T.alloc_buffer((m, groups * 2), "int32")
        if prompt:
            for r in T.parallel(m):
                prepare_row(x, xq, xt, steps, d, base, r)
        else:
            prepare_row(x, xq, xt, steps, d, base, 0)
        for task in T.parallel(tasks):
            acc = T.alloc_buffer((PROMPT_ROWS * ROWS,), "float32")
            if prompt:     # rows of the prompt in pairs: each code load and decoding serves both
                for pair in range(m // PROMPT_ROWS):
                    rows_pass(w, s, xq, d, base, out, acc, task, pair * PROMPT_ROWS, PROMPT_ROWS)
                for r in range(m // PROMPT_ROWS * PROMPT_ROWS, m):
                    rows_pass(w, s, xq, d, base, out, acc, task, r, 1)
            else:
                rows_pass(w, s, xq, d, base, out, acc, task, 0, 1)

    assert groups - looped <= 2, (k, looped)
    return kernel


def arm_t3_like(func: tirx.PrimFunc, x_bytes: int = X_BYTES) -> tirx.PrimFunc | None:
    """The t3 sdot kernel with `func`'s parameter order when `func` is a fused decode GEMV or prefill matmul of
    NK t3 codes (more than 4 outputs: two tasks or more, TVM drops a parallel loop of one) or of KN ones (a
    multiple of 4 outputs), else None. The caller checks that the target has dotprod."""
    for prompt in (False, True):
        match = match_packed_nk_gemv(func, rows="prompt" if prompt else "one")
        if match is None or match[0] not in ("t3", TILED_T3):
            continue
        fmt, n, k, act, scale_dtype, order = match
        interleaved = fmt == TILED_T3
        if n <= ROWS or (interleaved and int(func.params[order.index("scales")].shape[2]) != ROWS):
            return None
        kernel = t3_dot_kernel(n, k, act, scale_dtype, prompt, x_bytes, "rows" if interleaved else "NK")
        return substitute(func, kernel, order, ("dequant-matmul" if prompt else "dequant-gemv") + "-ternary")
    match = match_kn(func, "dequantize_t3_kn", T3_PER_WORD, SIGN_GROUP)    # android-hexagon's CPU half
    if match is None or match[0] <= ROWS or match[0] % ROWS:
        return None
    n, k, act, scale_dtype, prompt, order = match
    kernel = t3_dot_kernel(n, k, act, scale_dtype, prompt, x_bytes, layout="KN")
    return substitute(func, kernel, order, ("dequant-matmul" if prompt else "dequant-gemv") + "-ternary")
