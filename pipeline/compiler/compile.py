"""Lower a fused, scheduled Relax module to a VM library and export it in the target's form.

host-cpu: a shared object the runner loads. Phone targets: a system-lib `.tar` of objects (host code
for aarch64 + embedded device kernels), which MLC's Android/iOS packaging links into the app, with
the system-lib prefix `<model>_<quant>_` (stages.system_lib_prefix) so several models can live in one binary.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad(...) builds in TVM 0.27
from tvm.support import tar

from pipeline.errors import CompileError
from pipeline.kernels.cpu.rope import NO_CSE_ATTR
from pipeline.progress import Reporter


def attach_metadata(mod: tvm.IRModule, metadata: dict[str, Any]) -> tvm.IRModule:
    """`_metadata()` returns the JSON an app runtime reads before loading weights."""
    body = tvm.ir.StringImm(json.dumps(metadata, sort_keys=True))
    func = relax.Function([], body, relax.ObjectType()).with_attr("global_symbol", "_metadata")
    mod = mod.clone() if hasattr(mod, "clone") else mod
    mod["_metadata"] = func
    return mod


_ALLOCATIONS = ("relax.memory.alloc_storage", "relax.builtin.alloc_tensor")   # both take the shape first


def memory_usage(mod: tvm.IRModule, sizes: dict[str, int], default: int) -> dict[str, int]:
    """Bytes each public Relax function allocates for its intermediates, after TVM's static memory planning, with
    the symbolic sizes at their largest (`sizes`: e.g. seq_len -> prefill chunk; others -> `default`). MLC's
    engine reads this as `_metadata.memory_usage` and reserves twice the largest before sizing the KV cache."""
    t = relax.transform
    planned = tvm.transform.Sequential([t.RewriteDataflowReshape(), t.ToNonDataflow(), t.RemovePurityChecking(),
                                        t.CallTIRRewrite(), t.StaticPlanBlockMemory()])(mod)
    usage: dict[str, int] = {}
    for gv, func in planned.functions_items():
        if not isinstance(func, relax.Function) or func.attrs is None or "global_symbol" not in func.attrs:
            continue
        total = [0]

        def visit(expr, total=total):
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in _ALLOCATIONS:
                shape = expr.args[0]
                if isinstance(shape, relax.ShapeExpr):
                    n = math.prod(_evaluate(dim, sizes, default) for dim in shape.values)
                    if expr.op.name == "relax.builtin.alloc_tensor":
                        n *= (tvm.runtime.DataType(str(expr.args[1].value)).bits + 7) // 8
                    total[0] += n

        relax.analysis.post_order_visit(func.body, visit)
        usage[gv.name_hint] = total[0]
    return usage


_BINARY = {tirx.Add: lambda a, b: a + b, tirx.Sub: lambda a, b: a - b, tirx.Mul: lambda a, b: a * b,
           tirx.FloorDiv: lambda a, b: a // b, tirx.FloorMod: lambda a, b: a % b, tirx.Div: lambda a, b: a // b,
           tirx.Mod: lambda a, b: a % b, tirx.Max: max, tirx.Min: min}


def _evaluate(expr, sizes: dict[str, int], default: int) -> int:
    """An integer size expression with its variables at `sizes` (by name) or `default`."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return sizes.get(expr.name, default)
    if isinstance(expr, tirx.Cast):
        return _evaluate(expr.value, sizes, default)
    op = _BINARY.get(type(expr))
    if op is None:
        raise CompileError(f"cannot size an allocation of {expr}", fix="report it: a new shape expression kind")
    return op(_evaluate(expr.a, sizes, default), _evaluate(expr.b, sizes, default))


_ARITH = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max)


def _slots_read(expr) -> set[int] | None:
    """Constant slots an integer expression loads; None for anything but loads, constants and arithmetic."""
    if isinstance(expr, tirx.IntImm):
        return set()
    if isinstance(expr, TensorLoad) and len(expr.indices) == 1 and isinstance(expr.indices[0], tirx.IntImm):
        return {int(expr.indices[0])}
    if isinstance(expr, tirx.Cast):
        return _slots_read(expr.value)
    if isinstance(expr, _ARITH):
        a, b = _slots_read(expr.a), _slots_read(expr.b)
        return None if a is None or b is None else a | b
    return None


def _sorted_body(body):
    """A sequence of independent `H[i] = f(H[j], ...)` stores, ordered by slot i (else unchanged)."""
    if not isinstance(body, tirx.SeqStmt):
        return None
    stores = list(body.seq)
    if not all(isinstance(s, tirx.BufferStore) and len(s.indices) == 1 and isinstance(s.indices[0], tirx.IntImm)
               for s in stores):
        return None
    written = {int(s.indices[0]) for s in stores}
    reads = [_slots_read(s.value) for s in stores]
    if len(written) != len(stores) or any(r is None or r & written for r in reads):
        return None
    return tirx.SeqStmt(sorted(stores, key=lambda s: int(s.indices[0])))


@tvm.transform.module_pass(opt_level=0, name="SortShapeStores")
def sort_shape_stores(mod, _ctx):
    """VMShapeLower emits a shape function's independent slot stores in hash order, which changes between
    runs; sorted by slot, the same model compiles to the same bytes (reproducible releases)."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and gv.name_hint.startswith("shape_func"):
            body = _sorted_body(func.body)
            if body is not None:
                mod[gv] = func.with_body(body)
    return mod


def lowering_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    t = relax.transform
    passes = [
        t.RewriteDataflowReshape(), t.ToNonDataflow(), t.RemovePurityChecking(), t.CallTIRRewrite(),
        t.StaticPlanBlockMemory(), t.LowerAllocTensor(), t.KillAfterLastUse(), t.LowerRuntimeBuiltin(),
        t.ComputePrimValue(), t.VMShapeLower(), sort_shape_stores, t.AttachGlobalSymbol(),
    ]

    @tvm.transform.module_pass(opt_level=0, name="LowerToVM")
    def _lower(mod, _ctx):
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _lower


def build_library(mod: tvm.IRModule, target: tvm.target.Target, *, library: str, system_lib: bool,
                  prefix: str, out_dir: Path) -> Path:
    """Compile and export; returns the library path inside out_dir."""
    if system_lib:
        mod = mod.with_attr("system_lib_prefix", prefix)
    # kernels/cpu/rope.CSE_BREAKS: TVM 0.27's TIR CSE pass breaks a marked kernel; build without that pass
    no_cse = any(isinstance(f, tirx.PrimFunc) and f.attrs is not None and NO_CSE_ATTR in f.attrs
                 for _, f in mod.functions_items())
    try:
        with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}) if no_cse else contextlib.nullcontext():
            executable = relax.build(mod, target, relax_pipeline=lowering_pipeline(target), system_lib=system_lib)
    except TypeError as err:
        if system_lib and "Cannot treat type `ir.Call`" in str(err):
            # TVM 0.27's AttachGlobalSymbol cannot rename kernels holding tvm_access_ptr (Metal simdgroup
            # MMA from dlight's Matmul) for a system-lib prefix.
            raise CompileError("TVM 0.27 cannot give system-lib names to tensorized (simdgroup/MMA) kernels",
                               fix="use the matmul_simt schedule rule instead of matmul for this target") from None
        raise
    out_dir.mkdir(parents=True, exist_ok=True)
    if library == "so":
        path = out_dir / f"{prefix}model.so"
        executable.export_library(str(path))
    else:
        path = out_dir / f"{prefix}model.tar"
        executable.export_library(str(path), fcompile=tar.tar)
    return path


def compile_library(mod: Any, meta: dict[str, Any], schedules: list[Any], backend: Any, prefix: str,
                    key: str, tmp: Path, report: Reporter, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compile a scheduled module (and the backend's extra libraries: an NPU's) into `tmp` and write build.json;
    the LLM path and ONNX graphs share it; `extra`: more facts for build.json. No timings in build.json: it goes into the bundle, whose
    manifest must be reproducible. `backend`: the target's compiler/backend.Backend."""
    target = backend.spec
    with report.step(f"compile for {target.name}"):
        lib = build_library(attach_metadata(mod, meta), target.tvm(), library=target.library,
                            system_lib=target.system_lib, prefix=prefix, out_dir=tmp)
    info = {"library": lib.name, "system_lib_prefix": prefix, "metadata": meta, "key": key,
            "kernels": [{"name": s.name, "rule": s.rule, "on_device": s.on_device,
                         **({"reason": s.reason} if s.reason else {}),
                         **({"hvx_instructions": s.hvx_instructions} if s.hvx_instructions is not None else {})}
                        for s in schedules]}
    dots = backend.dot_code(lib, prefix)
    if dots is not None:
        info["dot_code"] = dots
    info.update(backend.extra_libraries(mod, schedules, prefix, tmp, report))
    info.update(extra or {})
    (tmp / "build.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return info
