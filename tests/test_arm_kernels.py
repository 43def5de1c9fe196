"""android-cpu's sdot kernels (pipeline/kernels/cpu/arm.py): executed under qemu-aarch64 against numpy, their
object code disassembled, and chosen for every NK q4 / q8 / t2 dequantize-matmul of an android-cpu build.

Each kernel is built for aarch64 (+dotprod) into one system-lib object, linked with the project's C harness
(pipeline/verify/native/kernel_harness.c) and run on random codes, fp16 scales and activations. Tolerances:
against a numpy emulation of the kernel's own arithmetic (x quantized to int8 per block as the kernel does,
exact integer group sums, fp64 afterwards) within 4 fp16 ulps of the output's scale (fp16 outputs: the kernel
rounds its fp32 sum once) or 1e-5 (fp32 outputs); against the exact fp64 product of the dequantized weights
within the same or 1e-4 with x in two bytes (the default: half a step of 1 / 32512 of a block's largest |x|
per value), within 2% of the output's scale with x in int8 (llama.cpp's Q8_0 precision); and bit-identical with 1 and 4 tasks per parallel loop (each output row is one
task's, whatever the thread count).
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.kernels.cpu.arm import Q_MAX, X_BYTES, dot_layout, nk_dot_kernel
from pipeline.kernels.cpu.arm_code import dot_kernels, find_objdump
from pipeline.kernels.cpu.arm_rows import interleaved_position, rows_dot_kernel
from pipeline.kernels.cpu.packed import NK_FORMATS
from pipeline.quant.quantize import interleave_q8, tile_kn
from pipeline.quant.ternary import unpack
from pipeline.verify.qemu_aarch64 import build_kernels, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()} (`make system-deps`)")

TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon", "+fullfp16", "+dotprod"]}
# name: (format, N, K, activation dtype, prompt, bytes per x value); SmolLM2's shapes (K = 576 / 1536; t2's last
# group of 64); two bytes (the default) and int8 (X_BYTES = 1)
CASES = {
    "q4_576x576": ("q4", 576, 576, "float16", False, 2),
    "q4_576x1536": ("q4", 576, 1536, "float16", False, 2),
    "q4_fp32": ("q4", 64, 256, "float32", False, 2),
    "q8_960x576": ("q8", 960, 576, "float16", False, 2),
    "t2_576x576": ("t2", 576, 576, "float16", False, 2),
    "t2_256x512": ("t2", 256, 512, "float16", False, 2),
    "q4_prompt": ("q4", 192, 576, "float16", True, 2),
    "q8_prompt": ("q8", 128, 576, "float16", True, 2),
    "t2_prompt": ("t2", 128, 576, "float16", True, 2),
    "q4_int8": ("q4", 576, 1536, "float16", False, 1),
    "q4_int8_fp32": ("q4", 64, 256, "float32", False, 1),
    "q8_int8_prompt": ("q8", 128, 576, "float16", True, 1),
    "t2_int8": ("t2", 576, 576, "float16", False, 1),
    "b1_576x576": ("b1", 576, 576, "float16", False, 2),
    "b1_256x512": ("b1", 256, 512, "float16", False, 2),
    "b1_prompt": ("b1", 128, 576, "float16", True, 2),
    "b1_int8_fp32": ("b1", 64, 576, "float32", False, 1),
}
# q4 / q8 / t2 rows interleaved (arm_rows.py, android-cpu's q4_interleave / q8_interleave / t2_interleave): name:
# (format, N, K, rows per tile, act, prompt, x bytes); t2 at K = 576 ends in a group of 64
ROW_CASES = {
    "rows8_576x576": ("q4", 576, 576, 8, "float16", False, 2),
    "rows8_576x1536": ("q4", 576, 1536, 8, "float16", False, 2),
    "rows4_960x576": ("q4", 960, 576, 4, "float16", False, 2),
    "rows8_fp32": ("q4", 64, 256, 8, "float32", False, 2),
    "rows8_prompt": ("q4", 192, 576, 8, "float16", True, 2),
    "rows8_int8": ("q4", 576, 1536, 8, "float16", False, 1),
    "rows4_int8_prompt": ("q4", 128, 576, 4, "float16", True, 1),
    "rows8_int8_prompt": ("q4", 128, 576, 8, "float16", True, 1),     # the prompt's default: 4 rows per pass
    "q8_rows8_960x576": ("q8", 960, 576, 8, "float16", False, 2),
    "q8_rows8_576x1536": ("q8", 576, 1536, 8, "float16", False, 2),
    "q8_rows8_prompt": ("q8", 128, 576, 8, "float16", True, 2),
    "q8_rows4_fp32": ("q8", 64, 256, 4, "float32", False, 2),
    "q8_rows8_int8": ("q8", 576, 576, 8, "float16", False, 1),
    "t2_rows8_960x576": ("t2", 960, 576, 8, "float16", False, 2),
    "t2_rows8_576x1536": ("t2", 576, 1536, 8, "float16", False, 2),
    "t2_rows8_prompt": ("t2", 128, 576, 8, "float16", True, 2),
    "t2_rows4_fp32": ("t2", 64, 256, 4, "float32", False, 2),
    "t2_rows8_int8": ("t2", 576, 576, 8, "float16", False, 1),
    "t2_rows8_int8_prompt": ("t2", 128, 576, 8, "float16", True, 1),
    "q8_rows8_int8_prompt": ("q8", 128, 576, 8, "float16", True, 1),
}
PROMPT_ROWS = 5
FP16_ULP = 2.0 ** -10
INT8_X_TOLERANCE = 2e-2
TWO_BYTE_X_TOLERANCE = 1e-4   # x within 1 / 65024 of its block's largest |x|


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(kernels with 1 task per parallel loop, with 4, the library's objects)."""
    out = tmp_path_factory.mktemp("arm")
    funcs = {name: nk_dot_kernel(NK_FORMATS[f], n, k, act, "float16", prompt, x_bytes).with_attr("global_symbol", name)
             for name, (f, n, k, act, prompt, x_bytes) in CASES.items()}
    funcs.update({name: rows_dot_kernel(NK_FORMATS[f], n, k, t, act, "float16", prompt, x_bytes).with_attr(
        "global_symbol", name) for name, (f, n, k, t, act, prompt, x_bytes) in ROW_CASES.items()})
    return build_kernels(funcs, TARGET, "arm_", out)


def _inputs(fmt: str, n: int, k: int, act: str, rows: int, rng):
    spec = NK_FORMATS[fmt]
    if spec.bits == 8:
        codes = rng.integers(-127, 128, (n, k)).astype(np.int8)
    else:
        codes = rng.integers(0, 2**32, (n, k // spec.codes), dtype=np.uint64).astype(np.uint32)
    scales = (rng.standard_normal((n, -(-k // spec.group))) * 0.02).astype(np.float16)
    x = rng.standard_normal((1, rows, k)).astype(act)
    return [codes, scales, x, np.zeros((1, rows, n), act)]


def _values(fmt: str, codes: np.ndarray, k: int) -> np.ndarray:
    """Integer weight values (step x code - offset) [N, K]."""
    spec = NK_FORMATS[fmt]
    if spec.bits == 8:
        return codes.astype(np.int64)
    if fmt == "t3":     # base 3 (arm_t3.py): the project's own reader
        return unpack(codes, "t3", k).astype(np.int64)
    fields = (codes[:, :, None] >> (spec.bits * np.arange(spec.codes, dtype=np.uint32))) & ((1 << spec.bits) - 1)
    return fields.reshape(codes.shape[0], -1)[:, :k].astype(np.int64) * spec.step - spec.offset   # b1: 2 bit - 1


def _exact(fmt: str, codes, scales, x) -> np.ndarray:
    k = x.shape[-1]
    group = NK_FORMATS[fmt].group
    weights = _values(fmt, codes, k) * np.repeat(scales.astype(np.float64), group, axis=1)[:, :k]
    return x[0].astype(np.float64) @ weights.T


def _emulated(fmt: str, codes, scales, x, x_bytes: int) -> np.ndarray:
    """The kernel's arithmetic: x rounded per block of the weight group (step max|x| / Q_MAX, in fp32 as the
    kernel computes it; two bytes: split exactly into 256 hi + lo), exact integer group sums, then scale *
    step per group."""
    q_max = Q_MAX[x_bytes]
    k, group = x.shape[-1], NK_FORMATS[fmt].group
    values = _values(fmt, codes, k)
    out = np.zeros((x.shape[1], codes.shape[0]))
    for r in range(x.shape[1]):
        xf = x[0, r].astype(np.float32)
        for g in range(-(-k // group)):
            block = xf[g * group:(g + 1) * group]
            amax = np.float32(np.abs(block).max())
            inv = np.float32(q_max) / amax if amax > 0 else np.float32(0)
            q = np.rint(block * inv).astype(np.int64)
            step = np.float64(amax * np.float32(1.0 / q_max))
            sums = values[:, g * group:g * group + len(block)] @ q
            out[r] += sums * scales[:, g].astype(np.float64) * step
    return out


def test_dot_layout_is_a_permutation_of_each_group():
    for fmt in ("q4", "q8", "t2", "b1"):
        group = NK_FORMATS[fmt].group
        assert sorted(dot_layout(NK_FORMATS[fmt], j) for j in range(group)) == list(range(group)), fmt


def assert_matches_emulation(built, name, args, fmt, plain, act, x_bytes):
    """Kernel `name` run with 1 and 4 tasks on `args` (its layout): bit-identical, and within the output's own
    rounding of the integer-arithmetic emulation and of the exact fp64 product of `plain` (NK codes, scales, x)."""
    one_task, four_tasks, _ = built
    got = one_task.call(name, args)[-1]
    assert np.array_equal(got, four_tasks.call(name, args)[-1]), "result depends on the task count"
    got = got[0].astype(np.float64)
    emulated, exact = _emulated(fmt, *plain, x_bytes), _exact(fmt, *plain)
    scale = np.abs(exact).max()
    own, total = np.abs(got - emulated).max() / scale, np.abs(got - exact).max() / scale
    print(f"\n{name}: vs emulation {own:.2e}, vs exact fp64 {total:.2e} (of the output's scale)")
    output = 4 * FP16_ULP if act == "float16" else 1e-5    # the output's own rounding
    assert own <= output, own
    assert total <= (INT8_X_TOLERANCE if x_bytes == 1 else max(output, TWO_BYTE_X_TOLERANCE)), total


@pytest.mark.parametrize("name", list(CASES))
def test_sdot_kernel_matches_numpy_under_qemu(built, name):
    fmt, n, k, act, prompt, x_bytes = CASES[name]
    args = _inputs(fmt, n, k, act, PROMPT_ROWS if prompt else 1, np.random.default_rng(len(name)))
    assert_matches_emulation(built, name, args, fmt, args[:3], act, x_bytes)


def test_gemv_objects_use_sdot_in_a_vector_loop(built):
    """Read from the object: every kernel's hottest loop is sdot-based and mostly vector instructions."""
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    x_bytes = {name: case[-1] for name, case in (*CASES.items(), *ROW_CASES.items())}
    found = {**dot_kernels(built[2], objdump, x_bytes=2), **{
        name: mix for name, mix in dot_kernels(built[2], objdump, x_bytes=1).items() if x_bytes[name] == 1}}
    assert set(found) == set(x_bytes), sorted(found)
    for name, mix in sorted(found.items()):
        print(f"{name}: {mix['dot_instructions']} sdot, hot loop {mix['loop_instructions']} instructions "
              f"({mix['loop_vector']} vector), {mix['instructions_per_weight']} per weight")
        assert mix["loop_vector"] >= 0.75 * mix["loop_instructions"], (name, mix)
        assert mix["instructions_per_weight"] <= (0.4 if x_bytes[name] == 1 else 0.55), (name, mix)
    # rows interleaved by 8: one 4-row vector per sdot, no horizontal add; measured q4 0.293 (two bytes), 0.215
    # (int8), q8 0.246, 0.168, t2 0.256 (plain NK t2: 0.332)
    limits = {"rows8_576x576": 0.30, "rows8_576x1536": 0.30, "rows8_prompt": 0.30, "rows8_int8": 0.22,
              "q8_rows8_960x576": 0.25, "q8_rows8_576x1536": 0.25, "q8_rows8_prompt": 0.25, "q8_rows8_int8": 0.17,
              "t2_rows8_960x576": 0.26, "t2_rows8_576x1536": 0.26}
    for name, limit in limits.items():
        assert found[name]["instructions_per_weight"] <= limit and found[name]["loop_vector"] >= 0.8 * found[name][
            "loop_instructions"], (name, found[name])


def test_library_dot_code_and_its_coverage_lines(built, tmp_path):
    """The build's reading of a library (compiler/backend.dot_code -> build.json -> coverage): every sdot kernel
    found with its loop, and the coverage summary says how many quantized matmuls run sdot and which do not."""
    from pipeline.kernels.cpu.arm_code import library_dot_code
    from pipeline.report.coverage import _dot_code_line, add_dot_code

    if find_objdump() is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    tar_path = built[2][0].parent.parent / "lib.tar"
    code = library_dot_code(tar_path, "", X_BYTES)
    assert set(code["kernels"]) == set(CASES) | set(ROW_CASES)
    code["kernels"] = {name: code["kernels"][name] for name in CASES}
    rows = [{"name": name, "op_class": "dequant-gemv"} for name in CASES] + [
        {"name": "scalar_gemv", "op_class": "dequant-gemv"}, {"name": "rms_norm", "op_class": "rmsnorm"}]
    report = {"kernels": rows, "summary": {}}
    add_dot_code(report, code)
    summary = report["summary"]["dot_code"]
    assert (summary["quantized_matmuls"], summary["with_dot"], summary["without_dot"]) == (len(CASES) + 1, len(CASES), ["scalar_gemv"])
    assert rows[0]["dot_code"]["dot_instructions"] > 0 and "dot_code" not in rows[-1]
    assert f"{len(CASES)} of {len(CASES) + 1} quantized matmul kernels run sdot" in _dot_code_line(summary)


def test_interleaved_position_is_a_permutation_of_each_group():
    for bits, group in ((4, 32), (8, 32), (2, 128), (2, 64)):
        assert sorted(interleaved_position(j, bits) for j in range(group)) == list(range(group)), (bits, group)


@pytest.mark.parametrize("name", list(ROW_CASES))
def test_interleaved_rows_kernel_matches_numpy_under_qemu(built, name):
    """q4 / q8 / t2 rows interleaved (the codes and scales as the converter stores them for android-cpu: q4 / t2
    quantize.tile_kn of the NK arrays transposed, q8 quantize.interleave_q8): against the same emulation and
    exact product as the plain kernels, within the same tolerances, and bit-identical with 1 and 4 tasks."""
    fmt, n, k, tile, act, prompt, x_bytes = ROW_CASES[name]
    codes, scales, x, out = _inputs(fmt, n, k, act, PROMPT_ROWS if prompt else 1, np.random.default_rng(len(name)))
    rows = interleave_q8(codes, tile) if fmt == "q8" else tile_kn(codes.T, tile)
    args = [rows, tile_kn(scales.T, tile), x, out]
    assert_matches_emulation(built, name, args, fmt, (codes, scales, x), act, x_bytes)


def test_prompt_rows_in_pairs_share_each_code_vector(built):
    """Read from the object: the interleaved prefill kernels' loop over a tile's groups for several prompt rows at
    once (arm_rows.PROMPT_ROWS: 2 with two-byte x, 4 with int8 x, the prompt's default) holds their sdot's in
    fewer instructions than one row at a time (the code loads and nibble splits serve all rows): measured q4
    0.25, q8 0.227 instructions per weight and row with two-byte x (0.297 / 0.246 one row at a time), q4 with
    int8 x and 4 rows 0.137."""
    import re

    from pipeline.kernels.cpu.arm_code import disassemble, functions

    objdump = find_objdump()
    if objdump is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    code = functions(disassemble(built[2][0], objdump))
    for name, rows, limit in (("rows8_prompt", 2, 0.26), ("q8_rows8_prompt", 2, 0.235), ("rows8_int8_prompt", 4, 0.14)):
        insns = code[f"{name}_compute_"]
        loops = []
        for i, insn in enumerate(insns):
            target = re.search(r"0x([0-9a-f]+)", insn.operands) if re.fullmatch(r"b\.\w+|cbn?z", insn.mnemonic) else None
            if target and int(target.group(1), 16) < insn.address:
                body = [c for c in insns[: i + 1] if c.address >= int(target.group(1), 16)]
                loops.append((sum(c.dot for c in body), len(body)))
        # per 8-row group step: 2 rows x 32 sdot (two-byte x) or 4 rows x 16 (int8 x), 256 weights per row
        step = min(length for dots, length in loops if dots == 64)
        assert step / (256 * rows) <= limit, (name, step)


def test_prompt_defaults_to_int8_x_and_decode_to_two_bytes():
    """rows_dot_kernel without x_bytes: a prompt's kernel is the int8 one, a decode GEMV's the two-byte one."""
    import tvm_ffi

    spec = NK_FORMATS["q4"]
    for prompt, x_bytes in ((True, 1), (False, 2)):
        assert tvm_ffi.structural_equal(rows_dot_kernel(spec, 128, 576, 8, prompt=prompt),
                                        rows_dot_kernel(spec, 128, 576, 8, prompt=prompt, x_bytes=x_bytes))
    assert not tvm_ffi.structural_equal(rows_dot_kernel(spec, 128, 576, 8, prompt=True),
                                        rows_dot_kernel(spec, 128, 576, 8, prompt=True, x_bytes=2))
