"""Checkpoint tensors -> the compiled model's parameters, one tensor at a time.

Maps HF names onto the fused layout (q/k/v -> qkv_proj, gate/up -> gate_up_proj), checks every shape
against the config, and quantizes as the parameter's dtype asks (uint32 codes + fp16 scales for q4,
a cast otherwise).

Memory stays bounded whatever the model size: sources are read in row blocks of about `block_bytes` of
float32 (`Checkpoint.get_rows`) and each block is converted straight into a preallocated array of the
parameter's final shape (for q4 an eighth of the float32 size). Rows are independent (q4 groups run
along the input axis) and fused parameters are concatenations along axis 0, so the result is
bit-identical to converting the whole concatenated tensor at once. The largest thing alive is the
output array plus one block and its temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .errors import WeightsError
from .models.layers import CODES_PER_WORD, GROUP
from .quantize import quantize_q4, quantize_q8

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         # Gated DeltaNet (Qwen3.5): one input GEMV instead of four
         "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
# Where multimodal checkpoints keep the text model (Qwen3_5ForConditionalGeneration).
TEXT_PREFIXES = ("model.language_model.",)
QUANT_SUFFIXES = (".q_weight", ".q_scale")
DEFAULT_BLOCK_BYTES = 64 * 2**20   # float32 bytes of source rows converted at a time


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


def _source_names(ckpt: Any, param: str, tied: bool) -> list[str]:
    names, _ = hf_sources(param)
    if tied and names == ["lm_head.weight"]:
        names = ["model.embed_tokens.weight"]
    names = [checkpoint_name(ckpt, n) for n in names]
    missing = [n for n in names if n not in ckpt]
    if missing:
        raise WeightsError(f"tensor {missing[0]!r} (needed for {param}) is not in the checkpoint",
                           path=ckpt.path, fix="check that the weights belong to this model config")
    return names


def _load_source(ckpt: Any, param: str, tied: bool) -> np.ndarray:
    parts = [ckpt.get(n) for n in _source_names(ckpt, param, tied)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def _source_shape(ckpt: Any, param: str, names: list[str]) -> tuple[int, ...]:
    """Shape of the sources concatenated along axis 0 (checked from headers, nothing read)."""
    shapes = [tuple(int(d) for d in ckpt.shape(n)) for n in names]
    if any(not s or s[1:] != shapes[0][1:] for s in shapes):
        raise WeightsError(f"cannot join {', '.join(names)} into {param}: shapes {[list(s) for s in shapes]} "
                           "differ after the first axis", path=ckpt.path,
                           fix="use the config.json that came with these weights")
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def _row_blocks(ckpt: Any, names: list[str], block_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first output row, float32 rows) of the sources concatenated along axis 0, in blocks of about
    `block_bytes` (at least one row)."""
    offset = 0
    for name in names:
        shape = tuple(int(d) for d in ckpt.shape(name))
        rows = shape[0]
        step = max(1, block_bytes // max(1, 4 * math.prod(shape[1:])))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            yield offset + start, ckpt.get_rows(name, start, stop)
        offset += rows


def _mismatch(ckpt: Any, name: str, want: tuple[int, ...], got: tuple[int, ...]) -> WeightsError:
    return WeightsError(f"shape mismatch for {name}: the config implies {list(want)}, the weights give "
                        f"{list(got)}", path=ckpt.path, fix="use the config.json that came with these weights")


def _convert_q4(ckpt: Any, name: str, names: list[str], layout: str, shapes: dict[str, tuple[int, ...]],
                block_bytes: int, on_bytes: Callable[[int], None] | None,
                bits: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Group-quantize the sources of `name` (a .q_weight or .q_scale) block by block -> (codes, scale):
    int4 packed 8 per uint32 (`bits=4`) or int8 codes (`bits=8`)."""
    src_shape = _source_shape(ckpt, name, names)
    n = src_shape[0]
    if len(src_shape) != 2 or src_shape[1] % GROUP:
        why = (f"reduction dim {src_shape[1]} is not a multiple of the group size {GROUP}"
               if len(src_shape) == 2 else f"expected a 2-d weight, got {len(src_shape)} dims")
        raise WeightsError(f"cannot quantize {name} of shape {list(src_shape)}: {why}",
                           path=ckpt.path, fix="use a float scheme (q0f16) for this model")
    k = src_shape[1]
    nk = layout == "NK"
    per_word = CODES_PER_WORD if bits == 4 else 1
    packed_shape = (n, k // per_word) if nk else (k // per_word, n)
    scale_shape = (n, k // GROUP) if nk else (k // GROUP, n)
    mine = packed_shape if name.endswith(".q_weight") else scale_shape
    if name in shapes and shapes[name] != mine:
        raise _mismatch(ckpt, name, shapes[name], mine)
    packed = np.empty(packed_shape, np.uint32 if bits == 4 else np.int8)
    scale = np.empty(scale_shape, np.float16)
    for r0, block in _row_blocks(ckpt, names, block_bytes):
        p, s = (quantize_q4 if bits == 4 else quantize_q8)(block, "NK")
        r1 = r0 + len(block)
        if nk:
            packed[r0:r1], scale[r0:r1] = p, s
        else:
            packed[:, r0:r1], scale[:, r0:r1] = p.T, s.T
        if on_bytes:
            on_bytes(p.nbytes if name.endswith(".q_weight") else s.nbytes)
    return packed, scale


def _convert_float(ckpt: Any, name: str, names: list[str], dtype: Any, want: tuple[int, ...],
                   block_bytes: int, on_bytes: Callable[[int], None] | None) -> np.ndarray:
    """Cast the sources of `name` to `dtype` block by block into one preallocated array."""
    src_shape = _source_shape(ckpt, name, names)
    if src_shape != want:
        raise _mismatch(ckpt, name, want, src_shape)
    out = np.empty(src_shape, np.dtype(dtype))
    for r0, block in _row_blocks(ckpt, names, block_bytes):
        out[r0:r0 + len(block)] = block.astype(out.dtype, copy=False)
        if on_bytes:
            on_bytes(len(block) * out[0:1].nbytes)
    return out


def iter_converted(ckpt: Any, params: list[tuple[str, Any]], layout: str, *, tied: bool = False,
                   on_tensor: Callable[[str, int], None] | None = None, start: int = 0,
                   block_bytes: int | None = None,
                   on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) in the model's parameter order, ready for the tensor cache.

    `start` skips the first `start` parameters without reading their sources (to resume a conversion);
    `block_bytes` bounds the float32 rows converted at a time; `on_bytes(n)` is called as output bytes
    are produced (block by block), adding up to the bytes of the tensors yielded.
    """
    block_bytes = int(block_bytes or DEFAULT_BLOCK_BYTES)
    shapes = {name: tuple(int(x) for x in p.shape) for name, p in params}
    dtypes = {name: str(p.dtype) for name, p in params}
    pending: dict[str, np.ndarray] = {}
    packed = scale = None
    for i, (name, p) in enumerate(params):
        if i < start:
            continue
        shape = shapes[name]
        if name in pending:
            arr = pending.pop(name)
            if on_bytes:
                on_bytes(arr.nbytes)
        elif name.endswith(QUANT_SUFFIXES):
            base = name.rsplit(".", 1)[0]
            # an embedding table is NK (gathered by rows) unless tied to the lm_head (see Q4Embedding)
            tensor_layout = "NK" if base.endswith("embed_tokens") and not tied else layout
            bits = 8 if dtypes.get(base + ".q_weight") == "int8" else 4
            packed, scale = _convert_q4(ckpt, name, _source_names(ckpt, name, tied), tensor_layout, shapes,
                                        block_bytes, on_bytes, bits=bits)
            is_weight = name.endswith(".q_weight")
            arr = packed if is_weight else scale
            pending[base + (".q_scale" if is_weight else ".q_weight")] = scale if is_weight else packed
        else:
            arr = _convert_float(ckpt, name, _source_names(ckpt, name, tied), p.dtype, shape, block_bytes,
                                 on_bytes)
        if tuple(arr.shape) != shape:
            raise _mismatch(ckpt, name, shape, tuple(arr.shape))
        if on_tensor:
            on_tensor(name, arr.nbytes)
        yield name, arr
        arr = packed = scale = None   # hold no finished output while converting the next tensor
