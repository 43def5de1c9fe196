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
