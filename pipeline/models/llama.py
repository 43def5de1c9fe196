"""One definition for the dense GQA decoder family: Llama (incl. Llama-3 RoPE scaling), Qwen2, Qwen3.

Written against `tvm.relax.frontend.nn`; attention runs over TVM's paged KV cache, which also applies
RoPE. Projections are fused (QKV, gate+up) so a decode step issues fewer, larger GEMVs. Which linear
layer class is used (float or group-quantized, NK or KN layout) is decided by the quantization scheme
through `layers.make_linear`, so the model code does not know about quantization.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tvm import relax, te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from pipeline.errors import ConfigError
from pipeline.frontend.hf_config import text_config
from pipeline.kernels.cpu.argmax import argmax_kernel
from pipeline.kernels.cpu.rope import rope_args
from pipeline.models.engine_table import EngineFunctions
from pipeline.models.layers import LayerFactory
from pipeline.models.moe import SparseMoE, expert_dot, gpu_info

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


# RoPE scaling types the dense decoder builds, with the fields each needs
ROPE_SCALINGS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass
class DecoderConfig:
    """The subset of a HF config the dense decoder needs (plus runtime sizes)."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    context_window_size: int = 4096
    prefill_chunk_size: int = 512
    max_batch_size: int = 16   # sequences one batch_decode may carry (MLC's engine reads it from _metadata)
    # mixture-of-experts MLPs (qwen3_moe; hf_config.Experts): 0 experts = dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, source: str = "config.json",
                context_window_size: int | None = None, prefill_chunk_size: int | None = None):
        t = text_config(hf, source=source)
        family = next((ARCHITECTURES[a] for a in t.architectures if a in ARCHITECTURES), None)
        if family is None:
            family = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3_moe": "qwen3_moe"}.get(t.model_type or "")
        if family is None:
            raise ConfigError(
                f"architecture {list(t.architectures) or t.model_type} is not supported by the dense decoder",
                path=source,
                fix=f"use one of {sorted(ARCHITECTURES)}",
            )
        cfg = cls(
            family=family,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_hidden_layers,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads,
            head_dim=t.head_dim,
            vocab_size=t.vocab_size,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_theta or 10000.0,
            rope_scaling=dict(t.rope_scaling),
            tie_word_embeddings=t.tie_word_embeddings,
            attention_bias=t.attention_bias if t.attention_bias is not None else family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe"),
            context_window_size=context_window_size or min(t.max_position_embeddings or 4096, 4096),
            prefill_chunk_size=prefill_chunk_size or 512,
        )
        # what the dense decoder does not build is refused, not dropped: a checkpoint's MLP biases would go
        # unread, and a window narrower than the context would attend where the model never looked
        if t.mlp_bias:
            raise ConfigError("mlp_bias is true, but the dense decoder has no MLP biases", path=source,
                              fix="use a model without MLP biases (mlp_bias: false)")
        if t.sliding_window is not None and t.sliding_window < cfg.context_window_size:
            raise ConfigError(f"sliding_window {t.sliding_window} is narrower than the context window "
                              f"{cfg.context_window_size}, and the dense decoder attends to the whole context",
                              path=source, fix=f"set context_window_size to at most {t.sliding_window}")
        if (t.experts is not None) != (family == "qwen3_moe"):
            raise ConfigError(f"{family} {'needs' if family == 'qwen3_moe' else 'cannot have'} num_experts",
                              path=source, fix="give the model's complete HF config.json")
        if t.experts is not None:
            e = t.experts
            if e.shared_intermediate_size:
                raise ConfigError("a shared expert is not part of Qwen3-MoE (shared_expert_intermediate_size)",
                                  path=source, fix="give the model's complete HF config.json")
            cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size = \
                e.num_experts, e.top_k, e.intermediate_size
            cfg.norm_topk_prob, cfg.decoder_sparse_step = e.norm_topk_prob, e.decoder_sparse_step
            cfg.mlp_only_layers = list(e.mlp_only_layers)
        kind = t.rope_scaling.get("rope_type")
        if kind is not None:   # TVM's RoPE frequencies support these (yarn needs MLC's precomputed scale; others none)
            need = ROPE_SCALINGS.get(kind)
            if need is None:
                raise ConfigError(f"rope_scaling type {kind!r} is not supported by the dense decoder", path=source,
                                  fix=f"use a model with default RoPE or one of: {', '.join(ROPE_SCALINGS)}")
            bad = [k for k in need if not isinstance(t.rope_scaling.get(k), int | float) or t.rope_scaling[k] <= 0]
            if bad:
                raise ConfigError(f"rope_scaling ({kind}) needs positive numbers for {', '.join(bad)}", path=source,
                                  fix="give the model's complete HF config.json")
        return cfg   # head counts, sizes and eps were checked by text_config

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the mixture of experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return self.num_experts > 0 and layer not in self.mlp_only_layers and \
            (layer + 1) % self.decoder_sparse_step == 0


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, make: LayerFactory, layer_id: int):
        self.cfg = cfg
        self.layer_id = layer_id
        self.kv_dtype = make.kv_cache_dtype
        qkv_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        self.qkv_proj = make.linear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias, role="qkv_proj")
        self.o_proj = make.linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False, role="o_proj")
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(cfg.head_dim, -1, cfg.rms_norm_eps, bias=False, dtype=make.dtype)
            self.k_norm = nn.RMSNorm(cfg.head_dim, -1, cfg.rms_norm_eps, bias=False, dtype=make.dtype)

    def forward(self, x: Tensor, kv: PagedKVCache) -> Tensor:
        c = self.cfg
        b, s, _ = x.shape
        nq, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = op.reshape(self.qkv_proj(x), (b, s, nq + 2 * nkv, d))
        if c.qk_norm:
            q, k, v = op.split(qkv, [nq, nq + nkv], axis=2)
            qkv = op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)
        out = cached_attention(kv, self.layer_id, qkv, nq, d, self.kv_dtype)
        return self.o_proj(op.reshape(out, (b, s, nq * d)))


def cached_attention(kv: PagedKVCache, layer: int, qkv: Tensor, nq: int, d: int, kv_dtype: str) -> Tensor:
    """The paged KV cache's attention over fused q/k/v, in the activations' dtype: the cache stores (and its
    kernels read) `kv_dtype`, so q/k/v go in cast to it and the output comes back cast from it."""
    act = qkv.dtype
    if act != kv_dtype:
        qkv = qkv.astype(kv_dtype)
    out = kv.attention_with_fused_qkv(layer, qkv, nq, sm_scale=d**-0.5)
    return out.astype(act) if out.dtype != act else out


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, make: LayerFactory):
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = make.linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, role="gate_up_proj")
        self.down_proj = make.linear(cfg.intermediate_size, cfg.hidden_size, bias=False, role="down_proj")

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, make: LayerFactory, layer_id: int, target: Any = None):
        eps = cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, eps, bias=False, dtype=make.dtype)
        self.self_attn = Attention(cfg, make, layer_id)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, eps, bias=False, dtype=make.dtype)
        if cfg.sparse(layer_id):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                 cfg.norm_topk_prob, make, *gpu_info(target), expert_dot=expert_dot(target))
        else:
            self.mlp = MLP(cfg, make)

    def forward(self, x: Tensor, kv: PagedKVCache) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: DecoderConfig, make: LayerFactory, target: Any = None):
        self.embed_tokens = make.embedding(cfg.vocab_size, cfg.hidden_size, tied=cfg.tie_word_embeddings)
        self.layers = nn.ModuleList([DecoderLayer(cfg, make, i, target) for i in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=make.dtype)

    def forward(self, x: Tensor, kv: PagedKVCache) -> Tensor:
        for layer in self.layers:
            x = layer(x, kv)
        return self.norm(x)


GREEDY_ENTRY = "decode_greedy"


def has_greedy_entry(target: Any) -> bool:
    """CPU targets export `decode_greedy`; on a GPU target its argmax would need a device schedule, and MLC's
    runtime, which phone apps embed, samples from decode's logits."""
    return target.kind.name == "llvm"


def greedy_entry_spec(target: Any, states: dict[str, Any], packed: dict[str, Any]) -> dict[str, Any]:
    """The export spec's `decode_greedy` entry (a token id, then the model's states), on CPU targets only."""
    if not has_greedy_entry(target):
        return {}
    return {GREEDY_ENTRY: {"input_ids": nn.spec.Tensor([1], "int32"), **states, **packed}}


def greedy_token(logits: Tensor, vocab_size: int) -> Tensor:
    """One step's logits [1, 1, V] -> the [1] int32 id of the largest (the first of equals, like numpy)."""
    return op.tensor_ir_op(argmax_kernel(vocab_size), "greedy_argmax", [op.reshape(logits, [vocab_size])],
                           Tensor.placeholder((1,), "int32"))


def kv_cache_spec() -> dict[str, Any]:
    """Export spec of create_tir_paged_kv_cache: runtime sizes only, no parameters. A fresh dict per
    export: the nn exporter consumes the "$" entry of the specs it is given."""
    return {
        "max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int,
        "page_size": int, "support_sliding_window": int,
        "$": {"param_mode": "none", "effect_mode": "none"},
    }


class DecoderLM(EngineFunctions, nn.Module):
    """Entry points follow MLC's engine contract (configs/runtimes/): embed, prefill / decode (one sequence: the
    hand-written CPU kernels' shapes), batch_prefill / batch_decode / batch_verify (several), the KV cache, and
    the engine's buffer and logit functions (models/engine_table.py)."""

    def __init__(self, cfg: DecoderConfig, make: LayerFactory, target: Any):
        self.cfg = cfg
        self.dtype = make.dtype
        self.kv_dtype = make.kv_cache_dtype
        self.target = target
        self.model = Backbone(cfg, make, target)
        if not cfg.tie_word_embeddings:
            self.lm_head = make.linear(cfg.hidden_size, cfg.vocab_size, bias=False, role="lm_head")

    def _logits(self, h: Tensor) -> Tensor:
        if self.cfg.tie_word_embeddings:
            logits = self.model.embed_tokens.lm_head(h)
        else:
            logits = self.lm_head(h)
        return logits.astype("float32") if logits.dtype != "float32" else logits

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def prefill(self, input_embed: Tensor, paged_kv_cache: PagedKVCache):
        """Run a chunk; logits of its last token only (what generation needs)."""
        h = self.model(input_embed, paged_kv_cache)
        return self._logits(_last_token(h)), paged_kv_cache

    def prefill_all_logits(self, input_embed: Tensor, paged_kv_cache: PagedKVCache):
        """Logits of every position of the chunk (teacher-forced evaluation, quality metrics)."""
        return self._logits(self.model(input_embed, paged_kv_cache)), paged_kv_cache

    def decode(self, input_embed: Tensor, paged_kv_cache: PagedKVCache):
        return self._logits(self.model(input_embed, paged_kv_cache)), paged_kv_cache

    def batch_prefill(self, input_embeds: Tensor, logit_positions: Tensor, paged_kv_cache: PagedKVCache):
        """Chunks of several sequences back to back in one [1, n, h]; logits at `logit_positions` (each
        sequence's last token) -> [1, b, V]. The KV cache knows which tokens belong to which sequence."""
        h = self.model(input_embeds, paged_kv_cache)
        return self._logits(op.take(h, logit_positions, axis=1)), paged_kv_cache

    def batch_decode(self, input_embeds: Tensor, paged_kv_cache: PagedKVCache):
        """One token of each of b sequences: [b, 1, h] -> [b, 1, V], computed as the b tokens of one [1, b, h]
        chunk (the KV cache's begin_forward says which sequence each token belongs to): the projections are then
        the prefill matmuls, whose hand-written CPU kernels stream each weight once for all b tokens."""
        b, _, h = input_embeds.shape
        logits = self._logits(self.model(op.reshape(input_embeds, (1, b, h)), paged_kv_cache))
        return op.reshape(logits, (b, 1, self.cfg.vocab_size)), paged_kv_cache

    def batch_verify(self, input_embeds: Tensor, paged_kv_cache: PagedKVCache):
        """Draft tokens of several sequences (speculative decoding): logits at every position."""
        return self._logits(self.model(input_embeds, paged_kv_cache)), paged_kv_cache

    def _step_embed(self, input_ids: Tensor) -> Tensor:
        return op.reshape(self.embed(input_ids), [1, 1, self.cfg.hidden_size])

    def decode_greedy(self, input_ids: Tensor, paged_kv_cache: PagedKVCache):
        """embed + decode + argmax of one token id in one call, the next id back instead of the logits: a
        host-side greedy step is then one library call, with no logits copied out (the Python between
        calls runs on caches the weights' stream evicted; SmolLM2 q4f16 decode 1.09x, same tokens)."""
        logits = self._logits(self.model(self._step_embed(input_ids), paged_kv_cache))
        return greedy_token(logits, self.cfg.vocab_size), paged_kv_cache

    def kv_rope(self) -> dict[str, Any]:
        """The RoPE arguments of the KV cache below (one place: the CPU RoPE kernel reads them too)."""
        c = self.cfg
        return {"rope_theta": c.rope_theta, "rope_scale": 1, "rope_scaling": c.rope_scaling, "rotary_dim": c.head_dim}

    def rope_settings(self) -> str:
        """The KV cache's RoPE settings, for the CPU RoPE kernel (cpu_rope.py)."""
        c, r = self.cfg, self.kv_rope()
        return rope_args(r["rope_theta"], r["rope_scale"], c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                         self.kv_dtype, r["rope_scaling"], r["rotary_dim"])

    def create_tir_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                                  prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                                  support_sliding_window: tirx.Var) -> PagedKVCache:
        c = self.cfg
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=_shape_expr([0, c.num_hidden_layers]),
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            **self.kv_rope(),
            rope_ext_factors=_empty_ext_factors(),
            enable_disaggregation=False,
            dtype=self.kv_dtype,
            target=self.target,
        )

    def export_spec(self) -> dict[str, Any]:
        h = self.cfg.hidden_size
        packed = {"$": {"param_mode": "packed", "effect_mode": "none"}}
        kv = nn.spec.Object(object_type=PagedKVCache)
        return {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), **packed},
            "prefill": {"input_embed": nn.spec.Tensor([1, "seq_len", h], self.dtype),
                        "paged_kv_cache": kv, **packed},
            "prefill_all_logits": {"input_embed": nn.spec.Tensor([1, "seq_len", h], self.dtype),
                                   "paged_kv_cache": kv, **packed},
            "decode": {"input_embed": nn.spec.Tensor([1, 1, h], self.dtype),
                       "paged_kv_cache": kv, **packed},
            **greedy_entry_spec(self.target, {"paged_kv_cache": kv}, packed),
            "batch_prefill": {"input_embeds": nn.spec.Tensor([1, "seq_len", h], self.dtype),
                              "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                              "paged_kv_cache": kv, **packed},
            # the b sequences' tokens are computed as one chunk: its size is the prefill kernels' seq_len
            "batch_decode": {"input_embeds": nn.spec.Tensor(["seq_len", 1, h], self.dtype),
                             "paged_kv_cache": kv, **packed},
            "batch_verify": {"input_embeds": nn.spec.Tensor([1, "seq_len", h], self.dtype),
                             "paged_kv_cache": kv, **packed},
            "create_tir_paged_kv_cache": kv_cache_spec(),
            **self.engine_spec(),
        }

    def metadata(self, quantization: str, params: list[tuple[str, Any]]) -> dict[str, Any]:
        c = self.cfg
        return {
            "model_type": c.family,
            "quantization": quantization,
            "context_window_size": c.context_window_size,
            "sliding_window_size": -1,
            "attention_sink_size": -1,
            "prefill_chunk_size": c.prefill_chunk_size,
            "tensor_parallel_shards": 1,
            "pipeline_parallel_stages": 1,
            "kv_state_kind": "kv_cache",
            "max_batch_size": c.max_batch_size,
            "params": [{"name": n, "shape": [int(x) for x in p.shape], "dtype": p.dtype, "preprocs": []}
                       for n, p in params],
            "kv_cache": {
                "num_hidden_layers": c.num_hidden_layers,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim,
                "dtype": self.kv_dtype,
            },
            "model_config": c.to_json(),
        }


def _shape_expr(values):
    return relax.ShapeExpr(values)


def _empty_ext_factors():
    """No long-RoPE factors: the runtime checks for an undefined tensor, so pass a plain 0."""
    return relax.prim_value(0)


def _last_token(h: Tensor) -> Tensor:
    """[b, s, d] -> [b, 1, d]: the hidden state of the chunk's last position."""
    def last(x):
        b, s, d = x.shape
        return te.compute((b, 1, d), lambda i, _, k: x[i, s - 1, k], name="last_token")

    return op.tensor_expr_op(last, "last_token", [h])
