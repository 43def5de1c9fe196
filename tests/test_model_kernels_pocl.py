"""Kernels taken from the real android-adreno model pipeline, executed on PoCL vs the same PrimFunc on LLVM.

The model is SmolLM2-shaped (hidden 576, GQA 9/3, q4f16 KN layout) with fp32 activations, since PoCL
has no fp16; the kernels are exactly the fused functions the build schedules (dequantize-GEMV fused by
our fuse stage, RMSNorm), scheduled by the target's own rule list. Tolerance 1e-4 of output scale.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import tirx

from pipeline.kernels.gpu.add_norm import cpu_variant
from pipeline.kernels.gpu.add_norm import outputs as norm_outputs
from pipeline.verify.execution import random_args
from pipeline.verify.opencl import find_opencl_device, run_on_llvm, run_on_pocl
from pipeline.verify.opencl_plan import opencl_kernels, param_spec

pytestmark = pytest.mark.skipif(find_opencl_device() is None, reason="no OpenCL platform (install pocl-opencl-icd)")

SMOLLM2_SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, vocab_size=2048,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=1e5)


@pytest.fixture(scope="module")
def fused_adreno_module():
    return adreno_twin()


def adreno_twin():
    """(the fused module, the fp32 android-adreno target) of the SmolLM2-shaped model (also tests/test_oclgrind.py)."""
    from pipeline.config import ModelSpec, load_target
    from pipeline.models.llama import DecoderConfig
    from pipeline.stages import Defined, Loaded, fuse

    target = dataclasses.replace(load_target("android-adreno"), compute_dtype="float32")
    target = dataclasses.replace(target, tvm_target={**target.tvm_target, "host": {"kind": "llvm"}})
    spec = ModelSpec(name="smollm2-shape", hf_config=SMOLLM2_SHAPE, weights=None)
    loaded = Loaded(spec, SMOLLM2_SHAPE, DecoderConfig.from_hf(SMOLLM2_SHAPE), None)
    from pipeline.models.layers import LayerFactory
    from pipeline.models.llama import DecoderLM

    # Same model code as the build; fp32 activations and fp32 scales because PoCL has no fp16.
    module = DecoderLM(loaded.decoder, LayerFactory("float32", "q4", "float32", "KN", scale_dtype="float32"),
                       target.tvm())
    mod, params = module.export_tvm(spec=module.export_spec())
    defined = Defined(module, params, mod, "KN", "float32")
    return fuse(defined, target), target


def _static_args(func: tirx.PrimFunc, rng) -> list[np.ndarray]:
    args = []
    for p in func.params:
        spec = param_spec(p)
        shape = tuple(int(s) for s in spec.shape)
        if spec.dtype == "uint32":
            args.append(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))
        else:
            args.append(rng.standard_normal(shape).astype(spec.dtype))
    return args


def _pick(mod: tvm.IRModule, must: str) -> tuple[str, tirx.PrimFunc]:
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc) and must in gv.name_hint:
            try:
                [int(s) for p in f.params for s in param_spec(p).shape]
            except TypeError:
                continue          # symbolic (prefill) variant; the decode one is static
            return gv.name_hint, f
    raise AssertionError(f"no static kernel containing {must!r} in {[g.name_hint for g in mod.functions]}")


@pytest.mark.parametrize("kernel", ["fused_dequantize_q4_kn", "rms_norm_split"])
def test_model_kernel_on_pocl_matches_llvm(fused_adreno_module, kernel):
    """A decode kernel of the model on PoCL against LLVM: a dequant GEMV (LLVM runs it unscheduled), and the first
    layer's input norm (ours, kernels/gpu/norm_rows.py: its LLVM variant the reference; one token)."""
    from pipeline.compiler.schedule import schedule_module

    mod, target = fused_adreno_module
    rng = np.random.default_rng(0)
    if kernel == "rms_norm_split":
        name, func = next((gv.name_hint, f) for gv, f in mod.functions_items() if gv.name_hint.startswith(kernel))
        reference, args = cpu_variant(func), random_args(func, rng, {"seq_len": 1})
    else:
        name, func = _pick(mod, kernel)
        reference, args = func, _static_args(func, rng)
    func = func.with_attr("global_symbol", name)   # relax-fused functions get it only at final lowering
    single = tvm.IRModule({name: func})
    scheduled, records = schedule_module(single, target.tvm(), target.schedule_rules, "gpu")
    assert records[0].rule in ("dequant_gemv", "library"), records
    expected = run_on_llvm(reference.with_attr("global_symbol", name), [a.copy() for a in args])[-1]
    program = opencl_kernels(scheduled, target.tvm())
    got = run_on_pocl(program, name, [a.copy() for a in args])[-1]
    scale = float(np.abs(expected).max())
    assert scale > 0
    assert float(np.abs(got - expected).max()) <= 1e-4 * scale


# Kernels the paged KV cache drives with its own page tables / position maps (random inputs would index
# out of bounds); decode attention over a real paged cache runs on PoCL in tests/test_opencl_exec.py.
KV_DRIVEN = ("paged_kv", "ragged_kv", "tree_attn", "kv_cache", "kv_copy", "copy_single_page", "merge_state",
             "fused_rope")


def test_every_model_kernel_on_pocl(fused_adreno_module):
    """Every kernel of the adreno model (decode and prefill variants, seq_len = 5) that does not need the
    KV cache's runtime tables is scheduled by the target's rules, executed on PoCL and matches LLVM."""
    from pipeline.compiler.schedule import schedule_module

    mod, target = fused_adreno_module
    executed, kv_driven, bad, bound = [], [], [], []
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        name = gv.name_hint
        if any(k in name for k in KV_DRIVEN):
            kv_driven.append(name)
            continue
        reference, outputs = func, [-1]
        if func.attrs is not None and func.attrs.get("tirx.is_scheduled"):
            reference = cpu_variant(func)   # our RMSNorm kernels: their LLVM variant
            if reference is None:
                bound.append(name)   # written thread-bound: no LLVM twin (tests/test_engine_kernels_pocl.py runs them)
                continue
            outputs = norm_outputs(func)   # the fused add + norm writes the sum and the normalised sum
        func = func.with_attr("global_symbol", name)
        scheduled, _ = schedule_module(tvm.IRModule({name: func}), target.tvm(), target.schedule_rules, "gpu")
        # engine-facing kernels take up to 16 sequences (random ids are < 16)
        args = random_args(func, np.random.default_rng(0), {"seq_len": 5, "batch_size": 16, "num_seq": 16})
        expected = run_on_llvm(reference.with_attr("global_symbol", name), [a.copy() for a in args])
        got = run_on_pocl(opencl_kernels(scheduled, target.tvm()), name, [a.copy() for a in args])
        for i in outputs:
            scale = max(float(np.abs(expected[i]).max()), 1e-30)
            if float(np.abs(got[i] - expected[i]).max()) > 1e-4 * scale:
                bad.append(name)
        executed.append(name)
    print(f"\nPoCL: {len(executed)} kernels executed and matched LLVM; {len(kv_driven)} KV-cache-driven "
          f"kernels compiled, not executed here: {', '.join(sorted(kv_driven))}")
    assert not bad, bad
    assert sorted(bound) == ["bitmask_kernel", "logit_bias_kernel", "penalty_kernel"], bound
    assert "softmax_with_temperature_kernel" in executed
    assert any(n.startswith("fused_add_rms_norm") for n in executed), executed   # kernels/gpu/norm_rows.py
    assert any(n.startswith("rms_norm_split") for n in executed), executed
    assert len(executed) >= 20 and any("matmul" in n for n in executed) and any("take" in n for n in executed)
