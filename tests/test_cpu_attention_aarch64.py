"""The KV cache's CPU kernels as android-cpu builds them (aarch64 + dotprod, fp16 pages), executed under
qemu-aarch64: decode / ragged prefill / paged prefill attention against float64 numpy, the KV append and the
table RoPE against the same PrimFunc built for this machine (itself checked against numpy / TVM's kernels in
tests/test_cpu_attention.py and tests/test_cpu_rope.py), the state merge against its numpy definition.

Tolerance: fp16 pages and outputs, fp32 sums: 2e-3 absolute on N(0, 1) data (an fp16 ulp near 1 is 1e-3);
the lse (fp32) 1e-4. 1 and 4 tasks per parallel loop: bit-identical (each output summed by one task).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from test_cpu_attention import H_KV, H_Q, PAGE, SM, D, paged, reference

from pipeline.kernels.cpu import attention as ca
from pipeline.kernels.cpu import rope as cpu_rope
from pipeline.verify.qemu_aarch64 import build_kernels, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()} (`make system-deps`)")

TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon", "+fullfp16", "+dotprod"]}
F16 = "float16"
TOL, LSE_TOL = 2e-3, 1e-4


def _funcs():
    return {"decode": ca.paged_decode(H_KV, H_Q, D, F16, PAGE), "ragged": ca.ragged_prefill(H_KV, H_Q, D, D, F16),
            "paged": ca.paged_prefill(H_KV, H_Q, D, F16, PAGE), "append": ca.transpose_append(H_KV, D, F16, PAGE),
            "merge": ca.merge_state(F16), "rope": cpu_rope.table_rope(1e4, 1.0, D, H_Q, H_KV, F16, {}, D)}


@pytest.fixture(scope="module")
def arm(tmp_path_factory):
    funcs = {n: f.with_attr("global_symbol", n) for n, f in _funcs().items()}
    one, four, _ = build_kernels(funcs, TARGET, "attn_", tmp_path_factory.mktemp("attn_aarch64"))
    return one, four


def _run(arm, name, args, outputs):
    """The kernel under qemu with 1 and with 4 tasks: the outputs (the same both times, asserted)."""
    one, four = (k.call(name, args) for k in arm)
    for i in outputs:
        assert np.array_equal(one[i], four[i]), (name, i)
    return [one[i] for i in outputs]


def _check(out, lse, want):
    assert np.abs(out.astype(np.float64) - want[0]).max() <= TOL
    assert np.abs(lse - want[1]).max() <= LSE_TOL


def test_decode(arm):
    rng = np.random.default_rng(1)
    lengths = [1, 16, 17, 300, 0]                # one key, a full page, one over, many pages, none
    pool, indptr, table, last, ks, vs = paged(rng, lengths)
    pool = pool.astype(F16)
    q = rng.standard_normal((len(lengths), H_Q, D)).astype(F16)
    zeros = np.zeros(len(lengths), np.int32)
    out, lse = _run(arm, "decode", [q, pool, indptr, table, last, zeros, zeros,
                                    np.zeros((len(lengths), H_Q, D), F16), np.zeros((len(lengths), H_Q), np.float32),
                                    0, 1.0, 1e4, SM], [7, 8])
    ks, vs = ([x.astype(F16) for x in xs] for xs in (ks, vs))
    _check(out, lse, reference([x[None] for x in q], ks, vs, causal=False))


@pytest.mark.parametrize("causal", [1, 0])
def test_ragged_prefill(arm, causal):
    rng = np.random.default_rng(0)
    lengths = [37, 5, 16, 1]
    qs, ks, vs = ([rng.standard_normal((n, h, D)).astype(F16) for n in lengths] for h in (H_Q, H_KV, H_KV))
    indptr = np.cumsum([0, *lengths]).astype(np.int32)
    rows = int(indptr[-1])
    out, lse = _run(arm, "ragged", [np.concatenate(qs), indptr, np.concatenate(ks), np.concatenate(vs), indptr,
                                    np.zeros(rows, np.int32), np.zeros(len(lengths), np.int32),
                                    np.zeros((rows, H_Q, D), F16), np.zeros((rows, H_Q), np.float32),
                                    causal, 0, 1.0, 1e4, SM], [7, 8])
    _check(out, lse, reference(qs, ks, vs, causal))


def test_paged_prefill(arm):
    rng = np.random.default_rng(2)
    q_lengths, kv_lengths = [5, 3, 16, 2], [40, 19, 16, 0]
    pool, indptr, table, last, ks, vs = paged(rng, kv_lengths)
    pool = pool.astype(F16)
    qs = [rng.standard_normal((n, H_Q, D)).astype(F16) for n in q_lengths]
    q_indptr = np.cumsum([0, *q_lengths]).astype(np.int32)
    rows = int(q_indptr[-1])
    out, lse = _run(arm, "paged", [np.concatenate(qs), q_indptr, pool, indptr, table, last,
                                   np.zeros(len(q_lengths), np.int32), np.zeros(rows, np.int32),
                                   np.zeros((rows, H_Q, D), F16), np.zeros((rows, H_Q), np.float32),
                                   1, 0, 1.0, 1e4, SM], [8, 9])
    ks, vs = ([x.astype(F16) for x in xs] for xs in (ks, vs))
    _check(out, lse, reference(qs, ks, vs, causal=1))


def _host(name):
    target = tvm.target.Target({"kind": "llvm"})
    return tvm.compile(tvm.IRModule({"main": _funcs()[name].with_attr("global_symbol", "main")}), target=target)["main"]


@pytest.mark.parametrize("n", [1, 37])
def test_append_writes_what_the_host_build_writes(arm, n):
    rng = np.random.default_rng(5)
    pool = rng.standard_normal((8, 2, H_KV, PAGE, D)).astype(F16)
    k, v = (rng.standard_normal((n, H_KV, D)).astype(F16) for _ in range(2))
    positions = rng.permutation(8 * PAGE)[:n].astype(np.int32)
    positions[1::5] = -1
    (got,) = _run(arm, "append", [pool, k, v, positions], [0])
    want = tvm.runtime.tensor(pool)
    _host("append")(want, tvm.runtime.tensor(k), tvm.runtime.tensor(v), tvm.runtime.tensor(positions))
    assert np.array_equal(got, want.numpy()) and not np.array_equal(got, pool)


@pytest.mark.parametrize("n", [1, 37])
def test_rope_matches_the_host_build(arm, n):
    rng = np.random.default_rng(n)
    qkv = rng.standard_normal((n, H_Q + 2 * H_KV, D)).astype(F16)
    positions = rng.integers(0, 5000, n).astype(np.int32)
    outs = [np.zeros((n, h, D), F16) for h in (H_Q, H_KV, H_KV)]
    got = _run(arm, "rope", [qkv, positions, *outs, 1], [2, 3, 4])
    want = [tvm.runtime.tensor(o) for o in outs]
    _host("rope")(tvm.runtime.tensor(qkv), tvm.runtime.tensor(positions), *want, 1)
    for mine, theirs in zip(got, want, strict=True):
        assert np.abs(mine.astype(np.float64) - theirs.numpy()).max() <= 4e-3    # an fp16 ulp at |x| < 4
    assert np.abs(got[0].astype(np.float64) - qkv[:, :H_Q]).max() > 0.1          # rotated, not copied


def test_merge_state(arm):
    """out, s <- the two partial attentions merged by their base-2 lse: weights 2^(s - max) each."""
    rng = np.random.default_rng(6)
    n = 37
    v, v_other = (rng.standard_normal((n, H_Q, D)).astype(F16) for _ in range(2))
    s, s_other = ((rng.standard_normal((n, H_Q)) * 4).astype(np.float32) for _ in range(2))
    out, lse = _run(arm, "merge", [v, s, v_other, s_other], [0, 1])
    top = np.maximum(s, s_other).astype(np.float64)
    a, b = np.exp2(s - top), np.exp2(s_other - top)
    want = (v * a[..., None] + v_other * b[..., None]) / (a + b)[..., None]
    assert np.abs(out.astype(np.float64) - want).max() <= TOL
    assert np.abs(lse - (top + np.log2(a + b))).max() <= LSE_TOL
    assert math.isfinite(float(lse.max()))
