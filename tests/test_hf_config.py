"""pipeline.frontend.hf_config: the one reader of HF config.json (models, memory plan, auto-quant, calibration)."""

import json

import pytest

from pipeline.config import ROOT
from pipeline.errors import ConfigError
from pipeline.frontend.hf_config import text_config

DENSE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 160}


def test_dense_defaults():
    t = text_config(DENSE)
    assert (t.num_key_value_heads, t.head_dim, t.tie_word_embeddings, t.hybrid) == (4, 16, False, False)
    assert t.layer_types == ("full_attention",) * 3 and t.linear is None and not t.nested
    assert t.rope_theta is None and t.rope_scaling == {} and t.attention_bias is None and t.rms_norm_eps == 1e-6


def test_rope_from_transformers_4_and_5_layouts():
    old = text_config({**DENSE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = text_config({**DENSE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    for t in (old, new):
        assert t.rope_theta == 5e5 and t.rope_scaling["rope_type"] == "linear" and t.rope_scaling["factor"] == 2.0
    assert text_config({**DENSE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_scaling == {}


def test_real_27b_config_nested_text_model():
    hf = json.loads((ROOT / "configs/models/hf/qwen3.5-27b.config.json").read_text())
    t = text_config(hf)
    assert t.hybrid and t.nested and t.model_type == "qwen3_5_text" and t.attn_output_gate
    assert (t.full_attention_layers, t.linear_attention_layers) == (16, 48)
    assert t.linear.conv_dim == 10240 and t.partial_rotary_factor == 0.25 and t.rope_theta == 1e7
    assert not t.is_moe and t.text["vocab_size"] == t.vocab_size == 248320


def test_wrapper_decides_tied_embeddings():
    text = {**DENSE, "model_type": "llama", "tie_word_embeddings": True}
    assert not text_config({"model_type": "wrapper", "tie_word_embeddings": False, "text_config": text}) \
        .tie_word_embeddings
    assert text_config({"model_type": "wrapper", "text_config": text}).tie_word_embeddings


def test_hybrid_layer_types_default_from_interval():
    hf = {**DENSE, "model_type": "qwen3_5_text", "num_hidden_layers": 8, "num_key_value_heads": 2,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
          "linear_value_head_dim": 8}
    t = text_config(hf)
    assert [i for i, k in enumerate(t.layer_types) if k == "full_attention"] == [3, 7]
    assert t.linear.conv_kernel == 4


@pytest.mark.parametrize("hf, words", [
    ({k: v for k, v in DENSE.items() if k != "vocab_size"}, "missing field 'vocab_size'"),
    ({"model_type": "qwen3_5", "text_config": {**DENSE, "model_type": "qwen3_5_text", "num_key_value_heads": 2}},
     "missing field 'linear_num_key_heads' in text_config"),
    ({**DENSE, "layer_types": ["full_attention"]}, "layer_types has 1 entries but num_hidden_layers is 3"),
    ({**DENSE, "hidden_size": "big"}, "field 'hidden_size' must be a number"),
])
def test_errors_name_the_field(hf, words):
    with pytest.raises(ConfigError, match=words):
        text_config(hf)


def test_sliding_window_only_when_used():
    assert text_config({**DENSE, "sliding_window": 4096}).sliding_window == 4096   # Mistral: on when set
    assert text_config({**DENSE, "sliding_window": 4096, "use_sliding_window": False}).sliding_window is None
    assert text_config({**DENSE, "sliding_window": 512, "use_sliding_window": False,     # transformers 5's Qwen2
                        "layer_types": ["sliding_attention"] * 3}).sliding_window == 512
    assert text_config(DENSE).sliding_window is None
