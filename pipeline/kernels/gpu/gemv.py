"""The GPU decode GEMV of KN-packed weights (q4 / q8 / t2 / b1): split-K over a work-group, fp32 sums.

dlight's GEMV rule splits K only when K has >= 128 packed rows, so every K = 576 GEMV of SmolLM2 (qkv,
o_proj, gate_up: most of a decode step's bytes) fell back to one work-item walking all of K for two output
columns: 72 dependent 8-byte loads per work-item, 3-12 work-groups per launch on a GPU of ~12 shader
processors, and the sum kept in half precision over all K terms.

This kernel replaces the fused dequantize + matmul PrimFunc of one token (x [1, 1, K], codes [K / codes
per word, N], scales [groups, N], out [1, 1, N]) with one written here, bound to GPU threads:
- each work-item owns V consecutive output columns and reads their codes as one 16-byte vector per step
  (KN: consecutive columns' codes are contiguous);
- the TK work-items of a column tile split K in chunks of whole code rows that share one scale, and
  reduce their partial sums through local memory (one barrier, then one work-item per column adds the
  TK partials in a fixed order);
- columns per work-group are chosen so that a launch has at least MIN_GROUPS work-groups (4 per shader
  processor of an Adreno 750) whenever N allows;
- codes, scales and x are widened to float32 and every sum is float32; only the result is stored in the
  output's dtype (float16 on the phone).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T

from pipeline.errors import CompileError
from pipeline.formats import B1_PER_WORD, CODES_PER_WORD, GROUP, SIGN_GROUP, T2_PER_WORD, ZERO
from pipeline.kernels.cpu.recognize import blocks
from pipeline.kernels.gpu import FILL_GROUPS

MIN_GROUPS = FILL_GROUPS  # work-groups per launch wanted (kernels/gpu/__init__.py)
WG_ITEMS = 64            # work-items per work-group (one Adreno wave) when K has enough chunks for them
LOAD_BYTES = 16          # bytes of codes a work-item loads per step when N allows
X_VECTOR = 8             # x is read 8 values at a time (OpenCL vectors stop at 16 lanes; b1 rows hold 32)
LINE_BYTES = 64          # a work-group reads at most this many contiguous bytes of a code row (one cache line,
                         # as assumed): wider column tiles would only cut the work-groups per launch
COLUMN_THREADS = (4, 2, 1)
OP_CLASS_ATTR = "pipeline.op_class"
PLAN_ATTR = "pipeline.gpu_plan"     # the launch, for the coverage report's cost columns (report/gpu_cost.py)
RULE = "dequant_gemv"


@dataclass(frozen=True)
class KNFormat:
    """A KN-packed weight format as the kernel reads it: value = (step * code - offset) * scale."""

    block: str      # the fused TE's dequantize block (models/layers.py names it)
    bits: int       # per code; 8: one int8 code per element
    group: int      # weights per scale along K
    offset: int
    step: int = 1

    @property
    def codes(self) -> int:
        return {4: CODES_PER_WORD, 2: T2_PER_WORD, 1: B1_PER_WORD, 8: 1}[self.bits]

    @property
    def code_dtype(self) -> str:
        return "int8" if self.bits == 8 else "uint32"

    @property
    def code_bytes(self) -> int:
        return 1 if self.bits == 8 else 4


FORMATS = {"q4": KNFormat("dequantize_kn", 4, GROUP, ZERO), "q8": KNFormat("dequantize_q8_kn", 8, GROUP, 0),
           "t2": KNFormat("dequantize_t2_kn", 2, SIGN_GROUP, 1), "b1": KNFormat("dequantize_b1_kn", 1, SIGN_GROUP, 1, 2)}


@dataclass(frozen=True)
class Plan:
    """How a launch is cut: V columns per work-item, TN x TK work-items per work-group, chunks of C rows."""

    fmt: str
    n: int
    k: int
    v: int
    tn: int
    tk: int
    chunk: int

    @property
    def spec(self) -> KNFormat:
        return FORMATS[self.fmt]

    @property
    def rows(self) -> int:
        return self.k // self.spec.codes

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.chunk)

    @property
    def steps(self) -> int:
        """Chunks per work-item (the slowest one's)."""
        return -(-self.chunks // self.tk)

    @property
    def cols(self) -> int:
        return self.tn * self.v

    @property
    def groups(self) -> int:
        """Work-groups per launch."""
        return -(-self.n // self.cols)

    @property
    def loads(self) -> int:
        """Code vector loads (V x code bytes each) by the busiest work-item."""
        return self.steps * self.chunk

    def describe(self) -> str:
        return (f"{self.groups} work-groups x {self.tn * self.tk} work-items ({self.tn} along N x {self.tk} along "
                f"K), {self.v} columns per work-item, {self.loads} loads of {self.v * self.spec.code_bytes} B each")


def plan(fmt: str, n: int, k: int) -> Plan | None:
    """The launch shape for an N x K GEMV of `fmt` codes, or None when the kernel does not cover it (N not a
    multiple of 4 columns, K not whole code words)."""
    spec = FORMATS[fmt]
    if k % spec.codes:
        return None
    widths = [v for v in (16, 8, 4, 2, 1) if v * spec.code_bytes <= LOAD_BYTES and n % v == 0]
    if not widths:
        return None
    shapes = [(v, tn) for v in widths for tn in COLUMN_THREADS if tn * v * spec.code_bytes <= LINE_BYTES]
    full = [(v, tn) for v, tn in shapes if -(-n // (v * tn)) >= MIN_GROUPS]
    v, tn = full[0] if full else max(shapes, key=lambda s: (-(-n // (s[0] * s[1])), s[0]))
    rows = k // spec.codes
    tk = max(1, min(WG_ITEMS // tn, rows))
    per_group = max(1, spec.group // spec.codes)
    sizes = [c for c in (8, 4, 2, 1) if per_group % c == 0]
    # The busiest work-item's loads: per chunk its code rows, as many x vectors, and one scale vector.
    chunk = min(sizes, key=lambda c: (_ceil(_ceil(rows, c), tk) * (2 * c + 1), -c))
    return Plan(fmt, n, k, v, tn, tk, chunk)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _value(fmt: str, word, j: int):
    """float32 (step * code - offset) of code j of `word`."""
    spec = FORMATS[fmt]
    if spec.bits == 8:
        return T.Cast("float32", word)
    mask = (1 << spec.bits) - 1
    code = T.Cast("float32", (word >> T.uint32(spec.bits * j)) & T.uint32(mask))
    return code * T.float32(spec.step) - T.float32(spec.offset)


def kn_gemv(p: Plan, x_dtype: str, scale_dtype: str, out_dtype: str) -> tirx.PrimFunc:
    """The kernel for plan `p`; parameters (codes, scales, x, out)."""
    spec = p.spec
    rows, n, k, v, tn, tk, chunk, cols = p.rows, p.n, p.k, p.v, p.tn, p.tk, p.chunk, p.cols
    codes, groups, chunks, steps, wgs = spec.codes, -(-p.k // spec.group), p.chunks, p.steps, p.groups
    xs_vec = min(codes, X_VECTOR)
    items = tn * tk
    fmt = p.fmt

    @T.prim_func(s_tir=True)
    def gemv(w_handle: T.handle, s_handle: T.handle, x_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        # int64 dims, as the fused function's (the build's PoCL verdicts match kernels by their shapes)
        w = T.match_buffer(w_handle, (T.int64(rows), T.int64(n)), spec.code_dtype)
        s = T.match_buffer(s_handle, (T.int64(groups), T.int64(n)), scale_dtype)
        x = T.match_buffer(x_handle, (T.int64(1), T.int64(1), T.int64(k)), x_dtype)
        out = T.match_buffer(out_handle, (T.int64(1), T.int64(1), T.int64(n)), out_dtype)
        red = T.sblock_alloc_buffer((tk, cols), "float32", scope="shared")
        for bx in T.thread_binding(wgs, thread="blockIdx.x"):
            for ty in T.thread_binding(tk, thread="threadIdx.y"):
                for tx in T.thread_binding(tn, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        acc = T.sblock_alloc_buffer((v,), "float32", scope="local")
                        part = T.sblock_alloc_buffer((v,), "float32", scope="local")
                        word = T.sblock_alloc_buffer((v,), spec.code_dtype, scope="local")
                        xs = T.sblock_alloc_buffer((codes,), "float32", scope="local")
                        total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        for c in T.vectorized(v):
                            acc[c] = T.float32(0)
                        for i in range(steps):
                            if ty + i * tk < chunks and bx * cols + tx * v < n:
                                for c in T.vectorized(v):
                                    part[c] = T.float32(0)
                                for r in T.unroll(chunk):
                                    if (ty + i * tk) * chunk + r < rows:
                                        for c in T.vectorized(v):
                                            word[c] = w[(ty + i * tk) * chunk + r, bx * cols + tx * v + c]
                                        for jo in T.unroll(codes // xs_vec):
                                            for ji in T.vectorized(xs_vec):
                                                xs[jo * xs_vec + ji] = T.Cast(
                                                    "float32", x[0, 0, ((ty + i * tk) * chunk + r) * codes
                                                                 + jo * xs_vec + ji])
                                        for j in T.unroll(codes):
                                            for c in T.vectorized(v):
                                                part[c] = part[c] + xs[j] * _value(fmt, word[c], j)
                                for c in T.vectorized(v):
                                    acc[c] = acc[c] + part[c] * T.Cast(
                                        "float32", s[(ty + i * tk) * chunk * codes // spec.group,
                                                     bx * cols + tx * v + c])
                        for c in T.vectorized(v):
                            red[ty, tx * v + c] = acc[c]
                        T.tvm_storage_sync("shared")
                        for j in range((cols + items - 1) // items):
                            if (ty * tn + tx) + j * items < cols and bx * cols + (ty * tn + tx) + j * items < n:
                                total[0] = T.float32(0)
                                for q in range(tk):
                                    total[0] = total[0] + red[q, (ty * tn + tx) + j * items]
                                out[0, 0, bx * cols + (ty * tn + tx) + j * items] = T.Cast(out_dtype, total[0])

    return gemv


# ------------------------------------------------------------------------------------ recognition
def _dims(param, rows: str) -> tuple[int, ...] | None:
    """Constant dims; rows="prompt": dim 1 of a 3-d buffer may be a variable (reported as -1)."""
    dims = []
    for i, d in enumerate(param.shape):
        if isinstance(d, tirx.IntImm):
            dims.append(int(d))
        elif rows == "prompt" and i == 1 and len(param.shape) == 3 and isinstance(d, tirx.Var):
            dims.append(-1)
        else:
            return None
    return tuple(dims)


def _offset_of(block) -> float | None:
    """The constant subtracted from the code in a dequantize block's store, (code - c) * scale or c = 0 for
    code * scale (q8), else None."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Mul):
        return None
    code = store.value.a
    if isinstance(code, tirx.Sub) and isinstance(code.b, tirx.FloatImm):
        return float(code.b.value)
    return 0.0 if isinstance(code, tirx.Cast) else None


def match_kn_gemv(func: tirx.PrimFunc, rows: str = "one") -> tuple[str, int, int, tuple[str, ...], dict[str, str]] | None:
    """(format, N, K, the role of each parameter, {role: dtype}) when `func` is a fused one-token GEMV of KN
    codes as models/layers.py and the fuse stage make it: blocks [dequantize, matmul]; codes [K / codes per
    word, N], scales [groups, N], x [1, 1, K], out [1, 1, N] last; None for anything else (tiled codes, an
    epilogue). rows="prompt": x [1, m, K] and out [1, m, N] over one symbolic m instead (a prefill)."""
    found = blocks(func)
    names = [b.name_hint for b in found]
    fmt = next((f for f, spec in FORMATS.items() if names == [spec.block, "matmul"]), None)
    params = list(func.params)
    if fmt is None or len(params) != 4:
        return None
    spec = FORMATS[fmt]
    offset = _offset_of(found[0])
    if offset is None or offset != float(spec.offset):
        return None
    shapes = [_dims(p, rows) for p in params]
    if any(s is None for s in shapes):
        return None
    out, one = shapes[-1], (1, 1) if rows == "one" else (1, -1)
    if len(out) != 3 or out[:2] != one or str(params[-1].dtype) not in ("float16", "float32"):
        return None
    if rows == "prompt" and not params[-1].shape[1].same_as(next(
            (p.shape[1] for p, sh in zip(params[:-1], shapes[:-1], strict=True) if len(sh) == 3), None)):
        return None
    n = out[2]
    roles: list[str] = []
    for p, shape in zip(params[:-1], shapes[:-1], strict=True):
        dtype = str(p.dtype)
        roles.append("codes" if dtype == spec.code_dtype and len(shape) == 2 else
                     "x" if dtype in ("float16", "float32") and len(shape) == 3 and shape[:2] == one else
                     "scales" if dtype in ("float16", "float32") and len(shape) == 2 else "")
    if sorted(roles) != ["codes", "scales", "x"]:
        return None
    by_role = dict(zip(roles, shapes[:-1], strict=True))
    k = by_role["x"][2]
    if k % spec.codes or by_role["codes"] != (k // spec.codes, n) or by_role["scales"] != (-(-k // spec.group), n):
        return None
    dtypes = {role: str(p.dtype) for role, p in zip((*roles, "out"), params, strict=True)}
    return fmt, n, k, (*roles, "out"), dtypes


def kn_gemv_like(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, Plan] | None:
    """`func` replaced by the kernel above (same parameter order and attributes), with its plan; None when
    `func` is not a one-token KN GEMV the kernel covers."""
    found = match_kn_gemv(func)
    if found is None:
        return None
    fmt, n, k, order, dtypes = found
    p = plan(fmt, n, k)
    if p is None:
        return None
    kernel = kn_gemv(p, dtypes["x"], dtypes["scales"], dtypes["out"])
    roles = ("codes", "scales", "x", "out")
    params = [kernel.params[roles.index(role)] for role in order]
    new = (tirx.PrimFunc(params, kernel.body, kernel.ret_type, func.attrs)
           .with_attr("tirx.is_scheduled", True).with_attr("tirx.noalias", True))
    op_class = "dequant-gemv-ternary" if fmt in ("t2", "b1") else "dequant-gemv"
    launch = {"work_groups": p.groups, "work_items": p.tn * p.tk, "loads": p.loads, "load_bytes": p.v * p.spec.code_bytes,
              "barriers": 1}
    return new.with_attr(OP_CLASS_ATTR, op_class).with_attr(PLAN_ATTR, launch), p


class GPUDequantGEMV(ScheduleRule):
    """The rule: a one-token KN GEMV of packed codes becomes `kn_gemv`; any other function is left to the next
    rule. A function it recognises but cannot build fails the build (never falls through unnoticed)."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name not in GPU_KINDS:
            return None
        try:
            found = kn_gemv_like(func)
        except Exception as err:  # noqa: BLE001 - re-raised with the reason, not as a RuntimeError the caller skips
            raise CompileError(f"the {RULE} rule recognised a GEMV but could not build its kernel: "
                               f"{str(err).strip().splitlines()[-1]}") from err
        return None if found is None else s_tir.Schedule(found[0])


GPU_KINDS = ("opencl", "metal", "vulkan", "webgpu", "cuda")

