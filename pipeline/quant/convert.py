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

Ternary parameters (attrs `format` t2 / t3, see `models.layers.LayerFactory`) are ternarised per group of
128 (`pipeline/quant/ternary.py`); with `ternary_source: native` every group must already be ternary (within one
ulp of the checkpoint's dtype) or the conversion stops with the tensor's name. Parameters marked `rotate`
get their rows multiplied by the block Walsh-Hadamard matrix before quantization (row-wise, so still
block by block).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pipeline.errors import WeightsError
from pipeline.formats import CODES_PER_WORD, GROUP, T3_INTERLEAVE
from pipeline.frontend.validate import text_tensor_names
from pipeline.quant import ternary as tern
from pipeline.quant.experts import expert_sources, with_stacked_experts
from pipeline.quant.gptq import output_error, quantize_rows
from pipeline.quant.quantize import (
    dequantize_q4,
    dequantize_q8,
    interleave_q8,
    pack_q4_levels,
    quantize_q4,
    quantize_q8,
    tile_kn,
    tile_q8,
)

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


# Checkpoint tensors no parameter reads by design: RoPE's inverse frequencies are recomputed from the config.
RECOMPUTED_SUFFIXES = (".rotary_emb.inv_freq",)


def unread_tensors(ckpt: Any, params: list[tuple[str, Any]], layout: str, tied: bool) -> list[str]:
    """The checkpoint's text-model tensors that no parameter of `params` is converted from. A config that
    names the wrong family or leaves out a field (a bias, a norm) builds a bundle that silently drops them and
    computes another model; the caller refuses that. Names only: no tensor data is read."""
    view = with_stacked_experts(ckpt)
    parts = _split_parts(params, layout)
    read: set[str] = set()
    for name, p in params:
        whole = parts[name][0] if name in parts else name
        experts = int((getattr(p, "attrs", None) or {}).get("experts") or 0)
        sources = expert_sources(whole, experts) if experts else hf_sources(whole)[0]
        if tied and sources == ["lm_head.weight"]:
            sources = ["model.embed_tokens.weight"]
        read.update(checkpoint_name(view, n) for n in sources)
    stacked = getattr(view, "stacked_name", None)
    if stacked is not None:   # a per-expert name read through StackedView reads its stacked tensor
        read.update(stacked(n) for n in list(read))
    allowed = {"lm_head.weight"} if tied else set()   # some tied checkpoints also store the (equal) head
    return [n for n in text_tensor_names(ckpt)
            if n not in read and n not in allowed and not n.endswith(RECOMPUTED_SUFFIXES)]


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


def _row_blocks(ckpt: Any, names: list[str], block_bytes: int, rotate: int = 1) -> Iterator[tuple[int, np.ndarray]]:
    """(first output row, float32 rows) of the sources concatenated along axis 0, in blocks of about
    `block_bytes` (at least one row); `rotate` > 1: each row times the block Hadamard matrix."""
    offset = 0
    for name in names:
        shape = tuple(int(d) for d in ckpt.shape(name))
        rows = shape[0]
        step = max(1, block_bytes // max(1, 4 * math.prod(shape[1:])))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            block = ckpt.get_rows(name, start, stop)
            yield offset + start, (tern.hadamard_rows(block, rotate) if rotate > 1 else block)
        offset += rows


def _mismatch(ckpt: Any, name: str, want: tuple[int, ...], got: tuple[int, ...]) -> WeightsError:
    return WeightsError(f"shape mismatch for {name}: the config implies {list(want)}, the weights give "
                        f"{list(got)}", path=ckpt.path, fix="use the config.json that came with these weights")


def _convert_q4(ckpt: Any, name: str, names: list[str], layout: str, shapes: dict[str, tuple[int, ...]],
                block_bytes: int, on_bytes: Callable[[int], None] | None,
                bits: int = 4, rotate: int = 1, calibrated: Any = None,
                stats: dict[str, float] | None = None, q8_tile: int = 0,
                q4_tile: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Group-quantize the sources of `name` (a .q_weight or .q_scale) block by block -> (codes, scale):
    int4 packed 8 per uint32 (`bits=4`) or int8 codes (`bits=8`). `calibrated` (calibrate.CalibratedInput):
    error feedback instead of round-to-nearest, with the result kept in the calibration's store (NK), so
    another layout or target of the same weights reuses it; `stats` then sums the output error
    (`calib_err`) and output energy (`calib_energy`) on the calibration inputs. `q8_tile`: KN int8 codes
    returned tiled (quantize.tile_q8), once the whole tensor is quantized; `q4_tile`: KN int4 codes and scales
    returned tiled by that many columns (quantize.tile_kn; the layer chose it, layers.tile_width), NK ones
    with that many rows interleaved (the same arrays of the transposed words)."""
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
    tiled = q8_tile and bits == 8 and not nk
    tiled4 = q4_tile and bits == 4     # NK: rows interleaved (formats.interleave_rows), the same arrays
    rows8 = q8_tile and bits == 8 and nk   # NK q8 rows interleaved (quantize.interleave_q8)
    stored_shape = (n // q8_tile, k // 2, 2 * q8_tile) if tiled else packed_shape
    stored_scale = scale_shape
    if tiled4:
        stored_shape, stored_scale = (n // q4_tile, k // per_word, q4_tile), (n // q4_tile, k // GROUP, q4_tile)
    if rows8:
        stored_shape, stored_scale = (n // q8_tile, k // 4, 4 * q8_tile), (n // q8_tile, k // GROUP, q8_tile)
    mine = stored_shape if name.endswith(".q_weight") else stored_scale
    if name in shapes and shapes[name] != mine:
        raise _mismatch(ckpt, name, shapes[name], mine)
    packed = np.empty(packed_shape, np.uint32 if bits == 4 else np.int8)
    scale = np.empty(scale_shape, np.float16)
    if calibrated is not None:
        _convert_calibrated(ckpt, name, names, packed, scale, nk, bits, block_bytes, on_bytes, calibrated, stats)
    else:
        rtn = quantize_q4 if bits == 4 else quantize_q8
        for r0, block in _row_blocks(ckpt, names, block_bytes, rotate):
            p, s = rtn(block, "NK")
            _store_rows(packed, scale, r0, p, s, nk, name, on_bytes)
    if tiled4:
        return tile_kn(packed.T if nk else packed, q4_tile), tile_kn(scale.T if nk else scale, q4_tile)
    if rows8:
        return interleave_q8(packed, q8_tile), tile_kn(scale.T, q8_tile)
    return (tile_q8(packed, q8_tile) if tiled else packed), scale


def _convert_calibrated(ckpt: Any, name: str, names: list[str], packed: np.ndarray, scale: np.ndarray, nk: bool,
                        bits: int, block_bytes: int, on_bytes: Callable[[int], None] | None, calibrated: Any,
                        stats: dict[str, float] | None) -> None:
    """Fill packed / scale (in their layout) with error-feedback quantization of the sources (gptq.py), from
    the calibration's store when this tensor was done before."""
    key = calibrated.key(names, bits)
    hit = calibrated.load(key)
    if hit is not None:
        p, s, err, energy = hit
        _store_rows(packed, scale, 0, p, s, nk, name, on_bytes)
    else:
        prep, h = calibrated.prepared(), calibrated.hessian()
        err = energy = 0.0
        deq = dequantize_q4 if bits == 4 else dequantize_q8
        # q/k/v (gate/up) rows in one call: the per-column work is the cost
        for r0, block in _joined(_row_blocks(ckpt, names, block_bytes), block_bytes):
            levels, s = quantize_rows(block, prep, "q4" if bits == 4 else "q8")
            p, s = pack_q4_levels(levels, s) if bits == 4 else (levels.astype(np.int8), s)
            err += output_error(block, deq(p, s), h)
            energy += output_error(block, np.zeros_like(block), h)
            _store_rows(packed, scale, r0, p, s, nk, name, on_bytes)
        calibrated.save(key, packed if nk else packed.T, scale if nk else scale.T, err, energy)
    if stats is not None:
        stats["calib_tensors"] = stats.get("calib_tensors", 0) + 1
        stats["calib_err"] = stats.get("calib_err", 0.0) + err
        stats["calib_energy"] = stats.get("calib_energy", 0.0) + energy
        rel = err / energy if energy else 0.0
        if rel >= stats.get("calib_worst", -1.0):
            stats["calib_worst"], stats["calib_worst_name"] = rel, name.rsplit(".", 1)[0]


def _joined(blocks: Iterator[tuple[int, np.ndarray]], block_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
    """Consecutive row blocks (of several sources) joined up to about `block_bytes` of float32."""
    held: list[np.ndarray] = []
    first = size = 0
    for r0, block in blocks:
        if held and size + block.nbytes > block_bytes:
            yield first, np.concatenate(held) if len(held) > 1 else held[0]
            held, size = [], 0
        if not held:
            first = r0
        held.append(block)
        size += block.nbytes
    if held:
        yield first, np.concatenate(held) if len(held) > 1 else held[0]


def _store_rows(packed: np.ndarray, scale: np.ndarray, r0: int, p: np.ndarray, s: np.ndarray, nk: bool,
                name: str, on_bytes: Callable[[int], None] | None) -> None:
    """Place one block of NK-quantized rows (codes p, scales s) at row r0 of the outputs in their layout
    (KN: as columns) and count the output bytes of the tensor being produced."""
    r1 = r0 + len(p)
    if nk:
        packed[r0:r1], scale[r0:r1] = p, s
    else:
        packed[:, r0:r1], scale[:, r0:r1] = p.T, s.T
    if on_bytes:
        on_bytes(p.nbytes if name.endswith(".q_weight") else s.nbytes)


# coarsest first: the tolerance of a fused parameter is that of its least precise source
_TOLERANCE_ORDER = ("bfloat16", "float16", "float32", "float64")


def _source_dtype(ckpt: Any, names: list[str]) -> str:
    kinds = [str(ckpt.dtype(n)) for n in names]
    return next((d for d in _TOLERANCE_ORDER if d in kinds), "float32")


def _not_ternary(ckpt: Any, name: str, names: list[str], row: int, group: int, block: np.ndarray,
                 fmt: str = "t2") -> WeightsError:
    """Which source tensor and group failed, and what it holds."""
    for src in names:
        rows = int(ckpt.shape(src)[0])
        if row < rows:
            break
        row -= rows
    vals = np.abs(block[:, group * tern.GROUP:(group + 1) * tern.GROUP])
    distinct = len(np.unique(vals[vals > 0]))
    if fmt in tern.BINARY:
        zeros = int((vals == 0).sum())
        return WeightsError(
            f"{src} (for {name}) is not binary: group {group} of row {row} holds {distinct} distinct nonzero "
            f"magnitudes and {zeros} zeros, not one magnitude", path=ckpt.path,
            fix="use --quant binary_ptq to binarise an ordinary model (destroys its quality), ternary for a "
                "natively ternary one, or a natively binary checkpoint")
    return WeightsError(
        f"{src} (for {name}) is not ternary: group {group} of row {row} holds {distinct} distinct nonzero "
        f"magnitudes, not one", path=ckpt.path,
        fix="use --quant ternary_ptq to ternarise an ordinary model (loses quality), or a natively ternary "
            "checkpoint")


def _convert_ternary(ckpt: Any, name: str, names: list[str], layout: str, shapes: dict[str, tuple[int, ...]],
                     block_bytes: int, on_bytes: Callable[[int], None] | None, attrs: dict[str, Any],
                     stats: dict[str, float] | None) -> tuple[np.ndarray, np.ndarray]:
    """Ternarise (or, `ternary_source: native`, import exactly) the sources of `name` block by block ->
    (packed codes, fp16 scales) in `layout`. `stats` accumulates the weight-space error and, for native
    imports, how many groups' scale is not exactly an fp16 number."""
    fmt, native = attrs["format"], attrs.get("ternary_source", "native") == "native"
    src_shape = _source_shape(ckpt, name, names)
    if len(src_shape) != 2:
        raise WeightsError(f"cannot ternarise {name} of shape {list(src_shape)}: expected a 2-d weight",
                           path=ckpt.path, fix="use a float scheme (q0f16) for this model")
    n, k = src_shape
    nk = layout == "NK"
    cols, groups = tern.packed_len(fmt, k), tern.n_groups(k)
    packed_shape, scale_shape = ((n, cols), (n, groups)) if nk else ((cols, n), (groups, n))
    # quantize.tile_kn (NK: of the rows), the layer's choice
    tile = int(attrs.get("t2_tile" if fmt == "t2" else T3_INTERLEAVE, 0)) if fmt in ("t2", "t3") else 0
    mine = packed_shape if name.endswith(".q_weight") else scale_shape
    if tile:
        mine = (n // tile, cols, tile) if name.endswith(".q_weight") else (n // tile, groups, tile)
    if name in shapes and shapes[name] != mine:
        raise _mismatch(ckpt, name, shapes[name], mine)
    packed = np.empty(packed_shape, tern.code_dtype(fmt))
    scale = np.empty(scale_shape, np.float16)
    dtype = _source_dtype(ckpt, names)
    for r0, block in _row_blocks(ckpt, names, block_bytes, int(attrs.get("rotate", 1))):
        if native:
            ok = tern.native_groups(block, fmt, dtype)
            if not ok.all():
                r, g = (int(i[0]) for i in np.nonzero(~ok))
                raise _not_ternary(ckpt, name, names, r0 + r, g, block[r:r + 1], fmt)
        trits, s64 = tern.round_groups(block, fmt)
        s = s64.astype(np.float16)
        if stats is not None:
            _ternary_stats(stats, block, trits, s, s64, native)
        _store_rows(packed, scale, r0, tern.pack(trits, fmt, k), s, nk, name, on_bytes)
    if tile:      # NK rows interleaved: the KN tiles of the transposed rows (formats.interleave_rows)
        return tile_kn(packed.T if nk else packed, tile), tile_kn(scale.T if nk else scale, tile)
    return packed, scale


def _ternary_stats(stats: dict[str, float], w: np.ndarray, trits: np.ndarray, s16: np.ndarray,
                   s64: np.ndarray, native: bool) -> None:
    k = w.shape[1]
    deq = trits[:, :k].astype(np.float32) * np.repeat(s16.astype(np.float32), tern.GROUP, axis=1)[:, :k]
    stats["err2"] = stats.get("err2", 0.0) + float(((deq - w).astype(np.float64) ** 2).sum())
    stats["norm2"] = stats.get("norm2", 0.0) + float((w.astype(np.float64) ** 2).sum())
    stats["groups"] = stats.get("groups", 0) + int(s16.size)
    if native:
        stats["scale_rounded"] = stats.get("scale_rounded", 0) + int((s16.astype(np.float64) != s64).sum())


def _check_finite(ckpt: Any, name: str, arr: np.ndarray) -> None:
    """A converted float tensor (weights, or the scales of quantized ones) must be finite: source weights beyond
    float16's range (65504) become inf when stored as fp16 and would ship as a bundle that prints nothing."""
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise WeightsError(f"{name} is not finite once stored as {arr.dtype} (its weights exceed the range of "
                           f"{arr.dtype}, largest finite value {np.finfo(arr.dtype).max:.6g}, or are not finite)",
                           path=ckpt.path, fix="check the checkpoint's weights, or use a float32 scheme (q0f32)")


def _convert_float(ckpt: Any, name: str, names: list[str], dtype: Any, want: tuple[int, ...],
                   block_bytes: int, on_bytes: Callable[[int], None] | None, rotate: int = 1) -> np.ndarray:
    """Cast the sources of `name` to `dtype` block by block into one preallocated array."""
    src_shape = _source_shape(ckpt, name, names)
    if src_shape != want:
        raise _mismatch(ckpt, name, want, src_shape)
    out = np.empty(src_shape, np.dtype(dtype))
    for r0, block in _row_blocks(ckpt, names, block_bytes, rotate):
        out[r0:r0 + len(block)] = block.astype(out.dtype, copy=False)
        if on_bytes:
            on_bytes(len(block) * out[0:1].nbytes)
    return out


def iter_converted(ckpt: Any, params: list[tuple[str, Any]], layout: str, *, tied: bool = False,
                   on_tensor: Callable[[str, int], None] | None = None, start: int = 0,
                   block_bytes: int | None = None,
                   on_bytes: Callable[[int], None] | None = None,
                   stats: dict[str, float] | None = None,
                   calibration: Any = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) in the model's parameter order, ready for the tensor cache.

    `start` skips the first `start` parameters without reading their sources (to resume a conversion);
    `block_bytes` bounds the float32 rows converted at a time; `on_bytes(n)` is called as output bytes
    are produced (block by block), adding up to the bytes of the tensors yielded; `stats` collects ternary
    conversion statistics (see `_convert_ternary`); `calibration` (calibrate.Calibration): q4 / q8 tensors
    whose layer input it measured are quantized with error feedback (gptq.py).
    """
    block_bytes = int(block_bytes or DEFAULT_BLOCK_BYTES)
    if any((getattr(p, "attrs", None) or {}).get("experts") for _, p in params):
        ckpt = with_stacked_experts(ckpt)
    shapes = {name: tuple(int(x) for x in p.shape) for name, p in params}
    dtypes = {name: str(p.dtype) for name, p in params}
    pending: dict[str, np.ndarray] = {}
    packed = scale = None
    parts = _split_parts(params, layout)
    for i, (name, p) in enumerate(params):
        if i < start:
            continue
        shape = shapes[name]
        if name in parts:
            arr = _next_part(ckpt, name, parts, pending, dtypes, layout, tied, block_bytes, calibration, stats)
            if on_bytes:
                on_bytes(arr.nbytes)
        elif name in pending:
            arr = pending.pop(name)
            if on_bytes:
                on_bytes(arr.nbytes)
        elif (getattr(p, "attrs", None) or {}).get("experts"):
            arr = _convert_experts(ckpt, name, p, shapes, dtypes, pending, block_bytes, on_bytes, stats)
        elif name.endswith(QUANT_SUFFIXES):
            base = name.rsplit(".", 1)[0]
            attrs = dict(getattr(p, "attrs", None) or {})
            # embedding tables are NK (gathered by rows) unless the layer says otherwise (a tied q4 table
            # takes the target's layout for its lm_head GEMV, see Q4Embedding)
            tensor_layout = attrs.get("layout") or ("NK" if base.endswith("embed_tokens") else layout)
            sources = _source_names(ckpt, name, tied)
            if attrs.get("format") in tern.PACKINGS:
                packed, scale = _convert_ternary(ckpt, name, sources, tensor_layout, shapes, block_bytes, on_bytes,
                                                 attrs, stats)
            else:
                bits = 8 if dtypes.get(base + ".q_weight") == "int8" else 4
                rotate = int(attrs.get("rotate", 1))
                packed, scale = _convert_q4(ckpt, name, sources, tensor_layout, shapes, block_bytes, on_bytes,
                                            bits=bits, rotate=rotate, stats=stats,
                                            calibrated=_calibrated(calibration, base, tied, rotate),
                                            q8_tile=int(attrs.get("q8_tile", 0)), q4_tile=int(attrs.get("q4_tile", 0)))
            is_weight = name.endswith(".q_weight")
            arr = packed if is_weight else scale
            pending[base + (".q_scale" if is_weight else ".q_weight")] = scale if is_weight else packed
        else:
            rotate = int((getattr(p, "attrs", None) or {}).get("rotate", 1))
            arr = _convert_float(ckpt, name, _source_names(ckpt, name, tied), p.dtype, shape, block_bytes,
                                 on_bytes, rotate=rotate)
        if tuple(arr.shape) != shape:
            raise _mismatch(ckpt, name, shape, tuple(arr.shape))
        _check_finite(ckpt, name, arr)
        if on_tensor:
            on_tensor(name, arr.nbytes)
        yield name, arr
        arr = packed = scale = None   # hold no finished output while converting the next tensor


def _convert_experts(ckpt: Any, name: str, p: Any, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
                     pending: dict[str, np.ndarray], block_bytes: int,
                     on_bytes: Callable[[int], None] | None, stats: dict[str, float] | None = None) -> np.ndarray:
    """A stacked expert parameter [E, rows, ...] (models/moe.py): its per-expert sources (quant/experts.py)
    converted as one fused 2-d weight [E * rows, K] (float, q4 / q8 NK rows, or t2 / t3 / b1 NK rows
    ternarised / imported as a dense layer's: `_convert_ternary`), then reshaped; a q_weight's scales wait in
    `pending` for their own parameter, like any quantized weight's."""
    experts = int(p.attrs["experts"])
    sources = [checkpoint_name(ckpt, n) for n in expert_sources(name, experts)]
    missing = [n for n in sources if n not in ckpt]
    if missing:
        raise WeightsError(f"tensor {missing[0]!r} (needed for {name}) is not in the checkpoint", path=ckpt.path,
                           fix="check that the weights belong to this model config")
    shape = shapes[name]
    flat = {name: (experts * shape[1], *shape[2:])}
    if not name.endswith(QUANT_SUFFIXES):
        return _convert_float(ckpt, name, sources, p.dtype, flat[name], block_bytes, on_bytes).reshape(shape)
    base = name.rsplit(".", 1)[0]
    attrs = dict(p.attrs)
    if attrs.get("format") in tern.PACKINGS:
        packed, scale = _convert_ternary(ckpt, name, sources, "NK", flat, block_bytes, on_bytes, attrs, stats)
    else:
        bits = 8 if dtypes.get(base + ".q_weight") == "int8" else 4
        packed, scale = _convert_q4(ckpt, name, sources, "NK", flat, block_bytes, on_bytes, bits=bits)
    codes_shape = shapes.get(base + ".q_weight", (experts, -1, packed.shape[1]))
    scale_shape = shapes.get(base + ".q_scale", (experts, -1, scale.shape[1]))
    packed, scale = packed.reshape(codes_shape), scale.reshape(scale_shape)
    is_weight = name.endswith(".q_weight")
    pending[base + (".q_scale" if is_weight else ".q_weight")] = scale if is_weight else packed
    return packed if is_weight else scale


# ------------------------------------------------------------------------------------ split tensors
def _split_parts(params: list[tuple[str, Any]], layout: str) -> dict[str, tuple[str, int, int, int]]:
    """{part name: (whole name, axis, start, stop)} for parameters split for the device's largest single
    allocation (models/split.py): `lm_head.q_weight.1` is rows [start, stop) of `lm_head.q_weight` along
    the vocab axis (axis 1 of KN codes and scales, axis 0 otherwise)."""
    out: dict[str, tuple[str, int, int, int]] = {}
    offsets: dict[str, int] = {}
    names = {n for n, _ in params}
    for name, p in params:
        whole, _, idx = name.rpartition(".")
        if not idx.isdigit() or not whole.endswith((".q_weight", ".q_scale", ".weight")) or whole in names:
            continue
        quantized = whole.endswith(QUANT_SUFFIXES) and not whole.rsplit(".", 1)[0].endswith("embed_tokens")
        axis = 1 if quantized and layout == "KN" else 0
        start = offsets.get(whole, 0)
        stop = start + int(p.shape[axis])
        out[name] = (whole, axis, start, stop)
        offsets[whole] = stop
    return out


def _next_part(ckpt: Any, name: str, parts: dict[str, tuple[str, int, int, int]], pending: dict[str, np.ndarray],
               dtypes: dict[str, str], layout: str, tied: bool, block_bytes: int, calibration: Any = None,
               stats: dict[str, float] | None = None) -> np.ndarray:
    """One part of a split tensor: the whole tensor is converted once (as if unsplit, so the values are
    bit-identical) and kept until its last part is taken."""
    whole, axis, start, stop = parts[name]
    if whole not in pending:
        total = max(p[3] for p in parts.values() if p[0] == whole)
        if whole.endswith(QUANT_SUFFIXES):
            base = whole.rsplit(".", 1)[0]
            tensor_layout = "NK" if base.endswith("embed_tokens") else layout
            bits = 8 if dtypes.get(base + ".q_weight.0") == "int8" else 4
            codes, scale = _convert_q4(ckpt, whole, _source_names(ckpt, whole, tied), tensor_layout, {},
                                       block_bytes, None, bits=bits, stats=stats,
                                       calibrated=_calibrated(calibration, base, tied))
            pending[base + ".q_weight"], pending[base + ".q_scale"] = codes, scale
        else:
            names = _source_names(ckpt, whole, tied)
            shape = _source_shape(ckpt, whole, names)
            pending[whole] = _convert_float(ckpt, whole, names, dtypes[name], (total, *shape[1:]),
                                            block_bytes, None)
    arr = pending[whole]
    part = np.ascontiguousarray(arr[start:stop] if axis == 0 else arr[:, start:stop])
    if stop == arr.shape[axis]:
        del pending[whole]
    return part


def _calibrated(calibration: Any, base: str, tied: bool, rotate: int = 1) -> Any:
    """calibrate.CalibratedInput for parameter `base` when the calibration measures its layer's input; None
    otherwise (an untied embedding, a rotated input, no calibration): round-to-nearest."""
    if calibration is None or rotate > 1:
        return None
    return calibration.input_of(base, tied)
