"""The functions MLC-LLM's serving engine looks up in a model library beside the model's own entry points.

Its engine (what Android / iOS apps link) batches requests: `batch_prefill` / `batch_decode` over several
sequences, the embeddings written into one buffer from `alloc_embedding_tensor` (the only place it learns
the hidden size), and logits post-processed on the device by four kernels it checks for at start:
`apply_logit_bias_inplace`, `apply_penalty_inplace`, `apply_bitmask_inplace`, `softmax_with_temperature`.
Their argument orders and shapes are the engine's (configs/runtimes/mlc-llm-79d603f.yaml lists them; `pipeline
check` compares a bundle with it). The kernels here are written for this project from that contract.
"""

from __future__ import annotations

import functools
from typing import Any

from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

from pipeline.config import GPU_SAMPLER_KINDS
from pipeline.models import gpu_sampler

KV_CACHE_CREATE = "vm.builtin.paged_attention_kv_cache_create"   # the runtime builtin the KV cache calls

GREEDY_TEMPERATURE = 1e-5   # at or below: the engine samples greedily (top_p 0), so probs are one-hot at the max


THREADS = 256   # work items per GPU block of the logit kernels (each item is one scattered read-modify-write)


def _loops(gpu: bool):
    """(outer, inner, threads): the (block, item) loop constructors of a logit kernel. GPU: bound to blockIdx.x /
    threadIdx.x (the kernel is marked scheduled: dlight has no rule for these scatters). CPU: plain loops."""
    if gpu:
        return (functools.partial(T.thread_binding, thread="blockIdx.x"),
                functools.partial(T.thread_binding, thread="threadIdx.x"), THREADS)
    return T.serial, T.serial, 1


def _finish(func: tirx.PrimFunc, gpu: bool) -> tirx.PrimFunc:
    func = func.with_attr("tirx.noalias", True)
    return func.with_attr("tirx.is_scheduled", True) if gpu else func


def _logit_bias(vocab: int, gpu: bool):
    outer, inner, threads = _loops(gpu)

    @T.prim_func
    def logit_bias_kernel(logits_h: T.handle, pos2seq_h: T.handle, ids_h: T.handle, bias_h: T.handle):
        batch, num_token = T.int64(), T.int64()
        logits = T.match_buffer(logits_h, (batch, vocab), "float32")
        pos2seq = T.match_buffer(pos2seq_h, (num_token,), "int32")
        ids = T.match_buffer(ids_h, (num_token,), "int32")
        bias = T.match_buffer(bias_h, (num_token,), "float32")
        for bx in outer((num_token + threads - 1) // threads):
            for tx in inner(threads):
                if bx * threads + tx < num_token:
                    i = bx * threads + tx
                    logits[pos2seq[i], ids[i]] = logits[pos2seq[i], ids[i]] + bias[i]

    return _finish(logit_bias_kernel, gpu)


def _penalty(vocab: int, gpu: bool):
    """Presence / frequency penalties subtract, then the repetition penalty divides a positive logit and
    multiplies a negative one (the usual HF rule); one work item per (sequence, appeared token)."""
    outer, inner, threads = _loops(gpu)

    @T.prim_func
    def penalty_kernel(logits_h: T.handle, seq_ids_h: T.handle, pos2seq_h: T.handle, ids_h: T.handle,
                       cnt_h: T.handle, pen_h: T.handle):
        batch, num_seq, num_token = T.int64(), T.int64(), T.int64()
        logits = T.match_buffer(logits_h, (batch, vocab), "float32")
        seq_ids = T.match_buffer(seq_ids_h, (num_seq,), "int32")
        pos2seq = T.match_buffer(pos2seq_h, (num_token,), "int32")
        ids = T.match_buffer(ids_h, (num_token,), "int32")
        cnt = T.match_buffer(cnt_h, (num_token,), "int32")
        pen = T.match_buffer(pen_h, (num_seq, 3), "float32")
        for bx in outer((num_token + threads - 1) // threads):
            for tx in inner(threads):
                if bx * threads + tx < num_token:
                    i = bx * threads + tx
                    p = pos2seq[i]
                    x = logits[seq_ids[p], ids[i]] - pen[p, 0] - T.Cast("float32", cnt[i]) * pen[p, 1]
                    logits[seq_ids[p], ids[i]] = T.if_then_else(x > T.float32(0), x / pen[p, 2], x * pen[p, 2])

    return _finish(penalty_kernel, gpu)


def _bitmask(vocab: int, gpu: bool):
    """Tokens whose bit is 0 in the grammar's bitmask (32 tokens per int32 word) get the lowest logit."""
    words = (vocab + 31) // 32
    outer, inner, threads = _loops(gpu)
    blocks = (vocab + threads - 1) // threads

    @T.prim_func
    def bitmask_kernel(logits_h: T.handle, seq_ids_h: T.handle, bitmask_h: T.handle):
        batch, num_seq = T.int64(), T.int64()
        logits = T.match_buffer(logits_h, (batch, vocab), "float32")
        seq_ids = T.match_buffer(seq_ids_h, (num_seq,), "int32")
        bitmask = T.match_buffer(bitmask_h, (batch, words), "int32")
        for bx in outer(num_seq * blocks):
            for tx in inner(threads):
                if (bx % blocks) * threads + tx < vocab:
                    s = seq_ids[bx // blocks]
                    v = (bx % blocks) * threads + tx
                    logits[s, v] = T.if_then_else(
                        T.bitwise_and(T.shift_right(bitmask[s, v // 32], T.Cast("int32", v % 32)), 1) == 1,
                        logits[s, v], T.min_value("float32"))

    return _finish(bitmask_kernel, gpu)


def _softmax_with_temperature(x: te.Tensor, temperature: te.Tensor) -> te.Tensor:
    """softmax(x / t) per row; a row whose t is at most GREEDY_TEMPERATURE gets 1 at its largest logit(s) and 0
    elsewhere, so the engine's greedy pick (the first largest probability) is the first largest logit."""
    b, one, v = x.shape
    k = te.reduce_axis((0, v), name="k")
    row_max = te.compute((b, one), lambda i, j: te.max(x[i, j, k], axis=k), name="row_max")
    greedy = te.compute((b,), lambda i: temperature[i] <= tirx.const(GREEDY_TEMPERATURE, "float32"), name="greedy")
    scale = te.compute((b,), lambda i: tirx.if_then_else(greedy[i], tirx.const(1, "float32"),
                                                        tirx.const(1, "float32") / temperature[i]), name="inv_t")
    e = te.compute(x.shape, lambda i, j, c: tirx.exp((x[i, j, c] - row_max[i, j]) * scale[i]), name="exp")
    k2 = te.reduce_axis((0, v), name="k2")
    total = te.compute((b, one), lambda i, j: te.sum(e[i, j, k2], axis=k2), name="row_sum")
    return te.compute(x.shape, lambda i, j, c: tirx.if_then_else(
        greedy[i], tirx.if_then_else(x[i, j, c] == row_max[i, j], tirx.const(1, "float32"), tirx.const(0, "float32")),
        e[i, j, c] / total[i, j]), name="probs")


def with_kv_config_fields(mod: Any, fields: int) -> Any:
    """The module with the paged KV cache's config shape (its first argument) cut to `fields` entries: TVM 0.27
    passes 6 (the 6th, a per-layer sliding window of 1024, is what a 5-field runtime assumes anyway); the runtime
    MLC's engine pins ICHECKs exactly 5."""

    @rx.expr_functor.mutator
    class CutConfig(rx.PyExprMutator):
        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            head = call.args[0] if call.args else None
            if not (isinstance(head, rx.ExternFunc) and head.global_symbol == KV_CACHE_CREATE):
                return call
            values = list(call.args[1].values)
            if not 0 < fields <= len(values):
                raise ValueError(f"the KV cache config has {len(values)} fields; cannot give {fields}")
            args = [head, rx.ShapeExpr(values[:fields]), *call.args[2:]]
            return rx.Call(call.op, args, call.attrs, call.ty_args)

        def run(self):
            for gv, func in mod.functions_items():
                if isinstance(func, rx.Function):
                    self.builder_.update_func(gv, self.visit_expr(func))
            return self.builder_.get()

    return CutConfig(mod).run()


LANES = 16   # independent running maxima / sums of the CPU softmax (a serial chain per lane, vectorized across lanes)


def _softmax_cpu(vocab: int):
    """softmax_with_temperature for CPU targets: one pass for the row's max (LANES partial maxima, vectorized), then
    either the one-hot of a greedy row (no exp at all: the engine samples greedily at temperature 0, its
    default) or exp / sum / scale. Rows run in parallel."""
    body, tail = vocab // LANES * LANES, vocab % LANES
    eps = GREEDY_TEMPERATURE

    @T.prim_func
    def softmax_cpu_kernel(logits_h: T.handle, temperature_h: T.handle, probs_h: T.handle):
        batch = T.int64()
        logits = T.match_buffer(logits_h, (batch, 1, vocab), "float32")
        temperature = T.match_buffer(temperature_h, (batch,), "float32")
        probs = T.match_buffer(probs_h, (batch, 1, vocab), "float32")
        for b in T.parallel(batch):
            part = T.alloc_local((LANES,), "float32")
            acc = T.alloc_local((1,), "float32")
            for lane in T.vectorized(LANES):
                part[lane] = T.min_value("float32")
            for blk in range(body // LANES):
                for lane in T.vectorized(LANES):
                    part[lane] = T.max(part[lane], logits[b, 0, blk * LANES + lane])
            acc[0] = part[0]
            for lane in range(1, LANES):
                acc[0] = T.max(acc[0], part[lane])
            for r in range(tail):
                acc[0] = T.max(acc[0], logits[b, 0, body + r])
            if temperature[b] <= T.float32(eps):
                for blk in range(body // LANES):
                    for lane in T.vectorized(LANES):
                        probs[b, 0, blk * LANES + lane] = T.Select(logits[b, 0, blk * LANES + lane] == acc[0],
                                                                   T.float32(1), T.float32(0))
                for r in range(tail):
                    probs[b, 0, body + r] = T.Select(logits[b, 0, body + r] == acc[0], T.float32(1), T.float32(0))
            else:
                inv = T.float32(1) / temperature[b]
                for lane in T.vectorized(LANES):
                    part[lane] = T.float32(0)
                for blk in range(body // LANES):
                    for lane in T.vectorized(LANES):
                        probs[b, 0, blk * LANES + lane] = T.exp((logits[b, 0, blk * LANES + lane] - acc[0]) * inv)
                        part[lane] = part[lane] + probs[b, 0, blk * LANES + lane]
                for r in range(tail):
                    probs[b, 0, body + r] = T.exp((logits[b, 0, body + r] - acc[0]) * inv)
                    part[0] = part[0] + probs[b, 0, body + r]
                total = T.alloc_local((1,), "float32")
                total[0] = T.float32(0)
                for lane in range(LANES):
                    total[0] = total[0] + part[lane]
                for blk in range(body // LANES):
                    for lane in T.vectorized(LANES):
                        probs[b, 0, blk * LANES + lane] = probs[b, 0, blk * LANES + lane] / total[0]
                for r in range(tail):
                    probs[b, 0, body + r] = probs[b, 0, body + r] / total[0]

    return _finish(softmax_cpu_kernel, False)


class EngineFunctions:
    """Mixin for a model nn.Module with `cfg` (hidden_size, vocab_size, prefill_chunk_size) and `dtype`: the
    engine's buffer allocator and logit processor, and their export spec."""

    @property
    def _gpu_kernels(self) -> bool:
        target = getattr(self, "target", None)
        return target is not None and target.kind.name not in ("llvm", "c")

    def alloc_embedding_tensor(self) -> Tensor:
        return op.zeros((self.cfg.prefill_chunk_size, self.cfg.hidden_size), self.dtype)

    def apply_logit_bias_inplace(self, logits: Tensor, pos2seq_id: Tensor, token_ids: Tensor,
                                 logit_bias: Tensor) -> Tensor:
        return op.tensor_ir_inplace_op(_logit_bias(self.cfg.vocab_size, self._gpu_kernels), "logit_bias_kernel",
                                       [logits, pos2seq_id, token_ids, logit_bias], [0],
                                       Tensor.placeholder(logits.shape, "float32"))

    def apply_penalty_inplace(self, logits: Tensor, seq_ids: Tensor, pos2seq_id: Tensor, token_ids: Tensor,
                              token_cnt: Tensor, penalties: Tensor) -> Tensor:
        return op.tensor_ir_inplace_op(_penalty(self.cfg.vocab_size, self._gpu_kernels), "penalty_kernel",
                                       [logits, seq_ids, pos2seq_id, token_ids, token_cnt, penalties], [0],
                                       Tensor.placeholder(logits.shape, "float32"))

    def apply_bitmask_inplace(self, logits: Tensor, seq_ids: Tensor, bitmask: Tensor) -> Tensor:
        return op.tensor_ir_inplace_op(_bitmask(self.cfg.vocab_size, self._gpu_kernels), "bitmask_kernel",
                                       [logits, seq_ids, bitmask], [0], Tensor.placeholder(logits.shape, "float32"))

    def softmax_with_temperature(self, logits: Tensor, temperature: Tensor) -> Tensor:
        if not self._gpu_kernels:
            return op.tensor_ir_op(_softmax_cpu(self.cfg.vocab_size), "softmax_cpu_kernel", [logits, temperature],
                                   Tensor.placeholder(logits.shape, "float32"))
        return op.tensor_expr_op(_softmax_with_temperature, "softmax_with_temperature_kernel", [logits, temperature])

    @property
    def _samples_on_device(self) -> bool:
        """MLC's engine samples on the device on these targets (Sampler::SupportGPUSampler), elsewhere on the host."""
        target = getattr(self, "target", None)
        return target is not None and target.kind.name in GPU_SAMPLER_KINDS

    def multinomial_from_uniform(self, probs: Tensor, uniform_samples: Tensor, sample_indices: Tensor) -> Tensor:
        return op.tensor_ir_op(gpu_sampler.multinomial_from_uniform(self.cfg.vocab_size), "multinomial_kernel",
                               [probs, uniform_samples, sample_indices],
                               Tensor.placeholder(sample_indices.shape, "int32"))

    def argsort_probs(self, probs: Tensor) -> tuple[Tensor, Tensor]:
        vals, idx = probs, op.zeros(probs.shape, "int32")   # the first pass writes the positions, reads no index
        for i, kernel in enumerate(gpu_sampler.argsort_passes(self.cfg.vocab_size)):
            vals, idx = op.tensor_ir_op(kernel, f"argsort_merge_{i}", [vals, idx],
                                        [Tensor.placeholder(probs.shape, "float32"),
                                         Tensor.placeholder(probs.shape, "int32")])
        return vals, idx

    def sample_with_top_p(self, sorted_probs: Tensor, sorted_indices: Tensor, uniform_samples: Tensor,
                          sample_indices: Tensor, top_p: Tensor) -> Tensor:
        return op.tensor_ir_op(gpu_sampler.sample_with_top_p(self.cfg.vocab_size), "top_p_kernel",
                               [sorted_probs, sorted_indices, uniform_samples, sample_indices, top_p],
                               Tensor.placeholder(sample_indices.shape, "int32"))

    def sampler_take_probs(self, probs: Tensor, sorted_indices: Tensor, sample_indices: Tensor,
                           sampled_token_ids: Tensor, top_prob_offsets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return op.tensor_ir_op(gpu_sampler.sampler_take_probs(self.cfg.vocab_size), "take_probs_kernel",
                               [probs, sorted_indices, sample_indices, sampled_token_ids, top_prob_offsets],
                               [Tensor.placeholder(sample_indices.shape, "float32"),
                                Tensor.placeholder(top_prob_offsets.shape, "float32"),
                                Tensor.placeholder(top_prob_offsets.shape, "int32")])

    def _sampler_spec(self, f32, i32, none) -> dict[str, Any]:
        if not self._samples_on_device:
            return {}
        v = self.cfg.vocab_size
        return {
            "multinomial_from_uniform": {"probs": f32("batch_size", v), "uniform_samples": f32("num_samples"),
                                         "sample_indices": i32("num_samples"), **none},
            "argsort_probs": {"probs": f32("batch_size", v), **none},
            "sample_with_top_p": {"sorted_probs": f32("batch_size", v), "sorted_indices": i32("batch_size", v),
                                  "uniform_samples": f32("num_samples"), "sample_indices": i32("num_samples"),
                                  "top_p": f32("batch_size"), **none},
            "sampler_take_probs": {"probs": f32("batch_size", v), "sorted_indices": i32("batch_size", v),
                                   "sample_indices": i32("num_samples"), "sampled_token_ids": i32("num_samples"),
                                   "top_prob_offsets": i32("num_positions"), **none},
        }

    def engine_spec(self) -> dict[str, Any]:
        v = self.cfg.vocab_size
        none = {"$": {"param_mode": "none", "effect_mode": "none"}}

        def f32(*shape):
            return nn.spec.Tensor(list(shape), "float32")

        def i32(*shape):
            return nn.spec.Tensor(list(shape), "int32")

        return {
            "alloc_embedding_tensor": dict(none),
            "apply_logit_bias_inplace": {"logits": f32("batch_size", v), "pos2seq_id": i32("num_token"),
                                         "token_ids": i32("num_token"), "logit_bias": f32("num_token"), **none},
            "apply_penalty_inplace": {"logits": f32("batch_size", v), "seq_ids": i32("num_seq"),
                                      "pos2seq_id": i32("num_token"), "token_ids": i32("num_token"),
                                      "token_cnt": i32("num_token"), "penalties": f32("num_seq", 3), **none},
            "apply_bitmask_inplace": {"logits": f32("batch_size", v), "seq_ids": i32("num_seq"),
                                      "bitmask": i32("batch_size", (v + 31) // 32), **none},
            "softmax_with_temperature": {"logits": f32("batch_size", 1, v), "temperature": f32("batch_size"),
                                         **none},
            **self._sampler_spec(f32, i32, none),
        }
