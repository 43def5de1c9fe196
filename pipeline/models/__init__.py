"""Model families: which config class parses a HF config and which nn.Module implements it."""

from __future__ import annotations

from typing import Any


def config_from_hf(hf: dict[str, Any], **kwargs: Any):
    """The family's config dataclass for a HF config.json (hybrid Qwen3.5 or the dense GQA decoder)."""
    from .llama import DecoderConfig
    from .qwen3_5 import HybridConfig, is_hybrid

    return (HybridConfig if is_hybrid(hf) else DecoderConfig).from_hf(hf, **kwargs)


def model_class(cfg: Any):
    from .llama import DecoderLM
    from .qwen3_5 import HybridConfig, HybridLM

    return HybridLM if isinstance(cfg, HybridConfig) else DecoderLM
