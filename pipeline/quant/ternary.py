"""Ternary (1.58-bit) and binary (1-bit) weights in numpy: rounding, detection of native checkpoints, packing.

Values are {-s, 0, +s} (ternary) or {-s, +s} (binary) with one fp16 scale s per group of 128 weights along
the reduction axis K (the grouping PrismML's Bonsai models ship). A weight's trit t in {-1, 0, +1} is
stored as the code t + 1; a binary weight's sign as one bit (1: +s, 0: -s).

Packings (NK = [N, ...] rows of codes, KN their transpose, like q4):
- `t2`: 16 two-bit codes per little-endian uint32, code of k at bits 2 * (k % 16): [N, ceil(K/16)] uint32.
  2 + 16/128 = 2.125 bits/weight with the scales.
- `t3`: base 3, five codes per byte (byte = sum_j code_j * 3^j, at most 242), four such bytes per
  little-endian uint32 (20 codes; byte b at bits 8b): the code of k is trit k % 5 of byte (k % 20) // 5 of
  word k // 20; rows padded with zero-weight codes to a multiple of 20: [N, ceil(K/20)] uint32 — in memory
  exactly the bytes of the plain 5-per-byte stream. A byte may hold codes of two scale groups (the scales
  are a separate array), which keeps the word index k // 20 an affine split of k — the form dlight's GEMV
  rule schedules — and 32-bit loads avoid TVM's broken OpenCL codegen for gathered uchar vectors.
  32 * ceil(K/20) / K + 16/128 bits/weight: 1.725 when 20 and 128 divide K (qwen27b's 5120), 1.726 for
  K = 17408 (the padding codes are counted).
- `b1` (binary): 32 sign bits per little-endian uint32, the bit of k at bit k % 32: [N, ceil(K/32)] uint32.
  1 + 16/128 = 1.125 bits/weight with the scales — the only format below t3, what lets a 27B fit the ~6 GB an
  iOS app gets at 8K context (1-bit Bonsai-style checkpoints hold exactly these values).
K need not be a multiple of 128: the last group is shorter (its padding is zero weights, never read).

Ternarisation (`ternarize`) is MSE-optimal per group: keeping the m largest |w| with the scale s = their
mean |w| leaves an error sum(w^2) - m s^2 = sum(w^2) - (sum of the top m |w|)^2 / m, so m is the argmax of
that last ratio over m = 1..128 (exact, from one sort). On a natively ternary group the optimum keeps
exactly its nonzeros and s is their common magnitude: import and post-training ternarisation are the same
function, and `ternary_groups` decides whether a tensor was ternary to begin with. Binarisation
(`binarize_exact`) is MSE-optimal too: with the signs fixed, the best scale is the group's mean |w|; a
natively binary group (one magnitude, no zeros) is reproduced exactly (`binary_groups`).
"""

from __future__ import annotations

import numpy as np

from pipeline.formats import (  # noqa: F401 - the packings' facts, used as ternary.X
    B1_PER_WORD,
    BINARY,
    PACKINGS,
    T2_PER_WORD,
    T3_PER_BYTE,
    T3_PER_WORD,
    code_dtype,
    n_groups,
    packed_len,
    row_bytes,
)
from pipeline.formats import SIGN_GROUP as GROUP
from pipeline.quant.quantize import untile_kn

_POW3 = np.array([1, 3, 9, 27, 81], np.uint16)

# Relative spacing of a float format's values (one unit in the last place at 1.0): magnitudes of one
# group that differ by no more than this are the same scale, written in that format.
ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23, "float64": 2.0**-52}


def _groups(w: np.ndarray) -> np.ndarray:
    """[N, K] -> float32 [N, G, 128], the last group zero-padded."""
    n, k = w.shape
    g = n_groups(k)
    w = w.astype(np.float32, copy=False)
    if k != g * GROUP:
        w = np.concatenate([w, np.zeros((n, g * GROUP - k), np.float32)], axis=1)
    return w.reshape(n, g, GROUP)


def ternarize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (trits int8 [N, G*128] in {-1, 0, 1}, zero-padded; fp16 scales [N, G])."""
    trits, scale = ternarize_exact(w)
    return trits, scale.astype(np.float16)


def ternarize_exact(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ternarize` with the scales in float64, before rounding to fp16.

    Per group the MSE-optimal support (see the module docstring); s = mean |w| over it. Ties at the
    threshold are all kept. An all-zero group gets s = 0 and trits 0."""
    groups = _groups(w)
    mag = np.abs(groups)
    top = -np.sort(-mag, axis=-1).astype(np.float64)             # descending
    csum = np.cumsum(top, axis=-1)
    m = np.arange(1, GROUP + 1, dtype=np.float64)
    best = np.argmax(csum * csum / m, axis=-1)                      # first maximum
    thr = np.take_along_axis(top, best[..., None], axis=-1).astype(np.float32)
    keep = (mag >= thr) & (mag > 0)
    kept = keep.sum(axis=-1)
    scale = np.where(kept > 0, (mag * keep).sum(axis=-1, dtype=np.float64) / np.maximum(kept, 1), 0.0)
    trits = (np.sign(groups) * keep).astype(np.int8)
    return trits.reshape(w.shape[0], -1), scale


def binarize_exact(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (signs int8 [N, G*128] in {-1, 1}, zero-padded columns +1; float64 scales [N, G]):
    per group s = mean |w| over its real (not padded) weights, the MSE-optimal scale for the signs."""
    n, k = w.shape
    groups = _groups(w)
    real = np.minimum(GROUP, k - np.arange(n_groups(k)) * GROUP).astype(np.float64)    # weights per group
    scale = np.abs(groups).sum(axis=-1, dtype=np.float64) / real
    signs = np.where(groups < 0, -1, 1).astype(np.int8)
    return signs.reshape(n, -1), scale


def round_groups(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """The packing's values of [N, K] weights: (trits or signs int8 [N, G*128], float64 scales [N, G])."""
    return binarize_exact(w) if fmt in BINARY else ternarize_exact(w)


def native_groups(w: np.ndarray, fmt: str, dtype: str = "float32") -> np.ndarray:
    """bool [N, G]: whether each group already holds only values `fmt` stores exactly."""
    return binary_groups(w, dtype) if fmt in BINARY else ternary_groups(w, dtype)


def binary_groups(w: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """bool [N, G]: whether each group of 128 holds only {-s, +s}: one magnitude within one unit in the last
    place of `dtype`, no zeros (an all-zero group counts: s = 0). The padding of a short last group is not
    looked at."""
    n, k = w.shape
    mag = np.abs(_groups(w))
    real = (np.arange(n_groups(k) * GROUP) < k).reshape(1, n_groups(k), GROUP)
    hi = np.where(real, mag, 0).max(axis=-1)
    lo = np.where(real, mag, np.inf).min(axis=-1)
    return (hi - lo) <= ULP.get(dtype, ULP["float32"]) * hi


def ternary_groups(w: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """bool [N, G]: whether each group of 128 holds only {-s, 0, +s} (nonzero magnitudes within one unit
    in the last place of the checkpoint's `dtype` of each other)."""
    mag = np.abs(_groups(w))
    hi = mag.max(axis=-1, keepdims=True)
    lo = np.where(mag > 0, mag, np.inf).min(axis=-1, keepdims=True)
    lo = np.where(np.isinf(lo), hi, lo)
    return ((hi - lo) <= ULP.get(dtype, ULP["float32"]) * hi)[..., 0]


def pack(trits: np.ndarray, fmt: str, k: int) -> np.ndarray:
    """trits [N, >= k] (padded to whole groups) -> NK packed codes of `fmt` for a reduction length k."""
    n = trits.shape[0]
    codes = (trits.astype(np.int16) + 1).astype(np.uint8)
    if fmt == "t2":
        return _pack_fields(codes, 2, packed_len("t2", k))
    if fmt == "t3":
        width = packed_len("t3", k) * T3_PER_WORD
        c = _pad_cols(codes[:, :k], width).reshape(n, -1, T3_PER_BYTE).astype(np.uint16)
        stream = np.ascontiguousarray((c * _POW3).sum(axis=-1).astype(np.uint8))
        return stream.view("<u4").astype(np.uint32, copy=False)
    if fmt == "b1":
        return _pack_fields((trits[:, :k] > 0).astype(np.uint8), 1, packed_len("b1", k))
    raise ValueError(f"unknown ternary packing {fmt!r}; expected one of {PACKINGS}")


def _pack_fields(codes: np.ndarray, bits: int, words: int) -> np.ndarray:
    """codes [N, C] -> [N, words] uint32 of 32 // bits fields, code i of a word at bits [bits i, bits (i + 1));
    columns past C padded with code 1 (t2: a zero weight; b1: +s, past K, never read)."""
    per = 32 // bits
    c = _pad_cols(codes, words * per)[:, :words * per].reshape(codes.shape[0], words, per).astype(np.uint32)
    return np.bitwise_or.reduce(c << (np.arange(per, dtype=np.uint32) * bits), axis=-1)


def _unpack_fields(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `_pack_fields`: [N, words] uint32 -> codes [N, words * 32 // bits]."""
    shifts = np.arange(32 // bits, dtype=np.uint32) * bits
    return ((packed.astype(np.uint32)[..., None] >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def _pad_cols(codes: np.ndarray, width: int) -> np.ndarray:
    """Pad with code 1 (a zero weight) up to `width` columns."""
    if codes.shape[1] >= width:
        return codes
    return np.concatenate([codes, np.ones((codes.shape[0], width - codes.shape[1]), np.uint8)], axis=1)


def unpack(packed: np.ndarray, fmt: str, k: int) -> np.ndarray:
    """NK packed codes -> trits int8 [N, k]."""
    n = packed.shape[0]
    if fmt == "t2":
        codes = _unpack_fields(packed, 2)
    elif fmt == "t3":
        stream = np.ascontiguousarray(packed.astype("<u4")).view(np.uint8)
        codes = ((stream.astype(np.uint16)[..., None] // _POW3) % 3).reshape(n, -1)
    elif fmt == "b1":
        codes = _unpack_fields(packed, 1).astype(np.int16) * 2             # 0 -> -1, 1 -> +1 below
    else:
        raise ValueError(f"unknown ternary packing {fmt!r}; expected one of {PACKINGS}")
    return (codes[:, :k].astype(np.int16) - 1).astype(np.int8)


def quantize_ternary(w: np.ndarray, fmt: str = "t2", layout: str = "NK") -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (packed codes, fp16 scales) in `layout` (KN stores both transposed)."""
    trits, s64 = round_groups(w, fmt)
    scale = s64.astype(np.float16)
    packed = pack(trits, fmt, w.shape[1])
    if layout == "KN":
        return np.ascontiguousarray(packed.T), np.ascontiguousarray(scale.T)
    return packed, scale


def dequantize_ternary(packed: np.ndarray, scale: np.ndarray, fmt: str, k: int,
                       layout: str = "NK") -> np.ndarray:
    """Inverse of `quantize_ternary`: -> [N, k] float32 (the reference for numerics tests; KN t2 codes and
    scales may be tiled: quantize.tile_kn; NK ones row-interleaved, the same 3-d arrays, whatever `layout` says)."""
    if packed.ndim == 3:
        packed, scale, layout = untile_kn(packed), untile_kn(scale), "KN"
    if layout == "KN":
        packed, scale = packed.T, scale.T
    trits = unpack(packed, fmt, k).astype(np.float32)
    return trits * np.repeat(scale.astype(np.float32), GROUP, axis=1)[:, :k]


# ------------------------------------------------------------------------------ Hadamard rotation
def rotation_block(k: int, cap: int) -> int:
    """The Walsh-Hadamard block for a reduction length k: the largest power of two that divides k, at
    most `cap` (1 = no rotation)."""
    b = 1
    while b * 2 <= cap and k % (b * 2) == 0:
        b *= 2
    return b


def hadamard_rows(w: np.ndarray, block: int) -> np.ndarray:
    """Each row times the block-diagonal normalized Sylvester-Hadamard matrix (symmetric, its own inverse),
    by the fast transform in float64 -> float32. Applied to a weight's rows (W H) and, in the graph, to the
    layer input (H x), it leaves W x unchanged."""
    if block <= 1:
        return w
    n, k = w.shape
    x = w.astype(np.float64).reshape(n, k // block, block)
    h = 1
    while h < block:
        x = x.reshape(n, k // block, block // (2 * h), 2, h)
        a, c = x[..., 0, :], x[..., 1, :]
        x = np.stack([a + c, a - c], axis=-2)
        h *= 2
    return (x.reshape(n, k) / np.sqrt(block)).astype(np.float32)
