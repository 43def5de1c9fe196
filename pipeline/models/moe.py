"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen3.5-MoE, in Relax over `moe_kernels`.

Per token: router logits ``x W_r^T`` (a small float linear, never quantized: its errors change which
experts run), softmax + top-k (+ renormalisation) in fp32, the k chosen experts' SwiGLU FFNs, their outputs
summed with the routing weights; Qwen3.5-MoE adds an always-on shared expert scaled by
``sigmoid(x w_g)``. The experts' weights are stacked per layer, ``experts.gate_up_proj`` [E, 2I, H] (gate
rows then up rows, each expert's as in a dense fused MLP) and ``experts.down_proj`` [E, H, I], float or
q4 / q8 codes of each expert's rows (NK whatever the target's layout: the gather kernels read an expert's
rows by index), or t2 / t3 / b1 sign codes packed per row as a dense ternary layer stores them. Their
parameters carry ``attrs["experts"] = E`` so the converter assembles them from the checkpoint's per-expert or
stacked tensors (quant/experts.py).
"""

from __future__ import annotations

from typing import Any

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from pipeline.errors import ConfigError
from pipeline.formats import FORMAT_BITS, GROUP, PACKINGS
from pipeline.kernels.cpu.probe import has_avx2, has_dotprod
from pipeline.models.layers import FloatLinear, LayerFactory
from pipeline.models.moe_grouped import moe_grouped_down, moe_grouped_gate_up, moe_sort
from pipeline.models.moe_grouped_gpu import moe_grouped_down_gpu, moe_grouped_gate_up_gpu, moe_sort_gpu
from pipeline.models.moe_kernels import (
    WEIGHT_FORMATS,
    code_dtype,
    moe_down,
    moe_gate_up,
    moe_route,
    weight_shapes,
)

EXPERT_ROLE = "experts"   # the scheme's `formats` key for the routed experts (float | q4 | q8 | t2 | t3 | b1)


def gpu_info(target: Any) -> tuple[bool, int]:
    """(kernels bound to GPU threads?, threads per block) for the hand-written kernels."""
    kind = target.kind.name if target is not None else "llvm"
    if kind in ("llvm", "c"):
        return False, 1
    threads = target.attrs.get("max_num_threads", 256) if hasattr(target, "attrs") else 256
    return True, int(min(int(threads), 128))


def expert_dot(target: Any) -> str | None:
    """The integer dot the CPU expert kernels take on this target (moe_kernels.EXPERT_DOTS): "avx2" (x86 with
    AVX2: kernels/cpu/expert_x86.py's pmaddwd), "dotprod" (AArch64 with dotprod, android-cpu and the CPU half of
    android-hexagon: kernels/cpu/expert_arm.py's sdot), else None (the fp32 form; GPU targets never ask)."""
    if has_avx2(target):
        return "avx2"
    if has_dotprod(target):
        return "dotprod"
    return None


class StackedExperts(nn.Module):
    """One projection of all E experts, [E, rows, k] (NK): `weight` (float) or `q_weight` + `q_scale`."""

    def __init__(self, experts: int, rows: int, k: int, make: LayerFactory):
        fmt = make.format_for(EXPERT_ROLE)
        if fmt not in WEIGHT_FORMATS:
            raise ConfigError(f"routed experts cannot be stored as {fmt!r} (one of {', '.join(WEIGHT_FORMATS)})",
                              fix="set formats.experts to one of them")
        # q4 / q8 need whole groups of 32 along K; the sign packings take any K (a short last group)
        self.fmt = "float" if fmt in FORMAT_BITS and k % GROUP else fmt
        codes, scales = weight_shapes(self.fmt, experts, rows, k)
        if self.fmt == "float":
            self.weight = nn.Parameter(codes, make.weight_dtype)
            params = [self.weight]
        else:
            self.q_weight = nn.Parameter(codes, code_dtype(self.fmt, make.weight_dtype))
            self.q_scale = nn.Parameter(scales, make.scale_dtype)
            params = [self.q_weight, self.q_scale]
        self.scale_dtype = make.scale_dtype
        for p in params:
            p.attrs["experts"] = experts
            if self.fmt in PACKINGS:   # the converter ternarises (ptq) or imports (native) them like a dense layer
                p.attrs.update(format=self.fmt, ternary_source=make.ternary_source)

    @property
    def tensors(self) -> list[Tensor]:
        return [self.weight] if self.fmt == "float" else [self.q_weight, self.q_scale]

    @property
    def dtype(self) -> str:
        return self.weight.dtype if self.fmt == "float" else "float32"


SHARED_ROLE = "shared_expert"   # the scheme's `formats` key for the shared expert (else gate_up_proj / down_proj)


class SharedExpert(nn.Module):
    """A dense SwiGLU FFN (fused gate+up like the dense decoder's MLP). Its format is the scheme's
    `shared_expert` when given (QUANT=auto plans it apart from the dense roles), else gate_up_proj's / down_proj's."""

    def __init__(self, hidden: int, inter: int, make: LayerFactory):
        own = SHARED_ROLE in (make.formats or {})
        self.gate_up_proj = make.linear(hidden, 2 * inter, bias=False, role=SHARED_ROLE if own else "gate_up_proj")
        self.down_proj = make.linear(inter, hidden, bias=False, role=SHARED_ROLE if own else "down_proj")

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class SharedExpertGate(nn.Module):
    """The shared expert's gate logit x . w ([1, H] weight, as the checkpoint's one-output linear), computed as
    a row reduction: as a matmul with N = 1, dlight's GEMV rule emits a dynamically sized local buffer for
    prefill that OpenCL code generation refuses ("constant size stack allocation")."""

    def __init__(self, hidden: int, dtype: str):
        self.weight = nn.Parameter((1, hidden), dtype)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight if self.weight.dtype == x.dtype else self.weight.astype(x.dtype)
        return op.sum(x * w, axis=-1, keepdims=True)


class SparseMoE(nn.Module):
    """Router + top-k routed experts (+ a gated shared expert when `shared_inter` > 0)."""

    def __init__(self, hidden: int, experts: int, top_k: int, inter: int, norm_topk: bool, make: LayerFactory,
                 gpu: bool, max_threads: int, shared_inter: int = 0, expert_dot: str | None = None):
        self.hidden, self.num_experts, self.top_k, self.inter = hidden, experts, top_k, inter
        self.norm_topk, self.dtype = norm_topk, make.dtype
        self.gpu, self.threads = gpu, max_threads
        self.expert_dot = expert_dot  # a CPU target's integer expert dot ("avx2" / "dotprod", `expert_dot`) or None
        self.gate = FloatLinear(hidden, experts, False, make.weight_dtype)
        self.experts = ExpertsPair(experts, hidden, inter, make)
        if shared_inter:
            self.shared_expert = SharedExpert(hidden, shared_inter, make)
            self.shared_expert_gate = SharedExpertGate(hidden, make.weight_dtype)
        else:
            self.shared_expert = None

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        n = b * s
        flat = op.reshape(x, (n, h))
        logits = self.gate(flat)
        if logits.dtype != "float32":
            logits = logits.astype("float32")
        E, k = self.num_experts, self.top_k
        idx, weight = op.tensor_ir_op(moe_route(E, k, self.norm_topk, gpu=self.gpu, max_threads=self.threads),
                                      "moe_route", [logits],
                                      [Tensor.placeholder((n, k), "int32"), Tensor.placeholder((n, k), "float32")])
        if isinstance(s, int) and s == 1:   # decode (one token per sequence): gather GEMVs
            y = self._gathered(flat, idx, weight, n)
        else:
            y = self._grouped(flat, idx, weight, n)
        if self.shared_expert is not None:
            y = y + op.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return op.reshape(y, (b, s, h))


    def _gathered(self, flat: Tensor, idx: Tensor, weight: Tensor, n: Any) -> Tensor:
        """Each token's k experts on their own (moe_kernels): decode."""
        E, k, inter, h, dtype = self.num_experts, self.top_k, self.inter, self.hidden, self.dtype
        kw = dict(gpu=self.gpu, max_threads=self.threads, expert_dot=self.expert_dot)
        gu, down = self.experts.gate_up_proj, self.experts.down_proj
        gate_up_kernel = moe_gate_up(E, inter, h, k, dtype, gu.fmt, gu.dtype, scale_dtype=gu.scale_dtype, **kw)
        down_kernel = moe_down(E, h, inter, k, dtype, down.fmt, down.dtype, scale_dtype=down.scale_dtype, **kw)
        act = op.tensor_ir_op(gate_up_kernel, "moe_gate_up", [flat, idx, *gu.tensors],
                              Tensor.placeholder((n, k, inter), dtype))
        return op.tensor_ir_op(down_kernel, "moe_down", [act, idx, weight, *down.tensors],
                               Tensor.placeholder((n, h), dtype))

    def _grouped(self, flat: Tensor, idx: Tensor, weight: Tensor, n: Any) -> Tensor:
        """Prefill: the chunk's slots sorted by expert, each expert's rows read once per chunk (moe_grouped; on GPU
        targets its thread-bound twin moe_grouped_gpu), then the routing-weighted sum over the k slots in fp32."""
        E, k, inter, h, dtype = self.num_experts, self.top_k, self.inter, self.hidden, self.dtype
        gu, down = self.experts.gate_up_proj, self.experts.down_proj
        if self.gpu:
            kw = dict(max_threads=self.threads)
            sort, gate_up, down_proj = moe_sort_gpu(E, k, **kw), moe_grouped_gate_up_gpu, moe_grouped_down_gpu
        else:
            kw = {}
            sort, gate_up, down_proj = moe_sort(E, k), moe_grouped_gate_up, moe_grouped_down
        offsets, order = op.tensor_ir_op(sort, "moe_sort", [idx],
                                         [Tensor.placeholder((E + 1,), "int32"), Tensor.placeholder((n * k,), "int32")])
        act = op.tensor_ir_op(gate_up(E, inter, h, k, dtype, gu.fmt, gu.dtype, scale_dtype=gu.scale_dtype, **kw),
                              "moe_grouped_gate_up", [flat, offsets, order, *gu.tensors],
                              Tensor.placeholder((n, k, inter), dtype))
        per_slot = op.tensor_ir_op(
            down_proj(E, h, inter, k, dtype, down.fmt, down.dtype, scale_dtype=down.scale_dtype, **kw),
            "moe_grouped_down", [act, offsets, order, *down.tensors], Tensor.placeholder((n, k, h), "float32"))
        y = op.sum(per_slot * op.reshape(weight, (n, k, 1)), axis=1)
        return y if dtype == "float32" else y.astype(dtype)


class ExpertsPair(nn.Module):
    """`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]."""

    def __init__(self, experts: int, hidden: int, inter: int, make: LayerFactory):
        self.gate_up_proj = StackedExperts(experts, 2 * inter, hidden, make)
        self.down_proj = StackedExperts(experts, hidden, inter, make)
