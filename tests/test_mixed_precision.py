"""Per-tensor quantization rules (schemes as data): q8f16 and the `mixed` recipe.

q8: symmetric int8, group 32, fp16 scales — round trip within half a step per group. Compiled q8f16 / mixed
host-cpu libraries vs the torch model on our own dequantized weights: max |Δlogit| ≤ 2e-2 × logit scale
(fp16-scale rounding is in both; the rest is float32 arithmetic order). Each layer role gets the format the
scheme names, visible in the library's parameter dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from bundle_weights import bundle_reference

from pipeline.config import load_quant
from pipeline.quant.quantize import dequantize_q8, quantize_q8
from pipeline.runtime.runner import Bundle


@pytest.mark.parametrize("layout", ["NK", "KN"])
def test_q8_round_trip_within_half_a_step(layout):
    w = np.random.default_rng(0).normal(0, 0.05, (48, 96)).astype(np.float32)
    w[3, :32] = 0.0                                          # an all-zero group
    codes, scale = quantize_q8(w, layout)
    assert codes.dtype == np.int8 and scale.dtype == np.float16
    assert codes.shape == ((48, 96) if layout == "NK" else (96, 48))
    assert np.abs(codes.astype(int)).max() <= 127
    back = dequantize_q8(codes, scale, layout)
    step = np.repeat((scale.T if layout == "KN" else scale).astype(np.float32), 32, axis=1)
    assert np.all(np.abs(back - w) <= step / 2 + 1e-7)
    assert np.all(back[3, :32] == 0.0)


def test_q8_tiles_round_trip():
    """host-cpu's tiled q8 codes (quantize.tile_q8): element [t, i, 2 j + r] is KN code [2 i + r, 16 t + j];
    untiling gives the KN codes back and dequantize_q8 reads either form alike; shapes that do not tile refuse."""
    from pipeline.quant.quantize import tile_q8, untile_q8

    w = np.random.default_rng(1).normal(0, 0.05, (48, 64)).astype(np.float32)   # N = 48, K = 64
    codes, scale = quantize_q8(w, "KN")
    tiled = tile_q8(codes, 16)
    assert tiled.shape == (3, 32, 32)
    assert tiled[2, 5, 2 * 7 + 1] == codes[11, 39] and tiled[0, 0, 0] == codes[0, 0]
    assert np.array_equal(untile_q8(tiled), codes)
    assert np.array_equal(dequantize_q8(tiled, scale, "KN"), dequantize_q8(codes, scale, "KN"))
    with pytest.raises(ValueError, match="cannot tile"):
        tile_q8(codes[:, :40], 16)


def test_target_q8_tile_is_checked(tmp_path, monkeypatch):
    """A target's q8_tile is 0 or a positive multiple of 8 (the kernels' vector width); anything else is a
    one-line config error naming the file."""
    from pipeline import config
    from pipeline.errors import ConfigError

    assert config.load_target("host-cpu").q8_tile == 16 and config.load_target("android-adreno").q8_tile == 0
    bad = tmp_path / "cpu-bad-tile.yaml"
    bad.write_text(config.TARGETS["host-cpu"].read_text().replace("q8_tile: 16", "q8_tile: 12"))
    monkeypatch.setitem(config.TARGETS, "cpu-bad-tile", bad)
    with pytest.raises(ConfigError, match=r"cpu-bad-tile.yaml: q8_tile must be 0 or a positive multiple of 8"):
        config.load_target("cpu-bad-tile")


def test_unknown_format_is_a_config_error(tmp_path):
    from pipeline.config import QuantSpec
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown weight format"):
        QuantSpec(name="bad", weight_format="q4", formats={"lm_head": "q3"}, path=tmp_path / "bad.yaml")


@pytest.mark.parametrize("scheme", ["q8f16", "mixed", pytest.param("q0f16", marks=pytest.mark.slow)])
def test_scheme_matches_its_dequantized_reference(tmp_path_factory, build_bundle, scheme):
    from test_model_numerics import tiny_hf_model

    folder, model = tiny_hf_model(tmp_path_factory.mktemp(scheme), "qwen3")
    quant = load_quant(scheme)
    bundle = Bundle(build_bundle(folder, "host-cpu", scheme))
    engine = bundle.engine()
    dtypes = {p["name"]: p["dtype"] for p in engine.meta["params"]}
    for name, dtype in dtypes.items():
        if name.endswith(".q_weight"):
            role = name.rsplit(".", 2)[-2]
            want = quant.formats.get(role, quant.weight_format)
            assert dtype == {"q4": "uint32", "q8": "int8"}[want], (name, dtype)
    if scheme == "mixed":
        assert {"int8", "uint32"} <= set(dtypes.values())
    shapes = {p["name"]: p["shape"] for p in engine.meta["params"]}
    for name, dtype in dtypes.items():   # host-cpu stores KN q8 codes in tiles of 16 columns (quantize.tile_q8);
        if name.endswith(".q_weight") and dtype == "int8" and "embed_tokens" not in name:   # untied tables: NK rows
            assert len(shapes[name]) == 3 and shapes[name][2] == 32, (name, shapes[name])
    chat = json.loads((Path(bundle.path) / "mlc-chat-config.json").read_text())   # says so to the app
    assert chat.get("q8_tile") == (16 if "int8" in dtypes.values() else None)
    ids = np.random.default_rng(2).integers(0, 512, 48)
    ours = engine.prefill(list(ids), all_logits=True)
    with torch.no_grad():
        ref = bundle_reference(model, bundle.path)(torch.tensor([ids])).logits[0].numpy()
    diff, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert diff <= 2e-2 * scale, f"{scheme}: max |Δ| {diff:.3g} vs logit scale {scale:.3g}"
