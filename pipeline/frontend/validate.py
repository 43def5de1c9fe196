"""The model config checked against the checkpoint's tensors before any stage runs.

A config that disagrees with its weights used to be found late or never: 0 or 1 layers silently dropped
the rest, -1 built a bundle that cannot load, a GGUF whose block count said 100000 while it held 30 blocks
built an enormous module for minutes, float weights relabelled as int32 were converted as numbers. Here
the config's own ranges are read by `hf_config.text_config`; this module compares them with what the
checkpoint holds (names, shapes, dtypes: header facts, no tensor data is read), and each disagreement is
one line naming the field, the tensor and the file.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.errors import ConfigError, WeightsError
from pipeline.frontend.hf_config import TextConfig

# Parts of multimodal / speculative checkpoints that text generation never reads.
UNUSED_PREFIXES = {"model.visual.": "vision tower", "mtp.": "multi-token-prediction head"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# integer dtypes as checkpoints name them (safetensors: int32, uint8, bool; GGUF: i8 ... i64); GGUF's
# quantized block types (q4_0, q8_0, ...) are weights the reader dequantizes
_INTEGER = re.compile(r"(u?int\d+|bool|i\d+)")
FIX = "use the config.json that came with these weights"


def text_tensor_names(ckpt: Any) -> list[str]:
    return [n for n in ckpt.names() if not n.startswith(tuple(UNUSED_PREFIXES))]


def check_against_checkpoint(text: TextConfig, ckpt: Any, source: object) -> None:
    """ConfigError / WeightsError for the first way `text` (from `source`) disagrees with `ckpt`'s tensors."""
    names = text_tensor_names(ckpt)
    layers = sorted({int(m.group(1)) for n in names if (m := _LAYER.search(n))})
    held = layers[-1] + 1 if layers else 0
    if held != text.num_hidden_layers or len(layers) != held:
        gaps = f" (blocks {sorted(set(range(held)) - set(layers))[:5]} missing)" if len(layers) != held else ""
        field = "block_count (GGUF metadata)" if getattr(ckpt, "format", "") == "gguf" else "num_hidden_layers"
        raise ConfigError(f"{field} is {text.num_hidden_layers} but the checkpoint {ckpt.path.name} "
                          f"holds {held} layers{gaps}", path=source, fix=FIX)
    for name in names:
        dtype = str(ckpt.dtype(name))
        if _INTEGER.fullmatch(dtype):
            raise WeightsError(f"tensor {name} is stored as {dtype}; a model weight must be a float type",
                               path=ckpt.path, fix="re-export the checkpoint (its header labels floats as "
                                                   "integers)")
    embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
    if embed is not None:
        rows, cols = ckpt.shape(embed)
        _expect(rows == text.vocab_size, f"vocab_size is {text.vocab_size} but {embed} has {rows} rows", source)
        _expect(cols == text.hidden_size, f"hidden_size is {text.hidden_size} but {embed} has {cols} columns",
                source)
    full = [i for i, kind in enumerate(text.layer_types) if kind == "full_attention"]
    if full:
        prefix = _layer_prefix(names, full[0])
        q, k = f"{prefix}self_attn.q_proj.weight", f"{prefix}self_attn.k_proj.weight"
        gate = 2 if text.attn_output_gate else 1
        if q in ckpt:
            want = text.num_attention_heads * text.head_dim * gate
            _expect(ckpt.shape(q)[0] == want,
                    f"num_attention_heads x head_dim{' x 2 (output gate)' if gate == 2 else ''} is {want} but "
                    f"{q} has {ckpt.shape(q)[0]} rows", source)
        if k in ckpt:
            want = text.num_key_value_heads * text.head_dim
            _expect(ckpt.shape(k)[0] == want,
                    f"num_key_value_heads x head_dim is {want} but {k} has {ckpt.shape(k)[0]} rows", source)
    gate_proj = f"{_layer_prefix(names, 0)}mlp.gate_proj.weight"
    if not text.is_moe and gate_proj in ckpt:
        rows = ckpt.shape(gate_proj)[0]
        _expect(rows == text.intermediate_size,
                f"intermediate_size is {text.intermediate_size} but {gate_proj} has {rows} rows", source)


def _layer_prefix(names: list[str], layer: int) -> str:
    """The name prefix of one decoder layer (`model.layers.3.` or a wrapper's `model.language_model.layers.3.`)."""
    marker = f"layers.{layer}."
    for n in names:
        at = n.find(marker)
        if at >= 0 and (at == 0 or n[at - 1] == "."):
            return n[:at + len(marker)]
    return marker


def _expect(ok: bool, message: str, source: object) -> None:
    if not ok:
        raise ConfigError(message, path=source, fix=FIX)
