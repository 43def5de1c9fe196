"""Model families: which config class parses a HF config and which nn.Module implements it."""

from __future__ import annotations

from typing import Any

from pipeline.models.llama import DecoderConfig, DecoderLM
from pipeline.models.qwen3_5 import HybridConfig, HybridLM, is_hybrid


def config_from_hf(hf: dict[str, Any], **kwargs: Any):
    """The family's config dataclass for a HF config.json (hybrid Qwen3.5 or the dense GQA decoder)."""
    return (HybridConfig if is_hybrid(hf) else DecoderConfig).from_hf(hf, **kwargs)


def model_class(cfg: Any):
    return HybridLM if isinstance(cfg, HybridConfig) else DecoderLM
