"""Drives a compiled model library on this computer: KV cache, chunked prefill, decode.

Used by `python -m pipeline run` and by the numerics tests; calls the same entry points an app runtime
calls (embed, prefill, decode, create_tir_paged_kv_cache), so a passing test exercises the real library.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime import ShapeTuple
from tvm.runtime.vm import VirtualMachine

from pipeline.runtime.host_memory import HugePageArena

PAGE_SIZE = 16
GREEDY_ENTRY = "decode_greedy"     # models/llama.py's name for it (not imported: this module needs no compiler)


class MissingWeightsError(KeyError):
    """The library needs a parameter the given weights do not have."""


@functools.cache
def _builtin(name: str):
    return tvm_ffi.get_global_func(name)


@functools.cache
def _shape(n: int) -> ShapeTuple:
    """ShapeTuple([n]), made once: each is an FFI object, and a step's calls run on cold caches."""
    return ShapeTuple([n])


class Engine:
    """One sequence at a time (batch 1), which is what a phone app chat does."""

    def __init__(self, library: Any, params: dict[str, Any] | list[Any] | Iterable[tuple[str, Any]],
                 metadata: dict[str, Any] | None = None, device=None, arena: HugePageArena | None = None):
        """`params`: arrays in the library's parameter order, a name -> array mapping (ordered by
        `_metadata`), or a stream of (name, array) pairs — each copied to the device as it arrives, so the
        host copy of all weights never exists at once. `metadata` defaults to the library's `_metadata()`.
        `arena`: where CPU weights go (one of its `empty` arrays is used in place); a new one by default."""
        self.device = device or tvm.cpu()
        lib = tvm.runtime.load_module(str(library)) if isinstance(library, (str, Path)) else library
        self.vm = VirtualMachine(lib, self.device)
        self.meta = metadata if metadata is not None else json.loads(self.vm["_metadata"]())
        # weights copied in here go to huge-page memory on the CPU (host_memory: decode 1.02-1.09x there)
        on_cpu = self.device.dlpack_device_type() == tvm.cpu().dlpack_device_type()
        self.arena = (arena or HugePageArena()) if on_cpu else None
        if not isinstance(params, (dict, list, tuple)):
            params = {name: self._to_device(arr) for name, arr in params}
        if isinstance(params, dict):
            missing = [p["name"] for p in self.meta["params"] if p["name"] not in params]
            if missing:
                raise MissingWeightsError(missing[0])
            params = [params[p["name"]] for p in self.meta["params"]]
        self.params = [self._to_device(p) for p in params]
        # the parameter list as one FFI array, and the entry points looked up once: rebuilding the array
        # from 300 tensors per call, twice per decoded token, was ~20 us of a ~8 ms step
        self._param_array = tvm_ffi.convert(self.params)
        self._fns: dict[str, Any] = {}
        self.dtype = self.meta["activation_dtype"]
        self.chunk = int(self.meta["prefill_chunk_size"])
        self.context = int(self.meta["context_window_size"])
        self.hybrid = self.meta.get("kv_state_kind") == "hybrid"
        self.kv = self.rnn = None
        self._has_greedy = self.vm.module.implements_function(GREEDY_ENTRY)
        self._greedy_ids, self._greedy_next = None, -1      # decode_greedy's last output and its id
        self.reset()

    def _to_device(self, array: Any) -> Any:
        """A host array copied to the device (the CPU: into the arena); a TVM tensor is taken as it is."""
        if isinstance(array, tvm.runtime.Tensor):
            return array
        return self.arena.place(array) if self.arena is not None else tvm.runtime.tensor(array, self.device)

    def reset(self) -> None:
        """Drop the conversation: a fresh KV cache with one empty sequence."""
        self.kv = self.vm["create_tir_paged_kv_cache"](
            ShapeTuple([1]), ShapeTuple([self.context]), ShapeTuple([self.chunk]),
            ShapeTuple([PAGE_SIZE]), ShapeTuple([0]))
        _builtin("vm.builtin.kv_state_add_sequence")(self.kv, 0)
        if self.hybrid:   # GDN conv + delta-rule states, zeroed for the new sequence
            self.rnn = self.vm["create_rnn_state"](ShapeTuple([1]), ShapeTuple([1]))
            _builtin("vm.builtin.kv_state_add_sequence")(self.rnn, 0)
        self.length = 0

    @property
    def states(self) -> list[Any]:
        """The KV cache, then (hybrid models) the RNN state: what prefill/decode take and return."""
        return [self.kv, self.rnn] if self.hybrid else [self.kv]

    def _forward(self, fn: str, ids: list[int]) -> np.ndarray:
        emb = self._fn("embed")(tvm.runtime.tensor(np.asarray(ids, dtype="int32"), self.device), self._param_array)
        emb = emb._create_view((1, len(ids), emb.shape[-1]))   # [n, h] -> [1, n, h], no copy
        return self._step(fn, emb, len(ids)).numpy()

    def _step(self, fn: str, first: Any, n: int) -> Any:
        """Run `fn` (first argument, then the states and weights) over n new positions; its first output."""
        if self.length + n > self.context:
            raise RuntimeError(f"context window of {self.context} tokens is full")
        for state in self.states:
            _builtin("vm.builtin.kv_state_begin_forward")(state, _shape(0), _shape(n))
        out, *states = self._fn(fn)(first, *self.states, self._param_array)
        self.kv, self.rnn = (states + [None])[:2]
        for state in self.states:
            _builtin("vm.builtin.kv_state_end_forward")(state)
        self.length += n
        return out

    def _fn(self, name: str) -> Any:
        if name not in self._fns:
            self._fns[name] = self.vm[name]
        return self._fns[name]

    def prefill(self, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Feed a prompt in chunks of `prefill_chunk_size`; logits of the last token ([V]) or all ([n, V])."""
        outs = []
        for start in range(0, len(ids), self.chunk):
            part = ids[start:start + self.chunk]
            fn = "prefill_all_logits" if all_logits else "prefill"
            outs.append(self._forward(fn, part)[0])
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][-1]

    def decode(self, token: int) -> np.ndarray:
        return self._forward("decode", [token])[0, -1]

    def decode_greedy(self, token: int) -> int:
        """The id after `token` by argmax of its logits: one call of the library's `decode_greedy` (CPU
        targets), which embeds, decodes and takes the argmax without the logits leaving it; a library
        without it (GPU targets, older bundles) decodes and takes numpy's argmax — the same id."""
        if not self._has_greedy:
            return int(np.argmax(self.decode(token)))
        if self._greedy_ids is None or token != self._greedy_next:   # else the last output already holds it
            self._greedy_ids = tvm.runtime.tensor(np.asarray([token], dtype="int32"), self.device)
        self._greedy_ids = self._step(GREEDY_ENTRY, self._greedy_ids, 1)
        self._greedy_next = int(self._greedy_ids.numpy()[0])
        return self._greedy_next
