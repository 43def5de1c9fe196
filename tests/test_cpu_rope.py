"""The table CPU RoPE kernel (pipeline/kernels/cpu/rope.py) vs TVM's own `llama_rope_with_position_map`, compiled
for this CPU and run on the same inputs, and the fuse stage's swap.

Tolerance: 2e-6 absolute on N(0, 1) inputs in float32 (same cos / sin, a different multiply-add order),
one fp16 ulp at |x| < 4 (4e-3) in float16. Llama-3 scaling: 1e-3, since our table's frequencies are folded at
compile time (unrolled dims) where TVM's kernel computes them in float32 at run time, and a frequency's last bit
moves the angle by up to position x ulp (positions < 5000: 3e-4 rad at frequency 1, times |x| < 4); `test_llama3_angles_against_float64` checks that the
folded ones are no farther from the exact rotation than TVM's.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

from pipeline.kernels.cpu import rope as cpu_rope

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _compile(func):
    target = tvm.target.Target({"kind": "llvm"})
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


@pytest.mark.parametrize(("n_q", "n_kv", "head_dim", "rotary_dim", "scaling", "dtype"), [
    (9, 3, 64, 64, {}, "float32"),          # SmolLM2's heads
    (8, 2, 128, 32, {}, "float32"),         # partial RoPE (Qwen3.5's full-attention layers)
    (4, 2, 64, 64, LLAMA3, "float32"),      # Llama-3 frequency scaling
    (9, 3, 64, 64, {}, "float16"),          # fp16 activations (android-cpu)
])
def test_matches_tvm_rope(n_q, n_kv, head_dim, rotary_dim, scaling, dtype):
    theirs = _compile(llama_rope_with_position_map(1e5, 1.0, head_dim, n_q, n_kv, dtype, scaling, rotary_dim))
    ours = _compile(cpu_rope.table_rope(1e5, 1.0, head_dim, n_q, n_kv, dtype, scaling, rotary_dim))
    tol = 4e-3 if dtype == "float16" else 1e-3 if scaling else 2e-6
    for n in (1, 5, 37):                    # decode (serial), a short prompt, a parallel one
        rng = np.random.default_rng(n)
        qkv = rng.standard_normal((n, n_q + 2 * n_kv, head_dim)).astype(dtype)
        positions = rng.integers(0, 5000, n).astype(np.int32)
        for apply_rope in (1, 0):
            results = []
            for fn in (theirs, ours):
                outs = [tvm.runtime.tensor(np.zeros((n, h, head_dim), dtype)) for h in (n_q, n_kv, n_kv)]
                fn(tvm.runtime.tensor(qkv), tvm.runtime.tensor(positions), *outs, apply_rope)
                results.append([o.numpy().astype(np.float64) for o in outs])
            for mine, want in zip(results[1], results[0], strict=True):
                assert np.abs(mine - want).max() <= tol, (n, apply_rope)
            if apply_rope:   # not a copy: the rotation happened
                assert np.abs(results[1][0] - qkv[:, :n_q]).max() > 0.1


def _llama3_exact(qkv, positions, n_q, rotary_dim, theta):
    """The Llama-3 rotation of qkv's q heads in float64 (the frequencies smoothed between the two wavelengths)."""
    half, f = rotary_dim // 2, LLAMA3
    inv = 1.0 / theta ** (np.arange(half) * 2 / rotary_dim)
    wavelen = 2 * np.pi / inv
    smooth = (f["original_max_position_embeddings"] / wavelen - f["low_freq_factor"]) / (
        f["high_freq_factor"] - f["low_freq_factor"])
    inv = np.where(wavelen < f["original_max_position_embeddings"] / f["high_freq_factor"], inv,
                   np.where(wavelen > f["original_max_position_embeddings"] / f["low_freq_factor"], inv / f["factor"],
                            (1 - smooth) * inv / f["factor"] + smooth * inv))
    angle = positions[:, None, None].astype(np.float64) * np.concatenate([inv, inv])[None, None]
    x = qkv[:, :n_q].astype(np.float64)
    return x * np.cos(angle) + np.concatenate([-x[..., half:], x[..., :half]], -1) * np.sin(angle)


def test_llama3_angles_against_float64():
    """Our kernel's Llama-3 rotation is at least as close to the float64 one as TVM's (and close to it)."""
    n_q, n_kv, d, n = 4, 2, 64, 37
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((n, n_q + 2 * n_kv, d)).astype("float32")
    positions = rng.integers(0, 5000, n).astype(np.int32)
    exact = _llama3_exact(qkv, positions, n_q, d, 1e5)
    errors = []
    for make in (llama_rope_with_position_map, cpu_rope.table_rope):
        outs = [tvm.runtime.tensor(np.zeros((n, h, d), "float32")) for h in (n_q, n_kv, n_kv)]
        _compile(make(1e5, 1.0, d, n_q, n_kv, "float32", LLAMA3, d))(tvm.runtime.tensor(qkv),
                                                                     tvm.runtime.tensor(positions), *outs, 1)
        errors.append(np.abs(outs[0].numpy() - exact).max())
    assert errors[1] <= errors[0] and errors[1] < 1e-3, errors


def test_host_builds_use_it_gpu_builds_keep_tvms():
    """The fuse stage swaps the KV cache's RoPE kernel on host-cpu only; the settings attribute is gone
    after it either way."""
    from test_coverage import SMALL

    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.models import config_from_hf
    from pipeline.stages import Loaded, define, fuse

    loaded = Loaded(ModelSpec(name="small", hf_config=SMALL, weights=None), SMALL, config_from_hf(SMALL), None)
    for name, kernel in (("host-cpu", "cpu_rope"), ("android-adreno", None)):
        target = load_target(name)
        mod = fuse(define(loaded, load_quant("q0f32"), target), target)
        rope = [f for gv, f in mod.functions_items() if gv.name_hint in cpu_rope.ROPE_FUNCS]
        assert len(rope) == 1
        attrs = dict(rope[0].attrs)
        assert cpu_rope.ROPE_ATTR not in attrs
        assert (str(attrs["mlp.kernel"]) if "mlp.kernel" in attrs else None) == kernel


def test_interleaved_rope_keeps_tvms_kernel():
    """GPT-J-style (interleaved pairs) rotation is not what the table kernel computes: no replacement."""
    settings = cpu_rope.rope_args(1e4, 1, 64, 4, 2, "float32", {"rope_type": "gptj"}, 64)
    func = llama_rope_with_position_map(1e4, 1.0, 64, 4, 2, "float32", {"rope_type": "gptj"}, 64)
    assert cpu_rope.kernel_for(func.with_attr(cpu_rope.ROPE_ATTR, settings)) is None
    assert cpu_rope.kernel_for(func) is None     # no settings: nothing to build from
