"""The one reader of a Hugging Face config.json: the shape facts of its text model, each field read once.

The model definitions (`models.config_from_hf`), the memory plan and auto-quant plan (`quant.memory_plan`,
`quant.auto_plan`) and calibration (`quant.calibrate`) all need the same facts: where the text model's
fields live (top level, or the nested ``text_config`` of a multimodal wrapper such as Qwen3.5's), which
defaults a missing field takes (``head_dim``, KV heads, the hybrid's ``layer_types``), where RoPE
parameters are (``rope_theta`` / ``rope_scaling`` of transformers 4, ``rope_parameters`` of transformers 5).
Each of them reading the dict its own way let the numbers of the plan drift from the model that is built;
`text_config(hf)` decides every such question here, once, and raises one-line `ConfigError`s naming the
missing or broken field. What a family then supports (which layer kinds, RoPE types, biases) stays with
the family's code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import ConfigError

__all__ = ["HYBRID_ARCHITECTURES", "HYBRID_MODEL_TYPES", "LAYER_KINDS", "LinearAttention", "Experts", "TextConfig",
           "text_config"]

# The Qwen3.5 hybrid (Gated DeltaNet + gated attention): the multimodal wrapper and the text-only model, dense
# or with mixture-of-experts MLPs (the "35B-A3B").
HYBRID_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# model types whose router always renormalises its top-k probabilities (the config has no norm_topk_prob)
ALWAYS_NORM_TOPK = ("qwen3_5_moe", "qwen3_5_moe_text")
LAYER_KINDS = ("linear_attention", "full_attention")
DEFAULT_FULL_ATTENTION_INTERVAL = 4   # the hybrid's layer_types when the config lists none
DEFAULT_CONV_KERNEL = 4               # transformers' default linear_conv_kernel_dim
FIX = "give the model's complete HF config.json"
MAX_VOCAB = 2**22   # a sanity bound: the largest real vocabularies are ~262K


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet (``linear_attention``) layers' sizes."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the causal depthwise conv: q and k (key heads x key dim) and v."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP's sizes and routing (Qwen3-MoE, Qwen3.5-MoE)."""

    num_experts: int
    top_k: int                           # experts routed per token (num_experts_per_tok)
    intermediate_size: int               # each routed expert's FFN width (moe_intermediate_size)
    norm_topk_prob: bool                 # renormalise the k selected probabilities to sum to 1
    shared_intermediate_size: int = 0    # the always-on shared expert (0: none) and its sigmoid gate
    decoder_sparse_step: int = 1         # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()   # ... and i is not listed here (those keep a dense MLP)

    def sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class TextConfig:
    """What a HF config says about its text model. ``None`` marks a field the config leaves out where the
    default is the family's to choose (``attention_bias``, ``rope_theta``, ``partial_rotary_factor``,
    ``max_position_embeddings``)."""

    model_type: str | None               # the text model's (text_config's), else the wrapper's
    architectures: tuple[str, ...]       # the wrapper's (what the checkpoint was saved as)
    hybrid: bool                         # a Qwen3.5 hybrid (by architecture or model type)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int             # num_attention_heads when a dense config leaves it out
    head_dim: int                        # hidden_size // num_attention_heads when left out
    vocab_size: int
    tie_word_embeddings: bool            # the wrapper's when it says, as transformers ties the checkpoint
    layer_types: tuple[str, ...]         # one per layer; defaulted for the hybrid, all full_attention else
    linear: LinearAttention | None       # hybrids (and any config with linear_attention layers)
    attn_output_gate: bool               # q_proj doubled by the output gate (always on for the hybrid)
    attention_bias: bool | None
    mlp_bias: bool
    sliding_window: int | None           # the attention window of a config that uses one, else None
    rms_norm_eps: float
    rope_theta: float | None
    rope_scaling: dict[str, Any]         # {} for plain RoPE; else with "rope_type" (never "type")
    partial_rotary_factor: float | None
    max_position_embeddings: int | None
    num_experts: int                     # 0 for dense MLPs
    mlp_only_layers: tuple[int, ...]
    experts: Experts | None              # MoE routing and sizes (None for dense MLPs)
    nested: bool                         # the fields came from a multimodal wrapper's text_config
    text: dict[str, Any] = field(repr=False)   # the text model's own fields (for transformers' configs)

    @property
    def full_attention_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def linear_attention_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts or self.mlp_only_layers)


def _text_fields(hf: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The text model's fields (a nested ``text_config`` merged with what the wrapper decides) and whether
    they were nested."""
    text = hf.get("text_config")
    if not isinstance(text, Mapping) or not text:
        return dict(hf), False
    merged = dict(text)
    if merged.get("model_type") is None:
        merged["model_type"] = hf.get("model_type")
    return merged, True


def _tied(hf: Mapping[str, Any], text: Mapping[str, Any]) -> bool:
    # transformers ties the checkpoint's lm_head by the config of the class it was saved from: the wrapper
    return bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def _rope(text: Mapping[str, Any]) -> tuple[float | None, dict[str, Any], float | None]:
    """(rope_theta, rope_scaling, partial_rotary_factor): transformers 5 folds all three into
    ``rope_parameters``; transformers 4 configs keep them at the top level."""
    params = dict(text.get("rope_parameters") or {})
    theta = params.get("rope_theta") or text.get("rope_theta")
    scaling = dict(text.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    if scaling.get("type") and not scaling.get("rope_type"):
        scaling["rope_type"] = scaling["type"]
    if scaling.get("rope_type") in (None, "default"):
        scaling = {}
    partial = params.get("partial_rotary_factor") or text.get("partial_rotary_factor")
    return (None if theta is None else float(theta)), scaling, (None if partial is None else float(partial))


def _sliding_window(text: Mapping[str, Any], types: list[str]) -> int | None:
    """Mistral's ``sliding_window`` is on when set; Qwen2 / Qwen3 carry one that ``use_sliding_window`` (or
    transformers 5's ``sliding_attention`` layer types) turns on."""
    window = text.get("sliding_window")
    used = "sliding_attention" in types or bool(text.get("use_sliding_window", window is not None))
    return int(window) if used and window else None


def text_config(hf: Mapping[str, Any], *, source: object = "config.json") -> TextConfig:
    """Parse ``hf`` (a config.json dict, possibly a multimodal wrapper); ConfigError names what is wrong."""
    if not isinstance(hf, Mapping):
        raise ConfigError(f"must hold a JSON object, not a {type(hf).__name__}", path=source, fix=FIX)
    text, nested = _text_fields(hf)
    where = " in text_config" if nested else ""

    def number(key: str, kind: type = int, default: Any = None) -> Any:
        value = text.get(key)
        if value is None:
            if default is None:
                raise ConfigError(f"missing field {key!r}{where}", path=source, fix=FIX)
            return default
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"field {key!r}{where} must be a number, not {value!r}", path=source,
                              fix=FIX) from None

    archs = tuple(str(a) for a in hf.get("architectures") or ())
    model_type = text.get("model_type")
    hybrid = bool(set(archs) & set(HYBRID_ARCHITECTURES)) or hf.get("model_type") in HYBRID_MODEL_TYPES \
        or model_type in HYBRID_MODEL_TYPES

    hidden = number("hidden_size")
    heads = number("num_attention_heads")
    if heads <= 0:
        raise ConfigError(f"num_attention_heads{where} must be positive, got {heads}", path=source, fix=FIX)
    n_layers = number("num_hidden_layers")
    # dense families (Llama, Qwen2/3) default the KV heads to the attention heads (no GQA); the hybrid's
    # transformers default is not, so a hybrid config must say
    kv_heads = number("num_key_value_heads", default=None if hybrid else heads)
    if text.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"hidden_size {hidden}{where} is not a multiple of num_attention_heads {heads} (and no "
                          "head_dim is given)", path=source, fix=FIX)
    head_dim = number("head_dim", default=hidden // heads)
    experts = _experts(text, number, source, where, n_layers)
    # an all-MoE config (Qwen3.5-35B-A3B) has no dense MLP width: the routed experts' stands in
    intermediate = number("intermediate_size", default=experts.intermediate_size if experts else None)
    vocab = number("vocab_size")
    for key, value in (("hidden_size", hidden), ("num_hidden_layers", n_layers), ("num_key_value_heads", kv_heads),
                       ("head_dim", head_dim), ("intermediate_size", intermediate), ("vocab_size", vocab)):
        if value <= 0:
            raise ConfigError(f"{key}{where} must be positive, got {value}", path=source, fix=FIX)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads}{where} is not a multiple of num_key_value_heads {kv_heads}",
                          path=source, fix=FIX)
    if vocab > MAX_VOCAB:
        raise ConfigError(f"vocab_size {vocab}{where} is implausible (over {MAX_VOCAB})", path=source, fix=FIX)

    types = list(text.get("layer_types") or [])
    if not types:
        if hybrid:
            interval = number("full_attention_interval", default=DEFAULT_FULL_ATTENTION_INTERVAL)
            types = [LAYER_KINDS[(i + 1) % interval == 0] for i in range(n_layers)]
        else:
            types = ["full_attention"] * n_layers
    if len(types) != n_layers:
        raise ConfigError(f"layer_types{where} has {len(types)} entries but num_hidden_layers is {n_layers}",
                          path=source, fix="fix layer_types in config.json")

    linear = None
    if hybrid or "linear_attention" in types:
        linear = LinearAttention(number("linear_num_key_heads"), number("linear_num_value_heads"),
                                 number("linear_key_head_dim"), number("linear_value_head_dim"),
                                 number("linear_conv_kernel_dim", default=DEFAULT_CONV_KERNEL))

    theta, scaling, partial = _rope(text)
    eps = number("rms_norm_eps", float, 1e-6)
    if not (math.isfinite(eps) and eps > 0):
        raise ConfigError(f"rms_norm_eps{where} must be a positive number, got {eps}", path=source, fix=FIX)
    if theta is not None and not (math.isfinite(theta) and theta > 0):
        raise ConfigError(f"rope_theta{where} must be a positive number, got {theta}", path=source, fix=FIX)
    if partial is not None and not 0 < partial <= 1:
        raise ConfigError(f"partial_rotary_factor{where} must be in (0, 1], got {partial}", path=source, fix=FIX)
    bias = text.get("attention_bias")
    max_pos = text.get("max_position_embeddings")
    tied = _tied(hf, text)
    text["tie_word_embeddings"] = tied
    return TextConfig(
        model_type=model_type,
        architectures=archs,
        hybrid=hybrid,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        layer_types=tuple(str(t) for t in types),
        linear=linear,
        attn_output_gate=bool(text.get("attn_output_gate", hybrid)),
        attention_bias=None if bias is None else bool(bias),
        mlp_bias=bool(text.get("mlp_bias", False)),
        sliding_window=_sliding_window(text, types),
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        max_position_embeddings=None if not max_pos else int(max_pos),
        num_experts=experts.num_experts if experts else 0,
        mlp_only_layers=experts.mlp_only_layers if experts else tuple(text.get("mlp_only_layers") or ()),
        experts=experts,
        nested=nested,
        text=text,
    )


def _experts(text: Mapping[str, Any], number: Any, source: object, where: str, n_layers: int) -> Experts | None:
    """The MoE fields (None when the config has no experts); ConfigError for a top-k / size out of range."""
    count = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    if count <= 0:
        return None
    top_k = number("num_experts_per_tok")
    if not 0 < top_k <= count:
        raise ConfigError(f"num_experts_per_tok{where} must be in [1, num_experts = {count}], got {top_k}",
                          path=source, fix=FIX)
    width = number("moe_intermediate_size")
    shared = number("shared_expert_intermediate_size", default=0)
    step = number("decoder_sparse_step", default=1)
    if width <= 0 or shared < 0 or step <= 0:
        raise ConfigError(f"moe_intermediate_size / shared_expert_intermediate_size / decoder_sparse_step{where} "
                          f"must be positive, got {width} / {shared} / {step}", path=source, fix=FIX)
    dense = tuple(int(i) for i in text.get("mlp_only_layers") or ())
    if any(not 0 <= i < n_layers for i in dense):
        raise ConfigError(f"mlp_only_layers{where} names layers outside 0..{n_layers - 1}: {list(dense)}",
                          path=source, fix=FIX)
    norm = text.get("model_type") in ALWAYS_NORM_TOPK or bool(text.get("norm_topk_prob", False))
    return Experts(count, top_k, width, norm, shared, step, dense)
