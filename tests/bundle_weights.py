"""A torch reference that runs on exactly the weights a bundle stores (dequantized), for numerics tests.

Calibrated quantization makes the stored values depend on more than the float tensor (the layer's input
statistics), so references read the bundle's own tensor cache instead of re-quantizing.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from pipeline.artifacts.tensor_cache import read_tensor_cache
from pipeline.quant.convert import FUSED
from pipeline.quant.quantize import dequantize_q4, dequantize_q8


def dequantized_tensors(bundle) -> dict[str, np.ndarray]:
    """{our parameter base + leaf ('weight' for quantized pairs): float32 array [N, K]} of a bundle."""
    cache = read_tensor_cache(bundle)
    out: dict[str, np.ndarray] = {}
    for name, arr in cache.items():
        if name.endswith(".q_scale"):
            continue
        if name.endswith(".q_weight"):
            base = name[: -len(".q_weight")]
            scale = cache[base + ".q_scale"]
            layout = "NK" if arr.ndim == 2 and arr.shape[0] == scale.shape[0] else "KN"   # 3-d: tiled KN q8
            deq = dequantize_q8 if arr.dtype == np.int8 else dequantize_q4
            out[base + ".weight"] = deq(arr, scale, layout)
        else:
            out[name] = np.asarray(arr, np.float32)
    return out


def bundle_reference(model, bundle):
    """A copy of the transformers `model` whose parameters hold the bundle's (dequantized) tensors."""
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, arr in dequantized_tensors(bundle).items():
            base, _, leaf = name.rpartition(".")
            owner, _, module = base.rpartition(".")
            targets = [f"{owner}.{part}.{leaf}" for part in FUSED[module]] if module in FUSED else [name]
            targets = [t for t in targets if t in params]
            if not targets:
                continue
            rows = 0
            for t in targets:
                p = params[t]
                p.copy_(torch.from_numpy(arr[rows:rows + p.shape[0]]).reshape(p.shape))
                rows += p.shape[0]
            assert rows == arr.shape[0], (name, rows, arr.shape)
    return ref
