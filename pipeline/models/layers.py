"""Linear / embedding layers whose storage follows the quantization scheme.

Group-int4 weights are dequantized by a small TE function that always yields W^T ([K, N]); the matmul
reads it directly, so the fuse stage can fold the dequantize into the matmul (one kernel that reads
packed int4 and never materialises fp16 weights). The layout (NK = MLC `_1`, KN = MLC `_0`) only
changes how the packed codes are laid out in memory: KN makes loads along the output dim coalesced,
which is what Adreno GEMV wants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from pipeline.formats import (  # noqa: F401 - also read as layers.X by tests
    CODES_PER_WORD,
    FORMAT_BITS,
    GROUP,
    T3_INTERLEAVE,
    ZERO,
    interleave_rows,
    interleaved_q8_index,
    tile_width,
    tiled_kn_index,
    tiled_q8_index,
)
from pipeline.quant import ternary as tern


def dequantize_te(packed: te.Tensor, scale: te.Tensor, layout: str, k: int, n: int, dtype: str):
    """TE for W^T[k, n] from packed int4 codes + fp16 scales (NK: [N, K/8], KN: [K/8, N] or both tiled,
    quantize.tile_kn)."""
    tiled = len(packed.shape) == 3

    def code(kk, nn_):
        if tiled:
            word = packed[tiled_kn_index(nn_, kk // CODES_PER_WORD, int(packed.shape[2]))]
        else:
            word = packed[nn_, kk // CODES_PER_WORD] if layout == "NK" else packed[kk // CODES_PER_WORD, nn_]
        shift = (kk % CODES_PER_WORD * 4).astype("uint32")
        return ((word >> shift) & tirx.const(0xF, "uint32")).astype(dtype)

    def scl(kk, nn_):
        if tiled:
            return scale[tiled_kn_index(nn_, kk // GROUP, int(scale.shape[2]))].astype(dtype)
        s = scale[nn_, kk // GROUP] if layout == "NK" else scale[kk // GROUP, nn_]
        return s.astype(dtype)

    return te.compute(
        (k, n), lambda kk, nn_: (code(kk, nn_) - tirx.const(ZERO, dtype)) * scl(kk, nn_),
        name=f"dequantize_{layout.lower()}")


def dequantize_q8_te(codes: te.Tensor, scale: te.Tensor, layout: str, k: int, n: int, dtype: str):
    """TE for W^T[k, n] from int8 codes + fp16 scales (NK: codes [N, K], KN: codes [K, N] or tiled)."""
    def value(kk, nn_):
        if len(scale.shape) == 3:      # NK rows interleaved (quantize.interleave_q8): [N / rows, K / 4, 4 rows]
            rows = int(scale.shape[2])
            c, s = codes[interleaved_q8_index(nn_, kk, rows)], scale[tiled_kn_index(nn_, kk // GROUP, rows)]
            return c.astype(dtype) * s.astype(dtype)
        if len(codes.shape) == 3:      # KN tiled (quantize.tile_q8): [N / tile, K / 2, 2 tile]
            c = codes[tiled_q8_index(nn_, kk, int(codes.shape[2]) // 2)]
        else:
            c = codes[nn_, kk] if layout == "NK" else codes[kk, nn_]
        s = scale[nn_, kk // GROUP] if layout == "NK" else scale[kk // GROUP, nn_]
        return c.astype(dtype) * s.astype(dtype)

    return te.compute((k, n), value, name=f"dequantize_q8_{layout.lower()}")


def sign_code(fmt: str, word_at, kk):
    """The stored code of weight `kk` of one sign-packed row (t2 / t3: trit + 1; b1: its sign bit as 0 or 2, so
    the value is (code - 1) * scale in every packing), from `word_at(i)`: the row's i-th uint32 word. Index
    arithmetic on PrimExprs, so the TE dequantize here and the routed experts' TIR gather kernels
    (moe_kernels.py) read one packing (quant/ternary.py) the same way."""
    if fmt == "t2":
        word = word_at(kk // tern.T2_PER_WORD)
        shift = (kk % tern.T2_PER_WORD * 2).astype("uint32")
        return (word >> shift) & tirx.const(3, "uint32")
    if fmt == "b1":                      # sign bit -> code 0 or 2 (value code - 1 = -1 or +1)
        word = word_at(kk // tern.B1_PER_WORD)
        shift = (kk % tern.B1_PER_WORD).astype("uint32")
        return ((word >> shift) & tirx.const(1, "uint32")) * tirx.const(2, "uint32")
    if fmt != "t3":
        raise ValueError(f"unknown sign packing {fmt!r}; expected one of {tern.PACKINGS}")
    word = word_at(kk // tern.T3_PER_WORD)
    shift = (kk % tern.T3_PER_WORD // tern.T3_PER_BYTE * 8).astype("uint32")
    byte = ((word >> shift) & tirx.const(0xFF, "uint32")).astype("int32")
    j = kk % tern.T3_PER_BYTE
    pow3 = tirx.Select(j == 0, 1, tirx.Select(j == 1, 3, tirx.Select(j == 2, 9, tirx.Select(j == 3, 27, 81))))
    return tirx.floormod(tirx.floordiv(byte, pow3), 3)


def dequantize_ternary_te(packed: te.Tensor, scale: te.Tensor, fmt: str, layout: str, k: int, n: int,
                          dtype: str):
    """TE for W^T[k, n] from ternary codes (code = trit + 1) + one scale per 128 weights along K.

    t2: 16 two-bit codes per uint32 (NK [N, ceil(K/16)], KN transposed); t3: base-3, 5 codes per byte,
    4 bytes per uint32 ([N, ceil(K/20)]; see pipeline/quant/ternary.py); b1: 32 sign bits per uint32 (binary,
    code 2 bit). Pure index arithmetic on the packed buffer, so the fused kernel reads packed codes only."""
    def at(buf, kk, nn_):
        if len(buf.shape) == 3:          # t2 KN tiled (quantize.tile_kn): [N / tile, rows, tile]
            return buf[tiled_kn_index(nn_, kk, int(buf.shape[2]))]
        return buf[nn_, kk] if layout == "NK" else buf[kk, nn_]

    def code(kk, nn_):
        return sign_code(fmt, lambda word: at(packed, word, nn_), kk)

    def value(kk, nn_):
        s = at(scale, kk // tern.GROUP, nn_).astype(dtype)
        return (code(kk, nn_).astype(dtype) - tirx.const(1, dtype)) * s

    return te.compute((k, n), value, name=f"dequantize_{fmt}_{layout.lower()}")


def dequantized_t(q_weight: Tensor, q_scale: Tensor, layout: str, k: int, n: int, dtype: str,
                  fmt: str | None = None) -> Tensor:
    """W^T [k, n] from packed codes, as its own call so the fuse stage can fold it into the matmul."""
    if fmt in tern.PACKINGS:
        return op.tensor_expr_op(lambda w, s: dequantize_ternary_te(w, s, fmt, layout, k, n, dtype),
                                 f"dequantize_{fmt}_{layout.lower()}", [q_weight, q_scale])
    if q_weight.dtype == "int8":
        return op.tensor_expr_op(lambda w, s: dequantize_q8_te(w, s, layout, k, n, dtype),
                                 f"dequantize_q8_{layout.lower()}", [q_weight, q_scale])
    return op.tensor_expr_op(lambda w, s: dequantize_te(w, s, layout, k, n, dtype),
                             f"dequantize_q4_{layout.lower()}", [q_weight, q_scale])


def _as(x: Tensor, dtype: str) -> Tensor:
    return x if x.dtype == dtype else x.astype(dtype)


def hadamard_te(x: te.Tensor, block: int):
    """x times the block-diagonal normalized Sylvester-Hadamard matrix along its last axis: entry (i, j) of a
    block is (-1)^popcount(i & j) / sqrt(block). The same transform is folded into the weights (W H) at
    conversion, so H x feeds W H and the product is unchanged (H H = I)."""
    j = te.reduce_axis((0, block), name="j")
    coeff = 1.0 / math.sqrt(block)

    def rotate(*idx):
        i = idx[-1]
        odd = tirx.popcount(tirx.bitwise_and(i % block, j)) % 2
        sign = tirx.Select(odd == 0, tirx.const(coeff, x.dtype), tirx.const(-coeff, x.dtype))
        return te.sum(x[(*idx[:-1], i - i % block + j)] * sign, axis=j)

    return te.compute(x.shape, rotate, name="hadamard_rotate")


def rotated(x: Tensor, block: int) -> Tensor:
    """The layer input in the rotated basis (`block` <= 1: unchanged)."""
    if block <= 1:
        return x
    return op.tensor_expr_op(lambda t: hadamard_te(t, block), "hadamard_rotate", [x])


class FloatLinear(nn.Module):
    """y = x W^T (+ b), weight stored [out, in] like HF."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, rotate: int = 1):
        self.in_features, self.out_features, self.rotate = in_features, out_features, rotate
        self.weight = nn.Parameter((out_features, in_features), dtype)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = op.matmul(rotated(x, self.rotate), op.permute_dims(_as(self.weight, x.dtype)))
        return y if self.bias is None else y + _as(self.bias, x.dtype)


def q_params(rows: int, k: int, code_dtype: str, scale_dtype: str, layout: str,
             q8_tile: int = 0, q4_tile: int = 0) -> tuple[nn.Parameter, nn.Parameter]:
    """Codes (uint32: 8 int4 per word; int8: one each) and one scale per GROUP along K, for `rows` outputs:
    NK [rows, K / per_word] + [rows, K / GROUP], or KN transposed. `q8_tile`: KN int8 codes tiled by that
    many columns when it divides `rows` ([rows / q8_tile, K / 2, 2 q8_tile], quantize.tile_q8; both
    parameters then carry attrs q8_tile, for the converter). `q4_tile`: KN int4 codes and their scales tiled
    by the widest multiple of 8 up to it that divides `rows` (`tile_width`; [rows / t, K / 8, t] and
    [rows / t, K / GROUP, t], quantize.tile_kn; attrs q4_tile = t); plain KN when none does. NK: `q4_tile`
    interleaves that many rows (`interleave_rows`: the same 3-d arrays, read alike), else plain rows; `q8_tile`
    NK int8 rows the same way (quantize.interleave_q8)."""
    per_word = CODES_PER_WORD if code_dtype == "uint32" else 1
    if layout == "NK":
        tile = interleave_rows(rows, q4_tile if code_dtype == "uint32" else q8_tile)
        if not tile:
            return nn.Parameter((rows, k // per_word), code_dtype), nn.Parameter((rows, k // GROUP), scale_dtype)
        if code_dtype == "int8":      # quantize.interleave_q8: 4 codes of each row side by side
            codes, scale = (nn.Parameter((rows // tile, k // 4, 4 * tile), code_dtype),
                            nn.Parameter((rows // tile, k // GROUP, tile), scale_dtype))
            for p in (codes, scale):
                p.attrs["q8_tile"] = tile
            return codes, scale
    elif q8_tile and code_dtype == "int8" and rows % q8_tile == 0:
        codes, scale = (nn.Parameter((rows // q8_tile, k // 2, 2 * q8_tile), code_dtype),
                        nn.Parameter((k // GROUP, rows), scale_dtype))
        for p in (codes, scale):
            p.attrs["q8_tile"] = q8_tile
        return codes, scale
    else:
        tile = tile_width(rows, q4_tile) if q4_tile and code_dtype == "uint32" else 0
    if tile:
        codes, scale = (nn.Parameter((rows // tile, k // per_word, tile), code_dtype),
                        nn.Parameter((rows // tile, k // GROUP, tile), scale_dtype))
        for p in (codes, scale):
            p.attrs["q4_tile"] = tile
        return codes, scale
    return nn.Parameter((k // per_word, rows), code_dtype), nn.Parameter((k // GROUP, rows), scale_dtype)


class Q4Linear(nn.Module):
    """Group-32 symmetric int4 weights with fp16 scales (`bits=8`: int8 codes); `layout` is NK or KN."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, layout: str,
                 scale_dtype: str = "float16", bits: int = 4, rotate: int = 1, q8_tile: int = 0, q4_tile: int = 0):
        self.in_features, self.out_features, self.layout, self.dtype = in_features, out_features, layout, dtype
        self.rotate = rotate
        k, n = in_features, out_features
        self.q_weight, self.q_scale = q_params(n, k, "uint32" if bits == 4 else "int8", scale_dtype, layout,
                                               q8_tile, q4_tile)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        w_t = dequantized_t(self.q_weight, self.q_scale, self.layout, self.in_features, self.out_features,
                            self.dtype)
        y = op.matmul(rotated(x, self.rotate), w_t)
        return y + self.bias if self.bias is not None else y


class TernaryLinear(nn.Module):
    """Ternary weights {-s, 0, +s}, one scale per 128 along K, packed `fmt` t2 (2 bits) or t3 (base 3)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, layout: str, fmt: str,
                 scale_dtype: str = "float16", rotate: int = 1, t2_tile: int = 0, t3_interleave: int = 0):
        self.in_features, self.out_features, self.layout, self.dtype = in_features, out_features, layout, dtype
        self.fmt, self.rotate = fmt, rotate
        k, n = in_features, out_features
        codes, groups = tern.packed_len(fmt, k), tern.n_groups(k)
        # `t2_tile` (the target's): KN t2 codes and scales tiled like q4 (quantize.tile_kn, `tile_width`); NK:
        # that many rows interleaved (`interleave_rows`: the same 3-d arrays, read alike)
        # `t3_interleave`: NK t3 rows interleaved the same way (arm_t3.py's sdot kernel reads 4 rows' words at once)
        tile = 0
        if t2_tile and fmt == "t2" and k % 16 == 0:
            tile = tile_width(n, t2_tile) if layout == "KN" else interleave_rows(n, t2_tile)
        elif t3_interleave and fmt == "t3" and layout == "NK":
            tile = interleave_rows(n, t3_interleave)
        if tile:
            self.q_weight = nn.Parameter((n // tile, codes, tile), tern.code_dtype(fmt))
            self.q_scale = nn.Parameter((n // tile, groups, tile), scale_dtype)
            for p in (self.q_weight, self.q_scale):
                p.attrs["t2_tile" if fmt == "t2" else T3_INTERLEAVE] = tile
        else:
            self.q_weight = nn.Parameter((n, codes) if layout == "NK" else (codes, n), tern.code_dtype(fmt))
            self.q_scale = nn.Parameter((n, groups) if layout == "NK" else (groups, n), scale_dtype)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        w_t = dequantized_t(self.q_weight, self.q_scale, self.layout, self.in_features, self.out_features,
                            self.dtype, fmt=self.fmt)
        y = op.matmul(rotated(x, self.rotate), w_t)
        return y + self.bias if self.bias is not None else y


class FloatEmbedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: str, compute_dtype: str):
        self.num, self.dim, self.dtype = num, dim, compute_dtype
        self.weight = nn.Parameter((num, dim), dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return _as(op.take(self.weight, ids, axis=0), self.dtype)

    def lm_head(self, h: Tensor) -> Tensor:
        """Tied output projection: h @ E^T."""
        return op.matmul(h, op.permute_dims(_as(self.weight, h.dtype)))


class Q4Embedding(nn.Module):
    """Group-int4 table (`bits=8`: int8). NK (rows) makes the gather read whole rows; a tied table that also
    serves as the lm_head is stored KN on KN targets, because the lm_head GEMV over the whole vocabulary
    is the biggest kernel of a decode step and wants the output dim contiguous, while a gather of a few
    KN columns costs hidden/8 strided words per token."""

    def __init__(self, num: int, dim: int, dtype: str, scale_dtype: str = "float16", bits: int = 4,
                 fmt: str | None = None, layout: str = "NK", q8_tile: int = 0, q4_tile: int = 0):
        self.num, self.dim, self.dtype, self.fmt = num, dim, dtype, fmt
        self.layout = "NK" if fmt in tern.PACKINGS else layout   # ternary tables: rows only
        if fmt in tern.PACKINGS:
            self.q_weight = nn.Parameter((num, tern.packed_len(fmt, dim)), tern.code_dtype(fmt))
            self.q_scale = nn.Parameter((num, tern.n_groups(dim)), scale_dtype)
            return
        self.q_weight, self.q_scale = q_params(num, dim, "uint32" if bits == 4 else "int8", scale_dtype, layout,
                                               q8_tile, q4_tile)
        if layout != "NK":
            for p in (self.q_weight, self.q_scale):
                p.attrs["layout"] = layout   # the converter stores embedding tables NK unless told

    def forward(self, ids: Tensor) -> Tensor:
        if len(self.q_weight.shape) == 3:
            return self._gather_tiled(ids)
        axis = 0 if self.layout == "NK" else 1
        rows = op.take(self.q_weight, ids, axis=axis)
        scales = op.take(self.q_scale, ids, axis=axis)
        dim, dtype, fmt, layout = self.dim, self.dtype, self.fmt, self.layout

        def gather_dequant(w: te.Tensor, s: te.Tensor):
            seq = w.shape[0] if layout == "NK" else w.shape[1]
            if fmt in tern.PACKINGS:
                t = dequantize_ternary_te(w, s, fmt, "NK", dim, seq, dtype)
            else:
                deq = dequantize_q8_te if w.dtype == "int8" else dequantize_te
                t = deq(w, s, layout, dim, seq, dtype)  # [dim, seq]
            return te.compute((seq, dim), lambda i, j: t[j, i], name="embed_dequant")

        return op.tensor_expr_op(gather_dequant, "dequantize_embedding", [rows, scales])

    def _gather_tiled(self, ids: Tensor) -> Tensor:
        """The rows of `ids` from a tiled q8 or q4 table (token t's codes are column t of the KN codes, inside
        tile t // tile): one TE over the whole table, which reads only those tokens' codes."""
        dim, dtype = self.dim, self.dtype

        def gather_dequant(idx: te.Tensor, w: te.Tensor, s: te.Tensor):
            seq = idx.shape[0]

            def value(i, j):
                t = idx[i]
                if w.dtype == "int8" and len(s.shape) == 3:     # NK rows interleaved (quantize.interleave_q8)
                    rows = int(s.shape[2])
                    return w[interleaved_q8_index(t, j, rows)].astype(dtype) * s[tiled_kn_index(t, j // GROUP, rows)].astype(dtype)
                if w.dtype == "int8":
                    return w[tiled_q8_index(t, j, int(w.shape[2]) // 2)].astype(dtype) * s[j // GROUP, t].astype(dtype)
                tile = int(w.shape[2])
                word = w[tiled_kn_index(t, j // CODES_PER_WORD, tile)]
                code = (word >> (j % CODES_PER_WORD * 4).astype("uint32")) & tirx.const(0xF, "uint32")
                return (code.astype(dtype) - tirx.const(ZERO, dtype)) * s[tiled_kn_index(t, j // GROUP, tile)].astype(dtype)

            return te.compute((seq, dim), value, name="embed_dequant")

        return op.tensor_expr_op(gather_dequant, "dequantize_embedding", [ids, self.q_weight, self.q_scale])

    def lm_head(self, h: Tensor) -> Tensor:
        return op.matmul(h, dequantized_t(self.q_weight, self.q_scale, self.layout, self.dim, self.num,
                                          self.dtype, fmt=self.fmt))


@dataclass
class LayerFactory:
    """Builds each layer in the storage the quantization scheme asks for.

    `formats` maps a layer's role (qkv_proj, o_proj, gate_up_proj, down_proj, in_proj, out_proj, lm_head,
    embed_tokens) to a format (float | q4 | q8 | t2 | t3) — a scheme's per-tensor rules; the rest get
    `weight_format`. `rotation` > 1 rotates the input of every linear layer but the lm_head by a
    Walsh-Hadamard block (the largest power of two <= rotation dividing its K) and marks its weight for
    the same rotation at conversion. Conversion options ride on the parameters' `attrs` (format,
    ternary_source, rotate), so the converter needs nothing else.
    """

    dtype: str                 # activation / compute dtype
    weight_format: str         # "float", "q4", "q8", "t2" or "t3"
    weight_dtype: str = "float32"
    layout: str = "NK"
    scale_dtype: str = "float16"   # float32 only to execute kernels on fp16-less OpenCL (PoCL) in tests
    formats: dict[str, str] | None = None
    rotation: int = 0
    ternary_source: str = "native"   # native: import ternary weights exactly (refuse others) | ptq
    kv_dtype: str | None = None      # the KV cache's storage dtype; None: the activation dtype
    q8_tile: int = 0                 # KN q8 codes tiled by this many columns (the target's q8_tile; 0: plain)
    q4_tile: int = 0                 # KN q4 codes and scales tiled by up to this many columns (the target's q4_tile)
    t2_tile: int = 0                 # ... and KN t2 codes and scales (the target's t2_tile)
    t3_interleave: int = 0           # NK t3 rows interleaved by this many (the target's t3_interleave)

    @property
    def kv_cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    def format_for(self, role: str) -> str:
        return (self.formats or {}).get(role, self.weight_format)

    def linear(self, in_features: int, out_features: int, bias: bool, role: str = "") -> nn.Module:
        fmt = self.format_for(role)
        rotate = tern.rotation_block(in_features, self.rotation) if self.rotation and role != "lm_head" else 1
        if fmt in tern.PACKINGS:
            layer = TernaryLinear(in_features, out_features, bias, self.dtype, self.layout, fmt, self.scale_dtype,
                                  rotate=rotate, t2_tile=self.t2_tile, t3_interleave=self.t3_interleave)
            self._mark(layer, fmt, rotate)
            return layer
        if fmt in FORMAT_BITS and in_features % GROUP == 0:
            layer = Q4Linear(in_features, out_features, bias, self.dtype, self.layout, self.scale_dtype,
                             bits=FORMAT_BITS[fmt], rotate=rotate, q8_tile=self.q8_tile, q4_tile=self.q4_tile)
        else:
            layer = FloatLinear(in_features, out_features, bias, self.weight_dtype, rotate=rotate)
        self._mark(layer, None, rotate)
        return layer

    def embedding(self, num: int, dim: int, tied: bool = False) -> nn.Module:
        """`tied`: the table is also the lm_head, so it takes the target's layout (see Q4Embedding)."""
        fmt = self.format_for("embed_tokens")
        if fmt in tern.PACKINGS:
            layer = Q4Embedding(num, dim, self.dtype, self.scale_dtype, fmt=fmt)
            self._mark(layer, fmt, 1)
            return layer
        if fmt in FORMAT_BITS and dim % GROUP == 0:
            return Q4Embedding(num, dim, self.dtype, self.scale_dtype, bits=FORMAT_BITS[fmt],
                               layout=self.layout if tied else "NK", q8_tile=self.q8_tile if tied else 0,
                               q4_tile=self.q4_tile if tied else 0)
        return FloatEmbedding(num, dim, self.weight_dtype, self.dtype)

    def _mark(self, layer: nn.Module, fmt: str | None, rotate: int) -> None:
        """Tell the converter how to produce this layer's weights (nothing for plain q4 / q8 / float)."""
        for name in ("q_weight", "q_scale", "weight"):
            p = getattr(layer, name, None)
            if p is None:
                continue
            if fmt:
                p.attrs.update(format=fmt, ternary_source=self.ternary_source)
            if rotate > 1:
                p.attrs["rotate"] = rotate
