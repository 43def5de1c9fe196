"""Parameters larger than the device's largest single allocation, split along the vocab / output axis.

OpenCL caps one buffer at CL_DEVICE_MAX_MEM_ALLOC_SIZE (often a quarter of memory on Adreno; the
target YAML's `capabilities.max_buffer_bytes`). A vocab x hidden table over the cap cannot be one
buffer, so the embedding and the lm_head are built from N parts of at most the cap each: rows
[0, n0), [n0, n0 + n1), ... of the HF tensor. The embedding gathers each id's row from the part that
holds it (one kernel reading N tables), the lm_head is one GEMV per part and a concat. Parameters are
named `<tensor>.<part>` (`lm_head.q_weight.0`), converted from the same HF tensor (convert.py), and the
memory plan lists the parts. A wrapper around the layers of `layers.py`, which stays unaware of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from pipeline.errors import ConfigError
from pipeline.models.layers import (
    FloatEmbedding,
    FloatLinear,
    LayerFactory,
    Q4Embedding,
    Q4Linear,
    dequantize_q8_te,
    dequantize_te,
    dequantized_t,
    q_params,
)
from pipeline.quant.memory_plan import split_rows as plan_rows

SPLIT_ROLES = ("embed_tokens", "lm_head")


def split_rows(rows: int, row_bytes: int, limit: int | None, what: str = "tensor") -> list[int]:
    """Rows per part so that no part exceeds `limit` bytes (the memory plan's rule, one-line error here)."""
    try:
        return plan_rows(rows, row_bytes, limit)
    except ValueError as err:
        raise ConfigError(f"{what}: {err}", fix="raise capabilities.max_buffer_bytes in the target YAML") from None


def _row_bytes(layer: nn.Module, rows: int) -> int:
    """Bytes per vocab row of the layer's largest parameter (the codes, or the float weight)."""
    biggest = max(math.prod(int(d) for d in p.shape) * np.dtype(p.dtype).itemsize
                  for _, p in layer.named_parameters())
    return math.ceil(biggest / rows)


@dataclass
class SplitFactory(LayerFactory):
    """A LayerFactory whose embedding / lm_head come in parts when over `max_buffer_bytes`."""

    max_buffer_bytes: int | None = None
    splits: list[dict[str, Any]] = field(default_factory=list)   # what was split, for the build's report

    def linear(self, in_features: int, out_features: int, bias: bool, role: str = "") -> nn.Module:
        layer = super().linear(in_features, out_features, bias, role)
        if role not in SPLIT_ROLES or bias:
            return layer
        sizes = self._sizes(role, layer, out_features)
        return layer if len(sizes) == 1 else SplitLinear(layer, sizes)

    def embedding(self, num: int, dim: int, tied: bool = False) -> nn.Module:
        layer = super().embedding(num, dim, tied)
        sizes = self._sizes("embed_tokens", layer, num)
        # parts are row (NK) tables, whatever layout the unsplit tied table would take
        return layer if len(sizes) == 1 else SplitEmbedding(super().embedding(num, dim), sizes)

    def _sizes(self, role: str, layer: nn.Module, rows: int) -> list[int]:
        row_bytes = _row_bytes(layer, rows)
        sizes = split_rows(rows, row_bytes, self.max_buffer_bytes, role)
        if len(sizes) > 1:
            self.splits.append({"role": role, "parts": len(sizes), "rows": sizes, "bytes": rows * row_bytes,
                                "max_buffer_bytes": self.max_buffer_bytes,
                                "reason": f"max single allocation {self.max_buffer_bytes} bytes"})
        return sizes


def _q_params(rows: list[int], k: int, code_dtype: str, scale_dtype: str, layout: str):
    parts = [q_params(n, k, code_dtype, scale_dtype, layout) for n in rows]
    return nn.ParameterList([c for c, _ in parts]), nn.ParameterList([s for _, s in parts])


class SplitLinear(nn.Module):
    """y = concat_i(x W_i^T): one (dequantize-)GEMV per part of the output axis."""

    def __init__(self, layer: nn.Module, rows: list[int]):
        self.rows, self.in_features, self.out_features = rows, layer.in_features, layer.out_features
        self.quantized = isinstance(layer, Q4Linear)
        if self.quantized:
            self.layout, self.dtype = layer.layout, layer.dtype
            self.q_weight, self.q_scale = _q_params(rows, layer.in_features, layer.q_weight.dtype,
                                                    layer.q_scale.dtype, layer.layout)
        else:
            assert isinstance(layer, FloatLinear)
            self.weight = nn.ParameterList([nn.Parameter((n, layer.in_features), layer.weight.dtype) for n in rows])

    def forward(self, x: Tensor) -> Tensor:
        if self.quantized:
            outs = [op.matmul(x, dequantized_t(w, s, self.layout, self.in_features, n, self.dtype))
                    for w, s, n in zip(self.q_weight, self.q_scale, self.rows, strict=True)]
        else:
            outs = [op.matmul(x, op.permute_dims(w if w.dtype == x.dtype else w.astype(x.dtype)))
                    for w in self.weight]
        return op.concat(outs, dim=-1)


def _gather(ids: Tensor, tables: list[Tensor], rows: list[int], name: str) -> Tensor:
    """out[i, :] = row ids[i] of the concatenation of `tables` along axis 0, without concatenating them."""
    starts = [sum(rows[:i]) for i in range(len(rows))]

    def compute(idx: te.Tensor, *parts: te.Tensor):
        def row(i, j):
            r = idx[i]
            value = parts[-1][r - starts[-1], j]
            for t, start, n in reversed(list(zip(parts[:-1], starts[:-1], rows[:-1], strict=True))):
                value = tirx.if_then_else(r < start + n, t[r - start, j], value)
            return value

        return te.compute((idx.shape[0], parts[0].shape[1]), row, name=name)

    return op.tensor_expr_op(compute, name, [ids, *tables])


class SplitEmbedding(nn.Module):
    """A vocab table in row parts: the gather picks each id's part; the tied lm_head is a GEMV per part."""

    def __init__(self, layer: nn.Module, rows: list[int]):
        self.rows, self.num, self.dim, self.dtype = rows, layer.num, layer.dim, layer.dtype
        self.quantized = isinstance(layer, Q4Embedding)
        if self.quantized:
            self.q_weight, self.q_scale = _q_params(rows, layer.dim, layer.q_weight.dtype, layer.q_scale.dtype, "NK")
        else:
            assert isinstance(layer, FloatEmbedding)
            self.weight = nn.ParameterList([nn.Parameter((n, layer.dim), layer.weight.dtype) for n in rows])

    def forward(self, ids: Tensor) -> Tensor:
        if not self.quantized:
            x = _gather(ids, list(self.weight), self.rows, "split_embedding_gather")
            return x if x.dtype == self.dtype else x.astype(self.dtype)
        codes = _gather(ids, list(self.q_weight), self.rows, "split_embedding_gather_codes")
        scales = _gather(ids, list(self.q_scale), self.rows, "split_embedding_gather_scales")
        dim, dtype = self.dim, self.dtype

        def dequant(w: te.Tensor, s: te.Tensor):
            deq = dequantize_q8_te if w.dtype == "int8" else dequantize_te
            t = deq(w, s, "NK", dim, w.shape[0], dtype)  # [dim, seq]
            return te.compute((w.shape[0], dim), lambda i, j: t[j, i], name="embed_dequant")

        return op.tensor_expr_op(dequant, "dequantize_embedding", [codes, scales])

    def lm_head(self, h: Tensor) -> Tensor:
        if self.quantized:
            outs = [op.matmul(h, dequantized_t(w, s, "NK", self.dim, n, self.dtype))
                    for w, s, n in zip(self.q_weight, self.q_scale, self.rows, strict=True)]
        else:
            outs = [op.matmul(h, op.permute_dims(w if w.dtype == h.dtype else w.astype(h.dtype)))
                    for w in self.weight]
        return op.concat(outs, dim=-1)
