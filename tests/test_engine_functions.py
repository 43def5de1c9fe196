"""MLC's engine function table in a real host-cpu library, called the way the engine calls it (cpp/serve/model.cc,
logit_processor.cc): several sequences in one batch_prefill / batch_decode match each sequence run alone through
the batch-1 entry points, and the logit kernels match numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.runtime import ShapeTuple

from pipeline.artifacts.tensor_cache import read_tensor_cache
from pipeline.runtime.engine import Engine

PROMPTS = ([1, 504, 3458, 282, 4649, 314], [1, 4711, 28, 940, 314, 17, 30, 44, 2530])


@pytest.fixture(scope="module")
def engine(build_bundle):
    bundle = build_bundle("smollm2-135m", "host-cpu", "q4f16")
    lib = json.loads((bundle / "manifest.json").read_text())["extra"]["library"]
    return Engine(bundle / lib, read_tensor_cache(bundle))


def _kv(engine, sequences: int):
    kv = engine.vm["create_tir_paged_kv_cache"](ShapeTuple([sequences]), ShapeTuple([4096]), ShapeTuple([256]),
                                                  ShapeTuple([16]), ShapeTuple([0]))
    for s in range(sequences):
        tvm_ffi.get_global_func("vm.builtin.kv_state_add_sequence")(kv, s)
    return kv


def _forward(engine, kv, fn: str, seq_ids: list[int], lengths: list[int], *args):
    tvm_ffi.get_global_func("vm.builtin.kv_state_begin_forward")(kv, ShapeTuple(seq_ids), ShapeTuple(lengths))
    logits, kv = engine.vm[fn](*args, kv, engine._param_array)
    tvm_ffi.get_global_func("vm.builtin.kv_state_end_forward")(kv)
    return logits.numpy(), kv


def _embed(engine, ids):
    return engine.vm["embed"](tvm.runtime.tensor(np.asarray(ids, "int32")), engine._param_array)


def test_batch_prefill_and_decode_match_each_sequence_alone(engine):
    alone_prefill, alone_next = [], []
    for ids in PROMPTS:
        engine.reset()
        alone_prefill.append(engine.prefill(ids))
        alone_next.append(engine.decode(int(np.argmax(alone_prefill[-1]))))
    kv = _kv(engine, 2)
    emb = _embed(engine, [*PROMPTS[0], *PROMPTS[1]])
    emb = emb._create_view((1, emb.shape[0], emb.shape[1]))
    ends = tvm.runtime.tensor(np.asarray([len(PROMPTS[0]) - 1, len(PROMPTS[0]) + len(PROMPTS[1]) - 1], "int32"))
    logits, kv = _forward(engine, kv, "batch_prefill", [0, 1], [len(p) for p in PROMPTS], emb, ends)
    assert logits.shape == (1, 2, engine.meta["model_config"]["vocab_size"])
    # the batch path runs TVM's generic kernels, batch 1 the hand-written ones: same math, other summation order
    for got, want in zip(logits[0], alone_prefill, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
        assert np.argmax(got) == np.argmax(want)
    nxt = [int(np.argmax(x)) for x in alone_prefill]
    emb = _embed(engine, nxt)
    logits, kv = _forward(engine, kv, "batch_decode", [0, 1], [1, 1], emb._create_view((2, 1, emb.shape[1])))
    assert logits.shape == (2, 1, engine.meta["model_config"]["vocab_size"])
    for got, want in zip(logits[:, 0], alone_next, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
        assert np.argmax(got) == np.argmax(want)


def test_alloc_embedding_tensor_tells_the_hidden_size(engine):
    buf = engine.vm["alloc_embedding_tensor"]()
    assert tuple(buf.shape) == (engine.meta["prefill_chunk_size"], engine.meta["model_config"]["hidden_size"])
    assert str(buf.dtype) == engine.meta["activation_dtype"]


def _call_inplace(engine, fn: str, logits: np.ndarray, *args: np.ndarray) -> np.ndarray:
    t = tvm.runtime.tensor(logits)
    engine.vm[fn](t, *(tvm.runtime.tensor(a) for a in args))
    return t.numpy()


def test_logit_kernels_match_numpy(engine):
    v = engine.meta["model_config"]["vocab_size"]
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, v)).astype("float32")

    pos, ids, bias = np.array([0, 2, 2], "int32"), np.array([5, 7, 9], "int32"), np.array([1.5, -2, 4], "float32")
    want = logits.copy()
    want[pos, ids] += bias
    np.testing.assert_array_equal(_call_inplace(engine, "apply_logit_bias_inplace", logits, pos, ids, bias), want)

    seq_ids = np.array([1, 2], "int32")                # penalties for logits rows 1 and 2
    pos2seq, ids, cnt = np.array([0, 0, 1], "int32"), np.array([3, 4, 3], "int32"), np.array([2, 1, 5], "int32")
    pen = np.array([[0.5, 0.25, 1.3], [0.0, 0.1, 0.8]], "float32")   # presence, frequency, repetition
    want = logits.copy()
    for p, tok, c in zip(pos2seq, ids, cnt, strict=True):
        x = want[seq_ids[p], tok] - pen[p, 0] - c * pen[p, 1]
        want[seq_ids[p], tok] = x / pen[p, 2] if x > 0 else x * pen[p, 2]
    got = _call_inplace(engine, "apply_penalty_inplace", logits, seq_ids, pos2seq, ids, cnt, pen)
    np.testing.assert_allclose(got, want, rtol=1e-6)

    words = (v + 31) // 32
    mask = rng.integers(-2**31, 2**31, (3, words), dtype=np.int64).astype("int32")
    bits = np.unpackbits(mask.view("uint8"), bitorder="little").reshape(3, -1)[:, :v].astype(bool)
    want = logits.copy()
    want[2][~bits[2]] = np.finfo("float32").min                          # only row 2 is masked
    got = _call_inplace(engine, "apply_bitmask_inplace", logits, np.array([2], "int32"), mask)
    np.testing.assert_array_equal(got, want)


def test_softmax_with_temperature(engine):
    v = engine.meta["model_config"]["vocab_size"]
    logits = np.random.default_rng(1).normal(0, 3, (3, 1, v)).astype("float32")
    logits[0, 0, [10, 20]] = logits[0].max() + 1      # a tie at the top of the greedy row
    temps = np.array([0.0, 0.7, 1.0], "float32")
    probs = engine.vm["softmax_with_temperature"](tvm.runtime.tensor(logits), tvm.runtime.tensor(temps)).numpy()
    assert probs.shape == (3, 1, v)
    onehot = np.zeros(v, "float32")
    onehot[[10, 20]] = 1
    np.testing.assert_array_equal(probs[0, 0], onehot)   # greedy: the engine picks the first 1, index 10
    for row, t in ((1, 0.7), (2, 1.0)):
        x = logits[row, 0] / t
        e = np.exp(x - x.max())
        np.testing.assert_allclose(probs[row, 0], e / e.sum(), rtol=1e-4, atol=1e-9)
