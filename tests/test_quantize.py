"""q4f16 packing: exact format, half-step error bound, NK/KN equivalence, the per-group scale search."""

import numpy as np
import pytest

from pipeline.quant.quantize import dequantize_q4, quantize_q4


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
    step = np.repeat(np.abs((scale if layout == "NK" else scale.T).astype(np.float32)), 32, axis=1)
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-6) + 1e-12)
    assert np.all(deq[3, :32] == 0)


def test_format_matches_the_spec_by_hand():
    """value = (code - 7) * scale, nibble k%8 of word k//8 (little-endian); values on an exact grid of
    step 1 keep scale 1 — the 16th level (+8 steps) and a negative scale when the largest weight is negative."""
    w = np.zeros((1, 32), np.float32)
    w[0, :8] = [7, -7, 0, 1, 2, 3, -1, -2]
    packed, scale = quantize_q4(w, "NK")
    assert scale[0, 0] == np.float16(1.0)
    codes = [14, 0, 7, 8, 9, 10, 6, 5]
    assert packed[0, 0] == sum(c << (4 * i) for i, c in enumerate(codes))
    assert packed[0, 1] == sum(7 << (4 * i) for i in range(8))
    w = np.zeros((2, 32), np.float32)
    w[0, :3] = [8, -7, 3]
    w[1, :3] = [-8, 7, 3]
    packed, scale = quantize_q4(w, "NK")
    assert list(scale[:, 0]) == [1.0, -1.0]
    assert packed[0, 0] & 0xFFF == 15 | 0 << 4 | 10 << 8
    assert packed[1, 0] & 0xFFF == 15 | 0 << 4 | 4 << 8
    np.testing.assert_array_equal(dequantize_q4(packed, scale), w)


def test_layouts_hold_the_same_values():
    w = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    nk = dequantize_q4(*quantize_q4(w, "NK"), "NK")
    kn = dequantize_q4(*quantize_q4(w, "KN"), "KN")
    np.testing.assert_array_equal(nk, kn)


def _reference_group(g: np.ndarray) -> tuple[np.float16, list[int]]:
    """One group by the spec, a candidate at a time: scale w_max / d in fp16 for d in 7, 7.5, 8, 8.5; keep
    the least squared error among the scales that leave every weight within half a step (d = 7 first)."""
    w_max = g[int(np.argmax(np.abs(g)))]
    best = None
    for d in (7.0, 7.5, 8.0, 8.5):
        s16 = np.float16(np.float32(w_max) / np.float32(d))
        s = np.float32(s16)
        levels = [min(8.0, max(-7.0, float(np.rint(np.float32(x) / s)))) if s != 0 else 0.0 for x in g]
        err = float(sum((np.float32(q) * s - x) ** 2 for q, x in zip(levels, g, strict=True)))
        within = all(abs(np.float32(q) * s - x) <= abs(s) / 2 + 1e-30 for q, x in zip(levels, g, strict=True))
        if best is None or (within and err < best[0]):
            best = (err, s16, levels)
    return best[1], [int(q) + 7 for q in best[2]]


def _reference_q4(w: np.ndarray, layout: str):
    """The spec spelled out, one group and one code at a time (slow): what the packed fast path must equal
    (up to error ties between candidate scales, which the fast path may break either way)."""
    n, k = w.shape
    groups = w.astype(np.float32).reshape(n, k // 32, 32)
    scale16 = np.zeros((n, k // 32), np.float16)
    codes = np.zeros((n, k // 32, 32), np.uint32)
    for i in range(n):
        for j in range(k // 32):
            scale16[i, j], codes[i, j] = _reference_group(groups[i, j])
    codes = codes.reshape(n, k // 8, 8)
    packed = np.bitwise_or.reduce(codes << (np.arange(8, dtype=np.uint32) * 4), axis=-1).astype(np.uint32)
    return (packed.T.copy(), scale16.T.copy()) if layout == "KN" else (packed, scale16)


@pytest.mark.parametrize("layout", ["NK", "KN"])
def test_bit_identical_to_the_reference_formula(layout):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((40, 256)) * rng.uniform(1e-6, 30, (40, 1))).astype(np.float32)
    w[0, :32] = 0.0
    w[1, :32] = 1e-8                       # fp16 scale rounds to 0
    w[2, 32:64] = -2e-7
    w[3, 64:96] = np.float32(7 * 2.0**-25)   # right at the fp16 rounding edge
    w[4, :] = np.repeat([0.5, -0.5], 128)    # equal magnitudes: the first is w_max
    w[5, :] *= 1e3
    for got, want in zip(quantize_q4(w, layout), _reference_q4(w, layout), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_search_never_loses_to_max_over_7_and_wins_on_average():
    """Per group, the chosen scale's squared error is at most that of MLC's fixed max|w| / 7 (always a
    candidate); over Gaussian weights the mean-square error drops by more than 20% (measured: 25%)."""
    w = np.random.default_rng(3).standard_normal((256, 1024)).astype(np.float32)
    groups = w.reshape(256, 32, 32)
    mlc_scale = (np.abs(groups).max(-1, keepdims=True) / 7).astype(np.float16).astype(np.float32)
    mlc = np.clip(np.rint(groups / mlc_scale), -7, 7) * mlc_scale
    ours = dequantize_q4(*quantize_q4(w)).reshape(groups.shape)
    err_ours, err_mlc = ((ours - groups) ** 2).sum(-1), ((mlc - groups) ** 2).sum(-1)
    assert np.all(err_ours <= err_mlc * (1 + 1e-6))
    assert err_ours.sum() < 0.8 * err_mlc.sum()


def test_kv_cache_precision_per_scheme_and_target(tmp_path):
    """`kv_cache: auto` stores the cache in fp16 on every target (host-cpu computes in fp32 but keeps fp16
    keys / values, like llama.cpp's default cache), except the fp32 reference scheme; an explicit value
    wins; an unknown one is a config error naming the file."""
    from pipeline.config import QuantSpec, load_quant, load_target
    from pipeline.errors import ConfigError

    cpu, gpu = load_target("host-cpu"), load_target("android-adreno")
    for name in ("q4f16", "q8f16", "q0f16", "ternary_ptq"):
        assert load_quant(name).kv_cache_dtype(cpu) == "float16"
        assert load_quant(name).kv_cache_dtype(gpu) == "float16"
    assert load_quant("q0f32").kv_cache_dtype(cpu) == "float32"
    assert QuantSpec(name="x", weight_format="q4", kv_cache="float32").kv_cache_dtype(gpu) == "float32"
    with pytest.raises(ConfigError, match="kv_cache") as err:
        QuantSpec(name="x", weight_format="q4", kv_cache="int4", path=tmp_path / "x.yaml")
    assert "x.yaml" in str(err.value)


def test_q4_tiles_round_trip():
    """host-cpu's tiled q4 storage (quantize.tile_kn): element [t, r, j] of the codes (and of the scales) is
    KN [r, tile t + j]; untiling gives them back, dequantize_q4 reads either form alike, and rows that do not
    tile refuse."""
    from pipeline.quant.quantize import tile_kn, untile_kn

    w = np.random.default_rng(2).normal(0, 0.05, (48, 64)).astype(np.float32)   # N = 48, K = 64
    codes, scale = quantize_q4(w, "KN")                                        # [8, 48], [2, 48]
    tiled, tiled_scale = tile_kn(codes, 24), tile_kn(scale, 24)
    assert tiled.shape == (2, 8, 24) and tiled_scale.shape == (2, 2, 24)
    assert tiled[1, 5, 7] == codes[5, 31] and tiled_scale[1, 1, 23] == scale[1, 47]
    assert np.array_equal(untile_kn(tiled), codes) and np.array_equal(untile_kn(tiled_scale), scale)
    assert np.array_equal(dequantize_q4(tiled, tiled_scale, "KN"), dequantize_q4(codes, scale, "KN"))
    with pytest.raises(ValueError, match="cannot tile"):
        tile_kn(codes[:, :40], 24)


def test_q4_row_interleave_round_trip():
    """android-cpu's interleaved NK q4 rows (target q4_interleave, formats.interleave_rows): tile_kn of the NK
    words transposed, so element [t, w, j] of the codes is row 8 t + j's word w (one 16-byte load: word w of
    4 rows) and [t, g, j] of the scales row 8 t + j's group g; dequantize_q4 reads them as the plain rows
    whatever layout it is told, untile_kn gives the NK arrays back transposed; shapes that do not split into
    two tiles of 8 stay plain."""
    from pipeline.formats import interleave_rows
    from pipeline.quant.quantize import tile_kn, untile_kn

    w = np.random.default_rng(3).normal(0, 0.05, (48, 64)).astype(np.float32)   # N = 48, K = 64
    codes, scale = quantize_q4(w, "NK")                                        # [48, 8], [48, 2]
    rows, row_scales = tile_kn(codes.T, 8), tile_kn(scale.T, 8)
    assert rows.shape == (6, 8, 8) and row_scales.shape == (6, 2, 8)
    assert rows[2, 5, 3] == codes[19, 5] and row_scales[5, 1, 7] == scale[47, 1]
    assert np.array_equal(untile_kn(rows).T, codes) and np.array_equal(untile_kn(row_scales).T, scale)
    for layout in ("NK", "KN"):
        assert np.array_equal(dequantize_q4(rows, row_scales, layout), dequantize_q4(codes, scale, "NK"))
    assert [interleave_rows(n, 8) for n in (576, 960, 49152, 16, 8, 20, 36)] == [8, 8, 8, 8, 0, 0, 0]
    assert interleave_rows(36, 4) == 4 and interleave_rows(576, 0) == 0
    from pipeline.models.layers import q_params  # the layers' parameters: interleaved or plain rows
    shapes = {rows: tuple(tuple(p.shape) for p in q_params(rows, 64, "uint32", "float16", "NK", q4_tile=8))
              for rows in (48, 20)}
    assert shapes == {48: ((6, 8, 8), (6, 2, 8)), 20: ((20, 8), (20, 2))}
    assert [tuple(p.shape) for p in q_params(48, 64, "int8", "float16", "NK", q4_tile=8)] == [(48, 64), (48, 2)]
    assert [tuple(p.shape) for p in q_params(48, 64, "int8", "float16", "NK", q8_tile=8)] == [(6, 16, 32), (6, 2, 8)]


def test_q8_row_interleave_round_trip():
    """android-cpu's interleaved NK q8 rows (target q8_interleave, quantize.interleave_q8): element [t, w, 4 j + b]
    of the codes is row 8 t + j's code 4 w + b (one 16-byte load: 4 codes of 4 rows), the scales as q4's;
    deinterleaving gives the NK codes back and dequantize_q8 reads both forms alike."""
    from pipeline.quant.quantize import deinterleave_q8, dequantize_q8, interleave_q8, quantize_q8, tile_kn

    w = np.random.default_rng(4).normal(0, 0.05, (48, 64)).astype(np.float32)
    codes, scale = quantize_q8(w, "NK")                                        # [48, 64], [48, 2]
    rows, row_scales = interleave_q8(codes, 8), tile_kn(scale.T, 8)
    assert rows.shape == (6, 16, 32) and rows[2, 5, 4 * 3 + 1] == codes[19, 21]
    assert np.array_equal(deinterleave_q8(rows), codes)
    assert np.array_equal(dequantize_q8(rows, row_scales, "NK"), dequantize_q8(codes, scale, "NK"))
    with pytest.raises(ValueError, match="cannot interleave"):
        interleave_q8(codes[:44], 8)


def test_target_q4_interleave_is_checked(tmp_path, monkeypatch):
    """android-cpu interleaves 8 rows; q4_interleave is 0, 4 or 8 and only on an NK target, else a one-line
    config error naming the file."""
    from pipeline import config
    from pipeline.errors import ConfigError

    android, host = config.load_target("android-cpu"), config.load_target("host-cpu")
    assert (android.q4_interleave, android.q8_interleave, host.q4_interleave, host.q8_interleave) == (8, 8, 0, 0)
    assert (android.t2_interleave, host.t2_interleave) == (8, 0)
    text = config.TARGETS["android-cpu"].read_text()
    for bad_text in (text.replace("q4_interleave: 8", "q4_interleave: 16"),
                     text.replace("weight_layout: NK", "weight_layout: KN").replace("q8_interleave: 8", "q8_interleave: 0")):
        bad = tmp_path / "cpu-bad-rows.yaml"
        bad.write_text(bad_text)
        monkeypatch.setitem(config.TARGETS, "cpu-bad-rows", bad)
        with pytest.raises(ConfigError, match=r"cpu-bad-rows.yaml: q4_interleave must be 0, 4 or 8 on an NK target"):
            config.load_target("cpu-bad-rows")
    bad.write_text(text.replace("t2_interleave: 8", "t2_interleave: 2"))
    with pytest.raises(ConfigError, match=r"cpu-bad-rows.yaml: t2_interleave must be 0, 4 or 8 on an NK target"):
        config.load_target("cpu-bad-rows")
    assert (android.t3_interleave, host.t3_interleave) == (4, 0)      # arm_t3.py's 4 rows per task only
    bad.write_text(text.replace("t3_interleave: 4", "t3_interleave: 8"))
    with pytest.raises(ConfigError, match=r"cpu-bad-rows.yaml: t3_interleave must be 0 or 4 on an NK target"):
        config.load_target("cpu-bad-rows")


def test_tile_width_is_the_widest_that_splits_the_outputs():
    """A weight's tile: the widest multiple of 8 up to the target's q4_tile that divides its outputs into at
    least two tiles (the kernels' parallel loop), else plain KN (0)."""
    from pipeline.models.layers import tile_width

    assert [tile_width(n, 24) for n in (576, 960, 49152, 1024, 24, 16, 8, 20)] == [24, 24, 24, 16, 8, 8, 0, 0]
    assert tile_width(576, 16) == 16 and tile_width(576, 0) == 0


@pytest.mark.parametrize("field", ["q4_tile", "t2_tile"])
def test_target_packed_tiles_are_checked(tmp_path, monkeypatch, field):
    """A target's q4_tile / t2_tile is 0, 8, 16 or 24 (the kernels hold a tile's sums in at most 3 vectors);
    anything else is a one-line config error naming the file."""
    from pipeline import config
    from pipeline.errors import ConfigError

    assert getattr(config.load_target("host-cpu"), field) == 24
    assert getattr(config.load_target("android-adreno"), field) == 0
    for value in (12, 32):
        bad = tmp_path / "cpu-bad-tile.yaml"
        bad.write_text(config.TARGETS["host-cpu"].read_text().replace(f"{field}: 24", f"{field}: {value}"))
        monkeypatch.setitem(config.TARGETS, "cpu-bad-tile", bad)
        with pytest.raises(ConfigError, match=rf"cpu-bad-tile.yaml: {field} must be 0, 8, 16 or 24"):
            config.load_target("cpu-bad-tile")
