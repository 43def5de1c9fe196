"""android-cpu's t3 sdot kernel (pipeline/kernels/cpu/arm_t3.py): executed under qemu-aarch64 against numpy, its
object code read, and chosen for every NK t3 dequantize-matmul of an android-cpu build.

Codes are random trits packed by the project's own packer (quant/ternary.pack: every byte value 0..242 occurs),
some weight groups all zero and one block of x all zero; K of one group, several, SmolLM2's 576 (a short
last group) and 1536, and K not a multiple of 20 (a padded last word); N not a multiple of the 4-row task.
Tolerances as tests/test_arm_kernels.py's: against a numpy emulation of the kernel's own arithmetic within 4
fp16 ulps of the output's scale (1e-5 for fp32 outputs), against the exact fp64 product within the same or
1e-4 (two-byte x) / 2% (int8 x); 1 and 4 tasks per parallel loop bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_arm_kernels import TARGET, assert_matches_emulation

from pipeline.kernels.cpu.arm_code import dot_kernels, find_objdump
from pipeline.kernels.cpu.arm_t3 import WINDOW, t3_dot_kernel, window_start, x_position
from pipeline.quant.quantize import tile_kn
from pipeline.quant.ternary import pack
from pipeline.verify.qemu_aarch64 import build_kernels, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()} (`make system-deps`)")

# name: (N, K, activation dtype, prompt, bytes per x value, layout); each kernel takes 6-10 s to build, so the
# default suite builds android-cpu's form (rows interleaved by 4: SmolLM2's down_proj, and a 5-row prompt at K =
# 576, a short last group), the slow one KN (android-hexagon's CPU half), plain NK rows (a padded last word,
# N not a multiple of 4, int8 x) and the rest
CASES = {
    "t3_rows_576x1536": (576, 1536, "float16", False, 2, "rows"),
    "t3_rows_prompt": (64, 576, "float16", True, 2, "rows"),
}
SLOW_CASES = {
    "t3_kn_64x576": (64, 576, "float16", False, 2, "KN"),
    "t3_36x150_int8": (36, 150, "float32", False, 1, "NK"),
    "t3_576x576": (576, 576, "float16", False, 2, "NK"),
    "t3_70x256": (70, 256, "float16", False, 2, "NK"),
    "t3_prompt": (64, 576, "float16", True, 2, "NK"),
    "t3_256x1536": (256, 1536, "float16", False, 2, "NK"),
    "t3_30x128": (30, 128, "float32", False, 2, "NK"),
    "t3_kn_prompt": (32, 150, "float32", True, 1, "KN"),
}
PROMPT_ROWS = 5


def _build(cases: dict, out):
    funcs = {name: t3_dot_kernel(n, k, act, "float16", prompt, x_bytes, layout).with_attr("global_symbol", name)
             for name, (n, k, act, prompt, x_bytes, layout) in cases.items()}
    return build_kernels(funcs, TARGET, "t3_", out)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(CASES, tmp_path_factory.mktemp("t3"))


@pytest.fixture(scope="module")
def built_slow(tmp_path_factory):
    return _build(SLOW_CASES, tmp_path_factory.mktemp("t3_slow"))


def _inputs(n: int, k: int, act: str, rows: int, rng):
    trits = rng.integers(-1, 2, (n, -(-k // 128) * 128)).astype(np.int8)
    trits[::7, :128] = 0                      # zero groups
    trits[:, k:] = 0
    scales = (rng.standard_normal((n, -(-k // 128))) * 0.02).astype(np.float16)
    x = rng.standard_normal((1, rows, k)).astype(act)
    x[0, 0, k // 128 * 128 - 128: k // 128 * 128] = 0 if k >= 256 else x[0, 0, :128]   # one block of x zero
    return [pack(trits, "t3", k), scales, x, np.zeros((1, rows, n), act)]


def test_x_positions_are_distinct_slots_of_their_group():
    for g in range(7):
        slots = [x_position(g, j) for j in range(128)]
        assert len(set(slots)) == 128 and min(slots) >= g * 160 and max(slots) < (g + 1) * 160, g


def test_every_trit_of_a_window_is_its_groups():
    """Word w of a row holds trits 20 w .. 20 w + 19; group g's window (8 words from window_start) covers its 128."""
    for g in range(10):
        first, last = window_start(g), (g * 128 + 127) // 20
        assert first * 20 <= g * 128 < (first + 1) * 20 and last - first < WINDOW, g


@pytest.mark.parametrize("name", [*CASES, *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW_CASES)])
def test_t3_kernel_matches_numpy_under_qemu(request, name):
    built = request.getfixturevalue("built" if name in CASES else "built_slow")
    n, k, act, prompt, x_bytes, layout = {**CASES, **SLOW_CASES}[name]
    args = _inputs(n, k, act, PROMPT_ROWS if prompt else 1, np.random.default_rng(len(name)))
    given = args      # the kernel's layout of the NK codes and scales: KN, or 4 rows interleaved (tile_kn of KN)
    if layout != "NK":
        given = [np.ascontiguousarray(a.T) if layout == "KN" else tile_kn(np.ascontiguousarray(a.T), 4)
                 for a in args[:2]] + args[2:]
    assert_matches_emulation(built, name, given, "t3", args[:3], act, x_bytes)


def _object_loops(kernels):
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    found = dot_kernels(kernels[2], objdump, x_bytes=2)
    for name, mix in sorted(found.items()):
        print(f"{name}: {mix['dot_instructions']} sdot, hot loop {mix['loop_instructions']} instructions "
              f"({mix['loop_vector']} vector)")
        assert mix["dot_mnemonics"] == ["sdot"] and mix["loop_vector"] >= 0.75 * mix["loop_instructions"], (name, mix)
    return found


# the group loop (4 rows x 128 weights, 80 sdot with two-byte x), measured: rows interleaved by 4 (android-cpu's
# t3_interleave) 238 instructions (0.46 per weight), KN 229 (0.45), plain NK rows 331 (0.65)
LOOP_LIMITS = {"t3_rows_576x1536": 245, "t3_kn_64x576": 235, "t3_576x576": 340}


def test_t3_objects_use_sdot_in_their_group_loop(built):
    """Read from the object: each t3 kernel's hottest loop is sdot-based and mostly vector instructions."""
    found = _object_loops(built)
    assert set(found) == set(CASES), sorted(found)
    for name in set(LOOP_LIMITS) & set(found):
        assert found[name]["loop_instructions"] <= LOOP_LIMITS[name] and found[name]["dot_instructions"] >= 80, (
            name, found[name])


@pytest.mark.slow
def test_plain_nk_t3_objects_use_sdot_in_their_group_loop(built_slow):
    found = _object_loops(built_slow)
    assert set(found) == set(SLOW_CASES), sorted(found)
    for name in set(LOOP_LIMITS) & set(found):
        assert found[name]["loop_instructions"] <= LOOP_LIMITS[name] and found[name]["dot_instructions"] >= 80, (
            name, found[name])
