"""q4f16 packing: exact format, half-step error bound, NK/KN equivalence."""

import numpy as np
import pytest

from pipeline.quantize import dequantize_q4, quantize_q4


@pytest.mark.parametrize("layout", ["NK", "KN"])
def test_every_weight_within_half_a_step(layout):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 256)) * rng.uniform(0.01, 3, (96, 1))).astype(np.float32)
    w[3, :32] = 0.0                                       # an all-zero group must survive
    packed, scale = quantize_q4(w, layout)
    assert packed.dtype == np.uint32 and scale.dtype == np.float16
    assert packed.shape == ((96, 32) if layout == "NK" else (32, 96))
    assert scale.shape == ((96, 8) if layout == "NK" else (8, 96))
    deq = dequantize_q4(packed, scale, layout)
    step = np.repeat((scale if layout == "NK" else scale.T).astype(np.float32), 32, axis=1)
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-6) + 1e-12)
    assert np.all(deq[3, :32] == 0)


def test_format_matches_the_spec_by_hand():
    """code = round(w/scale)+7, scale = max|w|/7 in fp16, nibble k%8 of word k//8 (little-endian)."""
    w = np.zeros((1, 32), np.float32)
    w[0, :8] = [7, -7, 0, 1, 2, 3, -1, -2]
    packed, scale = quantize_q4(w, "NK")
    assert scale[0, 0] == np.float16(1.0)
    codes = [14, 0, 7, 8, 9, 10, 6, 5]
    assert packed[0, 0] == sum(c << (4 * i) for i, c in enumerate(codes))
    assert packed[0, 1] == sum(7 << (4 * i) for i in range(8))


def test_layouts_hold_the_same_values():
    w = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    nk = dequantize_q4(*quantize_q4(w, "NK"), "NK")
    kn = dequantize_q4(*quantize_q4(w, "KN"), "KN")
    np.testing.assert_array_equal(nk, kn)


def _reference_q4(w: np.ndarray, layout: str):
    """The formula spelled out, one uint32 per code (slow): what the packed fast path must equal."""
    n, k = w.shape
    groups = w.astype(np.float32).reshape(n, k // 32, 32)
    scale16 = (np.abs(groups).max(axis=-1) / 7).astype(np.float16)
    scale = scale16.astype(np.float32)[..., None]
    safe = np.where(scale == 0, 1.0, scale)
    codes = np.clip(np.rint(groups / safe) + 7, 0, 14).astype(np.uint32)
    codes = np.where(scale == 0, 7, codes).reshape(n, k // 8, 8)
    packed = np.bitwise_or.reduce(codes << (np.arange(8, dtype=np.uint32) * 4), axis=-1).astype(np.uint32)
    return (packed.T.copy(), scale16.T.copy()) if layout == "KN" else (packed, scale16)


@pytest.mark.parametrize("layout", ["NK", "KN"])
def test_bit_identical_to_the_reference_formula(layout):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((300, 512)) * rng.uniform(1e-6, 30, (300, 1))).astype(np.float32)
    w[0, :32] = 0.0
    w[1, :32] = 1e-8                       # fp16 scale rounds to 0
    w[2, 32:64] = -2e-7
    w[3, 64:96] = np.float32(7 * 2.0**-25)   # right at the fp16 rounding edge
    w[4, :] = np.repeat([0.5, -0.5], 256)    # ties: rint rounds half to even
    w[5, :] *= 1e3
    for got, want in zip(quantize_q4(w, layout), _reference_q4(w, layout), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
