"""mlc-chat-config.json: the runtime config MLC's app runtimes (mlc4j, MLCSwift, web-llm) read.

Its `conv_template` is the whole Conversation object MLC's engine builds prompts from, fitted to the bundle's
tokenizer (pipeline/artifacts/conversation.py), and its `tokenizer_info` is detected from the bundle's
tokenizer.json as MLC does (pipeline/artifacts/tokenizer_info.py); see docs/conversation-templates.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifacts.conversation import bundle_conversation, to_json
from pipeline.artifacts.tokenizer_info import DEFAULT_INFO, detect_tokenizer_info
from pipeline.config import TILE_FIELDS
from pipeline.formats import Q4_INTERLEAVE, Q8_INTERLEAVE, T2_INTERLEAVE, T3_INTERLEAVE

CHAT_CONFIG_VERSION = "0.1.0"


def chat_config(loaded: Any, quant: Any, build_info: dict[str, Any], tokenizer_files: list[str],
                folder: Path | None = None, report: Any = None) -> dict:
    """`folder`: where the bundle's tokenizer files were written (None: not known, MLC's defaults are used);
    `report`: where a conversation template that does not reproduce the tokenizer's chat template is warned about."""
    d = loaded.decoder
    gen = loaded.generation_config or {}
    hf = loaded.hf_config

    def first(*vals):
        return next((v for v in vals if v is not None), None)

    eos = first(gen.get("eos_token_id"), hf.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    has_tokenizer = folder is not None and bool(tokenizer_files)
    fitted = bundle_conversation(loaded.spec.conv_template, Path(folder) if has_tokenizer else None, eos_ids,
                                 model_file=loaded.spec.path)
    for warning in fitted.warnings if report is not None else ():
        report.info(f"[yellow]warning:[/] {warning}")
    return {
        "version": CHAT_CONFIG_VERSION,
        "model_type": d.family,
        "quantization": quant.name,
        "model_config": {**d.to_json(), "hf_architectures": hf.get("architectures", [])},
        "vocab_size": d.vocab_size,
        "context_window_size": d.context_window_size,
        "sliding_window_size": -1,
        "prefill_chunk_size": d.prefill_chunk_size,
        "attention_sink_size": -1,
        "tensor_parallel_shards": 1,
        "pipeline_parallel_stages": 1,
        "temperature": first(gen.get("temperature"), 0.7),
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": first(gen.get("repetition_penalty"), 1.0),
        "top_p": first(gen.get("top_p"), 0.95),
        "tokenizer_files": sorted(tokenizer_files),
        "tokenizer_info": detect_tokenizer_info(Path(folder)) if has_tokenizer else dict(DEFAULT_INFO),
        "conv_template": to_json(fitted.conv),
        "pad_token_id": first(hf.get("pad_token_id"), 0),
        "bos_token_id": first(gen.get("bos_token_id"), hf.get("bos_token_id")),
        "eos_token_id": eos_ids,
        "model_task": "chat",
        "model_lib": f"lib/{build_info['library']}",
        "system_lib_prefix": build_info["system_lib_prefix"],
        "activation_dtype": build_info["metadata"]["activation_dtype"],
        "weight_layout": build_info["metadata"]["weight_layout"],
        **{f: build_info["metadata"][f] for f in (*TILE_FIELDS, Q4_INTERLEAVE, Q8_INTERLEAVE, T2_INTERLEAVE, T3_INTERLEAVE) if build_info["metadata"].get(f)},
    }
