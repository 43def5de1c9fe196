"""Qwen3.5 / 3.6 / 3.8 hybrid ("qwen27b"): Gated-DeltaNet layers + gated full-attention layers.

One definition for the text path of `Qwen3_5ForConditionalGeneration` (`qwen3_5`, nested `text_config`) and
`Qwen3_5ForCausalLM` (`qwen3_5_text`). Per `layer_types`:

* ``linear_attention`` (GDN): one fused input projection (checkpoint's in_proj_qkv | in_proj_z | in_proj_b |
  in_proj_a, concatenated), causal depthwise conv1d (kernel 4, SiLU) over the qkv part with a conv state of
  the last K-1 inputs, L2-normalised q/k, gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and
  ``beta = sigmoid(b)`` in fp32, the exact gated delta rule (`gdn_kernels`) on an fp32 state
  [value heads, key dim, value dim], gated RMSNorm ``rms(o) * w * silu(z)``, out_proj.
* ``full_attention``: q_proj gives query and gate interleaved per head ([H, 2D] -> split), q/k RMSNorm,
  partial RoPE (first `partial_rotary_factor` of head dims, applied by the paged KV cache), GQA,
  output times sigmoid(gate), o_proj.

The MoE variant (`Qwen3_5MoeForConditionalGeneration`, `qwen3_5_moe_text`: the 35B-A3B) replaces every
layer's MLP by routed experts (top-k of E, renormalised) plus a shared expert gated by sigmoid(x w), see
`models.moe`; the token mixers are the same.

RMSNorms outside GDN are zero-centred (scale ``1 + w``); that is computed in the graph so the stored weights
are the checkpoint's. The conv and delta-rule states live in the runtime RNN state (`recurrent_state`)
beside the paged KV cache, which only the full-attention layers use (`kv_state_kind: hybrid`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from pipeline.errors import ConfigError
from pipeline.frontend.hf_config import LAYER_KINDS, text_config
from pipeline.kernels.gpu.norm_rows import NormSpec, norm_kernel
from pipeline.models.gdn_kernels import gdn_decode, gdn_prefill, gdn_segments
from pipeline.models.layers import LayerFactory
from pipeline.models.llama import (
    MLP,
    DecoderLM,
    _empty_ext_factors,
    _last_token,
    _shape_expr,
    cached_attention,
    greedy_entry_spec,
    greedy_token,
    kv_cache_spec,
)
from pipeline.models.moe import SparseMoE, expert_dot, gpu_info
from pipeline.models.recurrent_state import RecurrentState


@dataclass
class HybridConfig:
    """What the hybrid needs from a HF config (the text part) plus runtime sizes."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: list[str]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    vocab_size: int
    family: str = "qwen3_5"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    context_window_size: int = 4096
    prefill_chunk_size: int = 512
    max_batch_size: int = 1
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    # mixture-of-experts MLPs in every layer (qwen3_5_moe): routed experts + a sigmoid-gated shared expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, source: str = "config.json",
                context_window_size: int | None = None, prefill_chunk_size: int | None = None):
        t = text_config(hf, source=source)
        bad = sorted(set(t.layer_types) - set(LAYER_KINDS))
        if bad:
            raise ConfigError(f"layer_types must list {t.num_hidden_layers} entries of {LAYER_KINDS}, got {bad}",
                              path=source, fix="fix layer_types in config.json")
        if t.rope_scaling:
            raise ConfigError(f"rope_type {t.rope_scaling.get('rope_type')!r} is not supported for {cls.__name__}",
                              path=source, fix="use a config with rope_type 'default' (text positions)")
        lin = t.linear
        if lin is None:   # text_config reads the linear-attention sizes of every config it sees as a hybrid
            raise ConfigError(f"is not a Qwen3.5 hybrid config (model_type {t.model_type!r}, no linear_attention "
                              "layers)", path=source, fix="give the model's complete HF config.json")
        cfg = cls(
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_hidden_layers,
            layer_types=list(t.layer_types),
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads,
            head_dim=t.head_dim,
            linear_num_key_heads=lin.key_heads,
            linear_num_value_heads=lin.value_heads,
            linear_key_head_dim=lin.key_head_dim,
            linear_value_head_dim=lin.value_head_dim,
            linear_conv_kernel_dim=lin.conv_kernel,
            vocab_size=t.vocab_size,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_theta or 10_000_000.0,
            partial_rotary_factor=t.partial_rotary_factor or 1.0,
            attention_bias=bool(t.attention_bias),
            tie_word_embeddings=t.tie_word_embeddings,
            context_window_size=context_window_size or min(t.max_position_embeddings or 4096, 4096),
            prefill_chunk_size=prefill_chunk_size or 512,
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads or \
                cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ConfigError("attention heads must be a multiple of KV heads (and GDN value heads of key heads)",
                              path=source, fix="fix the head counts in config.json")
        e = t.experts
        if t.is_moe and (e is None or e.mlp_only_layers or e.decoder_sparse_step != 1 or not e.norm_topk_prob):
            raise ConfigError("a Qwen3.5 MoE config routes every layer (no mlp_only_layers / decoder_sparse_step) "
                              "and renormalises its top-k", path=source, fix="give the model's complete HF config.json")
        if e is not None:
            cfg.family = "qwen3_5_moe"
            cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size = \
                e.num_experts, e.top_k, e.intermediate_size
            cfg.shared_expert_intermediate_size = e.shared_intermediate_size
        return cfg

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def rnn_states(self, dtype: str) -> list[tuple[list[int], str]]:
        """(shape, dtype) of each recurrent state id: 0 = conv inputs [K-1, conv_dim], 1 = delta-rule state."""
        return [([self.linear_conv_kernel_dim - 1, self.conv_dim], dtype),
                ([self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim], "float32")]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: x / rms(x) * (1 + w), the weight stored as in the checkpoint (around 0)."""

    def __init__(self, dim: int, eps: float, dtype: str):
        self.eps = eps
        self.weight = nn.Parameter((dim,), dtype)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.astype(x.dtype) if self.weight.dtype != x.dtype else self.weight
        return op.rms_norm(x, w + 1.0, axes=[-1], epsilon=self.eps)


class GatedAttention(nn.Module):
    def __init__(self, cfg: HybridConfig, make: LayerFactory, kv_layer: int):
        self.cfg, self.kv_layer = cfg, kv_layer
        self.kv_dtype = make.kv_cache_dtype
        nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = make.linear(cfg.hidden_size, 2 * nq * d + 2 * nkv * d, bias=cfg.attention_bias, role="qkv_proj")
        self.o_proj = make.linear(nq * d, cfg.hidden_size, bias=False, role="o_proj")
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, make.dtype)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, make.dtype)

    def forward(self, x: Tensor, kv: PagedKVCache) -> Tensor:
        c = self.cfg
        b, s, _ = x.shape
        nq, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg, k, v = op.split(self.qkv_proj(x), [2 * nq * d, 2 * nq * d + nkv * d], axis=-1)
        q, gate = op.split(op.reshape(qg, (b, s, nq, 2 * d)), 2, axis=-1)   # interleaved per head
        q = self.q_norm(q)
        k = self.k_norm(op.reshape(k, (b, s, nkv, d)))
        qkv = op.concat([q, k, op.reshape(v, (b, s, nkv, d))], dim=2)
        out = cached_attention(kv, self.kv_layer, qkv, nq, d, self.kv_dtype)
        out = op.reshape(out * op.sigmoid(gate), (b, s, nq * d))
        return self.o_proj(out)


class Conv1dWeight(nn.Module):
    """Holds `conv1d.weight` [channels, 1, kernel] exactly as the checkpoint stores it."""

    def __init__(self, channels: int, kernel: int, dtype: str):
        self.weight = nn.Parameter((channels, 1, kernel), dtype)


def _window(prev: te.Tensor, cur: te.Tensor):
    """Index the virtual sequence [previous K-1 inputs | this chunk] without materialising the concat."""
    keep = prev.shape[1]

    def at(b, t, c):
        return tirx.if_then_else(t < keep, prev[b, tirx.min(t, keep - 1), c],
                                 cur[b, tirx.max(t - keep, 0), c])

    return at


def _causal_conv_silu(prev: te.Tensor, cur: te.Tensor, w: te.Tensor, dtype: str) -> te.Tensor:
    """silu(depthwise causal conv) [1, s, C] of this chunk `cur` [1, s, C], `prev` [1, K-1, C] before it.

    The kernel is tiny and static (K = 4), so the taps are unrolled into one elementwise expression: no
    reduction, so every target schedules it as a plain injective kernel."""
    x = _window(prev, cur)
    kernel = int(w.shape[2])

    def conv(b, t, c):
        acc = x(b, t, c).astype("float32") * w[c, 0, 0].astype("float32")
        for j in range(1, kernel):
            acc = acc + x(b, t + j, c).astype("float32") * w[c, 0, j].astype("float32")
        return (acc * tirx.sigmoid(acc)).astype(dtype)

    return te.compute(cur.shape, conv, name="conv_silu")


def _tail(prev: te.Tensor, cur: te.Tensor) -> te.Tensor:
    """The last K-1 inputs of [prev | cur]: the conv state for the next call."""
    x = _window(prev, cur)
    s = cur.shape[1]
    return te.compute(prev.shape, lambda b, i, c: x(b, s + i, c), name="conv_state_tail")


def _segment_of(ends: te.Tensor, n) -> te.Tensor:
    """[n] int32: which sequence each token of a batched chunk belongs to (`ends` [b]: each one's last token)."""
    j = te.reduce_axis((0, ends.shape[0]), name="j")
    return te.compute((n,), lambda t: te.sum(tirx.Select(ends[j] < tirx.Cast("int32", t), 1, 0), axis=j),
                      name="segment_of")


def _segment_start(ends: te.Tensor, s):
    return tirx.if_then_else(s == 0, 0, ends[tirx.max(s, 1) - 1] + 1)


def _segmented_window(prev: te.Tensor, cur: te.Tensor, ends: te.Tensor):
    """x(s, p, c): position p of sequence s's virtual input [its previous K-1 inputs | its tokens of the chunk]."""
    keep = prev.shape[1]

    def at(s, p, c):
        t = _segment_start(ends, s) + tirx.Cast("int32", p - keep)
        return tirx.if_then_else(p < keep, prev[s, tirx.min(p, keep - 1), c], cur[0, tirx.max(t, 0), c])

    return at


def _segmented_conv_silu(prev: te.Tensor, cur: te.Tensor, w: te.Tensor, ends: te.Tensor, dtype: str) -> te.Tensor:
    """_causal_conv_silu over a chunk [1, n, C] holding several sequences back to back, each with its own
    previous inputs prev[s] ([b, K-1, C])."""
    x = _segmented_window(prev, cur, ends)
    seg = _segment_of(ends, cur.shape[1])
    kernel = int(w.shape[2])

    def conv(_, t, c):
        s = seg[t]
        p = tirx.Cast("int64", tirx.Cast("int32", t) - _segment_start(ends, s))
        acc = x(s, p, c).astype("float32") * w[c, 0, 0].astype("float32")
        for j in range(1, kernel):
            acc = acc + x(s, p + j, c).astype("float32") * w[c, 0, j].astype("float32")
        return (acc * tirx.sigmoid(acc)).astype(dtype)

    return te.compute(cur.shape, conv, name="conv_silu_segments")


def _segmented_tail(prev: te.Tensor, cur: te.Tensor, ends: te.Tensor) -> te.Tensor:
    """Each sequence's last K-1 inputs of [prev[s] | its tokens]: its conv state for the next call."""
    x = _segmented_window(prev, cur, ends)

    def tail(s, i, c):
        length = tirx.Cast("int64", ends[s] + 1 - _segment_start(ends, s))
        return x(s, length + tirx.Cast("int64", i), c)

    return te.compute(prev.shape, tail, name="conv_state_tail_segments")


def _gates(a: te.Tensor, b: te.Tensor, a_log: te.Tensor, dt_bias: te.Tensor):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); both fp32 [s, H]."""
    def softplus(x):
        return tirx.Select(x > tirx.const(20.0, "float32"), x, tirx.log(tirx.exp(x) + tirx.const(1.0, "float32")))

    shape = (a.shape[1], a.shape[2])
    g = te.compute(shape, lambda t, h: -tirx.exp(a_log[h]) * softplus(a[0, t, h].astype("float32") + dt_bias[h]),
                   name="gdn_g")
    beta = te.compute(shape, lambda t, h: tirx.sigmoid(b[0, t, h].astype("float32")), name="gdn_beta")
    return g, beta


L2_EPS = 1e-6


def _l2norm(x: Tensor, eps: float = L2_EPS) -> Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in fp32 (as transformers / FLA)."""
    xf = x.astype("float32") if x.dtype != "float32" else x
    inv = op.sqrt(op.sum(xf * xf, axis=-1, keepdims=True) + eps)
    y = xf / inv
    return y.astype(x.dtype) if x.dtype != "float32" else y


def _qk_l2norm(conv: Tensor, s, hk: int, dk: int, gpu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) of the conv output, q and k L2-normalised per head. On a GPU, q and k (adjacent in the conv
    output) go through one launch of the row-splitting norm kernel: 2 hk rows of dk, enough work-groups per row
    to fill the GPU at one token (kernels/gpu/norm_rows.py); the TE form was a 2 hk-group reduction and a divide
    per tensor, 4 launches."""
    if not gpu:
        q, k, v = op.split(conv, [hk * dk, 2 * hk * dk], axis=-1)
        return _l2norm(op.reshape(q, (s, hk, dk))), _l2norm(op.reshape(k, (s, hk, dk))), v
    qk, v = op.split(conv, [2 * hk * dk], axis=-1)
    spec = NormSpec(h=dk, dtype=conv.dtype, w_dtype=conv.dtype, eps=L2_EPS, heads=2 * hk, l2=True)
    qk = op.tensor_ir_op(norm_kernel(spec).with_attr("mlp.kernel", "l2_norm_split"), "l2_norm_split",
                         [op.reshape(qk, (1, s, 2 * hk, dk))], Tensor.placeholder((1, s, 2 * hk, dk), conv.dtype))
    q, k = op.split(op.reshape(qk, (s, 2 * hk, dk)), 2, axis=1)
    return q, k, v


class GatedRMSNorm(nn.Module):
    """rms(o) * w * silu(z) per value head (weight NOT zero-centred)."""

    def __init__(self, dim: int, eps: float, dtype: str):
        self.eps = eps
        self.weight = nn.Parameter((dim,), dtype)

    def forward(self, o: Tensor, z: Tensor) -> Tensor:
        w = self.weight.astype(o.dtype) if self.weight.dtype != o.dtype else self.weight
        return op.rms_norm(o, w, axes=[-1], epsilon=self.eps) * op.silu(z)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridConfig, make: LayerFactory, state_layer: int, gpu: bool, max_threads: int):
        self.cfg, self.state_layer, self.dtype = cfg, state_layer, make.dtype
        self.gpu, self.max_threads = gpu, max_threads
        hv = cfg.linear_num_value_heads
        self.value_dim = hv * cfg.linear_value_head_dim
        self.in_proj = make.linear(cfg.hidden_size, cfg.conv_dim + self.value_dim + 2 * hv, bias=False, role="in_proj")
        self.conv1d = Conv1dWeight(cfg.conv_dim, cfg.linear_conv_kernel_dim, make.weight_dtype)
        self.A_log = nn.Parameter((hv,), "float32")
        self.dt_bias = nn.Parameter((hv,), "float32")
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, make.dtype)
        self.out_proj = make.linear(self.value_dim, cfg.hidden_size, bias=False, role="out_proj")

    def forward(self, x: Tensor, state: RecurrentState, ends: Tensor | None = None) -> tuple[Tensor, RecurrentState]:
        """`ends` None: x is one sequence's chunk. Else x [1, n, h] holds b sequences back to back and `ends` [b]
        is each one's last token (MLC's batch_prefill / batch_decode); every state is per sequence."""
        if ends is not None:
            return self._forward_segments(x, state, ends)
        c, dtype, layer = self.cfg, self.dtype, self.state_layer
        _, s, _ = x.shape
        hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                          c.linear_value_head_dim)
        conv_dim, keep = c.conv_dim, c.linear_conv_kernel_dim - 1
        mixed, z, b, a = op.split(self.in_proj(x), [conv_dim, conv_dim + self.value_dim,
                                                    conv_dim + self.value_dim + hv], axis=-1)
        prev = state.get(layer, 0, (1, keep, conv_dim), dtype)
        state = state.set(layer, 0, op.tensor_expr_op(_tail, "conv_state_tail", [prev, mixed]))
        conv = op.tensor_expr_op(lambda p, m, w: _causal_conv_silu(p, m, w, dtype), "gdn_conv1d_silu",
                                 [prev, mixed, self.conv1d.weight])
        q, k, v = _qk_l2norm(conv, s, hk, dk, self.gpu)
        v = op.reshape(v, (s, hv, dv))
        g, beta = op.tensor_expr_op(_gates, "gdn_gates", [a, b, self.A_log, self.dt_bias])
        rec = op.reshape(state.get(layer, 1, (1, hv, dk, dv), "float32"), (hv, dk, dv))
        kw = dict(gpu=self.gpu, max_threads=self.max_threads, gate_dtype="float32")
        if isinstance(s, int) and s == 1:
            q, k, v, g, beta = (op.reshape(t, t.shape[1:]) for t in (q, k, v, g, beta))
            o, rec = op.tensor_ir_op(gdn_decode(hk, hv, dk, dv, dtype, **kw), "gdn_decode", [q, k, v, g, beta, rec],
                                     [Tensor.placeholder((hv, dv), dtype), Tensor.placeholder((hv, dk, dv), "float32")])
        else:
            o, rec = op.tensor_ir_op(gdn_prefill(hk, hv, dk, dv, dtype, **kw), "gdn_prefill",
                                     [q, k, v, g, beta, rec],
                                     [Tensor.placeholder((s, hv, dv), dtype),
                                      Tensor.placeholder((hv, dk, dv), "float32")])
        state = state.set(layer, 1, op.reshape(rec, (1, hv, dk, dv)))
        o = self.norm(op.reshape(o, (1, s, hv, dv)), op.reshape(z, (1, s, hv, dv)))
        return self.out_proj(op.reshape(o, (1, s, self.value_dim))), state


    def _forward_segments(self, x: Tensor, state: RecurrentState, ends: Tensor) -> tuple[Tensor, RecurrentState]:
        c, dtype, layer = self.cfg, self.dtype, self.state_layer
        _, s, _ = x.shape
        nseq = ends.shape[0]
        hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                          c.linear_value_head_dim)
        conv_dim, keep = c.conv_dim, c.linear_conv_kernel_dim - 1
        mixed, z, b, a = op.split(self.in_proj(x), [conv_dim, conv_dim + self.value_dim,
                                                    conv_dim + self.value_dim + hv], axis=-1)
        prev = state.get(layer, 0, (nseq, keep, conv_dim), dtype)
        state = state.set(layer, 0, op.tensor_expr_op(_segmented_tail, "conv_state_tail_segments",
                                                      [prev, mixed, ends]))
        conv = op.tensor_expr_op(lambda p, m, w, e: _segmented_conv_silu(p, m, w, e, dtype), "gdn_conv1d_silu_segments",
                                 [prev, mixed, self.conv1d.weight, ends])
        q, k, v = _qk_l2norm(conv, s, hk, dk, self.gpu)
        v = op.reshape(v, (s, hv, dv))
        g, beta = op.tensor_expr_op(_gates, "gdn_gates", [a, b, self.A_log, self.dt_bias])
        rec = state.get(layer, 1, (nseq, hv, dk, dv), "float32")
        kw = dict(gpu=self.gpu, max_threads=self.max_threads, gate_dtype="float32")
        o, rec = op.tensor_ir_op(gdn_segments(hk, hv, dk, dv, dtype, **kw), "gdn_segments",
                                 [q, k, v, g, beta, rec, ends],
                                 [Tensor.placeholder((s, hv, dv), dtype),
                                  Tensor.placeholder((nseq, hv, dk, dv), "float32")])
        state = state.set(layer, 1, rec)
        o = self.norm(op.reshape(o, (1, s, hv, dv)), op.reshape(z, (1, s, hv, dv)))
        return self.out_proj(op.reshape(o, (1, s, self.value_dim))), state


class HybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, make: LayerFactory, layer_id: int, gpu: bool, max_threads: int,
                 expert_dot: str | None = None):
        eps = cfg.rms_norm_eps
        self.kind = cfg.layer_types[layer_id]
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps, make.dtype)
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, make, cfg.linear_layers.index(layer_id), gpu, max_threads)
        else:
            self.self_attn = GatedAttention(cfg, make, cfg.full_layers.index(layer_id))
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps, make.dtype)
        if cfg.num_experts:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                 True, make, gpu, max_threads, shared_inter=cfg.shared_expert_intermediate_size,
                                 expert_dot=expert_dot)
        else:
            self.mlp = MLP(cfg, make)

    def forward(self, x: Tensor, kv: PagedKVCache, state: RecurrentState, ends: Tensor | None = None):
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h, state = self.linear_attn(h, state, ends)
        else:
            h = self.self_attn(h, kv)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), state


class HybridBackbone(nn.Module):
    def __init__(self, cfg: HybridConfig, make: LayerFactory, gpu: bool, max_threads: int,
                 expert_dot: str | None = None):
        self.embed_tokens = make.embedding(cfg.vocab_size, cfg.hidden_size, tied=cfg.tie_word_embeddings)
        self.layers = nn.ModuleList([HybridLayer(cfg, make, i, gpu, max_threads, expert_dot)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, make.dtype)

    def forward(self, x: Tensor, kv: PagedKVCache, state: RecurrentState, ends: Tensor | None = None):
        for layer in self.layers:
            x, state = layer(x, kv, state, ends)
        return self.norm(x), state


class HybridLM(DecoderLM):
    """Entry points: embed, prefill, decode, prefill_all_logits, create_tir_paged_kv_cache, create_rnn_state.

    prefill/decode take and return both the paged KV cache and the RNN state (`kv_state_kind: hybrid`);
    embed, the logits and the common metadata are the dense decoder's.
    """

    def __init__(self, cfg: HybridConfig, make: LayerFactory, target: Any):
        self.cfg, self.dtype, self.target = cfg, make.dtype, target
        self.kv_dtype = make.kv_cache_dtype
        gpu, threads = gpu_info(target)
        self.model = HybridBackbone(cfg, make, gpu, threads, expert_dot(target))
        if not cfg.tie_word_embeddings:
            self.lm_head = make.linear(cfg.hidden_size, cfg.vocab_size, bias=False, role="lm_head")

    def prefill(self, input_embed: Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState):
        h, rnn_state = self.model(input_embed, paged_kv_cache, rnn_state)
        return self._logits(_last_token(h)), paged_kv_cache, rnn_state

    def prefill_all_logits(self, input_embed: Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState):
        h, rnn_state = self.model(input_embed, paged_kv_cache, rnn_state)
        return self._logits(h), paged_kv_cache, rnn_state

    def decode(self, input_embed: Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState):
        h, rnn_state = self.model(input_embed, paged_kv_cache, rnn_state)
        return self._logits(h), paged_kv_cache, rnn_state

    def batch_prefill(self, input_embeds: Tensor, logit_positions: Tensor, paged_kv_cache: PagedKVCache,
                      rnn_state: RecurrentState):
        """MLC's hybrid batch_prefill: b sequences' chunks back to back in [1, n, h], each one's last token at
        `logit_positions` -> ([1, b, V], kv, rnn); the GDN layers scan each sequence from its own state."""
        h, rnn_state = self.model(input_embeds, paged_kv_cache, rnn_state, logit_positions)
        return self._logits(op.take(h, logit_positions, axis=1)), paged_kv_cache, rnn_state

    def batch_decode(self, input_embeds: Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState):
        """One token of each of b sequences [b, 1, h] -> [b, 1, V]: batch_prefill of b one-token segments."""
        b, _, h = input_embeds.shape
        ends = op.tensor_expr_op(lambda x: te.compute((x.shape[0],), lambda i: tirx.Cast("int32", i), name="ends"),
                                 "one_token_each", [input_embeds])
        out, rnn_state = self.model(op.reshape(input_embeds, (1, b, h)), paged_kv_cache, rnn_state, ends)
        return op.reshape(self._logits(out), (b, 1, self.cfg.vocab_size)), paged_kv_cache, rnn_state

    def decode_greedy(self, input_ids: Tensor, paged_kv_cache: PagedKVCache, rnn_state: RecurrentState):
        """DecoderLM.decode_greedy with the recurrent state."""
        h, rnn_state = self.model(self._step_embed(input_ids), paged_kv_cache, rnn_state)
        return greedy_token(self._logits(h), self.cfg.vocab_size), paged_kv_cache, rnn_state

    def kv_rope(self) -> dict[str, Any]:
        """Partial RoPE (the first rotary_dim dims), no scaling."""
        c = self.cfg
        return {"rope_theta": c.rope_theta, "rope_scale": 1, "rope_scaling": {}, "rotary_dim": c.rotary_dim}

    def create_tir_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                                  prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                                  support_sliding_window: tirx.Var) -> PagedKVCache:
        c = self.cfg
        n_full = len(c.full_layers)
        return TIRPagedKVCache(
            attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size, page_size=page_size,
            support_sliding_window=support_sliding_window, layer_partition=_shape_expr([0, n_full]),
            num_hidden_layers=n_full, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, qk_head_dim=c.head_dim, v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0, mla_original_v_head_dim=0, rope_mode=RopeMode.NORMAL, **self.kv_rope(),
            rope_ext_factors=_empty_ext_factors(), enable_disaggregation=False, dtype=self.kv_dtype, target=self.target)

    def create_rnn_state(self, max_batch_size: tirx.Var, max_history: tirx.Var) -> RecurrentState:
        return RecurrentState.create(len(self.cfg.linear_layers), self.cfg.rnn_states(self.dtype),
                                     max_batch_size, max_history)

    def export_spec(self) -> dict[str, Any]:
        h = self.cfg.hidden_size
        packed = {"$": {"param_mode": "packed", "effect_mode": "none"}}
        kv = nn.spec.Object(object_type=PagedKVCache)
        rnn = nn.spec.Object(object_type=RecurrentState)

        def step(seq):
            return {"input_embed": nn.spec.Tensor([1, seq, h], self.dtype), "paged_kv_cache": kv,
                    "rnn_state": rnn, **packed}

        return {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), **packed},
            "prefill": step("seq_len"),
            "prefill_all_logits": step("seq_len"),
            "decode": step(1),
            **greedy_entry_spec(self.target, {"paged_kv_cache": kv, "rnn_state": rnn}, packed),
            "batch_prefill": {"input_embeds": nn.spec.Tensor([1, "seq_len", h], self.dtype),
                              "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                              "paged_kv_cache": kv, "rnn_state": rnn, **packed},
            # the b sequences' tokens are computed as one chunk: its size is the prefill kernels' seq_len
            "batch_decode": {"input_embeds": nn.spec.Tensor(["seq_len", 1, h], self.dtype),
                             "paged_kv_cache": kv, "rnn_state": rnn, **packed},
            "create_tir_paged_kv_cache": kv_cache_spec(),
            "create_rnn_state": {"max_batch_size": int, "max_history": int,
                                 "$": {"param_mode": "none", "effect_mode": "none"}},
            **self.engine_spec(),
        }

    def metadata(self, quantization: str, params: list[tuple[str, Any]]) -> dict[str, Any]:
        c = self.cfg
        meta = super().metadata(quantization, params)
        meta["kv_state_kind"] = "hybrid"
        meta["kv_cache"].update(num_hidden_layers=len(c.full_layers), layers=c.full_layers)
        meta["rnn_state"] = {
            "num_layers": len(c.linear_layers),
            "layers": c.linear_layers,
            "states": [{"shape": shape, "dtype": dt} for shape, dt in c.rnn_states(self.dtype)],
        }
        return meta
