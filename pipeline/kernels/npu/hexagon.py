"""Hexagon HVX side of the android-hexagon target: which kernels go to the NPU, their HVX builds.

Design (what TVM 0.27 from PyPI can really build): the whole model is compiled as the usual aarch64
system-lib `.tar` — the CPU fallback for every kernel — and the kernels whose op class the target
declares supported (`npu.op_classes` in the YAML) are compiled a second time, for Hexagon with HVX
(an `llvm` target with a hexagon triple; TVM's `qcom/hexagon-*` tags alone emit x86), into a separate
`.tar` of QDSP6 objects. The lm_head (vocab x hidden does not fit in VTCM) and the embedding gather are
pinned to the CPU. Running the HVX objects needs a Hexagon TVM runtime and FastRPC, which the wheel does
not have: those kernels are compiled, not executed here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import tvm
from tvm import s_tir, tirx
from tvm.support import tar

from pipeline.errors import CompileError
from pipeline.kernels.cpu.schedule import _inline_producers
from pipeline.op_classes import classify
from pipeline.op_classes import eval_shape as _eval

HVX_BYTES = 128           # one HVX vector with +hvx-length128b


def _lanes(func: tirx.PrimFunc) -> int:
    """Vector lanes of one HVX register for the kernel's output dtype (fp16 -> 64, fp32 -> 32)."""
    bufs = [p for p in func.params if isinstance(p.ty, tirx.BufferType)]
    bits = tvm.runtime.DataType(str(bufs[-1].dtype)).bits if bufs else 32
    return max(1, HVX_BYTES * 8 // max(8, bits))


def hvx_schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Inline producers; vectorize the innermost output loop by a whole HVX register when it divides."""
    prepared = _inline_producers(func)
    if prepared is None:
        return func
    sch, block, spatial, rest = prepared
    lanes = _lanes(func)
    extent = sch.get(spatial[-1]).extent
    if not isinstance(extent, tirx.IntImm) or int(extent) % lanes or len(rest) > 1:
        return sch.mod["main"]
    try:
        outer, inner = sch.split(spatial[-1], factors=[None, lanes])
        if rest:   # reduction: keep the output vector in registers while k streams
            sch.reorder(outer, *spatial[:-1], rest[0], inner)
            init = sch.decompose_reduction(block, rest[0])
            sch.vectorize(sch.get_loops(init)[-1])
        sch.vectorize(inner)
    except Exception:  # noqa: BLE001 - a shape the simple rule cannot vectorize: scalar HVX-less code
        sch = s_tir.Schedule(func)
    return sch.mod["main"]


def partition(mod: tvm.IRModule, records: list[Any], npu: dict[str, Any], vocab_size: int) -> list[Any]:
    """Placement of every kernel: on_device (NPU) or not, with the reason."""
    supported = set(npu.get("op_classes") or ())
    out = []
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
            out.append(replace(r, on_device=False, reason=f"op class {cls} not in the target's npu.op_classes"))
        else:
            out.append(replace(r, rule="hvx", on_device=True, reason="HVX: compiled, not executed"))
    return out


def build_npu_library(mod: tvm.IRModule, records: list[Any], npu: dict[str, Any], prefix: str,
                      out_dir: Path) -> Path:
    """The NPU-placed kernels, HVX-scheduled and compiled for Hexagon, as a `.tar` of objects."""
    funcs = {}
    for r in records:
        if r.on_device:
            funcs[r.name] = hvx_schedule(mod[r.name]).with_attr("global_symbol", f"{prefix}hvx_{r.name}")
    target = tvm.target.Target(dict(npu["tvm_target"]))
    if "hexagon" not in str(target.attrs.get("mtriple", "")):
        raise CompileError("npu.tvm_target must be an llvm target with a hexagon mtriple",
                           fix="use {kind: llvm, mtriple: hexagon, mcpu: hexagonv73, mattr: [+hvxv73, +hvx-length128b]}")
    path = out_dir / f"{prefix}hexagon_hvx.tar"
    if not funcs:
        raise CompileError("no kernel is placed on the NPU", fix="check npu.op_classes in the target YAML")
    tvm.tirx.build(tvm.IRModule(funcs), target=target).export_library(str(path), fcompile=tar.tar)
    return path
