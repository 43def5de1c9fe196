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


def test_android_cpu_interleaved_q4_reads_back_as_the_plain_rows(tiny_llama):
    """android-cpu's tensor cache (q4 rows interleaved by 8, target q4_interleave): TVM's loader returns the
    interleaved arrays, and the reference reader (quantize.dequantize_q4) turns them into exactly the weights
    of the plain NK quantization of the checkpoint; the embedding table (untied) stays plain rows."""
    import dataclasses

    import tvm
    from tvm.contrib import tvmjs

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.progress import Reporter
    from pipeline.quant.quantize import dequantize_q4, quantize_q4
    from pipeline.stages import define, load, quantize

    folder, state = tiny_llama
    loaded = load(load_model(str(folder)))
    scheme = dataclasses.replace(load_quant("q4f16_1"), calibration=None)
    defined = define(loaded, scheme, load_target("android-cpu"))
    params, _meta = tvmjs.load_tensor_cache(str(quantize(loaded, defined, scheme, Reporter(quiet=True))), tvm.cpu())
    for name, parts in (("self_attn.qkv_proj", [f"self_attn.{p}_proj" for p in "qkv"]), ("mlp.down_proj", ["mlp.down_proj"])):
        w = np.concatenate([state[f"model.layers.1.{p}.weight"] for p in parts], axis=0)
        codes, scale = (params[f"model.layers.1.{name}.{s}"].numpy() for s in ("q_weight", "q_scale"))
        assert codes.shape == (w.shape[0] // 8, w.shape[1] // 8, 8) and scale.shape == (w.shape[0] // 8, w.shape[1] // 32, 8)
        np.testing.assert_array_equal(dequantize_q4(codes, scale, "NK"), dequantize_q4(*quantize_q4(w, "NK"), "NK"))
    embed_packed, _ = quantize_q4(state["model.embed_tokens.weight"], "NK")
    np.testing.assert_array_equal(params["model.embed_tokens.q_weight"].numpy(), embed_packed)
