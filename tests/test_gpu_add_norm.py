"""Our GPU RMSNorm kernels (pipeline/kernels/gpu/norm_rows.py) and their Relax rewrite (kernels/gpu/add_norm.py):
the kernels on PoCL (fp32 twin) and under Oclgrind against float64 numpy, their launches (>= 48 work-groups at
one token), the rewrite on Relax functions run by LLVM against the unfused function, and the build's PoCL check.
Tolerance 1e-5 of the output scale (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from pipeline.kernels.gpu.add_norm import KERNEL, PLAIN, cpu_variant, fuse_add_rms_norm
from pipeline.kernels.gpu.norm_rows import FILL_GROUPS, NormSpec, groups_per_row, norm_kernel, threads_for
from pipeline.report.gpu_cost import launches
from pipeline.verify.opencl_plan import ADRENO_TARGET, opencl_kernels

TOL = 1e-5
EPS = 1e-5


def _spec(h: int, residual: bool = True, heads: int = 1, offset: float | None = None, l2: bool = False) -> NormSpec:
    return NormSpec(h=h, dtype="float32", w_dtype="float32", eps=EPS, residual=residual, heads=heads, offset=offset,
                    l2=l2)


def _case(spec: NormSpec, rows: int, seed: int = 0):
    """The kernel's arguments and float64 numpy's outputs (the sum for a residual kernel, then the norm; an L2
    norm: x / sqrt(sum(x^2) + eps), as the Gated DeltaNet's q / k, with no weight argument)."""
    rng = np.random.default_rng(seed)
    shape = (1, rows, spec.h) if spec.heads == 1 else (1, rows, spec.heads, spec.h)
    ins = [rng.standard_normal(shape).astype(np.float32) for _ in range(2 if spec.residual else 1)]
    w = rng.standard_normal(spec.h).astype(np.float32)
    s = ins[0].astype(np.float64) + (ins[1] if spec.residual else 0)
    if spec.l2:
        outs = [np.zeros_like(ins[0])]
        return [*ins, *outs], [s / np.sqrt((s * s).sum(-1, keepdims=True) + EPS)]
    ref = s / np.sqrt((s * s).mean(-1, keepdims=True) + EPS) * (w + (spec.offset or 0.0))
    outs = [np.zeros_like(ins[0]) for _ in spec.outputs()]
    return [*ins, w, *outs], ([s] if spec.residual else []) + [ref]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) / float(np.abs(want).max())


# (spec, rows): SmolLM2's hidden size (a decode row, a prefill chunk of 7), qwen27b's (5120, its zero-centred
# norm with and without the residual add), its per-head q / k norms (24 / 4 heads of 256), 64 rows (one group
# each), its Gated DeltaNet's L2-normalised q and k together (2 x 16 heads of 128; a tiny config's 2 x 2 of 16)
CASES = [(_spec(576), 1), (_spec(576), 7), (_spec(5120, offset=1.0), 1), (_spec(5120), 7),
         (_spec(576, residual=False), 1), (_spec(5120, residual=False, offset=1.0), 7),
         (_spec(256, residual=False, heads=4, offset=1.0), 1), (_spec(256, residual=False, heads=24, offset=1.0), 1),
         (_spec(576), 64), (_spec(128, residual=False, heads=32, l2=True), 1),
         (_spec(16, residual=False, heads=4, l2=True), 5)]


@pytest.mark.parametrize("spec,rows", CASES, ids=lambda v: str(v) if isinstance(v, int) else
                         f"{'add+' if v.residual else ''}{'l2:' if v.l2 else ''}{v.heads}x{v.h}"
                         f"{'+1' if v.offset else ''}")
def test_norm_kernels_on_pocl(spec, rows):
    """Each row split over ceil(48 / rows) work-groups (one from 48 rows up), one barrier, float sums; every
    output matches numpy, and so does the kernel's LLVM variant."""
    from pipeline.verify.opencl import find_opencl_device, run_on_llvm, run_on_pocl

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)")
    func = norm_kernel(spec).with_attr("global_symbol", "main")
    total = rows * spec.heads
    groups = groups_per_row(spec, total)
    assert launches(func, {"seq_len": rows}) == [(total * groups, threads_for(spec.h))]
    assert total * groups >= FILL_GROUPS and (groups == 1) == (total >= FILL_GROUPS)
    program = opencl_kernels(tvm.IRModule({"main": func}), ADRENO_TARGET)
    assert program.source.count("barrier(") == 1
    args, want = _case(spec, rows)
    got = run_on_pocl(program, "main", [x.copy() for x in args])
    cpu = run_on_llvm(norm_kernel(spec, gpu=False).with_attr("global_symbol", "main"), [x.copy() for x in args])
    for i, ref in zip(spec.outputs(), want, strict=True):
        assert _rel(got[i], ref) <= TOL and _rel(cpu[i], ref) <= TOL, i


@pytest.mark.parametrize("spec", [_spec(576, offset=1.0), _spec(576, residual=False)], ids=["add", "plain"])
def test_one_token_launch_fills_the_gpu_with_float_sums(spec):
    """The emitted OpenCL C of a one-token call: 48 work-groups (the launch's grid, the group count a kernel
    argument the host computes from the row count), and the sums of squares and the scale in `float`."""
    func = norm_kernel(spec).with_attr("global_symbol", "main")
    assert launches(func, {"seq_len": 1}) == [(48, 64)]
    program = opencl_kernels(tvm.IRModule({"main": func}), ADRENO_TARGET)
    (launch,) = program.launches("main")
    assert "block=(64, 1, 1)" in launch.describe()
    assert "float acc_ptr[2];" in program.source and "__local float part_ptr[64];" in program.source
    assert "float vals_ptr[9];" in program.source


def test_norm_kernels_are_clean_under_oclgrind():
    """One token of SmolLM2's add + norm (48 work-groups writing slices of one row), 3 tokens of qwen27b-style
    per-head zero-centred norms and one token of its GDN q / k L2 norm: no race, out-of-bounds or uninitialised-value report, numpy's results."""
    from pipeline.verify.oclgrind import oclgrind_library, run_under_oclgrind

    if oclgrind_library() is None:
        pytest.skip("oclgrind not installed (`make system-deps`)")
    specs = {"add_norm": (_spec(576), 1), "head_norm": (_spec(256, residual=False, heads=4, offset=1.0), 3),
             "l2_norm": (_spec(128, residual=False, heads=32, l2=True), 1)}
    funcs = {n: norm_kernel(s).with_attr("global_symbol", n) for n, (s, _) in specs.items()}
    cases = {n: _case(s, rows) for n, (s, rows) in specs.items()}
    run = run_under_oclgrind(tvm.IRModule(funcs), ADRENO_TARGET, {n: c[0] for n, c in cases.items()})
    assert not run.failed, run.first
    for name, (spec, _) in specs.items():
        assert run.total(name) == 0 and name not in run.unchecked, run.first
        for i, ref in zip(spec.outputs(), cases[name][1], strict=True):
            assert _rel(run.outputs[name][i], ref) <= TOL


def _block_module(h: int = 64, zero_centred: bool = False):
    """n0 = rms_norm(x, w0); x1 = x + y; n1 = rms_norm(x1, w1); x2 = x1 + n1 * 2; n2 = rms_norm(x2, w2), and a
    per-head norm of n2 as [1, n, 4, h / 4]: a first input norm, two layer boundaries whose sums feed both a norm
    and the next add, a q / k norm; zero_centred: every weight w used as w + 1 (Qwen3.5), legalized like the
    model."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    ty = relax.TensorType((1, n, h), "float32")
    x, y = relax.Var("x", ty), relax.Var("y", ty)
    ws = [relax.Var(f"w{i}", relax.TensorType((h,), "float32")) for i in range(3)]
    wq = relax.Var("wq", relax.TensorType((h // 4,), "float32"))

    def norm(v, w):
        w = relax.op.add(w, relax.const(1.0, "float32")) if zero_centred else w
        return relax.op.nn.rms_norm(v, w, axes=[-1], epsilon=EPS)

    with bb.function("main", [x, y, *ws, wq]):
        with bb.dataflow():
            n0 = bb.emit(norm(x, ws[0]))
            x1 = bb.emit(relax.op.add(x, y))
            n1 = bb.emit(norm(x1, ws[1]))
            x2 = bb.emit(relax.op.add(x1, relax.op.multiply(n1, relax.const(2.0, "float32"))))
            n2 = bb.emit(norm(x2, ws[2]))
            heads = bb.emit(norm(relax.op.reshape(n2, (1, n, 4, h // 4)), wq))
            out = bb.emit_output(relax.Tuple([n0, x2, n2, heads]))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def _run_on_llvm(mod, inputs):
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in inputs])]


@pytest.mark.parametrize("zero_centred", [False, True], ids=["rms_norm", "zero_centred"])
def test_rewrite_fuses_each_boundary_and_keeps_the_results(zero_centred):
    """Under an OpenCL target both add + rms_norm pairs become fused_add_rms_norm calls (the sum still feeds the
    next add, the weight's `+ 1` in the kernel), the first norm and the per-head norm rms_norm_split calls, no
    other add or norm left; with the kernels' LLVM variants in their place the function gives the unfused one's
    results."""
    mod = _block_module(zero_centred=zero_centred)
    with tvm.target.Target(ADRENO_TARGET):
        fused = relax.transform.DeadCodeElimination()(fuse_add_rms_norm(mod))
    calls = [line.split("R.call_tir(")[1].split(",")[0] for line in fused["main"].script().splitlines()
             if "R.call_tir" in line]
    assert sum(c.startswith(KERNEL) for c in calls) == 2 and sum(c.startswith(PLAIN) for c in calls) == 2, calls
    assert not [c for c in calls if c.startswith("add") or c.startswith("rms_norm") and not c.startswith(PLAIN)], calls
    offsets = {gv.name_hint: f.attrs["pipeline.norm_rows"].get("offset") for gv, f in fused.functions_items()
               if gv.name_hint.startswith((KERNEL, PLAIN))}
    assert all((o == 1.0) if zero_centred else o is None for o in offsets.values()), offsets
    with tvm.target.Target("llvm"):
        assert fuse_add_rms_norm(mod).same_as(mod)            # CPU targets keep the pair
    for gv, func in list(fused.functions_items()):
        if cpu_variant(func) is not None:
            fused[gv] = cpu_variant(func)
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((1, 3, 64)).astype(np.float32) for _ in range(2)]
    inputs += [rng.standard_normal(64).astype(np.float32) for _ in range(3)] + [rng.standard_normal(16).astype(np.float32)]
    for want, got in zip(_run_on_llvm(mod, inputs), _run_on_llvm(fused, inputs), strict=True):
        assert _rel(got, want) <= TOL


@pytest.mark.parametrize("spec", [_spec(576), _spec(256, residual=False, heads=4, offset=1.0)], ids=["add", "heads"])
def test_build_verification_runs_it_against_its_llvm_variant(spec):
    """The android-adreno build's PoCL check (verify/execution.py) runs the thread-bound kernel against its LLVM
    variant, every output."""
    from pipeline.verify.execution import run_kernel
    from pipeline.verify.opencl import find_opencl_device

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)")
    verdict = run_kernel(KERNEL, norm_kernel(spec), tvm.target.Target(ADRENO_TARGET), ("fallback",))
    assert "its LLVM variant the reference, matches LLVM" in verdict, verdict
