"""Converted weights (NK and KN q4 layouts) read back through TVM's own tensor-cache loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, {k: v.float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("quant,layout", [("q4f16_1", "NK"), ("q4f16_0", "KN")])
@pytest.mark.parametrize("calibrated", [False, True])
def test_tvm_reads_our_q4_tensor_cache(tiny_llama, quant, layout, calibrated):
    """Uncalibrated: TVM's arrays equal an independent quantize_q4 of the checkpoint tensors. Calibrated
    (the presets' default): equal to what our own reader returns, and the codes differ from rounding."""
    import dataclasses

    import tvm
    from tvm.contrib import tvmjs

    from pipeline.artifacts.tensor_cache import read_tensor_cache
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.progress import Reporter
    from pipeline.quant.quantize import quantize_q4, tile_kn
    from pipeline.stages import define, load, quantize

    folder, state = tiny_llama
    loaded = load(load_model(str(folder)))
    scheme = load_quant(quant)
    assert scheme.calibration_spec is not None
    if not calibrated:
        scheme = dataclasses.replace(scheme, calibration=None)
    defined = define(loaded, scheme, load_target("host-cpu"))
    cache_dir = quantize(loaded, defined, scheme, Reporter(quiet=True))
    params, _meta = tvmjs.load_tensor_cache(str(cache_dir), tvm.cpu())
    assert {n for n, _ in defined.params} == set(params)
    qkv = np.concatenate([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"], axis=0)
    rounded, _ = quantize_q4(qkv, layout)
    if calibrated:
        ours = read_tensor_cache(cache_dir)
        for name, arr in ours.items():
            np.testing.assert_array_equal(params[name].numpy(), arr)
        assert not np.array_equal(ours["model.layers.1.self_attn.qkv_proj.q_weight"], rounded)
        return

    packed, scale = quantize_q4(qkv, layout)
    got = params["model.layers.1.self_attn.qkv_proj.q_weight"].numpy()
    if layout == "KN":   # host-cpu tiles KN q4 codes and scales (target q4_tile; quantize.tile_kn)
        assert got.shape == (qkv.shape[0] // 16, qkv.shape[1] // 8, 16)
        packed, scale = tile_kn(packed, 16), tile_kn(scale, 16)
    np.testing.assert_array_equal(got, packed)
    np.testing.assert_array_equal(params["model.layers.1.self_attn.qkv_proj.q_scale"].numpy(), scale)
    embed_packed, _ = quantize_q4(state["model.embed_tokens.weight"], "NK")   # embeddings stay row-major
    np.testing.assert_array_equal(params["model.embed_tokens.q_weight"].numpy(), embed_packed)
    np.testing.assert_array_equal(params["model.norm.weight"].numpy(), state["model.norm.weight"])
