"""One parallel region per run of CPU kernels in a decode step.

The kernels between two KV-cache calls (o_proj, residual add, RMSNorm, gate_up, SiLU * up, down, add, the
next layer's RMSNorm and QKV: 11 calls per layer) become one kernel whose threads meet at barriers instead
of returning to the VM after each: a decode step makes ~2 library calls per layer instead of ~12.

Why: in a bandwidth-bound decode step the time between kernels has no weights in flight, and after every
weight stream (more than the L3) the VM's code and data are cold. Inside one parallel launch the next
kernel starts right after a spinning barrier, with nothing of the host in between.

How: each kernel's top-level statements are either parallel loops (kept as they are) or serial work (run
by task 0 only); a barrier follows each stretch. The buffers the kernels allocate at their top level, and
every tensor passed from one kernel of the run to the next, are allocated once before the launch and
shared by the threads. Only `call_tir`s with static shapes, of kernels whose parallel loops are all at
their top level and whose other top-level statements are plain loops / stores / conditions, are merged;
anything else ends the run. The kernels' code is unchanged, so the results are bit-identical.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax, tirx
from tvm.s_tir import SBlockRealize, renew_defs

from pipeline.kernels.cpu.recognize import statements

LAUNCH = "pragma_parallel_launch_point"        # TVM's CPU codegen: one thread-pool launch for the body
BARRIER = "pragma_parallel_barrier_when_finish"  # ... and all tasks wait here after the statement
DECODE_FUNCTIONS = ("decode", "decode_greedy")  # static shapes: one token
CALL_TIR = tvm.ir.Op.get("relax.call_tir")
RESHAPE = tvm.ir.Op.get("relax.reshape")        # after RewriteDataflowReshape: a view, no copy
# serial statements that can move into task 0's branch without changing what later statements see
_SERIAL_OK = (tirx.For, tirx.BufferStore, tirx.IfThenElse, tirx.Evaluate, SBlockRealize)


def _flatten(stmt: tirx.Stmt) -> list[tirx.Stmt]:
    return [s for part in stmt.seq for s in _flatten(part)] if isinstance(stmt, tirx.SeqStmt) else [stmt]


def _seq(stmts: list[tirx.Stmt]) -> tirx.Stmt:
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def _has_parallel(stmt: tirx.Stmt) -> bool:
    """Whether a parallel loop sits anywhere in `stmt`."""
    return any(_is_parallel(s) for s in statements(stmt))


def _is_parallel(stmt: tirx.Stmt) -> bool:
    return isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.PARALLEL


def split_kernel(func: tirx.PrimFunc) -> tuple[list[Any], list[tirx.Stmt]] | None:
    """(buffers the kernel allocates at its top level, its other top-level statements), or None when the
    kernel cannot join a shared launch (a parallel loop below the top level, a top-level binding)."""
    body, allocs = func.body, []
    if isinstance(body, SBlockRealize):
        block = body.block
        if block.match_buffers or block.init is not None or block.iter_vars:
            return None
        allocs += list(block.alloc_buffers)
        body = block.body
    stmts = []
    for stmt in _flatten(body):
        if isinstance(stmt, tirx.AllocBuffer):
            allocs.append(stmt.buffer)
        elif _is_parallel(stmt) and not _has_parallel(stmt.body):
            stmts.append(stmt)
        elif isinstance(stmt, _SERIAL_OK) and not _is_parallel(stmt) and not _has_parallel(stmt):
            stmts.append(stmt)
        else:
            return None
    return allocs, stmts


def _static_shape(ty) -> tuple[int, ...] | None:
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = ty.shape.values
    return tuple(int(d) for d in dims) if all(isinstance(d, tirx.IntImm) for d in dims) else None


def _buffer(ty: relax.TensorType, name: str):
    """A buffer for a static-shape Relax tensor, with the int64 dims of Relax's kernels."""
    return tirx.decl_buffer([tirx.IntImm("int64", d) for d in _static_shape(ty)], ty.dtype, name)


def _barriered(stmts: list[tirx.Stmt]) -> list[tirx.Stmt]:
    """Parallel loops as they are, each stretch of serial statements in task 0's branch of a 2-task loop
    (any pool size: the loop's first iteration runs once), a barrier after each."""
    out, serial = [], []

    def flush():
        if serial:
            task = tirx.Var("serial_task", "int32")
            body = _seq(list(serial))
            out.append(tirx.For(task, 0, 2, tirx.ForKind.PARALLEL, tirx.IfThenElse(task == 0, body, None)))
            serial.clear()

    for stmt in stmts:
        if _is_parallel(stmt):
            flush()
            out.append(stmt)
        else:
            serial.append(stmt)
    flush()
    return [tirx.AttrStmt(0, BARRIER, 1, s) for s in out]


def _is_view(b) -> bool:
    return isinstance(b.value, relax.Call) and b.value.op == RESHAPE


class Run:
    """Consecutive bindings of a dataflow block: `call_tir`s, the `TupleGetItem`s that pick outputs of a
    multi-output one and reshapes (views: inside the region a buffer on the same memory). A tensor is named
    by its slot: a tensor call's var, (tuple var, index), or a view's var."""

    def __init__(self, bindings: list[relax.VarBinding], uses: dict):
        self.calls = [b for b in bindings if isinstance(b.value, relax.Call) and b.value.op == CALL_TIR]
        self.alias = {b.var: (b.value.tuple_value, b.value.index) for b in bindings
                      if isinstance(b.value, relax.TupleGetItem)}
        self.views = {b.var: b.value.args[0] for b in bindings if _is_view(b)}   # view -> what it reshapes
        self.types: dict = {}         # slot -> TensorType, in the order made
        for b in self.calls:
            ty = b.var.ty
            fields = ty.fields if isinstance(ty, relax.TupleType) else None
            self.types.update({(b.var, i): f for i, f in enumerate(fields)} if fields else {b.var: ty})
        inside: dict = {}
        for b in bindings:
            for ref in self.references(b):
                inside[ref] = inside.get(ref, 0) + 1
        outside = {v for v in [*(b.var for b in bindings)]
                   if uses.get(v, 0) > inside.get(v, 0) or not isinstance(v, relax.DataflowVar)}
        self.public: dict = {}        # slot -> the vars the rest of the function reads it by
        self.rebuilt: dict = {}       # a multi-output kernel's tuple read after the run -> its fields' vars
        self.reviewed: list = []      # (view read after the run, the tensor it views) -> reshaped again after
        self.inputs: list = []
        for b in bindings:
            for arg in self.references(b) if not isinstance(b.value, relax.TupleGetItem) else []:
                if not self.made(self.slot(arg)) and arg not in self.inputs:
                    self.inputs.append(arg)
        for v in (b.var for b in bindings if b.var in outside):   # binding order
            if isinstance(v.ty, relax.TupleType):     # handed back field by field, then made a tuple again
                self.rebuilt[v] = [relax.DataflowVar(f"{v.name}_{i}", f) for i, f in enumerate(v.ty.fields)]
                for i, field in enumerate(self.rebuilt[v]):
                    self.public.setdefault((v, i), []).append(field)
            elif v in self.views:
                self.reviewed.append((v, self.root(v)))
            else:
                self.public.setdefault(self.slot(v), []).append(v)
        for v, root in self.reviewed:                 # the viewed tensor must be handed back too
            if root in self.types and root not in self.public:
                self.public[root] = [relax.DataflowVar(f"{v.name}_base", self.types[root])]
        self.outputs = [slot for slot in self.types if slot in self.public]

    def made(self, slot) -> bool:
        return slot in self.types or slot in self.views

    def root(self, var):
        """The tensor a view (of a view ...) is a view of: a slot made in the run, or an input."""
        while var in self.views:
            var = self.slot(self.views[var])
        return var

    def after(self, slot):
        """The var the rest of the function reads a made slot or an input by."""
        return self.public[slot][0] if slot in self.public else slot

    @staticmethod
    def references(b: relax.VarBinding) -> list:
        if isinstance(b.value, relax.TupleGetItem):
            return [b.value.tuple_value]
        return [b.value.args[0]] if _is_view(b) else list(b.value.args[1].fields)

    def slot(self, var):
        return self.alias.get(var, var)

    def call_slots(self, b: relax.VarBinding) -> list:
        """A call's arguments then its outputs, as slots."""
        outs = [s for s in self.types if (s[0] if isinstance(s, tuple) else s).same_as(b.var)]
        return [self.slot(a) for a in b.value.args[1].fields] + outs

    def wiring(self) -> tuple:
        """What makes two runs the same kernel: the callees, which earlier tensor feeds each argument, the
        shapes, the outputs (the 30 layers of a model share one region kernel)."""
        number = {slot: ("in", i) for i, slot in enumerate(self.inputs)}
        number.update({slot: ("made", i) for i, slot in enumerate(self.types)})
        for i, (v, src) in enumerate(self.views.items()):
            number[v] = ("view", i, number[self.slot(src)], _static_shape(v.ty))
        key = tuple((b.value.args[0].name_hint, tuple(number[s] for s in self.call_slots(b)),
                     tuple(_static_shape(self._type(s)) for s in self.call_slots(b))) for b in self.calls)
        return key, tuple(number[s] for s in self.outputs)

    def _type(self, slot):
        return self.types.get(slot) or slot.ty


def merge_run(mod: tvm.IRModule, run: Run) -> tirx.PrimFunc:
    """One PrimFunc for a run; parameters: the run's inputs, then its outputs."""
    buffers = {v: _buffer(v.ty, f"in{i}") for i, v in enumerate(run.inputs)}
    buffers.update({slot: _buffer(ty, f"t{i}") for i, (slot, ty) in enumerate(run.types.items())})
    views = []
    for i, v in enumerate(run.views):     # binding order: a view's source has its buffer already
        base = buffers[run.slot(run.views[v])]
        buffers[v] = _buffer(v.ty, f"view{i}")
        views.append(tirx.DeclBuffer(buffers[v], data=base.data))
    allocs, stmts = [], []
    for b in run.calls:
        args = run.call_slots(b)
        callee = renew_defs(mod[b.value.args[0]])     # fresh vars and buffers for each use of a kernel
        shared = list({id(buffers[a]): buffers[a] for a in args}.values())
        # with the run's buffers as parameters too, specialize aliases each kernel parameter to one of them
        own_params = list(callee.params)
        callee = tirx.PrimFunc([*own_params, *shared], callee.body, attrs=callee.attrs)
        callee = callee.specialize({param: buffers[arg] for param, arg in zip(own_params, args, strict=True)})
        own, body = split_kernel(callee)
        allocs += own
        stmts += body
    allocs += [buffers[slot] for slot in run.types if slot not in run.public]
    body = _seq([*(tirx.AllocBuffer(buf) for buf in allocs), *views,
                 tirx.AttrStmt(0, LAUNCH, 1, _seq(_barriered(stmts)))])
    params = [buffers[v] for v in run.inputs + run.outputs]
    return tirx.PrimFunc(params, body).with_attrs({"tirx.noalias": True, "tirx.is_scheduled": True})


def _uses(func: relax.Function) -> dict:
    """Relax var -> its number of references in the bindings' values and the function's result."""
    counts: dict = {}

    def visit(expr):
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    for block in func.body.blocks:
        for binding in block.bindings:
            relax.analysis.post_order_visit(binding.value, visit)
    relax.analysis.post_order_visit(func.body.body, visit)
    return counts


def _int64_buffers(func: tirx.PrimFunc) -> bool:
    """Whether every parameter is a buffer with constant int64 dims, which the run's shared buffers have
    (specialize matches dims exactly; kernels built from int32-shaped compute stay separate calls)."""
    return all(isinstance(p.ty, tirx.BufferType)
               and all(isinstance(d, tirx.IntImm) and str(d.ty) == "int64" for d in p.shape) for p in func.params)


def _kernel_calls(blocks) -> int:
    return sum(1 for block in blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and b.value.op == CALL_TIR)


class _Merger:
    def __init__(self, mod: tvm.IRModule, min_run: int = 2, views: bool = True):
        self.mod, self.min_run, self.views = mod, min_run, views
        self.builder = relax.BlockBuilder(mod)
        self.kernels: dict[tuple, Any] = {}       # wiring -> GlobalVar of the region kernel
        self.members: dict[str, dict[str, Any]] = {}   # region kernel -> its kernels (in order), its calls
        self._splits: dict[str, bool] = {}
        self.calls: dict[str, dict[str, int]] = {}   # function -> kernel calls per step before / after

    def mergeable(self, binding, run: list) -> bool:
        value = getattr(binding, "value", None)
        if not isinstance(binding, relax.VarBinding):
            return False
        if isinstance(value, relax.TupleGetItem):        # an output of a multi-output kernel of the run
            return any(value.tuple_value.same_as(b.var) for b in run)
        if _is_view(binding):      # a view inside a run (one at its end is left out by `region`)
            return self.views and bool(run) and all(_static_shape(t) for t in (binding.var.ty, value.args[0].ty))
        if not isinstance(value, relax.Call) or value.op != CALL_TIR or len(value.args) != 2:
            return False      # (a call_tir with symbolic-shape arguments has a third: tir_vars)
        ty = binding.var.ty
        outs = ty.fields if isinstance(ty, relax.TupleType) else [ty]
        if not all(_static_shape(t) for t in [*outs, *(a.ty for a in value.args[1].fields)]):
            return False
        name = value.args[0].name_hint
        if name not in self._splits:
            func = self.mod[value.args[0]]
            self._splits[name] = (isinstance(func, tirx.PrimFunc) and _int64_buffers(func)
                                  and split_kernel(func) is not None)
        return self._splits[name]

    def region(self, bindings: list[relax.VarBinding], uses: dict, function: str) -> list[relax.VarBinding]:
        tail = []
        while bindings and _is_view(bindings[-1]):     # views after the run's last kernel stay outside
            tail.insert(0, bindings[-1])
            bindings = bindings[:-1]
        return self._region(bindings, uses, function) + tail

    def _region(self, bindings: list[relax.VarBinding], uses: dict, function: str) -> list[relax.VarBinding]:
        run = Run(bindings, uses)
        if len(run.calls) < self.min_run or not run.outputs:
            return bindings
        key = run.wiring()
        if key not in self.kernels:
            name = f"cpu_region{len(self.kernels)}"
            self.kernels[key] = self.builder.add_func(merge_run(self.mod, run), name)
            self.members[name] = {"kernels": [b.value.args[0].name_hint for b in run.calls], "calls": {},
                                  "views": len(run.views)}
        gv = self.kernels[key]
        calls = self.members[gv.name_hint]["calls"]
        calls[function] = calls.get(function, 0) + 1
        types = [run.types[slot] for slot in run.outputs]
        call = relax.call_tir(gv, relax.Tuple(run.inputs), types if len(types) > 1 else types[0])
        public = [(i, v) for i, slot in enumerate(run.outputs) for v in run.public[slot]]
        tuples = [relax.VarBinding(v, relax.Tuple(fields)) for v, fields in run.rebuilt.items()]
        tuples += [relax.VarBinding(v, relax.op.reshape(run.after(root), v.ty.shape))
                   for v, root in run.reviewed]
        if len(public) == 1:
            return [relax.VarBinding(public[0][1], call), *tuples]
        if len(types) == 1:
            call = relax.Tuple([call])             # one tensor read by two names
        tup = relax.DataflowVar(f"{gv.name_hint}_out", relax.TupleType(types))
        return [relax.VarBinding(tup, call), *(relax.VarBinding(v, relax.TupleGetItem(tup, i)) for i, v in public),
                *tuples]

    def function(self, name: str, func: relax.Function) -> relax.Function:
        uses = _uses(func)
        blocks = []
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                blocks.append(block)
                continue
            out, run = [], []
            for binding in [*block.bindings, None]:
                if binding is not None and self.mergeable(binding, run):
                    run.append(binding)
                    continue
                out += self.region(run, uses, name) if run else []
                run = []
                if binding is not None:
                    out.append(binding)
            blocks.append(relax.DataflowBlock(out))
        self.calls[name] = {"kernels": _kernel_calls(func.body.blocks), "calls": _kernel_calls(blocks)}
        return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                              func.attrs)


def merge_regions(mod: tvm.IRModule, functions: tuple[str, ...] = DECODE_FUNCTIONS, views: bool = True
                  ) -> tuple[tvm.IRModule, dict[str, Any]]:
    """The module with each run of mergeable kernels in `functions` replaced by one region kernel, and a
    summary for the coverage report: per region kernel the kernels it runs, its reshape views and its calls
    per step in each function, and per function its kernel calls per step before the merge (`kernels`) and after it
    (`calls`: regions and unmerged kernels)."""
    merger = _Merger(mod, views=views)
    for gv, func in list(mod.functions_items()):
        if gv.name_hint in functions and isinstance(func, relax.Function):
            merger.builder.update_func(gv, merger.function(gv.name_hint, func))
    summary = {"regions": merger.members, "calls_per_step": merger.calls}
    return merger.builder.get(), summary
