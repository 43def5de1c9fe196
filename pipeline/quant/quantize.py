"""Weight quantization (numpy, one tensor at a time): q0f32 / q0f16 casts and q4f16 group-int4 packing.

q4f16: int4, group 32 along the reduction (K) axis, one signed fp16 scale per group, value = (code - 7) *
scale with code in [0, 15], 8 codes per little-endian uint32 (code of k at nibble k % 8) — MLC's storage and
dequantization, so MLC-style runtimes read it unchanged. NK (MLC `_1`) stores packed [N, K/8] and scales
[N, K/32]; KN (MLC `_0`) stores their transposes.

The scale is chosen per group, not fixed at max|w| / 7 (MLC's converter, 15 levels): the scale carries the
sign of the group's largest-magnitude weight w_max, so that weight can sit on level +8 and all 16 codes are
used (like llama.cpp's Q4_0), and among scales w_max / d for d in SCALE_DIVISORS the one with the least
squared error is kept, subject to every weight of the group staying within half a step of its value (d = 7,
MLC's choice, always qualifies). On SmolLM2-135M this cuts the KL divergence to the float model from 0.44 to
0.35 and perplexity on 1024 tokens from 18.6 to 16.1 (base 12.8). Codes are computed against the
fp16-rounded scale.
"""

from __future__ import annotations

import numpy as np

from pipeline.formats import CODES_PER_WORD, GROUP, ZERO

SCALE_DIVISORS = (7.0, 7.5, 8.0, 8.5)   # candidate scales w_max / d (more candidates measured no better)
Q4_LOW, Q4_HIGH = -ZERO, 15 - ZERO     # levels (code - 7) reachable with 4-bit codes
_ROWS_PER_CHUNK_ELEMS = 1 << 16        # rows searched together: ~256 KB of float32, cache-resident


def quantize_q4(w: np.ndarray, layout: str = "NK") -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (packed uint32, scale float16) in `layout`.

    Rows are searched in cache-sized chunks; two codes are packed per byte (nibble k % 8 of a little-endian
    word is nibble k % 2 of its byte k % 8 // 2). A group whose fp16 scale is 0 holds only values below
    half the smallest fp16 step times 7, which get code ZERO (value 0).
    """
    n, k = w.shape
    groups = _groups(w)
    codes = np.empty((n, k // GROUP, GROUP), np.uint8)
    scale16 = np.empty((n, k // GROUP), np.float16)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // k)
    for r in range(0, n, step):
        q, s = _search_groups(groups[r:r + step])
        q += ZERO
        codes[r:r + step] = q
        scale16[r:r + step] = s
    return _in_layout(_pack_nibbles(codes.reshape(n, k)), scale16, layout)


def pack_q4_levels(levels: np.ndarray, scale16: np.ndarray, layout: str = "NK") -> tuple[np.ndarray, np.ndarray]:
    """Levels [N, K] (integers in [-7, 8], e.g. from gptq.quantize_rows) + fp16 scales -> the stored pair."""
    codes = (np.asarray(levels) + ZERO).astype(np.uint8)
    return _in_layout(_pack_nibbles(codes), np.asarray(scale16, np.float16), layout)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [N, K] -> uint32 [N, K/8], code of k at nibble k % 8 of a little-endian word."""
    n, k = codes.shape
    pairs = codes.reshape(n, k // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view("<u4").astype(np.uint32, copy=False)


def _search_groups(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[R, G, 32] float32 -> (levels as float32 in [-7, 8], fp16 scale [R, G]): per group, the scale
    w_max / d (d in SCALE_DIVISORS) with the least squared error that keeps every weight within half a step."""
    w_max = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)      # signed, [R, G, 1]
    big = np.abs(w_max)
    opposite = np.maximum((g * -np.sign(w_max)).max(-1, keepdims=True), 0)  # largest magnitude of other sign
    best_s = best_err = None
    for d in SCALE_DIVISORS:       # the first (7) always fits: |w| <= |w_max| = 7 steps
        s = (w_max / np.float32(d)).astype(np.float16).astype(np.float32)
        q = _levels(g, s)
        q *= s
        q -= g
        q *= q
        err = q.sum(-1, keepdims=True)
        step = np.abs(s)
        fits = (big <= (Q4_HIGH + 0.5) * step) & (opposite <= (-Q4_LOW + 0.5) * step)
        if best_s is None:
            best_s, best_err = s, err
            continue
        take = fits & (err < best_err)
        best_s = np.where(take, s, best_s)
        best_err = np.where(take, err, best_err)
    return _levels(g, best_s), best_s[..., 0].astype(np.float16)


def _levels(g: np.ndarray, s: np.ndarray) -> np.ndarray:
    """rint(g / s) clipped to the 4-bit levels; a zero scale gives level 0."""
    q = g / np.where(s == 0, np.float32(1), s)
    np.rint(q, out=q)
    return np.clip(q, Q4_LOW, Q4_HIGH, out=q)


def _groups(w: np.ndarray) -> np.ndarray:
    """[N, K] -> float32 view / copy [N, K/32, 32] (groups along the reduction axis)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"reduction dim {k} is not a multiple of the group size {GROUP}")
    return w.astype(np.float32, copy=False).reshape(n, k // GROUP, GROUP)


def _scaled_groups(w: np.ndarray, max_code: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric group-32 scaling (q8): (rint(w / scale) as float32 [N, K/32, 32], the fp16 scale
    max|w| / max_code [N, K/32]). Codes use the fp16-rounded scale; a zero scale divides by 1."""
    groups = _groups(w)
    amax = np.abs(groups).max(axis=-1)
    amax /= max_code
    scale16 = amax.astype(np.float16)
    scale = scale16.astype(np.float32)
    scale[scale == 0] = 1.0
    q = groups / scale[..., None]
    np.rint(q, out=q)
    return q, scale16


def _in_layout(codes: np.ndarray, scale16: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """NK as computed; KN stores both transposed."""
    if layout == "KN":
        return np.ascontiguousarray(codes.T), np.ascontiguousarray(scale16.T)
    return codes, scale16


def tile_kn(rows: np.ndarray, tile: int) -> np.ndarray:
    """KN packed codes (q4 [K / 8, N], t2 [K / 16, N]) or their scales -> [N / tile, rows, tile]: element
    [t, r, j] is [r, t tile + j]. host-cpu's q4 / t2 storage (targets' `q4_tile`, `t2_tile`): each tile of
    `tile` output columns, codes and scales alike, is one contiguous run over K, which the decode GEMV streams
    (kernels/cpu/x86.packed_tiled_gemv_int16); over KN rows a task walked a group's code rows and its scale row side
    by side, pieces of 96 bytes that the prefetchers followed poorly on narrow layers."""
    r, n = rows.shape
    if n % tile:
        raise ValueError(f"cannot tile KN rows [{r}, {n}] by {tile} columns")
    return np.ascontiguousarray(rows.reshape(r, n // tile, tile).transpose(1, 0, 2))


def untile_kn(tiled: np.ndarray) -> np.ndarray:
    """Inverse of `tile_kn`: -> KN rows [rows, N]."""
    tiles, r, tile = tiled.shape
    return np.ascontiguousarray(tiled.transpose(1, 0, 2)).reshape(r, tiles * tile)


def dequantize_q4(packed: np.ndarray, scale: np.ndarray, layout: str = "NK") -> np.ndarray:
    """Inverse of `quantize_q4`: -> [N, K] float32 (the reference for numerics tests; KN codes and scales
    may be tiled: `tile_kn`; NK ones row-interleaved, the same 3-d arrays, whatever `layout` says)."""
    if packed.ndim == 3:
        packed, scale, layout = untile_kn(packed), untile_kn(scale), "KN"
    if layout == "KN":
        packed, scale = packed.T, scale.T
    n = packed.shape[0]
    shifts = (np.arange(CODES_PER_WORD, dtype=np.uint32) * 4)
    codes = (packed[..., None] >> shifts) & np.uint32(0xF)
    codes = codes.reshape(n, -1).astype(np.float32) - ZERO
    return codes * np.repeat(scale.astype(np.float32), GROUP, axis=1)


Q8_MAX = 127


def quantize_q8(w: np.ndarray, layout: str = "NK") -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (int8 codes, fp16 scale) — symmetric int8, group 32 along K (like llama.cpp Q8_0).

    scale = max|w| / 127 (fp16-rounded, codes computed against it); NK keeps codes [N, K] and scales
    [N, K/32], KN their transposes (8.5 bits/weight)."""
    q, scale16 = _scaled_groups(w, Q8_MAX)
    np.clip(q, -Q8_MAX, Q8_MAX, out=q)
    return _in_layout(q.astype(np.int8).reshape(w.shape), scale16, layout)


def tile_q8(codes: np.ndarray, tile: int) -> np.ndarray:
    """KN int8 codes [K, N] -> [N / tile, K / 2, 2 tile]: element [t, i, 2 j + r] is code [2 i + r, t tile + j].
    host-cpu's q8 storage: each tile of `tile` output columns is one contiguous run over K with a column's
    codes for rows 2i, 2i + 1 side by side, so the decode GEMV streams a few long runs and feeds pmaddwd from
    one load (kernels/cpu/x86.q8_tiled_gemv_int16). The scales stay KN [K / 32, N]."""
    k, n = codes.shape
    if n % tile or k % 2:
        raise ValueError(f"cannot tile q8 codes [{k}, {n}] by {tile} columns and row pairs")
    return np.ascontiguousarray(codes.reshape(k // 2, 2, n // tile, tile).transpose(2, 0, 3, 1)).reshape(
        n // tile, k // 2, 2 * tile)


def untile_q8(tiled: np.ndarray) -> np.ndarray:
    """Inverse of `tile_q8`: -> KN codes [K, N]."""
    tiles, pairs, width = tiled.shape
    tile = width // 2
    return np.ascontiguousarray(tiled.reshape(tiles, pairs, tile, 2).transpose(1, 3, 0, 2)).reshape(
        2 * pairs, tiles * tile)


def interleave_q8(codes: np.ndarray, rows: int) -> np.ndarray:
    """NK int8 codes [N, K] -> [N / rows, K / 4, 4 rows]: element [t, w, 4 j + b] is code [rows t + j, 4 w + b].
    android-cpu's q8 storage (target q8_interleave; scales: tile_kn of their transpose, [N / rows, K / 32,
    rows]): one 16-byte load holds 4 consecutive codes of each of 4 rows, what `sdot` by element takes
    (kernels/cpu/arm_rows.py)."""
    n, k = codes.shape
    if n % rows or k % 4:
        raise ValueError(f"cannot interleave q8 codes [{n}, {k}] by {rows} rows")
    return np.ascontiguousarray(codes.reshape(n // rows, rows, k // 4, 4).transpose(0, 2, 1, 3)).reshape(
        n // rows, k // 4, 4 * rows)


def deinterleave_q8(codes: np.ndarray) -> np.ndarray:
    """Inverse of `interleave_q8`: -> NK codes [N, K]."""
    tiles, words, width = codes.shape
    rows = width // 4
    return np.ascontiguousarray(codes.reshape(tiles, words, rows, 4).transpose(0, 2, 1, 3)).reshape(
        tiles * rows, words * 4)


def dequantize_q8(codes: np.ndarray, scale: np.ndarray, layout: str = "NK") -> np.ndarray:
    """Inverse of `quantize_q8`: -> [N, K] float32 (KN codes may be tiled: `tile_q8`; NK codes and scales
    rows-interleaved, both 3-d: `interleave_q8`, whatever `layout` says)."""
    if codes.ndim == 3 and scale.ndim == 3:
        codes, scale, layout = deinterleave_q8(codes), untile_kn(scale).T, "NK"
    elif codes.ndim == 3:
        codes = untile_q8(codes)
    if layout == "KN":
        codes, scale = codes.T, scale.T
    return codes.astype(np.float32) * np.repeat(scale.astype(np.float32), GROUP, axis=1)
