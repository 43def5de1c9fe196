"""android-hexagon's CPU-half sdot kernel over KN t2 / b1 codes (pipeline/kernels/cpu/arm_kn_signs.py): executed
under qemu-aarch64 against numpy, and its object code read.

Built for aarch64 (+dotprod) into one system-lib object, linked with the project's C harness and run on random
codes (t2: all four 2-bit values, 3 included, so every field's extraction shows), fp16 scales and activations.
Tolerances against the exact fp64 product of the dequantized weights, of the output's largest magnitude:
two-byte x (the default) within 1e-3 (x's rounding is 1 / 65024 of a group's largest |x| per value; the fp16
output's own rounding is up to 2^-11), int8 x within 2e-2; 1 and 4 tasks per parallel loop bit-identical (a
task owns whole output columns).
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.kernels.cpu.arm_code import dot_kernels, find_objdump
from pipeline.kernels.cpu.arm_kn_signs import kn_sign_dot_kernel
from pipeline.verify.qemu_aarch64 import build_kernels, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()} (`make system-deps`)")

TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon", "+fullfp16", "+dotprod"]}
# name: (format, N, K, activation dtype, prompt, bytes per x value): SmolLM2's shapes (K = 576: a last group of
# 64 values; K = 1536: whole groups), prompts, fp32, int8 x
CASES = {
    "t2_qkv": ("t2", 960, 576, "float16", False, 2),
    "t2_down": ("t2", 576, 1536, "float16", False, 2),
    "t2_prompt_kv": ("t2", 192, 576, "float16", True, 2),
    "t2_prompt_down": ("t2", 64, 1536, "float16", True, 2),
    "t2_fp32": ("t2", 48, 256, "float32", False, 2),
    "t2_int8_x": ("t2", 576, 1536, "float16", False, 1),
    "b1_qkv": ("b1", 960, 576, "float16", False, 2),
    "b1_down": ("b1", 576, 1536, "float16", False, 2),
    "b1_prompt_kv": ("b1", 192, 576, "float16", True, 2),
    "b1_prompt_down": ("b1", 64, 1536, "float16", True, 2),
    "b1_fp32": ("b1", 48, 256, "float32", False, 2),
    "b1_int8_x": ("b1", 576, 1536, "float16", False, 1),
}
PROMPT_ROWS = 5            # odd: a prompt's last row alone
TOLERANCE = {2: 1e-3, 1: 2e-2}
PER_WORD = {"t2": 16, "b1": 32}


def pack(fmt: str, codes: np.ndarray) -> np.ndarray:
    """KN words [K / per_word, N] of codes [K, N] (t2: 0..3 at bits 2 i; b1: 0 / 1 at bit i), as models/layers.py
    reads them."""
    per_word = PER_WORD[fmt]
    bits = 32 // per_word
    k, n = codes.shape
    lanes = codes.astype(np.uint64).reshape(k // per_word, per_word, n)
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)[None, :, None]
    return (lanes << shifts).sum(axis=1).astype(np.uint32)


def weights(fmt: str, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The dequantized W^T [K, N] in fp64: (code - 1) * s for t2, (2 bit - 1) * s for b1."""
    value = codes.astype(np.float64) - 1 if fmt == "t2" else 2 * codes.astype(np.float64) - 1
    return value * np.repeat(scales.astype(np.float64), 128, axis=0)[: codes.shape[0]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("arm_kn_signs")
    funcs = {name: kn_sign_dot_kernel(fmt, n, k, act, "float16", prompt, x_bytes).with_attr("global_symbol", name)
             for name, (fmt, n, k, act, prompt, x_bytes) in CASES.items()}
    return build_kernels(funcs, TARGET, "knsign_", out)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_numpy(built, name):
    one, four, _ = built
    fmt, n, k, act, prompt, x_bytes = CASES[name]
    rows = PROMPT_ROWS if prompt else 1
    rng = np.random.default_rng(len(name))
    codes = rng.integers(0, 4 if fmt == "t2" else 2, (k, n))
    codes[:, :4] = codes.max()              # the extremes: |sum| bound of the int32 lanes
    scales = (rng.standard_normal((-(-k // 128), n)) * 0.02).astype(np.float16)
    x = rng.standard_normal((1, rows, k)).astype(act)
    x[0, 0, 128:256] = 0                    # a group of zeros: step 0
    args = [pack(fmt, codes), scales, x, np.zeros((1, rows, n), act)]
    got = one.call(name, args)[-1]
    exact = x.astype(np.float64) @ weights(fmt, codes, scales)
    err = np.abs(got.astype(np.float64) - exact).max() / np.abs(exact).max()
    assert err <= TOLERANCE[x_bytes], err
    assert np.array_equal(got, four.call(name, args)[-1])


def test_object_code(built):
    """Every kernel's hot loop runs indexed sdot, >= 85% of it vector instructions, with two-byte x <= 0.28
    instructions per weight (t2: 6 field ops and 8 sdots per 64 codes; b1: 8 cmtst and 16 sdots per 128), a t2
    prompt's row pairs <= 0.26 per weight and row; int8 x <= 0.21 (the field ops are shared by fewer sdots)."""
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    found = dot_kernels(built[2], objdump, "knsign_", 2)
    assert set(found) == set(CASES)
    for name, (fmt, _, _, _, prompt, x_bytes) in CASES.items():
        loop = found[name]
        assert loop["dot_mnemonics"] == ["sdot"], name
        per_weight = loop["instructions_per_weight"] * x_bytes / 2   # read with 2 bytes per x value
        bound = 0.21 if x_bytes == 1 else 0.26 if prompt and fmt == "t2" else 0.28
        assert per_weight <= bound, (name, per_weight)
        assert loop["loop_vector"] >= 0.85 * loop["loop_instructions"], name
