"""Model families: which config class parses a HF config and which nn.Module implements it."""

from __future__ import annotations

from typing import Any

from pipeline.frontend.hf_config import text_config
from pipeline.models.llama import DecoderConfig, DecoderLM
from pipeline.models.qwen3_5 import HybridConfig, HybridLM


def config_from_hf(hf: dict[str, Any], *, source: str = "config.json", **kwargs: Any):
    """The family's config dataclass for a HF config.json (hybrid Qwen3.5 or the dense GQA decoder)."""
    family = HybridConfig if text_config(hf, source=source).hybrid else DecoderConfig
    return family.from_hf(hf, source=source, **kwargs)


def model_class(cfg: Any):
    return HybridLM if isinstance(cfg, HybridConfig) else DecoderLM
