"""HVX kernels executed under qemu-hexagon (Debian qemu-user 7.2) through the freestanding harness.

What runs: integer HVX (128-byte vectors: vmem, valign, vector add / multiply, vrmpy) — checked here exactly
against numpy on kernels the HVX schedule vectorizes for the android-hexagon NPU target (v73), and the q4 KN
decode GEMVs and prefill matmuls written with vrmpy (kernels/npu/hvx_int8_matmul.py; tests/test_hvx_int8_matmul.py
checks them against a bit-exact numpy model) as the build places them. What does
not: qemu-hexagon 7.2's decoder has no HVX float instructions (v68+ `hf` / `qf16` / `qf32` / `sf`); the kernels
of the generic HVX schedule use them, and qemu aborts translating the first such packet ("decode_packet:
assertion failed: (new_insns > 0)", qemu killed by SIGSEGV). Those kernels must stop exactly there: `diagnose`
names the packet and the instruction, and the build's coverage report says so per kernel.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import tvm
from tvm import te

from pipeline.compiler.schedule import KernelSchedule
from pipeline.config import load_target
from pipeline.kernels.npu import hexagon
from pipeline.kernels.npu.hvx_int8_matmul import GEMV_RULES, INT8_RULES, PREFILL_RULES
from pipeline.quant.quantize import dequantize_q4
from pipeline.verify.qemu_hexagon import HexagonKernels as Kernels
from pipeline.verify.qemu_hexagon import (
    HexagonRunError,
    hexagon_kernels,
    library_objects,
    link_harness,
    missing_tools,
)

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()}")

NPU = load_target("android-hexagon").npu
FLOAT_HVX = re.compile(r"\.(hf|qf16|qf32|sf)\b")   # HVX float lane types (v68+), absent from qemu 7.2
SMOLLM2_SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, vocab_size=2048,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=1e5)
FP16_TOLERANCE = 8 * 2.0 ** -10    # of the output's largest magnitude
INT8_TOLERANCE = 2e-2              # int8 activations per group of 32 (the vrmpy GEMV) vs the exact product


def _int_add(n=1024, dtype="int16"):
    a, b = te.placeholder((1, 1, n), dtype, name="a"), te.placeholder((1, 1, n), dtype, name="b")
    return te.create_prim_func([a, b, te.compute((1, 1, n), lambda i, j, c: a[i, j, c] + b[i, j, c], name="y")])


def _int_gemv(n=256, k=96):
    x = te.placeholder((1, 1, k), "int32", name="x")
    w = te.placeholder((k, n), "int32", name="w")
    r = te.reduce_axis((0, k), name="r")
    return te.create_prim_func([x, w, te.compute((1, 1, n), lambda i, j, c: te.sum(x[i, j, r] * w[r, c], axis=r),
                                                 name="y")])


def test_integer_hvx_kernels_match_numpy(tmp_path):
    """HVX-scheduled integer kernels of the NPU target (v73, 128-byte HVX) run under qemu-hexagon, exactly."""
    funcs = {"add_i16": _int_add(), "add_i32": _int_add(dtype="int32"), "gemv_i32": _int_gemv()}
    mod = tvm.IRModule(funcs)
    records = [KernelSchedule(name, "hvx", True) for name in funcs]
    objdump = hexagon.find_objdump()
    if objdump:   # the same count the build's placement uses
        scheduled = {n: hexagon.hvx_schedule(f).with_attr("global_symbol", f"hvx_{n}") for n, f in funcs.items()}
        counts = hexagon.hvx_counts(scheduled, tvm.target.Target(dict(NPU["tvm_target"])), objdump)
        assert all(v > 0 for v in counts.values()), counts
    kernels = hexagon_kernels(mod, records, NPU, tmp_path)
    assert kernels.names() == sorted(funcs)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(-2**15, 2**15, (1, 1, 1024)).astype("int16") for _ in range(2))
    got = kernels.call("add_i16", [a, b, np.zeros_like(a)])[-1]
    np.testing.assert_array_equal(got, a + b)     # wraps like int16
    a, b = (rng.integers(-2**31, 2**31, (1, 1, 1024)).astype("int32") for _ in range(2))
    np.testing.assert_array_equal(kernels.call("add_i32", [a, b, np.zeros_like(a)])[-1], a + b)
    x = rng.integers(-1000, 1000, (1, 1, 96)).astype("int32")
    w = rng.integers(-1000, 1000, (96, 256)).astype("int32")
    got = kernels.call("gemv_i32", [x, w, np.zeros((1, 1, 256), "int32")])[-1]
    np.testing.assert_array_equal(got[0, 0], x[0, 0].astype(np.int64) @ w)


def _numpy_reference(name: str, args: list[np.ndarray]) -> np.ndarray:
    """What an NPU kernel of the SmolLM2-shaped build computes, in float64 numpy."""
    f = [a.astype(np.float64) for a in args]
    if name.startswith("add"):
        return f[0] + f[1]
    if name.startswith("rms_norm"):
        x, w = f[0], f[1]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + SMOLLM2_SHAPE["rms_norm_eps"]) * w
    if name.startswith("fused_dequantize_q4_kn"):
        weight = dequantize_q4(args[0], args[1], "KN").astype(np.float64)   # [N, K]
        return f[2] @ weight.T
    raise AssertionError(f"no numpy reference for {name}")


def _args(func, rng, seq_len=5):
    from pipeline.verify.opencl_plan import param_spec

    out = []
    for p in func.params:
        spec = param_spec(p)
        shape = tuple(int(d) if isinstance(d, int | tvm.tirx.IntImm) else seq_len for d in spec.shape)
        if spec.dtype == "uint32":
            out.append(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))
        elif len(out) == 1 and out[0].dtype == np.uint32:   # the scales after the q4 codes
            out.append((rng.random(shape) * 0.02 + 0.005).astype(spec.dtype))   # q4 scales: sizes of real ones
        else:
            out.append(rng.standard_normal(shape).astype(spec.dtype))
    return out


@pytest.fixture(scope="module")
def smollm2_build(tmp_path_factory):
    """The android-hexagon build of a SmolLM2-shaped model (2 layers), by the pipeline's own build stage."""
    from pipeline.config import ModelSpec, load_quant
    from pipeline.models.llama import DecoderConfig
    from pipeline.progress import Reporter
    from pipeline.stages import Loaded, build, define, fuse

    target, quant = load_target("android-hexagon"), load_quant("q4f16")
    loaded = Loaded(ModelSpec(name="smollm2-shape", hf_config=SMOLLM2_SHAPE, weights=None), SMOLLM2_SHAPE,
                    DecoderConfig.from_hf(SMOLLM2_SHAPE), None)
    defined = define(loaded, quant, target)
    lib_dir, info = build(loaded, defined, quant, target, Reporter(quiet=True))
    return lib_dir, info, fuse(defined, target)


def test_npu_kernels_under_qemu_match_numpy_or_stop_at_float_hvx(smollm2_build, tmp_path):
    """Each NPU kernel of the build's own HVX .tar: it matches numpy, or qemu-hexagon 7.2 stops at a packet
    holding an HVX float instruction its decoder lacks (the exact packet is named) — nothing else."""
    lib_dir, info, mod = smollm2_build
    rules = {k["name"]: k["rule"] for k in info["kernels"]}
    assert sum(r == GEMV_RULES["q4"] for r in rules.values()) == 4, rules   # qkv, o_proj, gate_up, down decode GEMVs
    assert sum(r == PREFILL_RULES["q4"] for r in rules.values()) == 4, rules   # ... and their prefill matmuls
    objects = library_objects(lib_dir / info["npu_library"], tmp_path / "objects")
    kernels = Kernels(link_harness(objects, tmp_path / "harness"), info["system_lib_prefix"] + "hvx_")
    names = kernels.names()
    assert any("matmul" in n for n in names) and any("rms_norm" in n for n in names)
    rng = np.random.default_rng(0)
    ran, stopped = {}, {}
    for name in names:
        args = _args(mod[name], rng)
        try:
            got = kernels.call(name, [a.copy() for a in args])[-1]
        except HexagonRunError as err:
            assert rules[name] not in INT8_RULES, f"the integer vrmpy kernel {name} did not run: {err}"
            packet = kernels.diagnose(name, [a.copy() for a in args])
            assert packet is not None, f"{name} stopped for another reason: {err}"
            assert all(FLOAT_HVX.search(i) for i in packet.undecoded), packet
            assert err.signal == 11 and "decode_packet: assertion failed" in str(err), err
            stopped[name] = str(packet)
            continue
        expected = _numpy_reference(name, args)
        scale = np.abs(expected).max()
        ran[name] = float(np.abs(got.astype(np.float64) - expected).max() / scale)
    print(f"\nqemu-hexagon: ran {ran}\nstopped at: {json.dumps(stopped, indent=1)}")
    assert len(ran) + len(stopped) == len(names)
    assert not {n: e for n, e in ran.items() if e > (INT8_TOLERANCE if rules[n] in INT8_RULES else FP16_TOLERANCE)}, ran


def test_coverage_executed_column_tells_qemu_hexagon_verdict(smollm2_build):
    """The report's "executed here" column of each NPU kernel comes from its qemu-hexagon run."""
    lib_dir, _, _ = smollm2_build
    report = json.loads((lib_dir / "coverage.json").read_text())
    npu = [r for r in report["kernels"] if r["placement"] == "NPU"]
    assert npu
    for r in npu:
        v = r["executed"]
        if r["rule"] in INT8_RULES:    # the vrmpy GEMVs and prefill matmuls must have run
            assert v.startswith("executed here (qemu-hexagon, HVX, int8 activations, matches LLVM"), v
            continue
        assert (v.startswith("executed here (qemu-hexagon, HVX, matches LLVM")
                or re.match(r"compiled, not executed \(qemu-hexagon 7\.2 cannot decode `[^`{;]*\.(hf|qf16|qf32|sf)\b[^`{;]*`", v)), v
    assert all(r["executed"] == "compiled, not executed (aarch64 CPU code)" for r in report["kernels"]
               if r["placement"] == "CPU")
    assert "qemu-hexagon" in report["summary"]["execution"]["how"]


# ------------------------------------------------------------------ fp16 by bit arithmetic (kernels/npu/hvx_fp16.py)
def test_fp16_bit_conversion_matches_numpy():
    """The kernels' fp16 -> fp32 conversion by integer arithmetic (no soft-float call), on this CPU: every fp16
    value exactly."""
    from tvm.script import tirx as T

    from pipeline.kernels.npu.hvx_fp16 import f16_bits_to_f32

    @T.prim_func
    def convert(h: T.Buffer((65536,), "int32"), wide: T.Buffer((65536,), "float32")):
        for i in range(65536):
            wide[i] = f16_bits_to_f32(h[i])

    lib = tvm.compile(tvm.IRModule({"main": convert}), target=tvm.target.Target({"kind": "llvm"}))
    h = np.arange(65536, dtype=np.int32)
    wide = tvm.runtime.tensor(np.zeros(65536, np.float32))
    lib["main"](tvm.runtime.tensor(h), wide)
    expect = h.astype(np.uint16).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(wide.numpy().view(np.int32), expect.view(np.int32))
