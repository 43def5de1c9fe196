"""The parallel CPU attention kernels (pipeline/kernels/cpu/attention.py) vs a numpy reference, and vs TVM's own
serial kernels where those are right; builds for LLVM targets use them.

Reference: softmax attention in float64 with TVM's conventions (base-2 log-sum-exp: lse = log2 sum 2^s with
s = q.k * sm_scale * log2(e); causal aligns the last query with the last key; no keys: output 0, lse -5e4).
Tolerance 1e-5 (float32 accumulation in a different order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm

from pipeline.kernels.cpu import attention as ca

H_KV, H_Q, D, PAGE = 3, 9, 64, 16
SM = 1 / math.sqrt(D)
TOL = 1e-5
DEV = tvm.cpu()


def _compile(func):
    target = tvm.target.Target({"kind": "llvm"})
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


@pytest.fixture(scope="module")
def kernels():
    return {"ragged": _compile(ca.ragged_prefill(H_KV, H_Q, D, D, "float32")),
            "decode": _compile(ca.paged_decode(H_KV, H_Q, D, "float32", PAGE)),
            "paged": _compile(ca.paged_prefill(H_KV, H_Q, D, "float32", PAGE))}


def reference(queries, keys, values, causal):
    """Per sequence: queries [n, H_Q, D], keys / values [m, H_KV, D] -> (output, lse) concatenated."""
    outs, lses = [], []
    for q, k, v in zip(queries, keys, values, strict=True):
        n, m = len(q), len(k)
        out, lse = np.zeros((n, H_Q, D)), np.full((n, H_Q), -5e4)
        for i in range(n):
            visible = max(min(m - n + i + 1, m), 0) if causal else m
            for h in range(H_Q):
                if not visible:
                    continue
                s = k[:visible, h // (H_Q // H_KV)].astype(np.float64) @ q[i, h] * SM * math.log2(math.e)
                p = np.exp2(s - s.max())
                out[i, h] = p @ v[:visible, h // (H_Q // H_KV)] / p.sum()
                lse[i, h] = s.max() + math.log2(p.sum())
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def paged(rng, lengths, n_pages=48):
    """A page pool holding the sequences' keys / values in shuffled pages -> (pool, indptr, values,
    last page lengths, per-sequence keys, per-sequence values)."""
    pool = rng.standard_normal((n_pages, 2, H_KV, PAGE, D)).astype(np.float32)
    order = rng.permutation(n_pages).astype(np.int32)
    indptr, table, last, keys, vals = [0], [], [], [], []
    for length in lengths:
        n = -(-length // PAGE)
        mine = order[len(table):len(table) + n]
        table += list(mine)
        indptr.append(len(table))
        last.append(length - (n - 1) * PAGE if n else 0)
        rows = [(mine[j // PAGE], j % PAGE) for j in range(length)]
        keys.append(np.array([pool[p, 0, :, o] for p, o in rows]).reshape(length, H_KV, D))
        vals.append(np.array([pool[p, 1, :, o] for p, o in rows]).reshape(length, H_KV, D))
    return pool, np.array(indptr, np.int32), np.array(table or [0], np.int32), np.array(last, np.int32), keys, vals


def _t(x):
    return tvm.runtime.tensor(np.ascontiguousarray(x), DEV)


def _outputs(rows):
    return _t(np.zeros((rows, H_Q, D), np.float32)), _t(np.zeros((rows, H_Q), np.float32))


def _check(out, lse, want) -> None:
    """Output and lse within TOL of the numpy reference's (output, lse)."""
    assert np.abs(out.numpy() - want[0]).max() <= TOL
    assert np.abs(lse.numpy() - want[1]).max() <= TOL


def test_decode_splits_even_out_the_threads():
    """The fewest parts per KV head that give each thread as many tasks; unknown thread count: the default."""
    assert [ca.decode_splits(h, 2) for h in (1, 2, 3, 4, 8)] == [2, 1, 2, 1, 1]
    assert ca.decode_splits(3, 4) == 4 and ca.decode_splits(8, 4) == 1 and ca.decode_splits(3, 1) == 1
    assert ca.decode_splits(3, 5) == ca.DECODE_SPLITS == ca.decode_splits(8, None)
    here = tvm.target.Target({"kind": "llvm"})
    cross = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-android"})
    assert ca.native_threads(here) >= 1 and ca.native_threads(cross) is None and ca.native_threads(None) is None


@pytest.mark.parametrize("causal", [1, 0])
def test_ragged_prefill(kernels, causal):
    rng = np.random.default_rng(0)
    lengths = [37, 5, 16, 1]
    qs = [rng.standard_normal((n, H_Q, D)).astype(np.float32) for n in lengths]
    ks = [rng.standard_normal((n, H_KV, D)).astype(np.float32) for n in lengths]
    vs = [rng.standard_normal((n, H_KV, D)).astype(np.float32) for n in lengths]
    indptr = np.cumsum([0, *lengths]).astype(np.int32)
    out, lse = _outputs(indptr[-1])
    kernels["ragged"](_t(np.concatenate(qs)), _t(indptr), _t(np.concatenate(ks)), _t(np.concatenate(vs)),
                      _t(indptr), _t(np.zeros(indptr[-1], np.int32)), _t(np.zeros(len(lengths), np.int32)),
                      out, lse, causal, 0, 1.0, 1e4, SM)
    _check(out, lse, reference(qs, ks, vs, causal))


@pytest.mark.parametrize("rows", [1, 3])
def test_ragged_prefill_any_rows_per_task(rows):
    """The ragged kernel with other row counts per task than the default (2): rows past a sequence's end and
    rows with different causal lengths in one task."""
    rng = np.random.default_rng(2)
    lengths = [7, 2, 1]
    qs = [rng.standard_normal((n, H_Q, D)).astype(np.float32) for n in lengths]
    ks = [rng.standard_normal((n, H_KV, D)).astype(np.float32) for n in lengths]
    vs = [rng.standard_normal((n, H_KV, D)).astype(np.float32) for n in lengths]
    indptr = np.cumsum([0, *lengths]).astype(np.int32)
    out, lse = _outputs(indptr[-1])
    _compile(ca.ragged_prefill(H_KV, H_Q, D, D, "float32", rows))(
        _t(np.concatenate(qs)), _t(indptr), _t(np.concatenate(ks)), _t(np.concatenate(vs)), _t(indptr),
        _t(np.zeros(indptr[-1], np.int32)), _t(np.zeros(len(lengths), np.int32)), out, lse, 1, 0, 1.0, 1e4, SM)
    _check(out, lse, reference(qs, ks, vs, causal=1))


def test_paged_decode(kernels):
    rng = np.random.default_rng(1)
    lengths = [1, 16, 17, 300, 0]                # one key, a full page, one over, many pages, none
    pool, indptr, table, last, ks, vs = paged(rng, lengths)
    q = rng.standard_normal((len(lengths), H_Q, D)).astype(np.float32)
    out, lse = _outputs(len(lengths))
    zeros = _t(np.zeros(len(lengths), np.int32))
    kernels["decode"](_t(q), _t(pool), _t(indptr), _t(table), _t(last), zeros, zeros, out, lse, 0, 1.0, 1e4, SM)
    _check(out, lse, reference([x[None] for x in q], ks, vs, causal=False))


@pytest.mark.parametrize("h_kv,h_q,d,dtype,splits", [(2, 12, 128, "float32", 4), (3, 9, 64, "float32", 3),
                                                     (1, 4, 64, "float16", 2), (8, 16, 128, "float16", 1)])
def test_paged_decode_groups_query_heads_and_splits_pages(h_kv, h_q, d, dtype, splits):
    """The decode task is (sequence, KV head, part of its pages): other GQA groups (6 query heads per KV head,
    qwen27b-like; a single KV head), split counts that leave parts empty (a one-page sequence) or uneven,
    several sequences, fp16 pages; the merged output matches float64 attention (fp16: its own rounding)."""
    rng = np.random.default_rng(7)
    lengths = [5, 70, 0, 33, 16 * 11 + 3]
    n_pages = sum(-(-n // PAGE) for n in lengths) + 3
    pool = rng.standard_normal((n_pages, 2, h_kv, PAGE, d)).astype(dtype)
    order = rng.permutation(n_pages).astype(np.int32)
    indptr, table, last = [0], [], []
    for n in lengths:
        table += list(order[len(table):len(table) + -(-n // PAGE)])
        indptr.append(len(table))
        last.append(n - (-(-n // PAGE) - 1) * PAGE if n else 0)
    q = rng.standard_normal((len(lengths), h_q, d)).astype(dtype)
    out = _t(np.zeros((len(lengths), h_q, d), dtype))
    lse = _t(np.zeros((len(lengths), h_q), np.float32))
    zeros = _t(np.zeros(len(lengths), np.int32))
    sm = 1 / math.sqrt(d)
    _compile(ca.paged_decode(h_kv, h_q, d, dtype, PAGE, splits=splits))(
        _t(q), _t(pool), _t(np.array(indptr, np.int32)), _t(np.array(table, np.int32)), _t(np.array(last, np.int32)),
        zeros, zeros, out, lse, 0, 1.0, 1e4, sm)
    tol = TOL if dtype == "float32" else 2e-3
    for s, n in enumerate(lengths):
        if n == 0:
            assert np.all(out.numpy()[s] == 0) and np.all(lse.numpy()[s] == -5e4)
            continue
        pages = table[indptr[s]:indptr[s + 1]]
        kv = np.concatenate([pool[p] for p in pages], axis=2)[:, :, :n].astype(np.float64)   # [2, h_kv, n, d]
        for h in range(h_q):
            sc = kv[0, h // (h_q // h_kv)] @ q[s, h].astype(np.float64) * sm * math.log2(math.e)
            p = np.exp2(sc - sc.max())
            assert np.abs(out.numpy()[s, h] - p @ kv[1, h // (h_q // h_kv)] / p.sum()).max() <= tol
            assert abs(lse.numpy()[s, h] - (sc.max() + math.log2(p.sum()))) <= TOL


@pytest.mark.parametrize("causal", [1, 0])
def test_paged_prefill(kernels, causal):
    """New tokens over cached pages (a chunked prefill / a follow-up turn), including a sequence with no
    cached pages; TVM's own kernel is not the reference here: it rescales its output with an out-of-bounds
    read of a one-element buffer."""
    rng = np.random.default_rng(2)
    q_lengths, kv_lengths = [5, 3, 16, 2], [40, 19, 16, 0]
    pool, indptr, table, last, ks, vs = paged(rng, kv_lengths)
    qs = [rng.standard_normal((n, H_Q, D)).astype(np.float32) for n in q_lengths]
    q_indptr = np.cumsum([0, *q_lengths]).astype(np.int32)
    out, lse = _outputs(q_indptr[-1])
    kernels["paged"](_t(np.concatenate(qs)), _t(q_indptr), _t(pool), _t(indptr), _t(table), _t(last),
                     _t(np.zeros(len(q_lengths), np.int32)), _t(np.zeros(q_indptr[-1], np.int32)),
                     out, lse, causal, 0, 1.0, 1e4, SM)
    _check(out, lse, reference(qs, ks, vs, causal))


def test_matches_tvm_serial_kernels(kernels):
    """The ragged prefill and decode kernels agree with TVM's serial CPU ones on the same inputs."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_ragged_cpu

    rng = np.random.default_rng(3)
    tvm_ragged = _compile(_attention_prefill_ragged_cpu(H_KV, H_Q, D, D, "float32", {}))
    n = 40
    q, k, v = (rng.standard_normal((n, h, D)).astype(np.float32) for h in (H_Q, H_KV, H_KV))
    results = []
    for fn in (kernels["ragged"], tvm_ragged):
        out, lse = _outputs(n)
        ptr = _t(np.array([0, n], np.int32))
        fn(_t(q), ptr, _t(k), _t(v), ptr, _t(np.zeros(n, np.int32)), _t(np.zeros(1, np.int32)), out, lse,
           1, 0, 1.0, 1e4, SM)
        results.append((out.numpy(), lse.numpy()))
    assert np.abs(results[0][0] - results[1][0]).max() <= TOL and np.abs(results[0][1] - results[1][1]).max() <= TOL

    tvm_decode = _compile(_attention_decode_cpu(H_KV, H_Q, D, "float32", False, {}))
    pool, indptr, table, last, _, _ = paged(rng, [70, 3])
    q = rng.standard_normal((2, H_Q, D)).astype(np.float32)
    results = []
    for fn in (kernels["decode"], tvm_decode):
        out, lse = _outputs(2)
        zeros = _t(np.zeros(2, np.int32))
        fn(_t(q), _t(pool), _t(indptr), _t(table), _t(last), zeros, zeros, out, lse, 0, 1.0, 1e4, SM)
        results.append((out.numpy(), lse.numpy()))
    assert np.abs(results[0][0] - results[1][0]).max() <= TOL


@pytest.mark.parametrize("n", [1, 37])
def test_transpose_append_matches_tvm(n):
    """The KV append writes the same pool as TVM's (tokens at position -1 are skipped), for a decode step
    (serial) and a prompt (parallel)."""
    from tvm.relax.frontend.nn.llm._page_kernels import _kv_cache_transpose_append

    rng = np.random.default_rng(5)
    pool = rng.standard_normal((8, 2, H_KV, PAGE, D)).astype(np.float32)
    k, v = (rng.standard_normal((n, H_KV, D)).astype(np.float32) for _ in range(2))
    positions = rng.permutation(8 * PAGE)[:n].astype(np.int32)
    positions[1::5] = -1
    results = []
    for fn in (_compile(ca.transpose_append(H_KV, D, "float32", PAGE)),
               _compile(_kv_cache_transpose_append(H_KV, D, "float32", PAGE))):
        pages = _t(pool)
        fn(pages, _t(k), _t(v), _t(positions))
        results.append(pages.numpy())
    assert np.array_equal(results[0], results[1])
    assert not np.array_equal(results[0], pool)     # something was written


@pytest.mark.parametrize("n", [1, 40])
def test_merge_state_matches_tvm(n):
    """The attention-state merge computes what TVM's serial one does (decode: 1 x heads rows, serial;
    a prefill chunk over cached pages: parallel)."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _merge_state_inplace_cpu

    rng = np.random.default_rng(6)
    v, v_other = (rng.standard_normal((n, H_Q, D)).astype(np.float32) for _ in range(2))
    s, s_other = ((rng.standard_normal((n, H_Q)) * 4).astype(np.float32) for _ in range(2))
    results = []
    for fn in (_compile(ca.merge_state("float32")), _compile(_merge_state_inplace_cpu("float32"))):
        out_v, out_s = _t(v), _t(s)
        fn(out_v, out_s, _t(v_other), _t(s_other))
        results.append((out_v.numpy(), out_s.numpy()))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)
    assert np.abs(results[0][0] - v).max() > 0.1     # merged, not left as it was


def test_inline_rope_is_refused(kernels):
    """rotary_mode 1 (RoPE inside attention) is not implemented: the kernel stops instead of skipping it."""
    n = 4
    ptr = _t(np.array([0, n], np.int32))
    out, lse = _outputs(n)
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((n, h, D)).astype(np.float32) for h in (H_Q, H_KV, H_KV))
    with pytest.raises(Exception, match="RoPE"):
        kernels["ragged"](_t(q), ptr, _t(k), _t(v), ptr, _t(np.zeros(n, np.int32)), _t(np.zeros(1, np.int32)),
                          out, lse, 1, 1, 1.0, 1e4, SM)


def test_host_builds_use_them():
    """The fuse stage swaps TVM's serial CPU kernels (sliding-window variants stay TVM's)."""
    from test_coverage import SMALL

    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.stages import Loaded, define, fuse

    target = load_target("host-cpu")
    from pipeline.models import config_from_hf

    loaded = Loaded(ModelSpec(name="small", hf_config=SMALL, weights=None), SMALL, config_from_hf(SMALL), None)
    mod = fuse(define(loaded, load_quant("q0f32"), target), target)
    ours = {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and str(f.attrs.get("mlp.kernel")) == "cpu_attention"}
    assert set(ours) == set(ca.REPLACEMENTS)
    # the decode kernel prefetches the next page on x86 only (the android-* system-lib builds cannot take it)
    from pipeline.kernels.cpu.probe import has_avx2

    assert ("llvm.prefetch" in ours["batch_decode_paged_kv_cpu"].script()) == has_avx2(target.tvm())
    phone = load_target("android-cpu")
    decode = next(f for gv, f in fuse(define(loaded, load_quant("q0f32"), phone), phone).functions_items()
                  if gv.name_hint == "batch_decode_paged_kv_cpu")
    assert str(decode.attrs.get("mlp.kernel")) == "cpu_attention" and "llvm.prefetch" not in decode.script()


def test_vector_exp2_is_accurate():
    """The polynomial exp2 of the softmax weights: relative error <= 4e-7 (a few fp32 ulps) over the
    range softmax uses (x <= 0), and it vectorizes (no libm call left in the loop)."""
    from tvm.script import tirx as T

    n = 4096

    @T.prim_func
    def main(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i in T.vectorized(n):
            y[i] = ca._exp2(x[i])

    lib = tvm.compile(tvm.IRModule({"main": main}), target=tvm.target.Target({"kind": "llvm"}))
    assert "exp2f" not in lib.mod.inspect_source("ll")
    xs = np.concatenate([-np.geomspace(1e-6, 125.0, n - 2), [0.0, -0.5]]).astype(np.float32)
    out = _t(np.zeros(n, np.float32))
    lib["main"](_t(xs), out)
    want = np.exp2(xs.astype(np.float64))
    assert np.abs(out.numpy() / want - 1).max() <= 4e-7
