"""Which fused functions the hand-written CPU kernels stand in for: the one-token (or prompt) KN GEMV of
packed codes and the one-token NT GEMV of float weights, with the parameters (format, N, K, dtypes, the
role of each parameter) the kernels are built for.

Recognised on the TIR itself (block names, which the TE in models/layers.py gives and FuseOps / FuseTIR
keep; the store expressions; parameter shapes), never on its printed form: a printer change must not make
every fast kernel silently drop out. This TVM has no Python statement visitor, so `statements` walks the
few statement kinds a function body holds.
"""

from __future__ import annotations

from tvm import ir, tirx
from tvm.s_tir import SBlock, SBlockRealize

from pipeline.kernels.cpu.packed import (
    FLOAT_NT_CHAINS,
    FLOAT_NT_ROWS,
    FORMATS,
    LANES,
    NK_FORMATS,
    ROLES,
    TILED_PACKED,
    TILED_Q8,
    TILED_T3,
    PackedFormat,
    q8_tile_of,
)
from pipeline.tir_walk import statements  # noqa: F401 - also read as recognize.statements

_LOAD = ir.expr.TensorLoad   # what tirx.BufferLoad builds in this TVM


def blocks(func: tirx.PrimFunc) -> list[SBlock]:
    """`func`'s blocks in program order, the root block left out."""
    return [s for s in statements(func.body) if isinstance(s, SBlock) and s.name_hint != "root"]


def block_names(func: tirx.PrimFunc) -> list[str]:
    return [b.name_hint for b in blocks(func)]


def _dtype(expr) -> str:
    return str(expr.ty)


def _is_cast(expr, dtype: str) -> bool:
    return isinstance(expr, tirx.Cast) and _dtype(expr) == dtype


def _same_vars(indices, want) -> bool:
    """`indices` are exactly the variables `want`, in order."""
    return len(indices) == len(want) and all(isinstance(i, tirx.Var) and i.same_as(w) for i, w in zip(indices, want, strict=True))


def _dequantizes(block: SBlock, spec: PackedFormat) -> bool:
    """`block` stores the fused TE's fp32 dequantize of `spec` (models/layers.py): (code - offset) *
    float32(scale) for packed codes, float32(code) * float32(scale) for int8 ones."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Mul):
        return False
    code, scale = store.value.a, store.value.b
    if not _is_cast(scale, "float32"):
        return False
    if spec.bits == 8:
        return _is_cast(code, "float32") and isinstance(code.value, _LOAD)
    offset = code.b if isinstance(code, tirx.Sub) else None
    return isinstance(offset, tirx.FloatImm) and _dtype(offset) == "float32" and float(offset.value) == float(spec.offset)


def match_packed_kn_gemv(func: tirx.PrimFunc, rows: str = "one") -> tuple[str, int, int, str, tuple[str, ...]] | None:
    """(format, N, K, scale dtype, the role of each parameter in order) when `func` is a fused one-token KN
    GEMV of packed codes: blocks dequantize then matmul, tensors codes uint32 [K / codes per word, N],
    scales [groups, N], x float32 [1, 1, K] and out float32 [1, 1, N] (the last parameter, as in every
    function TE / relax fusion makes). rows="prompt": the same with a symbolic row count instead of 1
    (x [1, m, K], out [1, m, N]: a prefill). q8 codes tiled
    (quantize.tile_q8) are TILED_Q8; q4 / t2 codes and scales tiled (quantize.tile_kn, in two tiles or more)
    TILED_Q4 / TILED_T2."""
    found = blocks(func)
    names = [b.name_hint for b in found]
    fmt = next((f for f, spec in FORMATS.items() if names == [spec.block, "matmul"]), None)
    if fmt is None or not _dequantizes(found[0], FORMATS[fmt]):
        return None
    spec = FORMATS[fmt]
    params = list(func.params)   # tensor parameters carry shape and dtype
    if len(params) != 4:
        return None
    shapes, row_vars = [], []
    for p in params:
        dims = []
        for i, d in enumerate(p.shape):
            if isinstance(d, tirx.IntImm):
                dims.append(int(d))
            elif rows == "prompt" and i == 1 and isinstance(d, tirx.Var) and len(p.shape) == 3:
                dims.append(1)             # the prompt's rows: one symbolic variable shared by x and out
                row_vars.append(d)
            else:
                return None
        shapes.append(tuple(dims))
    if rows == "prompt" and (len(row_vars) != 2 or not row_vars[0].same_as(row_vars[1])):
        return None             # x and out both [1, m, .] over the same m
    dtypes = [str(p.dtype) for p in params]
    out = shapes[-1]
    if dtypes[-1] != "float32" or len(out) != 3 or out[:2] != (1, 1):
        return None
    n = out[2]
    roles = []
    tiled_packed = fmt in TILED_PACKED.values()   # q4 / t2 codes + scales may be tiled (3-d)
    for shape, dtype in zip(shapes[:-1], dtypes[:-1], strict=True):
        if dtype == spec.code_dtype and (len(shape) == 2 or ((spec.bits == 8 or tiled_packed) and len(shape) == 3)):
            roles.append("codes")      # 3-d: q8 codes tiled (quantize.tile_q8) or q4 / t2 (quantize.tile_kn)
        elif dtype == "float32" and len(shape) == 3 and shape[:2] == (1, 1):
            roles.append("x")
        elif dtype in ("float16", "float32") and (len(shape) == 2 or (tiled_packed and len(shape) == 3)):
            roles.append("scales")
        else:
            return None
    if sorted(roles) != sorted(ROLES[:3]):
        return None
    by_role = dict(zip(roles, shapes[:-1], strict=True))
    k = by_role["x"][2]
    groups = -(-k // spec.group)
    if len(by_role["codes"]) == 3 and tiled_packed:
        tile = by_role["codes"][2]
        if (n % tile or tile % LANES or n // tile < 2 or by_role["codes"] != (n // tile, k // spec.codes, tile)
                or by_role["scales"] != (n // tile, groups, tile) or k % LANES):
            return None
        return next(t for t, f in TILED_PACKED.items() if f == fmt), n, k, dtypes[roles.index("scales")], (*roles, "out")
    if len(by_role["codes"]) == 3:
        if not q8_tile_of(by_role["codes"], n, k) or by_role["scales"] != (groups, n):
            return None
        return TILED_Q8, n, k, dtypes[roles.index("scales")], (*roles, "out")
    if k % spec.codes or n % LANES or by_role["codes"] != (k // spec.codes, n) or by_role["scales"] != (groups, n):
        return None
    return fmt, n, k, dtypes[roles.index("scales")], (*roles, "out")


def _dequantizes_nk(block: SBlock, spec: PackedFormat, dtype: str) -> bool:
    """`block` stores the fused TE's dequantize of NK `spec` codes in `dtype` (models/layers.py): (code -
    offset) * scale for packed codes, code * scale for int8 ones, the scale widened when `dtype` is wider."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Mul) or _dtype(store.value) != dtype:
        return False
    code, scale = store.value.a, store.value.b
    if not (_is_cast(scale, dtype) and isinstance(scale.value, _LOAD)) and not isinstance(scale, _LOAD):
        return False
    if spec.bits == 8:
        return _is_cast(code, dtype) and isinstance(code.value, _LOAD)
    offset = code.b if isinstance(code, tirx.Sub) else None
    return isinstance(offset, tirx.FloatImm) and float(offset.value) == float(spec.offset)


def match_packed_nk_gemv(func: tirx.PrimFunc, rows: str = "one") -> tuple[str, int, int, str, str, tuple[str, ...]] | None:
    """(format, N, K, activation dtype, scale dtype, the role of each parameter in order) when `func` is a fused
    GEMV of NK codes (MLC's plain layout, android-cpu): blocks dequantize then matmul, codes uint32 [N, K /
    codes per word] or int8 [N, K], scales [N, groups], x [1, 1, K] and out [1, 1, N] in one float dtype (the
    target's compute dtype), out last. rows="prompt": x [1, m, K] and out [1, m, N] over one symbolic m (a
    prefill). q4 rows interleaved (formats.interleave_rows: codes [N / t, K / 8, t], scales [N / t, groups,
    t]) are TILED_Q4, t2 ones (codes [N / t, K / 16, t]) TILED_T2, q8 ones (quantize.interleave_q8: codes
    [N / t, K / 4, 4 t]) TILED_Q8."""
    found = blocks(func)
    names = [b.name_hint for b in found]
    fmt = next((f for f, spec in NK_FORMATS.items() if names == [spec.block, "matmul"]), None)
    params = list(func.params)
    if fmt is None or len(params) != 4:
        return None
    spec = NK_FORMATS[fmt]
    act = str(params[-1].dtype)
    if act not in ("float16", "float32") or not _dequantizes_nk(found[0], spec, act):
        return None
    shapes, row_vars = [], []
    for p in params:
        dims = []
        for i, d in enumerate(p.shape):
            if isinstance(d, tirx.IntImm):
                dims.append(int(d))
            elif rows == "prompt" and i == 1 and isinstance(d, tirx.Var) and len(p.shape) == 3:
                dims.append(1)
                row_vars.append(d)
            else:
                return None
        shapes.append(tuple(dims))
    if (rows == "prompt") != bool(row_vars) or (row_vars and (len(row_vars) != 2 or not row_vars[0].same_as(row_vars[1]))):
        return None
    out = shapes[-1]
    if len(out) != 3 or out[:2] != (1, 1):
        return None
    n = out[2]
    roles, by_role = [], {}
    for p, shape in zip(params[:-1], shapes[:-1], strict=True):
        dtype = str(p.dtype)
        interleaved = fmt in ("q4", "q8", "t2", "t3") and len(shape) == 3 and shape[:2] != (1, 1)   # 3-d codes / scales
        role = ("codes" if dtype == spec.code_dtype and (len(shape) == 2 or interleaved) else
                "x" if dtype == act and len(shape) == 3 and shape[:2] == (1, 1) else
                "scales" if dtype in ("float16", "float32") and (len(shape) == 2 or interleaved) else "")
        roles.append(role)
        by_role[role] = (shape, dtype)
    if sorted(roles) != sorted(ROLES[:3]):
        return None
    k = by_role["x"][0][2]
    codes, scales = by_role["codes"][0], by_role["scales"][0]
    if len(codes) == 3:
        t = scales[2] if len(scales) == 3 else 0
        want = (n // t, k // 4, 4 * t) if spec.bits == 8 else (n // t, -(-k // spec.codes), t)
        # t2: the last group may be shorter; t3: the last word too (padded)
        whole = k % spec.codes == 0 if spec.bits == 2 else True if spec.per_word else k % spec.group == 0
        if not t or n % t or codes != want or scales != (n // t, -(-k // spec.group), t) or not whole:
            return None
        tiled = TILED_Q8 if spec.bits == 8 else TILED_T3 if fmt == "t3" else next(
            t for t, f in TILED_PACKED.items() if f == fmt)
        return tiled, n, k, act, by_role["scales"][1], (*roles, "out")
    whole = k % spec.codes == 0 or spec.per_word     # t3 rows end in a padded word
    if not whole or by_role["codes"][0] != (n, -(-k // spec.codes)) or by_role["scales"][0] != (n, -(-k // spec.group)):
        return None
    return fmt, n, k, act, by_role["scales"][1], (*roles, "out")


def _nt_update(store: tirx.BufferStore):
    """(out, x, w) when `store` is out[a, b, c] = out[a, b, c] + x[a, b, r] * w[c, r] (the matmul block's
    update over plain iteration variables), else None."""
    if len(store.indices) != 3 or not all(isinstance(i, tirx.Var) for i in store.indices):
        return None
    value = store.value
    if not isinstance(value, tirx.Add) or not isinstance(value.b, tirx.Mul):
        return None
    acc, x, w = value.a, value.b.a, value.b.b
    if not all(isinstance(e, _LOAD) for e in (acc, x, w)) or not acc.source.same_as(store.buffer):
        return None
    a, b, c = store.indices
    if not _same_vars(acc.indices, (a, b, c)) or len(x.indices) != 3 or not isinstance(x.indices[2], tirx.Var):
        return None
    if not _same_vars(x.indices, (a, b, x.indices[2])) or not _same_vars(w.indices, (c, x.indices[2])):
        return None
    return store.buffer, x.source, w.source


def _widening(store: tirx.BufferStore):
    """(destination, source) when `store` is dst[i, j] = float32(src[i, j]) or a plain copy, else None."""
    if len(store.indices) != 2 or not all(isinstance(i, tirx.Var) for i in store.indices):
        return None
    value = store.value.value if _is_cast(store.value, "float32") else store.value
    if not isinstance(value, _LOAD) or not _same_vars(value.indices, tuple(store.indices)):
        return None
    return store.buffer, value.source


def _sssr(realize: SBlockRealize) -> bool:
    """Three spatial iteration variables then one reduction, each bound to a loop variable as it stands."""
    kinds = [int(iv.iter_type) for iv in realize.block.iter_vars]
    return (kinds == [tirx.IterVar.DataPar] * 3 + [tirx.IterVar.CommReduce]
            and all(isinstance(v, tirx.Var) for v in realize.iter_values))


def match_float_nt_gemv(func: tirx.PrimFunc, min_work: int = 0) -> tuple[int, int, str, tuple[str, ...]] | None:
    """(N, K, weight dtype, each parameter's role) when `func` is exactly a one-token NT matmul of float
    weights, out[0, 0, n] = sum_k x[0, 0, k] * float32(w[n, k]), the widening in its own block or none
    (q0f16 / q0f32 decode as relax fuses it: x float32 [1, 1, K], w float16 / float32 [N, K], out float32
    [1, 1, N], out last) of at least `min_work` multiply-adds; None for anything else (a bias or residual
    epilogue included)."""
    body = list(statements(func.body))
    found = [s for s in body if isinstance(s, SBlock) and s.name_hint != "root"]
    stores = [s for s in body if isinstance(s, tirx.BufferStore)]
    matmul = [m for m in map(_nt_update, stores) if m is not None]
    if (len(found) not in (1, 2) or len(matmul) != 1 or not any(b.init is not None for b in found)
            or not any(_sssr(s) for s in body if isinstance(s, SBlockRealize))):
        return None
    out_buf, x_buf, w_buf = matmul[0]
    params = list(func.params)
    if len(params) != 3 or any(not all(isinstance(d, tirx.IntImm) for d in p.shape) for p in params):
        return None
    if len(found) == 2:   # the widening block: w_buf is its output, cast from a parameter
        cast = [c for c in map(_widening, stores) if c is not None]
        if len(cast) != 1 or not cast[0][0].same_as(w_buf):
            return None
        w_buf = cast[0][1]
    roles = ["x" if p.same_as(x_buf) else "w" if p.same_as(w_buf) else "" for p in params[:2]]
    if sorted(roles) != ["w", "x"] or not params[2].same_as(out_buf):
        return None
    x, w, out = params[roles.index("x")], params[roles.index("w")], params[2]
    shapes = {role: tuple(int(d) for d in p.shape) for role, p in (("x", x), ("w", w), ("out", out))}
    if len(shapes["w"]) != 2:
        return None
    n, k = shapes["w"]
    if (str(x.dtype), str(out.dtype)) != ("float32", "float32") or str(w.dtype) not in ("float16", "float32"):
        return None
    if shapes["x"] != (1, 1, k) or shapes["out"] != (1, 1, n) or n * k < min_work:
        return None
    if n % FLOAT_NT_ROWS or k % (FLOAT_NT_CHAINS * LANES):
        return None
    return n, k, str(w.dtype), (*roles, "out")
