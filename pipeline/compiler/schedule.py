"""The tune stage: give every GPU kernel a schedule and record which rule did it.

TVM 0.27 compiles an unscheduled PrimFunc for a GPU target into *host* code without a word, so a
"GPU" build could silently run kernels on the phone's CPU. Here each kernel is scheduled by the
target's ordered rule list (dlight defaults; tuned records later), and the stage fails with the kernel's
name when one is left without thread bindings. The per-kernel record feeds the coverage report.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.s_tir import dlight as dl

from pipeline.compiler.matmul_f32 import GPUMatmulF32
from pipeline.compiler.tuning import apply_record, workload_key
from pipeline.errors import CompileError
from pipeline.kernels.cpu.schedule import CPUArmDot, CPUInlineParallel
from pipeline.kernels.gpu.fill_fallback import GPUFillFallback
from pipeline.kernels.gpu.gemv import GPUDequantGEMV


def _rules():
    return {
        "dequant_gemv": GPUDequantGEMV,     # ours: one-token KN GEMV of packed codes, split-K, fp32 sums
        "matmul_f32": GPUMatmulF32,         # ours: prefill KN dequantize + matmul, dlight's schedule, fp32 sums
        "gemv": dl.gpu.GEMV,
        "matmul": dl.gpu.Matmul,
        "matmul_simt": _simt_matmul_rule(),
        "reduction": dl.gpu.Reduction,
        "general_reduction": dl.gpu.GeneralReduction,
        "fill_fallback": GPUFillFallback,   # ours: dlight's Fallback with work-groups sized to fill the GPU
        "fallback": dl.gpu.Fallback,
        "cpu_gemv": dl.cpu.GEMV,
        "cpu_reduction": dl.cpu.Reduction,
        "cpu_inline_parallel": CPUInlineParallel,
        "cpu_arm_dot": CPUArmDot,
    }


def _simt_matmul_rule():
    """dlight's Matmul with its thread-tiled (SIMT) schedule on every GPU, Metal included.

    On Metal, dlight's Matmul switches to simdgroup-MMA tensorization. Those kernels carry
    `tvm_access_ptr(type_annotation(...), ...)` arguments, and TVM 0.27's AttachGlobalSymbol crashes on
    them ("Cannot treat type ir.Call as ir.Expr") when it renames functions for a system-lib prefix — which
    every iOS/Android `.tar` library needs. This rule schedules the matmul as if for a generic GPU (the
    same tiling dlight uses for Metal when tensorization does not apply), so the prefill matmuls stay on
    the GPU and the library builds.
    """
    class SIMTMatmul(dl.gpu.Matmul):
        def apply(self, func, target, tunable):
            if target.kind.name == "metal":
                target = tvm.target.Target({"kind": "opencl", "max_threads_per_block":
                                            int(target.attrs["max_threads_per_block"])})
            return super().apply(func, target, tunable)

    return SIMTMatmul


@dataclass(frozen=True)
class KernelSchedule:
    name: str
    rule: str          # rule name, "library" (shipped pre-scheduled by TVM), or "cpu-default"
    on_device: bool
    reason: str = ""   # why a kernel is placed where it is (NPU targets)
    hvx_instructions: int | None = None   # HVX vector instructions in its Hexagon object (NPU candidates)


def is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs and "tirx.is_scheduled" in func.attrs and int(func.attrs["tirx.is_scheduled"]))


def has_thread_binding(func: tirx.PrimFunc) -> bool:
    text = func.script()
    return "T.thread_binding" in text or "threadIdx" in text or "blockIdx" in text


def schedule_module(mod: tvm.IRModule, target: tvm.target.Target, rule_names: tuple[str, ...],
                    device: str, tuned: dict | None = None) -> tuple[tvm.IRModule, list[KernelSchedule]]:
    """Apply the rules in order to each unscheduled PrimFunc; return the module and a record per kernel.

    `tuned`: {workload: TunedRecord} from the target's tuning database (tuning.py), tried first."""
    records: list[KernelSchedule] = []
    table = _rules()
    unknown = [r for r in rule_names if r not in table]
    if unknown:
        raise CompileError(f"unknown schedule rule {unknown[0]!r}", fix=f"use rules from {sorted(table)}")
    rules = [(name, table[name]()) for name in rule_names]
    updates = {}
    with target:
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if is_scheduled(func):
                records.append(KernelSchedule(gv.name_hint, "library", True))
                continue
            record = tuned.get(workload_key(func)) if tuned else None
            if record is not None:
                try:
                    updates[gv] = apply_record(func, record).with_attr("tirx.is_scheduled", True)
                    records.append(KernelSchedule(gv.name_hint, "tuned", True,
                                                  f"tuned record ({record.device_key}, {record.latency_us:.1f} us)"))
                    continue
                except Exception:  # noqa: BLE001 - a record that no longer fits: the default rules below
                    pass
            for rule_name, rule in rules:
                try:
                    space = rule.apply(func, target, False)
                except RuntimeError:   # a rule that matches but cannot finish (ScheduleError): let the next one try
                    space = None
                if space is None:
                    continue
                sch = space[0] if isinstance(space, list) else space
                updates[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                records.append(KernelSchedule(gv.name_hint, rule_name, True))
                break
            else:
                records.append(KernelSchedule(gv.name_hint, "none" if device == "gpu" else "cpu-default",
                                              device != "gpu"))
    for gv, func in updates.items():
        mod[gv] = func
    if device != "gpu":
        return mod, records
    missing = [r.name for r in records if r.on_device and not has_thread_binding(mod[r.name])]
    missing += [r.name for r in records if r.rule == "none"]
    if missing:
        raise CompileError(
            f"{len(missing)} GPU kernel(s) have no schedule and would silently run on the CPU: "
            f"{', '.join(sorted(set(missing))[:5])}",
            fix="add a schedule rule to the target's schedule_rules (e.g. fallback)")
    return mod, records
