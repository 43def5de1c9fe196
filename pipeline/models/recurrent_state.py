"""The fixed-size per-sequence state of recurrent layers (GDN conv + delta-rule state), kept by TVM's runtime.

TVM's runtime has an RNN state object (`vm.builtin.rnn_state_create|get|set`, a `KVState` like the paged
KV cache, so `kv_state_add_sequence`, `kv_state_begin_forward`, `kv_state_end_forward`, `fork`, `popn`
all work on it). It stores, per layer and per state id, a tensor ``[num_seqs, max_history, *shape]`` and
calls two TIR functions per state id that the model library provides:

    get(storage, seq_slot_ids[b], history_slot_ids[b], out[b, *shape])
    set(storage, seq_slot_ids[b], history_slot_ids[b], data[b, *shape])   # writes slot (h + 1) % H

The state of a hybrid model is this object *beside* the paged KV cache: both are arguments of
`prefill`/`decode` and both are returned, and the runner begins/ends a forward on both.

States are stored flattened (``[numel]``) so one pair of rank-3 TIR copy kernels serves every shape; the
model reshapes on get/set (free). Ordering: `set` returns a new state handle and every later `get`/`set`
uses it, so the data dependencies order the in-place runtime calls (nothing is dead-code eliminated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tvm import relax as rx
from tvm.relax.frontend.nn import Object, Tensor
from tvm.script import tirx as T


def _get_func(numel: int, dtype: str):
    @T.prim_func(s_tir=True)
    def rnn_state_get(storage_h: T.handle, seq_h: T.handle, hist_h: T.handle, out_h: T.handle):
        num_seqs, history, batch = T.int64(), T.int64(), T.int64()
        storage = T.match_buffer(storage_h, (num_seqs, history, numel), dtype)
        seq = T.match_buffer(seq_h, (batch,), "int32")
        hist = T.match_buffer(hist_h, (batch,), "int32")
        out = T.match_buffer(out_h, (batch, numel), dtype)
        for b, i in T.grid(batch, numel):
            with T.sblock("rnn_state_get"):
                vb, vi = T.axis.remap("SS", [b, i])
                T.reads(seq[vb], hist[vb], storage[seq[vb], hist[vb], vi])
                T.writes(out[vb, vi])
                out[vb, vi] = storage[seq[vb], hist[vb], vi]

    return rnn_state_get


def _set_func(numel: int, dtype: str):
    @T.prim_func(s_tir=True)
    def rnn_state_set(storage_h: T.handle, seq_h: T.handle, hist_h: T.handle, data_h: T.handle):
        num_seqs, history, batch = T.int64(), T.int64(), T.int64()
        storage = T.match_buffer(storage_h, (num_seqs, history, numel), dtype)
        seq = T.match_buffer(seq_h, (batch,), "int32")
        hist = T.match_buffer(hist_h, (batch,), "int32")
        data = T.match_buffer(data_h, (batch, numel), dtype)
        for b, i in T.grid(batch, numel):
            with T.sblock("rnn_state_set"):
                vb, vi = T.axis.remap("SS", [b, i])
                T.reads(seq[vb], hist[vb], data[vb, vi])
                T.writes(storage[seq[vb], T.Cast("int64", hist[vb] + 1) % history, vi])
                storage[seq[vb], T.Cast("int64", hist[vb] + 1) % history, vi] = data[vb, vi]

    return rnn_state_set


class RecurrentState(Object):
    """Handle to the runtime RNN state inside a model function."""

    @staticmethod
    def create(num_layers: int, states: Sequence[tuple[Sequence[int], str]], max_batch_size, max_history,
               name: str = "rnn_state") -> RecurrentState:
        """`states`: (shape, dtype) of each state id, the same for every recurrent layer; zeros at start."""
        bb = rx.BlockBuilder.current()
        f_gets, f_sets, init = [], [], []
        for sid, (shape, dtype) in enumerate(states):
            numel = math.prod(int(x) for x in shape)
            for funcs, make, kind in ((f_gets, _get_func, "get"), (f_sets, _set_func, "set")):
                symbol = f"rnn_state_{kind}_{sid}"
                funcs.append(bb.add_func(make(numel, dtype).with_attr("global_symbol", symbol), symbol))
            init.append(bb.emit(rx.op.zeros(rx.ShapeExpr([numel]), dtype)))
        return RecurrentState(
            _expr=rx.call_pure_packed(
                "vm.builtin.rnn_state_create", rx.prim_value(num_layers), max_batch_size, max_history,
                rx.Tuple(f_gets), rx.Tuple(f_sets), rx.Tuple(init), ty_args=rx.AnyType()),
            _name=name)

    def get(self, layer: int, state_id: int, shape: Sequence, dtype: str) -> Tensor:
        """State `state_id` of recurrent layer `layer` for the sequences of this forward, as [b, *shape]
        (b = 1 for the batch-1 entry points)."""
        numel = math.prod(int(x) for x in shape[1:])
        flat = rx.BlockBuilder.current().emit(rx.call_dps_packed(
            "vm.builtin.rnn_state_get", [self._expr, rx.prim_value(layer), rx.prim_value(state_id)],
            out_ty=rx.TensorType((shape[0], numel), dtype)))
        return Tensor(_expr=flat).reshape(*shape)

    def set(self, layer: int, state_id: int, value: Tensor) -> RecurrentState:
        b = value.shape[0]
        numel = math.prod(int(x) for x in value.shape[1:])
        flat = value.reshape(b, numel)
        return RecurrentState(
            _expr=rx.call_pure_packed(
                "vm.builtin.rnn_state_set", self._expr, rx.prim_value(layer), rx.prim_value(state_id),
                flat._expr, ty_args=rx.AnyType()),
            _name="rnn_state_set")
