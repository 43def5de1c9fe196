"""The i8mm class's smmla prefill matmul (pipeline/kernels/cpu/arm_mmla.py): executed under qemu-aarch64 (its
default CPU, `max`, has i8mm) against numpy, its object code read with llvm-objdump, and chosen only where the
target's CPU class has i8mm.

Each kernel is built for aarch64 (+dotprod +i8mm) into one system-lib object, linked with the project's C
harness and run on random codes (stored row-interleaved as the converter stores them for android-cpu), fp16
scales and activations, for prompts of 1, 2, 5, 7 and 8 rows (pairs of rows per smmla; an odd prompt's last
row paired with itself; 2 pairs per pass, then a lone pair). Tolerances, as tests/test_arm_kernels.py's int8
cases: against a numpy emulation of the kernel's arithmetic (x rounded to int8 per group of 32, exact integer
sums, fp64 after) within 4 fp16 ulps of the output's scale (fp32 outputs: 1e-5); against the exact fp64
product within 2% (int8 x: llama.cpp's Q8_0 precision); bit-identical with 1 and 4 tasks per parallel loop.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_arm_kernels import FP16_ULP, INT8_X_TOLERANCE, _emulated, _exact, _inputs

from pipeline.kernels.cpu.arm_code import disassemble, dot_kernels, find_objdump, functions
from pipeline.kernels.cpu.arm_mmla import mmla_kernel
from pipeline.kernels.cpu.packed import NK_FORMATS
from pipeline.quant.quantize import interleave_q8, tile_kn
from pipeline.verify.qemu_aarch64 import build_kernels, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()} (`make system-deps`)")

TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon", "+fullfp16", "+dotprod", "+i8mm"]}
# name: (format, N, K, rows per tile, act); SmolLM2's K = 576 (not a multiple of 256), 4-row tiles over 3 and 5
# groups, fp32 activations (each TVMScript kernel takes ~1 s to parse: few cases)
CASES = {
    "mmla_q4_576x576": ("q4", 576, 576, 8, "float16"),
    "mmla_q4_tile4_k96": ("q4", 64, 96, 4, "float16"),
    "mmla_q8_128x576": ("q8", 128, 576, 8, "float16"),
    "mmla_q8_tile4_fp32": ("q8", 64, 160, 4, "float32"),
}
PROMPTS = (1, 2, 5, 7, 8)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(kernels with 1 task per parallel loop, with 4, the library's objects)."""
    out = tmp_path_factory.mktemp("mmla")
    funcs = {name: mmla_kernel(NK_FORMATS[f], n, k, t, act).with_attr("global_symbol", name)
             for name, (f, n, k, t, act) in CASES.items()}
    return build_kernels(funcs, TARGET, "arm_", out)


@pytest.mark.parametrize("name", list(CASES))
def test_smmla_prefill_matches_numpy_under_qemu(built, name):
    one_task, four_tasks, _ = built
    fmt, n, k, tile, act = CASES[name]
    worst = []
    for rows in PROMPTS:
        codes, scales, x, out = _inputs(fmt, n, k, act, rows, np.random.default_rng(rows + len(name)))
        stored = interleave_q8(codes, tile) if fmt == "q8" else tile_kn(codes.T, tile)
        args = [stored, tile_kn(scales.T, tile), x, out]
        got = one_task.call(name, args)[-1]
        assert np.array_equal(got, four_tasks.call(name, args)[-1]), f"{rows} rows: result depends on the task count"
        got = got[0].astype(np.float64)
        exact = _exact(fmt, codes, scales, x)
        scale = np.abs(exact).max()
        own = np.abs(got - _emulated(fmt, codes, scales, x, 1)).max() / scale
        total = np.abs(got - exact).max() / scale
        assert own <= (4 * FP16_ULP if act == "float16" else 1e-5), (rows, own)
        assert total <= INT8_X_TOLERANCE, (rows, total)
        worst.append((own, total))
    print(f"\n{name}: worst vs emulation {max(w[0] for w in worst):.2e}, vs exact fp64 {max(w[1] for w in worst):.2e}")


def _dot_loops(code) -> list[tuple[int, int, set[str]]]:
    """(smmla count, instructions, mnemonics) of every loop (a backward branch's body) holding dot products."""
    loops = []
    for i, insn in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", insn.operands) if re.fullmatch(r"b\.\w+|cbn?z", insn.mnemonic) else None
        if target and int(target.group(1), 16) < insn.address:
            body = [c for c in code[: i + 1] if c.address >= int(target.group(1), 16)]
            if any(c.dot for c in body):
                loops.append((sum(c.mnemonic == "smmla" for c in body), len(body), {c.mnemonic for c in body}))
    return loops


def test_prefill_objects_run_smmla(built):
    """Read from the object: every kernel's dot products are smmla (no sdot), and the loop over a tile's
    groups for two pairs of prompt rows (8-row tiles: 4 words x 4 row pairs x 2 prompt pairs = 32 smmla per
    group) costs at most 0.13 instructions per weight and prompt row for q4 (measured 0.122), 0.12 for q8
    (0.112); sdot prefill (arm_rows.py, two-byte x): 0.25 / 0.227."""
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    found = dot_kernels(built[2], objdump, x_bytes=1)
    assert set(found) == set(CASES), sorted(found)
    code = functions(disassemble(built[2][0], objdump))
    for name in CASES:
        mnemonics = {c.mnemonic for c in code[f"{name}_compute_"]}
        assert "smmla" in mnemonics and "sdot" not in mnemonics, name
    for name, limit in (("mmla_q4_576x576", 0.13), ("mmla_q8_128x576", 0.12)):
        loops = _dot_loops(code[f"{name}_compute_"])
        length = min(n for smmla, n, _ in loops if smmla == 32)
        per_weight_row = length / (32 * 32)          # smmla: 2 x 8 x 2 = 32 products
        print(f"{name}: {length} instructions per group and 2 x 2 prompt rows, {per_weight_row:.3f} per weight and row")
        assert per_weight_row <= limit, (name, length)


def test_library_reading_and_coverage_name_smmla(built):
    """The build's reading of a library (arm_code.library_dot_code -> build.json -> coverage): each smmla kernel
    found with smmla as its dot instruction and its densest loop (two prompt pairs) per weight and prompt row;
    the coverage line names smmla and the kernels that run it."""
    from pipeline.kernels.cpu.arm import X_BYTES
    from pipeline.kernels.cpu.arm_code import library_dot_code
    from pipeline.report.coverage import _dot_code_line, add_dot_code

    if find_objdump() is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    code = library_dot_code(built[2][0].parent.parent / "lib.tar", "", X_BYTES)
    assert set(code["kernels"]) == set(CASES)
    assert all(k["dot_mnemonics"] == ["smmla"] for k in code["kernels"].values()), code["kernels"]
    assert code["kernels"]["mmla_q4_576x576"]["instructions_per_weight"] <= 0.13, code["kernels"]
    report = {"kernels": [{"name": name, "op_class": "dequant-matmul"} for name in CASES], "summary": {}}
    add_dot_code(report, code)
    line = _dot_code_line(report["summary"]["dot_code"])
    assert f"{len(CASES)} of {len(CASES)} quantized matmul kernels run sdot or smmla" in line, line
    assert f"smmla (i8mm) in {len(CASES)}: " in line and all(name in line for name in CASES), line


def test_i8mm_only_in_the_i8mm_class():
    """The rule's gate (probe.has_i8mm) from the targets the classes give: android-cpu's own class (dotprod) has
    none, the i8mm class has it, host-cpu is no AArch64 target."""
    import dataclasses

    from pipeline.config import load_target
    from pipeline.kernels.cpu.probe import has_dotprod, has_i8mm

    target = load_target("android-cpu")
    assert has_dotprod(target.tvm()) and not has_i8mm(target.tvm())
    assert has_i8mm(dataclasses.replace(target, cpu_class="i8mm").tvm())
    assert not has_i8mm(load_target("host-cpu").tvm())


@pytest.mark.slow   # ~15 s per scheme on 2 loaded cores (define + fuse, four kernels parsed): make test-slow
@pytest.mark.parametrize("scheme", ["q4f16", "q8f16"])
def test_smmla_only_for_the_i8mm_class(scheme):
    """The schedule rule on a SmolLM2-shaped layer's fused functions (android-cpu; the first prefill matmul and
    decode GEMV of row-interleaved q4 / q8 codes: each kernel takes ~1 s to parse): with the i8mm class the
    prefill matmul takes the smmla kernel and the decode GEMV stays on sdot (arm_rows.py); with the dotprod
    class (the target's own) neither runs smmla."""
    import dataclasses

    from test_qemu_aarch64 import SMOLLM2_SHAPE
    from tvm import tirx

    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.kernels.cpu.packed import OP_CLASS_ATTR, TILED_Q4, TILED_Q8
    from pipeline.kernels.cpu.recognize import match_packed_nk_gemv
    from pipeline.kernels.cpu.schedule import CPUArmDot
    from pipeline.models.llama import DecoderConfig
    from pipeline.stages import Loaded, define, fuse

    shape = {**SMOLLM2_SHAPE, "num_hidden_layers": 1}
    loaded = Loaded(ModelSpec(name="smollm2-shape", hf_config=shape, weights=None), shape,
                    DecoderConfig.from_hf(shape), None)
    target = load_target("android-cpu")
    mod = fuse(define(loaded, load_quant(scheme), target), target)      # the same functions for both classes
    stored = {"q4f16": TILED_Q4, "q8f16": TILED_Q8}[scheme]
    funcs = {}
    for gv, func in mod.functions_items():
        match = match_packed_nk_gemv(func, rows="prompt") or match_packed_nk_gemv(func, rows="one")
        if isinstance(func, tirx.PrimFunc) and match is not None and match[0] == stored:
            funcs.setdefault("prefill" if match_packed_nk_gemv(func, rows="prompt") else "decode", (gv.name_hint, func))
    assert set(funcs) == {"prefill", "decode"}, sorted(mod.get_global_vars())
    chosen = {}
    for cls in ("dotprod", "i8mm"):
        tvm_target = dataclasses.replace(target, cpu_class=cls).tvm()
        for role, (name, func) in funcs.items():
            sch = CPUArmDot().apply(func, tvm_target, False)
            assert sch is not None, (cls, name)
            chosen[cls, role] = (str(sch.mod["main"].attrs[OP_CLASS_ATTR]), "smmla" in sch.mod.script())
    assert chosen == {("i8mm", "prefill"): ("dequant-matmul", True), ("i8mm", "decode"): ("dequant-gemv", False),
                      ("dotprod", "prefill"): ("dequant-matmul", False), ("dotprod", "decode"): ("dequant-gemv", False)}
