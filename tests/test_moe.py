"""Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE): compiled host-cpu libraries vs transformers.

Tiny configs made here, random init widened so routing is decisive; transformers fp32 is the reference.
q0f32: prefill 48 tokens + 24 greedy decode steps, max |Δlogit| ≤ 1e-3 × max |reference logit|, tokens
identical. The gather kernels alone are checked against a float64 NumPy MoE (routing indices exact) for
float, q4 and q8 expert weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_qwen3_5 import ACTIVE, assert_close, chain, ours, reference, word_tokenizer

from pipeline.models.moe_kernels import moe_down, moe_gate_up, moe_reference, moe_route
from pipeline.quant.quantize import dequantize_q4, dequantize_q8, quantize_q4, quantize_q8
from pipeline.runtime.runner import Bundle

VOCAB = 256
PROMPT_LEN = 48
DECODE_STEPS = 24


def widen(model, norm_std: float = 0.0):
    """Scale 2-d and stacked expert weights by 3 (the tiny init gives near-flat logits and router
    probabilities); `norm_std`: give zero-centred norms non-trivial weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
            elif norm_std and name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0.0, norm_std)
    return model


def tiny_qwen3_moe(seed: int = 0, **extra):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    sizes = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)
    cfg = Qwen3MoeConfig(**{**sizes, **extra})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():   # transformers leaves the stacked experts uninitialised (torch.empty)
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.02)
    return widen(model)


def tiny_qwen35_moe(seed: int = 0):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.02)
    return widen(model, norm_std=0.3)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    model = tiny_qwen3_moe()
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def test_qwen3_moe_q0f32_matches_transformers(qwen3_moe, build_bundle):
    folder, model = qwen3_moe
    bundle = build_bundle(folder, "host-cpu", "q0f32")
    engine = Bundle(bundle).engine()
    ids = np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN)
    got_prefill, got_decode, got_tokens = ours(engine, ids, DECODE_STEPS)
    ref_prefill, ref_decode, ref_tokens = reference(model, ids, DECODE_STEPS)
    assert_close(got_prefill, ref_prefill, "prefill logits")
    assert_close(got_decode, ref_decode, "decode logits")
    assert got_tokens == ref_tokens
    # the coverage report counts what a decode step reads: the 2 chosen experts' rows of 8, per layer
    kernels = {k["name"]: k for k in json.loads((bundle / "reports" / "coverage.json").read_text())["kernels"]}
    gate_up, down = kernels["moe_gate_up"], kernels["moe_down"]
    assert gate_up["op_class"] == down["op_class"] == "moe-gemv"
    expert_bytes = 4 * 3 * 32 * 64   # fp32 gate, up and down of one expert (I = 32, H = 64)
    step = gate_up["decode_step"]["bytes_per_call"] + down["decode_step"]["bytes_per_call"]
    assert 2 * expert_bytes <= step < 3 * expert_bytes and gate_up["decode_step"]["calls"] == 2
    # prefill ran grouped by expert (moe_grouped): the prefill logits above checked it; decode never calls it
    for name in ("moe_sort", "moe_grouped_gate_up", "moe_grouped_down"):
        assert kernels[name]["prefill_chunk"]["calls"] == 2 and not kernels[name]["decode_step"]["calls"], name
    assert not gate_up["prefill_chunk"]["calls"]


@pytest.mark.slow
def test_qwen35_moe_q0f32_matches_transformers(tmp_path, build_bundle):
    """The hybrid (GDN x3 + gated attention) with routed experts + the sigmoid-gated shared expert (slow: ~45 s,
    most of it compiling the hybrid's entry points; the MoE kernels are the ones the default suite checks)."""
    model = tiny_qwen35_moe()
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = Bundle(build_bundle(tmp_path, "host-cpu", "q0f32")).engine()
    assert engine.meta["model_config"]["family"] == "qwen3_5_moe"
    ids = np.random.default_rng(2).integers(0, VOCAB, PROMPT_LEN)
    got_prefill, got_decode, got_tokens = ours(engine, ids, DECODE_STEPS)
    ref_prefill, ref_decode, ref_tokens = reference(model, ids, DECODE_STEPS)
    assert_close(got_prefill, ref_prefill, "prefill logits")
    assert_close(got_decode, ref_decode, "decode logits")
    assert got_tokens == ref_tokens


@pytest.fixture(scope="module")
def trained_qwen3_moe():
    """A Qwen3-MoE (2 layers, 8 experts top-2) trained for 100 AdamW steps on test_qwen3_5's synthetic language
    (random weights give near-flat logits, where the top-1 is noise); (model, the language's permutation)."""
    model = tiny_qwen3_moe(vocab_size=512).train()
    rng, perm = np.random.default_rng(0), np.random.default_rng(1).permutation(ACTIVE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(100):
        x = torch.from_numpy(chain(rng, 16, 32, perm))
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert float(loss) < 1.5, f"the toy did not learn its language (loss {float(loss):.2f})"
    return model, perm


@pytest.mark.slow
def test_qwen3_moe_q4f16_top1_agreement(trained_qwen3_moe, tmp_path, build_bundle):
    """q4f16 (q4 experts, dequantized inside the gather kernels) vs transformers fp32 on the trained toy: top-1
    agreement >= 90% over teacher-forced positions."""
    model, perm = trained_qwen3_moe
    model.save_pretrained(tmp_path, safe_serialization=True)
    word_tokenizer().save_pretrained(tmp_path)
    ids = chain(np.random.default_rng(7), 1, 128, perm)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    got = Bundle(build_bundle(tmp_path, "host-cpu", "q4f16")).engine().prefill(list(ids), all_logits=True)
    agreement = float((got.argmax(-1) == ref.argmax(-1)).mean())
    assert agreement >= 0.90, f"q4f16 top-1 agreement {agreement:.1%} < 90% over {len(ids)} positions"


def _rounded(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """`w` (2-d, or stacked [E, rows, K]) rounded as the build stores it, row by row along K, dequantized."""
    from pipeline.quant.ternary import dequantize_ternary, quantize_ternary

    a = w.detach().numpy().astype(np.float32).reshape(-1, w.shape[-1])
    deq = {"q4": lambda: dequantize_q4(*quantize_q4(a)), "q8": lambda: dequantize_q8(*quantize_q8(a)),
           "t3": lambda: dequantize_ternary(*quantize_ternary(a, "t3"), "t3", a.shape[1]),
           "b1": lambda: dequantize_ternary(*quantize_ternary(a, "b1"), "b1", a.shape[1])}[fmt]()
    return torch.from_numpy(np.asarray(deq, np.float32).reshape(w.shape))


@pytest.mark.slow
def test_routed_experts_tolerate_lower_bits(trained_qwen3_moe):
    """What QUANT=auto's MoE rules rest on (docs/moe.md), measured on the trained toy (8 experts, top-2): only the
    routed experts rounded (attention float) vs only the attention matrices, KL(fp32 || rounded) and top-1 over 4 x
    128 teacher-forced positions.
    * q4 experts keep top-1 >= 90%; post-training ternary (t3) and binary (b1) experts are far worse (the plan takes
      them below q4 only when nothing else fits, and prints these top-1 numbers: auto_plan.TOY_EXPERT_TOP1);
    * the plan weighs the experts by their active parameters (k of E): its predicted KL ratio experts / attention,
      eps x W with W from auto_plan.role_weights, is nearer the measured ratio than weighing by stored parameters
      (E/k = 4x more) would be."""
    from pipeline.quant.auto_plan import TOY_EXPERT_TOP1, role_weights

    model, perm = trained_qwen3_moe
    ids = torch.from_numpy(chain(np.random.default_rng(7), 4, 128, perm))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    roles = {"experts": lambda n: ".mlp.experts." in n,
             "attention": lambda n: ".self_attn." in n and n.endswith("_proj.weight")}
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits.float(), -1)

    def measure(role: str, fmt: str) -> tuple[float, float, float]:
        """(KL, top-1 agreement, relative weight error) with only `role` rounded to `fmt`."""
        chosen = {k: _rounded(v, fmt) for k, v in state.items() if roles[role](k)}
        try:
            model.load_state_dict({**state, **chosen})
            with torch.no_grad():
                got = torch.log_softmax(model(ids).logits.float(), -1)
        finally:
            model.load_state_dict(state)
        kl = float((ref.exp() * (ref - got)).sum(-1).mean())
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        eps = sum(float(((chosen[k] - state[k]) ** 2).sum()) for k in chosen) / \
            sum(float((state[k] ** 2).sum()) for k in chosen)
        return kl, top1, eps

    got = {(r, f): measure(r, f) for r in roles for f in ("q8", "q4", "t3", "b1")}
    table = ", ".join(f"{r} {f}: KL {kl:.2e} top-1 {t:.1%}" for (r, f), (kl, t, _) in got.items())
    print("\n" + table.replace(", ", "\n"))
    (kl_q4, top1_q4, eps_e), (kl_t3, top1_t3, _) = got["experts", "q4"], got["experts", "t3"]
    assert top1_q4 >= 0.90, table
    assert top1_t3 < top1_q4 and kl_t3 > 10 * kl_q4, table
    # the numbers QUANT=auto prints when it takes the experts below q4 (measured: the training is seeded)
    for fmt, top1 in TOY_EXPERT_TOP1.items():
        assert abs(got["experts", fmt][1] - top1) < 0.005, (fmt, table)
    w = role_weights(model.config.to_dict())
    kl_attn, _, eps_a = got["attention", "q4"]
    planned = eps_e * w["experts"] / (eps_a * (w["qkv_proj"] + w["o_proj"]))
    measured = kl_q4 / kl_attn
    stored = planned * 8 / 2
    assert abs(np.log(measured / planned)) < abs(np.log(measured / stored)), (
        f"measured KL ratio experts/attention {measured:.3g}, active-weighted prediction {planned:.3g}, "
        f"stored-weighted {stored:.3g}; {table}")


def _run(func, inputs, outputs, target="llvm"):
    import tvm

    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in inputs]
    outs = [tvm.runtime.tensor(np.zeros(shape, dtype), dev) for shape, dtype in outputs]
    lib["main"](*args, *outs)
    return [o.numpy() for o in outs]


def _stored(fmt: str, w: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """A stacked expert weight [E, rows, K] as the build stores it (each expert's rows quantized like a dense
    layer's: quantize.py / ternary.py, NK) -> (the kernel's weight arguments, the dequantized weight, fp32)."""
    from pipeline.quant.ternary import dequantize_ternary, quantize_ternary

    if fmt == "float":
        return [w], w
    rows = w.reshape(-1, w.shape[-1])
    if fmt in ("q4", "q8"):
        quant, dequant = (quantize_q4, dequantize_q4) if fmt == "q4" else (quantize_q8, dequantize_q8)
        codes, scales = quant(rows)
        deq = dequant(codes, scales)
    else:
        codes, scales = quantize_ternary(rows, fmt)
        deq = dequantize_ternary(codes, scales, fmt, w.shape[-1])
    args = [a.reshape(*w.shape[:2], -1) for a in (codes, scales)]
    return args, np.asarray(deq, np.float32).reshape(w.shape)


SLOW = pytest.mark.slow
# t3 (base-3 bytes, padded words) in the default suite; t2 / b1 read words the same way: slow (~2.5 s each)
SIGN_FORMATS = [pytest.param("t2", marks=SLOW), "t3", pytest.param("b1", marks=SLOW)]


@pytest.mark.parametrize("fmt", ["float", "q4", "q8", *SIGN_FORMATS])
def test_gather_kernels_match_numpy(fmt):
    """Router (softmax, top-2, renormalised or not) and the two gather GEMVs vs a float64 NumPy MoE whose
    experts are the kernels' dequantized weights (ternary / binary: quant/ternary.dequantize_ternary of the
    dense layers' packing): indices exact, outputs within fp32 rounding. K = 64 / 32 is shorter than one
    sign group of 128 and (t3) not a multiple of 20: the short group and the padded word are read."""
    E, inter, hidden, k, n = 8, 32, 64, 2, 5
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    router = rng.standard_normal((E, hidden)).astype(np.float32)
    gu_args, gate_up = _stored(fmt, (rng.standard_normal((E, 2 * inter, hidden)) * 0.2).astype(np.float32))
    down_args, down = _stored(fmt, (rng.standard_normal((E, hidden, inter)) * 0.2).astype(np.float32))
    for norm in (True, False):
        want, want_idx = moe_reference(x, router, gate_up, down, k, norm)
        idx, weight = _run(moe_route(E, k, norm), [x @ router.T], [((n, k), "int32"), ((n, k), "float32")])
        np.testing.assert_array_equal(idx, want_idx)
        act, = _run(moe_gate_up(E, inter, hidden, k, "float32", fmt), [x, idx, *gu_args], [((n, k, inter), "float32")])
        y, = _run(moe_down(E, hidden, inter, k, "float32", fmt), [act, idx, weight, *down_args],
                  [((n, hidden), "float32")])
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), (fmt, norm)


@pytest.mark.parametrize("fmt", ["float", "q4", "q8", "t2", "t3", "b1"])
def test_vector_dots_cover_whole_groups_and_padded_words(fmt):
    """The CPU gather kernels' vectorised dots (kernels/cpu/expert_rows.py) at K long enough for whole scale
    groups and, for the sign packings, K not a multiple of a word's codes (K = 328 / 168: t2 / b1 whole groups,
    a short group, the scalar tail; t3 words inside a group and words that straddle two): both projections
    against NumPy on the dequantized weights, within 1e-5 of the output scale."""
    E, k, n = 3, 2, 2
    H, M = (328, 168) if fmt in ("t2", "t3", "b1") else (320, 160)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, H)).astype(np.float32)
    gu_args, gate_up = _stored(fmt, (rng.standard_normal((E, 2 * M, H)) * 0.1).astype(np.float32))
    dn_args, down = _stored(fmt, (rng.standard_normal((E, H, M)) * 0.1).astype(np.float32))
    idx = np.array([[2, 0], [1, 2]], np.int32)
    w = np.array([[0.7, 0.3], [0.4, 0.6]], np.float32)
    act, = _run(moe_gate_up(E, M, H, k, "float32", fmt), [x, idx, *gu_args], [((n, k, M), "float32")])
    g = np.einsum("th,tjmh->tjm", x.astype(np.float64), gate_up[idx, :M])
    u = np.einsum("th,tjmh->tjm", x.astype(np.float64), gate_up[idx, M:])
    want_act = g / (1 + np.exp(-g)) * u
    assert np.abs(act - want_act).max() <= 1e-5 * np.abs(want_act).max(), fmt
    y, = _run(moe_down(E, H, M, k, "float32", fmt), [act, idx, w, *dn_args], [((n, H), "float32")])
    want_y = np.einsum("tj,tjm,tjhm->th", w.astype(np.float64), act.astype(np.float64), down[idx])
    assert np.abs(y - want_y).max() <= 1e-5 * np.abs(want_y).max(), fmt


@pytest.mark.parametrize("shape", [(320, 192), (320, 160)])
def test_avx2_int16_expert_dot_matches_numpy(shape):
    """The host's AVX2 expert dot (kernels/cpu/expert_x86.py: q4 codes against x quantized per group of 32 to
    int16, `pmaddwd`) against NumPy on the dequantized weights, within 2e-4 of the output scale (x's int16
    steps: ~1.5e-5 of a group's largest |x| per element); K = 160 is no multiple of its 64-weight step, so
    that down projection keeps the fp32 dot (within 1e-5)."""

    from pipeline.config import load_target
    from pipeline.kernels.cpu.probe import has_avx2

    host = load_target("host-cpu").tvm()
    if not has_avx2(host):
        pytest.skip(f"host-cpu here has no AVX2 ({host}): the int16 expert dot is x86-only")
    E, k, n = 3, 2, 2
    H, M = shape
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, H)).astype(np.float32)
    x[1, :32] = 0.0     # a group of zeros: a zero step
    gu_args, gate_up = _stored("q4", (rng.standard_normal((E, 2 * M, H)) * 0.1).astype(np.float32))
    dn_args, down = _stored("q4", (rng.standard_normal((E, H, M)) * 0.1).astype(np.float32))
    idx = np.array([[2, 0], [1, 2]], np.int32)
    w = np.array([[0.7, 0.3], [0.4, 0.6]], np.float32)
    act, = _run(moe_gate_up(E, M, H, k, "float32", "q4", expert_dot="avx2"), [x, idx, *gu_args],
                [((n, k, M), "float32")], host)
    g = np.einsum("th,tjmh->tjm", x.astype(np.float64), gate_up[idx, :M])
    u = np.einsum("th,tjmh->tjm", x.astype(np.float64), gate_up[idx, M:])
    want_act = g / (1 + np.exp(-g)) * u
    assert np.abs(act - want_act).max() <= 2e-4 * np.abs(want_act).max()
    y, = _run(moe_down(E, H, M, k, "float32", "q4", expert_dot="avx2"), [act, idx, w, *dn_args], [((n, H), "float32")],
              host)
    want_y = np.einsum("tj,tjm,tjhm->th", w.astype(np.float64), act.astype(np.float64), down[idx])
    assert np.abs(y - want_y).max() <= (2e-4 if M % 64 == 0 else 1e-5) * np.abs(want_y).max()


@pytest.mark.parametrize("fmt", ["float", "q4", "q8", *SIGN_FORMATS])
def test_grouped_kernels_match_the_gather_kernels(fmt):
    """Prefill grouped by expert (moe_grouped: counting sort, one pass per expert row over its tokens) gives the
    gather kernels' numbers: the sort lists every slot once, ascending within each expert; the per-slot outputs
    and their routing-weighted sum equal moe_gate_up / moe_down (same fp32 dot order: exact up to 1e-6)."""
    from pipeline.models.moe_grouped import moe_grouped_down, moe_grouped_gate_up, moe_sort

    E, K, H, M, n = 8, 2, 64, 32, 37
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, H)).astype("float32")
    logits = rng.standard_normal((n, E)).astype("float32")
    logits[:, 5] -= 10.0   # an expert no token picks: an empty group
    gu = (rng.standard_normal((E, 2 * M, H)) * 0.1).astype("float32")
    dn = (rng.standard_normal((E, H, M)) * 0.1).astype("float32")
    idx, w = _run(moe_route(E, K, True), [logits], [((n, K), "int32"), ((n, K), "float32")])
    offsets, order = _run(moe_sort(E, K), [idx], [((E + 1,), "int32"), ((n * K,), "int32")])
    flat = idx.reshape(-1)
    assert offsets[5] == offsets[6] and offsets[-1] == n * K
    for e in range(E):
        np.testing.assert_array_equal(order[offsets[e]:offsets[e + 1]], np.flatnonzero(flat == e))
    (gu_args, _), (dn_args, _) = _stored(fmt, gu), _stored(fmt, dn)
    h_ref, = _run(moe_gate_up(E, M, H, K, "float32", fmt, scale_dtype="float16"), [x, idx, *gu_args],
                  [((n, K, M), "float32")])
    h, = _run(moe_grouped_gate_up(E, M, H, K, "float32", fmt, scale_dtype="float16"), [x, offsets, order, *gu_args],
              [((n, K, M), "float32")])
    np.testing.assert_array_equal(h, h_ref)   # one dot macro (kernels/cpu/expert_rows.py): the same numbers
    y_ref, = _run(moe_down(E, H, M, K, "float32", fmt, scale_dtype="float16"), [h_ref, idx, w, *dn_args],
                  [((n, H), "float32")])
    per_slot, = _run(moe_grouped_down(E, H, M, K, "float32", fmt, scale_dtype="float16"),
                     [h, offsets, order, *dn_args], [((n, K, H), "float32")])
    y = (per_slot * w[..., None]).sum(1)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-6 * np.abs(y_ref).max())


def test_sparse_layers_follow_transformers():
    """mlp_only_layers and decoder_sparse_step pick the same MoE layers as transformers' Qwen3-MoE."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from pipeline.models.llama import DecoderConfig

    for extra in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [0, 3]}, {"decoder_sparse_step": 3,
                                                                            "mlp_only_layers": [5]}):
        model = tiny_qwen3_moe(num_hidden_layers=6, **extra)
        cfg = DecoderConfig.from_hf(model.config.to_dict())
        want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers]
        assert [cfg.sparse(i) for i in range(6)] == want and any(want) and not all(want), extra


def test_stacked_checkpoint_converts_like_per_expert(qwen3_moe, tmp_path, quant="q4f16_1"):
    """transformers 5 keeps experts stacked in memory ([E, 2I, H], [E, H, I]) and saves them per expert; a
    checkpoint in either spelling gives the same bundle tensors, and q4 experts are each expert's rows
    quantized like any linear weight."""
    from safetensors.torch import save_file

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.frontend.checkpoint import open_checkpoint
    from pipeline.quant.convert import iter_converted
    from pipeline.stages import define, load

    folder, model = qwen3_moe
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load(load_model(str(folder)))
    defined = define(loaded, load_quant(quant), load_target("host-cpu"))   # the same config: the same parameters
    per_expert, stacked = (dict(iter_converted(ckpt, defined.params, defined.layout, block_bytes=700))
                           for ckpt in (loaded.checkpoint, open_checkpoint(tmp_path)))
    assert per_expert.keys() == stacked.keys()
    for name in per_expert:
        np.testing.assert_array_equal(per_expert[name], stacked[name], err_msg=name)
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"].numpy()
    codes, scales = quantize_q4(gate_up[5], "NK")
    np.testing.assert_array_equal(per_expert["model.layers.1.mlp.experts.gate_up_proj.q_weight"][5], codes)
    np.testing.assert_array_equal(per_expert["model.layers.1.mlp.experts.gate_up_proj.q_scale"][5], scales)
    router = state["model.layers.1.mlp.gate.weight"].numpy().astype(np.float16)   # float, the scheme's dtype
    np.testing.assert_array_equal(per_expert["model.layers.1.mlp.gate.weight"], router)


@pytest.mark.parametrize("fmt", ["t2", "t3"])
def test_ternary_experts_convert_like_dense_rows(qwen3_moe, fmt):
    """Stacked experts in a sign packing (models/moe.StackedExperts under a ternary_ptq-like factory): each
    expert's rows ternarised and packed exactly as quant/ternary.quantize_ternary packs a dense weight
    ([E, rows, ceil(K / 16 or 20)] uint32 codes, [E, rows, ceil(K / 128)] fp16 scales); the conversion
    statistics count their weight error."""
    from pipeline.frontend.checkpoint import open_checkpoint
    from pipeline.models.layers import LayerFactory
    from pipeline.models.moe import ExpertsPair
    from pipeline.quant.convert import iter_converted
    from pipeline.quant.ternary import quantize_ternary

    folder, model = qwen3_moe
    pair = ExpertsPair(8, 64, 32, LayerFactory("float32", fmt, "float16", ternary_source="ptq"))
    prefix = "model.layers.0.mlp.experts."
    params = [(prefix + n, p) for n, p in pair.named_parameters()]
    stats: dict[str, float] = {}
    got = dict(iter_converted(open_checkpoint(folder), params, "NK", block_bytes=700, stats=stats))
    state = model.state_dict()
    per_word = {"t2": 16, "t3": 20}[fmt]
    for proj, k in (("gate_up_proj", 64), ("down_proj", 32)):
        w = state[prefix + proj].numpy()
        codes, scales = got[f"{prefix}{proj}.q_weight"], got[f"{prefix}{proj}.q_scale"]
        assert codes.shape == (8, w.shape[1], -(-k // per_word)) and codes.dtype == np.uint32
        assert scales.shape == (8, w.shape[1], 1) and scales.dtype == np.float16
        for e in range(8):
            want_codes, want_scales = quantize_ternary(w[e], fmt)
            np.testing.assert_array_equal(codes[e], want_codes)
            np.testing.assert_array_equal(scales[e], want_scales)
    assert stats["groups"] == 8 * (64 + 64) and stats["err2"] > 0


TERNARY_EXPERTS = ("name: ternary_ptq_t3_experts\nweight_format: t2\nweight_dtype: float16\nlayout: target\n"
                   "ternary_source: ptq\nformats: {embed_tokens: q8, lm_head: q8, experts: t3}\n")


def as_stored(model, expert_fmt: str = "t3", dense_fmt: str = "t2"):
    """A copy of the torch model holding the values the ternary scheme above stores: stacked experts and the
    attention linears ternarised row by row (quant/ternary.py, what the dense layers store), the embedding /
    lm_head q8, the router and the norms rounded to fp16 (weight_dtype) — the reference for a ternary build
    (vs the fp32 model a post-training ternary model is poor by design)."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            w = p.detach().numpy().astype(np.float32)
            if ".experts." in name:
                got = _stored(expert_fmt, w)[1]
            elif "embed_tokens" in name or name.startswith("lm_head"):
                got = dequantize_q8(*quantize_q8(w, "NK"), "NK")
            elif p.dim() == 2 and "mlp.gate." not in name:
                got = _stored(dense_fmt, w[None])[1][0]
            else:
                got = w.astype(np.float16).astype(np.float32)
            p.copy_(torch.from_numpy(np.asarray(got, np.float32).reshape(w.shape)))
    return ref


@pytest.mark.slow
def test_qwen3_moe_ternary_experts_end_to_end(qwen3_moe, build_bundle, tmp_path_factory):
    """A tiny Qwen3-MoE built for host-cpu with post-training t3 experts (t2 attention, q8 vocab tables): the
    compiled library's prefill logits and 16 greedy decode steps vs transformers fp32 on the same stored values
    (as_stored), within 2e-3 x the logit scale (fp16 KV cache; measured 4.8e-4, against 0.64 vs the fp32 model),
    tokens identical; the coverage report's decode step reads the 2 chosen experts' t3 rows (slow: ~60 s)."""
    folder, model = qwen3_moe
    scheme = tmp_path_factory.mktemp("scheme") / "ternary_ptq_t3_experts.yaml"
    scheme.write_text(TERNARY_EXPERTS)
    bundle = build_bundle(folder, "host-cpu", str(scheme))
    ids = np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN)
    got_prefill, got_decode, got_tokens = ours(Bundle(bundle).engine(), ids, 16)
    ref_prefill, ref_decode, ref_tokens = reference(as_stored(model), ids, 16)
    assert_close(got_prefill, ref_prefill, "prefill logits", rel=2e-3)
    assert_close(got_decode, ref_decode, "decode logits", rel=2e-3)
    assert got_tokens == ref_tokens
    kernels = {k["name"]: k for k in json.loads((bundle / "reports" / "coverage.json").read_text())["kernels"]}
    # one expert's t3 rows (I = 32, H = 64): gate_up 64 rows of K = 64 -> 4 words + 1 fp16 scale = 18 B,
    # down 64 rows of K = 32 -> 2 words + 1 scale = 10 B; fp32 activations: gate_up reads x [1, 64], idx [1, 2]
    # and writes h [1, 2, 32] (520 B), down h, idx, weight [1, 2] and y [1, 64] (528 B)
    expert = 64 * 18 + 64 * 10
    step = sum(kernels[n]["decode_step"]["bytes_per_call"] for n in ("moe_gate_up", "moe_down"))
    assert step == 2 * expert + 520 + 528
    assert kernels["moe_gate_up"]["decode_step"]["flops_per_call"] == 2 * 2 * 64 * 64   # 2 experts x 64 rows x K


@pytest.mark.slow
@pytest.mark.parametrize("target", ["android-cpu", "android-adreno", "android-hexagon"])
def test_phone_targets_compile_ternary_experts(qwen3_moe, build_bundle, tmp_path_factory, target):
    """The tiny Qwen3-MoE with t3 experts builds for the phones (~1 min each): aarch64 objects, the MoE gather
    kernels (decode) and the grouped ones (prefill) in the library — on Adreno in the OpenCL source, thread-bound by
    the model (rule `library`); on the CPU targets as compiled loop TIR (`cpu-default`; Hexagon keeps them on the aarch64 CPU: no HVX moe-gemv)."""
    from test_ternary import _aarch64_objects

    folder, _ = qwen3_moe
    scheme = tmp_path_factory.mktemp("scheme") / "ternary_ptq_t3_experts.yaml"
    scheme.write_text(TERNARY_EXPERTS)
    bundle = build_bundle(folder, target, str(scheme))
    objs = _aarch64_objects(bundle)
    assert objs and all(o[:4] == b"\x7fELF" and int.from_bytes(o[18:20], "little") == 183 for o in objs)
    rules = {k["name"]: k["rule"] for k in json.loads((bundle / "reports" / "kernels.json").read_text())["kernels"]}
    assert {"moe_gate_up", "moe_down"} <= rules.keys(), sorted(rules)
    assert {"moe_sort", "moe_grouped_gate_up", "moe_grouped_down"} <= rules.keys()   # prefill grouped by expert
    if target == "android-adreno":
        grouped = ("moe_gate_up", "moe_down", "moe_sort", "moe_grouped_gate_up", "moe_grouped_down")
        assert {rules[n] for n in grouped} == {"library"}, rules
        assert any(b"moe_grouped_gate_up" in o and b"__kernel" in o for o in objs)
    else:
        assert rules["moe_gate_up"] == rules["moe_down"] == "cpu-default"


def test_real_35b_config_reads():
    """Qwen3.5-35B-A3B's shipped config: an all-MoE hybrid with no dense intermediate_size (QUANT=auto on it:
    test_auto_quant.py)."""
    from pipeline.config import load_model
    from pipeline.models import config_from_hf

    hf = load_model("qwen3.5-35b-a3b").hf_config
    cfg = config_from_hf(hf)
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size, len(cfg.full_layers)) == ("qwen3_5_moe", 256, 8, 512, 512, 10)


@pytest.mark.parametrize("fmt", ["float", "q4", pytest.param("t2", marks=SLOW), "t3"])
def test_gpu_kernels_on_pocl(fmt):
    """The thread-bound (GPU) variants, compiled to OpenCL C for Adreno and run on PoCL (fp32: PoCL has no
    fp16), give the CPU variants' routing and outputs: what an Adreno build ships (not run at build time).
    The output is also checked against NumPy (float64) on the dequantized weights and PoCL's routing."""
    from pipeline.verify.opencl import find_opencl_device, run_on_pocl
    from pipeline.verify.opencl_plan import opencl_kernels

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)")
    E, inter, hidden, k, n = 8, 32, 64, 2, 5
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    logits = rng.standard_normal((n, E)).astype(np.float32)
    gate_up = (rng.standard_normal((E, 2 * inter, hidden)) * 0.2).astype(np.float32)
    down = (rng.standard_normal((E, hidden, inter)) * 0.2).astype(np.float32)
    # fp32 scales (the fp16 ones' values): PoCL has no fp16
    (gu_args, gu_deq), (down_args, down_deq) = (_stored(fmt, w) for w in (gate_up, down))
    gu_args, down_args = ([a.astype(np.float32) if a.dtype == np.float16 else a for a in args]
                          for args in (gu_args, down_args))
    kw = dict(scale_dtype="float32")

    def both(make, inputs, outputs):
        gpu_args = [*inputs, *[np.zeros(s, d) for s, d in outputs]]
        run_on_pocl(opencl_kernels(make(gpu=True, max_threads=32)), "main", gpu_args)
        return gpu_args[len(inputs):], _run(make(gpu=False), inputs, outputs)

    (idx, weight), cpu = both(lambda **g: moe_route(E, k, True, **g), [logits], [((n, k), "int32"), ((n, k), "float32")])
    np.testing.assert_array_equal(idx, cpu[0])
    np.testing.assert_allclose(weight, cpu[1], rtol=1e-6)
    (act,), (act_cpu,) = both(lambda **g: moe_gate_up(E, inter, hidden, k, "float32", fmt, **kw, **g),
                              [x, idx, *gu_args], [((n, k, inter), "float32")])
    np.testing.assert_allclose(act, act_cpu, rtol=1e-5, atol=1e-5)
    (y,), (y_cpu,) = both(lambda **g: moe_down(E, hidden, inter, k, "float32", fmt, **kw, **g),
                          [act, idx, weight, *down_args], [((n, hidden), "float32")])
    np.testing.assert_allclose(y, y_cpu, rtol=1e-5, atol=1e-5)
    assert np.abs(y_cpu).max() > 0.1
    want = np.zeros((n, hidden))
    for t, j in np.ndindex(n, k):
        g, u = np.split(gu_deq[idx[t, j]].astype(np.float64) @ x[t], 2)
        want[t] += weight[t, j] * (down_deq[idx[t, j]] @ (g / (1 + np.exp(-g)) * u))
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), fmt


def test_batch_functions_route_each_token(qwen3_moe, build_bundle):
    """MLC's batch_prefill / batch_decode (two sequences in one call) match each sequence alone: every token of
    a batch picks its own experts."""
    import tvm
    from test_engine_functions import _embed, _forward, _kv

    folder, _ = qwen3_moe
    engine = Bundle(build_bundle(folder, "host-cpu", "q0f32")).engine()
    prompts = ([5, 17, 200, 3, 99, 41], [250, 7, 7, 128, 64, 31, 2, 180, 11])
    alone_prefill, alone_next = [], []
    for ids in prompts:
        engine.reset()
        alone_prefill.append(engine.prefill(ids))
        alone_next.append(engine.decode(int(np.argmax(alone_prefill[-1]))))
    kv = _kv(engine, 2)
    emb = _embed(engine, [*prompts[0], *prompts[1]])
    emb = emb._create_view((1, emb.shape[0], emb.shape[1]))
    ends = tvm.runtime.tensor(np.asarray([len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1], "int32"))
    logits, kv = _forward(engine, kv, "batch_prefill", [0, 1], [len(p) for p in prompts], emb, ends)
    for got, want in zip(logits[0], alone_prefill, strict=True):
        assert_close(got, want, "batch_prefill logits")
    emb = _embed(engine, [int(np.argmax(x)) for x in alone_prefill])
    logits, kv = _forward(engine, kv, "batch_decode", [0, 1], [1, 1], emb._create_view((2, 1, emb.shape[1])))
    for got, want in zip(logits[:, 0], alone_next, strict=True):
        assert_close(got, want, "batch_decode logits")


@pytest.mark.parametrize("fmt", ["float", "q4", pytest.param("q8", marks=SLOW), "t3"])
def test_gpu_grouped_prefill_on_pocl(fmt):
    """The GPU prefill grouped by expert (moe_grouped_gpu), as OpenCL C for Adreno on PoCL (fp32 twin): the sort
    is the CPU counting sort's exactly (an expert no token picks included), and the per-slot outputs equal the GPU
    gather kernels' (the same serial fp32 dot, run on the same device: to 1e-6 of the scale)."""
    from pipeline.models.moe_grouped import moe_sort
    from pipeline.models.moe_grouped_gpu import moe_grouped_down_gpu, moe_grouped_gate_up_gpu, moe_sort_gpu
    from pipeline.verify.opencl import find_opencl_device, run_on_pocl
    from pipeline.verify.opencl_plan import opencl_kernels

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)")
    E, M, H, K, n = 8, 32, 64, 2, 23
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, H)).astype(np.float32)
    logits = rng.standard_normal((n, E)).astype(np.float32)
    logits[:, 5] -= 10.0   # an empty group
    (gu_args, _), (dn_args, _) = (_stored(fmt, (rng.standard_normal(s) * 0.2).astype(np.float32))
                                  for s in ((E, 2 * M, H), (E, H, M)))
    gu_args, dn_args = ([a.astype(np.float32) if a.dtype == np.float16 else a for a in args]
                        for args in (gu_args, dn_args))

    def pocl(func, inputs, outputs):
        args = [*inputs, *[np.zeros(s, d) for s, d in outputs]]
        run_on_pocl(opencl_kernels(func), "main", args)
        return args[len(inputs):]

    idx, w = _run(moe_route(E, K, True), [logits], [((n, K), "int32"), ((n, K), "float32")])
    sort_out = [((E + 1,), "int32"), ((n * K,), "int32")]
    offsets, order = pocl(moe_sort_gpu(E, K, max_threads=4).with_attr("global_symbol", "main"), [idx], sort_out)
    for got, want in zip((offsets, order), _run(moe_sort(E, K), [idx], sort_out), strict=True):
        np.testing.assert_array_equal(got, want)
    assert offsets[5] == offsets[6]
    kw = dict(scale_dtype="float32", max_threads=32)
    h, = pocl(moe_grouped_gate_up_gpu(E, M, H, K, "float32", fmt, **kw).with_attr("global_symbol", "main"),
              [x, offsets, order, *gu_args], [((n, K, M), "float32")])
    h_ref, = pocl(moe_gate_up(E, M, H, K, "float32", fmt, gpu=True, **kw).with_attr("global_symbol", "main"),
                  [x, idx, *gu_args], [((n, K, M), "float32")])
    np.testing.assert_allclose(h, h_ref, rtol=0, atol=1e-6 * np.abs(h_ref).max())
    o, = pocl(moe_grouped_down_gpu(E, H, M, K, "float32", fmt, **kw).with_attr("global_symbol", "main"),
              [h, offsets, order, *dn_args], [((n, K, H), "float32")])
    y_ref, = pocl(moe_down(E, H, M, K, "float32", fmt, gpu=True, **kw).with_attr("global_symbol", "main"),
                  [h, idx, w, *dn_args], [((n, H), "float32")])
    np.testing.assert_allclose((o * w[..., None]).sum(1), y_ref, rtol=0, atol=1e-5 * np.abs(y_ref).max())
    if fmt == "q4":
        run = _grouped_clean_under_oclgrind({
            "moe_sort": (moe_sort_gpu(E, K, max_threads=4), [idx, np.zeros_like(offsets), np.zeros_like(order)]),
            "moe_grouped_gate_up": (moe_grouped_gate_up_gpu(E, M, H, K, "float32", fmt, **kw),
                                    [x, offsets, order, *gu_args, np.zeros_like(h)]),
            "moe_grouped_down": (moe_grouped_down_gpu(E, H, M, K, "float32", fmt, **kw),
                                 [h, offsets, order, *dn_args, np.zeros_like(o)])})
        if run is not None:   # Oclgrind ran them: the same results as PoCL
            np.testing.assert_allclose(run.outputs["moe_grouped_down"][-1], o, rtol=0, atol=1e-6 * np.abs(o).max())


def _grouped_clean_under_oclgrind(cases: dict):
    """Each kernel under Oclgrind (skipped in one line without it): no race, out-of-bounds or uninitialised read."""
    import tvm

    from pipeline.verify.oclgrind import oclgrind_library, run_under_oclgrind
    from pipeline.verify.opencl_plan import ADRENO_TARGET

    if oclgrind_library() is None:
        print("Oclgrind not installed (`make system-deps`): the grouped kernels' race / bounds check skipped")
        return None
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, (f, _) in cases.items()})
    run = run_under_oclgrind(mod, ADRENO_TARGET, {n: args for n, (_, args) in cases.items()})
    assert not run.failed and all(run.total(n) == 0 for n in cases), (run.failed, run.reports)
    return run
