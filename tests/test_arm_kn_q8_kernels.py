"""android-hexagon's CPU-half sdot kernel over KN q8 codes (pipeline/kernels/cpu/arm_kn_q8.py): executed under
qemu-aarch64 against numpy, and its object code read.

Built for aarch64 (+dotprod) into one system-lib object, linked with the project's C harness and run on random
int8 codes, fp16 scales and activations. Tolerances against the exact fp64 product of the dequantized weights,
of the output's largest magnitude: two-byte x (the default) within 1e-3 (x's rounding is 1 / 65024 of a group's
largest |x| per value; the fp16 output's own rounding is up to 2^-11), int8 x within 2e-2; 1 and 4 tasks per
parallel loop bit-identical (a task owns whole output columns).
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.kernels.cpu.arm_code import dot_kernels, find_objdump
from pipeline.kernels.cpu.arm_kn_q8 import BLOCK, kn_q8_dot_kernel, task_span
from pipeline.verify.qemu_aarch64 import build_kernels, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()} (`make system-deps`)")

TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon", "+fullfp16", "+dotprod"]}
# name: (N, K, activation dtype, prompt, bytes per x value): SmolLM2's shapes (gate_up's K x N, down, k / v),
# prompts, an odd shape (16-column tasks, 3 groups), fp32, int8 x
CASES = {
    "up": (1536, 576, "float16", False, 2),
    "down": (576, 1536, "float16", False, 2),
    "kv": (192, 576, "float16", False, 2),
    "prompt_down": (576, 1536, "float16", True, 2),
    "prompt_kv": (192, 576, "float16", True, 2),
    "odd": (48, 96, "float16", False, 2),
    "fp32": (64, 256, "float32", False, 2),
    "int8_x": (576, 1536, "float16", False, 1),
}
PROMPT_ROWS = 5
TOLERANCE = {2: 1e-3, 1: 2e-2}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("arm_kn_q8")
    funcs = {name: kn_q8_dot_kernel(n, k, act, "float16", prompt, x_bytes).with_attr("global_symbol", name)
             for name, (n, k, act, prompt, x_bytes) in CASES.items()}
    return build_kernels(funcs, TARGET, "knq8_", out)


def test_task_spans():
    """64 columns per task where that leaves 8 tasks or more (whole cache lines of each code row), else 16."""
    assert [task_span(n) for n in (1536, 576, 192, 48)] == [64, 64, BLOCK, BLOCK]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_numpy(built, name):
    one, four, _ = built
    n, k, act, prompt, x_bytes = CASES[name]
    rows = PROMPT_ROWS if prompt else 1
    rng = np.random.default_rng(len(name))
    codes = rng.integers(-128, 128, (k, n), dtype=np.int8)
    codes[:4, :4] = -128                   # the extremes: |sum| bound of the int32 lanes
    scales = (rng.standard_normal((k // 32, n)) * 0.02).astype(np.float16)
    x = rng.standard_normal((1, rows, k)).astype(act)
    x[0, 0, 32:64] = 0                     # a group of zeros: step 0
    args = [codes, scales, x, np.zeros((1, rows, n), act)]
    got = one.call(name, args)[-1]
    weight = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), 32, axis=0)   # [K, N]
    exact = x.astype(np.float64) @ weight
    err = np.abs(got.astype(np.float64) - exact).max() / np.abs(exact).max()
    assert err <= TOLERANCE[x_bytes], err
    assert np.array_equal(got, four.call(name, args)[-1])


def test_object_code(built):
    """Every kernel's hot loop runs indexed sdot: <= 0.42 instructions per weight with two-byte x (a prompt's row
    pairs sharing each transpose: <= 0.33 per weight and row), <= 0.32 with int8 x (the transposing zips cost the
    same for both), >= 85% of them vector instructions."""
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    found = dot_kernels(built[2], objdump, "knq8_", 2)
    assert set(found) == set(CASES)
    for name, (_, _, _, prompt, x_bytes) in CASES.items():
        loop = found[name]
        assert loop["dot_mnemonics"] == ["sdot"], name
        per_weight = loop["instructions_per_weight"] * x_bytes / 2   # read with 2 bytes per x value
        assert per_weight <= (0.32 if x_bytes == 1 else 0.33 if prompt else 0.42), (name, per_weight)
        assert loop["loop_vector"] >= 0.85 * loop["loop_instructions"], name
