"""Execute TVM-generated OpenCL kernels on a CPU OpenCL driver (PoCL) and compare them with LLVM builds.

``run_on_pocl`` interprets a launch plan read by `pipeline.verify.opencl_plan` with pyopencl: shape
variables are bound from the numpy arrays (or given in ``scalar_vars``), symbolic extents are evaluated,
and each kernel is enqueued with global size = grid * block and local size = block.

``run_on_llvm`` builds the same unscheduled PrimFunc for the CPU as the reference. PoCL has no
``cl_khr_fp16``, so only fp32 (and integer) kernels can be executed here. pyopencl is imported inside
the functions that need it: it is optional (no OpenCL device, no execution checks).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from typing import Any

import numpy as np
import tvm
from tvm import ir, relax, tirx

from pipeline.kernels.cpu.rope import NO_CSE_ATTR
from pipeline.verify.opencl_plan import (
    HostEntry,
    KernelLaunch,
    OpenCLProgram,
    cast_scalar,
    eval_host,
    opencl_kernels,
)

# --------------------------------------------------------------------------------------------------
# PoCL execution
# --------------------------------------------------------------------------------------------------

_CL_STATE: dict[str, Any] = {}


def find_opencl_device():
    """The PoCL (CPU) OpenCL device if present, else the first OpenCL device; None when there is none."""
    try:
        import pyopencl as cl
    except ImportError:
        return None
    try:
        platforms = cl.get_platforms()
    except Exception:  # noqa: BLE001 - no ICD loader / no platform
        return None
    devices = []
    for platform in platforms:
        try:
            found = platform.get_devices()
        except Exception:  # noqa: BLE001 - a platform without devices
            continue
        is_pocl = "portable computing language" in platform.name.lower() or "pocl" in platform.name.lower()
        devices += [(0 if is_pocl else 1, d) for d in found]
    if not devices:
        return None
    return sorted(devices, key=lambda x: x[0])[0][1]


def _cl_state():
    if "queue" not in _CL_STATE:
        import pyopencl as cl

        device = find_opencl_device()
        if device is None:
            raise RuntimeError("no OpenCL device found (install pocl-opencl-icd)")
        ctx = cl.Context([device])
        _CL_STATE.update(device=device, ctx=ctx, queue=cl.CommandQueue(ctx), programs={})
    return _CL_STATE


def _cl_program(source: str):
    import pyopencl as cl

    state = _cl_state()
    key = hashlib.sha256(source.encode()).hexdigest()
    prog = state["programs"].get(key)
    if prog is None:
        uses_half = "cl_khr_fp16" in source or re.search(r"\bhalf\d*\b", source) is not None
        if uses_half and "cl_khr_fp16" not in state["device"].extensions:
            raise RuntimeError("the OpenCL source uses fp16 but the OpenCL device has no cl_khr_fp16 "
                               "(PoCL on CPU): build the kernels in float32")
        prog = cl.Program(state["ctx"], source).build()
        state["programs"][key] = prog
    return prog


_NP_SCALAR = {"int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
              "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
              "float32": np.float32, "float64": np.float64, "bool": np.int8}


def _bind_params(entry: HostEntry, args: list, named: dict[str, Any]) -> dict:
    """Bind parameters and the shape/offset variables of buffer parameters from the given arrays."""
    if len(args) != len(entry.params):
        raise ValueError(f"{entry.name} takes {len(entry.params)} arguments "
                         f"({', '.join(p.name for p in entry.params)}), got {len(args)}")
    env: dict = {}

    def bind(var_expr, value, what: str) -> None:
        if isinstance(var_expr, tirx.Var):
            key = var_expr.__chandle__()
            if key not in env:
                if str(var_expr.name) in named and int(named[str(var_expr.name)]) != value:
                    raise ValueError(f"{what}: {var_expr.name}={value} from the array, "
                                     f"but scalar_vars says {named[str(var_expr.name)]}")
                env[key] = value

    for spec, arg in zip(entry.params, args, strict=True):
        if spec.kind == "scalar":
            value = named.get(spec.name) if arg is None else arg
            if value is None:
                raise ValueError(f"scalar parameter {spec.name!r} has no value")
            env[spec.var.__chandle__()] = cast_scalar(spec.dtype, value.item() if hasattr(value, "item") else value)
            continue
        if not isinstance(arg, np.ndarray):
            raise TypeError(f"parameter {spec.name!r} needs a numpy array, got {type(arg).__name__}")
        if str(arg.dtype) != spec.dtype:
            raise TypeError(f"parameter {spec.name!r} is {spec.dtype}, got a {arg.dtype} array")
        if arg.ndim != len(spec.shape):
            raise ValueError(f"parameter {spec.name!r} has {len(spec.shape)} dims, got shape {arg.shape}")
        if not (arg.flags.c_contiguous and arg.flags.writeable):
            raise ValueError(f"parameter {spec.name!r} must be a writeable C-contiguous array")
        for dim, size in zip(spec.shape, arg.shape, strict=True):
            bind(dim, int(size), f"{spec.name}.shape")
        bind(spec.elem_offset, 0, f"{spec.name}.elem_offset")
        contiguous = [int(np.prod(arg.shape[i + 1:], dtype=np.int64)) for i in range(arg.ndim)]
        for stride, value in zip(spec.strides, contiguous, strict=False):
            bind(stride, value, f"{spec.name}.strides")
    # Check every shape / offset / stride expression against the arrays.
    for spec, arg in zip(entry.params, args, strict=True):
        if spec.kind != "buffer":
            continue
        for i, (dim, size) in enumerate(zip(spec.shape, arg.shape, strict=True)):
            if int(eval_host(dim, env, named)) != size:
                raise ValueError(f"{spec.name}.shape[{i}] is {dim}={eval_host(dim, env, named)}, got {size}")
        if int(eval_host(spec.elem_offset, env, named)) != 0:
            raise ValueError(f"{spec.name} expects a non-zero element offset")
    return env


def run_on_pocl(program: OpenCLProgram, func_name: str, args: list,
                scalar_vars: dict[str, int] | None = None) -> list:
    """Run every kernel launch of ``func_name`` on PoCL; results are copied back into ``args`` in place.

    ``args`` follow the entry function's parameters: numpy arrays for buffers, numbers for scalar
    parameters (or None to take them from ``scalar_vars`` by name). Symbolic shape variables are bound
    from the arrays; ``scalar_vars`` supplies (or cross-checks) any variable by name.
    """
    import pyopencl as cl

    entry = program.entry(func_name)
    named = dict(scalar_vars or {})
    env = _bind_params(entry, list(args), named)
    state = _cl_state()
    ctx, queue = state["ctx"], state["queue"]
    prog = _cl_program(program.source)
    mf = cl.mem_flags
    device_buffers = []
    for spec, arg in zip(entry.params, args, strict=True):
        if spec.kind == "buffer":
            host = arg if arg.nbytes else np.zeros(4, np.uint8)
            buf = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=host)
            env[spec.var.__chandle__()] = buf
            device_buffers.append((arg, buf))
    for step in entry.steps:
        kind = step[0]
        if kind == "bind":
            env[step[1].__chandle__()] = eval_host(step[2], env, named)
        elif kind == "alias":
            env[step[1].__chandle__()] = eval_host(step[2], env, named)
        elif kind == "alloc":
            _, buf_var, shape, dtype = step
            count = int(np.prod([int(eval_host(s, env, named)) for s in shape], dtype=np.int64))
            nbytes = max(count * np.dtype(dtype).itemsize, 4)
            env[buf_var.__chandle__()] = cl.Buffer(ctx, mf.READ_WRITE, size=nbytes)
        elif kind == "assert":
            if not eval_host(step[1], env, named):
                raise AssertionError(f"host assertion failed: {step[1]}")
        elif kind == "launch":
            _launch(prog, queue, step[1], env, named)
    queue.finish()
    for arr, buf in device_buffers:
        if arr.nbytes:
            cl.enqueue_copy(queue, arr, buf)
    queue.finish()
    return list(args)


def _launch(prog, queue, launch: KernelLaunch, env: dict, named: dict) -> None:
    import pyopencl as cl

    kernel = cl.Kernel(prog, launch.kernel)
    values = []
    for arg in launch.args:
        value = eval_host(arg.expr, env, named)
        if arg.kind == "buffer":
            if not isinstance(value, cl.Buffer):
                raise RuntimeError(f"{launch.kernel}: argument {arg.name} is not a device buffer")
            values.append(value)
        else:
            values.append(_NP_SCALAR[arg.dtype](value))
    if launch.dyn_shared_bytes is not None:
        values.append(cl.LocalMemory(max(1, int(eval_host(launch.dyn_shared_bytes, env, named)))))
    kernel.set_args(*values)
    global_size, local_size = launch.sizes(named, env)
    cl.enqueue_nd_range_kernel(queue, kernel, global_size, local_size)


# --------------------------------------------------------------------------------------------------
# LLVM reference
# --------------------------------------------------------------------------------------------------


def run_on_llvm(func: tirx.PrimFunc, args: list) -> list:
    """Build ``func`` (unscheduled) for the host CPU with LLVM, run it, and copy results into ``args``."""
    no_cse = func.attrs is not None and NO_CSE_ATTR in func.attrs   # kernels/cpu/rope.CSE_BREAKS
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}) if no_cse else contextlib.nullcontext():
        exe = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target({"kind": "llvm"}))
    dev = tvm.cpu()
    call_args = []
    tensors = []
    for arg in args:
        if isinstance(arg, np.ndarray):
            t = tvm.runtime.tensor(arg, dev)
            call_args.append(t)
            tensors.append((arg, t))
        else:
            call_args.append(arg.item() if hasattr(arg, "item") else arg)
    exe["main"](*call_args)
    for arr, t in tensors:
        if not arr.flags.writeable:
            raise ValueError("run_on_llvm writes results back; pass writeable arrays")
        np.copyto(arr, t.numpy())
    return list(args)


# --------------------------------------------------------------------------------------------------
# A whole Relax function, kernel by kernel
# --------------------------------------------------------------------------------------------------


def _relax_shape(ty) -> tuple[int, ...]:
    return tuple(int(d) for d in ty.shape.values)


def run_relax_on_pocl(fused: tvm.IRModule, scheduled: tvm.IRModule, inputs: list[np.ndarray], target,
                      func_name: str = "main") -> tuple[list[np.ndarray], dict[str, float]]:
    """Execute a fused Relax function's `call_tir`s in order, each kernel on PoCL, on the real tensors.

    ``fused`` holds the unscheduled PrimFuncs (built with LLVM as the reference for every call, on the same
    inputs); ``scheduled`` the GPU-scheduled ones of the same names. Static shapes only. Returns the outputs
    of the function (from the PoCL chain) and, per kernel, the largest |PoCL - LLVM| over its calls
    relative to the LLVM output's scale.
    """
    func = fused[func_name]
    env: dict = dict(zip([p.__chandle__() for p in func.params], inputs, strict=True))
    programs: dict[str, OpenCLProgram] = {}
    errors: dict[str, float] = {}
    call_tir = ir.Op.get("relax.call_tir")

    def value(expr) -> Any:
        if isinstance(expr, ir.Constant):
            return np.array(expr.value.numpy(), order="C", copy=True)   # keeps 0-d arrays 0-d
        if isinstance(expr, relax.Var):
            return env[expr.__chandle__()]
        if isinstance(expr, relax.Tuple):
            return [value(f) for f in expr.fields]
        raise NotImplementedError(f"cannot evaluate {type(expr).__name__} on PoCL")

    def run_call(call) -> Any:
        gv, args = call.args[0], [value(a) for a in call.args[1].fields]
        outs_ty = call.ty_args[0]
        outs_ty = list(outs_ty.fields) if isinstance(outs_ty, relax.TupleType) else [outs_ty]
        outs = [np.zeros(_relax_shape(t), str(t.dtype)) for t in outs_ty]
        name = gv.name_hint
        if name not in programs:
            programs[name] = opencl_kernels(tvm.IRModule({name: scheduled[name].with_attr("global_symbol", name)}),
                                            target)
        ref = run_on_llvm(fused[name].with_attr("global_symbol", name), [a.copy() for a in args + outs])[len(args):]
        got = run_on_pocl(programs[name], name, [a.copy() for a in args + outs])[len(args):]
        for r, g in zip(ref, got, strict=True):
            scale = max(float(np.abs(r).max()) if r.size else 0.0, 1e-30)
            err = float(np.abs(g.astype(np.float64) - r).max()) / scale if r.size else 0.0
            errors[name] = max(errors.get(name, 0.0), err)
        return got if isinstance(call.ty_args[0], relax.TupleType) else got[0]

    body = func.body
    for block in body.blocks:
        for binding in block.bindings:
            v = binding.value
            if isinstance(v, relax.Call) and v.op.same_as(call_tir):
                result = run_call(v)
            elif isinstance(v, relax.TupleGetItem):
                result = value(v.tuple_value)[v.index]
            else:
                result = value(v)
            env[binding.var.__chandle__()] = result
    out = value(body.body)
    return (out if isinstance(out, list) else [out]), errors
