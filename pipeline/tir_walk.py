"""Walking a TIR statement tree: shared by the kernel recognisers (kernels/cpu/recognize.py) and the GPU launch
cost of the coverage report (report/gpu_cost.py), which may not import each other."""

from __future__ import annotations

from collections.abc import Iterator

from tvm import tirx
from tvm.s_tir import SBlock, SBlockRealize


def statements(stmt: tirx.Stmt) -> Iterator[tirx.Stmt]:
    """Every statement under `stmt`, itself first, in program order (a block before its init, its init before
    its body)."""
    stack = [stmt]
    while stack:
        s = stack.pop()
        if s is None:
            continue
        yield s
        if isinstance(s, tirx.SeqStmt):
            children = list(s.seq)
        elif isinstance(s, SBlockRealize):
            children = [s.block]
        elif isinstance(s, SBlock):
            children = [s.init, s.body]
        elif isinstance(s, tirx.IfThenElse):
            children = [s.then_case, s.else_case]
        else:   # For, While, AttrStmt, ...: one body, or none (stores, bindings, allocations)
            children = [getattr(s, "body", None)]
        stack.extend(reversed(children))
