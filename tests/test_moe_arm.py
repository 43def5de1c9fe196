"""android-cpu's MoE expert kernels: `moe_gate_up` / `moe_down` built for the android-cpu target (aarch64 +
dotprod, what models/moe.expert_dot chooses "dotprod" for: q4 / q8 rows take kernels/cpu/expert_arm.py's sdot
dot), executed under qemu-aarch64 through the project's harness (pipeline/verify/qemu_aarch64.py) and their
objects read with llvm-objdump.

Tolerances, each of the output's scale (max |reference|): against the exact float64 MoE on the dequantized
weights within 1e-4 (fp32 activations; x held in two bytes per value, half a step of 1 / 32512 of its group's
largest |x|: test_arm_kernels' TWO_BYTE_X_TOLERANCE) or 4 fp16 ulps (fp16 activations, android-cpu's own: the outputs
are rounded to fp16); against test_arm_kernels' emulation of the kernels' arithmetic (x rounded per group of
32 exactly as arm.py rounds it, exact integer group sums) within 1e-5 (fp32); bit-identical with 1 and 4 tasks
per parallel loop. Formats and K the sdot dot does not take (here t3) keep the fp32 form: no sdot in their
code, within 1e-5 of the exact product.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_arm_kernels import FP16_ULP, TWO_BYTE_X_TOLERANCE, _emulated
from test_moe import _stored

from pipeline.kernels.cpu.arm_code import find_objdump
from pipeline.models.moe_kernels import moe_down, moe_gate_up
from pipeline.verify.qemu_aarch64 import build_kernels, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()} (`make system-deps`)")

E, TOP_K, TOKENS = 3, 2, 2
# name: (projection, format, H, M, activation dtype, expert_dot). K (H for gate_up, M for down) = 320 / 160 / 96:
# 10 / 5 / 3 groups of 32 (every K a q4 / q8 expert takes is whole groups). Rows per work item: gate_up 2 outputs
# = 4 rows (M odd: 1 output, 2 rows); down 4 rows (H not a multiple of 4: 2 rows, or 1).
CASES = {
    "gu_q4": ("gate_up", "q4", 320, 160, "float32", "dotprod"),
    "dn_q4": ("down", "q4", 320, 160, "float32", "dotprod"),
    "gu_q8": ("gate_up", "q8", 320, 160, "float32", "dotprod"),
    "dn_q8": ("down", "q8", 320, 160, "float32", "dotprod"),
    "gu_q4_fp16": ("gate_up", "q4", 96, 64, "float16", "dotprod"),
    "dn_q4_fp16": ("down", "q4", 96, 64, "float16", "dotprod"),
    "gu_q4_odd_m": ("gate_up", "q4", 96, 33, "float32", "dotprod"),
    "dn_q4_h66": ("down", "q4", 66, 96, "float32", "dotprod"),
    "dn_q8_h33": ("down", "q8", 33, 96, "float32", "dotprod"),
    "gu_t3_fp32_form": ("gate_up", "t3", 96, 64, "float32", "dotprod"),
    "dn_t3_fp32_form": ("down", "t3", 96, 64, "float32", "dotprod"),
    "gu_q4_fp32_form": ("gate_up", "q4", 320, 160, "float32", None),
    "dn_q4_fp32_form": ("down", "q4", 320, 160, "float32", None),
}
SDOT_CASES = [name for name, case in CASES.items() if case[1] in ("q4", "q8") and case[5] == "dotprod"]


def _target():
    from pipeline.config import load_target

    return load_target("android-cpu").tvm()


def _kernel(name: str):
    proj, fmt, H, M, act, dot = CASES[name]
    if proj == "gate_up":
        return moe_gate_up(E, M, H, TOP_K, act, fmt, expert_dot=dot, name=name)
    return moe_down(E, H, M, TOP_K, act, fmt, expert_dot=dot, name=name)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(kernels with 1 task per parallel loop, with 4, the library's objects)."""
    return build_kernels({name: _kernel(name) for name in CASES}, _target(), "moe_", tmp_path_factory.mktemp("moe_arm"))


def test_android_cpu_takes_the_sdot_expert_dot():
    """models/moe.expert_dot: "dotprod" for android-cpu and android-hexagon's CPU half, "avx2" stays x86's, none on
    a GPU target."""
    from pipeline.config import load_target
    from pipeline.models.moe import expert_dot

    assert expert_dot(_target()) == "dotprod"
    assert expert_dot(load_target("android-hexagon").tvm()) == "dotprod"
    assert expert_dot(load_target("android-adreno").tvm()) is None
    with pytest.raises(ValueError, match="expert_dot"):
        moe_gate_up(E, 32, 64, TOP_K, "float32", "q4", expert_dot="neon")


def _inputs(name: str, rng):
    """(kernel arguments, dequantized weight [E, rows, K] fp32, codes, scales) with x / h holding a zero group."""
    proj, fmt, H, M, act, _ = CASES[name]
    rows, k = (2 * M, H) if proj == "gate_up" else (H, M)
    args, weight = _stored(fmt, (rng.standard_normal((E, rows, k)) * 0.1).astype(np.float32))
    idx = np.array([[2, 0], [1, 2]], np.int32)
    if proj == "gate_up":
        x = rng.standard_normal((TOKENS, H)).astype(act)
        x[1, :32] = 0      # a group of zeros: step 0
        return [x, idx, *args, np.zeros((TOKENS, TOP_K, M), act)], weight, args
    h = rng.standard_normal((TOKENS, TOP_K, M)).astype(act)
    h[0, 1, 32:64] = 0
    w = np.array([[0.7, 0.3], [0.4, 0.6]], np.float32)
    return [h, idx, w, *args, np.zeros((TOKENS, H), act)], weight, args


def _silu_mul(g, u):
    return g / (1 + np.exp(-g)) * u


def _reference(name: str, args, weight, codes_scales, emulate: bool):
    """The exact float64 MoE on the dequantized weights, or (emulate) test_arm_kernels' emulation of the sdot
    arithmetic per expert (x quantized per group of 32 as arm.py does)."""
    proj, fmt, H, M, _, _ = CASES[name]
    idx = args[1]

    def dot(e, x_row, rows):
        if emulate:
            codes, scales = (a[e] for a in codes_scales)
            return _emulated(fmt, codes, scales, x_row[None, None, :], 2)[0][rows]
        return weight[e].astype(np.float64)[rows] @ x_row.astype(np.float64)

    if proj == "gate_up":
        x = args[0]
        return np.array([[_silu_mul(dot(e, x[t], slice(0, M)), dot(e, x[t], slice(M, 2 * M))) for e in idx[t]]
                         for t in range(TOKENS)])
    h, w = args[0], args[2]
    return np.array([sum(w[t, j] * dot(e, h[t, j], slice(None)) for j, e in enumerate(idx[t]))
                     for t in range(TOKENS)])


@pytest.mark.parametrize("name", list(CASES))
def test_expert_kernels_match_numpy_under_qemu(built, name):
    _, fmt, _, _, act, dot = CASES[name]
    args, weight, codes_scales = _inputs(name, np.random.default_rng(len(name)))
    one_task, four_tasks, _ = built
    got = one_task.call(name, args)[-1]
    assert np.array_equal(got, four_tasks.call(name, args)[-1]), "result depends on the task count"
    got = got.astype(np.float64)
    exact = _reference(name, args, weight, codes_scales, emulate=False)
    scale = np.abs(exact).max()
    total = np.abs(got - exact).max() / scale
    output = 4 * FP16_ULP if act == "float16" else 1e-5      # the output's own rounding
    integer = name in SDOT_CASES
    if integer and act == "float32":
        emulated = _reference(name, args, weight, codes_scales, emulate=True)
        own = np.abs(got - emulated).max() / scale
        print(f"\n{name}: vs emulation {own:.2e}, vs exact fp64 {total:.2e} (of the output's scale)")
        assert own <= 1e-5, own
    else:
        print(f"\n{name}: vs exact fp64 {total:.2e} (of the output's scale)")
    assert total <= (max(output, TWO_BYTE_X_TOLERANCE) if integer else output), total


def _own_code(name: str, folder):
    """The instructions of kernel `name` built alone for android-cpu, per symbol (its parallel loop bodies are
    unnamed local code that llvm-objdump lists under the preceding symbol: alone in an object, they are its own)."""
    import tvm
    from tvm.support import tar

    from pipeline.kernels.cpu.arm_code import disassemble, functions, tar_objects

    folder.mkdir()
    tvm.tirx.build(tvm.IRModule({name: _kernel(name)}), target=_target()).export_library(
        str(folder / "lib.tar"), fcompile=tar.tar)
    return functions(disassemble(tar_objects(folder / "lib.tar", folder)[0], find_objdump()))


def _fp32_loop_per_weight(code: dict, weights: int) -> float:
    """Instructions per weight of the fp32 form's hot loop: the shortest loop holding at least weights / 4
    `fmla`s (one per 4 weights: each weight needs its fp32 multiply-add), `weights` per iteration (rows x 32)."""
    import re

    best = None
    for insns in code.values():
        for i, insn in enumerate(insns):
            target = re.search(r"0x([0-9a-f]+)", insn.operands) if re.fullmatch(r"b\.\w+|cbn?z", insn.mnemonic) else None
            if target and int(target.group(1), 16) < insn.address:
                body = [c for c in insns[: i + 1] if c.address >= int(target.group(1), 16)]
                if sum(c.mnemonic == "fmla" for c in body) >= weights // 4 and (best is None or len(body) < best):
                    best = len(body)
    assert best is not None, "no fp32 dot loop found"
    return best / weights


def test_expert_objects_use_sdot_and_the_fp32_form_does_not(tmp_path):
    """Read from each kernel's own object: the q4 / q8 kernels built with expert_dot="dotprod" run sdot in a vector
    hot loop of at most 0.52 instructions per weight (4 rows x 32 weights per group; measured at these shapes: q4
    gate_up 0.484, down 0.467, q8 0.438 / 0.405), at most a third of the fp32 form's on the same target (q4: 1.85
    / 1.77); the fp32 form (no expert_dot, or t3 rows) holds no dot instruction."""
    from pipeline.kernels.cpu.arm_code import hot_loop

    if find_objdump() is None:
        pytest.skip("needs llvm-objdump (Debian llvm)")
    sdot = {}
    for name in ("gu_q4", "dn_q4", "gu_q8", "dn_q8"):
        code = _own_code(name, tmp_path / name)
        loops = [loop for loop in map(hot_loop, code.values()) if loop is not None]
        assert loops, f"{name}: no dot instruction in its code"
        loop = min(loops, key=lambda m: m.per_weight(2))
        mnemonics = {c.mnemonic for insns in code.values() for c in insns if c.dot}
        sdot[name] = loop.per_weight(2)      # x in two bytes: each weight meets two sdot's
        print(f"{name}: hot loop {loop.instructions} instructions ({loop.vector} vector), {loop.dots} sdot, "
              f"{sdot[name]:.3f} per weight")
        assert mnemonics == {"sdot"} and loop.vector >= 0.75 * loop.instructions, (name, mnemonics, loop)
        assert sdot[name] <= 0.52, (name, loop)
    fp32 = {}
    for name, rows in (("gu_q4_fp32_form", 4), ("dn_q4_fp32_form", 2), ("gu_t3_fp32_form", 4)):
        code = _own_code(name, tmp_path / name)
        assert not any(c.dot for insns in code.values() for c in insns), f"{name} holds a dot instruction"
        if name.endswith("q4_fp32_form"):
            fp32[name] = _fp32_loop_per_weight(code, rows * 32)
            print(f"{name}: fp32 hot loop {fp32[name]:.3f} instructions per weight")
    assert sdot["gu_q4"] * 3 <= fp32["gu_q4_fp32_form"] and sdot["dn_q4"] * 3 <= fp32["dn_q4_fp32_form"], (sdot, fp32)
