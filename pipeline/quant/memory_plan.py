"""Static memory and bandwidth plan for running an LLM on a phone.

Pure arithmetic over a Hugging Face ``config.json`` (read by `pipeline.frontend.hf_config`, like the
model definitions, so the plan counts the model that is built); nothing is loaded or compiled. The plan answers
three questions before a long build is started: how many bytes of weights the bundle carries, how
much RAM a session needs at a given context length, and roughly how fast decode can be on a phone
whose memory bandwidth is known.

Supported configs
-----------------
* Dense decoder-only models of the Llama / Qwen2 / Qwen3 family (``hidden_size``,
  ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
  optional ``head_dim``, ``vocab_size``, ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``).
  Qwen2 always has q/k/v biases; Qwen3 has per-head q/k RMSNorm.
* The Qwen3.5 hybrid (``model_type`` ``qwen3_5`` with a nested ``text_config``, or ``qwen3_5_text``):
  ``layer_types`` mixes ``linear_attention`` (Gated DeltaNet) and ``full_attention`` (gated
  attention: with ``attn_output_gate`` the q projection is doubled). Only the text model is counted
  (no vision tower, no MTP head).
* Mixture-of-experts MLPs (``qwen3_moe``, ``qwen3_5_moe``; `frontend.hf_config.Experts`): per sparse layer a
  router [E, H] (float in the scheme's weight dtype: never quantized, models/moe.py), the E routed experts'
  stacked gate_up [E, 2I, H] and down [E, H, I] (each expert's rows stored like a linear weight: q4 / q8 /
  float, or t2 / t3 / b1 sign codes) and, for qwen3_5_moe, a shared expert (gate_up / down linears) with its [1, H] float
  gate; ``mlp_only_layers`` / ``decoder_sparse_step`` layers keep a dense MLP of ``intermediate_size``.

Model of the numbers
--------------------
Weights
    One entry per tensor group with its parameter count, bytes and precision. ``q0f32`` stores
    every tensor at 4 B, ``q0f16`` at 2 B. ``q4f16`` stores every 2-D matrix whose input (last,
    reduction) dimension is a multiple of 32 as 4-bit codes plus one fp16 scale per 32 weights
    (4.5 bits/weight; the embedding table is a [vocab, hidden] matrix and is quantized too, as in
    MLC's q4f16_1); everything else (norms, biases, the depthwise conv1d) stays fp16, except GDN
    ``A_log`` / ``dt_bias``, which stay fp32. ``q8f16``: int8 codes + an fp16 scale per 32.
    Ternary ``t2f16`` / ``t3f16`` store every 2-D matrix (any K) as ternary codes with one fp16 scale
    per 128 along K: t2 packs 16 two-bit codes per uint32 (``ceil(K/16) x 4 B`` per row), t3 five
    base-3 codes per byte, four bytes per uint32 (``ceil(K/20) x 4 B`` per row; ``pipeline/quant/ternary.py``);
    plus ``ceil(K/128) x 2 B`` of scales per row — 2.125 bits per weight (t2, 128 | K), 1.725 (t3, 20 and
    128 | K).
Weights read per decoded token
    All weight bytes except the embedding table, of which only one row is gathered; when the
    embeddings are tied, the lm_head reads the whole embedding matrix, so it is counted once.
    Mixture-of-experts: of each sparse layer's routed experts only the k = ``num_experts_per_tok``
    chosen ones are read (the gather kernels index the stacked weights; nothing else of them is touched),
    so the routed experts count ``k / E`` of their bytes; the router and the shared expert are read
    whole. This is batch-1 decode with k distinct experts per token (top-k never repeats one); a batch of
    b sequences reads up to ``min(E, b x k)`` experts per layer, which the plan does not model. The
    "active" bytes are what the predicted decode speed below divides by.
KV cache
    ``2 (K and V) x kv_heads x head_dim x bytes(kv_dtype)`` per full-attention layer per token, times
    the context length; ``kv_dtype`` is the scheme's KV-cache precision (fp16 by default; the compute dtype
    when not given). Sliding windows are not modelled.
Recurrent state (hybrids only)
    Gated DeltaNet state, always fp32: ``value_heads x key_head_dim x value_head_dim x 4 B`` per
    linear-attention layer. Conv state in ``compute_dtype`` (it holds the last ``kernel - 1``
    inputs of the causal depthwise conv, which are activations):
    ``conv_dim x (kernel - 1) x bytes`` per layer, ``conv_dim = 2 x key_heads x key_dim +
    value_heads x value_dim``. Both are fixed-size, independent of the context. During decode each
    token reads and writes all of it, so ``2 x state`` is added to the bytes moved per token.
Activations
    Peak of one prefill chunk of ``prefill_chunk`` tokens, in ``compute_dtype``: the residual stream
    and the normed input (``2 x hidden``) stay live while the widest layer intermediate exists,
    the widest being the max of the SwiGLU gate+up outputs (``2 x intermediate``), the attention
    q/k/v projections plus the attention output, the GDN projections (qkv, conv output, z, b, a)
    and ``4 x hidden``. Attention is assumed fused (scores are never materialized over the whole
    context, as in paged / flash attention kernels), so the estimate does not grow with context.
    Hybrids add a GDN chunk workspace (``value_heads x chunk x 64 x 4 B``, the 64-token
    intra-chunk matrices of the chunked delta rule). Logits are computed for the last token only,
    in fp32: ``vocab x 4 B``.
Totals and phone
    ``total(ctx) = weights + KV(ctx) + state + activations``. With a ``phone`` dict
    (``name``, ``ram_gb``, ``app_budget_gb``, ``bandwidth_gbs``) each context gets ``fits``
    (``total <= app_budget_gb x 1e9``; decimal GB, conservative against binary-sized RAM) and a
    *predicted* decode speed ``0.6 x bandwidth / bytes_per_token`` where ``bytes_per_token =
    weights_read_per_token + KV(ctx) + 2 x state``; 0.6 is the share of peak bandwidth phones
    sustain in decode (55-65%). ``roofline_tok_s`` is the same with the full peak bandwidth, an
    upper bound. Both are predictions, not measurements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pipeline.formats import GROUP, SIGN_GROUP, row_bytes
from pipeline.frontend.hf_config import LAYER_KINDS, TextConfig, text_config
from pipeline.quant import ternary

__all__ = ["memory_plan", "plan_markdown", "QUANT_MODES", "DTYPE_BYTES"]

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
QUANT_MODES = ("q0f32", "q0f16", "q4f16", "q8f16", "t2f16", "t3f16", "b1f16")
TERNARY_MODES = {"t2f16": "t2", "t3f16": "t3", "b1f16": "b1"}
# A scheme's per-tensor rules name layer roles; these are the plan's tensor groups each role covers.
ROLE_GROUPS = {
    "embed_tokens": ("embedding",), "lm_head": ("lm_head",), "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_o",),
    # the shared expert's linears are gate_up_proj / down_proj too (models/moe.py), unless `shared_expert` is given
    "gate_up_proj": ("mlp_gate", "mlp_up", "shared_expert_gate_up"), "down_proj": ("mlp_down", "shared_expert_down"),
    "in_proj": ("gdn_in_proj_qkv", "gdn_in_proj_z", "gdn_in_proj_b", "gdn_in_proj_a"),
    "out_proj": ("gdn_out_proj",),
    "experts": ("experts_gate_up", "experts_down"),
    "shared_expert": ("shared_expert_gate_up", "shared_expert_down"),
}
# roles whose format, when given, overrides a general role's for the groups both cover
OVERRIDING_ROLES = ("shared_expert",)
# stored as float in the scheme's weight dtype whatever the scheme (the router decides which experts run)
FLOAT_GROUPS = ("moe_router", "shared_expert_gate")
EXPERT_GROUPS = ("experts_gate_up", "experts_down")
# what each tensor group is, for the per-token read breakdown
PARTS = (("routed experts", EXPERT_GROUPS), ("shared expert", ("shared_expert_gate_up", "shared_expert_down",
                                                                "shared_expert_gate")),
         ("router", ("moe_router",)), ("dense MLP", ("mlp_gate", "mlp_up", "mlp_down", "mlp_bias")),
         ("attention", ("attn_q", "attn_k", "attn_v", "attn_o", "attn_bias", "attn_qk_norm")),
         ("Gated DeltaNet", ("gdn_in_proj_qkv", "gdn_in_proj_z", "gdn_in_proj_b", "gdn_in_proj_a", "gdn_conv1d",
                             "gdn_decay", "gdn_norm", "gdn_out_proj")),
         ("embedding + lm_head", ("embedding", "lm_head")), ("norms", ("norms",)))
SUSTAINED_BANDWIDTH_SHARE = 0.6
GDN_CHUNK = 64
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def plan_config(hf_config: dict) -> TextConfig:
    """The text model's facts (`frontend.hf_config`), refused (ValueError) where the plan cannot count them."""
    t = text_config(hf_config)
    unknown = sorted(set(t.layer_types) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"unsupported layer types {unknown}")
    return t


def q_outputs(t: TextConfig) -> int:
    """q_proj outputs: gated attention doubles them (Qwen3.5 always has the gate)."""
    return t.num_attention_heads * t.head_dim * (2 if t.attn_output_gate else 1)


def _tensor_bytes(shape: tuple[int, ...], quant: str) -> tuple[int, str]:
    """Bytes of one tensor and its precision label under ``quant``."""
    n = math.prod(shape)
    if quant == "q0f32":
        return n * 4, "float32"
    if quant == "q0f16":
        return n * 2, "float16"
    if quant in TERNARY_MODES and len(shape) == 2:
        fmt = TERNARY_MODES[quant]
        kind = "binary" if fmt in ternary.BINARY else "ternary"
        return shape[0] * row_bytes(fmt, shape[1]), f"{kind} {fmt} g{SIGN_GROUP} + fp16 scale"
    if len(shape) == 2 and shape[-1] % GROUP == 0:   # int8 / int4 codes + one fp16 scale per group of 32 along K
        fmt = "q8" if quant == "q8f16" else "q4"
        return shape[0] * row_bytes(fmt, shape[1]), f"{fmt} g{GROUP} + fp16 scale"
    return n * 2, "float16"


def split_rows(rows: int, row_bytes: int, limit: int | None) -> list[int]:
    """Rows per part so that no part of a [rows, ...] tensor exceeds `limit` bytes (a device's largest
    single allocation), as even as possible; [rows] when it fits. models/split.py splits the same way."""
    if not limit or rows * row_bytes <= limit:
        return [rows]
    if row_bytes > limit:
        raise ValueError(f"one row ({row_bytes} bytes) exceeds the max single allocation of {limit} bytes")
    parts = math.ceil(rows / (limit // row_bytes))
    size = math.ceil(rows / parts)
    return [size] * (parts - 1) + [rows - size * (parts - 1)]


def _largest_row_bytes(cols: int, mode: str) -> int:
    """Bytes per row of a tensor's largest stored array (the codes, or the float weight) under `mode`."""
    return {"q0f32": 4 * cols, "q0f16": 2 * cols, "q8f16": cols}.get(mode, cols // 2)


def _splits(t: TextConfig, quant: str, group_modes: dict[str, str] | None, limit: int | None) -> list[dict]:
    """Vocab tables over the largest single allocation and the parts they are stored in."""
    out = []
    for group, shape, _ in tensor_shapes(t):
        if group not in ("embedding", "lm_head"):
            continue
        mode = (group_modes or {}).get(group, quant)
        row = _largest_row_bytes(shape[1], mode)
        rows = split_rows(shape[0], row, limit)
        if len(rows) > 1:
            out.append({"group": group, "parts": len(rows), "rows": rows, "largest_tensor_bytes": shape[0] * row,
                        "max_buffer_bytes": limit,
                        "reason": f"max single allocation {limit} bytes (target capabilities.max_buffer_bytes)"})
    return out


def modes_for_scheme(weight_format: str, weight_dtype: str, formats: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(default mode, {plan group: mode}) of a quantization scheme with per-role formats."""
    def mode(fmt: str) -> str:
        return {"q4": "q4f16", "q8": "q8f16", "t2": "t2f16", "t3": "t3f16", "b1": "b1f16"}.get(
            fmt, "q0f32" if weight_dtype == "float32" else "q0f16")

    ordered = sorted(formats.items(), key=lambda rf: rf[0] in OVERRIDING_ROLES)
    groups = {g: mode(fmt) for role, fmt in ordered for g in ROLE_GROUPS.get(role, ())}
    return mode(weight_format), groups


def tensor_shapes(c: TextConfig) -> list[tuple[str, tuple[int, ...], int]]:
    """(group, shape, count) for every weight tensor of the text model."""
    mt = c.model_type or ""
    hidden, inter, vocab, heads, head_dim = c.hidden_size, c.intermediate_size, c.vocab_size, \
        c.num_attention_heads, c.head_dim
    n_full, n_lin, n_layers, q_out = c.full_attention_layers, c.linear_attention_layers, len(c.layer_types), \
        q_outputs(c)
    kv_out = c.num_key_value_heads * head_dim
    attn_bias = bool(c.attention_bias)
    qkv_bias = attn_bias or mt == "qwen2"

    t: list[tuple[str, tuple[int, ...], int]] = [("embedding", (vocab, hidden), 1)]
    if not c.tie_word_embeddings:
        t.append(("lm_head", (vocab, hidden), 1))
    t.append(("norms", (hidden,), 2 * n_layers + 1))  # input / post-attention per layer + final
    if n_full:
        t += [
            ("attn_q", (q_out, hidden), n_full),
            ("attn_k", (kv_out, hidden), n_full),
            ("attn_v", (kv_out, hidden), n_full),
            ("attn_o", (hidden, heads * head_dim), n_full),
        ]
        if qkv_bias:
            t += [
                ("attn_bias", (q_out,), n_full),
                ("attn_bias", (kv_out,), 2 * n_full),
            ]
        if attn_bias:
            t.append(("attn_bias", (hidden,), n_full))
        if mt in _QK_NORM_TYPES:
            t.append(("attn_qk_norm", (head_dim,), 2 * n_full))
    if n_lin:
        vh, vd, kernel, conv_dim = c.linear.value_heads, c.linear.value_head_dim, c.linear.conv_kernel, \
            c.linear.conv_dim
        value_dim = vh * vd
        t += [
            ("gdn_in_proj_qkv", (conv_dim, hidden), n_lin),
            ("gdn_in_proj_z", (value_dim, hidden), n_lin),
            ("gdn_in_proj_b", (vh, hidden), n_lin),
            ("gdn_in_proj_a", (vh, hidden), n_lin),
            ("gdn_conv1d", (conv_dim, 1, kernel), n_lin),
            ("gdn_decay", (vh,), 2 * n_lin),  # A_log and dt_bias
            ("gdn_norm", (vd,), n_lin),
            ("gdn_out_proj", (hidden, value_dim), n_lin),
        ]
    n_sparse = sparse_layers(c)
    n_dense = n_layers - n_sparse
    if n_dense:
        t += [
            ("mlp_gate", (inter, hidden), n_dense),
            ("mlp_up", (inter, hidden), n_dense),
            ("mlp_down", (hidden, inter), n_dense),
        ]
        if c.mlp_bias:
            t += [("mlp_bias", (inter,), 2 * n_dense), ("mlp_bias", (hidden,), n_dense)]
    if n_sparse:
        e = c.experts
        t += [
            ("moe_router", (e.num_experts, hidden), n_sparse),
            ("experts_gate_up", (2 * e.intermediate_size, hidden), e.num_experts * n_sparse),
            ("experts_down", (hidden, e.intermediate_size), e.num_experts * n_sparse),
        ]
        if e.shared_intermediate_size:
            shared = e.shared_intermediate_size
            t += [
                ("shared_expert_gate_up", (2 * shared, hidden), n_sparse),
                ("shared_expert_down", (hidden, shared), n_sparse),
                ("shared_expert_gate", (1, hidden), n_sparse),
            ]
    return t


def sparse_layers(c: TextConfig) -> int:
    """Layers whose MLP is routed experts (the rest keep a dense MLP)."""
    if c.experts is None:
        return 0
    return sum(c.experts.sparse(i) for i in range(len(c.layer_types)))


def read_share(c: TextConfig, group: str) -> tuple[int, int]:
    """(numerator, denominator) of a group's bytes read per decoded token: k of E for the routed experts,
    none of an untied embedding (a one-row gather), all of the rest."""
    if group in EXPERT_GROUPS:
        return c.experts.top_k, c.experts.num_experts
    if group == "embedding" and not c.tie_word_embeddings:
        return 0, 1
    return 1, 1


NORM_GROUPS = ("norms", "attn_qk_norm", "gdn_norm")   # stored in the compute dtype, like activations


def _weights(t: TextConfig, quant: str, group_modes: dict[str, str] | None = None,
             compute_dtype: str = "float16") -> dict[str, dict]:
    groups: dict[str, dict] = {}
    for group, shape, count in tensor_shapes(t):
        mode = (group_modes or {}).get(group, quant)
        params = math.prod(shape)
        if group == "gdn_decay":   # A_log / dt_bias stay fp32 in every scheme (exp of A_log overflows fp16)
            nbytes, precision = 4 * params, "float32"
        elif group in FLOAT_GROUPS:
            precision = "float32" if quant == "q0f32" else "float16"
            nbytes = DTYPE_BYTES[precision] * params
        elif group in NORM_GROUPS and quant != "q0f32":
            nbytes, precision = DTYPE_BYTES[compute_dtype] * params, compute_dtype
        else:
            nbytes, precision = _tensor_bytes(shape, mode)
        g = groups.setdefault(group, {"params": 0, "bytes": 0, "precision": precision,
                                      "read_params": 0, "read_bytes": 0})
        g["params"] += params * count
        g["bytes"] += nbytes * count
        num, den = read_share(t, group)
        g["read_params"] += params * count // den * num   # count is a multiple of den (E x sparse layers)
        g["read_bytes"] += nbytes * count // den * num
        if g["precision"] != precision:
            g["precision"] = "mixed"
    return groups


def memory_plan(
    hf_config: dict,
    *,
    quant: str,
    compute_dtype: str = "float16",
    contexts: Iterable[int] = (4096, 8192, 32768),
    prefill_chunk: int = 512,
    phone: dict | None = None,
    group_modes: dict[str, str] | None = None,
    max_buffer_bytes: int | None = None,
    kv_dtype: str | None = None,
) -> dict:
    """Memory / bandwidth plan of ``hf_config`` under ``quant``; see the module docstring for the model."""
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quant {quant!r}; expected one of {QUANT_MODES}")
    kv_dtype = kv_dtype or compute_dtype
    for what, dt in (("compute_dtype", compute_dtype), ("kv_dtype", kv_dtype)):
        if dt not in DTYPE_BYTES:
            raise ValueError(f"unknown {what} {dt!r}; expected one of {sorted(DTYPE_BYTES)}")
    cfg = plan_config(hf_config)
    act_b = DTYPE_BYTES[compute_dtype]
    kv_b = DTYPE_BYTES[kv_dtype]
    hidden, inter, vocab, heads = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_attention_heads
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.head_dim
    types, n_full, n_lin = cfg.layer_types, cfg.full_attention_layers, cfg.linear_attention_layers

    bad = sorted(set((group_modes or {}).values()) - set(QUANT_MODES))
    if bad:
        raise ValueError(f"unknown quant {bad[0]!r} in group_modes; expected one of {QUANT_MODES}")
    groups = _weights(cfg, quant, group_modes, compute_dtype)
    total_params = sum(g["params"] for g in groups.values())
    total_bytes = sum(g["bytes"] for g in groups.values())
    # the embedding is a gather (a tied lm_head reads the matrix once per token); k of E routed experts
    read_bytes = sum(g["read_bytes"] for g in groups.values())
    read_params = sum(g["read_params"] for g in groups.values())
    read_by_part = {part: sum(groups[g]["read_bytes"] for g in members if g in groups)
                    for part, members in PARTS if any(g in groups for g in members)}

    # KV cache
    kv_per_token = 2 * kv_heads * head_dim * kv_b * n_full

    # recurrent state
    gdn_state = conv_state = 0
    widths = [2 * inter, 4 * hidden]
    if n_full:
        widths.append(q_outputs(cfg) + 2 * kv_heads * head_dim + heads * head_dim)
    gdn_workspace = 0
    if n_lin:
        lin = cfg.linear
        vh, kd, vd, kernel, conv_dim = lin.value_heads, lin.key_head_dim, lin.value_head_dim, lin.conv_kernel, \
            lin.conv_dim
        gdn_state = n_lin * vh * kd * vd * 4
        conv_state = n_lin * conv_dim * (kernel - 1) * act_b
        widths.append(2 * conv_dim + vh * vd + 2 * vh)
        gdn_workspace = vh * prefill_chunk * GDN_CHUNK * 4
    moe = None
    if cfg.experts is not None and sparse_layers(cfg):
        e = cfg.experts
        # router logits, the k experts' SiLU(gate) * up, the shared expert's gate_up (models/moe.py)
        widths.append(e.num_experts + e.top_k * e.intermediate_size + 2 * e.shared_intermediate_size)
        routed = [groups[g] for g in EXPERT_GROUPS]
        moe = {"experts": e.num_experts, "top_k": e.top_k, "sparse_layers": sparse_layers(cfg),
               "expert_intermediate_size": e.intermediate_size,
               "shared_intermediate_size": e.shared_intermediate_size,
               "routed_params": sum(g["params"] for g in routed), "routed_bytes": sum(g["bytes"] for g in routed),
               "routed_read_params": sum(g["read_params"] for g in routed),
               "routed_read_bytes": sum(g["read_bytes"] for g in routed)}
    state_bytes = gdn_state + conv_state

    # activations of one prefill chunk
    act_width = 2 * hidden + max(widths)
    chunk_bytes = prefill_chunk * act_width * act_b
    logits_bytes = vocab * 4
    activations = chunk_bytes + gdn_workspace + logits_bytes

    fixed = total_bytes + state_bytes + activations
    per_context = []
    for ctx in contexts:
        ctx = int(ctx)
        kv = kv_per_token * ctx
        row = {
            "context": ctx,
            "kv_bytes": kv,
            "total_bytes": fixed + kv,
            "decode_bytes_per_token": read_bytes + kv + 2 * state_bytes,
        }
        if phone is not None:
            bw = float(phone["bandwidth_gbs"]) * 1e9
            row["fits"] = row["total_bytes"] <= float(phone["app_budget_gb"]) * 1e9
            row["headroom_bytes"] = int(float(phone["app_budget_gb"]) * 1e9) - row["total_bytes"]
            row["predicted_decode_tok_s"] = SUSTAINED_BANDWIDTH_SHARE * bw / row["decode_bytes_per_token"]
            row["roofline_tok_s"] = bw / row["decode_bytes_per_token"]
        per_context.append(row)

    return {
        "model_type": cfg.model_type,
        "quant": quant,
        "compute_dtype": compute_dtype,
        "prefill_chunk": prefill_chunk,
        "layers": {"total": len(types), "full_attention": n_full, "linear_attention": n_lin},
        "weights": groups,
        "splits": _splits(cfg, quant, group_modes, max_buffer_bytes),
        "weights_total": {"params": total_params, "bytes": total_bytes},
        "weights_read_per_token": {"params": read_params, "bytes": read_bytes, "by_part": read_by_part},
        "moe": moe,
        "kv_cache": {
            "bytes_per_token": kv_per_token,
            "dtype": kv_dtype,
            "layers": n_full,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "by_context": {r["context"]: r["kv_bytes"] for r in per_context},
        },
        "recurrent_state": {
            "gdn_bytes": gdn_state,
            "gdn_dtype": "float32",
            "conv_bytes": conv_state,
            "conv_dtype": compute_dtype,
            "bytes": state_bytes,
        },
        "activations": {
            "chunk_bytes": chunk_bytes,
            "gdn_workspace_bytes": gdn_workspace,
            "logits_bytes": logits_bytes,
            "bytes": activations,
        },
        "contexts": per_context,
        "weights_only_roofline_tok_s": (
            float(phone["bandwidth_gbs"]) * 1e9 / read_bytes if phone is not None else None
        ),
        "phone": dict(phone) if phone is not None else None,
        "sustained_bandwidth_share": SUSTAINED_BANDWIDTH_SHARE,
    }


def _fmt_bytes(n: float) -> str:
    n = float(n)
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.1f} MB"
    if abs(n) >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{int(n)} B"


def _fmt_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.3f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"


def _moe_lines(plan: dict) -> list[str]:
    """The mixture-of-experts paragraph: what is stored against what a decoded token reads, by part."""
    moe = plan.get("moe")
    if not moe:
        return []
    wr = plan["weights_read_per_token"]
    lines = ["", "## Mixture of experts: stored vs read per decoded token", "",
             f"{moe['sparse_layers']} sparse layers of {moe['experts']} routed experts (FFN "
             f"{moe['expert_intermediate_size']}), {moe['top_k']} per token"
             + (f", plus a shared expert (FFN {moe['shared_intermediate_size']})"
                if moe["shared_intermediate_size"] else "")
             + f". The routed experts hold {_fmt_bytes(moe['routed_bytes'])} "
             f"({_fmt_params(moe['routed_params'])} params); a decoded token reads the {moe['top_k']} chosen "
             f"experts' rows, {_fmt_bytes(moe['routed_read_bytes'])} ({moe['top_k']}/{moe['experts']}). "
             "Batch-1 decode: a batch of b sequences reads up to min(E, b x k) experts per layer.", "",
             "| part | bytes read per token |", "|---|---:|"]
    lines += [f"| {part} | {_fmt_bytes(b)} |" for part, b in wr["by_part"].items()]
    lines.append(f"| **active total** | **{_fmt_bytes(wr['bytes'])}** |")
    return lines


def plan_markdown(plan: dict) -> str:
    """Markdown tables for a plan returned by :func:`memory_plan`."""
    lay = plan["layers"]
    out = [
        f"# Memory plan: {plan['model_type']} {plan['quant']} (compute {plan['compute_dtype']})",
        "",
        f"Layers: {lay['total']} ({lay['full_attention']} full attention, "
        f"{lay['linear_attention']} linear attention). GB = 10^9 bytes.",
        "",
        "## Weights",
        "",
        "| group | params | bytes | precision |",
        "|---|---:|---:|---|",
    ]
    for name, g in plan["weights"].items():
        out.append(f"| {name} | {_fmt_params(g['params'])} | {_fmt_bytes(g['bytes'])} | {g['precision']} |")
    wt, wr = plan["weights_total"], plan["weights_read_per_token"]
    out += [
        f"| **total** | **{_fmt_params(wt['params'])}** | **{_fmt_bytes(wt['bytes'])}** | |",
        f"| read per decoded token | {_fmt_params(wr['params'])} | {_fmt_bytes(wr['bytes'])} | |",
        *[line for sp in plan.get("splits", []) for line in (
            "", f"Split {sp['group']} ({_fmt_bytes(sp['largest_tensor_bytes'])} in its largest array) into "
                f"{sp['parts']} parts of {', '.join(str(r) for r in sp['rows'])} rows (reason: {sp['reason']}).")],
        *_moe_lines(plan),
        "",
        "## Fixed-size state and activations",
        "",
        "| item | bytes |",
        "|---|---:|",
    ]
    kv = plan["kv_cache"]
    st = plan["recurrent_state"]
    act = plan["activations"]
    out.append(
        f"| KV cache per token ({kv['layers']} layers x 2 x {kv['kv_heads']} x {kv['head_dim']}, "
        f"{kv['dtype']}) | {kv['bytes_per_token'] / 1024:.0f} KiB |"
    )
    if st["bytes"]:
        out.append(f"| GDN recurrent state ({st['gdn_dtype']}) | {_fmt_bytes(st['gdn_bytes'])} |")
        out.append(f"| conv state ({st['conv_dtype']}) | {_fmt_bytes(st['conv_bytes'])} |")
    out.append(
        f"| activations, prefill chunk of {plan['prefill_chunk']} | {_fmt_bytes(act['chunk_bytes'])} |"
    )
    if act["gdn_workspace_bytes"]:
        out.append(f"| GDN chunk workspace | {_fmt_bytes(act['gdn_workspace_bytes'])} |")
    out += [f"| last-token logits (fp32) | {_fmt_bytes(act['logits_bytes'])} |", ""]

    phone = plan.get("phone")
    out += ["## Per context", ""]
    if phone:
        out += [
            f"Phone: {phone.get('name', '?')}, {phone.get('ram_gb', '?')} GB RAM, app budget "
            f"{phone['app_budget_gb']} GB, {phone['bandwidth_gbs']} GB/s peak. Decode speeds are "
            f"**predictions** ({plan['sustained_bandwidth_share']:.0%} of peak bandwidth / bytes per "
            "token; roofline = 100%), not measurements."
            + (" Mixture of experts: bytes/token counts the active weights (the k chosen experts, above), not the "
               "stored ones." if plan.get("moe") else "")
            + (f" CPU library built for class {phone['cpu_class']}: {phone['cpu_class_description']}."
               if phone.get("cpu_class_description") else ""),   # CPU targets only: a GPU target's phone
            # entry may name a class (configs/phones.yaml) that its library was not built for
            "",
            "| context | KV cache | total RAM | fits | bytes/token | predicted tok/s | roofline tok/s |",
            "|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in plan["contexts"]:
            out.append(
                f"| {r['context']} | {_fmt_bytes(r['kv_bytes'])} | {_fmt_bytes(r['total_bytes'])} | "
                f"{'yes' if r['fits'] else 'no'} | {_fmt_bytes(r['decode_bytes_per_token'])} | "
                f"{r['predicted_decode_tok_s']:.2f} | {r['roofline_tok_s']:.2f} |"
            )
    else:
        out += ["| context | KV cache | total RAM | bytes/token |", "|---:|---:|---:|---:|"]
        for r in plan["contexts"]:
            out.append(
                f"| {r['context']} | {_fmt_bytes(r['kv_bytes'])} | {_fmt_bytes(r['total_bytes'])} | "
                f"{_fmt_bytes(r['decode_bytes_per_token'])} |"
            )
    return "\n".join(out) + "\n"
