"""Coverage report: where every compiled kernel runs, who calls it, and what it costs per token.

Peers report counts of delegated ops; counts alone do not say where the work goes. This report lists
each PrimFunc of the fused + scheduled module with its op class, its Relax callers (and how often
they call it), its placement (GPU/CPU) and a static estimate of the bytes it moves and the FLOPs it does
per decode step and per prefill chunk. The decode-step bytes give a bandwidth-bound time estimate on
the target's phone (bytes / (peak GB/s x 0.6), phones sustain 55-65% of peak in decode).

Estimates are static: the bytes of a kernel are the sizes of its buffer parameters (each read or
written once), with symbolic dims substituted (`seq_len` = 1 for decode, the prefill chunk for
prefill). Gathers count only the gathered rows of their table. Attention and KV-append kernels are
called by the paged KV cache at run time (one per attention call) with context-dependent sizes; they
are listed with those indirect call counts, and costed only when `context_len` is given.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import tvm
from tvm import relax, tirx

from pipeline.op_classes import (
    MATMUL_CLASSES,
    OP_CLASSES,
    buffer_params,
    classify,
    dim_str,
    elems,
    eval_shape,
    matmul_k,
    moe_cost,
    nbytes,
    written_params,
)
from pipeline.report.gpu_cost import annotate_gpu_cost, gpu_cost_lines

# Which Relax functions make up one decode step / one prefill chunk (embed runs once per step).
DECODE_FUNCS = ("decode", "embed")
PREFILL_FUNCS = ("prefill", "embed")
EFFECTIVE_BANDWIDTH = 0.6

_KV_ATTENTION_BUILTIN = "attention_kv_cache_attention"
# the RNN state's runtime copies (models/recurrent_state.py): each get / set builtin call of state id `sid` runs
# the module's kernel `rnn_state_{get|set}_{sid}`, which copies one sequence's state
_RNN_BUILTINS = {"vm.builtin.rnn_state_get": "rnn_state_get", "vm.builtin.rnn_state_set": "rnn_state_set"}
# kernels the paged KV cache dispatches per attention call, by phase
_KV_DISPATCH = {"decode": ("batch_decode_paged_kv", "tir_kv_cache_transpose_append"),
                "prefill": ("batch_prefill_paged_kv", "tir_kv_cache_transpose_append"),
                "prefill_all_logits": ("batch_prefill_paged_kv", "tir_kv_cache_transpose_append")}


def _params(func: tirx.PrimFunc) -> list[dict[str, Any]]:
    out = []
    for p in func.params:
        if isinstance(p.ty, tirx.BufferType):
            out.append({"name": str(p.name), "shape": [dim_str(d) for d in p.shape], "dtype": str(p.dtype)})
        else:
            out.append({"name": str(p.name), "shape": [], "dtype": str(getattr(p.ty, "dtype", p.ty))})
    return out


# ------------------------------------------------------------------------------------ costs
def _kv_cost(name: str, func: tirx.PrimFunc, tokens: int, context_len: int | None) -> tuple[int | None, int | None]:
    """Paged-KV kernels the cache dispatches per attention call: attention over context + new tokens, append.

    Pages are (num_pages, 2, kv_heads, page_size, head_dim): one token's K and V take
    elems(pages[1:]) / page_size elements. Attention reads the KV of context_len + tokens positions and its
    queries, writes its outputs, and does 4 x heads x head_dim x tokens x positions FLOPs (QK^T and PV).
    """
    if context_len is None:
        return None, None
    bufs = buffer_params(func)
    pages = next((b for b in bufs if str(b.name) == "pages" and len(b.shape) >= 3), None)
    if pages is None:
        return None, None
    page_size = eval_shape(pages.shape[-2], {})
    per_page = _nbytes_tail(pages)
    if not page_size or per_page is None:
        return None, None
    per_token = per_page // page_size
    low = name.lower()
    if "transpose_append" in low and "mla" not in low:
        return 2 * tokens * per_token + 4 * tokens, tokens * per_token
    if not low.startswith(("batch_decode_paged_kv", "batch_prefill_paged_kv")) or "sliding" in low:
        return None, None
    q = bufs[0]
    heads, dim = (eval_shape(d, {}) for d in q.shape[-2:])
    if not heads or not dim:
        return None, None
    dt = tvm.runtime.DataType(str(q.dtype))
    q_bytes = tokens * heads * dim * max(1, dt.bits // 8)
    positions = context_len + tokens
    return positions * per_token + 2 * q_bytes + 4 * tokens * heads, 4 * heads * dim * tokens * positions


def _rnn_cost(func: tirx.PrimFunc) -> tuple[int | None, int | None]:
    """An RNN-state copy of one sequence (rnn_state_get / set: storage [seqs, history, numel] <-> [batch, numel],
    batch 1): the state read and written, and its two int32 slot ids."""
    last = buffer_params(func)[-1]
    numel = eval_shape(last.shape[-1], {})
    if numel is None:
        return None, None
    return 2 * numel * max(1, tvm.runtime.DataType(str(last.dtype)).bits // 8) + 8, 0


def _nbytes_tail(buf: Any) -> int | None:
    n = 1
    for d in buf.shape[1:]:
        v = eval_shape(d, {})
        if v is None:
            return None
        n *= v
    dt = tvm.runtime.DataType(str(buf.dtype))
    return n * max(1, dt.bits * dt.lanes // 8)


def _cost(cls: str, func: tirx.PrimFunc, text: str, env: dict[str, int]) -> tuple[int | None, int | None]:
    """(bytes read + written, FLOPs) of one call, or (None, None) when not statically known."""
    if cls in ("attention", "kv-cache"):
        return None, None
    if cls == "moe-gemv":
        return moe_cost(func, env)
    if cls == "rnn-state":
        return _rnn_cost(func)
    bufs = buffer_params(func)
    outs = written_params(func, text)
    ins = [b for b in bufs if not any(b.same_as(o) for o in outs)]
    out_bytes = [nbytes(o, env) for o in outs]
    out_elems = [elems(o, env) for o in outs]
    if None in out_bytes or None in out_elems:
        return None, None
    n_out = sum(out_elems)
    if cls == "gather" and any(str(b.dtype) in ("int32", "int64") for b in ins):
        # only the gathered rows of the table(s) are read — as many bytes as the output (a q8 table tiled for
        # host-cpu is read as codes + scales in one kernel: both tables); plus the indices
        rest = [nbytes(b, env) for b in ins if str(b.dtype) in ("int32", "int64")]
        if None in rest:
            return None, None
        return 2 * sum(out_bytes) + sum(rest), n_out
    in_bytes = [nbytes(b, env) for b in ins]
    if None in in_bytes:
        return None, None
    moved = sum(in_bytes) + sum(out_bytes)   # not `nbytes`: that would shadow the function above
    if cls in MATMUL_CLASSES:
        k = eval_shape(matmul_k(ins, outs), env)
        return moved, 2 * n_out * (k or 0)
    if cls in ("rmsnorm", "layernorm", "l2norm", "reduction"):
        largest = max((elems(b, env) or 0 for b in ins), default=0)
        return moved, 2 * largest + n_out
    return moved, n_out


# ------------------------------------------------------------------------------------ callers
def relax_callers(mod: tvm.IRModule) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """{kernel: {relax function: call_tir count}} and {relax function: KV-cache attention calls}."""
    call_tir_ops = {tvm.ir.Op.get(n) for n in ("relax.call_tir", "relax.call_tir_inplace")}
    calls: dict[str, dict[str, int]] = defaultdict(Counter)
    attention: dict[str, int] = Counter()
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        fname = gv.name_hint

        def visit(node, fname=fname):
            if not isinstance(node, relax.Call):
                return
            if any(node.op.same_as(op) for op in call_tir_ops) and isinstance(node.args[0], tvm.ir.GlobalVar):
                calls[node.args[0].name_hint][fname] += 1
            rnn = _rnn_kernel(node)
            if rnn is not None:
                calls[rnn][fname] += 1
            for arg in node.args:
                if isinstance(arg, relax.ExternFunc) and _KV_ATTENTION_BUILTIN in str(arg.global_symbol):
                    attention[fname] += 1
            if isinstance(node.op, relax.ExternFunc) and _KV_ATTENTION_BUILTIN in str(node.op.global_symbol):
                attention[fname] += 1

        relax.analysis.post_order_visit(func.body, visit)
    return {k: dict(v) for k, v in calls.items()}, dict(attention)


def _rnn_kernel(call: relax.Call) -> str | None:
    """The kernel an RNN-state get / set builtin call runs (`rnn_state_get_1`), or None for any other call: the
    state id is the third argument (after the state and the layer) of call_dps_packed's tuple or of
    call_pure_packed."""
    if not call.args or not isinstance(call.args[0], relax.ExternFunc):
        return None
    kind = _RNN_BUILTINS.get(str(call.args[0].global_symbol))
    args = list(call.args[1].fields) if len(call.args) == 2 and isinstance(call.args[1], relax.Tuple) \
        else list(call.args[1:])
    if kind is None or len(args) < 3 or not isinstance(args[2], tvm.tirx.IntImm):
        return None
    return f"{kind}_{int(args[2].value)}"


# ------------------------------------------------------------------------------ module of origin
def module_of_param(name: str) -> str:
    """`model.layers.3.mlp.down_proj.q_weight` -> `layers.*.mlp.down_proj`; split parts (`lm_head.q_weight.0`)
    fold into their module."""
    name = re.sub(r"\.\d+$", "", name)                  # part index of a split parameter
    name = name.rsplit(".", 1)[0] if "." in name else name   # the attribute: weight, q_weight, A_log, ...
    name = name[len("model."):] if name.startswith("model.") else name
    return re.sub(r"(^|\.)layers\.\d+(?=\.|$)", r"\1layers.*", name)


def _common_module(mods: set[str]) -> str:
    parts = [m.split(".") for m in sorted(mods)]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or "model"


def kernel_modules(mod: tvm.IRModule, param_names: list[str]) -> dict[str, list[str]]:
    """{kernel (or KV-dispatch prefix): model modules it runs for}, from the parameters each call reads.

    A call that reads weights belongs to their module (`layers.*.mlp.down_proj`); one that reads none
    (activation, reshape, residual add, KV-cache attention) to the common prefix of the modules of the
    weight-reading calls just before and after it (`layers.*.mlp`, `layers.*.self_attn`, `layers.*`).
    """
    call_tir_ops = {tvm.ir.Op.get(n) for n in ("relax.call_tir", "relax.call_tir_inplace")}
    to_vdevice = tvm.ir.Op.get("relax.to_vdevice")
    found: dict[str, set[str]] = defaultdict(set)
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr) or not func.params:
            continue
        packed = func.params[-1]
        param_module: dict[Any, str] = {}
        calls: list[tuple[list[str], set[str]]] = []
        for block in func.body.blocks:
            for binding in block.bindings:
                value = getattr(binding, "value", None)
                if isinstance(value, relax.TupleGetItem) and value.tuple_value.same_as(packed):
                    if value.index < len(param_names):
                        param_module[binding.var] = module_of_param(param_names[value.index])
                    continue
                if not isinstance(value, relax.Call):
                    continue
                if value.op.same_as(to_vdevice) and value.args[0] in param_module:   # forced-CPU weight copy
                    param_module[binding.var] = param_module[value.args[0]]
                    continue
                if any(value.op.same_as(op) for op in call_tir_ops) and isinstance(value.args[0], tvm.ir.GlobalVar):
                    kernels, args = [value.args[0].name_hint], list(value.args[1].fields)
                elif any(isinstance(a, relax.ExternFunc) and _KV_ATTENTION_BUILTIN in str(a.global_symbol)
                         for a in [value.op, *value.args]):
                    kernels, args = list(_KV_DISPATCH.get(gv.name_hint, ())), list(value.args)
                else:
                    continue
                mods = {param_module[a] for a in args if a in param_module}
                if gv.name_hint != "embed" and mods == {"embed_tokens"}:
                    mods = {"lm_head (tied to embed_tokens)"}   # the tied output projection reads the table
                calls.append((kernels, mods))
        for i, (kernels, mods) in enumerate(calls):
            if not mods:
                prev = next((m for _, m in reversed(calls[:i]) if m), set())
                nxt = next((m for _, m in calls[i + 1:] if m), set())
                common = _common_module(prev | nxt) if prev | nxt else ""
                if common == "model" and all(m.startswith("layers.*") for m in prev):
                    common = "layers.*"           # the residual add closing the last layer
                mods = {common} if common else set()
            for k in kernels:
                found[k] |= mods
    return {k: sorted(v) for k, v in found.items()}


def _module_for(name: str, cls: str, modules: dict[str, list[str]]) -> str:
    mods = modules.get(name) or next((v for k, v in modules.items() if name in (k, f"{k}_cpu")), None)
    if mods:
        return ", ".join(mods)
    return "paged KV cache (runtime)" if cls in ("kv-cache", "attention") else "-"


def _placement(record: Any, target: Any) -> str:
    if getattr(target, "npu", None):
        return "NPU" if record is not None and record.on_device else "CPU"
    device = "GPU" if target.device == "gpu" else str(target.device).upper()
    if record is None:
        return device if target.device == "gpu" else "CPU"
    return device if record.on_device and target.device != "cpu" else "CPU"


# ------------------------------------------------------------------------------------ report
def coverage_report(mod: tvm.IRModule, records: list[Any], target: Any, *, seq_len: int = 1,
                    prefill_chunk: int = 256, context_len: int | None = None,
                    param_names: list[str] | None = None,
                    phase_funcs: dict[str, tuple[str, ...]] | None = None,
                    phase_note: str | None = None) -> dict[str, Any]:
    """Per-kernel rows and a summary for a fused + scheduled module (see the module docstring).

    context_len: tokens already in the KV cache; when given, the attention and KV-append kernels the paged
    KV cache dispatches are costed too (KV reads grow with it), otherwise they are listed as not costed.
    phase_funcs: which Relax functions make up each phase, for modules that are not LLMs (an ONNX graph
    has one entry, `main`); phase_note says so in the report.
    """
    by_name = {r.name: r for r in records}
    # reshapes that the lowering turns into views (compile.py, RewriteDataflowReshape) launch nothing
    callers, attention_calls = relax_callers(relax.transform.RewriteDataflowReshape()(mod))
    modules = kernel_modules(mod, list(param_names or []))
    phase_map = {"decode_step": DECODE_FUNCS, "prefill_chunk": PREFILL_FUNCS, **(phase_funcs or {})}
    phases = {"decode_step": (phase_map["decode_step"], {"seq_len": seq_len}),
              "prefill_chunk": (phase_map["prefill_chunk"], {"seq_len": prefill_chunk})}
    rows = []
    for gv, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gv.name_hint
        text = func.script()
        cls = classify(name, func, text)
        record = by_name.get(name)
        direct = dict(callers.get(name, {}))
        indirect = {f: n for f, n in attention_calls.items()
                    if any(name in (k, f"{k}_cpu") for k in _KV_DISPATCH.get(f, ()))}
        row: dict[str, Any] = {
            "name": name, "op_class": cls, "module": _module_for(name, cls, modules),
            "placement": _placement(record, target),
            "rule": record.rule if record else "unrecorded",
            "callers": direct, "kv_cache_calls": indirect, "params": _params(func)}
        if record is not None and getattr(record, "reason", ""):
            row["reason"] = record.reason
        if getattr(record, "hvx_instructions", None) is not None:
            row["hvx_instructions"] = record.hvx_instructions
        for phase, (funcs, env) in phases.items():
            n_calls = sum(direct.get(f, 0) for f in funcs) + sum(indirect.get(f, 0) for f in funcs)
            nbytes, flops = _cost(cls, func, text, env)
            if nbytes is None and indirect:
                nbytes, flops = _kv_cost(name, func, env["seq_len"], context_len)
            costed = nbytes is not None
            row[phase] = {"calls": n_calls, "bytes_per_call": nbytes, "flops_per_call": flops,
                          "bytes": nbytes * n_calls if costed else None,
                          "flops": flops * n_calls if costed else None, "costed": costed}
        rows.append(row)
    report = {"target": target.name, "device": target.device, "seq_len": seq_len, "prefill_chunk": prefill_chunk,
              "context_len": context_len, "kernels": rows, "summary": _summary(rows, target, context_len)}
    if phase_note:
        report["phase_note"] = phase_note
    if target.device == "gpu":
        annotate_gpu_cost(report, mod, target)
    if (getattr(target, "npu", None) or {}).get("app_runtime"):   # what an app must add to run the NPU code
        report["npu_runtime"] = " ".join(str(target.npu["app_runtime"]).split())
    accel = _accelerator(target)
    if getattr(target, "npu", None) or (accel == "GPU" and any(r["placement"] == "CPU" for r in rows)):
        report["summary"]["crossings"] = crossings(mod, rows, {"seq_len": seq_len}, accel,
                                                   entry=phase_map["decode_step"][0])
    return report


def _accelerator(target: Any) -> str:
    return "NPU" if getattr(target, "npu", None) else "GPU" if target.device == "gpu" else "CPU"


def crossings(mod: tvm.IRModule, rows: list[dict[str, Any]], env: dict[str, int],
              accelerator: str = "NPU", entry: str = "decode") -> dict[str, Any]:
    """CPU<->accelerator (NPU or GPU) hand-overs in one decode step (`entry`: `main` for an ONNX graph).
    The entry's kernel calls are walked in binding order (KV-cache attention, dispatched by the runtime,
    runs on the CPU beside an NPU and on the GPU of a GPU target); each change of unit between
    consecutive calls is a crossing, and the bytes moved are the tensors a call reads that a call on
    the other unit produced (activations; weights and states stay where they live) plus every explicit
    device copy (`to_vdevice`) the graph makes around GPU-target kernels pinned to the CPU, which also
    copy the weights those kernels read (the packed parameters live on the GPU)."""
    placement = {r["name"]: r["placement"] for r in rows}
    to_vdevice = tvm.ir.Op.get("relax.to_vdevice")
    attention_unit = "CPU" if accelerator == "NPU" else accelerator   # paged-KV kernels: GPU ones on a GPU
    call_tir_ops = {tvm.ir.Op.get(n) for n in ("relax.call_tir", "relax.call_tir_inplace")}
    decode = next((f for gv, f in mod.functions_items()
                   if gv.name_hint == entry and isinstance(f, relax.Function)), None)
    units: list[str] = []
    producer: dict[Any, str] = {}
    moved = 0

    def unit_of(call: relax.Call) -> str | None:
        if any(call.op.same_as(op) for op in call_tir_ops) and isinstance(call.args[0], tvm.ir.GlobalVar):
            return placement.get(call.args[0].name_hint, "CPU")
        if any(isinstance(a, relax.ExternFunc) and _KV_ATTENTION_BUILTIN in str(a.global_symbol)
               for a in [call.op, *call.args]):
            return attention_unit
        return None

    def tensor_vars(expr: Any) -> list[Any]:
        if isinstance(expr, relax.Tuple):
            return [v for f in expr.fields for v in tensor_vars(f)]
        return [expr] if isinstance(expr, relax.Var) else []

    def var_bytes(var: Any) -> int:
        ty = var.ty
        if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            return 0
        n = 1
        for d in ty.shape.values:
            v = eval_shape(d, env)
            if v is None:
                return 0
            n *= v
        return n * max(1, tvm.runtime.DataType(str(ty.dtype)).bits // 8)

    blocks = decode.body.blocks if decode is not None and isinstance(decode.body, relax.SeqExpr) else []
    for block in blocks:
        for binding in block.bindings:
            value = getattr(binding, "value", None)
            if isinstance(value, relax.TupleGetItem) and value.tuple_value in producer:
                producer[binding.var] = producer[value.tuple_value]
                continue
            if not isinstance(value, relax.Call):
                continue
            if value.op.same_as(to_vdevice):   # forced-CPU kernels: a device copy, activations and weights alike
                moved += var_bytes(value.args[0])
                continue
            unit = unit_of(value)
            if unit is None:
                continue
            args = value.args[1] if any(value.op.same_as(op) for op in call_tir_ops) else relax.Tuple(value.args)
            moved += sum(var_bytes(v) for v in tensor_vars(args) if producer.get(v, unit) != unit)
            producer[binding.var] = unit
            units.append(unit)
    n = sum(1 for a, b in zip(units, units[1:], strict=False) if a != b)
    return {"decode_calls": len(units), "npu_calls": units.count("NPU"), "accelerator": accelerator,
            "accelerator_calls": units.count(accelerator), "crossings_per_token": n,
            "bytes_moved_per_token": moved,
            "note": "estimate: tensors one unit reads that the other produced; weights and states not moved"
            if accelerator == "NPU" else "explicit device copies of the CPU-pinned kernels' inputs (weights "
            "included) and outputs"}


def _pct(part: float, total: float) -> float:
    return round(100.0 * part / total, 2) if total else 0.0


def _summary(rows: list[dict[str, Any]], target: Any, context_len: int | None) -> dict[str, Any]:
    summary: dict[str, Any] = {"kernels": len(rows)}
    for phase in ("decode_step", "prefill_chunk"):
        acc = {"flops": 0, "bytes": 0}
        cpu = {"flops": 0, "bytes": 0}
        uncosted = sorted(r["name"] for r in rows if r[phase]["calls"] and not r[phase]["costed"])
        for r in rows:
            if not r[phase]["costed"]:
                continue
            side = cpu if r["placement"] == "CPU" else acc
            side["flops"] += r[phase]["flops"]
            side["bytes"] += r[phase]["bytes"]
        total = {k: acc[k] + cpu[k] for k in acc}
        summary[phase] = {
            "accelerator": {**acc, "flops_pct": _pct(acc["flops"], total["flops"]),
                            "bytes_pct": _pct(acc["bytes"], total["bytes"])},
            "cpu": {**cpu, "flops_pct": _pct(cpu["flops"], total["flops"]),
                    "bytes_pct": _pct(cpu["bytes"], total["bytes"])},
            "total": total, "not_costed": uncosted}
    classes: dict[str, dict[str, int]] = {}
    for r in rows:
        c = classes.setdefault(r["op_class"], {"kernels": 0, "gpu": 0, "cpu": 0, "decode_calls": 0,
                                                "decode_bytes": 0, "decode_flops": 0})
        c["kernels"] += 1
        c["cpu" if r["placement"] == "CPU" else "gpu"] += 1
        c["decode_calls"] += r["decode_step"]["calls"]
        c["decode_bytes"] += r["decode_step"]["bytes"] or 0
        c["decode_flops"] += r["decode_step"]["flops"] or 0
    total_row = {k: sum(c[k] for c in classes.values()) for k in
                 ("kernels", "gpu", "cpu", "decode_calls", "decode_bytes", "decode_flops")}
    summary["op_classes"] = dict(sorted(classes.items(), key=lambda kv: OP_CLASSES.index(kv[0])))
    summary["op_classes_total"] = total_row
    if getattr(target, "cpu_class", None):    # AArch64 libraries: the instruction-set class they were built for
        summary["cpu_class"] = target.cpu_class
    bw = (target.phone or {}).get("bandwidth_gbs")
    if bw:
        eff = float(bw) * EFFECTIVE_BANDWIDTH
        seconds = summary["decode_step"]["total"]["bytes"] / (eff * 1e9)
        summary["phone"] = {"name": target.phone.get("name"), "bandwidth_gbs": bw,
                            "effective_bandwidth_gbs": round(eff, 3),
                            "decode_step_ms": round(seconds * 1e3, 4),
                            "decode_tok_s_upper_bound": round(1.0 / seconds, 1) if seconds else None,
                            "note": "bandwidth-bound estimate; " + (
                                "excludes KV-cache/attention traffic" if context_len is None
                                else f"includes KV-cache reads at a context of {context_len} tokens")}
    return summary


# ------------------------------------------------------------------------------------ output
def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _fmt_num(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def to_markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"# Kernel coverage: {report['target']} ({report['device']})", "",
             f"{s['kernels']} kernels; decode step at seq_len={report['seq_len']}, "
             f"prefill chunk of {report['prefill_chunk']} tokens.", ""]
    if report.get("phase_note"):
        lines += [f"Note: {report['phase_note']}", ""]
    lines += ["| phase | accelerator FLOPs | CPU FLOPs | accelerator bytes | CPU bytes |", "|---|---|---|---|---|"]
    for phase in ("decode_step", "prefill_chunk"):
        p = s[phase]
        lines.append(f"| {phase} | {_fmt_num(p['accelerator']['flops'])} ({p['accelerator']['flops_pct']}%) "
                     f"| {_fmt_num(p['cpu']['flops'])} ({p['cpu']['flops_pct']}%) "
                     f"| {_fmt_bytes(p['accelerator']['bytes'])} ({p['accelerator']['bytes_pct']}%) "
                     f"| {_fmt_bytes(p['cpu']['bytes'])} ({p['cpu']['bytes_pct']}%) |")
    if s["decode_step"]["not_costed"]:
        lines += ["", "Not costed (run-time sizes, dispatched by the KV cache): "
                  + ", ".join(s["decode_step"]["not_costed"])]
    if "phone" in s:
        ph = s["phone"]
        lines += ["", f"Estimated decode step on {ph['name']}: {ph['decode_step_ms']} ms "
                  f"({ph['bandwidth_gbs']} GB/s x {EFFECTIVE_BANDWIDTH}; {ph['note']})."]
    if "cpu_class" in s:
        lines += ["", f"CPU class: the CPU library is built for `{s['cpu_class']}` (configs/cpu_classes.yaml)."]
    if "crossings" in s:
        c = s["crossings"]
        acc = c.get("accelerator", "NPU")
        lines += ["", f"CPU<->{acc} crossings per decoded token: {c['crossings_per_token']} "
                  f"({c.get('accelerator_calls', c['npu_calls'])} of {c['decode_calls']} decode kernel calls on "
                  f"the {acc}), moving about "
                  f"{_fmt_bytes(c['bytes_moved_per_token'])} per token ({c['note']})."]
    if report.get("npu_runtime"):
        lines += ["", f"NPU runtime: {report['npu_runtime']}"]
    if "execution" in s:
        e = s["execution"]
        lines += ["", f"Executed here: {e['executed']} of {s['kernels']} kernels ({e['how']}); "
                  f"{e['not_executed']} compiled, not executed (reason per kernel below)."
                  + (f" MISMATCH vs LLVM: {', '.join(e['mismatched'])}." if e["mismatched"] else "")]
        if "oclgrind" in e:
            lines += ["", oclgrind_line(e["oclgrind"]) + "."]
    if "dot_code" in s:
        lines += ["", _dot_code_line(s["dot_code"])]
    big = report.get("largest_parameter")
    if big and big.get("max_buffer_bytes"):
        lines += ["", f"Largest single tensor: `{big['name']}`, {_fmt_bytes(big['bytes'])} "
                  f"({'fits' if big['fits'] else 'EXCEEDS'} the max single allocation of "
                  f"{_fmt_bytes(big['max_buffer_bytes'])})."]
    regions = report.get("cpu_regions")
    if regions and regions.get("regions"):
        per_fn = "; ".join(f"{fn} {c['kernels']} -> {c['calls']}" for fn, c in regions["calls_per_step"].items())
        lines += ["", f"CPU regions: the kernels between two KV-cache calls share one thread-pool launch "
                  f"(barriers between them; {len(regions['regions'])} region kernels). Kernel calls per step: "
                  f"{per_fn}."]
    for sp in report.get("splits") or []:
        lines += ["", f"Split: {sp['message']}; rows per part {sp['rows']}."]
    acc = s.get("crossings", {}).get("accelerator", "GPU")
    lines += ["", "## Op classes", "", f"| op class | kernels | {acc} | CPU | decode calls | decode bytes | decode FLOPs |",
              "|---|---|---|---|---|---|---|"]
    for cls, c in list(s["op_classes"].items()) + [("**Total**", s["op_classes_total"])]:
        lines.append(f"| {cls} | {c['kernels']} | {c['gpu']} | {c['cpu']} | {c['decode_calls']} "
                     f"| {_fmt_bytes(c['decode_bytes'])} | {_fmt_num(c['decode_flops'])} |")
    lines += ["", "## Kernels", "",
              "| kernel | op class | module | placement | rule | callers | decode calls | decode bytes | decode FLOPs "
              "| prefill calls | prefill bytes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    executed = any("executed" in r for r in report["kernels"])
    if executed:
        lines[-2] += " executed here |"
        lines[-1] += "---|"
    reasons = any("reason" in r for r in report["kernels"])
    if reasons:
        lines[-2] += " reason |"
        lines[-1] += "---|"
    for r in report["kernels"]:
        who = {**r["callers"], **{f"{k} (kv-cache)": v for k, v in r["kv_cache_calls"].items()}}
        callers = ", ".join(f"{k}×{v}" for k, v in sorted(who.items())) or "-"
        d, p = r["decode_step"], r["prefill_chunk"]
        lines.append(f"| `{r['name']}` | {r['op_class']} | {r.get('module', '-')} | {r['placement']} | {r['rule']} "
                     f"| {callers} | {d['calls']} | {_fmt_bytes(d['bytes'])} | {_fmt_num(d['flops'])} "
                     f"| {p['calls']} | {_fmt_bytes(p['bytes'])} |"
                     + (f" {r.get('executed', '')} |" if executed else "")
                     + (f" {r.get('reason', '')} |" if reasons else ""))
    lines += gpu_cost_lines(report, _fmt_bytes)
    return "\n".join(lines) + "\n"


def add_dot_code(report: dict[str, Any], dot_code: dict[str, Any]) -> None:
    """Which kernels run dot-product instructions (sdot / smmla), as the compiler read them from the library's
    objects (build.json's dot_code): per kernel row, and in the summary how many of the quantized matmuls do,
    with their hot loops' instructions per weight."""
    kernels = dot_code.get("kernels")
    if kernels is None:
        report["summary"]["dot_code"] = {"note": dot_code.get("note", "not read")}
        return
    quantized = [r["name"] for r in report["kernels"] if r["op_class"].startswith(("dequant-gemv", "dequant-matmul"))]
    for row in report["kernels"]:
        if row["name"] in kernels:
            row["dot_code"] = kernels[row["name"]]
    per_weight = sorted(kernels[n]["instructions_per_weight"] for n in quantized if n in kernels)
    report["summary"]["dot_code"] = {
        "read_with": dot_code.get("read_with"), "quantized_matmuls": len(quantized), "with_dot": len(per_weight),
        "without_dot": [n for n in quantized if n not in kernels],
        "with_smmla": [n for n in quantized if "smmla" in kernels.get(n, {}).get("dot_mnemonics", ())],
        "loop_instructions_per_weight": [per_weight[0], per_weight[-1]] if per_weight else None}


def _dot_code_line(d: dict[str, Any]) -> str:
    if "note" in d:
        return f"Dot-product code: {d['note']}."
    smmla = d.get("with_smmla") or []
    line = (f"Dot-product code (read from the library's objects with {d['read_with']}): {d['with_dot']} of "
            f"{d['quantized_matmuls']} quantized matmul kernels run sdot" + (" or smmla" if smmla else ""))
    if d["loop_instructions_per_weight"]:
        low, high = d["loop_instructions_per_weight"]
        line += f", hot loop {low}-{high} instructions per weight" + (" (smmla: per weight and prompt row)" if smmla
                                                                       else "")
    if smmla:
        line += f"; smmla (i8mm) in {len(smmla)}: {', '.join(smmla)}"
    if d["without_dot"]:
        line += f"; without: {', '.join(d['without_dot'])}"
    return line + "."


def write_coverage(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write coverage.json (sorted keys) and coverage.md into out_dir; return both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "coverage.json"
    md = out / "coverage.md"
    js.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    md.write_text(to_markdown(report))
    return js, md


def oclgrind_line(summary: dict[str, Any]) -> str:
    """The build's Oclgrind verdict (verify/oclgrind_build.py) in one line: printed and in coverage.md."""
    s = summary
    found = (f"{s['races']} data races, {s['out_of_bounds']} out-of-bounds accesses, "
             f"{s['uninitialised']} uninitialised reads" + (f", {s['other']} other reports" if s["other"] else ""))
    known = (f"; known TVM findings: {', '.join(f'{n} ({c})' for n, c in s['known_tvm'].items())}"
             if s["known_tvm"] else "")
    failed = f"; could not run: {', '.join(s['failed'])}" if s["failed"] else ""
    capped = (f" ({s['over_quick_cap']} over the default build's size cap: OCLGRIND=1 checks all)"
              if s.get("over_quick_cap") else "")
    return (f"Oclgrind: {s['run']} of {s['kernels']} twin kernels checked in {s['seconds']} s{capped}: {found}"
            f"{known}{failed}")
