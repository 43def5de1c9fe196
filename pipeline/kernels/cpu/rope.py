"""A CPU RoPE kernel that computes each token's cos / sin once, in place of TVM's per-element one.

The paged KV cache splits the fused QKV projection and rotates Q and K with `tir_split_rotary` (TVM's
`llama_rope_with_position_map`). That kernel evaluates the rotation angle per (token, head, dim): a
`powf`, a `cosf` and a `sinf` for each of the (q + 2 kv) heads x head_dim elements, so SmolLM2-135M makes
~2,900 libm calls per layer per token: 0.3 ms of a decode step, 30 ms of a 128-token prefill.
The angle depends on the position and the dim only, so this kernel fills a table of rotary_dim cosines
and sines per token (the same frequency expressions as TVM's, `switch_rope_freq_func`), then rotates every
head from the table with vector loads: one table per token, shared by all heads. The fill is unrolled over
the dims, so LLVM folds each dim's frequency (the `powf`) to a constant, and where the two halves' angles are
then the same (rotate-half frequencies: default, llama3) it computes each cosf / sinf once: SmolLM2's table
went from 64 x (powf, cosf, sinf) to 32 x (cosf, sinf) per token and layer (call sites read from the aarch64
object), 10.6 k -> 3.7 k instructions per token counted under qemu-aarch64 (the kernel and its libm calls).

Same name, signature and outputs; tokens run in parallel when there are enough of them (a prompt), serially
for a decode step. Needs the model's RoPE settings, which the model hands over as the function attribute
`pipeline.rope` (JSON) at definition time (`stages.define`); GPT-J-style (interleaved) rotation and
LongRoPE's per-dim factors keep TVM's kernel.
"""

from __future__ import annotations

import json
from typing import Any

import tvm
from tvm import tirx
from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func
from tvm.script import tirx as T

ROPE_FUNCS = ("fused_rope", "tir_split_rotary")   # the KV cache's RoPE kernel: its module name, its registry name
ROPE_ATTR = "pipeline.rope"
PARALLEL_TOKENS = 8              # fewer tokens (a decode step) run on the calling thread: no fork-join
UNSUPPORTED = ("gptj", "longrope")
# TVM 0.27's TIR common-subexpression pass breaks TVM's own RoPE kernel with these scalings on GPU targets
# ("variable cse_v2 has been used before definition"): such a kernel is marked, and the library is built with
# that pass off (compiler/compile.build_library). Measured for Llama-3 scaling on android-adreno (OpenCL).
CSE_BREAKS = ("llama3",)
NO_CSE_ATTR = "pipeline.disable_cse_tir"


def rope_args(theta: float, scale: float, head_dim: int, num_q_heads: int, num_kv_heads: int, dtype: str,
              rope_scaling: dict[str, Any], rotary_dim: int) -> str:
    """The RoPE settings a model passes to its KV cache, as the JSON this module's kernel is made from."""
    return json.dumps({"theta": float(theta), "scale": float(scale), "head_dim": int(head_dim),
                       "num_q_heads": int(num_q_heads), "num_kv_heads": int(num_kv_heads),
                       "dtype": str(dtype), "rope_scaling": dict(rope_scaling or {}), "rotary_dim": int(rotary_dim)}, sort_keys=True)


def _angle_exprs(rope_scaling: dict[str, Any], rotary_dim: int, theta: float, pos, d):
    """(cos, sin) of the rotation angle at position `pos` (float32, scale applied) and dim `d`, with TVM's
    frequency expressions (their let-bound intermediates wrapped in)."""
    cos, sin, bindings = switch_rope_freq_func(rope_scaling)(pos, d, rotary_dim, theta, "float32")
    for var, value in bindings.items():
        cos = tirx.Let(var, value, cos)
        sin = tirx.Let(var, value, sin)
    return cos, sin


def table_rope(theta: float, scale: float, head_dim: int, num_q_heads: int, num_kv_heads: int, dtype: str,
               rope_scaling: dict[str, Any], rotary_dim: int):
    """The replacement kernel: TVM's `fused_rope` signature (qkv, position_map, q, k, v, apply_rope)."""
    fused_heads = num_q_heads + 2 * num_kv_heads
    half = rotary_dim // 2
    scale_f = tirx.const(scale, "float32")

    def cos_of(pos, d):
        return _angle_exprs(rope_scaling, rotary_dim, theta, T.Cast("float32", pos) * scale_f, d)[0]

    def sin_of(pos, d):
        return _angle_exprs(rope_scaling, rotary_dim, theta, T.Cast("float32", pos) * scale_f, d)[1]

    @T.macro
    def rotate_head(qkv, out, s, h, o, apply_rope, cs, sn):
        """qkv[s, h] rotated (or copied when apply_rope is 0) into out[s, o]."""
        if apply_rope > 0:
            for d in T.vectorized(half):
                out[s, o, d] = T.Cast(dtype, cs[d] * T.Cast("float32", qkv[s, h, d])
                                      - sn[d] * T.Cast("float32", qkv[s, h, d + half]))
            for d in T.vectorized(half):
                out[s, o, d + half] = T.Cast(dtype, cs[d + half] * T.Cast("float32", qkv[s, h, d + half])
                                             + sn[d + half] * T.Cast("float32", qkv[s, h, d]))
            for d in T.vectorized(max(head_dim - rotary_dim, 1)):   # the unrotated tail (partial RoPE)
                if rotary_dim + d < head_dim:
                    out[s, o, rotary_dim + d] = qkv[s, h, rotary_dim + d]
        else:
            for d in T.vectorized(head_dim):
                out[s, o, d] = qkv[s, h, d]

    @T.macro
    def one_token(qkv, position_map, q, k, v, apply_rope, s):
        cs = T.decl_buffer((rotary_dim,), "float32")
        sn = T.decl_buffer((rotary_dim,), "float32")
        for d in T.unroll(rotary_dim):  # unrolled: each dim's frequency a constant (no powf per token)
            cs[d] = cos_of(position_map[s], d)
            sn[d] = sin_of(position_map[s], d)
        for h in range(num_q_heads):
            rotate_head(qkv, q, s, h, h, apply_rope, cs, sn)
        for h in range(num_kv_heads):
            rotate_head(qkv, k, s, num_q_heads + h, h, apply_rope, cs, sn)
        for h in range(num_kv_heads):
            for d in T.vectorized(head_dim):
                v[s, h, d] = qkv[s, num_q_heads + num_kv_heads + h, d]

    @T.prim_func
    def fused_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                   var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True})
        seq_len = T.int32()
        position_map_elem_offset = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, fused_heads, head_dim), dtype)
        q = T.match_buffer(var_q, (seq_len, num_q_heads, head_dim), dtype)
        k = T.match_buffer(var_k, (seq_len, num_kv_heads, head_dim), dtype)
        v = T.match_buffer(var_v, (seq_len, num_kv_heads, head_dim), dtype)
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset)
        if seq_len >= PARALLEL_TOKENS:
            for s in T.parallel(seq_len):
                one_token(qkv, position_map, q, k, v, apply_rope, s)
        else:
            for s in range(seq_len):
                one_token(qkv, position_map, q, k, v, apply_rope, s)

    return fused_rope


def kernel_for(func: tirx.PrimFunc):
    """Our kernel for a KV cache's RoPE function carrying the model's settings, or None (keep TVM's)."""
    if func.attrs is None or ROPE_ATTR not in func.attrs:
        return None
    args = json.loads(str(func.attrs[ROPE_ATTR]))
    if args["rope_scaling"].get("rope_type") in UNSUPPORTED or args["rotary_dim"] % 2:
        return None
    return table_rope(args["theta"], args["scale"], args["head_dim"], args["num_q_heads"], args["num_kv_heads"],
                      args["dtype"], args["rope_scaling"], args["rotary_dim"])


@tvm.transform.module_pass(opt_level=0, name="ReplaceCPURoPE")
def replace_cpu_rope(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """On LLVM targets, swap the KV cache's per-element RoPE kernel for the table one (same attributes);
    elsewhere (GPU targets) keep TVM's and drop the settings attribute (marking it NO_CSE_ATTR where TVM's CSE
    pass breaks it)."""
    target = tvm.target.Target.current(allow_none=True)
    cpu = target is not None and target.kind.name == "llvm"
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or ROPE_ATTR not in func.attrs:
            continue
        fast = kernel_for(func) if cpu else None
        if fast is None:
            rope_type = json.loads(str(func.attrs[ROPE_ATTR]))["rope_scaling"].get("rope_type")
            mod[gv] = func.without_attr(ROPE_ATTR)
            if not cpu and rope_type in CSE_BREAKS:
                mod[gv] = mod[gv].with_attr(NO_CSE_ATTR, True)
            continue
        for key, value in func.attrs.items():
            if key != ROPE_ATTR:
                fast = fast.with_attr(key, value)
        mod[gv] = fast.with_attr("mlp.kernel", "cpu_rope")
    return mod


def annotate(mod: tvm.IRModule, args_json: str | None) -> tvm.IRModule:
    """Attach the model's RoPE settings to the KV cache's RoPE function (read by `replace_cpu_rope`)."""
    if not args_json:
        return mod
    for gv, func in list(mod.functions_items()):
        if gv.name_hint in ROPE_FUNCS and isinstance(func, tirx.PrimFunc) and len(func.params) == 6:
            mod[gv] = func.with_attr(ROPE_ATTR, args_json)
    return mod
