"""The android-cpu library's aarch64 kernels, executed under qemu-aarch64 and compared with x86 LLVM builds.

The library is built by the pipeline's own build stage (`stages.build`, as `make build TARGET=android-cpu`
does) for a SmolLM2-shaped model (hidden 576, GQA 9/3, ffn 1536, q4f16; 2 layers and a 2048 vocabulary to
stay fast); `lib0.o` is taken from its `.tar`, linked statically with `pipeline/verify/native/kernel_harness.c`
by the Debian cross gcc, and every kernel the KV cache does not drive is run under qemu-aarch64 on random
inputs (decode and prefill variants, seq_len 5) and compared with the same fused PrimFunc built by LLVM
for this x86 machine. The slow test does the same on the default model's real android-cpu bundle.

Tolerances: fp32 build (the target's dict with float32 compute) <= 1e-5 of the output's scale. fp16 build
(the target as shipped): every fp16 kernel but the matmuls bit-identical; the fp32 ones (the sampler's softmax: its
exp polynomial) within 1e-6, as the aarch64 back end contracts a * b + c into one fused multiply-add where x86's
build rounds twice; matmuls within 4 fp16 ulps of the
output's scale (4 * 2^-10): their inner loop is one native fp16 fused multiply-add on aarch64 (`fmadd h`,
one rounding), while x86 has no fp16 arithmetic and LLVM rounds the product and the sum separately. The
quantized matmuls that take arm.py's sdot kernels (x rounded per block to two bytes; fp32 sums) against the
x86 build of the fused TE: fp32 within 1e-4 of the output's scale (X_BYTES = 1, int8: 2%), fp16 within 2%
(that reference sums in fp16); tests/test_arm_kernels.py checks their own arithmetic tightly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import tirx

from pipeline.kernels.cpu.arm import X_BYTES, arm_dot_like
from pipeline.kernels.cpu.arm_rows import PROMPT_X_BYTES, arm_rows_like, rows_base
from pipeline.kernels.cpu.packed import NK_FORMATS
from pipeline.kernels.cpu.recognize import match_packed_nk_gemv
from pipeline.verify.opencl import run_on_llvm
from pipeline.verify.opencl_plan import param_spec
from pipeline.verify.qemu_aarch64 import AArch64Kernels, library_objects, link_harness, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian packages {missing_tools()} "
                                "(qemu-aarch64 and the aarch64 cross gcc/libc; `make system-deps` installs them)")

SMOLLM2_SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, vocab_size=2048,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=1e5)
# Kernels the paged KV cache drives with its own page tables (random inputs would index out of bounds).
KV_DRIVEN = ("paged_kv", "ragged_kv", "tree_attn", "kv_cache", "kv_copy", "copy_single_page", "merge_state",
             "fused_rope")
FP16_ULP = 2.0 ** -10
FP32_CONTRACTION = 1e-6   # fp32 kernels of an fp16 build: aarch64 fuses multiply-adds, x86 rounds twice
# the sdot kernels' quantized activations (tests/test_arm_kernels.py): two bytes (decode's default) or int8 (the
# interleaved q4 / q8 rows' prompt default, arm_rows.PROMPT_X_BYTES: measured 5.0e-3 to 6.9e-3 of the output's scale)
SDOT_FP32_TOLERANCE = {2: 1e-4, 1: 2e-2}
SDOT_FP16_TOLERANCE = 2e-2   # the x86 fp16 reference sums K products in fp16 itself (measured up to 1.05e-2)


def _build(tmp_path, compute_dtype: str):
    """(AArch64Kernels over the built lib0.o, fused module) for the SmolLM2-shaped model on android-cpu."""
    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.models.llama import DecoderConfig
    from pipeline.progress import Reporter
    from pipeline.stages import Loaded, build, define, fuse

    target = dataclasses.replace(load_target("android-cpu"), compute_dtype=compute_dtype)
    quant = load_quant("q4f16")
    loaded = Loaded(ModelSpec(name="smollm2-shape", hf_config=SMOLLM2_SHAPE, weights=None), SMOLLM2_SHAPE,
                    DecoderConfig.from_hf(SMOLLM2_SHAPE), None)
    defined = define(loaded, quant, target)
    lib_dir, info = build(loaded, defined, quant, target, Reporter(quiet=True))
    objects = library_objects(lib_dir / info["library"], tmp_path / "objects")
    harness = link_harness(objects, tmp_path / "kernel_harness")
    return AArch64Kernels(harness, info["system_lib_prefix"]), fuse(defined, target)


def _args(func: tirx.PrimFunc, rng, seq_len: int = 5) -> list[np.ndarray]:
    args = []
    for p in func.params:
        spec = param_spec(p)
        shape = tuple(int(d) if isinstance(d, int | tirx.IntImm) else seq_len for d in spec.shape)
        if spec.dtype == "uint32":
            args.append(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))
        elif spec.dtype.startswith("int"):          # token ids / row or position indices: small, in range
            args.append(rng.integers(0, min(16, seq_len), shape).astype(spec.dtype))
        else:
            args.append(rng.standard_normal(shape).astype(spec.dtype))
    return args


INDEXED_BY_INPUTS = ("logit_bias_kernel", "penalty_kernel", "bitmask_kernel")


def compare_kernels(kernels: AArch64Kernels, mod: tvm.IRModule) -> tuple[dict[str, float], list[str]]:
    """{kernel: max |aarch64 - x86| / scale} over every kernel not driven by the KV cache; and those skipped."""
    assert kernels.names(), "the harness registered no kernels"
    available = set(kernels.names())
    errors, kv_driven = {}, []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gv.name_hint
        assert name in available, f"{name} is not in the android-cpu library"
        if any(k in name for k in KV_DRIVEN):
            kv_driven.append(name)
            continue
        # the engine's logit kernels index rows by their int inputs (random ids < 16): 16 rows
        args = _args(func, np.random.default_rng(0), 16 if name in INDEXED_BY_INPUTS else 5)
        expected = run_on_llvm(func.with_attr("global_symbol", name), [a.copy() for a in args])[-1]
        got = kernels.call(name, args)[-1]
        scale = max(float(np.abs(expected.astype(np.float64)).max()), 1e-30)
        errors[name] = float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max()) / scale
    return errors, sorted(kv_driven)


def _report(errors: dict[str, float], kv_driven: list[str], what: str) -> None:
    print(f"\nqemu-aarch64 ({what}): {len(errors)} kernels executed, max rel. diff vs x86 "
          f"{max(errors.values()):.2e}; {len(kv_driven)} KV-cache-driven kernels compiled, not executed")


def _is_matmul(name: str) -> bool:
    return "matmul" in name


def _sdot_kernels(mod: tvm.IRModule) -> set[str]:
    """The functions android-cpu builds with the sdot kernels (the rule cpu_arm_dot: arm.py, arm_rows.py)."""
    return {gv.name_hint for gv, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and (arm_rows_like(f) or arm_dot_like(f)) is not None}


def _x_bytes(mod: tvm.IRModule, name: str) -> int:
    """The bytes per value of x in an sdot kernel: an interleaved-rows prompt matmul's PROMPT_X_BYTES of its
    codes' bits, else arm.X_BYTES."""
    func = mod[name]
    match = match_packed_nk_gemv(func, rows="prompt")
    if arm_rows_like(func) is None or match is None:
        return X_BYTES
    return PROMPT_X_BYTES[NK_FORMATS[rows_base(match[0])].bits]


def _fp32_kernels(mod: tvm.IRModule) -> set[str]:
    """Kernels of an fp16 build whose every floating-point buffer is fp32 (the engine's sampler kernels)."""
    out = set()
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc):
            floats = {param_spec(p).dtype for p in f.params if param_spec(p).dtype.startswith("float")}
            if floats == {"float32"}:
                out.add(gv.name_hint)
    return out


def _check_fp16(errors: dict[str, float], sdot: set[str], fp32: set[str]) -> None:
    assert sdot and sdot <= set(errors), sorted(sdot)
    assert not {n: e for n, e in errors.items() if not _is_matmul(n) and n not in fp32 and e != 0.0}
    assert not {n: e for n, e in errors.items() if not _is_matmul(n) and n in fp32 and not e <= FP32_CONTRACTION}
    assert not {n: e for n, e in errors.items() if _is_matmul(n) and n not in sdot and e > 4 * FP16_ULP}
    assert not {n: e for n, e in errors.items() if n in sdot and e > SDOT_FP16_TOLERANCE}


def test_fp32_kernels_match_x86(tmp_path):
    kernels, mod = _build(tmp_path, "float32")
    errors, kv_driven = compare_kernels(kernels, mod)
    _report(errors, kv_driven, "fp32")
    assert len(errors) >= 20 and any("dequantize_q4" in n for n in errors) and any("rms_norm" in n for n in errors)
    sdot = _sdot_kernels(mod)
    assert sdot and sdot <= set(errors), sorted(sdot)
    bad = {n: e for n, e in errors.items() if e > (SDOT_FP32_TOLERANCE[_x_bytes(mod, n)] if n in sdot else 1e-5)}
    assert not bad, bad
    assert {_x_bytes(mod, n) for n in sdot} == {1, 2}, "prompt (int8 x) and decode (two-byte x) kernels both ran"


@pytest.mark.slow   # fp16 compute under qemu: make test-slow (the fp32 kernels above run in the default suite)
def test_fp16_kernels_match_x86(tmp_path):
    kernels, mod = _build(tmp_path, "float16")
    errors, kv_driven = compare_kernels(kernels, mod)
    _report(errors, kv_driven, "fp16, as shipped")
    assert len(errors) >= 20
    _check_fp16(errors, _sdot_kernels(mod), _fp32_kernels(mod))


@pytest.mark.slow
def test_default_model_android_cpu_bundle_under_qemu(tmp_path, build_bundle):
    """The objects of `make build TARGET=android-cpu` (SmolLM2-135M, q4f16) themselves."""
    import json

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.stages import define, fuse, load

    bundle = build_bundle("smollm2-135m", "android-cpu", "q4f16")
    info = json.loads((bundle / "reports" / "kernels.json").read_text())
    objects = library_objects(bundle / "lib" / info["library"], tmp_path / "objects")
    kernels = AArch64Kernels(link_harness(objects, tmp_path / "kernel_harness"), info["system_lib_prefix"])
    target, quant = load_target("android-cpu"), load_quant("q4f16")
    loaded = load(load_model("smollm2-135m"))
    mod = fuse(define(loaded, quant, target), target)
    errors, kv_driven = compare_kernels(kernels, mod)
    _report(errors, kv_driven, "default model bundle, fp16")
    _check_fp16(errors, _sdot_kernels(mod), _fp32_kernels(mod))
