"""Checkpoint tensors -> the compiled model's parameters, one tensor at a time.

Maps HF names onto the fused layout (q/k/v -> qkv_proj, gate/up -> gate_up_proj), checks every shape
against the config, and quantizes as the parameter's dtype asks (uint32 codes + fp16 scales for q4,
a cast otherwise). Nothing larger than one fused tensor is ever held in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .errors import WeightsError
from .quantize import quantize_q4

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         # Gated DeltaNet (Qwen3.5): one input GEMV instead of four
         "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
# Where multimodal checkpoints keep the text model (Qwen3_5ForConditionalGeneration).
TEXT_PREFIXES = ("model.language_model.",)
QUANT_SUFFIXES = (".q_weight", ".q_scale")


def hf_sources(param: str) -> tuple[list[str], str]:
    """Our parameter name -> (HF tensor names to concatenate along axis 0, what they feed)."""
    base, _, leaf = param.rpartition(".")
    src_leaf = "weight" if leaf in ("weight", "q_weight", "q_scale") else leaf
    owner, _, module = base.rpartition(".")
    if module in FUSED:
        return [f"{owner}.{part}.{src_leaf}" for part in FUSED[module]], src_leaf
    return [f"{base}.{src_leaf}"], src_leaf


def checkpoint_name(ckpt: Any, name: str) -> str:
    """`name` as the checkpoint spells it: text-only names (model.layers...) may sit under the text prefix
    of a multimodal checkpoint (model.language_model.layers...)."""
    if name in ckpt or not name.startswith("model."):
        return name
    for prefix in TEXT_PREFIXES:
        alt = prefix + name[len("model."):]
        if alt in ckpt:
            return alt
    return name


def _load_source(ckpt: Any, param: str, tied: bool) -> np.ndarray:
    names, _ = hf_sources(param)
    if tied and names == ["lm_head.weight"]:
        names = ["model.embed_tokens.weight"]
    names = [checkpoint_name(ckpt, n) for n in names]
    missing = [n for n in names if n not in ckpt]
    if missing:
        raise WeightsError(f"tensor {missing[0]!r} (needed for {param}) is not in the checkpoint",
                           path=ckpt.path, fix="check that the weights belong to this model config")
    parts = [ckpt.get(n) for n in names]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def iter_converted(ckpt: Any, params: list[tuple[str, Any]], layout: str, *, tied: bool = False,
                   on_tensor: Callable[[str, int], None] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) in the model's parameter order, ready for the tensor cache."""
    pending: dict[str, np.ndarray] = {}
    for name, p in params:
        shape = tuple(int(x) for x in p.shape)
        if name in pending:
            arr = pending.pop(name)
        else:
            src = _load_source(ckpt, name, tied)
            if name.endswith(QUANT_SUFFIXES):
                base = name.rsplit(".", 1)[0]
                tensor_layout = "NK" if base.endswith("embed_tokens") else layout
                try:
                    packed, scale = quantize_q4(src, tensor_layout)
                except ValueError as err:
                    raise WeightsError(f"cannot quantize {name} of shape {list(src.shape)}: {err}",
                                       path=ckpt.path, fix="use a float scheme (q0f16) for this model") from None
                is_weight = name.endswith(".q_weight")
                arr = packed if is_weight else scale
                pending[base + (".q_scale" if is_weight else ".q_weight")] = scale if is_weight else packed
            else:
                arr = src.astype(p.dtype, copy=False)
        if tuple(arr.shape) != shape:
            raise WeightsError(
                f"shape mismatch for {name}: the config implies {list(shape)}, the weights give "
                f"{list(arr.shape)}", path=ckpt.path, fix="use the config.json that came with these weights")
        if on_tensor:
            on_tensor(name, arr.nbytes)
        yield name, arr
