"""Residual add + RMSNorm in one GPU launch, at every layer boundary.

After fusion, each layer boundary of a decoder is two kernels: `add` (the residual stream plus the attention
or MLP output) and `rms_norm` of that sum (FuseOps keeps them apart: the sum also feeds the next residual
add). dlight gives the norm one work-group of 256 work-items and a 10-barrier local-memory tree. Here the
pair becomes one call of a kernel with two outputs, the sum (for the residual stream) and the normalised
sum: one work-group per token row, each work-item adding, storing and squaring H / THREADS elements in
float registers, one barrier, then every work-item adds the THREADS partial sums of squares from local
memory in the same order (fp32) and writes its normalised elements. The sum is rounded to the stream's
dtype before it is squared, as the unfused pair computes it.

Recognised from the legalized TIR (TVM's `add` of two equal tensors; its `rms_norm`, whose eps is read off
`rsqrt(sum / H + eps)`); anything else is left as it was.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.s_tir import SBlock
from tvm.script import tirx as T

from pipeline.tir_walk import statements

GPU_KINDS = ("opencl", "metal")
KERNEL = "fused_add_rms_norm"
PLAN_ATTR = "pipeline.gpu_plan"   # the launch, for the coverage report's cost columns (report/gpu_cost.py)
SHAPE_ATTR = "pipeline.add_norm"  # (h, dtype, w_dtype, eps): enough to make the kernel's LLVM variant
OUTPUTS = (3, 4)                  # the parameters it writes: the sum and the normalised sum


def threads_for(h: int) -> int:
    """Work-items per row: one 64-wide wave up to 2048 elements (SmolLM2's 576: 9 each), 256 above."""
    return 64 if h <= 2048 else 256


def add_rms_norm(h: int, dtype: str, w_dtype: str, eps: float, gpu: bool = True):
    """(a, b, w) -> (a + b, rms_norm(a + b) * w) over rows of h, rows symbolic. gpu=False: the same arithmetic
    in plain serial loops, for LLVM (the reference of the GPU kernel)."""
    threads = threads_for(h)
    per = -(-h // threads)

    @T.prim_func(s_tir=True)
    def fused_add_rms_norm_gpu(a_h: T.handle, b_h: T.handle, w_h: T.handle, sum_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        seq_len = T.int64()
        a = T.match_buffer(a_h, (T.int64(1), seq_len, T.int64(h)), dtype)
        b = T.match_buffer(b_h, (T.int64(1), seq_len, T.int64(h)), dtype)
        w = T.match_buffer(w_h, (T.int64(h),), w_dtype)
        total = T.match_buffer(sum_h, (T.int64(1), seq_len, T.int64(h)), dtype)
        out = T.match_buffer(out_h, (T.int64(1), seq_len, T.int64(h)), dtype)
        for row in T.thread_binding(seq_len, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("add_rms_norm"):
                    part = T.sblock_alloc_buffer((threads,), "float32", scope="shared")
                    vals = T.sblock_alloc_buffer((per,), "float32", scope="local")
                    acc = T.sblock_alloc_buffer((2,), "float32", scope="local")   # sum of squares, then scale
                    acc[0] = T.float32(0)
                    for i in range(per):
                        if i * threads + tx < h:
                            vals[i] = T.Cast("float32", T.Cast(dtype, T.Cast("float32", a[0, row, i * threads + tx])
                                                               + T.Cast("float32", b[0, row, i * threads + tx])))
                            total[0, row, i * threads + tx] = T.Cast(dtype, vals[i])
                            acc[0] = acc[0] + vals[i] * vals[i]
                    part[tx] = acc[0]
                    T.tvm_storage_sync("shared")
                    acc[1] = T.float32(0)
                    for j in range(threads):
                        acc[1] = acc[1] + part[j]
                    acc[1] = T.rsqrt(acc[1] / T.float32(h) + T.float32(eps))
                    for i in range(per):
                        if i * threads + tx < h:
                            out[0, row, i * threads + tx] = T.Cast(
                                dtype, acc[1] * vals[i] * T.Cast("float32", w[i * threads + tx]))

    @T.prim_func(s_tir=True)
    def fused_add_rms_norm_cpu(a_h: T.handle, b_h: T.handle, w_h: T.handle, sum_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        seq_len = T.int64()
        a = T.match_buffer(a_h, (T.int64(1), seq_len, T.int64(h)), dtype)
        b = T.match_buffer(b_h, (T.int64(1), seq_len, T.int64(h)), dtype)
        w = T.match_buffer(w_h, (T.int64(h),), w_dtype)
        total = T.match_buffer(sum_h, (T.int64(1), seq_len, T.int64(h)), dtype)
        out = T.match_buffer(out_h, (T.int64(1), seq_len, T.int64(h)), dtype)
        ss = T.alloc_buffer((1,), "float32")
        for row in range(seq_len):
            ss[0] = T.float32(0)
            for c in range(h):
                total[0, row, c] = T.Cast(dtype, T.Cast("float32", a[0, row, c]) + T.Cast("float32", b[0, row, c]))
                ss[0] = ss[0] + T.Cast("float32", total[0, row, c]) * T.Cast("float32", total[0, row, c])
            ss[0] = T.rsqrt(ss[0] / T.float32(h) + T.float32(eps))
            for c in range(h):
                out[0, row, c] = T.Cast(dtype, ss[0] * T.Cast("float32", total[0, row, c]) * T.Cast("float32", w[c]))

    if not gpu:
        return fused_add_rms_norm_cpu
    plan = {"work_groups": "one per token", "work_items": threads, "barriers": 1}
    shape = {"h": h, "dtype": dtype, "w_dtype": w_dtype, "eps": eps}
    return fused_add_rms_norm_gpu.with_attr(PLAN_ATTR, plan).with_attr(SHAPE_ATTR, shape)


def cpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The LLVM variant of a GPU fused_add_rms_norm (its reference in the build's PoCL check), or None for any
    other function."""
    shape = func.attrs.get(SHAPE_ATTR) if func.attrs else None
    if shape is None:
        return None
    return add_rms_norm(int(shape["h"]), str(shape["dtype"]), str(shape["w_dtype"]), float(shape["eps"]), gpu=False)


# ------------------------------------------------------------------ recognising the pair
def _static_row(func: tirx.PrimFunc) -> list[tuple[tuple, str]] | None:
    """[(shape, dtype)] of the buffer parameters when every one has a static last dim."""
    out = []
    for buf in func.params:
        if not hasattr(buf, "shape") or not buf.shape or not isinstance(buf.shape[-1], tirx.IntImm):
            return None
        out.append((tuple(buf.shape), str(buf.dtype)))
    return out


def _blocks(func: tirx.PrimFunc) -> list[SBlock]:
    return [s for s in statements(func.body) if isinstance(s, SBlock) and s.name_hint != "root"]


def is_residual_add(func: tirx.PrimFunc) -> bool:
    """TVM's legalized `add` of two [1, n, H] tensors of one dtype: one block storing a + b."""
    bufs = _static_row(func)
    if bufs is None or len(bufs) != 3 or len({b for b in bufs}) != 1 or len(bufs[0][0]) != 3:
        return False
    blocks = _blocks(func)
    return len(blocks) == 1 and isinstance(blocks[0].body, tirx.BufferStore) and isinstance(blocks[0].body.value,
                                                                                            tirx.Add)


def rms_norm_eps(func: tirx.PrimFunc) -> float | None:
    """eps of TVM's legalized `rms_norm` over the last dim ([1, n, H], weight [H]), from rsqrt(sum / H + eps)."""
    bufs = _static_row(func)
    if bufs is None or len(bufs) != 3 or len(bufs[0][0]) != 3 or len(bufs[1][0]) != 1:
        return None
    h = int(bufs[0][0][-1])
    for block in _blocks(func):
        v = block.body.value if isinstance(block.body, tirx.BufferStore) else None
        if isinstance(v, tvm.ir.Call) and v.op.name == "tirx.rsqrt" and isinstance(v.args[0], tirx.Add):
            mean, eps = v.args[0].a, v.args[0].b
            if isinstance(mean, tirx.Div) and isinstance(mean.b, tirx.FloatImm) and int(mean.b.value) == h \
                    and isinstance(eps, tirx.FloatImm):
                return float(eps.value)
    return None


def _call_tir(expr, mod: tvm.IRModule) -> tuple[str, tirx.PrimFunc, list] | None:
    if not (isinstance(expr, relax.Call) and expr.op.name == "relax.call_tir"):
        return None
    gv = expr.args[0]
    func = mod[gv] if gv in mod.functions else None
    if not isinstance(func, tirx.PrimFunc) or not isinstance(expr.args[1], relax.Tuple):
        return None
    return gv.name_hint, func, list(expr.args[1].fields)


def fusable_pairs(func: relax.Function, mod: tvm.IRModule) -> dict:
    """{add's var: (norm's var, eps, norm's weight)} for each `s = add(a, b); y = rms_norm(s, w)` of `func`
    whose weight is bound before the add (a parameter or an earlier binding); one norm per add."""
    bound: dict = {}
    order: dict = {}
    pairs: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            order[binding.var] = len(order)
            bound[binding.var] = binding.value
            norm = _call_tir(binding.value, mod)
            if norm is None or not norm[0].startswith("rms_norm") or len(norm[2]) != 2:
                continue
            s, w = norm[2]
            add = _call_tir(bound.get(s), mod)
            if add is None or not add[0].startswith("add") or s in pairs or not isinstance(s, relax.DataflowVar) \
                    or not isinstance(binding.var, relax.DataflowVar) or order.get(w, -1) > order[s]:
                continue
            eps = rms_norm_eps(norm[1])
            if eps is not None and is_residual_add(add[1]):
                pairs[s] = (binding.var, eps, w)
    return pairs


@relax.expr_functor.mutator
class _FuseAddNorm(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod_ = mod
        self.kernels: dict = {}
        self.pairs: dict = {}
        self.norm_values: dict = {}

    def run(self) -> tvm.IRModule:
        for gv, func in self.mod_.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                self.pairs = fusable_pairs(func, self.mod_)
                if self.pairs:
                    self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def _kernel(self, s_ty, w_ty, eps: float):
        h, dtype, w_dtype = int(s_ty.shape[-1]), str(s_ty.dtype), str(w_ty.dtype)
        key = (h, dtype, w_dtype, eps)
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(
                add_rms_norm(h, dtype, w_dtype, eps).with_attr("mlp.kernel", KERNEL), KERNEL)
        return self.kernels[key]

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.pairs:
            norm_var, eps, w = self.pairs[binding.var]
            a, b = (self.visit_expr(x) for x in binding.value.args[1].fields)
            w = self.visit_expr(w)
            s_ty = binding.var.ty
            gv = self._kernel(s_ty, w.ty, eps)
            both = self.builder_.emit(relax.call_tir(gv, relax.Tuple([a, b, w]), [s_ty, s_ty]))
            self.set_var_remap(binding.var, self.builder_.emit(relax.TupleGetItem(both, 0)))
            self.norm_values[norm_var] = self.builder_.emit(relax.TupleGetItem(both, 1))
            return
        if binding.var in self.norm_values:
            self.set_var_remap(binding.var, self.norm_values[binding.var])
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="FuseAddRMSNormGPU")
def fuse_add_rms_norm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """On OpenCL / Metal targets, each residual add whose sum is RMS-normalised becomes one fused_add_rms_norm
    call with both outputs (module docstring)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name not in GPU_KINDS:
        return mod
    return _FuseAddNorm(mod).run()
