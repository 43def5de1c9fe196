"""The coverage report's "executed here" column: from actual PoCL runs on android-adreno, with a reason
for every kernel that was only compiled."""

from __future__ import annotations

import json

import pytest
from test_model_numerics import tiny_hf_model

from pipeline.verify import execution
from pipeline.verify.opencl import find_opencl_device

needs_pocl = pytest.mark.skipif(find_opencl_device() is None, reason="no OpenCL platform (install pocl-opencl-icd)")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder, _ = tiny_hf_model(tmp_path_factory.mktemp("exec"), "llama", num_hidden_layers=2)
    return folder


def _build(folder, out, **kw):
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    return run_pipeline(str(folder), "android-adreno", "q4f16", out=str(out), report=Reporter(quiet=True), **kw).bundle


@pytest.mark.slow     # ~75 s: `make test-slow`; the default suite runs the build-time PoCL check through the
@needs_pocl           # default model's and the hybrid's Adreno builds (test_report, test_targets, test_qwen3_5)
def test_adreno_build_runs_its_kernels_on_pocl(tiny_llama, tmp_path):
    bundle = _build(tiny_llama, tmp_path)
    cov = json.loads((bundle / "reports" / "coverage.json").read_text())
    rows = {r["name"]: r for r in cov["kernels"]}
    e = cov["summary"]["execution"]
    ran = [n for n, r in rows.items() if r["executed"].startswith("executed here (PoCL")]
    assert e["executed"] == len(ran) >= 20 and e["executed"] + e["not_executed"] == len(rows) and not e["mismatched"]
    # every GEMV / matmul / norm / gather of the build ran, with its measured error; the paged KV cache's
    # kernels ran on a consistent cache against TVM's CPU variants (the debug reader is shaped by the layer
    # count, which the one-layer twin does not share); only fp16 casts were left
    for r in rows.values():
        if r["op_class"] in ("dequant-gemv", "dequant-matmul", "rmsnorm", "gather"):
            assert "matches LLVM: rel. err" in r["executed"], r
        if r["name"] in ("logit_bias_kernel", "penalty_kernel", "bitmask_kernel", "take"):   # engine-facing kernels
            assert "matches LLVM: rel. err" in r["executed"], r
        if r["op_class"] in ("attention", "kv-cache") and r["name"] != "tir_kv_cache_debug_get_kv":
            assert "paged KV cache of 2 sequences, matches its CPU variant: rel. err" in r["executed"], r
    left = {n: r["executed"] for n, r in rows.items() if not r["executed"].startswith("executed here")}
    assert all("fp16-only" in v for n, v in left.items() if n != "tir_kv_cache_debug_get_kv"), left
    assert len(left) <= 3, left
    print(f"executed on PoCL: {e['executed']} of {len(rows)} kernels; compiled only: {left}")
    md = (bundle / "reports" / "coverage.md").read_text()
    assert f"Executed here: {e['executed']} of {len(rows)} kernels" in md and "| executed here |" in md
    html = (bundle / "reports" / "coverage.html").read_text()
    assert 'id="kernels-executed">' + str(e["executed"]) in html and "compiled, not executed (" in html


def test_without_opencl_device_nothing_claims_execution(tiny_llama, tmp_path, monkeypatch):
    import pipeline.verify.opencl as vo

    monkeypatch.setattr(vo, "find_opencl_device", lambda: None)
    bundle = _build(tiny_llama, tmp_path / "nodev")
    cov = json.loads((bundle / "reports" / "coverage.json").read_text())
    assert cov["summary"]["execution"]["executed"] == 0
    assert {r["executed"] for r in cov["kernels"]} == {
        "compiled, not executed (no OpenCL device here: install pyopencl + pocl-opencl-icd)"}


def test_verdicts_for_other_targets(monkeypatch):
    from pipeline.compiler.schedule import KernelSchedule
    from pipeline.config import load_target

    recs = [KernelSchedule("a", "hvx", True), KernelSchedule("b", "cpu-default", False)]
    out, summary = execution.verdicts(load_target("android-hexagon"), recs, verify=False)
    assert out == {"a": "compiled, not executed (HVX: build-time qemu-hexagon run off (--no-verify))",
                   "b": "compiled, not executed (aarch64 CPU code)"} and summary["executed"] == 0
    monkeypatch.setattr(execution, "missing_tools", lambda: ["qemu-user"])
    out, _ = execution.verdicts(load_target("android-hexagon"), recs, verify="no-qemu-hexagon")
    assert out["a"] == "compiled, not executed (HVX: the qemu-hexagon harness needs apt-get install qemu-user)"
    out, _ = execution.verdicts(load_target("android-adreno"), recs, verify=False)
    assert all("verification off" in v for v in out.values())
    out, _ = execution.verdicts(load_target("ios-metal"), recs, verify=True)
    assert all(v == "compiled, not executed (no metal device here)" for v in out.values())


@needs_pocl
@pytest.mark.slow     # a full uncached Adreno build + PoCL run (~60 s): `make test-slow`
def test_a_crashing_kernel_costs_only_its_own_verdict(tiny_llama, tmp_path, monkeypatch):
    """Kernels run in a child process: one that kills it (here: an abort injected on the first input norm) is
    marked crashed, the others still run."""
    monkeypatch.setenv("MLP_VERIFY_ABORT_ON", "rms_norm_split")
    monkeypatch.setenv("MLP_CACHE_DIR", str(tmp_path / "cache"))   # not the library cached by the tests above
    bundle = _build(tiny_llama, tmp_path / "crash")
    rows = {r["name"]: r for r in json.loads((bundle / "reports" / "coverage.json").read_text())["kernels"]}
    assert rows["rms_norm_split"]["executed"].startswith("compiled, not executed (the PoCL run crashed (exit")
    assert rows["fused_add_rms_norm"]["executed"].startswith("executed here (PoCL")
    assert sum(r["executed"].startswith("executed here") for r in rows.values()) >= 20


@needs_pocl
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_gpu_bound_gdn_kernels_run_against_their_cpu_variant(kind):
    """The gated delta rule kernels come bound to GPU threads (LLVM cannot build them): PoCL runs them and
    their CPU variant of the same shapes is the reference, both outputs (o and the state written back)
    compared; a kernel that computes something else is a MISMATCH, not a failed run."""
    import tvm

    from pipeline.config import load_target
    from pipeline.models import gdn_kernels

    builder = getattr(gdn_kernels, f"gdn_{kind}")
    name = f"gdn_{kind}"
    target = load_target("android-adreno")
    tvm_target = tvm.target.Target({**target.tvm_target, "host": {"kind": "llvm"}})
    rules = tuple(target.schedule_rules)
    gpu, cpu = builder(2, 4, 16, 24, gpu=True, max_threads=16), builder(2, 4, 16, 24)
    verdict = execution.run_kernel(name, gpu, tvm_target, rules, reference=cpu)
    assert verdict.startswith("executed here (PoCL") and "matches LLVM: rel. err" in verdict, verdict
    other = builder(2, 4, 16, 24, scale=0.5)      # the reference of a kernel with another q scale
    assert "MISMATCH" in execution.run_kernel(name, gpu, tvm_target, rules, reference=other)
    assert "no CPU variant" in execution.run_kernel(name, gpu, tvm_target, rules)


@pytest.mark.slow     # ~2-4 min: the PoCL twin run, then every twin kernel under Oclgrind
@needs_pocl
def test_adreno_build_with_oclgrind_prints_its_verdict(tiny_llama, tmp_path):
    from pipeline.verify.oclgrind_build import KNOWN_TVM, missing

    if missing():
        pytest.skip(missing())
    bundle = _build(tiny_llama, tmp_path, verify="oclgrind")
    cov = json.loads((bundle / "reports" / "coverage.json").read_text())
    o = cov["summary"]["execution"]["oclgrind"]
    assert o["races"] == o["out_of_bounds"] == o["uninitialised"] == o["other"] == 0, o
    assert set(o["known_tvm"]) <= set(KNOWN_TVM) and not o["failed"] and o["run"] >= 20, o
    ran = [r for r in cov["kernels"] if r["executed"].startswith("executed here (PoCL")]
    assert ran and all("; Oclgrind: " in r["executed"] for r in ran), [r["executed"] for r in ran]
    assert sum("Oclgrind: no report" in r["executed"] for r in ran) >= len(ran) - len(o["known_tvm"])
    md = (bundle / "reports" / "coverage.md").read_text()
    assert f"Oclgrind: {o['run']} of {o['kernels']} twin kernels checked" in md


def test_oclgrind_needs_an_opencl_target_and_the_pocl_run(monkeypatch):
    """--oclgrind on a target without OpenCL kernels, or without Oclgrind installed: one line, before any work."""
    from pipeline.config import load_target
    from pipeline.errors import ConfigError
    from pipeline.verify import oclgrind_build

    with pytest.raises(ConfigError, match="--oclgrind checks OpenCL kernels and android-cpu has none"):
        execution.verify_mode(load_target("android-cpu"), "oclgrind", 0)
    monkeypatch.setattr(oclgrind_build, "oclgrind_library", lambda: None)
    with pytest.raises(ConfigError, match="Oclgrind is not installed.* fix: make system-deps"):
        execution.verify_mode(load_target("android-adreno"), "oclgrind", 0)


def test_default_adreno_build_runs_the_quick_oclgrind_pass(monkeypatch):
    """Where Oclgrind and an OpenCL device are here, a default (or --verify) android-adreno build runs the quick
    pass after PoCL; OCLGRIND=0 / --no-oclgrind and the suite's MLP_QUICK_OCLGRIND=0 leave PoCL alone; a CPU
    target never gets it; without Oclgrind the default stays PoCL (no error: only --oclgrind asks for it)."""
    from pipeline.config import load_target
    from pipeline.verify import oclgrind_build

    adreno, cpu = load_target("android-adreno"), load_target("android-cpu")
    monkeypatch.setattr(execution.verify_opencl, "find_opencl_device", lambda: object())
    monkeypatch.setattr(oclgrind_build, "oclgrind_library", lambda: "/x/liboclgrind-rt-icd.so")
    monkeypatch.delenv("MLP_QUICK_OCLGRIND")
    assert execution.verify_mode(adreno, None, 0) == execution.verify_mode(adreno, True, 0) == "pocl+oclgrind-quick"
    assert execution.verify_mode(adreno, "no-oclgrind", 0) == "pocl"
    assert execution.verify_mode(adreno, "oclgrind", 0) == "pocl+oclgrind"
    assert execution.verify_mode(adreno, None, execution.AUTO_VERIFY_MAX_BYTES + 1) == "too-big"
    assert execution.verify_mode(cpu, None, 0) is False
    monkeypatch.setenv("MLP_QUICK_OCLGRIND", "0")
    assert execution.verify_mode(adreno, None, 0) == "pocl"
    monkeypatch.delenv("MLP_QUICK_OCLGRIND")
    monkeypatch.setattr(oclgrind_build, "oclgrind_library", lambda: None)
    assert execution.verify_mode(adreno, None, 0) == "pocl"


def test_oclgrind_line_says_what_the_size_cap_left_out():
    from pipeline.report.coverage import oclgrind_line

    s = {"run": 30, "kernels": 47, "races": 0, "out_of_bounds": 0, "uninitialised": 0, "other": 0,
         "known_tvm": {}, "failed": [], "seconds": 75, "over_quick_cap": 12}
    assert oclgrind_line(s) == ("Oclgrind: 30 of 47 twin kernels checked in 75 s (12 over the default build's size "
                                "cap: OCLGRIND=1 checks all): 0 data races, 0 out-of-bounds accesses, "
                                "0 uninitialised reads")
    assert "size cap" not in oclgrind_line({**s, "over_quick_cap": 0})


@pytest.mark.slow     # ~65-100 s (build, PoCL twin run, Oclgrind): the default suite keeps the two tests above
@needs_pocl
def test_quick_oclgrind_pass_skips_kernels_over_the_cap_with_the_reason(tiny_llama, tmp_path, monkeypatch):
    """The default build's pass on a tiny Llama, the cap lowered so that its bigger kernels stay out: those say
    why in "executed here", the rest carry Oclgrind's verdict, and the printed line counts both."""
    from pipeline.verify import oclgrind_build

    if oclgrind_build.missing():
        pytest.skip(oclgrind_build.missing())
    monkeypatch.delenv("MLP_QUICK_OCLGRIND")
    monkeypatch.setattr(oclgrind_build, "QUICK_MAX_ARG_BYTES", 24 * 1024)
    bundle = _build(tiny_llama, tmp_path)
    cov = json.loads((bundle / "reports" / "coverage.json").read_text())
    o = cov["summary"]["execution"]["oclgrind"]
    assert o["races"] == o["out_of_bounds"] == o["uninitialised"] == o["other"] == 0 and not o["failed"], o
    assert o["run"] >= 5 and o["over_quick_cap"] >= 3 and o["run"] + o["over_quick_cap"] <= o["kernels"], o
    cells = [r["executed"] for r in cov["kernels"] if r["executed"].startswith("executed here (PoCL")]
    assert cells and all("; Oclgrind: " in c for c in cells), cells   # a verdict or why not, for every one
    assert 5 <= sum("; Oclgrind: no report" in c for c in cells) <= o["run"], cells
    capped = sum("; Oclgrind: not run (" in c and "over the default build's 24 KiB: OCLGRIND=1 checks it" in c
                 for c in cells)
    assert 3 <= capped <= o["over_quick_cap"], cells
    md = (bundle / "reports" / "coverage.md").read_text()
    assert "over the default build's size cap: OCLGRIND=1 checks all" in md
