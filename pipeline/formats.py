"""The stored weight formats in one table: what a code is, how codes pack into words, how scales group.

Every reader and writer of quantized weights (the converter, the TE dequantize in models/layers.py, the
CPU / GPU / NPU kernels, the memory plan, the tensor-cache readers) takes its facts from here. The
numpy packing itself lives in quant/ (quantize.py: q4 / q8, ternary.py: t2 / t3 / b1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoredFormat:
    """One weight format as stored in the tensor cache (one fp16 scale per `group` weights along K)."""

    name: str
    code_bits: float           # bits of one weight's code (t3: 32 bits hold 20 codes)
    group: int                 # weights per scale along the reduction axis K; 0: no scale (float)
    codes_per_word: int        # codes per element of `code_dtype`
    code_dtype: str
    zero: int | None = None    # value = (code - zero) * scale
    tile_field: str | None = None   # the target field that tiles this format's KN storage (see tile_width)
    signs: bool = False        # a sign packing: ternary {-s, 0, +s} or binary {-s, +s} (quant/ternary.py)

    def row_bytes(self, k: int) -> int:
        """Bytes of one output row of k weights: codes padded to whole words, plus one fp16 scale per group."""
        if not self.group:
            return k * 2
        words = -(-k // self.codes_per_word)
        return words * _ITEMSIZE[self.code_dtype] + 2 * -(-k // self.group)

    def bits_per_weight(self, k: int) -> float:
        """Bits per weight of a row of k weights (e.g. q4: 4.5, q8: 8.5, t2: 2.125, t3: 1.725 at K = 5120)."""
        return 8 * self.row_bytes(k) / k


_ITEMSIZE = {"uint32": 4, "int8": 1, "float16": 2}


GROUP = 32            # q4 / q8: weights per scale along K
CODES_PER_WORD = 8    # q4: int4 codes per uint32
ZERO = 7              # q4: value = (code - 7) * scale, code in [0, 15] (quantize.py chooses the signed scale)
SIGN_GROUP = 128      # t2 / t3 / b1: weights per scale along K (the grouping PrismML's Bonsai models ship)
T2_PER_WORD = 16
T3_PER_BYTE = 5
T3_PER_WORD = 20      # four bytes of five trits
B1_PER_WORD = 32

FORMATS: dict[str, StoredFormat] = {f.name: f for f in (
    StoredFormat("float", 16, 0, 1, "float16"),
    StoredFormat("q4", 4, GROUP, CODES_PER_WORD, "uint32", zero=ZERO, tile_field="q4_tile"),
    StoredFormat("q8", 8, GROUP, 1, "int8", tile_field="q8_tile"),
    StoredFormat("t2", 2, SIGN_GROUP, T2_PER_WORD, "uint32", tile_field="t2_tile", signs=True),
    StoredFormat("t3", 1.6, SIGN_GROUP, T3_PER_WORD, "uint32", signs=True),
    StoredFormat("b1", 1, SIGN_GROUP, B1_PER_WORD, "uint32", signs=True),
)}

WEIGHT_FORMATS = tuple(FORMATS)
PACKINGS = tuple(n for n, f in FORMATS.items() if f.signs)        # t2, t3, b1
BINARY = ("b1",)
FORMAT_BITS = {n: int(FORMATS[n].code_bits) for n in ("q4", "q8")}   # the group-scaled integer formats
TILE_FIELDS = tuple(dict.fromkeys(f.tile_field for f in (FORMATS["q8"], FORMATS["q4"], FORMATS["t2"])))


def n_groups(k: int) -> int:
    """Scale groups of a sign-packed row of k weights (the last one may be shorter)."""
    return -(-k // SIGN_GROUP)


def packed_len(fmt: str, k: int) -> int:
    """Packed code words per row of a sign packing for a reduction length k."""
    if fmt not in PACKINGS:
        raise ValueError(f"unknown ternary packing {fmt!r}; expected one of {PACKINGS}")
    return -(-k // FORMATS[fmt].codes_per_word)


def code_dtype(fmt: str) -> str:
    if fmt not in PACKINGS:
        raise ValueError(f"unknown ternary packing {fmt!r}; expected one of {PACKINGS}")
    return FORMATS[fmt].code_dtype


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one output row: packed codes + fp16 scales (what the tensor cache stores)."""
    return FORMATS[fmt].row_bytes(k)


# ------------------------------------------------------------------------------------ tiled KN
def tiled_kn_index(col, row, tile: int) -> tuple:
    """Where KN q4 / t2 row `row` (a code word row or a scale row) of output column `col` sits in the tiled
    layout (quantize.tile_kn: [N / tile, rows, tile]) — for TE and TIR expressions alike."""
    return col // tile, row, col % tile


def tile_width(n: int, widest: int) -> int:
    """The column tile of a KN q4 / t2 weight with `n` outputs under a target's `q4_tile` / `t2_tile`: the widest
    multiple of 8 (a vector of fp32 lanes) up to `widest` that divides n into at least two tiles (the kernels'
    parallel loop over tiles; one iteration is dropped by TVM and its vector buffers then fail a storage
    rewrite); 0 (plain KN) when none does."""
    return next((t for t in range(widest - widest % 8, 0, -8) if n % t == 0 and n // t >= 2), 0)


Q4_INTERLEAVE = "q4_interleave"   # the target / metadata field: NK q4 rows interleaved by this many (arm_rows.py)
Q8_INTERLEAVE = "q8_interleave"   # ... and NK q8 rows (quantize.interleave_q8)
T2_INTERLEAVE = "t2_interleave"   # ... and NK t2 rows (the KN tiles of the NK words, as q4's)
T3_INTERLEAVE = "t3_interleave"   # ... and NK t3 rows (the same arrays of base-3 words: kernels/cpu/arm_t3.py)
INTERLEAVES = (0, 4, 8)


def interleave_rows(n: int, rows: int) -> int:
    """The row interleave of an NK q4 / q8 / t2 weight with `n` outputs under a target's `q4_interleave` /
    `q8_interleave` / `t2_interleave`: `rows` when it divides n into two tiles or more (the kernel's parallel
    loop over tiles), else 0 (plain NK rows). q4's and t2's interleaved arrays are the KN tiles of `tile_width`
    ([N / rows, K / 8 or K / 16, rows] codes, [N / rows, groups, rows] scales: quantize.tile_kn of the NK words
    transposed), so the TE dequantize and the tiled gather read both alike; q8's: quantize.interleave_q8."""
    return rows if rows and n % rows == 0 and n // rows >= 2 else 0


def interleaved_q8_index(row, k, rows: int) -> tuple:
    """Where NK q8 code [row, k] sits with `rows` rows interleaved (quantize.interleave_q8: [N / rows, K / 4,
    4 rows]); its scale is at tiled_kn_index(row, k // 32, rows) — TE and TIR expressions alike."""
    return row // rows, k // 4, row % rows * 4 + k % 4


def tiled_q8_index(col, row, tile: int) -> tuple:
    """Where KN q8 code [row, col] sits in the tiled layout (quantize.tile_q8): (tile, row pair, byte) — index
    arithmetic that serves TE and TIR expressions alike (the TE dequantize, the tiled gather, the CPU
    prefill kernel)."""
    return col // tile, row // 2, col % tile * 2 + row % 2
