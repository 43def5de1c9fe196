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


@pytest.mark.parametrize("quant", ["q4f16_1", "q8f16"])
def test_android_cpu_interleaved_rows_read_back_as_the_plain_rows(tiny_llama, quant):
    """android-cpu's tensor cache (q4 / q8 rows interleaved by 8, target q4_interleave / q8_interleave): TVM's
    loader returns the interleaved arrays, and the reference reader (quantize.dequantize_q4 / _q8) turns them
    into exactly the weights of the plain NK quantization of the checkpoint; the embedding table (untied)
    stays plain rows."""
    import dataclasses

    import tvm
    from tvm.contrib import tvmjs

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.progress import Reporter
    from pipeline.quant.quantize import dequantize_q4, dequantize_q8, quantize_q4, quantize_q8
    from pipeline.stages import define, load, quantize

    q8 = quant == "q8f16"
    rtn, deq, words = (quantize_q8, dequantize_q8, 4) if q8 else (quantize_q4, dequantize_q4, 8)
    folder, state = tiny_llama
    loaded = load(load_model(str(folder)))
    scheme = dataclasses.replace(load_quant(quant), calibration=None)
    defined = define(loaded, scheme, load_target("android-cpu"))
    params, _meta = tvmjs.load_tensor_cache(str(quantize(loaded, defined, scheme, Reporter(quiet=True))), tvm.cpu())
    for name, parts in (("self_attn.qkv_proj", [f"self_attn.{p}_proj" for p in "qkv"]), ("mlp.down_proj", ["mlp.down_proj"])):
        w = np.concatenate([state[f"model.layers.1.{p}.weight"] for p in parts], axis=0)
        codes, scale = (params[f"model.layers.1.{name}.{s}"].numpy() for s in ("q_weight", "q_scale"))
        assert codes.shape == (w.shape[0] // 8, w.shape[1] // words, 32 if q8 else 8)
        assert scale.shape == (w.shape[0] // 8, w.shape[1] // 32, 8)
        np.testing.assert_array_equal(deq(codes, scale, "NK"), deq(*rtn(w, "NK"), "NK"))
    embed_packed, _ = rtn(state["model.embed_tokens.weight"], "NK")
    np.testing.assert_array_equal(params["model.embed_tokens.q_weight"].numpy(), embed_packed)


def test_android_cpu_interleaved_t2_rows_read_back_as_the_plain_rows(tiny_llama):
    """ternary_ptq on android-cpu (t2 rows interleaved by 8, target t2_interleave): the tensor cache holds the KN
    tiles of the NK words ([N / 8, K / 16, 8] codes, [N / 8, groups, 8] scales, K = 64 one short group), and the
    reference reader (ternary.dequantize_ternary) turns them into exactly the weights of the plain NK
    ternarisation of the checkpoint."""
    import tvm
    from tvm.contrib import tvmjs

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.progress import Reporter
    from pipeline.quant.ternary import dequantize_ternary, quantize_ternary
    from pipeline.stages import define, load, quantize

    folder, state = tiny_llama
    loaded = load(load_model(str(folder)))
    scheme = load_quant("ternary_ptq")
    defined = define(loaded, scheme, load_target("android-cpu"))
    params, meta = tvmjs.load_tensor_cache(str(quantize(loaded, defined, scheme, Reporter(quiet=True))), tvm.cpu())
    for name, parts in (("self_attn.qkv_proj", [f"self_attn.{p}_proj" for p in "qkv"]), ("mlp.down_proj", ["mlp.down_proj"])):
        w = np.concatenate([state[f"model.layers.1.{p}.weight"] for p in parts], axis=0)
        n, k = w.shape
        codes, scale = (params[f"model.layers.1.{name}.{s}"].numpy() for s in ("q_weight", "q_scale"))
        assert codes.shape == (n // 8, k // 16, 8) and scale.shape == (n // 8, -(-k // 128), 8), name
        np.testing.assert_array_equal(dequantize_ternary(codes, scale, "t2", k, "NK"),
                                      dequantize_ternary(*quantize_ternary(w, "t2", "NK"), "t2", k, "NK"))


def test_android_cpu_interleaved_t3_rows_read_back_as_the_plain_rows(tiny_llama):
    """t3 on android-cpu (rows interleaved by 4, target t3_interleave; the post-training form of ternary_t3, the
    tiny checkpoint not being ternary): the tensor cache holds [N / 4, ceil(K / 20), 4] codes and [N / 4, groups,
    4] scales, and the reference reader gives exactly the weights of the plain NK ternarisation."""
    import dataclasses

    import tvm
    from tvm.contrib import tvmjs

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.progress import Reporter
    from pipeline.quant.ternary import dequantize_ternary, quantize_ternary
    from pipeline.stages import define, load, quantize

    folder, state = tiny_llama
    loaded = load(load_model(str(folder)))
    scheme = dataclasses.replace(load_quant("ternary_t3"), ternary_source="ptq")
    defined = define(loaded, scheme, load_target("android-cpu"))
    params, meta = tvmjs.load_tensor_cache(str(quantize(loaded, defined, scheme, Reporter(quiet=True))), tvm.cpu())
    for name, parts in (("self_attn.qkv_proj", [f"self_attn.{p}_proj" for p in "qkv"]), ("mlp.down_proj", ["mlp.down_proj"])):
        w = np.concatenate([state[f"model.layers.1.{p}.weight"] for p in parts], axis=0)
        n, k = w.shape
        codes, scale = (params[f"model.layers.1.{name}.{s}"].numpy() for s in ("q_weight", "q_scale"))
        assert codes.shape == (n // 4, -(-k // 20), 4) and scale.shape == (n // 4, -(-k // 128), 4), name
        np.testing.assert_array_equal(dequantize_ternary(codes, scale, "t3", k, "NK"),
                                      dequantize_ternary(*quantize_ternary(w, "t3", "NK"), "t3", k, "NK"))


@pytest.mark.parametrize("fmt", ["q4", "q8", "t2"])
def test_te_dequantize_reads_interleaved_rows_like_the_reference(fmt):
    """The layers' TE dequantize (what the fused kernels and the lm_head compute from) reads android-cpu's
    interleaved q4 / q8 arrays (3-d codes and scales) as the same weights the reference reader gives: W^T."""
    import tvm
    from tvm import te

    from pipeline.models.layers import dequantize_q8_te, dequantize_te, dequantize_ternary_te
    from pipeline.quant.quantize import (
        dequantize_q4,
        dequantize_q8,
        interleave_q8,
        quantize_q4,
        quantize_q8,
        tile_kn,
    )

    n, k, rows = 48, 64, 8
    w = np.random.default_rng(5).normal(0, 0.05, (n, k)).astype(np.float32)
    from pipeline.quant.ternary import dequantize_ternary, quantize_ternary

    if fmt == "q8":
        codes, scale = quantize_q8(w, "NK")
        codes, scale, expected = interleave_q8(codes, rows), tile_kn(scale.T, rows), dequantize_q8(codes, scale, "NK")
    elif fmt == "t2":
        codes, scale = quantize_ternary(w, "t2", "NK")
        codes, scale, expected = tile_kn(codes.T, rows), tile_kn(scale.T, rows), dequantize_ternary(codes, scale, "t2", k)
    else:
        codes, scale = quantize_q4(w, "NK")
        codes, scale, expected = tile_kn(codes.T, rows), tile_kn(scale.T, rows), dequantize_q4(codes, scale, "NK")
    c = te.placeholder(codes.shape, str(codes.dtype), name="codes")
    s = te.placeholder(scale.shape, "float16", name="scale")
    if fmt == "t2":
        out = dequantize_ternary_te(c, s, "t2", "NK", k, n, "float32")
    else:
        out = (dequantize_q8_te if fmt == "q8" else dequantize_te)(c, s, "NK", k, n, "float32")
    func = tvm.tirx.build(te.create_prim_func([c, s, out]), target="llvm")
    got = tvm.runtime.tensor(np.zeros((k, n), np.float32))
    func(tvm.runtime.tensor(codes), tvm.runtime.tensor(scale), got)
    np.testing.assert_array_equal(got.numpy(), expected.T)
