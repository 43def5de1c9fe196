"""Hexagon HVX side of the android-hexagon target: which kernels go to the NPU, their HVX builds.

Design (what TVM 0.27 from PyPI can really build): the whole model is compiled as the usual aarch64
system-lib `.tar` — the CPU fallback for every kernel — and the kernels whose op class the target
declares supported (`npu.op_classes` in the YAML) are compiled a second time, for Hexagon with HVX
(an `llvm` target with a hexagon triple; TVM's `qcom/hexagon-*` tags alone emit x86), into a separate
`.tar` of QDSP6 objects. The lm_head (vocab x hidden does not fit in VTCM) and the embedding gather are
pinned to the CPU. Running the HVX objects needs a Hexagon TVM runtime and FastRPC, which the wheel does
not have: those kernels are compiled, not executed here.

Placement is decided from the emitted code, not from the op class alone (issue #38: a swallowed schedule
error once left every GEMV as scalar Hexagon code while the report credited the NPU): a candidate stays on
the NPU only when its HVX schedule applied and its disassembled object holds HVX vector instructions.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import tvm
from tvm import s_tir, tirx
from tvm.support import tar

from pipeline.errors import CompileError
from pipeline.kernels.cpu.schedule import _inline_producers
from pipeline.kernels.npu.hvx_fp16 import HAND_WRITTEN
from pipeline.kernels.npu.hvx_int8_matmul import INT8_RULES, int8_matmul_like
from pipeline.kernels.objdump import find_objdump
from pipeline.op_classes import classify
from pipeline.op_classes import eval_shape as _eval

HVX_BYTES = 128           # one HVX vector with +hvx-length128b
# Older disassemblers lack the newest Hexagon CPUs (Debian's LLVM 14/15 stop at v69): the target's own CPU
# is tried first, then these; HVX encodings an older decoder does not know print as <unknown> and are not
# counted, so a fallback can only undercount.
FALLBACK_MCPUS = ("hexagonv69", "hexagonv68", "hexagonv67", "hexagonv66", "hexagonv65")
NO_VECTOR = "no whole HVX vector divides its output"
SCHEDULE_FAILED = "HVX schedule failed"
SCALAR = "compiled to scalar Hexagon code: 0 HVX instructions"
NO_OBJDUMP = "llvm-objdump not found: the HVX object cannot be checked for vector code (apt-get install llvm)"
CPU_FALLBACKS = (NO_VECTOR, SCHEDULE_FAILED, SCALAR, NO_OBJDUMP)   # reasons of candidates sent back to the CPU
# An HVX instruction names an HVX register: v0-v31 (or a pair v1:0, a lane view v0.h, v0.cur / .tmp),
# a vector predicate q0-q3, or is a vector memory access vmem(...). Scalar Hexagon ops, including the
# scalar "v"-named SIMD ones on register pairs (r1:0 = vaddh(...)), name none of them.
_HVX_OPERAND = re.compile(r"\b(?:v(?:[0-9]|[12][0-9]|3[01])(?::[0-9]+)?|q[0-3])\b|\bvmem\(")
_INSN = re.compile(r"^\s*[0-9a-f]+:\t")
_SYMBOL = re.compile(r"^[0-9a-f]+ <(.+)>:$")


class HvxScheduleError(Exception):
    """A kernel did not get its HVX schedule; the message says why (it becomes the CPU placement reason)."""


def _lanes(func: tirx.PrimFunc) -> int:
    """Vector lanes of one HVX register for the kernel's output dtype (fp16 -> 64, fp32 -> 32)."""
    bufs = [p for p in func.params if isinstance(p.ty, tirx.BufferType)]
    bits = tvm.runtime.DataType(str(bufs[-1].dtype)).bits if bufs else 32
    return max(1, HVX_BYTES * 8 // max(8, bits))


def _one_line(err: Exception) -> str:
    """The first informative line of a TVM error (its messages run to dozens of lines of TIR)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    msg = next((ln for ln in lines if ln.startswith("Error message:")), lines[0] if lines else type(err).__name__)
    return msg.removeprefix("Error message:").strip()[:200]


def hvx_schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Inline producers; vectorize the innermost output loop by a whole HVX register.

    Raises HvxScheduleError (never falls back silently): an unscheduled kernel is scalar Hexagon code, so
    the caller must place it on the CPU. For a reduction the output vector is vectorized before the
    reduction is decomposed: TVM refuses to vectorize the update block once its init is split off."""
    if func.attrs and HAND_WRITTEN in func.attrs:   # written with HVX vectors already (kernels/npu/*.py)
        return func
    prepared = _inline_producers(func)
    if prepared is None:
        raise HvxScheduleError(f"{SCHEDULE_FAILED}: no spatial output loop to vectorize")
    sch, block, spatial, rest = prepared
    lanes = _lanes(func)
    extent = sch.get(spatial[-1]).extent
    if not isinstance(extent, tirx.IntImm) or int(extent) % lanes:
        raise HvxScheduleError(NO_VECTOR)
    if len(rest) > 1:
        raise HvxScheduleError(f"{SCHEDULE_FAILED}: {len(rest)} loops after the output loops (one expected)")
    try:
        outer, inner = sch.split(spatial[-1], factors=[None, lanes])
        if rest:   # reduction: keep the output vector in registers while k streams
            sch.reorder(outer, *spatial[:-1], rest[0], inner)
            sch.vectorize(inner)
            sch.decompose_reduction(block, rest[0])   # the init loop keeps the vectorized kind
        else:
            sch.vectorize(inner)
    except (s_tir.ScheduleError, tvm.error.InternalError) as err:   # TVM refused a primitive: say which
        raise HvxScheduleError(f"{SCHEDULE_FAILED}: {_one_line(err)}") from err
    return sch.mod["main"]


def hvx_kernel(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, str]:
    """(the kernel's HVX form, its rule): the hand-written vrmpy kernel for a q4 / q8 KN decode GEMV or prefill
    matmul (hvx_int8_matmul.py), else `hvx_schedule` (rule "hvx"). Raises HvxScheduleError like hvx_schedule."""
    int8 = int8_matmul_like(func)
    if int8 is not None:
        return int8
    return hvx_schedule(func), "hvx"


def _disassemble(objdump: str, obj: Path, mcpu: str, mattr: list[str]) -> str:
    """Disassembly of one Hexagon object, with the target's CPU or the newest one objdump knows."""
    width = [a.lstrip("+") for a in mattr if "hvx-length" in a]
    cpus = [mcpu, *(c for c in FALLBACK_MCPUS if c < mcpu)] if mcpu else list(FALLBACK_MCPUS)
    for cpu in cpus:
        attrs = [f"+hvx{cpu.removeprefix('hexagon')}", *(f"+{w}" for w in width)]
        proc = subprocess.run([objdump, "-d", f"--mcpu={cpu}", f"--mattr={','.join(attrs)}", str(obj)],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout
    last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    raise CompileError(f"{Path(objdump).name} cannot disassemble Hexagon objects: {last}",
                       fix="install a newer llvm (apt-get install llvm) or set LLVM_OBJDUMP")


def count_hvx(disassembly: str) -> dict[str, int]:
    """{symbol: HVX instructions} of an llvm-objdump listing (the rule in _HVX_OPERAND above)."""
    counts: dict[str, int] = {}
    symbol = None
    for line in disassembly.splitlines():
        head = _SYMBOL.match(line)
        if head:
            symbol = head.group(1)
            counts.setdefault(symbol, 0)
        elif symbol is not None and _INSN.match(line):
            text = line.split("\t")[-1]
            counts[symbol] += bool(_HVX_OPERAND.search(text))
    return counts


def _kernel_of(symbol: str) -> str:
    """The global symbol a code symbol belongs to: TVM emits `__tvm_ffi_<sym>` and `<sym>_compute_`."""
    return symbol.removeprefix("__tvm_ffi_").removesuffix("_compute_")


def hvx_counts(funcs: dict[str, tirx.PrimFunc], target: tvm.target.Target, objdump: str) -> dict[str, int]:
    """{kernel: HVX instructions in its compiled code}, from one Hexagon build of `funcs` (each with its
    global_symbol)."""
    with tempfile.TemporaryDirectory(prefix="hvx-") as tmp:
        path = Path(tmp) / "hvx.tar"
        tvm.tirx.build(tvm.IRModule(funcs), target=target).export_library(str(path), fcompile=tar.tar)
        with tarfile.open(path) as t:
            t.extractall(tmp, filter="data")
        key = {str(f.attrs["global_symbol"]): name for name, f in funcs.items()}
        counts = dict.fromkeys(funcs, 0)
        mcpu, mattr = str(target.attrs.get("mcpu", "")), [str(a) for a in target.attrs.get("mattr", [])]
        for obj in sorted(Path(tmp).glob("*.o")):
            for symbol, n in count_hvx(_disassemble(objdump, obj, mcpu, mattr)).items():
                if _kernel_of(symbol) in key:
                    counts[key[_kernel_of(symbol)]] += n
    return counts


def _target(npu: dict[str, Any]) -> tvm.target.Target:
    target = tvm.target.Target(dict(npu["tvm_target"]))
    if "hexagon" not in str(target.attrs.get("mtriple", "")):
        raise CompileError("npu.tvm_target must be an llvm target with a hexagon mtriple",
                           fix="use {kind: llvm, mtriple: hexagon, mcpu: hexagonv73, mattr: [+hvxv73, +hvx-length128b]}")
    return target


def _symbol(prefix: str, name: str) -> str:
    return f"{prefix}hvx_{name}"


def partition(mod: tvm.IRModule, records: list[Any], npu: dict[str, Any], vocab_size: int) -> list[Any]:
    """Placement of every kernel: on_device (NPU) or not, with the reason.

    A kernel of a supported op class goes to the NPU only when its HVX schedule applies and its Hexagon
    object holds HVX vector instructions (counted in `hvx_instructions`); otherwise it stays on the CPU
    with the reason, so the report never credits the NPU with scalar code."""
    supported = set(npu.get("op_classes") or ())
    out: list[Any] = []
    candidates: dict[str, tirx.PrimFunc] = {}
    rules: dict[str, str] = {}
    for r in records:
        func = mod[r.name]
        cls = classify(r.name, func)
        bufs = [p for p in func.params if isinstance(p.ty, tirx.BufferType)]
        logits = any(b.shape and _eval(b.shape[-1], {}) == vocab_size for b in bufs)
        if cls == "gather":
            out.append(replace(r, on_device=False, reason="embedding gather pinned to CPU (4-bit gather "
                                                          "unsupported on the NPU)"))
        elif logits:
            out.append(replace(r, on_device=False, reason="lm_head/logits pinned to CPU (vocab x hidden "
                                                          "does not fit in VTCM)"))
        elif cls not in supported:
            why = (npu.get("cpu_reasons") or {}).get(cls)   # the target's word on why the class has no HVX kernel
            out.append(replace(r, on_device=False, reason=f"op class {cls} not in the target's npu.op_classes"
                                                          + (f": {why}" if why else "")))
        else:
            try:
                kernel, rules[r.name] = hvx_kernel(func)
                candidates[r.name] = kernel.with_attr("global_symbol", _symbol("", r.name))
                out.append(r)
            except HvxScheduleError as err:
                out.append(replace(r, on_device=False, reason=str(err)))
    if not candidates:
        return out
    objdump = find_objdump()
    counts = hvx_counts(candidates, _target(npu), objdump) if objdump else {}
    placed = []
    for r in out:
        if r.name not in candidates:
            placed.append(r)
        elif objdump is None:
            placed.append(replace(r, on_device=False, reason=NO_OBJDUMP))
        elif counts[r.name] == 0:
            placed.append(replace(r, on_device=False, hvx_instructions=0,
                                  reason=SCALAR))
        else:
            n = counts[r.name]
            placed.append(replace(r, rule=rules[r.name], on_device=True, hvx_instructions=n,
                                  reason=f"HVX: {n} vector instructions ({rules[r.name]})"))
    return placed


def placement_lines(records: list[Any]) -> list[str]:
    """One build-output line per HVX candidate: its instruction count on the NPU, or why it is on the CPU."""
    lines = []
    for r in records:
        if r.on_device and r.rule in ("hvx", *INT8_RULES):
            lines.append(f"NPU {r.name}: {r.hvx_instructions} HVX instructions ({r.rule})")
        elif r.reason.startswith(CPU_FALLBACKS):
            lines.append(f"CPU {r.name}: {r.reason}")
    return lines


def build_npu_library(mod: tvm.IRModule, records: list[Any], npu: dict[str, Any], prefix: str,
                      out_dir: Path) -> Path | None:
    """The NPU-placed kernels, HVX-scheduled and compiled for Hexagon, as a `.tar` of objects; None when no
    kernel got HVX code (the CPU library then runs everything)."""
    target = _target(npu)
    funcs = {r.name: hvx_kernel(mod[r.name])[0].with_attr("global_symbol", _symbol(prefix, r.name))
             for r in records if r.on_device}
    if not funcs:
        return None
    path = out_dir / f"{prefix}hexagon_hvx.tar"
    tvm.tirx.build(tvm.IRModule(funcs), target=target).export_library(str(path), fcompile=tar.tar)
    return path
