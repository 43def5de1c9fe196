"""GPU launch cost per kernel in the coverage report, and a PREDICTION of each kernel's decode time on the
target's phone.

Read from the scheduled TIR (what the OpenCL C launches): work-groups x work-items of each launch (blockIdx /
threadIdx bindings, their extents at one sequence decoding one token (DECODE_SIZES); an extent of any other
size, the KV cache's pages for one, says "symbolic"), and, for
our own kernels, the loads per work-item their plan records (`pipeline.gpu_plan`). The prediction is a
stated model, not a measurement: a kernel streams its decode bytes at the phone's bandwidth (target
`phone.bandwidth_gbs`) scaled by how much of the GPU its launch fills,

    time = bytes / (bandwidth x min(1, work-groups / FILL_GROUPS)),

FILL_GROUPS = 48 (4 work-groups per shader processor of an Adreno 750, 12 SPs). It ignores launch overhead,
caches and compute, so it is a floor for what a kernel can reach, not a forecast of what it will. Launches sized
by the batch (the paged KV cache's attention) are shown for one sequence (DECODE_SIZES); a kernel of several
launches (a split's outputs, each its own loop) has its bytes shared among them in proportion to their
work-items, each share at its own launch's fill, unless its plan names the streaming launch (the split-KV
attention: its merge launch moves a few KB), which then carries them all. Barriers per launch come from our kernels' plans.
A kernel whose work-groups re-read their inputs (our RMSNorms: every work-group of a row reads the whole row,
kernels/gpu/norm_rows.py) has those bytes in its plan (`reread_bytes`, at one token); the prediction charges
them on top of the decode bytes, at the same bandwidth (no cache).
"""

from __future__ import annotations

import math
from typing import Any

from tvm import tirx

from pipeline.op_classes import eval_shape
from pipeline.tir_walk import statements

PLAN_ATTR = "pipeline.gpu_plan"
FILL_GROUPS = 48
DECODE_SIZES = {"B": 1, "batch_size": 1, "batch": 1, "seq_len": 1}   # one sequence decoding one token
MODEL = ("PREDICTION (a model, not a measurement): bytes / (phone bandwidth x min(1, work-groups / "
         f"{FILL_GROUPS})) per launch, a kernel's bytes shared among its launches by their work-items; no launch "
         "overhead, caches or compute")


def _binding(s) -> tuple[str, Any] | None:
    """(thread tag, extent) of a thread-bound loop or a launch_thread attribute."""
    if isinstance(s, tirx.For) and s.thread_binding is not None:
        return str(s.thread_binding.thread_tag), s.extent
    if isinstance(s, tirx.AttrStmt) and str(s.attr_key) == "thread_extent":
        return str(s.node.thread_tag), s.value
    return None


def launches(func: tirx.PrimFunc, sizes: dict[str, int] | None = None) -> list[tuple[int, int]] | None:
    """(work-groups, work-items per group) of each launch of a scheduled kernel, in program order; None when an
    extent is symbolic (size variables named in `sizes` take those values). A launch is a nest of blockIdx
    bindings with the threadIdx bindings under it."""
    out: list[dict[str, int]] = []
    for s in statements(func.body):
        bound = _binding(s)
        if bound is None:
            continue
        tag, extent = bound
        if not isinstance(extent, tirx.IntImm):
            value = eval_shape(extent, sizes or {})
            if value is None:
                return None
            extent = tirx.IntImm("int32", value)
        if tag.startswith("blockIdx") and (not out or tag in out[-1] or any(t.startswith("threadIdx") for t in out[-1])):
            out.append({})
        if not out:
            out.append({})
        out[-1].setdefault(tag, int(extent))
    return [(math.prod(v for t, v in d.items() if t.startswith("blockIdx")),
             math.prod(v for t, v in d.items() if t.startswith("threadIdx"))) for d in out]


def predicted_us(nbytes: float, shape: list[tuple[int, int]], bandwidth_gbs: float,
                 streaming_groups: int | None = None) -> float:
    """The model's time for one call (module docstring): the bytes shared among the launches by their work-items,
    each share at the bandwidth its launch's fill allows; a streaming launch named by the plan carries them all."""
    if streaming_groups is not None:
        shape = [(streaming_groups, 1)]
    items = sum(g * i for g, i in shape)
    return sum(nbytes * g * i / items / (bandwidth_gbs * 1e3 * min(1.0, g / FILL_GROUPS)) for g, i in shape)


def annotate_gpu_cost(report: dict[str, Any], mod: Any, target: Any) -> None:
    """Add launch shape, loads per work-item and the predicted decode time to each GPU kernel row (in place),
    and the predicted decode step to the summary."""
    bandwidth = float((getattr(target, "phone", None) or {}).get("bandwidth_gbs") or 0)
    total_us, gemv_us, covered = 0.0, 0.0, 0
    for row in report["kernels"]:
        func = next((f for gv, f in mod.functions_items() if gv.name_hint == row["name"]), None)
        if row["placement"] != "GPU" or func is None:
            continue
        shape = launches(func, DECODE_SIZES) if isinstance(func, tirx.PrimFunc) else None
        cost: dict[str, Any] = {"launches": shape}
        plan = func.attrs.get(PLAN_ATTR) if isinstance(func, tirx.PrimFunc) and func.attrs else None
        if plan is not None and "loads" in plan:
            cost["loads_per_work_item"] = int(plan["loads"])
            cost["load_bytes"] = int(plan["load_bytes"])
        if plan is not None and "barriers" in plan:
            cost["barriers"] = str(plan["barriers"])
        reread = int(plan["reread_bytes"]) if plan is not None and "reread_bytes" in plan else 0
        if reread:
            cost["reread_bytes"] = reread
        d = row["decode_step"]
        if bandwidth and shape and d.get("bytes_per_call") and d["calls"]:
            us = predicted_us(d["bytes_per_call"] + reread, shape, bandwidth,
                              int(plan["work_groups"]) if plan is not None and "streaming" in plan else None)
            cost["predicted_us_per_call"] = round(us, 2)
            total_us += us * d["calls"]
            covered += 1
            if row["op_class"].startswith("dequant-gemv"):
                gemv_us += us * d["calls"]
        row["gpu_cost"] = cost
    report["summary"]["gpu_prediction"] = {
        "model": MODEL, "bandwidth_gbs": bandwidth, "kernels": covered,
        "decode_step_us": round(total_us, 1), "decode_gemv_us": round(gemv_us, 1)}


def gpu_cost_lines(report: dict[str, Any], fmt_bytes) -> list[str]:
    """The coverage.md section: one row per GPU kernel that has a decode call."""
    pred = report["summary"].get("gpu_prediction")
    if not pred:
        return []
    lines = ["", "## GPU launch cost and predicted decode time (PREDICTION)", "",
             f"Model: {pred['model']}; {pred['bandwidth_gbs']} GB/s. Predicted decode step over "
             f"{pred['kernels']} costed kernels: {pred['decode_step_us']} µs, of which dequant GEMVs "
             f"{pred['decode_gemv_us']} µs (the KV-cache attention is costed only with a context length).", "",
             "| kernel | rule | decode bytes / call | work-groups x work-items | loads / work-item | barriers / launch "
             "| predicted µs / call |",
             "|---|---|---|---|---|---|---|"]
    for r in report["kernels"]:
        cost = r.get("gpu_cost")
        if not cost or not r["decode_step"]["calls"]:
            continue
        shape = "; ".join(f"{g} x {i}" for g, i in cost["launches"]) if cost["launches"] else "symbolic"
        loads = f"{cost['loads_per_work_item']} x {cost['load_bytes']} B" if "loads_per_work_item" in cost else "-"
        moved = fmt_bytes(r['decode_step']['bytes_per_call'])
        if cost.get("reread_bytes"):
            moved += f" + {fmt_bytes(cost['reread_bytes'])} re-read"
        lines.append(f"| `{r['name']}` | {r['rule']} | {moved} | {shape} "
                     f"| {loads} | {cost.get('barriers', '-')} | {cost.get('predicted_us_per_call', '-')} |")
    return lines
