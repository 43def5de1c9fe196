"""memory_plan: parameter counts, KV / recurrent state sizes and decode predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.quant.memory_plan import memory_plan, plan_markdown

HF = Path(__file__).resolve().parent.parent / "configs" / "models" / "hf"
PHONE_8G3 = {"name": "Snapdragon 8 Gen 3", "ram_gb": 16, "app_budget_gb": 12, "bandwidth_gbs": 76.8}


def _load(name: str) -> dict:
    return json.loads((HF / name).read_text())


@pytest.fixture(scope="module")
def qwen27b() -> dict:
    return _load("qwen3.5-27b.config.json")


@pytest.fixture(scope="module")
def qwen32b() -> dict:
    return _load("qwen3-32b.config.json")


def test_qwen27b_params_kv_state(qwen27b):
    plan = memory_plan(qwen27b, quant="q0f16")
    assert plan["layers"] == {"total": 64, "full_attention": 16, "linear_attention": 48}
    params = plan["weights_total"]["params"]
    assert params == pytest.approx(26.9e9, rel=0.03)
    # everything but the embedding gather (untied lm_head): ~25.6B
    assert plan["weights_read_per_token"]["params"] == pytest.approx(25.6e9, rel=0.03)
    # fp16 everywhere except A_log / dt_bias (fp32)
    assert plan["weights_total"]["bytes"] == 2 * params + 2 * plan["weights"]["gdn_decay"]["params"]
    # q_proj doubled by the output gate: 2 x 24 x 256 outputs
    assert plan["weights"]["attn_q"]["params"] == 16 * 2 * 24 * 256 * 5120
    # KV: 16 full layers x 2 x 4 kv heads x 256 x 2 B = 64 KiB/token
    assert plan["kv_cache"]["bytes_per_token"] == 16 * 2 * 4 * 256 * 2 == 64 * 1024
    assert plan["kv_cache"]["by_context"][32768] == 64 * 1024 * 32768
    st = plan["recurrent_state"]
    assert st["gdn_bytes"] == 48 * 48 * 128 * 128 * 4
    assert st["gdn_bytes"] == pytest.approx(151e6, rel=0.02)
    # conv state in fp16: 48 x (2*16*128 + 48*128) x 3 x 2 B ~= 2.9 MB
    assert st["conv_bytes"] == 48 * 10240 * 3 * 2
    assert st["conv_bytes"] == pytest.approx(3e6, rel=0.05)
    # fp32 compute doubles KV and conv state but not the (always fp32) GDN state
    p32 = memory_plan(qwen27b, quant="q0f16", compute_dtype="float32")
    assert p32["kv_cache"]["bytes_per_token"] == 128 * 1024
    assert p32["recurrent_state"]["gdn_bytes"] == st["gdn_bytes"]
    assert p32["recurrent_state"]["conv_bytes"] == 2 * st["conv_bytes"]
    # the KV cache's own precision (the scheme's kv_cache) decides its bytes, not the compute dtype
    p32_kv16 = memory_plan(qwen27b, quant="q0f16", compute_dtype="float32", kv_dtype="float16")
    assert p32_kv16["kv_cache"]["bytes_per_token"] == 64 * 1024 and p32_kv16["kv_cache"]["dtype"] == "float16"
    assert p32_kv16["recurrent_state"]["conv_bytes"] == p32["recurrent_state"]["conv_bytes"]
    with pytest.raises(ValueError, match="kv_dtype"):
        memory_plan(qwen27b, quant="q0f16", kv_dtype="int3")


def test_qwen27b_q4_weights_and_phone(qwen27b):
    plan = memory_plan(qwen27b, quant="q4f16", phone=PHONE_8G3)
    total = plan["weights_total"]["bytes"]
    # ~4.5 bpw over 26.9B params; only norms / conv1d / decay stay fp16. We get 15.13 GB.
    assert 14.8e9 < total < 15.4e9
    read = plan["weights_read_per_token"]["bytes"]
    assert read == pytest.approx(14.4e9, rel=0.02)  # ~14.4 GB read per token at 4.5 bpw
    assert plan["weights_only_roofline_tok_s"] == pytest.approx(5.3, rel=0.02)
    rows = {r["context"]: r for r in plan["contexts"]}
    assert set(rows) == {4096, 8192, 32768}
    for r in rows.values():
        assert r["predicted_decode_tok_s"] <= 5.3
        assert r["roofline_tok_s"] <= 5.34
        assert r["predicted_decode_tok_s"] == pytest.approx(0.6 * r["roofline_tok_s"])
        # 15 GB of weights alone exceed a 12 GB app budget
        assert r["fits"] is False
    assert rows[32768]["predicted_decode_tok_s"] < rows[4096]["predicted_decode_tok_s"]
    assert rows[4096]["total_bytes"] == (
        total + 64 * 1024 * 4096 + plan["recurrent_state"]["bytes"] + plan["activations"]["bytes"]
    )
    big_phone = dict(PHONE_8G3, ram_gb=24, app_budget_gb=20)
    assert memory_plan(qwen27b, quant="q4f16", phone=big_phone)["contexts"][0]["fits"] is True
    md = plan_markdown(plan)
    assert "| embedding |" in md and "64 KiB" in md and "predicted tok/s" in md and "**predictions**" in md
    # a GPU target's phone entry may name a CPU class (configs/phones.yaml) its library was not built for: no
    # class line (the 35B's QUANT=auto PHONE=android-16gb adreno build once failed here with a KeyError)
    named = plan_markdown(memory_plan(qwen27b, quant="q4f16", phone=dict(PHONE_8G3, cpu_class="i8mm")))
    assert "CPU library built for class" not in named


def test_qwen32b(qwen32b):
    plan = memory_plan(qwen32b, quant="q0f16", contexts=(1024,))
    assert plan["weights_total"]["params"] == pytest.approx(32.8e9, rel=0.03)
    assert plan["kv_cache"]["bytes_per_token"] == 64 * 2 * 8 * 128 * 2 == 256 * 1024
    assert plan["recurrent_state"]["bytes"] == 0
    assert plan["layers"]["linear_attention"] == 0
    assert "attn_qk_norm" in plan["weights"]
    assert "GDN" not in plan_markdown(plan)


def test_quant_modes_and_errors(qwen32b):
    p32 = memory_plan(qwen32b, quant="q0f32")
    p16 = memory_plan(qwen32b, quant="q0f16")
    p4 = memory_plan(qwen32b, quant="q4f16")
    assert p32["weights_total"]["bytes"] == 2 * p16["weights_total"]["bytes"]
    assert p4["weights"]["mlp_down"]["bytes"] * 8 == p4["weights"]["mlp_down"]["params"] * 4.5
    assert p4["weights"]["norms"]["precision"] == "float16"
    with pytest.raises(ValueError):
        memory_plan(qwen32b, quant="q3f16")
    with pytest.raises(ValueError):
        memory_plan(qwen32b, quant="q4f16", compute_dtype="int8")


def _group_of(name: str) -> str:
    """Map a transformers parameter name onto memory_plan's tensor groups."""
    table = [
        ("experts.gate_up_proj", "experts_gate_up"),
        ("experts.down_proj", "experts_down"),
        ("mlp.gate.weight", "moe_router"),
        ("shared_expert_gate", "shared_expert_gate"),
        ("shared_expert.gate_proj", "shared_expert_gate_up"),
        ("shared_expert.up_proj", "shared_expert_gate_up"),
        ("shared_expert.down_proj", "shared_expert_down"),
        ("embed_tokens", "embedding"),
        ("lm_head", "lm_head"),
        ("q_norm", "attn_qk_norm"),
        ("k_norm", "attn_qk_norm"),
        ("in_proj_qkv", "gdn_in_proj_qkv"),
        ("in_proj_z", "gdn_in_proj_z"),
        ("in_proj_b", "gdn_in_proj_b"),
        ("in_proj_a", "gdn_in_proj_a"),
        ("conv1d", "gdn_conv1d"),
        ("A_log", "gdn_decay"),
        ("dt_bias", "gdn_decay"),
        ("linear_attn.norm", "gdn_norm"),
        ("out_proj", "gdn_out_proj"),
        ("gate_proj", "mlp_gate"),
        ("up_proj", "mlp_up"),
        ("down_proj", "mlp_down"),
        ("layernorm", "norms"),
        ("model.norm", "norms"),
    ]
    for key, group in table:
        if key in name:
            return "mlp_bias" if group.startswith("mlp_") and name.endswith(".bias") else group
    for proj in "qkvo":
        if f"{proj}_proj" in name:
            return "attn_bias" if name.endswith(".bias") else f"attn_{proj}"
    raise AssertionError(f"unmapped parameter {name}")


def _hf_groups(model) -> dict[str, int]:
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():  # shared (tied) parameters are listed once
        g = _group_of(name)
        groups[g] = groups.get(g, 0) + p.numel()
    return groups


TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 160,
}


@pytest.mark.parametrize(
    "family, extra",
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True, "head_dim": 32}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"tie_word_embeddings": False, "head_dim": 24}),
    ],
)
def test_tiny_dense_matches_transformers(family, extra):
    transformers = pytest.importorskip("transformers")
    cls_cfg, cls_model = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    cfg = getattr(transformers, cls_cfg)(**TINY, **extra)
    model = getattr(transformers, cls_model)(cfg)
    plan = memory_plan(cfg.to_dict(), quant="q0f32", contexts=(16,))
    assert plan["weights_total"]["params"] == model.num_parameters()
    assert {g: v["params"] for g, v in plan["weights"].items()} == _hf_groups(model)
    assert plan["weights_total"]["bytes"] == 4 * model.num_parameters()
    if extra["tie_word_embeddings"]:
        assert "lm_head" not in plan["weights"]
        assert plan["weights_read_per_token"]["params"] == model.num_parameters()
    else:
        emb = plan["weights"]["embedding"]["params"]
        assert plan["weights_read_per_token"]["params"] == model.num_parameters() - emb


def test_tiny_qwen35_matches_transformers():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("transformers without Qwen3.5")
    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=160,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3_5ForCausalLM(cfg)
    # wrap it the way the multimodal checkpoint does
    hf = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": cfg.to_dict()}
    plan = memory_plan(hf, quant="q0f16", contexts=(16,))
    assert plan["layers"] == {"total": 4, "full_attention": 1, "linear_attention": 3}
    assert plan["weights_total"]["params"] == model.num_parameters()
    assert {g: v["params"] for g, v in plan["weights"].items()} == _hf_groups(model)
    assert plan["kv_cache"]["bytes_per_token"] == 1 * 2 * 2 * 32 * 2
    assert plan["recurrent_state"]["gdn_bytes"] == 3 * 4 * 16 * 16 * 4
    assert plan["recurrent_state"]["conv_bytes"] == 3 * (2 * 2 * 16 + 4 * 16) * 3 * 2


@pytest.mark.parametrize("quant", ["q0f16", "q4f16", "q8f16", "mixed", "ternary", "ternary_t3", "ternary_ptq_rot"])
def test_plan_bytes_equal_the_compiled_models_parameters(qwen27b, quant):
    """The plan is computed from the config; the model definition declares the real parameters. They agree
    byte for byte (a 4-layer cut of the real 27B config, phone target, so activations/norms are fp16)."""
    import math

    import numpy as np

    from pipeline import stages
    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.quant.memory_plan import modes_for_scheme

    text = {**qwen27b["text_config"], "num_hidden_layers": 4,
            "layer_types": qwen27b["text_config"]["layer_types"][:4]}
    hf = {**qwen27b, "text_config": text}
    spec = ModelSpec(name="cut", hf_config=hf, weights=None)
    loaded = stages.load(spec)
    spec_q = load_quant(quant)
    defined = stages.define(loaded, spec_q, load_target("android-adreno"))
    real = sum(math.prod(int(x) for x in p.shape) * np.dtype(p.dtype).itemsize for _, p in defined.params)
    mode, group_modes = modes_for_scheme(spec_q.weight_format, spec_q.weight_dtype, spec_q.formats)
    assert memory_plan(hf, quant=mode, group_modes=group_modes)["weights_total"]["bytes"] == real


def _tiny_moe_model(kind: str):
    """A transformers MoE model made here: qwen3_moe (3 layers, layer 1 dense) or qwen3_5_moe (shared expert)."""
    transformers = pytest.importorskip("transformers")
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**TINY, head_dim=16, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, mlp_only_layers=[1], tie_word_embeddings=False)
        return cfg.to_dict(), transformers.Qwen3MoeForCausalLM(cfg)
    cfg = transformers.Qwen3_5MoeTextConfig(
        hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, vocab_size=160,
        tie_word_embeddings=False)
    hf = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False, "text_config": cfg.to_dict()}
    return hf, transformers.Qwen3_5MoeForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_tiny_moe_matches_transformers(kind):
    """Every parameter of transformers' MoE models is counted, in the right group (all E experts stored)."""
    hf, model = _tiny_moe_model(kind)
    plan = memory_plan(hf, quant="q0f32", contexts=(16,))
    assert plan["weights_total"]["params"] == model.num_parameters()
    assert {g: v["params"] for g, v in plan["weights"].items()} == _hf_groups(model)
    assert plan["moe"]["routed_params"] == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    # read per token: all but the embedding gather and 6 of the 8 experts of each sparse layer
    emb = model.get_input_embeddings().weight.numel()
    assert plan["weights_read_per_token"]["params"] == (
        model.num_parameters() - emb - plan["moe"]["routed_params"] * 6 // 8)


def test_moe_active_bytes_by_hand():
    """q4f16 bytes of a tiny qwen3_moe (3 layers, layer 1 dense, 8 experts top-2), stored and read per decoded
    token, against the arithmetic done by hand; the predicted decode speed divides the active bytes."""
    hf, _ = _tiny_moe_model("qwen3_moe")
    phone = {"name": "test phone", "ram_gb": 1, "app_budget_gb": 0.5, "bandwidth_gbs": 50.0}
    plan = memory_plan(hf, quant="q4f16", contexts=(100,), phone=phone)

    def q4(rows, k):   # 4-bit codes + one fp16 scale per 32 along K
        return rows * (k // 2 + 2 * (k // 32))

    attention = 3 * (q4(64, 64) + q4(32, 64) + q4(32, 64) + q4(64, 64) + 2 * 16 * 2)   # q, k, v, o, q/k norms
    norms = (2 * 3 + 1) * 64 * 2
    dense_mlp = q4(96, 64) + q4(96, 64) + q4(64, 96)                                    # layer 1 only
    router = 8 * 64 * 2                                                                 # fp16, never quantized
    expert = q4(2 * 32, 64) + q4(64, 32)                                                # one expert's gate_up + down
    vocab_table = q4(160, 64)
    stored = attention + norms + dense_mlp + 2 * (router + 8 * expert) + 2 * vocab_table
    active = attention + norms + dense_mlp + 2 * (router + 2 * expert) + vocab_table     # lm_head, no embedding
    assert (stored, active) == (101056, 53824)   # the sums written out: a change of the formula above shows here
    assert plan["weights_total"]["bytes"] == stored
    assert plan["weights_read_per_token"]["bytes"] == active
    assert plan["moe"]["routed_bytes"] == 2 * 8 * expert and plan["moe"]["routed_read_bytes"] == 2 * 2 * expert
    assert plan["weights_read_per_token"]["by_part"]["routed experts"] == 4 * expert
    row = plan["contexts"][0]
    kv = 3 * 2 * 2 * 16 * 2 * 100   # 3 layers x K,V x 2 kv heads x head_dim 16 x fp16 x 100 tokens
    assert row["decode_bytes_per_token"] == active + kv
    assert row["predicted_decode_tok_s"] == pytest.approx(0.6 * 50e9 / (active + kv))
    md = plan_markdown(plan)
    assert "## Mixture of experts" in md and "2/8" in md and "**predictions**" in md and "active weights" in md


def test_35b_a3b_active_and_phones():
    """Qwen3.5-35B-A3B's real config: ~35B stored, ~3B read per token (the "A3B"); at q4 the weights (19.5 GB)
    fit a 24 GB Android phone's 20 GB budget at 8K, not a 16 GB one's 12 GB."""
    from pipeline.config import load_model, load_phone

    hf = load_model("qwen3.5-35b-a3b").hf_config
    plan = memory_plan(hf, quant="q4f16", contexts=(8192,), phone=load_phone("android-24gb"))
    assert plan["weights_total"]["params"] == pytest.approx(34.66e9, rel=1e-3)
    assert plan["weights_read_per_token"]["params"] == pytest.approx(2.95e9, rel=1e-2)
    # 40 layers x 8 experts x (2 x 512 x 2048 + 2048 x 512) weights at 4.5 bits
    assert plan["moe"]["routed_read_bytes"] == 40 * 8 * 3 * 512 * 2048 * 9 // 16
    assert plan["kv_cache"]["bytes_per_token"] == 10 * 2 * 2 * 256 * 2
    assert plan["recurrent_state"]["gdn_bytes"] == 30 * 32 * 128 * 128 * 4
    assert plan["contexts"][0]["fits"] is True
    assert memory_plan(hf, quant="q4f16", contexts=(8192,), phone=load_phone("android-16gb"))["contexts"][0][
        "fits"] is False
    # t3 experts (models/moe.py stores them since the gather kernels read sign codes): 20 codes per uint32 word
    # + an fp16 scale per 128 along K, by hand: gate_up rows K = 2048 -> 103 words + 16 scales = 444 B, down rows
    # K = 512 -> 26 words + 4 scales = 112 B; 1.74 bits/weight. Only the experts' bytes change.
    t3 = memory_plan(hf, quant="q4f16", contexts=(8192,), phone=load_phone("android-16gb"),
                     group_modes={"experts_gate_up": "t3f16", "experts_down": "t3f16"})
    expert = 1024 * (103 * 4 + 16 * 2) + 2048 * (26 * 4 + 4 * 2)
    assert t3["moe"]["routed_bytes"] == 40 * 256 * expert and t3["moe"]["routed_read_bytes"] == 40 * 8 * expert
    assert t3["weights_total"]["bytes"] - plan["weights_total"]["bytes"] == \
        t3["moe"]["routed_bytes"] - plan["moe"]["routed_bytes"]
    assert t3["contexts"][0]["fits"] is True   # the 16 GB phone's 12 GB budget, at 8K


@pytest.mark.parametrize("quant", ["q0f16", "mixed", "experts-q8-shared-float",
                                   pytest.param("experts-t3-shared-t2", marks=pytest.mark.slow)])   # ~18 s
def test_moe_plan_bytes_equal_the_compiled_models_parameters(quant):
    """The plan of a 2-layer cut of Qwen3.5-35B-A3B's config (GDN + gated attention, all 256 experts) equals,
    byte for byte, the
    parameters the model definition declares for a phone target, per-role formats included."""
    import dataclasses
    import math

    import numpy as np

    from pipeline import stages
    from pipeline.config import ModelSpec, load_model, load_quant, load_target
    from pipeline.quant.memory_plan import modes_for_scheme

    hf = load_model("qwen3.5-35b-a3b").hf_config
    text = {**hf["text_config"], "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    hf = {**hf, "text_config": text}
    if quant == "experts-q8-shared-float":
        spec_q = dataclasses.replace(load_quant("q4f16"), formats={"experts": "q8", "shared_expert": "float",
                                                                   "gate_up_proj": "q8"})
    elif quant == "experts-t3-shared-t2":   # sign-packed experts: [E, rows, words] codes + [E, rows, groups] scales
        spec_q = dataclasses.replace(load_quant("ternary_ptq"), formats={"experts": "t3", "shared_expert": "t2"})
    else:
        spec_q = load_quant(quant)
    defined = stages.define(stages.load(ModelSpec(name="cut", hf_config=hf, weights=None)), spec_q,
                            load_target("android-adreno"))
    real = sum(math.prod(int(x) for x in p.shape) * np.dtype(p.dtype).itemsize for _, p in defined.params)
    mode, group_modes = modes_for_scheme(spec_q.weight_format, spec_q.weight_dtype, spec_q.formats)
    assert memory_plan(hf, quant=mode, group_modes=group_modes)["weights_total"]["bytes"] == real
