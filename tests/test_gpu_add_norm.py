"""Residual add + RMSNorm fused for the GPU (pipeline/kernels/gpu/add_norm.py): the kernel on PoCL (fp32 twin) and
under Oclgrind against float64 numpy, the graph rewrite on a Relax function run by LLVM against the unfused
function, and the SmolLM2-shaped android-adreno module's launches. Tolerance 1e-5 of the output scale (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from pipeline.kernels.gpu.add_norm import KERNEL, add_rms_norm, fuse_add_rms_norm
from pipeline.verify.opencl_plan import ADRENO_TARGET, opencl_kernels

TOL = 1e-5
EPS = 1e-5


def _case(h: int, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((1, rows, h)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(h).astype(np.float32)
    s = a.astype(np.float64) + b
    ref = s / np.sqrt((s * s).mean(-1, keepdims=True) + EPS) * w
    return [a, b, w, np.zeros_like(a), np.zeros_like(a)], s, ref


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) / float(np.abs(want).max())


@pytest.mark.parametrize("h,rows", [(576, 1), (576, 7), (5120, 2)])
def test_fused_add_rms_norm_on_pocl(h, rows):
    """SmolLM2's hidden size (decode row, a prefill chunk of 7) and qwen27b's: one launch of one work-group per
    row, one barrier, float sums; both outputs match numpy."""
    from pipeline.verify.opencl import find_opencl_device, run_on_llvm, run_on_pocl

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)")
    program = opencl_kernels(tvm.IRModule({"main": add_rms_norm(h, "float32", "float32", EPS)
                                           .with_attr("global_symbol", "main")}), ADRENO_TARGET)
    (launch,) = program.launches("main")
    assert f"grid=(seq_len, 1, 1) block=({64 if h <= 2048 else 256}, 1, 1)" in launch.describe()
    assert program.source.count("barrier(") == 1
    args, s, ref = _case(h, rows)
    got = run_on_pocl(program, "main", [x.copy() for x in args])
    assert _rel(got[3], s) <= TOL and _rel(got[4], ref) <= TOL
    cpu = run_on_llvm(add_rms_norm(h, "float32", "float32", EPS, gpu=False).with_attr("global_symbol", "main"),
                      [x.copy() for x in args])
    assert _rel(cpu[3], s) <= TOL and _rel(cpu[4], ref) <= TOL


def test_fused_add_rms_norm_is_clean_under_oclgrind():
    from pipeline.verify.oclgrind import oclgrind_library, run_under_oclgrind

    if oclgrind_library() is None:
        pytest.skip("oclgrind not installed (`make system-deps`)")
    args, s, ref = _case(576, 3)
    func = add_rms_norm(576, "float32", "float32", EPS).with_attr("global_symbol", "add_norm")
    run = run_under_oclgrind(tvm.IRModule({"add_norm": func}), ADRENO_TARGET, {"add_norm": args})
    assert not run.failed and run.total("add_norm") == 0 and "add_norm" not in run.unchecked, run.first
    assert _rel(run.outputs["add_norm"][3], s) <= TOL and _rel(run.outputs["add_norm"][4], ref) <= TOL


def _block_module(h: int = 64):
    """x1 = x + y; n1 = rms_norm(x1, w1); x2 = x1 + n1 * 2; n2 = rms_norm(x2, w2): two layer boundaries whose sums
    feed both a norm and the next add, legalized like the model."""
    bb = relax.BlockBuilder()
    ty = relax.TensorType((1, tvm.tirx.Var("n", "int64"), h), "float32")
    x, y = relax.Var("x", ty), relax.Var("y", ty)
    w1, w2 = (relax.Var(n, relax.TensorType((h,), "float32")) for n in ("w1", "w2"))
    with bb.function("main", [x, y, w1, w2]):
        with bb.dataflow():
            x1 = bb.emit(relax.op.add(x, y))
            n1 = bb.emit(relax.op.nn.rms_norm(x1, w1, axes=[-1], epsilon=EPS))
            x2 = bb.emit(relax.op.add(x1, relax.op.multiply(n1, relax.const(2.0, "float32"))))
            n2 = bb.emit(relax.op.nn.rms_norm(x2, w2, axes=[-1], epsilon=EPS))
            out = bb.emit_output(relax.Tuple([x2, n2]))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def _run_on_llvm(mod, inputs):
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in inputs])]


def test_rewrite_fuses_each_boundary_and_keeps_the_results():
    """Under an OpenCL target both add + rms_norm pairs become fused_add_rms_norm calls (the sum still feeds the
    next add); with the kernel's LLVM variant in its place the function gives the unfused one's results."""
    mod = _block_module()
    with tvm.target.Target(ADRENO_TARGET):
        fused = fuse_add_rms_norm(mod)
    calls = [line for line in fused["main"].script().splitlines() if "R.call_tir" in line]
    assert sum(KERNEL in line for line in calls) == 2 and not any("rms_norm" in line and KERNEL not in line
                                                                  for line in calls), calls
    with tvm.target.Target("llvm"):
        assert fuse_add_rms_norm(mod).same_as(mod)            # CPU targets keep the pair
    for gv in list(fused.functions.keys()):
        if gv.name_hint.startswith(KERNEL):
            fused[gv] = add_rms_norm(64, "float32", "float32", EPS, gpu=False)
    fused = relax.transform.DeadCodeElimination()(fused)
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((1, 3, 64)).astype(np.float32) for _ in range(2)]
    inputs += [rng.standard_normal(64).astype(np.float32) for _ in range(2)]
    for want, got in zip(_run_on_llvm(mod, inputs), _run_on_llvm(fused, inputs), strict=True):
        assert _rel(got, want) <= TOL


def test_build_verification_runs_it_against_its_llvm_variant():
    """The android-adreno build's PoCL check (verify/execution.py) runs the thread-bound kernel against its LLVM
    variant, both outputs."""
    from pipeline.verify.execution import run_kernel
    from pipeline.verify.opencl import find_opencl_device

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)")
    func = add_rms_norm(576, "float32", "float32", EPS)
    verdict = run_kernel(KERNEL, func, tvm.target.Target(ADRENO_TARGET), ("fallback",))
    assert "its LLVM variant the reference, matches LLVM" in verdict, verdict
