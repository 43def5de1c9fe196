"""Block-by-block conversion is bit-identical to converting whole (concatenated) tensors at once."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

from pipeline.frontend.checkpoint import open_checkpoint
from pipeline.quant.convert import QUANT_SUFFIXES, _load_source, iter_converted
from pipeline.quant.quantize import quantize_q4, tile_kn


def _whole_tensor_reference(ckpt, params, layout, tied):
    """The conversion as it was before streaming: concatenate the full fp32 sources, then quantize / cast."""
    pending = {}
    for name, p in params:
        if name in pending:
            yield name, pending.pop(name)
            continue
        src = _load_source(ckpt, name, tied)
        if name.endswith(QUANT_SUFFIXES):
            base = name.rsplit(".", 1)[0]
            nk = base.endswith("embed_tokens") or layout == "NK"
            packed, scale = quantize_q4(src, "NK" if nk else layout)
            tile = int((getattr(p, "attrs", None) or {}).get("q4_tile", 0))   # host-cpu's tiled KN q4, android-cpu's NK rows
            if tile:
                packed, scale = tile_kn(packed.T if nk else packed, tile), tile_kn(scale.T if nk else scale, tile)
            is_weight = name.endswith(".q_weight")
            pending[base + (".q_scale" if is_weight else ".q_weight")] = scale if is_weight else packed
            yield name, packed if is_weight else scale
        else:
            yield name, src.astype(p.dtype, copy=False)


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """A tiny untied Qwen3 (fused qkv with q/k-norm, gate_up) saved in bfloat16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128,
                      tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("tiny-qwen3-bf16")
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("quant,target", [("q4f16_1", "host-cpu"), ("q4f16_0", "host-cpu"), ("q0f16", "host-cpu"),
                                          ("q0f32", "host-cpu"), ("q4f16_1", "android-cpu")])
def test_chunked_conversion_is_bit_identical(tiny_bf16, quant, target):
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.stages import define, load

    loaded = load(load_model(str(tiny_bf16)))
    defined = define(loaded, load_quant(quant), load_target(target))
    ckpt, params, tied = loaded.checkpoint, defined.params, loaded.decoder.tie_word_embeddings
    reference = list(_whole_tensor_reference(ckpt, params, defined.layout, tied))
    for block_bytes in (1, 700, None):       # one row at a time, a few rows, the default (one block)
        produced = []
        got = list(iter_converted(ckpt, params, defined.layout, tied=tied, block_bytes=block_bytes,
                                  on_bytes=produced.append))
        assert [n for n, _ in got] == [n for n, _ in reference]
        for (name, a), (_, b) in zip(got, reference, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b), (quant, block_bytes, name)
        assert sum(produced) == sum(a.nbytes for _, a in got)


def test_start_skips_without_reading(tiny_bf16):
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.stages import define, load

    loaded = load(load_model(str(tiny_bf16)))
    defined = define(loaded, load_quant("q4f16_1"), load_target("host-cpu"))
    ckpt = loaded.checkpoint
    full = dict(iter_converted(ckpt, defined.params, "NK"))
    reads = []
    real = ckpt.get_rows
    ckpt.get_rows = lambda name, a, b: reads.append(name) or real(name, a, b)
    start = next(i for i, (n, _) in enumerate(defined.params) if n.endswith("lm_head.q_scale"))
    rest = list(iter_converted(ckpt, defined.params, "NK", start=start))
    assert [n for n, _ in rest] == [n for n, _ in defined.params[start:]]
    assert all(_bits(a) == _bits(full[n]) for n, a in rest)
    assert set(reads) == {"lm_head.weight"}         # a q_scale whose q_weight was skipped: that source only


def test_safetensors_get_rows_matches_get(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {
        "bf16": rng.standard_normal((37, 64)).astype(ml_dtypes.bfloat16),
        "special": np.array([np.nan, np.inf, -np.inf, -0.0, 1e-40], dtype=np.float32).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((9, 5, 3)).astype(np.float16),
        "f32": rng.standard_normal(11).astype(np.float32),
        "i32": np.arange(6, dtype=np.int32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ckpt = open_checkpoint(tmp_path)
    for name in tensors:
        full = ckpt.get(name)
        rows = full.shape[0]
        for start, stop in ((0, rows), (1, min(rows, 7)), (rows // 3, rows), (2, 1), (0, rows + 5)):
            part = ckpt.get_rows(name, start, stop)
            assert part.dtype == np.float32 and part.shape == full[start:stop].shape
            assert _bits(part) == _bits(full[start:stop]), (name, start, stop)


def test_gguf_get_rows_matches_get(smollm2_gguf):
    ckpt = open_checkpoint(smollm2_gguf)
    names = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
             "model.layers.0.mlp.down_proj.weight"]
    for name in names:
        full = ckpt.get(name)
        rows = full.shape[0]
        for start, stop in ((0, rows), (3, 70), (rows - 5, rows)):
            assert _bits(ckpt.get_rows(name, start, stop)) == _bits(full[start:stop]), (name, start, stop)
