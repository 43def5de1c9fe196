"""Llama-3 RoPE scaling on the GPU targets: TVM 0.27's TIR CSE pass broke the KV cache's RoPE kernel ("variable
cse_v2 has been used before definition"), so a Llama-3.x model failed on android-adreno (the issue saw ios-metal fail too; it builds here either way); the kernel
is now marked (kernels/cpu/rope.CSE_BREAKS) and the library built with that pass off. The kernel itself is run on
PoCL against the CPU targets' own RoPE kernel (an independent implementation)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import ModelSpec, load_quant, load_target
from pipeline.models import config_from_hf
from pipeline.progress import Reporter
from pipeline.stages import Loaded, build, define
from pipeline.verify import opencl as verify_opencl
from pipeline.verify.execution import attention_heads, reference_module, run_kv_kernel, twin_module

LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, rms_norm_eps=1e-5,
              rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True,
              rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"})


@pytest.fixture(scope="module")
def loaded():
    return Loaded(ModelSpec(name="llama3-tiny", hf_config=LLAMA3, weights=None), LLAMA3, config_from_hf(LLAMA3), None)


@pytest.mark.parametrize("target_name", ["android-adreno", "ios-metal"])
def test_llama3_rope_builds_for_gpu_targets(loaded, target_name, tmp_path, monkeypatch):
    monkeypatch.setenv("MLP_CACHE_DIR", str(tmp_path))
    target, quant = load_target(target_name), load_quant("q4f16")
    lib_dir, info = build(loaded, define(loaded, quant, target), quant, target, Reporter(quiet=True), verify=False)
    assert (lib_dir / info["library"]).stat().st_size > 0


def test_llama3_rope_kernel_matches_the_cpu_one_on_pocl(loaded):
    if verify_opencl.find_opencl_device() is None:
        pytest.skip("needs PoCL (pocl-opencl-icd; `make system-deps`)")
    target, quant = load_target("android-adreno"), load_quant("q4f16")
    twin, reference = twin_module(loaded, quant, target), reference_module(loaded, quant)
    tvm_target = dataclasses.replace(target, tvm_target={**target.tvm_target, "host": {"kind": "llvm"}}).tvm()
    verdict = run_kv_kernel("fused_rope", twin["fused_rope"], reference["fused_rope"], tvm_target,
                            tuple(target.schedule_rules), attention_heads(twin))
    assert verdict.startswith("executed") and "matches" in verdict, verdict
