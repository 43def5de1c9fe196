"""Weight quantization (numpy, one tensor at a time): q0f32 / q0f16 casts and q4f16 group-int4 packing.

q4f16: symmetric int4, group 32 along the reduction (K) axis, fp16 scale = max|w| / 7,
code = clamp(round(w / scale) + 7, 0, 14), 8 codes per little-endian uint32 (code of k at nibble k % 8).
NK (MLC `_1`) stores packed [N, K/8] and scales [N, K/32]; KN (MLC `_0`) stores their transposes.
Codes are computed against the fp16-rounded scale, so every weight dequantizes to within half a step.
"""

from __future__ import annotations

import numpy as np

from .models.layers import CODES_PER_WORD, GROUP, ZERO


def quantize_q4(w: np.ndarray, layout: str = "NK") -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (packed uint32, scale float16) in `layout`.

    Works in place on one float32 temporary and packs two codes per byte (nibble k % 8 of a little-endian
    word is nibble k % 2 of its byte k % 8 // 2), so it makes few passes over the data. A group whose fp16
    scale is 0 holds only values below half the smallest fp16 step times 7, which round to code ZERO.
    """
    q, scale16 = _scaled_groups(w, ZERO)
    q += ZERO
    np.clip(q, 0, 2 * ZERO, out=q)
    n, k = w.shape
    codes = q.astype(np.uint8).reshape(n, k // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).view("<u4").astype(np.uint32, copy=False)
    return _in_layout(packed, scale16, layout)


def _scaled_groups(w: np.ndarray, max_code: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric group-32 scaling shared by q4 and q8: (rint(w / scale) as float32 [N, K/32, 32], the fp16
    scale max|w| / max_code [N, K/32]). Codes use the fp16-rounded scale; a zero scale divides by 1."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"reduction dim {k} is not a multiple of the group size {GROUP}")
    groups = w.astype(np.float32, copy=False).reshape(n, k // GROUP, GROUP)
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


def dequantize_q4(packed: np.ndarray, scale: np.ndarray, layout: str = "NK") -> np.ndarray:
    """Inverse of `quantize_q4`: -> [N, K] float32 (the reference for numerics tests)."""
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


def dequantize_q8(codes: np.ndarray, scale: np.ndarray, layout: str = "NK") -> np.ndarray:
    """Inverse of `quantize_q8`: -> [N, K] float32."""
    if layout == "KN":
        codes, scale = codes.T, scale.T
    return codes.astype(np.float32) * np.repeat(scale.astype(np.float32), GROUP, axis=1)
