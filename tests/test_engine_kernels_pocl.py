"""The GPU variants of MLC's engine kernels (models/engine_table.py, gdn_kernels.gdn_segments) executed as OpenCL
C on PoCL, against numpy: what an Adreno bundle runs when MLC's engine processes logits or batches a hybrid."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import te

from pipeline.models.engine_table import _bitmask, _logit_bias, _penalty, _softmax_with_temperature
from pipeline.models.gdn_kernels import gdn_reference, gdn_segments

pytest.importorskip("pyopencl")
from pipeline.verify.opencl import find_opencl_device, run_on_pocl  # noqa: E402
from pipeline.verify.opencl_plan import opencl_kernels, schedule_for_gpu  # noqa: E402

if find_opencl_device() is None:
    pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)", allow_module_level=True)

ADRENO = {"kind": "opencl", "device": "adreno", "host": {"kind": "llvm"}}
V = 1000   # not a multiple of the block size: the guards are exercised


def _logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (rows, V)).astype("float32")


def test_logit_bias_penalty_bitmask_on_pocl():
    logits = _logits(3)
    pos, ids, bias = np.array([0, 2, 2], "int32"), np.array([5, 7, 999], "int32"), np.array([1.5, -2, 4], "float32")
    want = logits.copy()
    want[pos, ids] += bias
    got = logits.copy()
    run_on_pocl(opencl_kernels(_logit_bias(V, True), ADRENO), "main", [got, pos, ids, bias])
    np.testing.assert_array_equal(got, want)

    seq_ids, pos2seq = np.array([1, 2], "int32"), np.array([0, 0, 1], "int32")
    ids, cnt = np.array([3, 4, 3], "int32"), np.array([2, 1, 5], "int32")
    pen = np.array([[0.5, 0.25, 1.3], [0.0, 0.1, 0.8]], "float32")
    want = logits.copy()
    for p, tok, c in zip(pos2seq, ids, cnt, strict=True):
        x = want[seq_ids[p], tok] - pen[p, 0] - c * pen[p, 1]
        want[seq_ids[p], tok] = x / pen[p, 2] if x > 0 else x * pen[p, 2]
    got = logits.copy()
    run_on_pocl(opencl_kernels(_penalty(V, True), ADRENO), "main", [got, seq_ids, pos2seq, ids, cnt, pen])
    np.testing.assert_allclose(got, want, rtol=1e-6)

    words = (V + 31) // 32
    mask = np.random.default_rng(1).integers(-2**31, 2**31, (3, words), dtype=np.int64).astype("int32")
    bits = np.unpackbits(mask.view("uint8"), bitorder="little").reshape(3, -1)[:, :V].astype(bool)
    want = logits.copy()
    for row in (0, 2):
        want[row][~bits[row]] = np.finfo("float32").min
    got = logits.copy()
    run_on_pocl(opencl_kernels(_bitmask(V, True), ADRENO), "main", [got, np.array([0, 2], "int32"), mask])
    masked = want == np.finfo("float32").min
    np.testing.assert_array_equal(got[~masked], want[~masked])
    assert (got[masked] < -3.4e38).all()   # OpenCL C prints FLT_MIN's literal to 7 digits: -3.402823e+38


def test_gpu_softmax_with_temperature_on_pocl():
    """The TE softmax as dlight schedules it for a GPU target (the Adreno build's path)."""
    x_ph = te.placeholder((te.var("batch", "int64"), 1, V), "float32", name="logits")
    t_ph = te.placeholder((x_ph.shape[0],), "float32", name="temperature")
    func = te.create_prim_func([x_ph, t_ph, _softmax_with_temperature(x_ph, t_ph)])
    program = opencl_kernels(schedule_for_gpu(func, ADRENO), ADRENO)
    logits = _logits(3, seed=4).reshape(3, 1, V)
    logits[0, 0, [10, 20]] = logits[0].max() + 1
    temps = np.array([0.0, 0.7, 1.0], "float32")
    probs = np.zeros_like(logits)
    run_on_pocl(program, "main", [logits, temps, probs])
    onehot = np.zeros(V, "float32")
    onehot[[10, 20]] = 1
    np.testing.assert_array_equal(probs[0, 0], onehot)
    for row, t in ((1, 0.7), (2, 1.0)):
        z = logits[row, 0] / t
        e = np.exp(z - z.max())
        np.testing.assert_allclose(probs[row, 0], e / e.sum(), rtol=1e-4, atol=1e-9)


def test_gdn_segments_on_pocl():
    """Three sequences of 5, 1 and 3 tokens in one chunk, each from its own state: the reference run per sequence."""
    hk, hv, dk, dv = 2, 4, 8, 16
    rng = np.random.default_rng(3)
    lengths = [5, 1, 3]
    n, b = sum(lengths), len(lengths)
    q, k = (rng.normal(0, 1, (n, hk, dk)).astype("float32") for _ in range(2))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(0, 1, (n, hv, dv)).astype("float32")
    g = -rng.uniform(0.01, 1, (n, hv)).astype("float32")
    beta = rng.uniform(0, 1, (n, hv)).astype("float32")
    state = rng.normal(0, 0.5, (b, hv, dk, dv)).astype("float32")
    ends = (np.cumsum(lengths) - 1).astype("int32")
    o, s = np.zeros((n, hv, dv), "float32"), np.zeros_like(state)
    program = opencl_kernels(gdn_segments(hk, hv, dk, dv, "float32", gpu=True, max_threads=16, gate_dtype="float32"),
                             ADRENO)
    run_on_pocl(program, "main", [q, k, v, g, beta, state.copy(), ends, o, s])
    start = 0
    for i, length in enumerate(lengths):
        rows = slice(start, start + length)
        o_ref, s_ref = gdn_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], state[i])
        np.testing.assert_allclose(o[rows], o_ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s[i], s_ref, rtol=1e-4, atol=1e-5)
        start += length


def _probs(rows: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 2, (rows, V))
    p = np.exp(x - x.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)).astype("float32")


def test_gpu_sampler_on_pocl():
    """MLC's device-side sampling (Metal / Vulkan) as OpenCL C: sorting, multinomial and top-p draws against numpy
    with the same uniform numbers."""
    from pipeline.models import gpu_sampler

    probs = _probs(3, 5)
    probs[1, [3, 700]] = probs[1, 500]            # ties: a stable descending sort keeps their order
    vals, idx = probs.copy(), np.zeros(probs.shape, "int32")
    for i, kernel in enumerate(gpu_sampler.argsort_passes(V)):
        out_v, out_i = np.zeros_like(vals), np.zeros_like(idx)
        run_on_pocl(opencl_kernels(kernel, ADRENO), "main", [vals, idx, out_v, out_i])
        vals, idx = out_v, out_i
        assert i < 10
    want = np.argsort(-probs, axis=1, kind="stable").astype("int32")
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(vals, np.take_along_axis(probs, want, axis=1))

    u = np.array([0.0, 0.37, 0.999, 0.5], "float32")
    rows = np.array([0, 1, 2, 2], "int32")
    got = np.zeros(4, "int32")
    run_on_pocl(opencl_kernels(gpu_sampler.multinomial_from_uniform(V), ADRENO), "main", [probs, u, rows, got])
    cum = np.cumsum(probs.astype(np.float64), axis=1)
    want = [int(np.searchsorted(cum[r], x, side="right")) for r, x in zip(rows, u, strict=True)]
    assert got.tolist() == want

    top_p = np.array([0.9, 1e-5, 0.5], "float32")   # row 1: greedy (the engine's top_p floor)
    got = np.zeros(4, "int32")
    run_on_pocl(opencl_kernels(gpu_sampler.sample_with_top_p(V), ADRENO), "main", [vals, idx, u, rows, top_p, got])
    expect = []
    for r, x in zip(rows, u, strict=True):
        c = np.cumsum(vals[r].astype(np.float64))
        kept = int(np.searchsorted(c, top_p[r], side="left")) + 1
        k = min(int(np.searchsorted(c[:kept], x * c[kept - 1], side="right")), kept - 1)
        expect.append(int(idx[r, k]))
    assert got.tolist() == expect
    assert got[1] == int(np.argmax(probs[1]))

    ids = np.array([5, 6, 7, 8], "int32")
    offsets = np.array([0 * V + 0, 0 * V + 1, 2 * V + 0], "int32")
    p, top, top_ids = np.zeros(4, "float32"), np.zeros(3, "float32"), np.zeros(3, "int32")
    run_on_pocl(opencl_kernels(gpu_sampler.sampler_take_probs(V), ADRENO), "main",
                [probs, idx, rows, ids, offsets, p, top, top_ids])
    np.testing.assert_array_equal(p, probs[rows, ids])
    np.testing.assert_array_equal(top_ids, [idx[0, 0], idx[0, 1], idx[2, 0]])
    np.testing.assert_array_equal(top, [vals[0, 0], vals[0, 1], vals[2, 0]])
