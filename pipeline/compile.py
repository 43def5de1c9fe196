"""Lower a fused, scheduled Relax module to a VM library and export it in the target's form.

host-cpu: a shared object the runner loads. Phone targets: a system-lib `.tar` of objects (host code
for aarch64 + embedded device kernels), which MLC's Android/iOS packaging links into the app, with
the system-lib prefix `<model_type>_<quant>_` so several models can live in one binary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

from .errors import CompileError


def attach_metadata(mod: tvm.IRModule, metadata: dict[str, Any]) -> tvm.IRModule:
    """`_metadata()` returns the JSON an app runtime reads before loading weights."""
    body = tvm.ir.StringImm(json.dumps(metadata, sort_keys=True))
    func = relax.Function([], body, relax.ObjectType()).with_attr("global_symbol", "_metadata")
    mod = mod.clone() if hasattr(mod, "clone") else mod
    mod["_metadata"] = func
    return mod


def lowering_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    t = relax.transform
    passes = [
        t.RewriteDataflowReshape(), t.ToNonDataflow(), t.RemovePurityChecking(), t.CallTIRRewrite(),
        t.StaticPlanBlockMemory(), t.LowerAllocTensor(), t.KillAfterLastUse(), t.LowerRuntimeBuiltin(),
        t.ComputePrimValue(), t.VMShapeLower(), t.AttachGlobalSymbol(),
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
    try:
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
        from tvm.support import tar

        path = out_dir / f"{prefix}model.tar"
        executable.export_library(str(path), fcompile=tar.tar)
    return path
