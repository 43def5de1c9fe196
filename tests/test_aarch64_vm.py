"""An android-cpu bundle's whole decode — Relax VM, paged KV cache, every kernel — executed under qemu-aarch64.

clients/aarch64_vm cross-builds the TVM runtime from the wheel's own sources and links the bundle's objects
with it into one static aarch64 program, as an Android app links them; qemu-aarch64 runs it. The slow test
compares SmolLM2-135M q4f16 (`make build TARGET=android-cpu`) with the host-cpu bundle of the same model and
quantization run by `pipeline run`'s engine on this machine:
- teacher forced with the host's 16 greedy ids, the logits of the prompt and of every step within
  LOGIT_TOLERANCE of the host's largest logit. Both libraries hold the same q4 codes but different kernels:
  the phone's sdot GEMVs round each activation block to two bytes and sum in int32 / fp32, its fp16
  arithmetic fuses multiply-adds (one rounding); x86 takes its own path. Measured on 2026-12-06: at most
  0.0038 of the scale (5x margin) with two-byte x in the prompt too; the prompt's matmuls now take int8 x
  (INT8_PROMPT_LOGIT_TOLERANCE);
- at every step the two argmaxes agree wherever the host's top-1 / top-2 margin exceeds twice that step's
  largest logit difference (a flip needs the top-1 to fall and the top-2 to rise by the margin together);
- free running, the 16 greedy ids identical up to the first step that is a near-tie by that rule (SmolLM2
  on this prompt has one at step 9: margin 0.021 on logits of scale 20, where the two runtimes differ by
  up to ~0.08; the paths may part there, and only there);
- 1 and 4 threads (TVM's thread pool, TVM_NUM_THREADS) give bit-identical logits: each output element is
  summed by one thread in a fixed order.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from clients.aarch64_vm import build as vm_build
from clients.aarch64_vm.run import decode, system_lib_prefix, tokenize
from clients.native_build import Missing

TOOLS = ("qemu-aarch64", vm_build.CXX)
MISSING = [t for t in TOOLS if shutil.which(t) is None]
needs_tools = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (`make system-deps` "
                                 "installs qemu-user and g++-aarch64-linux-gnu)")

PROMPT = "The capital of France is"
STEPS = 16
LOGIT_TOLERANCE = 0.02   # of the host's largest |logit| per step
# the phone's q4 / q8 prompt matmuls over interleaved rows (sdot, arm_rows.PROMPT_X_BYTES; the i8mm class's smmla)
# take x in one byte (int8), not two: the KV cache differs from the host's by that rounding at every later step.
# Measured 2026-12-07: q4f16 at most 0.0547 of the scale (dotprod and i8mm alike, the same int8 values), q8f16
# 0.054, so fewer steps have a top-2 margin the check can decide: 7 of 15 (at least STEPS // 3). t2 / t3 prompts
# keep two-byte x (int8 x per 128-wide t2 group: 0.24 of the scale).
INT8_PROMPT_LOGIT_TOLERANCE = 0.08


def test_a_bundle_without_a_phone_library_is_refused_in_one_line(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "model.so").write_bytes(b"")
    with pytest.raises(Missing, match="make build TARGET=android-cpu"):
        vm_build.library_tar(tmp_path)
    (tmp_path / "mlc-chat-config.json").write_text(json.dumps({"model_lib": "lib/model.so"}))
    with pytest.raises(Missing, match="no system_lib_prefix"):
        system_lib_prefix(tmp_path)


def test_runtime_key_follows_the_wheel_and_the_flags(monkeypatch):
    """A different compiler flag or tvm version is a different cached runtime (never a stale archive)."""
    if shutil.which(vm_build.CXX) is None:
        pytest.skip(f"needs {vm_build.CXX}")
    from clients.native_build import key
    base = key(vm_build.key_inputs(vm_build.CXX))
    assert key(vm_build.key_inputs(vm_build.CXX)) == base
    monkeypatch.setattr(vm_build, "CXXFLAGS", [*vm_build.CXXFLAGS, "-O3"])
    assert key(vm_build.key_inputs(vm_build.CXX)) != base
    # the sources listed are the wheel's: the VM, the paged KV cache and the tensor cache are among them
    sources = vm_build.key_inputs(vm_build.CXX)["sources"]["tvm"]
    assert {"runtime/vm/vm.cc", "runtime/vm/paged_kv_cache.cc", "runtime/vm/tensor_cache_support.cc"} <= set(sources)


def host_greedy(bundle, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    from pipeline.runtime.runner import Bundle

    engine = Bundle(bundle).engine()
    logits = [np.asarray(engine.prefill(ids), dtype=np.float32)]
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(logits[-1])))
        logits.append(np.asarray(engine.decode(out[-1]), dtype=np.float32))
    return out, np.stack(logits)


T3_PTQ = "name: ternary_t3_ptq\nweight_format: t3\nweight_dtype: float16\nlayout: target\nternary_source: ptq\n" \
         "formats:\n  embed_tokens: q8\n  lm_head: q8\n"   # ternary_t3's packing, post-training (SmolLM2 is not ternary)


@needs_tools
@pytest.mark.slow
@pytest.mark.parametrize("quant", ["q4f16", "q4f16@i8mm", "q8f16", "ternary_ptq", "t3_ptq"])
def test_smollm2_android_cpu_decode_under_qemu_matches_host(build_bundle, quant, tmp_path_factory):
    """ternary_ptq: t2 rows interleaved by 8 on the phone (arm_rows.py), KN tiles on the host; the same trits
    and scales (the PTQ is deterministic), the lm_head / embeddings q8. Measured 2026-12-06: at most 0.0108 of
    the scale per step (0.004-0.007 after the prompt); the PTQ model repeats one token, host and phone alike.
    t3_ptq: the same trits in t3, rows interleaved by 4 on the phone (arm_t3.py), plain KN on the host.
    q8f16: q8 rows interleaved on the phone (arm_rows.py), KN tiles on the host; measured 2026-12-06: at most
    0.0031 of the scale per step, the 16 free-running greedy ids equal (~2.5 min).
    q4f16@i8mm: built for a phone of the i8mm class (`--phone android-16gb`): the prompt's matmuls are
    arm_mmla.py's smmla kernels (qemu-aarch64's default CPU has FEAT_I8MM). q4f16 / q8f16 have their prompt's
    matmuls on int8 x (INT8_PROMPT_LOGIT_TOLERANCE); the q8f16 figure above was measured with two-byte prompts."""
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    if quant == "t3_ptq":
        quant = tmp_path_factory.mktemp("scheme") / "ternary_t3_ptq.yaml"
        quant.write_text(T3_PTQ)
        quant = str(quant)
    tolerance, min_decided = LOGIT_TOLERANCE, STEPS // 2
    if quant in ("q4f16", "q8f16", "q4f16@i8mm"):    # int8 x in the prompt's matmuls
        tolerance, min_decided = INT8_PROMPT_LOGIT_TOLERANCE, STEPS // 3
    if quant.endswith("@i8mm"):
        quant = quant.removesuffix("@i8mm")
        phone = run_pipeline("smollm2-135m", "android-cpu", quant, out=str(tmp_path_factory.mktemp("i8mm")),
                             phone="android-16gb", report=Reporter(quiet=True)).bundle
        assert "smmla" in (phone / "reports" / "coverage.md").read_text()
    else:
        phone = build_bundle("smollm2-135m", "android-cpu", quant)
    host = build_bundle("smollm2-135m", "host-cpu", quant)
    ids = tokenize(phone, PROMPT)
    ref_ids, ref_logits = host_greedy(host, ids, STEPS)
    forced = decode(phone, ids, STEPS, threads=1, forced=ref_ids)
    forced4 = decode(phone, ids, STEPS, threads=4, forced=ref_ids)
    free = decode(phone, ids, STEPS, threads=1)

    scale = np.abs(ref_logits).max(axis=1)
    diff = np.abs(forced.logits - ref_logits).max(axis=1)
    print(f"\naarch64 vs host logits, teacher forced: max rel. error per step {np.round(diff / scale, 4).tolist()}")
    assert (diff / scale).max() <= tolerance
    top2 = np.sort(ref_logits, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * diff          # no flip possible at these steps
    assert decided[:-1].sum() >= min_decided, "too few clear steps for the check to mean anything"
    assert [int(np.argmax(row)) for row in forced.logits[:-1][decided[:-1]]] == list(np.asarray(ref_ids)[decided[:-1]])
    first_tie = next((i for i in range(STEPS) if not decided[i]), STEPS)
    print(f"free-running greedy ids: qemu {free.ids}, host {ref_ids}; first near-tie at step {first_tie}")
    assert free.ids[:first_tie] == ref_ids[:first_tie]
    assert np.array_equal(forced4.logits, forced.logits), "4 threads differ from 1"
