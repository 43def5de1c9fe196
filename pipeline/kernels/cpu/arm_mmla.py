"""AArch64 `smmla` prefill matmul over q4 / q8 codes stored row-interleaved (android-cpu's `q4_interleave` /
`q8_interleave`), for CPUs with the i8mm extension (configs/cpu_classes.yaml: the i8mm class).

Why: the sdot prefill (arm_rows.py) meets each 16 code bytes with one `sdot` per prompt row and byte of x: 0.25
instructions per weight and row (two-byte x), 1.7x llama.cpp's whole prefill. `smmla` (armv8.6-a i8mm) takes a
2 x 8 int8 matrix A and a 2 x 8 int8 matrix B and adds A B^T into a 2 x 2 int32 tile: 32 products per
instruction, twice sdot's, and each code byte meets two prompt rows at once.

The order of the 8 k a smmla sums over is free as long as x and the codes agree, so the stored layout serves
as is. One 16-byte load of q4 codes holds one 4-byte word (8 k as nibbles) of each of 4 rows; `and` / `ushr`
give the rows' even k and odd k (4 bytes each); `zip1` / `zip2` on 32-bit lanes pair them into [row: 4 even k,
4 odd k] for rows 0, 1 and rows 2, 3: two B operands. q8: two consecutive 4-byte words of 4 rows, zipped the
same way ([row: k 0-3, k 4-7]). x is quantized once per call to int8 (step max|x| / 127 per group of 32,
llama.cpp's Q8_0 precision: smmla has no two-byte form) in the same order within each 8 values
(arm_rows.interleaved_position), two prompt rows' 8 values side by side: one 16-byte load is one A operand.
The 2 x 2 tile [p0 w0, p0 w1, p1 w0, p1 w1] starts from the rows' zero-point terms ([b0, b0, b1, b1], -7 sum q
per group for q4) and is scaled by [s(w0), s(w1), s(w0), s(w1)] x [step(p0), step(p0), step(p1), step(p1)].

Per group of 32 k, an 8-row tile and PROMPT_PAIRS pairs of prompt rows (4 rows): 8 code loads, 8 `and` + 8
`ushr` (q4), 16 `zip`, 32 `smmla`, the int32 tiles converted, scaled and added to fp32 partial sums once per
group: read from the object, 125 instructions (119 vector), 0.122 per weight and prompt row (q8: 0.112). Three
pairs per pass spill NEON registers (0.21). An odd prompt's last row is paired with a copy of itself (the
copy's outputs are not stored).

A task owns one tile of output rows and runs every row pair of the prompt against it (the tile's codes stay
in L1); TVM's parallel loop gives each thread a contiguous range of tiles, so 1 and 4 threads compute every
output identically. Decode (one row) stays on arm_rows.py's sdot GEMV: smmla would waste half its products.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipeline.kernels.cpu.arm import Q_MAX
from pipeline.kernels.cpu.arm_rows import check_rows, quantize_row_vector_macro
from pipeline.kernels.cpu.packed import NK_FORMATS, TILED_Q4, TILED_Q8, PackedFormat, substitute
from pipeline.kernels.cpu.recognize import match_packed_nk_gemv

SMMLA = "llvm.aarch64.neon.smmla"
# pairs of prompt rows per pass over a tile's codes (each code vector's unpack and zips serve all of them)
PROMPT_PAIRS = 2


def mmla_kernel(spec: PackedFormat, n: int, k: int, tile: int, act: str = "float16",
                scale_dtype: str = "float16") -> tirx.PrimFunc:
    """out[1, m, n] = x[1, m, k] @ dequantize(codes, scales [n / tile, groups, tile]) for row-interleaved codes
    (q4: uint32 [n / tile, k / 8, tile]; q8: int8 [n / tile, k / 4, 4 tile]), m symbolic (a prompt), x in int8."""
    assert check_rows(spec, n, k, tile), (spec, n, k, tile)
    i64 = T.int64
    groups = k // spec.group
    q8 = spec.bits == 8
    words = k // 4 if q8 else k // spec.codes
    code_shape = (i64(n // tile), i64(words), i64(4 * tile if q8 else tile))
    octets = spec.group // 8          # 8-k steps per group: one smmla each per row pair
    m = tirx.Var("seq_len", "int64")
    pairs = (m + 1) // 2              # of prompt rows; an odd prompt's last row paired with itself
    quantize_row = quantize_row_vector_macro(spec, k, 1, Q_MAX[1], pair_rows=True)
    low = T.Broadcast(T.int8(0xF), 16)
    four = T.Broadcast(T.uint8(4), 16)

    def halves(w, t, g, u, q):
        """(first, second) int32x4: 4 bytes of k 8 u .. 8 u + 7 of group g for each of rows 4 q .. 4 q + 3
        of tile t; q4: the words' low nibbles (even k) and high ones (odd k), q8: k 0-3 and k 4-7."""
        if q8:
            word = (g * octets + u) * 2
            return (T.reinterpret("int32x4", w[t, word, T.Ramp(q * 16, 1, 16)]),
                    T.reinterpret("int32x4", w[t, word + 1, T.Ramp(q * 16, 1, 16)]))
        v = T.reinterpret("int8x16", w[t, g * octets + u, T.Ramp(q * 4, 1, 4)])
        return (T.reinterpret("int32x4", T.bitwise_and(v, low)),
                T.reinterpret("int32x4", T.shift_right(T.reinterpret("uint8x16", v), four)))

    def tile_sums(w, xq, base, t, pair, g, j):
        """int32x4 [p0 w0, p0 w1, p1 w0, p1 w1]: group g of rows w0 = 2 j, w1 = 2 j + 1 of tile t against the
        rows of `pair`, zero-point terms included."""
        acc = base[pair, g, T.Ramp(0, 1, 4)]
        for u in range(octets):
            first, second = halves(w, t, g, u, j // 2)
            at = j % 2 * 2    # zip1 (j even: rows 4 q, 4 q + 1) / zip2 (rows 4 q + 2, 4 q + 3); constant once unrolled
            b = T.reinterpret("int8x16", T.Shuffle([first, second], [at, at + 4, at + 1, at + 5]))
            acc = T.call_llvm_pure_intrin("int32x4", SMMLA, acc, xq[pair, g * octets + u, T.Ramp(0, 1, 16)], b)
        return acc

    @T.macro
    def tile_pairs(w, s, xq, base, out, acc, t, pair, count):
        """Pairs pair .. pair + count - 1 (count static) against tile t, in one loop over the groups, so LLVM
        loads, splits and zips each code vector once for all of them."""
        for i in T.unroll(count * tile // 2):
            acc[T.Ramp(i * 4, 1, 4)] = T.Broadcast(T.float32(0), 4)
        for g in range(groups):
            for j in T.unroll(tile // 2):
                for i in T.unroll(count):
                    at = T.Ramp((i * tile // 2 + j) * 4, 1, 4)
                    scale = T.Shuffle([T.Cast(f"float32x{tile}", s[t, g, T.Ramp(0, 1, tile)])],
                                      [2 * j, 2 * j + 1, 2 * j, 2 * j + 1])
                    step = T.reinterpret("float32x4", base[pair + i, g, T.Ramp(4, 1, 4)])
                    acc[at] = acc[at] + T.Cast("float32x4", tile_sums(w, xq, base, t, pair + i, g, j)) * (scale * step)
        for i in T.unroll(count):
            row = (pair + i) * 2
            tiles = [acc[T.Ramp((i * tile // 2 + j) * 4, 1, 4)] for j in range(tile // 2)]
            rows = T.Shuffle(tiles, [4 * j + h for j in range(tile // 2) for h in (0, 1)])
            out[0, row, T.Ramp(t * tile, 1, tile)] = T.Cast(f"{act}x{tile}", rows)
            if row + 1 < m:
                rows = T.Shuffle(tiles, [4 * j + h for j in range(tile // 2) for h in (2, 3)])
                out[0, row + 1, T.Ramp(t * tile, 1, tile)] = T.Cast(f"{act}x{tile}", rows)

    @T.prim_func(private=True)
    def kernel(w: T.Buffer(code_shape, spec.code_dtype),
               s: T.Buffer((i64(n // tile), i64(groups), i64(tile)), scale_dtype),
               x: T.Buffer((i64(1), m, i64(k)), act), out: T.Buffer((i64(1), m, i64(n)), act)):
        T.func_attr({"tirx.noalias": True})
        xq = T.alloc_buffer((pairs, i64(k // 8), i64(16)), "int8")   # per 8 k: row 2 p's 8 bytes, row 2 p + 1's
        base = T.alloc_buffer((pairs, i64(groups), i64(8)), "int32")  # per group: offset terms, steps' fp32 bits
        for r in T.parallel(pairs * 2):
            quantize_row(x, xq, base, r, T.min(r, m - 1))
        for t in T.parallel(n // tile):
            acc = T.alloc_buffer((PROMPT_PAIRS * tile * 2,), "float32")
            for p in range(pairs // PROMPT_PAIRS):
                tile_pairs(w, s, xq, base, out, acc, t, p * PROMPT_PAIRS, PROMPT_PAIRS)
            for p in range(pairs // PROMPT_PAIRS * PROMPT_PAIRS, pairs):
                tile_pairs(w, s, xq, base, out, acc, t, p, 1)

    return kernel


def arm_mmla_like(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The smmla kernel with `func`'s parameter order when `func` is a fused prefill matmul (a prompt's rows)
    of row-interleaved q4 / q8 codes of a shape it takes, else None. The caller checks that the target has
    i8mm; a decode GEMV is not taken (arm_rows.py's sdot form serves one row)."""
    match = match_packed_nk_gemv(func, rows="prompt")
    if match is None or match[0] not in (TILED_Q4, TILED_Q8):
        return None
    fmt, n, k, act, scale_dtype, order = match
    tile = int(func.params[order.index("scales")].shape[2])
    spec = NK_FORMATS["q8" if fmt == TILED_Q8 else "q4"]
    if not check_rows(spec, n, k, tile):
        return None
    return substitute(func, mmla_kernel(spec, n, k, tile, act, scale_dtype), order, "dequant-matmul")
