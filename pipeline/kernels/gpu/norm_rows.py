"""RMSNorm kernels that fill the GPU at one token: each row's outputs split over several work-groups.

A decode step normalises one row (or a few heads): one work-group per row left 47 of an Adreno 750's 48
work-group slots (4 per shader processor, 12 SPs) idle. Here a row gets G = ceil(48 / rows) work-groups
(capped at H; one per row from 48 rows up, a prompt), G decided at run time from the row count. Every
work-group of a row reads the whole row and computes its sum of squares itself: each work-item squares
H / THREADS elements in float registers, one barrier, then every work-item adds the THREADS partial sums from
local memory in the same order, so all G work-groups get the bit-identical fp32 scale with no second launch,
global atomics or inter-group sync. A work-group then writes only its slice of ceil(H / G) consecutive
outputs, from the values it holds in registers. The price is the re-read row: G - 1 extra reads of its inputs,
charged as bytes in the launch plan (`reread_bytes`, report/gpu_cost.py).

Variants (NormSpec): residual (a + b first, both the sum and its norm written, the sum rounded to the stream's
dtype before it is squared, as the unfused add and norm compute it) or plain; rows of a token ([1, n, H]) or
per-head rows ([1, n, heads, H]); the weight as stored or plus a constant added in the weight's dtype
(Qwen3.5's zero-centred norm scales by 1 + w); or an L2 norm, x * rsqrt(sum(x^2) + eps) with no weight (the Gated
DeltaNet's q / k, models/qwen3_5.py). gpu=False gives the same arithmetic in serial loops for LLVM:
the reference of the build's PoCL check and the CPU form of a kernel pinned to the host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tvm import tirx
from tvm.script import tirx as T

from pipeline.kernels.gpu import FILL_GROUPS

PLAN_ATTR = "pipeline.gpu_plan"   # the launch, for the coverage report's cost columns (report/gpu_cost.py)
SPEC_ATTR = "pipeline.norm_rows"  # the NormSpec: enough to make the kernel's LLVM variant


@dataclass(frozen=True)
class NormSpec:
    h: int                        # the normalised (last) dim
    dtype: str                    # the stream's dtype (inputs and outputs)
    w_dtype: str
    eps: float
    residual: bool = False        # (a, b, w) -> (a + b, norm(a + b)); else (x, w) -> norm(x)
    heads: int = 1                # rows per token: > 1 for a per-head norm over [1, n, heads, H]
    offset: float | None = None   # the weight is w + offset, added in w_dtype (zero-centred: 1.0)
    l2: bool = False              # x * rsqrt(sum(x^2) + eps), no weight (Gated DeltaNet's q / k): (x) -> norm(x)

    def outputs(self) -> list[int]:
        """The parameters the kernel writes."""
        return [3, 4] if self.residual else [1] if self.l2 else [2]


def threads_for(h: int) -> int:
    """Work-items per work-group: one 64-wide wave up to 2048 elements (SmolLM2's 576: 9 each), 256 above."""
    return 64 if h <= 2048 else 256


def groups_per_row(spec: NormSpec, rows: int) -> int:
    """Work-groups per row at `rows` rows (tokens x heads): enough for FILL_GROUPS in all, at most H."""
    return max(1, min(spec.h, -(-FILL_GROUPS // max(rows, 1))))


def plan(spec: NormSpec) -> dict:
    """The launch as the coverage report reads it, with the re-reads of a one-token call charged as bytes."""
    rows = spec.heads
    g = groups_per_row(spec, rows)
    row_in = spec.h * _itemsize(spec.dtype) * (2 if spec.residual else 1)
    return {"work_groups": f"ceil({FILL_GROUPS} / rows) per row, at most H: {g * rows} at one token",
            "work_items": threads_for(spec.h), "barriers": 1, "reread_bytes": (g - 1) * rows * row_in}


def _itemsize(dtype: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]


def norm_kernel(spec: NormSpec, gpu: bool = True) -> tirx.PrimFunc:
    """The kernel of `spec`, rows symbolic (module docstring); gpu=False: its serial LLVM variant."""
    # no global symbol: a module holds several of them (shapes, weight offsets), each under its own name
    func = (_residual if spec.residual else _plain)(spec, gpu).without_attr("global_symbol")
    if not gpu:
        return func
    return func.with_attr(PLAN_ATTR, plan(spec)).with_attr(SPEC_ATTR, {
        k: v for k, v in asdict(spec).items() if v is not None})


def spec_of(func: tirx.PrimFunc) -> NormSpec | None:
    """The NormSpec a GPU kernel of this module was made from, or None for any other function."""
    attr = func.attrs.get(SPEC_ATTR) if func.attrs else None
    if attr is None:
        return None
    return NormSpec(h=int(attr["h"]), dtype=str(attr["dtype"]), w_dtype=str(attr["w_dtype"]),
                    eps=float(attr["eps"]), residual=bool(attr["residual"]), heads=int(attr["heads"]),
                    offset=float(attr["offset"]) if "offset" in attr else None, l2=bool(attr.get("l2", False)))


# ------------------------------------------------------------------ index and weight helpers (TVMScript closures)
class _Rows:
    """Grid, slice and weight arithmetic of one spec, as TIR expressions of the symbolic token count n."""

    def __init__(self, spec: NormSpec):
        self.spec = spec

    def shape(self, n):
        s = self.spec
        lead = (T.int64(1), n) if s.heads == 1 else (T.int64(1), n, T.int64(s.heads))
        return (*lead, T.int64(s.h))

    def at(self, tok, head, c):
        """Buffer indices of element c of head `head` of token `tok`."""
        return (T.int64(0), tok, c) if self.spec.heads == 1 else (T.int64(0), tok, head, c)

    def tiers(self) -> list[tuple[int, int, int]]:
        """(most rows, work-groups per row, slice length) of each group count below FILL_GROUPS rows."""
        out: list[tuple[int, int, int]] = []
        for rows in range(1, FILL_GROUPS):
            g = groups_per_row(self.spec, rows)
            if out and out[-1][1] == g:
                out[-1] = (rows, g, out[-1][2])
            else:
                out.append((rows, g, -(-self.spec.h // g)))
        return out

    def _by_rows(self, n, pick: int, whole: int):
        """A tier's value at n tokens as a chain of comparisons of the row count: no division anywhere (the
        host's grid and the kernel agree; a division by a kernel argument made Oclgrind's clang emit `freeze`,
        which stops its uninitialised-value check)."""
        rows = n * self.spec.heads
        out = T.int64(whole)
        for tier in reversed(self.tiers()):
            out = T.Select(rows <= T.int64(tier[0]), T.int64(tier[pick]), out)
        return out

    def groups(self, n):
        """Work-groups per row (groups_per_row): 1 from FILL_GROUPS rows up."""
        return self._by_rows(n, 1, 1)

    def slice_len(self, n):
        """Outputs per work-group: ceil(H / groups); the whole row from FILL_GROUPS rows up."""
        return self._by_rows(n, 2, self.spec.h)

    def scale(self, sum_sq):
        """The row's fp32 scale from its sum of squares: rsqrt(mean + eps), or rsqrt(sum + eps) for an L2 norm."""
        s = self.spec
        return T.rsqrt((sum_sq if s.l2 else sum_sq / T.float32(s.h)) + T.float32(s.eps))

    def weight(self, w, c):
        s = self.spec
        if s.l2:
            return T.float32(1)
        if s.offset is None:
            return T.Cast("float32", w[c])
        return T.Cast("float32", w[c] + T.Cast(s.w_dtype, T.float32(s.offset)))


def _plain(spec: NormSpec, gpu: bool) -> tirx.PrimFunc:
    r = _Rows(spec)
    h, heads, dtype = spec.h, spec.heads, spec.dtype
    threads = threads_for(h)
    per = -(-h // threads)

    @T.macro
    def gpu_body(x, w, out, seq_len):
        for tok in T.thread_binding(seq_len, thread="blockIdx.z"):
            for head in T.thread_binding(heads, thread="blockIdx.y"):
                for g in T.thread_binding(r.groups(seq_len), thread="blockIdx.x"):
                    lo: T.int64 = g * r.slice_len(seq_len)
                    hi: T.int64 = lo + r.slice_len(seq_len)
                    for tx in T.thread_binding(threads, thread="threadIdx.x"):
                        with T.sblock("rms_norm"):
                            part = T.sblock_alloc_buffer((threads,), "float32", scope="shared")
                            vals = T.sblock_alloc_buffer((per,), "float32", scope="local")
                            acc = T.sblock_alloc_buffer((2,), "float32", scope="local")   # sum of squares, scale
                            acc[0] = T.float32(0)
                            for i in range(per):
                                if i * threads + tx < h:
                                    vals[i] = T.Cast("float32", x[r.at(tok, head, i * threads + tx)])
                                    acc[0] = acc[0] + vals[i] * vals[i]
                            part[tx] = acc[0]
                            T.tvm_storage_sync("shared")
                            acc[1] = T.float32(0)
                            for j in range(threads):
                                acc[1] = acc[1] + part[j]
                            acc[1] = r.scale(acc[1])
                            for i in range(per):
                                if i * threads + tx < h and lo <= T.Cast("int64", i * threads + tx) < hi:
                                    out[r.at(tok, head, i * threads + tx)] = T.Cast(
                                        dtype, acc[1] * vals[i] * r.weight(w, i * threads + tx))

    @T.macro
    def cpu_body(x, w, out, seq_len, ss):
        for tok, head in T.grid(seq_len, heads):
            ss[0] = T.float32(0)
            for c in range(h):
                ss[0] = ss[0] + T.Cast("float32", x[r.at(tok, head, c)]) * T.Cast("float32", x[r.at(tok, head, c)])
            ss[0] = r.scale(ss[0])
            for c in range(h):
                out[r.at(tok, head, c)] = T.Cast(dtype, ss[0] * T.Cast("float32", x[r.at(tok, head, c)])
                                                 * r.weight(w, c))

    if spec.l2:   # parsed only for its spec: r.weight never reads the stand-in buffer
        @T.prim_func(s_tir=True)
        def l2_norm_split_gpu(x_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            seq_len = T.int64()
            x = T.match_buffer(x_h, r.shape(seq_len), dtype)
            out = T.match_buffer(out_h, r.shape(seq_len), dtype)
            gpu_body(x, x, out, seq_len)   # no weight: r.weight is 1 (x stands in for the absent buffer)

        @T.prim_func(s_tir=True)
        def l2_norm_split_cpu(x_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            seq_len = T.int64()
            x = T.match_buffer(x_h, r.shape(seq_len), dtype)
            out = T.match_buffer(out_h, r.shape(seq_len), dtype)
            ss = T.alloc_buffer((1,), "float32")
            cpu_body(x, x, out, seq_len, ss)

        return l2_norm_split_gpu if gpu else l2_norm_split_cpu

    @T.prim_func(s_tir=True)
    def rms_norm_split_gpu(x_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        seq_len = T.int64()
        x = T.match_buffer(x_h, r.shape(seq_len), dtype)
        w = T.match_buffer(w_h, (T.int64(h),), spec.w_dtype)
        out = T.match_buffer(out_h, r.shape(seq_len), dtype)
        gpu_body(x, w, out, seq_len)

    @T.prim_func(s_tir=True)
    def rms_norm_split_cpu(x_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        seq_len = T.int64()
        x = T.match_buffer(x_h, r.shape(seq_len), dtype)
        w = T.match_buffer(w_h, (T.int64(h),), spec.w_dtype)
        out = T.match_buffer(out_h, r.shape(seq_len), dtype)
        ss = T.alloc_buffer((1,), "float32")
        cpu_body(x, w, out, seq_len, ss)

    return rms_norm_split_gpu if gpu else rms_norm_split_cpu


def _residual(spec: NormSpec, gpu: bool) -> tirx.PrimFunc:
    r = _Rows(spec)
    h, heads, dtype = spec.h, spec.heads, spec.dtype
    threads = threads_for(h)
    per = -(-h // threads)

    @T.prim_func(s_tir=True)
    def fused_add_rms_norm_gpu(a_h: T.handle, b_h: T.handle, w_h: T.handle, sum_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        seq_len = T.int64()
        a = T.match_buffer(a_h, r.shape(seq_len), dtype)
        b = T.match_buffer(b_h, r.shape(seq_len), dtype)
        w = T.match_buffer(w_h, (T.int64(h),), spec.w_dtype)
        total = T.match_buffer(sum_h, r.shape(seq_len), dtype)
        out = T.match_buffer(out_h, r.shape(seq_len), dtype)
        for tok in T.thread_binding(seq_len, thread="blockIdx.z"):
            for head in T.thread_binding(heads, thread="blockIdx.y"):
                for g in T.thread_binding(r.groups(seq_len), thread="blockIdx.x"):
                    lo: T.int64 = g * r.slice_len(seq_len)
                    hi: T.int64 = lo + r.slice_len(seq_len)
                    for tx in T.thread_binding(threads, thread="threadIdx.x"):
                        with T.sblock("add_rms_norm"):
                            part = T.sblock_alloc_buffer((threads,), "float32", scope="shared")
                            vals = T.sblock_alloc_buffer((per,), "float32", scope="local")
                            acc = T.sblock_alloc_buffer((2,), "float32", scope="local")   # sum of squares, scale
                            acc[0] = T.float32(0)
                            for i in range(per):
                                if i * threads + tx < h:
                                    vals[i] = T.Cast("float32", T.Cast(dtype, T.Cast(
                                        "float32", a[r.at(tok, head, i * threads + tx)]) + T.Cast(
                                        "float32", b[r.at(tok, head, i * threads + tx)])))
                                    acc[0] = acc[0] + vals[i] * vals[i]
                            part[tx] = acc[0]
                            T.tvm_storage_sync("shared")
                            acc[1] = T.float32(0)
                            for j in range(threads):
                                acc[1] = acc[1] + part[j]
                            acc[1] = r.scale(acc[1])
                            for i in range(per):
                                if i * threads + tx < h and lo <= T.Cast("int64", i * threads + tx) < hi:
                                    total[r.at(tok, head, i * threads + tx)] = T.Cast(dtype, vals[i])
                                    out[r.at(tok, head, i * threads + tx)] = T.Cast(
                                        dtype, acc[1] * vals[i] * r.weight(w, i * threads + tx))

    @T.prim_func(s_tir=True)
    def fused_add_rms_norm_cpu(a_h: T.handle, b_h: T.handle, w_h: T.handle, sum_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        seq_len = T.int64()
        a = T.match_buffer(a_h, r.shape(seq_len), dtype)
        b = T.match_buffer(b_h, r.shape(seq_len), dtype)
        w = T.match_buffer(w_h, (T.int64(h),), spec.w_dtype)
        total = T.match_buffer(sum_h, r.shape(seq_len), dtype)
        out = T.match_buffer(out_h, r.shape(seq_len), dtype)
        ss = T.alloc_buffer((1,), "float32")
        for tok, head in T.grid(seq_len, heads):
            ss[0] = T.float32(0)
            for c in range(h):
                total[r.at(tok, head, c)] = T.Cast(dtype, T.Cast("float32", a[r.at(tok, head, c)])
                                                   + T.Cast("float32", b[r.at(tok, head, c)]))
                ss[0] = ss[0] + T.Cast("float32", total[r.at(tok, head, c)]) * T.Cast(
                    "float32", total[r.at(tok, head, c)])
            ss[0] = r.scale(ss[0])
            for c in range(h):
                out[r.at(tok, head, c)] = T.Cast(dtype, ss[0] * T.Cast("float32", total[r.at(tok, head, c)])
                                                 * r.weight(w, c))

    return fused_add_rms_norm_gpu if gpu else fused_add_rms_norm_cpu
