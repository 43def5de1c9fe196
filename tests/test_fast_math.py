"""The vectorizable exp / exp2 / sigmoid (pipeline/kernels/cpu/fast_math.py) vs numpy in float64.

Tolerances: float32 exp and exp2 relative error <= 2e-7 (~3 float32 ulps) over the normal range, denormals
within 2 of the smallest denormal, IEEE +inf / 0 beyond; sigmoid absolute error <= 2e-7. float16 exp /
sigmoid (computed in float32, rounded once): within 1 float16 ulp of numpy's float64 value rounded to float16.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from pipeline.kernels.cpu.fast_math import rewrite_func

N = 8192


def _compiled():
    @T.prim_func
    def main(x: T.Buffer((N,), "float32"), y: T.Buffer((N,), "float32"), z: T.Buffer((N,), "float32")):
        T.func_attr({"tirx.noalias": True})
        for io in range(N // 8):     # 8 lanes as in the model's kernels (one 8192-lane vector: minutes in LLVM)
            for ii in T.vectorized(8):
                y[io * 8 + ii] = T.exp(x[io * 8 + ii])
                z[io * 8 + ii] = T.sigmoid(x[io * 8 + ii])

    return tvm.compile(tvm.IRModule({"main": rewrite_func(main)}), target=tvm.target.Target({"kind": "llvm"}))


def test_exp_and_sigmoid_match_numpy_without_libm():
    lib = _compiled()
    assert "expf" not in lib.mod.inspect_source("ll")      # no per-lane libm call left
    xs = np.concatenate([np.linspace(-120, 100, N - 6), [0.0, -0.0, 88.7, 88.72, -87.3, -103.0]]).astype(np.float32)
    y, z = (tvm.runtime.tensor(np.zeros(N, np.float32)) for _ in range(2))
    lib["main"](tvm.runtime.tensor(xs), y, z)
    x64, got = xs.astype(np.float64), y.numpy().astype(np.float64)
    want = np.exp(x64)
    normal = (want > 1.2e-38) & (want < 3.4e38)
    assert np.abs(got[normal] / want[normal] - 1).max() <= 2e-7
    denormal = (want <= 1.2e-38) & (want > 1e-45)
    assert np.abs(got[denormal] - want[denormal]).max() <= 3e-45
    assert np.isinf(got[x64 > 88.73]).all() and (got[x64 < -104] == 0).all()
    assert np.abs(z.numpy() - 1 / (1 + np.exp(-x64))).max() <= 2e-7


def _compiled_exp2_and_fp16():
    @T.prim_func
    def main(x: T.Buffer((N,), "float32"), y: T.Buffer((N,), "float32"), h: T.Buffer((N,), "float16"),
             e: T.Buffer((N,), "float16"), s: T.Buffer((N,), "float16")):
        T.func_attr({"tirx.noalias": True})
        for io in range(N // 8):
            for ii in T.vectorized(8):
                y[io * 8 + ii] = T.exp2(x[io * 8 + ii])
                e[io * 8 + ii] = T.exp(h[io * 8 + ii])
                s[io * 8 + ii] = T.sigmoid(h[io * 8 + ii])

    return tvm.compile(tvm.IRModule({"main": rewrite_func(main)}), target=tvm.target.Target({"kind": "llvm"}))


def test_exp2_and_float16_exp_sigmoid_match_numpy_without_libm():
    lib = _compiled_exp2_and_fp16()
    ll = lib.mod.inspect_source("ll")
    assert "exp2f" not in ll and "expf" not in ll
    xs = np.concatenate([np.linspace(-160, 140, N - 6), [0.0, -0.0, 127.9, 128.0, -126.5, -149.0]]).astype(np.float32)
    hs = np.linspace(-17, 11, N).astype(np.float16)     # fp16 e^x overflows above ~11.09
    y = tvm.runtime.tensor(np.zeros(N, np.float32))
    e, s = (tvm.runtime.tensor(np.zeros(N, np.float16)) for _ in range(2))
    lib["main"](tvm.runtime.tensor(xs), y, tvm.runtime.tensor(hs), e, s)
    x64, got = xs.astype(np.float64), y.numpy().astype(np.float64)
    want = np.exp2(x64)
    normal = (want > 1.2e-38) & (want < 3.4e38)
    assert np.abs(got[normal] / want[normal] - 1).max() <= 2e-7
    denormal = (want <= 1.2e-38) & (want > 1e-45)
    assert np.abs(got[denormal] - want[denormal]).max() <= 3e-45
    assert np.isinf(got[x64 >= 128.0]).all() and (got[x64 < -150] == 0).all()
    h64 = hs.astype(np.float64)
    for got16, want64 in ((e.numpy(), np.exp(h64)), (s.numpy(), 1 / (1 + np.exp(-h64)))):
        ulp = np.spacing(want64.astype(np.float16)).astype(np.float64)
        assert (np.abs(got16.astype(np.float64) - want64.astype(np.float16).astype(np.float64)) <= ulp).all()


def test_host_build_kernels_have_no_exp_calls():
    """The fuse stage rewrites the MLP's SiLU (and every other float32 exp) on host-cpu, not on Adreno."""
    from test_coverage import SMALL

    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.models import config_from_hf
    from pipeline.stages import Loaded, define, fuse

    loaded = Loaded(ModelSpec(name="small", hf_config=SMALL, weights=None), SMALL, config_from_hf(SMALL), None)
    for name, rewritten in (("host-cpu", True), ("android-adreno", False)):
        target = load_target(name)
        mod = fuse(define(loaded, load_quant("q0f32"), target), target)
        silu = [f for gv, f in mod.functions_items() if "silu" in gv.name_hint]
        assert silu
        text = silu[0].script()
        assert ("T.sigmoid" not in text and "T.exp(" not in text) == rewritten, name
