"""Forced CPU fallback: pin whole op classes to the phone's CPU, for experiments and for drivers that
miscompile a kernel class.

The op classes come from the target YAML (`force_cpu: [rmsnorm, ...]`) or the build option
(`--force-cpu rmsnorm,softmax`, Makefile `FORCE_CPU=`). On a GPU target the pinned kernels are really
compiled for the host CPU: each PrimFunc keeps its unscheduled (or CPU-scheduled) body and gets the
target's host as its `target` attribute, so TVM builds it into the host object instead of the OpenCL /
Metal source; the Relax functions copy the kernel's inputs to a CPU virtual device and its outputs back
(`relax.op.to_vdevice`), which the VM turns into device copies. On CPU-only targets (and the CPU side of
the Hexagon target) pinning only changes placement: the kernel stays in the CPU library and leaves the NPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import tvm
from tvm import relax, tirx

from pipeline.compiler.backend import backend_for
from pipeline.errors import ConfigError
from pipeline.kernels.cpu.schedule import CPUInlineParallel
from pipeline.kernels.gpu import add_norm
from pipeline.op_classes import classify, parse_classes

FORCED = "forced"


def reasons(target: Any, option: str | None) -> dict[str, str]:
    """{op class: why it is pinned}: the target YAML's `force_cpu`, then the build option."""
    path = getattr(target, "path", None)
    where = f"targets/{path.name}" if path is not None else "the target"
    out = {cls: f"by config: {where} force_cpu" for cls in getattr(target, "force_cpu", ())}
    for cls in parse_classes(option, "--force-cpu"):
        out.setdefault(cls, "by option --force-cpu")
    return out


def apply(mod: tvm.IRModule, unscheduled: dict[str, tirx.PrimFunc], records: list[Any], forced: dict[str, str],
          target: Any) -> tuple[tvm.IRModule, list[Any]]:
    """Pin kernels whose op class is a key of `forced` ({op class: why}) to the CPU.

    `unscheduled` maps kernel names to their PrimFuncs before the tune stage (the CPU-compilable bodies). Returns the module
    (GPU targets: pinned kernels retargeted to the host and wrapped in device copies) and updated records.
    """
    if not forced:
        return mod, records
    pinned: list[str] = []
    out = []
    for r in records:
        cls = classify(r.name, mod[r.name])
        if cls in forced:
            pinned.append(r.name)
            out.append(replace(r, rule="forced-cpu", on_device=False, reason=f"{FORCED} ({forced[cls]})"))
        else:
            out.append(r)
    if pinned and backend_for(target).retargets_forced_kernels:
        library = [r for r in records if r.name in pinned and r.rule == "library" and _own_cpu_body(mod[r.name]) is None]
        if library:
            r = library[0]
            raise ConfigError(f"{r.name} (op class {classify(r.name, mod[r.name])}) is a TVM library kernel that "
                              f"the runtime drives on the GPU; it cannot be pinned to the CPU on {target.name}",
                              fix="leave that op class out of --force-cpu / force_cpu")
        mod = _to_host(mod, unscheduled, pinned, target.tvm())
    return mod, out


def _own_cpu_body(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The CPU form of a pre-scheduled GPU kernel of ours (the fused add + RMSNorm), or None: TVM's library
    kernels (KV cache, attention) have none, the runtime drives them on the GPU."""
    return add_norm.cpu_variant(func)


def _to_host(mod: tvm.IRModule, unscheduled: dict[str, tirx.PrimFunc], names: list[str], target: tvm.target.Target):
    """Compile `names` for target.host and copy their tensors to / from a CPU virtual device around each call."""
    host = target.host or tvm.target.Target({"kind": "llvm"})
    mod = mod.clone() if hasattr(mod, "clone") else mod
    for name in names:
        func = _own_cpu_body(mod[name]) or unscheduled[name]
        with host:
            sch = CPUInlineParallel().apply(func, host, False)
        func = sch.mod["main"] if sch is not None else func
        mod[name] = func.with_attr("target", host).with_attr("tirx.is_scheduled", True)
    gpu_vd, cpu_vd = relax.VDevice(target, 0, "global"), relax.VDevice(host, 0, "global")
    mod.update_global_info("vdevice", [gpu_vd, cpu_vd])
    gvars = {mod.get_global_var(n) for n in names}
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gv] = _CopyAround(gvars, gpu_vd, cpu_vd).visit_expr(func)
    return mod


@relax.expr_functor.mutator
class _CopyAround(relax.PyExprMutator):
    """call_tir(f, args) -> to_gpu(call_tir(f, to_cpu(args)) on the CPU device) for the pinned kernels."""

    def __init__(self, gvars, gpu_vd, cpu_vd):
        super().__init__()
        self.gvars, self.gpu, self.cpu = gvars, gpu_vd, cpu_vd
        self.call_tir = tvm.ir.Op.get("relax.call_tir")

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (call.op.same_as(self.call_tir) and any(call.args[0].same_as(g) for g in self.gvars)):
            return call
        args = [self._move(a, self.cpu) for a in call.args[1].fields]
        out = call.ty_args[0]
        outs = [self._on_cpu(t) for t in out.fields] if isinstance(out, relax.TupleType) else self._on_cpu(out)
        result = self.builder_.emit(relax.call_tir(call.args[0], relax.Tuple(args), outs))
        if isinstance(outs, list):
            return relax.Tuple([self._move(relax.TupleGetItem(result, i), self.gpu) for i in range(len(outs))])
        return relax.op.to_vdevice(result, self.gpu)

    def _on_cpu(self, t: relax.TensorType) -> relax.TensorType:
        return relax.TensorType(t.shape, t.dtype, vdevice=self.cpu)

    def _move(self, expr: relax.Expr, vdevice) -> relax.Expr:
        if isinstance(getattr(expr, "ty", None), relax.TensorType):
            return self.builder_.emit(relax.op.to_vdevice(expr, vdevice))
        return expr
