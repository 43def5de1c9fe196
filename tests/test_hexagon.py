"""android-hexagon: aarch64 CPU library for everything + Hexagon HVX objects for the NPU op classes."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile

import pytest
from test_model_numerics import tiny_hf_model

EM_AARCH64, EM_HEXAGON = 183, 164


@pytest.fixture(scope="module")
def hexagon_bundle(build_bundle, tmp_path_factory):
    folder, _ = tiny_hf_model(tmp_path_factory.mktemp("hexagon"), "llama", num_hidden_layers=2)
    return build_bundle(folder, "android-hexagon", "q4f16")


def _objects(path):
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _machine(data: bytes) -> int:
    assert data[:4] == b"\x7fELF"
    return int.from_bytes(data[18:20], "little")


def test_two_libraries(hexagon_bundle, tmp_path):
    info = json.loads((hexagon_bundle / "reports" / "kernels.json").read_text())
    cpu = _objects(hexagon_bundle / "lib" / info["library"])
    npu = _objects(hexagon_bundle / "lib" / info["npu_library"])
    assert cpu and all(_machine(o) == EM_AARCH64 for o in cpu.values())
    assert npu and all(_machine(o) == EM_HEXAGON for o in npu.values())
    objdump = shutil.which("llvm-objdump")
    if objdump:   # HVX vector loads/stores in the NPU kernels
        obj = tmp_path / "npu.o"
        obj.write_bytes(next(iter(npu.values())))
        dis = subprocess.run([objdump, "-d", "--mcpu=hexagonv68", "--mattr=+hvxv68,+hvx-length128b", str(obj)],
                             capture_output=True, text=True).stdout
        assert "vmem(" in dis


def test_placement_and_reasons(hexagon_bundle):
    report = json.loads((hexagon_bundle / "reports" / "coverage.json").read_text())
    rows = report["kernels"]
    placements = {r["placement"] for r in rows}
    assert placements == {"NPU", "CPU"}
    assert all(r.get("reason") for r in rows)
    for r in rows:
        if r["placement"] == "NPU":
            assert r["op_class"] in ("dequant-gemv", "dequant-matmul", "rmsnorm", "elementwise")
    assert all(r["placement"] == "CPU" for r in rows if r["op_class"] == "gather")
    pinned = [r for r in rows if "lm_head" in r["reason"]]
    assert any(r["op_class"].startswith("dequant-") for r in pinned), "lm_head is not pinned to the CPU"
    s = report["summary"]
    assert s["decode_step"]["cpu"]["bytes"] > 0 and s["decode_step"]["accelerator"]["bytes"] > 0
    c = s["crossings"]
    assert c["crossings_per_token"] > 0 and c["bytes_moved_per_token"] > 0
    md = (hexagon_bundle / "reports" / "coverage.md").read_text()
    assert "CPU<->NPU crossings per decoded token" in md and "compiled, not executed" in md
