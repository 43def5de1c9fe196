"""Phone targets: the Android libraries are real aarch64 objects with every GPU kernel scheduled."""

from __future__ import annotations

import json
import tarfile

import pytest

from pipeline.errors import CompileError


def _elf_machine(data: bytes) -> int:
    assert data[:4] == b"\x7fELF", "not an ELF object"
    return int.from_bytes(data[18:20], "little")


AARCH64 = 183


def test_default_build_for_adreno(build_bundle):
    bundle = build_bundle("smollm2-135m", "android-adreno", "q4f16")
    for name in ("mlc-chat-config.json", "tensor-cache.json", "manifest.json", "tokenizer.json"):
        assert (bundle / name).exists(), name
    cfg = json.loads((bundle / "mlc-chat-config.json").read_text())
    assert cfg["quantization"] == "q4f16" and cfg["weight_layout"] == "KN"
    lib = bundle / cfg["model_lib"]
    assert lib.suffix == ".tar"
    with tarfile.open(lib) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert members and all(_elf_machine(data) == AARCH64 for data in members.values())
    device_objects = [data for name, data in members.items() if "devc" in name]
    assert device_objects and b"__kernel" in device_objects[0], "no OpenCL kernels embedded"
    from pipeline.verify.opencl_plan import accumulators  # every GEMV / matmul kernel sums in float registers
    sums = {k: v for k, v in accumulators(device_objects[0].decode("latin-1")).items() if "matmul" in k and v}
    assert len(sums) >= 10 and all(t.startswith("float") for v in sums.values() for t in v.values()), sums
    for report in ("coverage.json", "coverage.md", "memory.json", "memory.md"):
        assert (bundle / "reports" / report).exists(), report
    coverage = json.loads((bundle / "reports" / "coverage.json").read_text())
    assert coverage["summary"]["kernels"] == len(coverage["kernels"])
    assert all(row["placement"] == "GPU" for row in coverage["kernels"])
    memory = json.loads((bundle / "reports" / "memory.json").read_text())
    assert "Snapdragon" in json.dumps(memory)
    kernels = json.loads((bundle / "reports" / "kernels.json").read_text())["kernels"]
    assert kernels and all(k["on_device"] and k["rule"] != "none" for k in kernels)
    rules = {k["rule"] for k in kernels}
    assert {"dequant_gemv", "matmul_f32"} <= rules, rules   # our decode GEMV; prefill summed in float32
    gemv = [k["name"] for k in kernels if k["rule"] == "dequant_gemv"]
    assert any("dequantize" in name for name in gemv), "q4 dequantize is not fused into our GEMV kernel"


def test_android_cpu_library(build_bundle, tmp_path):
    bundle = build_bundle("smollm2-135m", "android-cpu", "q4f16")
    cfg = json.loads((bundle / "mlc-chat-config.json").read_text())
    with tarfile.open(bundle / cfg["model_lib"]) as tar:
        objs = [tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()]
    assert objs and all(_elf_machine(o) == AARCH64 for o in objs)
    # the layout the sdot kernels read is recorded for the runtime (targets/android-cpu.yaml: q4_interleave)
    assert cfg["weight_layout"] == "NK" and cfg["q4_interleave"] == 8
    # the report and the memory plan name the CPU class the library was built for (configs/cpu_classes.yaml)
    reports = bundle / "reports"
    assert "CPU class: the CPU library is built for `dotprod`" in (reports / "coverage.md").read_text()
    assert "CPU library built for class dotprod: armv8.2-a + dotprod" in (reports / "memory.md").read_text()


def test_unscheduled_gpu_kernel_is_an_error():
    """With no rules, a GPU build must refuse and name the kernels instead of emitting host code."""
    import tvm
    from tvm import te

    from pipeline.compiler.schedule import schedule_module

    a = te.placeholder((64,), "float32", name="a")
    b = te.compute((64,), lambda i: a[i] * 2.0, name="b")
    mod = tvm.IRModule({"double_it": te.create_prim_func([a, b]).with_attr("global_symbol", "double_it")})
    target = tvm.target.Target({"kind": "opencl", "device": "adreno"})
    with pytest.raises(CompileError, match="double_it"):
        schedule_module(mod, target, (), "gpu")
    scheduled, records = schedule_module(mod, target, ("fallback",), "gpu")
    assert records[0].rule == "fallback" and records[0].on_device
