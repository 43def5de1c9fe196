"""Read what TVM's OpenCL build would launch: the OpenCL C and each host function's launch plan.

The TVM wheel has no OpenCL runtime, but it does emit OpenCL C. This module builds a GPU-scheduled
PrimFunc for the Adreno OpenCL target, keeps the generated OpenCL C, and reads the launch plan of every
host entry function from the host-side TIR captured right after ``SplitHostDevice``: at that point the
host function is a flat list of buffer declarations, let-bindings, workspace allocations and
``T.call_ffi_kernel(name, kernel args..., launch extents...)`` calls, whose extents follow the
``launch_params`` tags (``blockIdx.*`` / ``threadIdx.*``, optionally the dynamic shared-memory size last),
exactly what TVM's own OpenCL runtime consumes. ``eval_host`` evaluates the host expressions (shape
variables, symbolic extents) of that plan.

It needs only TVM, not an OpenCL driver: `pipeline.verify.opencl` runs the plans on PoCL.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import ir, tirx
from tvm.s_tir import dlight as dl

from pipeline.compiler.schedule import has_thread_binding, is_scheduled
from pipeline.errors import CompileError
from pipeline.kernels.cpu.rope import NO_CSE_ATTR

# Adreno OpenCL device code; the host part is this machine so that the host side can be lowered here.
ADRENO_TARGET: dict = {"kind": "opencl", "device": "adreno", "host": {"kind": "llvm"}}

# Launch-parameter tags that are flags and consume no launch argument (see TVM's LaunchParamConfig).
_FLAG_TAGS = (
    "tirx.use_programtic_dependent_launch",
    "tirx.use_cooperative_launch",
    "tirx.use_required_block_dimension",
)
_DYN_SHMEM_TAG = "tirx.use_dyn_shared_memory"


# --------------------------------------------------------------------------------------------------
# Scheduling
# --------------------------------------------------------------------------------------------------


def _as_target(target) -> tvm.target.Target:
    return target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)


def default_gpu_rules(target) -> list:
    """The dlight rules tried in order: Adreno pattern rules (conv/pool/layout), then the generic GPU ones.

    The generic order (GEMV, Matmul, Reduction, GeneralReduction, Fallback) is the one the pipeline's
    ``android-adreno`` target uses. The Adreno rules only claim their own patterns; TVM's texture-based
    ``dl.adreno.Fallback`` is left out because the pipeline does not use texture memory.
    """
    target = _as_target(target)
    rules = []
    if "adreno" in target.keys:
        rules += [dl.adreno.Conv2d(), dl.adreno.LayoutTransform(), dl.adreno.Pool2D()]
    rules += [dl.gpu.GEMV(), dl.gpu.Matmul(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    return rules


def schedule_for_gpu(func: tirx.PrimFunc, target, rules: Sequence | None = None) -> tvm.IRModule:
    """Schedule ``func`` with dlight GPU rules under ``target``; return ``IRModule({"main": scheduled})``.

    A function that is already scheduled (``tirx.is_scheduled`` and thread bindings, e.g. TVM's
    paged-attention kernels) is kept as it is. ``rules`` overrides the rule list (first rule that
    applies wins). Raises :class:`CompileError` when no rule gives the function thread bindings:
    TVM would otherwise silently compile it to host code.
    """
    target = _as_target(target)
    name = str(func.attrs["global_symbol"]) if func.attrs is not None and "global_symbol" in func.attrs \
        else "main"
    if is_scheduled(func) and has_thread_binding(func):
        return tvm.IRModule({"main": func})
    rule_list = list(rules) if rules is not None else default_gpu_rules(target)
    scheduled = None
    with target:
        for rule in rule_list:
            space = rule.apply(func, target, False)
            if space is None:
                continue
            sch = space[0] if isinstance(space, list | tuple) else space
            scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            break
    if scheduled is None or not has_thread_binding(scheduled):
        tried = ", ".join(type(r).__name__ for r in rule_list)
        raise CompileError(f"PrimFunc {name!r} was not scheduled for the GPU by any of [{tried}]",
                           fix="add a schedule rule (e.g. dl.gpu.Fallback) or schedule it by hand")
    return tvm.IRModule({"main": scheduled})


# --------------------------------------------------------------------------------------------------
# Launch plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchArg:
    """One kernel argument: a device buffer (``kind="buffer"``) or a scalar (``kind="scalar"``).

    ``name`` is the host buffer the pointer refers to (a parameter of the entry function or a workspace
    allocated between launches) or, for scalars, the TIR expression; ``expr`` is the host-side value.
    """

    name: str
    kind: str
    dtype: str
    expr: Any


@dataclass(frozen=True)
class KernelLaunch:
    """One ``call_ffi_kernel`` in a host function.

    ``grid`` / ``block`` are the (x, y, z) extents of ``blockIdx`` / ``threadIdx`` as TIR expressions
    (ints when static); OpenCL global size = grid * block, local size = block.
    """

    kernel: str
    args: tuple[LaunchArg, ...]
    grid: tuple[Any, Any, Any]
    block: tuple[Any, Any, Any]
    work_dim: int
    dyn_shared_bytes: Any = None

    def sizes(self, scalar_vars: dict[str, int] | None = None, _env: dict | None = None
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global, local) OpenCL work sizes, symbolic variables given by name in ``scalar_vars``.

        Extents that use host let-bindings need :meth:`HostEntry.work_sizes` instead.
        """
        named = dict(scalar_vars or {})
        env = _env or {}
        # Like TVM's runtime, a zero extent (empty dynamic shape) is launched as 1.
        grid = [max(1, int(eval_host(e, env, named))) for e in self.grid[:self.work_dim]]
        block = [max(1, int(eval_host(e, env, named))) for e in self.block[:self.work_dim]]
        return tuple(g * b for g, b in zip(grid, block, strict=True)), tuple(block)

    def describe(self) -> str:
        args = ", ".join(a.name if a.kind == "buffer" else f"{a.dtype} {a.name}" for a in self.args)
        grid = ", ".join(str(e) for e in self.grid)
        block = ", ".join(str(e) for e in self.block)
        return f"{self.kernel}({args}) grid=({grid}) block=({block})"


@dataclass(frozen=True)
class ParamSpec:
    """A parameter of a host entry function: a buffer (shape/dtype/offset exprs) or a scalar."""

    name: str
    kind: str                    # "buffer" | "scalar"
    dtype: str
    var: Any
    shape: tuple = ()
    strides: tuple = ()
    elem_offset: Any = 0


@dataclass
class HostEntry:
    """A host entry function: its parameters and its ordered steps (bind / alias / alloc / launch)."""

    name: str
    params: list[ParamSpec]
    steps: list[tuple]
    launches: list[KernelLaunch] = field(default_factory=list)

    def work_sizes(self, scalar_vars: dict[str, int] | None = None) -> list[tuple[tuple, tuple]]:
        """(global, local) sizes of each launch in order, evaluating the host let-bindings on the way."""
        named = dict(scalar_vars or {})
        env: dict = {}
        sizes = []
        for step in self.steps:
            if step[0] == "bind":
                env[step[1].__chandle__()] = eval_host(step[2], env, named)
            elif step[0] == "launch":
                sizes.append(step[1].sizes(named, env))
        return sizes


@dataclass
class OpenCLProgram:
    """The OpenCL C of a built module plus the launch plan of each host entry function."""

    source: str
    entries: dict[str, HostEntry]
    kernel_params: dict[str, list[str]]      # kernel name -> param dtypes ("handle" for pointers)
    target: Any = None

    def launches(self, func_name: str) -> list[KernelLaunch]:
        return self.entry(func_name).launches

    def entry(self, func_name: str) -> HostEntry:
        if func_name not in self.entries:
            raise KeyError(f"no host function {func_name!r}; have {sorted(self.entries)}")
        return self.entries[func_name]


@tvm.instrument.pass_instrument
class _AfterSplitHostDevice:
    """Keeps a copy of the module right after SplitHostDevice (host TIR still has plain params)."""

    def __init__(self):
        self.mod = None

    def run_after_pass(self, mod, info):
        if str(info.name).endswith("SplitHostDevice"):
            self.mod = mod


def _lower_and_build(mod: tvm.IRModule, target: tvm.target.Target) -> tuple[tvm.IRModule, Any]:
    """tvm.tirx.build with the real default pipeline, also returning the post-SplitHostDevice module."""
    snap = _AfterSplitHostDevice()
    cur = tvm.transform.PassContext.current()
    config = dict(cur.config)
    if any(f.attrs is not None and NO_CSE_ATTR in f.attrs for _, f in mod.functions_items()):
        config["tirx.disable_cse_tir"] = True      # as the library is built (kernels/cpu/rope.CSE_BREAKS)
    ctx = tvm.transform.PassContext(opt_level=cur.opt_level, config=config,
                                    instruments=list(cur.instruments) + [snap])
    with ctx:
        lib = tvm.tirx.build(mod, target=target)
    if snap.mod is None:
        raise RuntimeError("the TIR pipeline did not run SplitHostDevice; cannot read kernel launches")
    return snap.mod, lib


def _device_source(lib) -> str:
    sources = []
    for m in lib.imports:
        if m.kind == "opencl":
            sources.append(m.inspect_source())
    if not sources:
        kinds = [m.kind for m in lib.imports]
        raise CompileError(f"the build produced no OpenCL module (imports: {kinds})",
                           fix="schedule the functions for the GPU (thread bindings) before building")
    return "\n".join(sources)


def _is_host_func(func) -> bool:
    # Right after SplitHostDevice the host function still carries the device target (with its host);
    # device kernels are the ones with the kernel-launch calling convention.
    attrs = func.attrs
    if attrs is None:
        return True
    is_kernel = "tirx.is_global_func" in attrs and bool(attrs["tirx.is_global_func"])
    return not is_kernel and int(attrs.get("calling_conv", 0)) != int(ir.CallingConv.DEVICE_KERNEL_LAUNCH)


def _launch_from_call(call, kernel_params: dict[str, list[str]], buffer_names: dict) -> KernelLaunch:
    kernel = str(call.args[0].value)
    if kernel not in kernel_params:
        raise RuntimeError(f"host code launches unknown kernel {kernel!r}")
    ptypes = kernel_params[kernel]
    nargs = len(ptypes)
    kargs = []
    for expr, dtype in zip(call.args[1:1 + nargs], ptypes, strict=True):
        if dtype == "handle":
            if not (isinstance(expr, ir.Call) and expr.op.name == "tirx.buffer_data"):
                raise NotImplementedError(f"kernel {kernel}: pointer argument {expr} is not a buffer's data")
            name = buffer_names.get(expr.args[0].__chandle__(), expr.args[0].name)
            kargs.append(LaunchArg(str(name), "buffer", "handle", expr))
        else:
            kargs.append(LaunchArg(str(expr), "scalar", dtype, expr))
    extents = list(call.args[1 + nargs:])
    grid: list[Any] = [1, 1, 1]
    block: list[Any] = [1, 1, 1]
    filled = [False] * 6
    dyn = None
    pos = 0
    for tag in [str(t) for t in call.attrs.launch_params]:
        if tag in _FLAG_TAGS:
            continue
        if tag == _DYN_SHMEM_TAG:
            dyn = extents[pos]
            pos += 1
            continue
        scope, _, dim = tag.partition(".")
        idx = "xyz".index(dim)
        if scope == "blockIdx":
            grid[idx] = extents[pos]
            filled[idx] = True
        elif scope == "threadIdx":
            block[idx] = extents[pos]
            filled[3 + idx] = True
        else:
            raise NotImplementedError(f"kernel {kernel}: launch tag {tag!r} is not supported on OpenCL")
        pos += 1
    if pos != len(extents):
        raise RuntimeError(f"kernel {kernel}: {len(extents)} launch values for tags {list(call.attrs.launch_params)}")
    work_dim = max([i + 1 for i in range(3) if filled[i] or filled[3 + i]] or [1])
    return KernelLaunch(kernel, tuple(kargs), tuple(grid), tuple(block), work_dim, dyn)


def _host_steps(stmt, kernel_params, buffer_names, steps: list, launches: list) -> None:
    """Flatten a post-SplitHostDevice host body into ordered steps; reject host control flow."""
    if isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            _host_steps(s, kernel_params, buffer_names, steps, launches)
    elif isinstance(stmt, tirx.AttrStmt):
        _host_steps(stmt.body, kernel_params, buffer_names, steps, launches)
    elif isinstance(stmt, tirx.DeclBuffer):
        data = stmt.data
        if isinstance(data, ir.Call) and data.op.name == "tirx.buffer_data":
            buffer_names[stmt.buffer.__chandle__()] = buffer_names.get(data.args[0].__chandle__(),
                                                                        data.args[0].name)
        steps.append(("alias", stmt.buffer, data))
    elif isinstance(stmt, tirx.AllocBuffer):
        buf = stmt.buffer
        buffer_names[buf.__chandle__()] = f"workspace:{buf.name}"
        steps.append(("alloc", buf, tuple(buf.shape), str(buf.dtype)))
    elif isinstance(stmt, tirx.Bind):
        steps.append(("bind", stmt.var, stmt.value))
    elif isinstance(stmt, tirx.AssertStmt):
        steps.append(("assert", stmt.condition, stmt))
    elif isinstance(stmt, tirx.Evaluate):
        value = stmt.value
        if isinstance(value, ir.Call) and value.op.name == "tirx.call_ffi_kernel":
            launch = _launch_from_call(value, kernel_params, buffer_names)
            launches.append(launch)
            steps.append(("launch", launch))
        elif isinstance(value, ir.Call):
            raise NotImplementedError(f"host code calls {value.op.name}; only kernel launches are supported")
    elif isinstance(stmt, tirx.Return):
        return
    else:
        raise NotImplementedError(f"host statement {type(stmt).__name__} around kernel launches is not "
                                  "supported by the PoCL harness")


def param_spec(param) -> ParamSpec:
    ty = param.ty
    if isinstance(ty, tirx.BufferType):
        return ParamSpec(str(param.name), "buffer", str(param.dtype), param, tuple(param.shape),
                         tuple(param.strides), param.elem_offset)
    if isinstance(ty, ir.PrimType):
        return ParamSpec(str(param.name), "scalar", str(ty.dtype), param)
    raise NotImplementedError(f"parameter {param.name} of type {ty} is not supported")


def opencl_kernels(mod: tvm.IRModule | tirx.PrimFunc, target=None) -> OpenCLProgram:
    """Build a GPU-scheduled module for OpenCL; return its OpenCL C and per-entry kernel launch plans."""
    target = _as_target(target if target is not None else ADRENO_TARGET)
    if isinstance(mod, tirx.PrimFunc):
        mod = tvm.IRModule({"main": mod})
    # TVM would silently compile an unscheduled function into host code; refuse it up front.
    unscheduled = [gv.name_hint for gv, f in mod.functions_items()
                   if isinstance(f, tirx.PrimFunc) and not has_thread_binding(f)]
    if unscheduled:
        raise CompileError(f"function(s) {', '.join(sorted(unscheduled))} have no GPU thread bindings and "
                           "would run as host code", fix="schedule them first (schedule_for_gpu)")
    lowered, lib = _lower_and_build(mod, target)
    kernel_params: dict[str, list[str]] = {}
    for gv, func in lowered.functions_items():
        if isinstance(func, tirx.PrimFunc) and not _is_host_func(func):
            ptypes = ["handle" if isinstance(p.ty, ir.PointerType) else str(p.ty.dtype) for p in func.params]
            kernel_params[gv.name_hint] = ptypes
            if func.attrs is not None and "global_symbol" in func.attrs:
                kernel_params[str(func.attrs["global_symbol"])] = ptypes
    entries: dict[str, HostEntry] = {}
    for gv, func in lowered.functions_items():
        if not isinstance(func, tirx.PrimFunc) or not _is_host_func(func):
            continue
        params = [param_spec(p) for p in func.params]
        names = {p.var.__chandle__(): p.name for p in params if p.kind == "buffer"}
        steps: list[tuple] = []
        launches: list[KernelLaunch] = []
        _host_steps(func.body, kernel_params, names, steps, launches)
        entries[gv.name_hint] = HostEntry(gv.name_hint, params, steps, launches)
    if not any(e.launches for e in entries.values()):
        raise CompileError("no function of the module launches an OpenCL kernel",
                           fix="schedule the functions for the GPU (thread bindings) before building")
    return OpenCLProgram(_device_source(lib), entries, kernel_params, target)


# --------------------------------------------------------------------------------------------------
# Host-expression evaluation
# --------------------------------------------------------------------------------------------------


def _trunc_div(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return a / b
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _trunc_mod(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return math.fmod(a, b)
    return a - _trunc_div(a, b) * b


def _floor_div(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return math.floor(a / b)
    return a // b


_BINARY: dict[type, Callable] = {
    tirx.Add: operator.add, tirx.Sub: operator.sub, tirx.Mul: operator.mul,
    tirx.Div: _trunc_div, tirx.Mod: _trunc_mod, tirx.FloorDiv: _floor_div, tirx.FloorMod: operator.mod,
    tirx.Min: min, tirx.Max: max,
    tirx.EQ: operator.eq, tirx.NE: operator.ne, tirx.LT: operator.lt, tirx.LE: operator.le,
    tirx.GT: operator.gt, tirx.GE: operator.ge,
    tirx.And: lambda a, b: bool(a) and bool(b), tirx.Or: lambda a, b: bool(a) or bool(b),
    tirx.BitwiseAnd: operator.and_, tirx.BitwiseOr: operator.or_, tirx.BitwiseXor: operator.xor,
    tirx.LShift: operator.lshift, tirx.RShift: operator.rshift,
}


def cast_scalar(dtype: str, value):
    if dtype == "bool":
        return bool(value)
    if dtype.startswith(("int", "uint")):
        bits = int(re.sub(r"\D", "", dtype) or 32)
        v = int(value) % (1 << bits)
        if dtype.startswith("int") and v >= 1 << (bits - 1):
            v -= 1 << bits
        return v
    if dtype.startswith(("float", "bfloat")):
        return float(value)
    return value


def eval_host(expr, env: dict, named: dict[str, Any]):
    """Evaluate a host TIR expression; ``env`` maps var handles to values, ``named`` maps var names."""
    if isinstance(expr, int | float | bool | np.integer | np.floating):
        return expr
    if isinstance(expr, tirx.IntImm):
        return bool(expr.value) if str(expr.ty.dtype) == "bool" else int(expr.value)
    if isinstance(expr, tirx.FloatImm):
        return float(expr.value)
    if isinstance(expr, tirx.Var):
        key = expr.__chandle__()
        if key in env:
            return env[key]
        if str(expr.name) in named:
            return named[str(expr.name)]
        raise KeyError(f"unbound variable {expr.name!r}; pass it in scalar_vars")
    op = _BINARY.get(type(expr))
    if op is not None:
        return op(eval_host(expr.a, env, named), eval_host(expr.b, env, named))
    if isinstance(expr, tirx.Not):
        return not eval_host(expr.a, env, named)
    if isinstance(expr, tirx.Cast):
        return cast_scalar(str(expr.ty.dtype), eval_host(expr.value, env, named))
    if isinstance(expr, tirx.Select):
        cond = eval_host(expr.condition, env, named)
        return eval_host(expr.true_value if cond else expr.false_value, env, named)
    if isinstance(expr, tirx.Let):
        inner = dict(env)
        inner[expr.var.__chandle__()] = eval_host(expr.value, env, named)
        return eval_host(expr.body, inner, named)
    if isinstance(expr, ir.Call):
        name = expr.op.name if isinstance(expr.op, ir.Op) else str(expr.op)
        if name == "tirx.buffer_data":
            return eval_host(expr.args[0], env, named)
        if name == "tirx.if_then_else":
            cond = eval_host(expr.args[0], env, named)
            return eval_host(expr.args[1] if cond else expr.args[2], env, named)
        if name in ("tirx.likely", "tirx.assume"):
            return eval_host(expr.args[0], env, named)
        raise NotImplementedError(f"cannot evaluate host call {name}")
    raise NotImplementedError(f"cannot evaluate host expression {type(expr).__name__}: {expr}")


_PRIVATE_ARRAY = re.compile(r"^\s*(\w+) (\w+)\[\d+\];", re.M)
_SELF_UPDATE = re.compile(r"^\s*(\w+)\[([^\]]*)\] = (.*);$", re.M)


def accumulators(source: str) -> dict[str, dict[str, str]]:
    """{kernel: {private array: its element type}} for every private array of each OpenCL kernel that is
    updated from itself with a `+` (x[i] = (x[i] + ...) or (... + x[i])): the registers a reduction sums in."""
    out: dict[str, dict[str, str]] = {}
    for part in re.split(r"^// Function: ", source, flags=re.M)[1:]:
        name = part.split("\n", 1)[0].strip()
        declared = {m.group(2): m.group(1) for m in _PRIVATE_ARRAY.finditer(part)}
        found = out.setdefault(name, {})
        for m in _SELF_UPDATE.finditer(part):
            var, index, value = m.groups()
            if var in declared and "+" in value and f"{var}[{index}]" in value:
                found[var] = declared[var]
    return out
