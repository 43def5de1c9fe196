"""ONNX graphs exported by torch.onnx go through the same targets, schedules and coverage report as the LLMs.

Models are made here (an MLP and a one-layer transformer encoder block), exported with torch.onnx (the
dynamo exporter), built with `run_pipeline` / the CLI, and checked against torch: the host-cpu library
is executed by TVM's runtime (max |diff| <= 1e-4); the android-adreno build places every kernel on the
GPU, and its OpenCL kernels are executed on PoCL in graph order on the real tensors, each compared with
the LLVM build of the same kernel, the chain's output with torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cli import main as cli_main

TOL = 1e-4


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(self.norm(torch.nn.functional.gelu(self.up(x))))


def _encoder():
    return torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                            batch_first=True)


MODELS = {"mlp": (MLP, (4, 32)), "encoder": (_encoder, (1, 8, 32))}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{name: (onnx path, torch module)} — each model exported once with torch.onnx."""
    folder = tmp_path_factory.mktemp("onnx")
    out = {}
    for name, (make, shape) in MODELS.items():
        torch.manual_seed(0)
        model = make().eval()
        path = folder / f"{name}.onnx"
        torch.onnx.export(model, (torch.randn(*shape),), str(path), dynamo=True, verbose=False)
        out[name] = (path, model)
    return out


def _reference(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def _input(name: str, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(MODELS[name][1]).astype("float32")


@pytest.mark.parametrize("name", ["mlp", "encoder"])
def test_host_cpu_library_matches_torch(exported, build_bundle, name):
    import tvm
    from tvm import relax

    from pipeline.artifacts.bundle import verify_manifest

    path, model = exported[name]
    bundle = build_bundle(path, "host-cpu", "q0f32")
    for f in ("reports/coverage.json", "reports/coverage.md", "reports/coverage.html", "graph.json"):
        assert (bundle / f).is_file(), f
    verify_manifest(bundle)
    graph = json.loads((bundle / "graph.json").read_text())
    assert graph["inputs"][0]["shape"] == list(MODELS[name][1])
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(bundle / graph["library"])), tvm.cpu())
    x = _input(name)
    got = vm["main"](tvm.runtime.tensor(x, tvm.cpu())).numpy()
    expected = _reference(model, x)
    assert got.shape == expected.shape
    assert float(np.abs(got - expected).max()) <= TOL


@pytest.mark.parametrize("quant", ["q0f32", "q0f16"])
def test_adreno_build_places_every_kernel_on_the_gpu(exported, build_bundle, quant):
    path, _ = exported["encoder"]
    bundle = build_bundle(path, "android-adreno", quant)
    cov = json.loads((bundle / "reports" / "coverage.json").read_text())
    assert cov["kernels"] and all(k["placement"] == "GPU" for k in cov["kernels"])
    assert cov["summary"]["decode_step"]["accelerator"]["flops_pct"] == 100.0
    assert {"matmul", "layernorm"} <= {k["op_class"] for k in cov["kernels"]}
    assert "ONNX graph" in (bundle / "reports" / "coverage.md").read_text()
    assert "ONNX graph" in (bundle / "reports" / "coverage.html").read_text()
    assert list((bundle / "lib").glob("*.tar"))
    if quant == "q0f16":   # fp16 compute inside the graph
        assert any(p["dtype"] == "float16" for k in cov["kernels"] for p in k["params"])


def test_adreno_opencl_kernels_run_on_pocl(exported, build_bundle):
    """Every OpenCL kernel of the encoder's adreno build, in graph order on real tensors, vs LLVM and torch."""
    import tvm

    from pipeline.compiler.schedule import schedule_module
    from pipeline.config import load_target
    from pipeline.onnx_stages import fuse_graph, import_onnx
    from pipeline.verify.opencl import find_opencl_device, run_relax_on_pocl

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform (install pocl-opencl-icd)")
    path, model = exported["encoder"]
    target = load_target("android-adreno")
    # Same device target and rules as the build; host code for this machine so the launch plan can be read.
    tvm_target = tvm.target.Target({**target.tvm_target, "host": {"kind": "llvm"}})
    fused = fuse_graph(import_onnx(path, "float32"), tvm_target)
    scheduled, _ = schedule_module(tvm.IRModule(dict(fused.functions_items())), tvm_target,
                                   target.schedule_rules, "gpu")
    x = _input("encoder", seed=2)
    outs, errors = run_relax_on_pocl(fused, scheduled, [x], tvm_target)
    built = {k["name"] for k in json.loads(
        (build_bundle(path, "android-adreno", "q0f32") / "reports" / "coverage.json").read_text())["kernels"]}
    print(f"\nPoCL: {len(errors)} of {len(built)} OpenCL kernels of the encoder executed, max rel. diff vs LLVM "
          f"{max(errors.values()):.2e}")
    assert set(errors) == built
    assert max(errors.values()) <= TOL
    assert float(np.abs(outs[0] - _reference(model, x)).max()) <= TOL


# ---------------------------------------------------------------------------------------------- errors
def _build_cli(model: Path, tmp_path: Path, capsys, quant: str = "q0f32", target: str = "host-cpu"):
    rc = cli_main(["build", "--model", str(model), "--target", target, "--quant", quant, "--out",
                   str(tmp_path / "dist")])
    err = capsys.readouterr().err.strip()
    return rc, err


def test_quantized_scheme_is_refused_in_one_line(exported, tmp_path, capsys):
    rc, err = _build_cli(exported["mlp"][0], tmp_path, capsys, quant="q4f16")
    assert rc == 2 and len(err.splitlines()) == 1
    assert "q4f16" in err and "q0f32" in err and "mlp.onnx" in err
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())


def test_unsupported_onnx_op_is_named(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Celu", ["r"], ["y"])],
                              "celu", [x], [y])
    path = tmp_path / "celu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    rc, err = _build_cli(path, tmp_path, capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert "Celu" in err and "celu.onnx" in err and "Relu" not in err
    assert not any((tmp_path / "dist").glob("*")) if (tmp_path / "dist").exists() else True


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_onnx_file_is_one_line(exported, tmp_path, capsys, damage):
    data = exported["mlp"][0].read_bytes()
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x00not an onnx model\xff" * 8 if damage == "garbage" else data[: len(data) // 3])
    rc, err = _build_cli(path, tmp_path, capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "broken.onnx" in err and "ONNX" in err
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())


@pytest.mark.parametrize("target", ["android-cpu", "ios-metal", "android-hexagon"])
def test_other_targets_build_with_reports(exported, build_bundle, target):
    path, _ = exported["mlp"]
    bundle = build_bundle(path, target, "q0f16")
    cov = json.loads((bundle / "reports" / "coverage.json").read_text())
    assert list((bundle / "lib").glob("*.tar")) and (bundle / "reports" / "coverage.html").is_file()
    places = {k["placement"] for k in cov["kernels"]}
    if target == "ios-metal":
        assert places == {"GPU"}
    elif target == "android-cpu":
        assert places == {"CPU"}
    else:   # NPU only where the Hexagon object has HVX code; CPU with a reason for the rest
        assert places <= {"NPU", "CPU"} and "CPU" in places
        assert all(k.get("reason") for k in cov["kernels"])
        on_npu = [k for k in cov["kernels"] if k["placement"] == "NPU"]
        assert all(k.get("hvx_instructions", 0) > 0 for k in on_npu)
        # this graph's NPU-class kernel (a cast) fills no whole HVX vector: it is on the CPU, saying so
        assert bool(list((bundle / "lib").glob("*hexagon_hvx.tar"))) == bool(on_npu)
