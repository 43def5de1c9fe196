"""ios-metal: a system-lib .tar of arm64-apple-ios Mach-O objects with every kernel as Metal source."""

from __future__ import annotations

import json
import re
import tarfile

import pytest
from test_model_numerics import tiny_hf_model

MACHO_64 = b"\xcf\xfa\xed\xfe"
CPU_ARM64 = 0x0100000C


@pytest.fixture(scope="module")
def metal_bundle(build_bundle, tmp_path_factory):
    folder, _ = tiny_hf_model(tmp_path_factory.mktemp("metal"), "qwen3", num_hidden_layers=2)
    return build_bundle(folder, "ios-metal", "q4f16")


def _members(bundle):
    cfg = json.loads((bundle / "mlc-chat-config.json").read_text())
    lib = bundle / cfg["model_lib"]
    assert lib.suffix == ".tar"
    with tarfile.open(lib) as tar:
        return cfg, {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_ios_metal_tar_holds_arm64_ios_objects_and_metal_kernels(metal_bundle):
    cfg, members = _members(metal_bundle)
    assert members
    for name, data in members.items():   # Mach-O 64-bit, CPU type arm64
        assert data[:4] == MACHO_64 and int.from_bytes(data[4:8], "little") == CPU_ARM64, name
    device = [data for name, data in members.items() if "devc" in name]
    assert device, "no device-code object in the tar"
    metal = device[0].decode("latin-1")
    assert "#include <metal_stdlib>" in metal
    kernels = set(re.findall(r"kernel void (\w+)\(", metal))
    coverage = json.loads((metal_bundle / "reports" / "coverage.json").read_text())
    rows = coverage["kernels"]
    assert rows and {r["placement"] for r in rows} == {"GPU"}
    prefix = json.loads((metal_bundle / "reports" / "kernels.json").read_text())["system_lib_prefix"]
    # every compiled kernel has Metal source (a kernel may be split into several Metal functions)
    for r in rows:
        assert any(k.startswith(prefix + r["name"]) for k in kernels), r["name"]
    assert cfg["quantization"] == "q4f16"


def test_ios_metal_schedules(metal_bundle):
    kernels = json.loads((metal_bundle / "reports" / "kernels.json").read_text())["kernels"]
    rules = {k["rule"] for k in kernels}
    assert all(k["on_device"] and k["rule"] != "none" for k in kernels)
    assert {"gemv", "matmul_simt"} <= rules, rules
    memory = json.loads((metal_bundle / "reports" / "memory.json").read_text())
    assert "A17 Pro" in json.dumps(memory)


def test_simt_matmul_on_metal():
    """matmul_simt schedules a matmul for Metal with thread tiles, not simdgroup MMA."""
    import tvm
    from tvm import te

    from pipeline.compiler.schedule import schedule_module

    a = te.placeholder((1, 128, 128), "float16", name="a")
    b = te.placeholder((128, 128), "float16", name="b")
    k = te.reduce_axis((0, 128), name="k")
    c = te.compute((1, 128, 128), lambda n, i, j: te.sum(a[n, i, k] * b[j, k], axis=k), name="matmul")
    func = te.create_prim_func([a, b, c]).with_attr("global_symbol", "mm")
    target = tvm.target.Target({"kind": "metal", "host": {"kind": "llvm", "mtriple": "arm64-apple-ios"}})
    mod, records = schedule_module(tvm.IRModule({"mm": func}), target, ("matmul_simt",), "gpu")
    assert records[0].rule == "matmul_simt"
    assert "simdgroup" not in mod["mm"].script() and "threadIdx" in mod["mm"].script()


def test_tensorized_kernel_with_system_lib_prefix_is_a_one_line_error():
    """What dlight's simdgroup Matmul emits (tvm_access_ptr) cannot get a system-lib name in TVM 0.27:
    a CompileError naming the fix, not a stack trace."""
    import tvm
    from tvm.script import tirx as T

    from pipeline.compiler.compile import build_library
    from pipeline.errors import CompileError

    @T.prim_func(private=True)
    def uses_access_ptr(A: T.Buffer((64,), "float16")):
        T.evaluate(T.tvm_access_ptr(T.type_annotation("float16"), A.data, 0, 64, 2))

    mod = tvm.IRModule({"k": uses_access_ptr.with_attr("global_symbol", "k")})
    target = tvm.target.Target({"kind": "metal", "host": {"kind": "llvm", "mtriple": "arm64-apple-ios"}})
    with pytest.raises(CompileError, match="matmul_simt"):
        build_library(mod, target, library="tar", system_lib=True, prefix="t_", out_dir=None)
