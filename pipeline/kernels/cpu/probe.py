"""What the CPU a library is built for offers, as far as this machine can tell: its x86 features (from the
TVM target's -mcpu / -mattr), threads and vendor (read here, so only for a library built for this computer:
a cross-compiled one gets None / 0 and kernels that do not depend on them).
"""

from __future__ import annotations

import functools
import os
import platform

from tvm.target import codegen


def build_threads() -> int:
    """The threads a host-cpu library will run with: TVM_NUM_THREADS, else the CPUs this process may use
    (TVM's own default). Part of the build key (stages.build), since `k_splits` depends on it."""
    env = os.environ.get("TVM_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))


def native_threads(target) -> int | None:
    """`build_threads()` for a library built for this computer (an LLVM target without a foreign triple),
    else None: a cross-compiled library's thread count is the phone's, not known here."""
    if target is None or "llvm" not in str(target.kind):
        return None
    triple = str(target.attrs.get("mtriple", "") or "")
    return build_threads() if not triple or triple.startswith(platform.machine()) else None


# How far ahead (bytes of a thread's code stream) the tiled q4 / t2 GEMV prefetches, by the CPU's vendor; 0 or
# absent: no software prefetch. Intel: measured on a Xeon with AMX and a 480 MiB L3 (one core streams ~11 GB/s,
# latency-bound), decode side by side against the same code without it, same tokens: the 0.49B Qwen3's q4f16
# 2.41x, ternary_ptq 3.11x, SmolLM2 q4f16 1.22x; against 1.9 KB ahead, 1 KB 0.89x, 3 KB 1.07x, 4.6-12 KB 1.11x (a
# plateau). AMD: a software prefetch of the same stream measured 0.73-0.98x per GEMV on a Zen 4 EPYC (2026-12-05,
# an earlier form, not this one), so none there until measured.
GEMV_PREFETCH_BYTES = {"GenuineIntel": 6144}


@functools.cache
def cpu_vendor() -> str:
    """This machine's CPU vendor as /proc/cpuinfo names it (e.g. GenuineIntel, AuthenticAMD); "" unknown.
    Read once per process: the schedule rule asks for every function of a build."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def native_prefetch_bytes(target) -> int:
    """`GEMV_PREFETCH_BYTES` of this machine's CPU for a library built for this computer (an x86 LLVM
    target without a foreign triple), else 0 (a cross-compiled library's CPU is not known here)."""
    if native_threads(target) is None:
        return 0
    return GEMV_PREFETCH_BYTES.get(cpu_vendor(), 0)


def has_avx2(target) -> bool:
    """The target has x86 AVX2 (its -mcpu or -mattr): the int16 dot-product kernels (x86.py) apply."""
    try:
        return target is not None and "llvm" in str(target.kind) and bool(codegen.target_has_features("avx2", target))
    except Exception:  # noqa: BLE001 - not an x86 LLVM target
        return False


def has_vnni(target) -> bool:
    """The target has AVX-512 VNNI on 256-bit vectors (vpdpbusd, e.g. Zen 4, Ice Lake and later): the byte
    dot-product kernels (x86.packed_kn_gemv_bytes) apply."""
    try:
        return (target is not None and "llvm" in str(target.kind)
                and all(bool(codegen.target_has_features(f, target)) for f in ("avx512vnni", "avx512vl")))
    except Exception:  # noqa: BLE001 - not an x86 LLVM target
        return False


def host_threads(target) -> int:
    """`native_threads`, else 1 (a cross-compiled library is split for one thread)."""
    return native_threads(target) or 1


def has_dotprod(target) -> bool:
    """The target is AArch64 with the dotprod extension (sdot / udot: armv8.2-a+dotprod, phone cores from
    2019 on; its -mattr or -mcpu): the sdot kernels (arm.py) apply."""
    try:
        return (target is not None and "llvm" in str(target.kind)
                and str(target.attrs.get("mtriple", "") or "").startswith("aarch64")
                and bool(codegen.target_has_features("dotprod", target)))
    except Exception:  # noqa: BLE001 - not an AArch64 LLVM target
        return False


def has_i8mm(target) -> bool:
    """`has_dotprod` and the i8mm extension (smmla: armv8.6-a, phone cores from 2022 on; configs/cpu_classes.yaml's
    i8mm class): the prefill matmul takes arm_mmla.py's smmla kernel."""
    try:
        return has_dotprod(target) and bool(codegen.target_has_features("i8mm", target))
    except Exception:  # noqa: BLE001 - not an AArch64 LLVM target
        return False
