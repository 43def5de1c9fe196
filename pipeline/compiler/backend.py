"""What a target does at each step of a build, decided once from its YAML (device, npu, host_native).

The build steps (stages.py, onnx_stages.py, compile.py, force_cpu.py, verify/execution.py) ask the target's
backend instead of each testing `device == "gpu"`, `npu` or `host_native` on its own: one class per kind of
device says how its kernels are scheduled, placed, finished, compiled into libraries and verified. The
target's data stays in its YAML (config.TargetSpec); this is its behaviour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tvm
from rich.markup import escape
from tvm import relax

from pipeline.compiler.schedule import KernelSchedule, schedule_module
from pipeline.config import TargetSpec
from pipeline.kernels.cpu.arm import X_BYTES
from pipeline.kernels.cpu.arm_code import library_dot_code
from pipeline.kernels.cpu.probe import build_threads
from pipeline.kernels.cpu.regions import merge_regions
from pipeline.kernels.npu.hexagon import build_npu_library, find_objdump, partition, placement_lines
from pipeline.progress import Reporter


class Backend:
    """A CPU target: kernels scheduled by CPU rules (or TVM's default), one library."""

    kind = "cpu"
    tune_step = "tune"
    verifies_on_opencl = False      # the build can run its kernels on an OpenCL device (PoCL) here
    retargets_forced_kernels = False   # --force-cpu moves kernels off another device onto the host

    def __init__(self, spec: TargetSpec):
        self.spec = spec

    def key_facts(self) -> dict[str, Any]:
        """What the compiled library depends on beyond the IR and the target dict (part of the build key)."""
        return {"npu": self.spec.npu, **({"cpu_threads": build_threads()} if self.spec.host_native else {})}

    def schedule(self, mod: tvm.IRModule, tuned: dict | None = None) -> tuple[tvm.IRModule, list[KernelSchedule]]:
        return schedule_module(mod, self.spec.tvm(), self.spec.schedule_rules, self.spec.device, tuned)

    def place(self, mod: tvm.IRModule, schedules: list[KernelSchedule], vocab_size: int,
              report: Reporter | None = None, unscheduled: dict[str, Any] | None = None) -> list[KernelSchedule]:
        """Kernels moved to a second device after scheduling (the NPU's share); none here. `unscheduled`: the
        functions as fused, before the CPU rules replaced any (what a second device's kernels are made from)."""
        return schedules

    def device_module(self, mod: tvm.IRModule) -> tvm.IRModule:
        """The module the build-time verification runs the device's kernels from: the scheduled one here."""
        return mod

    def finish(self, mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, Any] | None]:
        """The decode step's runs of CPU kernels as one parallel region each (kernels/cpu/regions.py).
        Reshapes that lowering turns into views are rewritten first, so that they stay views (inside a region
        too, unless the library is a system lib: TVM 0.27's system-lib symbol pass fails on the buffer
        declarations they become). Runs after the coverage report, which lists kernels, not regions."""
        return merge_regions(relax.transform.RewriteDataflowReshape()(mod), views=not self.spec.system_lib)

    def extra_libraries(self, mod: tvm.IRModule, schedules: list[KernelSchedule], prefix: str, out_dir: Path,
                        report: Reporter) -> dict[str, str]:
        """Libraries beside the main one ({build.json key: file name})."""
        return {}

    def dot_code(self, library: Path, prefix: str) -> dict[str, Any] | None:
        """For an AArch64 system-lib `.tar`: which kernels run dot-product instructions (sdot / smmla) and their
        hot loops' instructions per weight, read from its objects (kernels/cpu/arm_code.py); None otherwise."""
        if not str(self.spec.tvm_target.get("mtriple", "")).startswith("aarch64") or library.suffix != ".tar":
            return None
        return library_dot_code(library, prefix, X_BYTES)


class GpuBackend(Backend):
    """A GPU target: every kernel must get a thread-bound schedule (schedule_module refuses one that does not)."""

    kind = "gpu"
    tune_step = "tune (schedule GPU kernels)"
    retargets_forced_kernels = True

    def __init__(self, spec: TargetSpec):
        super().__init__(spec)
        self.verifies_on_opencl = spec.tvm_target.get("kind") == "opencl"

    def finish(self, mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, Any] | None]:
        return mod, None


class NpuBackend(Backend):
    """A phone CPU library for every kernel plus an NPU library for the op classes the target lists
    (kernels/npu/hexagon.py decides which kernels go and builds their objects)."""

    kind = "npu"

    def key_facts(self) -> dict[str, Any]:
        """Placement depends on the disassembler that counts the HVX instructions (none: all on the CPU)."""
        return {**super().key_facts(), "objdump": find_objdump()}

    def place(self, mod: tvm.IRModule, schedules: list[KernelSchedule], vocab_size: int,
              report: Reporter | None = None, unscheduled: dict[str, Any] | None = None) -> list[KernelSchedule]:
        """The NPU's share, from the HVX code each candidate compiles to; one output line per candidate. The HVX
        kernels are made from the fused functions (`unscheduled`), not from the aarch64 kernels the CPU rules
        substituted (kernels/cpu/arm_kn.py, arm_kn_q8.py, arm_kn_signs.py), which stay the CPU library's fallback."""
        self._fused = tvm.IRModule(unscheduled) if unscheduled else mod
        placed = partition(self._fused, schedules, self.spec.npu, vocab_size)
        for line in placement_lines(placed) if report is not None else ():
            report.info(escape(f"hvx: {line}"))
        return placed

    def device_module(self, mod: tvm.IRModule) -> tvm.IRModule:
        """The fused functions the NPU kernels were made from (see `place`)."""
        return getattr(self, "_fused", mod)

    def finish(self, mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, Any] | None]:
        return mod, None

    def extra_libraries(self, mod: tvm.IRModule, schedules: list[KernelSchedule], prefix: str, out_dir: Path,
                        report: Reporter) -> dict[str, str]:
        with report.step(f"compile NPU kernels ({self.spec.npu.get('name', 'npu')})"):
            path = build_npu_library(self.device_module(mod), schedules, self.spec.npu, prefix, out_dir)
        if path is None:
            report.info("hvx: no kernel compiled to HVX code: no NPU library, the CPU library runs every kernel")
            return {}
        return {"npu_library": path.name}


def backend_for(spec: TargetSpec) -> Backend:
    if spec.npu:
        return NpuBackend(spec)
    return GpuBackend(spec) if spec.is_gpu else Backend(spec)
