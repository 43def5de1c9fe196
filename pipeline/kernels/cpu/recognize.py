"""Which fused functions the hand-written CPU kernels stand in for: the one-token (or prompt) KN GEMV of
packed codes and the one-token NT GEMV of float weights, with the parameters (format, N, K, dtypes, the
role of each parameter) the kernels are built for.
"""

from __future__ import annotations

import re

from tvm import tirx

from pipeline.kernels.cpu.packed import (
    FLOAT_NT_CHAINS,
    FLOAT_NT_ROWS,
    FORMATS,
    LANES,
    ROLES,
    TILED_PACKED,
    TILED_Q8,
    q8_tile_of,
)

_NT_CAST = re.compile(r'^\s*(\w+)\[(\w+), (\w+)\] = (?:T\.Cast\("float32", )?(\w+)\[\2, \3\]\)?$', re.M)  # or a copy
_NT_MATMUL = re.compile(r'(\w+)\[(\w+), (\w+), (\w+)\] = \1\[\2, \3, \4\] \+ (\w+)\[\2, \3, (\w+)\] \* (\w+)\[\4, \6\]')


def match_packed_kn_gemv(func: tirx.PrimFunc, text: str | None = None, rows: str = "one"
                         ) -> tuple[str, int, int, str, tuple[str, ...]] | None:
    """(format, N, K, scale dtype, the role of each parameter in order) when `func` is a fused one-token KN
    GEMV of packed codes: blocks dequantize then matmul, tensors codes uint32 [K / codes per word, N],
    scales [groups, N], x float32 [1, 1, K] and out float32 [1, 1, N] (the last parameter, as in every
    function TE / relax fusion makes). rows="prompt": the same with a symbolic row count instead of 1
    (x [1, m, K], out [1, m, N]: a prefill). `text`: func.script(), when the caller has it. q8 codes tiled
    (quantize.tile_q8) are TILED_Q8; q4 / t2 codes and scales tiled (quantize.tile_kn, in two tiles or more)
    TILED_Q4 / TILED_T2."""
    text = text if text is not None else func.script()
    blocks = [b for b in re.findall(r'T\.sblock\("(\w+)"\)', text) if b != "root"]
    fmt = next((f for f, spec in FORMATS.items() if blocks == [spec.block, "matmul"]), None)
    if fmt is None or FORMATS[fmt].pattern not in text:
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


def match_float_nt_gemv(func: tirx.PrimFunc, text: str | None = None, min_work: int = 0
                        ) -> tuple[int, int, str, tuple[str, ...]] | None:
    """(N, K, weight dtype, each parameter's role) when `func` is exactly a one-token NT matmul of float
    weights, out[0, 0, n] = sum_k x[0, 0, k] * float32(w[n, k]), the widening in its own block or none
    (q0f16 / q0f32 decode as relax fuses it: x float32 [1, 1, K], w float16 / float32 [N, K], out float32
    [1, 1, N], out last) of at least `min_work` multiply-adds; None for anything else (a bias or residual
    epilogue included)."""
    text = text if text is not None else func.script()
    blocks = [b for b in re.findall(r'T\.sblock\("(\w+)"\)', text) if b != "root"]
    matmul = _NT_MATMUL.findall(text)
    if len(blocks) not in (1, 2) or len(matmul) != 1 or 'T.axis.remap("SSSR"' not in text or "T.init()" not in text:
        return None
    out_name, *_, x_name, _, w_name = matmul[0]
    params = list(func.params)
    if len(params) != 3 or any(not all(isinstance(d, tirx.IntImm) for d in p.shape) for p in params):
        return None
    names = [p.name for p in params]
    if len(blocks) == 2:   # the widening block: w_name is its output, cast from a parameter
        cast = _NT_CAST.findall(text)
        if len(cast) != 1 or cast[0][0] != w_name:
            return None
        w_name = cast[0][3]
    if sorted(names[:2]) != sorted([x_name, w_name]) or out_name != names[2]:
        return None
    shapes = {p.name: tuple(int(d) for d in p.shape) for p in params}
    dtypes = {p.name: str(p.dtype) for p in params}
    if len(shapes[w_name]) != 2:
        return None
    n, k = shapes[w_name]
    if (dtypes[x_name], dtypes[names[2]]) != ("float32", "float32") or dtypes[w_name] not in ("float16", "float32"):
        return None
    if shapes[x_name] != (1, 1, k) or shapes[names[2]] != (1, 1, n) or n * k < min_work:
        return None
    if n % FLOAT_NT_ROWS or k % (FLOAT_NT_CHAINS * LANES):
        return None
    return n, k, dtypes[w_name], tuple("x" if nm == x_name else "w" for nm in names[:2]) + ("out",)

