"""Every quantized GEMV / prefill matmul of a host-cpu build gets its hand-written kernel (kernels/cpu/gemv.py,
x86.py, prefill.py). The fast kernels are chosen by recognising the fused function (recognize.py); if that
recognition stops matching (a TVM change, a renamed TE block, a new fusion), the build still succeeds on the
slower scheduled kernels, so only a test like this one notices. The functions are found by the names relax
gives the fused dequantize + matmul, not by the recogniser itself."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_coverage import SMALL
from tvm import tirx

from pipeline.config import ModelSpec, load_quant, load_target
from pipeline.kernels.cpu.packed import OP_CLASS_ATTR
from pipeline.kernels.cpu.recognize import block_names
from pipeline.models import config_from_hf
from pipeline.stages import Loaded, define, fuse, tune

# relax's names for a fused dequantize (models/layers.py's TE, KN codes) + matmul, and for a cast + NT matmul
DEQUANT = re.compile(r"fused_dequantize_(q4|q8|t2|b1)_kn\d*_matmul\d*")
FLOAT_NT = re.compile(r"fused_cast\d*_NT_matmul\d*")
CPUS = {"avx2": "haswell", "vnni": "znver4", "plain": "x86-64"}   # fixed -mcpu: the same answer on any machine


@pytest.fixture(scope="module")
def loaded():
    return Loaded(ModelSpec(name="small", hf_config=SMALL, weights=None), SMALL, config_from_hf(SMALL), None)


def _scheduled(loaded, quant: str, cpu: str, tiled: bool = True):
    """The tuned module and schedule records of SMALL (SmolLM2's layer shapes) for host-cpu with `cpu`; tiled:
    host-cpu's own tiled q4 / q8 / t2 storage, else plain KN codes."""
    target = dataclasses.replace(load_target("host-cpu"),
                                 tvm_target={"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": CPUS[cpu]})
    if not tiled:
        target = dataclasses.replace(target, q8_tile=0, q4_tile=0, t2_tile=0)
    mod, records = tune(fuse(define(loaded, load_quant(quant), target), target), target)
    return mod, {r.name: r.rule for r in records}


def _kernels(mod, pattern):
    return {gv.name_hint: f for gv, f in mod.functions_items() if pattern.fullmatch(gv.name_hint)}


@pytest.mark.parametrize("quant,cpu,tiled,formats", [
    ("q4f16", "avx2", True, {"q4"}), ("q8f16", "avx2", True, {"q8"}), ("ternary_ptq", "avx2", True, {"t2", "q8"}),
    ("q4f16", "vnni", True, {"q4"}), ("ternary_ptq", "plain", True, {"t2", "q8"}),
    ("q4f16", "vnni", False, {"q4"}), ("binary_ptq", "avx2", False, {"b1", "q8"}),
])
def test_every_dequant_matmul_gets_the_hand_written_kernel(loaded, quant, cpu, tiled, formats):
    """Decode GEMVs and prefill matmuls alike: the hand-written kernel (no TIR blocks left, its op class
    declared), under the rule cpu_inline_parallel; on x86 with AVX2 every one is an integer dot-product
    kernel (x86.py / prefill.py), for plain KN q8 prefill too on a tiled target."""
    mod, rules = _scheduled(loaded, quant, cpu, tiled)
    kernels = _kernels(mod, DEQUANT)
    assert {DEQUANT.fullmatch(name).group(1) for name in kernels} == formats
    classes = {}
    for name, func in kernels.items():
        op_class = str(func.attrs[OP_CLASS_ATTR]) if func.attrs and OP_CLASS_ATTR in func.attrs else None
        assert rules[name] == "cpu_inline_parallel" and op_class is not None and not block_names(func), name
        classes[name] = op_class
        if tiled and cpu != "plain":
            assert "llvm.x86." in func.script(), name
        elif cpu == "plain":
            assert "llvm.x86." not in func.script(), name
    decode = [c for c in classes.values() if c.startswith("dequant-gemv")]
    prefill = [c for c in classes.values() if c.startswith("dequant-matmul")]
    assert len(decode) == len(prefill) == len(classes) // 2 > 0, classes


def test_float_decode_gemvs_get_the_hand_written_kernel(loaded):
    """q0f16: every one-token NT GEMV (the weight's cast fused in; static shapes, where a prompt's are
    symbolic) is gemv.float_nt_gemv."""
    mod, rules = _scheduled(loaded, "q0f16", "avx2")
    kernels = _kernels(mod, FLOAT_NT)
    decode = {name for name, f in kernels.items()
              if all(isinstance(d, tirx.IntImm) for p in f.params for d in p.shape)}
    assert decode and len(decode) == len(kernels) // 2
    for name in decode:
        func = kernels[name]
        assert rules[name] == "cpu_inline_parallel" and not block_names(func), name
        assert func.attrs and str(func.attrs.get(OP_CLASS_ATTR)) == "gemv", name


SLOW = pytest.mark.slow   # the plain-NK (rows 0) forms: the default android-cpu layout interleaves rows
NK_DEQUANT = re.compile(r"fused_dequantize_(q4|q8|t2|t3|b1)_nk\d*_matmul\d*")


@pytest.mark.parametrize("quant,formats,rows", [("q4f16", {"q4"}, 8), pytest.param("q4f16", {"q4"}, 0, marks=SLOW),
                                                ("q8f16", {"q8"}, 8), pytest.param("q8f16", {"q8"}, 0, marks=SLOW),
                                                ("ternary_ptq", {"t2", "q8"}, 8),
                                                pytest.param("ternary_t3", {"t3", "q8"}, 8, marks=SLOW),   # ~70 s; arm_t3's
                                                # kernels run under qemu in the default suite (test_arm_t3.py)
                                                pytest.param("ternary_ptq", {"t2", "q8"}, 0, marks=pytest.mark.slow),
                                                pytest.param("binary_ptq", {"b1", "q8"}, 8, marks=pytest.mark.slow)])
def test_android_cpu_dequant_matmuls_get_the_sdot_kernel(loaded, quant, formats, rows):
    """android-cpu (NK codes, fp16 compute, +dotprod): every decode GEMV and prefill matmul of NK q4 / q8 / t2 / b1
    codes is an sdot kernel under the rule cpu_arm_dot (its op class declared, no TIR blocks left, the sdot
    intrinsic in its body): q4 / q8 / t2 with the target's rows interleaved (q4_interleave / q8_interleave /
    t2_interleave: 8) arm_rows.py's, over 3-d codes, and arm.py's over plain rows (0; b1 always); t3 arm_t3.py's
    over rows interleaved by 4 (t3_interleave) or plain (before it, t3 got no rule: TVM's default lowering);
    without dotprod in the target none is."""
    target = dataclasses.replace(load_target("android-cpu"), q4_interleave=rows, q8_interleave=rows,
                                 t2_interleave=rows, t3_interleave=4 if rows else 0)
    mod, records = tune(fuse(define(loaded, load_quant(quant), target), target), target)
    rules = {r.name: r.rule for r in records}
    kernels = _kernels(mod, NK_DEQUANT)
    assert {NK_DEQUANT.fullmatch(name).group(1) for name in kernels} == formats
    classes = [str(f.attrs[OP_CLASS_ATTR]) for f in kernels.values() if f.attrs and OP_CLASS_ATTR in f.attrs]
    assert len(classes) == len(kernels) and sum(c.startswith("dequant-gemv") for c in classes) == len(kernels) // 2
    for name, func in kernels.items():
        assert rules[name] == "cpu_arm_dot" and not block_names(func), name
        assert "llvm.aarch64.neon.sdot" in func.script(), name
        codes = next(p for p in func.params if str(p.dtype) in ("uint32", "int8"))
        fmt = NK_DEQUANT.fullmatch(name).group(1)
        interleaved = fmt != "b1" and bool(rows)
        width = 4 if fmt == "t3" else rows * (4 if str(codes.dtype) == "int8" else 1)   # q8: 4 codes of each row side by side
        assert len(codes.shape) == (3 if interleaved else 2) and (not interleaved or int(codes.shape[2]) == width), name
    # the rest: host-cpu's rule (norms, elementwise, float GEMVs; schedule.py), TVM's default, or pre-scheduled
    assert {r for n, r in rules.items() if n not in kernels} <= {"cpu_inline_parallel", "cpu-default", "library"}
    norms = [n for n in rules if "rms_norm" in n and n not in kernels]
    assert norms and all(rules[n] == "cpu_inline_parallel" for n in norms), {n: rules[n] for n in norms}
    plain = dataclasses.replace(target, tvm_target={**target.tvm_target, "mattr": ["+neon", "+fullfp16"]})
    _, records = tune(fuse(define(loaded, load_quant(quant), plain), plain), plain)
    assert "cpu_arm_dot" not in {r.rule for r in records}


def test_android_hexagon_cpu_half_q4_matmuls_get_the_kn_sdot_kernel(loaded):
    """android-hexagon's aarch64 library (KN codes, the lm_head and every NPU kernel's fallback): each q4 decode
    GEMV and prefill matmul is arm_kn.py's sdot kernel under cpu_arm_dot; the NPU still gets its kernels from
    the fused functions (NpuBackend.place takes them unscheduled), so placement is what it was."""
    from pipeline.compiler.backend import backend_for

    target = load_target("android-hexagon")
    fused = fuse(define(loaded, load_quant("q4f16"), target), target)
    unscheduled = {gv.name_hint: f for gv, f in fused.functions_items()}
    mod, records = tune(fused, target)
    kernels = _kernels(mod, DEQUANT)
    assert kernels and {DEQUANT.fullmatch(name).group(1) for name in kernels} == {"q4"}
    rules = {r.name: r.rule for r in records}
    for name, func in kernels.items():
        assert rules[name] == "cpu_arm_dot" and not block_names(func), name
        assert "llvm.aarch64.neon.sdot" in func.script(), name
    placed = backend_for(target).place(mod, records, SMALL["vocab_size"], unscheduled=unscheduled)
    on_npu = {r.name: r.rule for r in placed if r.on_device}
    assert {on_npu.get(n) for n in kernels if "lm_head" not in n} >= {"hvx-q4-vrmpy", "hvx-q4-prefill-vrmpy"}, on_npu


def test_android_hexagon_cpu_half_q8_matmuls_get_the_kn_q8_sdot_kernel(loaded):
    """q8f16 on android-hexagon (plain KN int8 codes, no q8_tile): each q8 decode GEMV and prefill matmul of the
    aarch64 library is arm_kn_q8.py's sdot kernel under cpu_arm_dot (before it, TVM's default schedule:
    "cpu-default"), half of them decode GEMVs; the substitute reads the int8 codes as they are stored ([K, N])."""
    target = load_target("android-hexagon")
    mod, records = tune(fuse(define(loaded, load_quant("q8f16"), target), target), target)
    kernels = _kernels(mod, DEQUANT)
    assert kernels and {DEQUANT.fullmatch(name).group(1) for name in kernels} == {"q8"}
    rules = {r.name: r.rule for r in records}
    classes = []
    for name, func in kernels.items():
        assert rules[name] == "cpu_arm_dot" and not block_names(func), (name, rules[name])
        assert "llvm.aarch64.neon.sdot" in func.script(), name
        codes = next(p for p in func.params if str(p.dtype) == "int8")
        out = func.params[-1]
        assert int(codes.shape[1]) == int(out.shape[2]) and len(codes.shape) == 2, name   # KN: [K, N]
        classes.append(str(func.attrs[OP_CLASS_ATTR]))
    assert sorted(set(classes)) == ["dequant-gemv", "dequant-matmul"] and classes.count("dequant-gemv") == len(classes) // 2


@pytest.mark.slow
def test_android_hexagon_cpu_half_t3_matmuls_get_the_t3_sdot_kernel(loaded):
    """ternary_t3 on android-hexagon (KN codes): every t3 decode GEMV and prefill matmul of the aarch64 library is
    arm_t3.py's sdot kernel in its KN form under cpu_arm_dot."""
    target = load_target("android-hexagon")
    mod, records = tune(fuse(define(loaded, load_quant("ternary_t3"), target), target), target)
    pattern = re.compile(r"fused_dequantize_t3_kn\d*_matmul\d*")
    kernels = _kernels(mod, pattern)
    rules = {r.name: r.rule for r in records}
    assert len(kernels) >= 2, sorted(rules)
    for name, func in kernels.items():
        assert rules[name] == "cpu_arm_dot" and not block_names(func), name
        assert "llvm.aarch64.neon.sdot" in func.script(), name
        assert str(func.attrs[OP_CLASS_ATTR]).endswith("-ternary"), name


@pytest.mark.parametrize("quant,fmt", [("ternary_ptq", "t2"), ("binary_ptq", "b1")])
def test_android_hexagon_cpu_half_t2_b1_matmuls_get_the_kn_sign_sdot_kernel(loaded, quant, fmt):
    """A ternary / binary scheme on android-hexagon (plain KN t2 / b1 codes): each of its decode GEMVs and prefill
    matmuls in the aarch64 library is arm_kn_signs.py's sdot kernel under cpu_arm_dot (before it, TVM's default
    schedule: "cpu-default"), reading the codes as stored ([K / per_word, N]); the q8 lm_head keeps arm_kn_q8.py's."""
    target = load_target("android-hexagon")
    mod, records = tune(fuse(define(loaded, load_quant(quant), target), target), target)
    kernels = {name: f for name, f in _kernels(mod, DEQUANT).items() if DEQUANT.fullmatch(name).group(1) == fmt}
    rules = {r.name: r.rule for r in records}
    assert len(kernels) == 8, sorted(rules)    # qkv, o, gate_up, down: decode + prompt
    classes = []
    for name, func in kernels.items():
        assert rules[name] == "cpu_arm_dot" and not block_names(func), (name, rules[name])
        assert "llvm.aarch64.neon.sdot" in func.script(), name
        codes = next(p for p in func.params if str(p.dtype) == "uint32")
        assert len(codes.shape) == 2 and int(codes.shape[1]) == int(func.params[-1].shape[2]), name   # KN
        classes.append(str(func.attrs[OP_CLASS_ATTR]))
    assert sorted(classes) == ["dequant-gemv-ternary"] * 4 + ["dequant-matmul-ternary"] * 4
