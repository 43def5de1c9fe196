"""The signatures of a library's public functions, read from the Relax module that is compiled into it.

Recorded in build.json (a bundle's reports/kernels.json) so that `pipeline check` can compare a bundle of any
target with an app runtime's contract without loading it: a phone library cannot be loaded here. Each argument
and result is {"kind": tensor|object|params|int|tuple, ...}: tensors with their dtype and dims (an int, or the
name of a symbolic size), objects with their parameter name (paged_kv_cache, rnn_state)."""

from __future__ import annotations

from typing import Any

from tvm import relax, tirx


def _dim(value: Any) -> int | str:
    if isinstance(value, tirx.IntImm):
        return int(value.value)
    if isinstance(value, tirx.Var):
        return value.name
    return str(value)


def describe(ty: Any, name: str | None = None) -> dict[str, Any]:
    """One argument or result type in the notation above."""
    if isinstance(ty, relax.TensorType):
        shape = ty.shape
        dims = [_dim(d) for d in shape.values] if isinstance(shape, relax.ShapeExpr) else None
        return {"kind": "tensor", "dtype": str(ty.dtype), "dims": dims}
    if isinstance(ty, relax.ShapeType):
        return {"kind": "int"}
    if isinstance(ty, relax.TupleType):
        if name is not None and all(isinstance(f, relax.TensorType) for f in ty.fields):
            return {"kind": "params", "count": len(ty.fields)}
        return {"kind": "tuple", "fields": [describe(f) for f in ty.fields]}
    if isinstance(ty, relax.ObjectType):
        return {"kind": "object", **({"name": name} if name else {})}
    return {"kind": type(ty).__name__}


def function_signatures(mod: Any) -> dict[str, dict[str, Any]]:
    """name -> {"args": [...], "returns": [...]} for every Relax function an app can call."""
    out = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or func.attrs is None or "global_symbol" not in func.attrs:
            continue
        ret = describe(func.ret_ty)
        returns = ret["fields"] if ret["kind"] == "tuple" else [ret]
        out[gv.name_hint] = {"args": [describe(p.ty, p.name) for p in func.params], "returns": returns}
    return dict(sorted(out.items()))


KV_CACHE_CREATE = "vm.builtin.paged_attention_kv_cache_create"


def kv_cache_config_fields(mod: Any) -> int | None:
    """How many config fields the library's paged KV cache passes to the runtime (None: no paged KV cache)."""
    found: list[int] = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.args and isinstance(expr.args[0], relax.ExternFunc) \
                and expr.args[0].global_symbol == KV_CACHE_CREATE and isinstance(expr.args[1], relax.ShapeExpr):
            found.append(len(expr.args[1].values))

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return max(found) if found else None
