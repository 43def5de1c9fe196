"""Compiled host-cpu libraries vs transformers (float32) — the numerics reference for the decoder family.

Tolerance: max |Δlogit| ≤ 1e-3 × max |reference logit| for q0f32; greedy decode tokens identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bundle_weights import bundle_reference

from pipeline.runtime.runner import Bundle

PROMPT_LEN = 32
DECODE_STEPS = 32


def tiny_hf_model(tmp_path, family: str, **overrides):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    cfg_cls, model_cls = classes[family]
    kwargs = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, head_dim=16)
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():   # random init is tiny; widen it so logits are far from ties
        for p in model.parameters():
            if p.dim() >= 1:
                p.mul_(3.0 if p.dim() == 2 else 1.0)
    folder = tmp_path / family
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def run_engine_greedy(engine, ids, steps):
    logits = engine.prefill(list(ids), all_logits=True)
    out, tok = [], int(np.argmax(logits[-1]))
    for _ in range(steps):
        out.append(tok)
        tok = int(np.argmax(engine.decode(tok)))
    return logits, out


def reference_greedy(model, ids, steps):
    """Greedy with the HF KV cache, never stopping at EOS (our loop does not either)."""
    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), use_cache=True)
        logits = out.logits[0].float().numpy()
        past, tokens = out.past_key_values, []
        tok = int(out.logits[0, -1].argmax())
        for _ in range(steps):
            tokens.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
    return logits, tokens


def assert_close_logits(ours, ref, rel=1e-3):
    scale = float(np.abs(ref).max())
    diff = float(np.abs(ours - ref).max())
    assert diff <= rel * scale, f"max |Δ| {diff:.3g} > {rel} × logit scale {scale:.3g}"


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", {}),                                                       # QKV bias
    ("qwen3", {}),                                                       # q/k RMSNorm
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "rope_theta": 500000.0}),                                 # Llama-3 RoPE scaling
])
def test_tiny_models_q0f32_match_transformers(tmp_path_factory, build_bundle, family, overrides):
    folder, model = tiny_hf_model(tmp_path_factory.mktemp(family), family, **overrides)
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    bundle = Bundle(build_bundle(folder, "host-cpu", "q0f32"))
    ids = np.random.default_rng(1).integers(0, 512, PROMPT_LEN)
    ours, our_tokens = run_engine_greedy(bundle.engine(), ids, DECODE_STEPS)
    ref, ref_tokens = reference_greedy(model, ids, DECODE_STEPS)
    assert_close_logits(ours, ref)
    assert our_tokens == ref_tokens


def test_fp16_kv_cache_matches_transformers(tmp_path_factory, build_bundle):
    """The KV-cache precision on its own: fp32 weights and activations, keys / values (and the attention's
    query and output) stored in fp16 (the scheme's `kv_cache: float16`, what host-cpu q4f16 / q8f16 / q0f16
    get by default). Measured: max |Δlogit| 5.5e-4 x the logit scale over the prompt (5.0e-4 over 32 decode
    steps; with q0f32's fp32 cache 7e-7); the bound is 3e-3, and greedy decode keeps the reference's tokens."""
    folder, model = tiny_hf_model(tmp_path_factory.mktemp("kv16"), "llama")
    scheme = tmp_path_factory.mktemp("scheme") / "q0f32_kv16.yaml"
    scheme.write_text("name: q0f32_kv16\nweight_format: float\nweight_dtype: float32\nlayout: NK\n"
                      "kv_cache: float16\n")
    bundle = Bundle(build_bundle(folder, "host-cpu", str(scheme)))
    ids = np.random.default_rng(1).integers(0, 512, PROMPT_LEN)
    engine = bundle.engine()
    ours, our_tokens = run_engine_greedy(engine, ids, DECODE_STEPS)
    ref, ref_tokens = reference_greedy(model, ids, DECODE_STEPS)
    assert engine.meta["kv_cache"]["dtype"] == "float16"
    assert_close_logits(ours, ref, rel=3e-3)
    assert our_tokens == ref_tokens


def test_kv_cache_flag_overrides_the_scheme(tmp_path):
    """`--kv-cache` (run_pipeline's kv_cache) replaces the scheme's precision: the same output folder is
    rebuilt, not taken as current, and the bundle's KV cache has the asked dtype (its memory plan, written
    from the library's metadata: a second library at the same path would not load in this process)."""
    import json

    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    folder, _ = tiny_hf_model(tmp_path, "llama", num_hidden_layers=1)
    dtypes = []
    for kv in (None, "float32"):
        result = run_pipeline(str(folder), "host-cpu", "q0f16", out=str(tmp_path / "dist"), kv_cache=kv,
                              report=Reporter(quiet=True))
        assert not result.cached
        dtypes.append(json.loads((result.bundle / "reports" / "memory.json").read_text())["kv_cache"]["dtype"])
    assert dtypes == ["float16", "float32"]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


def chat_ids(bundle: Bundle, text: str) -> list[int]:
    tok = bundle.tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_default_model_q0f32_matches_transformers(build_bundle, smollm2_reference):
    bundle = Bundle(build_bundle("smollm2-135m", "host-cpu", "q0f32"))
    tok = bundle.tokenizer()
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type with an oil-based ink and a wooden screw press, and it changed")
    ids = tok.encode(text)[:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN
    ours, our_tokens = run_engine_greedy(bundle.engine(), ids, DECODE_STEPS)
    ref, ref_tokens = reference_greedy(smollm2_reference, ids, DECODE_STEPS)
    assert_close_logits(ours, ref)
    assert our_tokens == ref_tokens


def test_greedy_step_matches_argmax_of_decode(tmp_path_factory, build_bundle):
    """A CPU library's decode_greedy (embed + decode + argmax in one call, the id back instead of the logits)
    picks the ids numpy's argmax of decode's logits picks, and the reference's; an engine over a library
    without it (GPU targets, older bundles) takes that argmax itself, with the same ids."""
    from pipeline.models.llama import GREEDY_ENTRY
    from pipeline.runtime import engine as engine_module

    assert engine_module.GREEDY_ENTRY == GREEDY_ENTRY
    folder, model = tiny_hf_model(tmp_path_factory.mktemp("greedy"), "qwen3")
    engine = Bundle(build_bundle(folder, "host-cpu", "q0f32")).engine()
    assert engine.vm.module.implements_function(GREEDY_ENTRY)
    ids = np.random.default_rng(2).integers(0, 512, PROMPT_LEN)
    _, plain = run_engine_greedy(engine, ids, DECODE_STEPS)

    def greedy_run() -> list[int]:
        engine.reset()
        tokens = [int(np.argmax(engine.prefill(list(ids))))]
        while len(tokens) < DECODE_STEPS:
            tokens.append(engine.decode_greedy(tokens[-1]))
        assert engine.length == PROMPT_LEN + DECODE_STEPS - 1
        return tokens

    assert greedy_run() == plain == reference_greedy(model, ids, DECODE_STEPS)[1]
    engine._has_greedy = False        # what a library without the entry point gets
    assert greedy_run() == plain


def test_greedy_entry_only_on_cpu_targets():
    """GPU libraries keep MLC's entry points only: their argmax would need a device schedule."""
    import tvm

    from pipeline.models.llama import has_greedy_entry

    assert has_greedy_entry(tvm.target.Target({"kind": "llvm"}))
    assert not has_greedy_entry(tvm.target.Target({"kind": "opencl"}))
    assert not has_greedy_entry(tvm.target.Target({"kind": "metal"}))


CHAT_PROMPTS = ("Explain why the sky is blue in a short paragraph.", "Write a short poem about the sea.",
                "What are three tips for staying healthy?", "Describe how a bicycle works.",
                "Give me a recipe for pancakes.", "What is the difference between a virus and a bacterium?")


def test_default_model_q4f16(build_bundle, smollm2_reference):
    """q4f16 logits vs the same network on the bundle's own dequantized weights (≤ 8e-2: measured 0.053 of a
    logit scale of 40 with the default fp16 KV cache, 0.0145 with `kv_cache: float32`; measured with a fresh
    cache per prompt, the two give the same top-1 agreement and KL below to 1e-4), and agreement with fp32.

    Teacher-forced on the fp32 model's own greedy answers to 6 chat prompts, 64 positions each. Measured,
    compiled: same top-1 69% over the 384 positions (per prompt 64–73%), mean KL 0.29 with calibrated
    quantization (the default: calibrate.py + gptq.py); round-to-nearest with the scale search gives 69.5% /
    0.40 and MLC's fixed max|w|/7 scales 66% / 0.51. One prompt alone swings by ±8 points, hence 6.
    Issue #2's 90% same-top-1 is not reached: llama.cpp's Q4_0 scores 76–78% on this model, and
    it keeps the tied embedding at Q8_0; q4 in the 30 decoder layers alone (lm_head float) costs 75% here.
    The KL bound catches a return to uncalibrated rounding.
    """
    bundle = Bundle(build_bundle("smollm2-135m", "host-cpu", "q4f16"))
    engine = bundle.engine()
    deq = bundle_reference(smollm2_reference, bundle.path)
    agree, kl = [], []
    for i, text in enumerate(CHAT_PROMPTS):
        prompt = chat_ids(bundle, text)
        with torch.no_grad():
            gen = smollm2_reference.generate(torch.tensor([prompt]), max_new_tokens=72, do_sample=False,
                                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        ids = gen[0].tolist()
        ours = engine.prefill(ids, all_logits=True)
        with torch.no_grad():
            ref_f = smollm2_reference(torch.tensor([ids])).logits[0].numpy()
            if i == 0:
                ref_q = deq(torch.tensor([ids])).logits[0].numpy()
                diff = float(np.abs(ours - ref_q).max())
                assert diff <= 8e-2, f"q4f16 vs dequantized reference: max |Δ| {diff:.3g}"
        answer = slice(len(prompt) - 1, len(prompt) - 1 + 64)
        agree.append(float(np.mean(ours[answer].argmax(-1) == ref_f[answer].argmax(-1))))
        lp = torch.log_softmax(torch.from_numpy(ref_f[answer]).double(), -1)
        lq = torch.log_softmax(torch.from_numpy(np.asarray(ours[answer], np.float64)), -1)
        kl.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
    print(f"q4f16 vs fp32 over {64 * len(agree)} positions: same top-1 {np.mean(agree):.1%} "
          f"(per prompt {', '.join(f'{a:.0%}' for a in agree)}), mean KL {np.mean(kl):.3f}")
    assert np.mean(agree) >= 0.66, f"top-1 agreement with fp32 {np.mean(agree):.1%}"
    assert np.mean(kl) <= 0.33, f"mean KL to fp32 {np.mean(kl):.3f}"
