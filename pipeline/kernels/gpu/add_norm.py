"""Residual add + RMSNorm in one GPU launch, and every other RMSNorm on our row-splitting kernel.

After fusion, each layer boundary of a decoder is two kernels: `add` (the residual stream plus the attention
or MLP output) and `rms_norm` of that sum (FuseOps keeps them apart: the sum also feeds the next residual
add); Qwen3.5's zero-centred norm adds a third, `add` of 1 to the weight (its scale is 1 + w). dlight gives a
norm one work-group of 256 work-items per row and a 10-barrier local-memory tree. Here the pair (with its
weight's `+ 1`, when there is one) becomes one call of a kernel with two outputs, the sum (for the residual
stream) and the normalised sum, and every other norm (the first layer's input norm, per-head q / k norms)
one call of the plain kernel: both in norm_rows.py, whose launches fill the GPU at one token.

Recognised from the legalized TIR: TVM's `add` of two equal [1, n, H] tensors; its `rms_norm` over the last dim
of [1, n, H] or [1, n, heads, H], whose eps is read off `rsqrt(sum / H + eps)`; `add` of a float constant to a
[H] weight (`w + 1.0`). Anything else is left as it was.
"""

from __future__ import annotations

from dataclasses import replace

import tvm
from tvm import relax, tirx
from tvm.s_tir import SBlock

from pipeline.kernels.gpu.norm_rows import NormSpec, norm_kernel, spec_of
from pipeline.tir_walk import statements

GPU_KINDS = ("opencl", "metal")
KERNEL = "fused_add_rms_norm"    # the residual add + norm
PLAIN = "rms_norm_split"         # a norm alone


def cpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The LLVM variant of one of our GPU norm kernels (its reference in the build's PoCL check, its CPU form
    when pinned to the host), or None for any other function."""
    spec = spec_of(func)
    return None if spec is None else norm_kernel(spec, gpu=False)


def outputs(func: tirx.PrimFunc) -> list[int]:
    """The parameters one of our norm kernels writes (the sum and the normalised sum, or the norm)."""
    spec = spec_of(func)
    return [] if spec is None else spec.outputs()


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


def _unit_lead(shape: tuple) -> bool:
    return isinstance(shape[0], tirx.IntImm) and int(shape[0]) == 1


def is_residual_add(func: tirx.PrimFunc) -> bool:
    """TVM's legalized `add` of two [1, n, H] tensors of one dtype: one block storing a + b."""
    bufs = _static_row(func)
    if bufs is None or len(bufs) != 3 or len({b for b in bufs}) != 1 or len(bufs[0][0]) != 3 \
            or not _unit_lead(bufs[0][0]):
        return False
    blocks = _blocks(func)
    return len(blocks) == 1 and isinstance(blocks[0].body, tirx.BufferStore) and isinstance(blocks[0].body.value,
                                                                                            tirx.Add)


def weight_offset(func: tirx.PrimFunc) -> float | None:
    """c of TVM's legalized `add` of a float constant to a [H] tensor (`w + c`; Qwen3.5's norms: w + 1)."""
    bufs = _static_row(func)
    if bufs is None or len(bufs) != 2 or len(bufs[0][0]) != 1 or len({str(b) for b in bufs}) != 1:
        return None
    blocks = _blocks(func)
    if len(blocks) != 1 or not isinstance(blocks[0].body, tirx.BufferStore):
        return None
    v = blocks[0].body.value
    if not isinstance(v, tirx.Add):
        return None
    load, c = (v.a, v.b) if isinstance(v.b, tirx.FloatImm) else (v.b, v.a)
    loaded = getattr(load, "source", None)   # TVM 0.27's load of a tensor: its `source`, the parameter
    if isinstance(c, tirx.FloatImm) and loaded is not None and loaded.same_as(func.params[0]):
        return float(c.value)
    return None


def rms_norm_eps(func: tirx.PrimFunc) -> float | None:
    """eps of TVM's legalized `rms_norm` over the last dim of [1, n, H] or [1, n, heads, H] (weight [H]), from
    rsqrt(sum / H + eps)."""
    bufs = _static_row(func)
    if bufs is None or len(bufs) != 3 or len(bufs[0][0]) not in (3, 4) or len(bufs[1][0]) != 1 \
            or not _unit_lead(bufs[0][0]) or len(bufs[2][0]) != len(bufs[0][0]):
        return None
    if len(bufs[0][0]) == 4 and not isinstance(bufs[0][0][2], tirx.IntImm):
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


def _weight(w, bound: dict, mod: tvm.IRModule) -> tuple:
    """(stored weight, offset): the input of an `add` of a constant to it, or w itself and None."""
    add = _call_tir(bound.get(w), mod)
    if add is not None and add[0].startswith("add") and len(add[2]) == 1:
        offset = weight_offset(add[1])
        if offset is not None:
            return add[2][0], offset
    return w, None


def norm_calls(func: relax.Function, mod: tvm.IRModule) -> tuple[dict, dict]:
    """({add's var: (norm's var, NormSpec, a, b, w)}, {norm's var: (NormSpec, x, w)}): each `s = add(a, b);
    y = rms_norm(s, w)` of `func` whose weight is bound before the add (a parameter or an earlier binding; one
    norm per add), then every other recognised norm. w is the stored weight, the spec's offset its `+ c`."""
    bound: dict = {}
    order: dict = {}
    pairs: dict = {}
    solos: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            order[binding.var] = len(order)
            bound[binding.var] = binding.value
            norm = _call_tir(binding.value, mod)
            if norm is None or not norm[0].startswith("rms_norm") or len(norm[2]) != 2 \
                    or not isinstance(binding.var, relax.DataflowVar):
                continue
            eps = rms_norm_eps(norm[1])
            if eps is None:
                continue
            s, w = norm[2]
            w, offset = _weight(w, bound, mod)
            x_ty = binding.var.ty
            spec = NormSpec(h=int(x_ty.shape[-1]), dtype=str(x_ty.dtype), w_dtype=str(w.ty.dtype), eps=eps,
                            heads=int(x_ty.shape[2]) if len(x_ty.shape) == 4 else 1, offset=offset)
            add = _call_tir(bound.get(s), mod)
            if add is not None and add[0].startswith("add") and s not in pairs and isinstance(s, relax.DataflowVar) \
                    and spec.heads == 1 and order.get(w, -1) < order[s] and is_residual_add(add[1]):
                a, b = add[2]
                pairs[s] = (binding.var, replace(spec, residual=True), a, b, w)
            else:
                solos[binding.var] = (spec, s, w)
    return pairs, solos


@relax.expr_functor.mutator
class _FuseAddNorm(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod_ = mod
        self.kernels: dict = {}
        self.pairs: dict = {}
        self.solos: dict = {}
        self.norm_values: dict = {}

    def run(self) -> tvm.IRModule:
        for gv, func in self.mod_.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                self.pairs, self.solos = norm_calls(func, self.mod_)
                if self.pairs or self.solos:
                    self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def _kernel(self, spec: NormSpec):
        if spec not in self.kernels:
            name = KERNEL if spec.residual else PLAIN
            self.kernels[spec] = self.builder_.add_func(norm_kernel(spec).with_attr("mlp.kernel", name), name)
        return self.kernels[spec]

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.pairs:
            norm_var, spec, a, b, w = self.pairs[binding.var]
            args = relax.Tuple([self.visit_expr(x) for x in (a, b, w)])
            s_ty = binding.var.ty
            both = self.builder_.emit(relax.call_tir(self._kernel(spec), args, [s_ty, s_ty]))
            self.set_var_remap(binding.var, self.builder_.emit(relax.TupleGetItem(both, 0)))
            self.norm_values[norm_var] = self.builder_.emit(relax.TupleGetItem(both, 1))
            return
        if binding.var in self.norm_values:
            self.set_var_remap(binding.var, self.norm_values[binding.var])
            return
        if binding.var in self.solos:
            spec, x, w = self.solos[binding.var]
            args = relax.Tuple([self.visit_expr(x), self.visit_expr(w)])
            self.set_var_remap(binding.var, self.builder_.emit(relax.call_tir(self._kernel(spec), args,
                                                                             binding.var.ty)))
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="FuseAddRMSNormGPU")
def fuse_add_rms_norm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """On OpenCL / Metal targets, each residual add whose sum is RMS-normalised becomes one fused_add_rms_norm
    call with both outputs, every other recognised RMSNorm one rms_norm_split call (module docstring)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name not in GPU_KINDS:
        return mod
    return _FuseAddNorm(mod).run()
