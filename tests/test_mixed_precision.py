"""Per-tensor quantization rules (schemes as data): q8f16 and the `mixed` recipe.

q8: symmetric int8, group 32, fp16 scales — round trip within half a step per group. Compiled q8f16 / mixed
host-cpu libraries vs the torch model on our own dequantized weights: max |Δlogit| ≤ 2e-2 × logit scale
(fp16-scale rounding is in both; the rest is float32 arithmetic order). Each layer role gets the format the
scheme names, visible in the library's parameter dtypes.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pipeline.config import load_quant
from pipeline.quantize import dequantize_q4, dequantize_q8, quantize_q4, quantize_q8
from pipeline.runner import Bundle

ROLE_OF = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj", "down_proj": "down_proj", "o_proj": "o_proj", "embed_tokens": "embed_tokens",
           "lm_head": "lm_head"}


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


def test_unknown_format_is_a_config_error(tmp_path):
    from pipeline.config import QuantSpec
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown weight format"):
        QuantSpec(name="bad", weight_format="q4", formats={"lm_head": "q3"}, path=tmp_path / "bad.yaml")


def _role(name: str) -> str:
    return next(role for key, role in ROLE_OF.items() if key in name)


def dequantized(model, formats: dict[str, str], default: str):
    """The torch model with every 2-D weight replaced by our dequantization in the format of its role."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() != 2 or p.shape[1] % 32:
                continue
            fmt = formats.get(_role(name), default)
            w = p.float().numpy()
            if fmt == "q4":
                p.copy_(torch.from_numpy(dequantize_q4(*quantize_q4(w, "NK"), "NK")))
            elif fmt == "q8":
                p.copy_(torch.from_numpy(dequantize_q8(*quantize_q8(w, "NK"), "NK")))
    return ref


@pytest.mark.parametrize("scheme", ["q8f16", "mixed"])
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
    ids = np.random.default_rng(2).integers(0, 512, 48)
    ours = engine.prefill(list(ids), all_logits=True)
    with torch.no_grad():
        ref = dequantized(model, quant.formats, quant.weight_format)(torch.tensor([ids])).logits[0].numpy()
    diff, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert diff <= 2e-2 * scale, f"{scheme}: max |Δ| {diff:.3g} vs logit scale {scale:.3g}"
