"""Op classes: what kind of work a compiled kernel does, read from its name and its TIR structure.

The coverage report, forced CPU placement, the NPU partition and the tuner all group kernels by these
classes; the classification lives here, below all of them, so that none has to import another.
"""

from __future__ import annotations

import re
from typing import Any

import tvm
from tvm import tirx

from pipeline.errors import ConfigError

OP_CLASSES = ("dequant-gemv", "dequant-matmul", "dequant-gemv-ternary", "dequant-matmul-ternary", "gemv", "matmul",
              "moe-gemv",
              "rotation", "rmsnorm", "layernorm", "l2norm", "attention", "rope", "kv-cache", "gdn-recurrence", "gdn-conv",
              "rnn-state", "gather", "elementwise", "injective", "reduction", "other")

MATMUL_CLASSES = ("dequant-gemv", "dequant-matmul", "dequant-gemv-ternary", "dequant-matmul-ternary", "gemv",
                  "matmul")

# Gated-DeltaNet (hybrid models): the delta-rule scan, its conv/gates, and the RNN-state copies.
_GDN_CLASSES = (("gdn_prefill", "gdn-recurrence"), ("gdn_decode", "gdn-recurrence"), ("gdn_conv1d", "gdn-conv"),
                ("conv_state", "gdn-conv"), ("gdn_gates", "gdn-conv"), ("rnn_state", "rnn-state"))

# fused dequantize functions of the sign packings (layers.dequantize_ternary_te: ternary t2 / t3, binary b1),
# one "-ternary" op class: their codes are uint32 like q4
_TERNARY_NAMES = ("dequantize_t2", "dequantize_t3", "dequantize_b1")
_ATTENTION_NAMES = ("batch_prefill_paged_kv", "batch_decode_paged_kv", "batch_prefill_ragged_kv", "tree_attn",
                    "attention", "merge_state")
_KV_NAMES = ("kv_cache", "copy_single_page", "compact_kv", "transpose_append", "get_kv", "rollback")

# ------------------------------------------------------------------------------------ shapes
def eval_shape(expr: Any, env: dict[str, int]) -> int | None:
    """Integer value of a shape expression with symbolic vars bound by name; None when unbound."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return env.get(str(expr.name))
    if isinstance(expr, tirx.Cast):
        return eval_shape(expr.value, env)
    ops = {tirx.Add: lambda a, b: a + b, tirx.Sub: lambda a, b: a - b, tirx.Mul: lambda a, b: a * b,
           tirx.FloorDiv: lambda a, b: a // b, tirx.FloorMod: lambda a, b: a % b,
           tirx.Div: lambda a, b: int(a / b), tirx.Mod: lambda a, b: a % b, tirx.Min: min, tirx.Max: max}
    ops.update({tirx.LT: lambda a, b: int(a < b), tirx.LE: lambda a, b: int(a <= b),
                tirx.GT: lambda a, b: int(a > b), tirx.GE: lambda a, b: int(a >= b), tirx.EQ: lambda a, b: int(a == b)})
    for cls, fn in ops.items():
        if isinstance(expr, cls):
            a, b = eval_shape(expr.a, env), eval_shape(expr.b, env)
            return None if a is None or b is None else fn(a, b)
    if isinstance(expr, tirx.Select):   # a grid sized by tiers of the row count (kernels/gpu/norm_rows.py)
        cond = eval_shape(expr.condition, env)
        return None if cond is None else eval_shape(expr.true_value if cond else expr.false_value, env)
    return None


def dim_str(d: Any) -> int | str:
    v = eval_shape(d, {})
    return v if v is not None else str(d)


def buffer_params(func: tirx.PrimFunc) -> list[Any]:
    return [p for p in func.params if isinstance(p.ty, tirx.BufferType)]


def elems(buf: Any, env: dict[str, int]) -> int | None:
    n = 1
    for d in buf.shape:
        v = eval_shape(d, env)
        if v is None:
            return None
        n *= v
    return n


def nbytes(buf: Any, env: dict[str, int]) -> int | None:
    n = elems(buf, env)
    if n is None:
        return None
    dt = tvm.runtime.DataType(str(buf.dtype))
    return n * max(1, dt.bits * dt.lanes // 8)


# ------------------------------------------------------------------------------- classification
def written_params(func: tirx.PrimFunc, text: str) -> list[Any]:
    """Parameters written by the function (T.writes in its blocks); the last parameter as a fallback."""
    bufs = buffer_params(func)
    names = set(re.findall(r"T\.writes\(([A-Za-z_]\w*)\[", text))
    written = [b for b in bufs if str(b.name) in names]
    return written or bufs[-1:]


def has_reduction(text: str) -> bool:
    return "T.axis.reduce" in text or re.search(r"T\.axis\.remap\(\"[SR]*R", text) is not None


def classify(name: str, func: tirx.PrimFunc, text: str | None = None) -> str:
    """Op class of a kernel from its name (TVM library kernels, normalisations) and structure."""
    declared = func.attrs.get("pipeline.op_class") if func.attrs else None
    if declared is not None:   # a hand-written kernel standing in for a fused one (kernels/cpu/gemv.py)
        return str(declared)
    text = text if text is not None else func.script()
    low = name.lower()
    for key, cls in _GDN_CLASSES:
        if key in low:
            return cls
    if any(k in low for k in _KV_NAMES):
        return "kv-cache"
    if any(k in low for k in _ATTENTION_NAMES):
        return "attention"
    if "rope" in low or "rotary" in low:
        return "rope"
    if "hadamard" in low:      # Walsh-Hadamard rotation of a layer input (rotated quantization schemes)
        return "rotation"
    if "rms_norm" in low or "rmsnorm" in low:
        return "rmsnorm"
    if "layer_norm" in low or "layernorm" in low:   # ONNX graphs (encoders)
        return "layernorm"
    if "l2_norm" in low:    # the Gated DeltaNet's q / k on the GPU (kernels/gpu/norm_rows.py)
        return "l2norm"
    if low.startswith("take") or "embedding" in low or "gather" in low:
        return "gather"
    bufs = buffer_params(func)
    outs = written_params(func, text)
    ins = [b for b in bufs if not any(b.same_as(o) for o in outs)]
    if has_reduction(text):
        if "rsqrt" in text and len(outs) == 1 and any(len(b.shape) == 1 for b in ins):
            return "rmsnorm"
        if matmul_k(ins, outs) is not None:
            rows = elems(outs[0], {}) if outs else None
            last = eval_shape(outs[0].shape[-1], {}) if outs and outs[0].shape else None
            kind = "gemv" if rows is not None and last and rows // last == 1 else "matmul"
            if any(t in low for t in _TERNARY_NAMES):
                return f"dequant-{kind}-ternary"
            return f"dequant-{kind}" if any(str(b.dtype) in ("uint32", "int8") for b in ins) else kind
        return "reduction"
    pattern = func.attrs.get("op_pattern") if func.attrs else None
    if pattern is not None:
        if int(pattern) <= 1:
            return "elementwise"
        if int(pattern) == 2:
            return "injective"
    if outs and all(same_shape(b, outs[0]) for b in ins):
        return "elementwise"
    return "injective" if outs else "other"


def same_shape(a: Any, b: Any) -> bool:
    return len(a.shape) == len(b.shape) and all(str(x) == str(y) for x, y in zip(a.shape, b.shape, strict=True))


def matmul_k(ins: list[Any], outs: list[Any]) -> Any | None:
    """The reduction length K of a matmul: the last dim of the input sharing the output's leading dims."""
    if len(outs) != 1 or len(outs[0].shape) < 2:
        return None
    lead = [str(d) for d in outs[0].shape[:-1]]
    for b in ins:
        if len(b.shape) == len(outs[0].shape) and [str(d) for d in b.shape[:-1]] == lead:
            return b.shape[-1]
    return None


def parse_classes(value: Any, source: str, path: Any = None) -> tuple[str, ...]:
    """Op classes from a YAML list or a comma-separated option; an unknown one is a one-line error."""
    if value in (None, "", []):
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    classes = tuple(dict.fromkeys(str(c).strip() for c in items if str(c).strip()))
    unknown = [c for c in classes if c not in OP_CLASSES]
    if unknown:
        raise ConfigError(f"unknown op class(es) {', '.join(unknown)} in {source}", path=path,
                          fix=f"use some of: {', '.join(OP_CLASSES)}")
    return classes


def moe_cost(func: tirx.PrimFunc, env: dict[str, int]) -> tuple[int | None, int | None]:
    """(bytes, FLOPs) of one call of a routed-experts gather GEMV (models/moe_kernels.py): each of the n x k
    (token, chosen expert) pairs reads that expert's slab of the stacked weights [E, rows, K'] (and scales),
    never the other experts'; the activations and indices are read whole."""
    bufs = buffer_params(func)
    weights = [b for b in bufs if b.shape and isinstance(b.shape[0], tirx.IntImm)]
    acts = [b for b in bufs if not any(b.same_as(w) for w in weights)]
    idx = next((b for b in acts if str(b.dtype) == "int32" and len(b.shape) == 2), None)
    if idx is None or not weights:
        return None, None
    tokens, k = eval_shape(idx.shape[0], env), eval_shape(idx.shape[1], env)
    act_bytes = [nbytes(b, env) for b in acts]
    if tokens is None or k is None or None in act_bytes:
        return None, None
    slab = [nbytes(w, {}) // int(w.shape[0].value) for w in weights]
    codes = weights[0]
    reduction = func.attrs.get("pipeline.moe_reduction") if func.attrs else None
    if reduction is not None:   # K as the kernel declares it (a packed word holds 8, 16, 20 or 32 weights)
        macs = tokens * k * int(codes.shape[1].value) * int(reduction)
    else:
        per_elem = {"uint32": 8}.get(str(codes.dtype), 1)   # q4: 8 weights per word
        macs = tokens * k * (elems(codes, {}) // int(codes.shape[0].value)) * per_elem
    return tokens * k * sum(slab) + sum(act_bytes), 2 * macs
