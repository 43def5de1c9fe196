"""Forced CPU fallback (target YAML `force_cpu`, `--force-cpu`): pinned kernels are compiled for the host
CPU, wrapped in device copies, reported as CPU with the reason, and counted in the crossings."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import pytest
import tvm
from test_model_numerics import tiny_hf_model
from tvm import relax, te

from pipeline import config
from pipeline.cli import main as cli_main
from pipeline.compiler import force_cpu
from pipeline.errors import ConfigError

HIDDEN, LAYERS = 128, 2


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder, _ = tiny_hf_model(tmp_path_factory.mktemp("force"), "llama", num_hidden_layers=LAYERS)
    return folder


def _run(folder, target, out, force=None):
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    # verify=False: these tests read placement, reports and objects, not the build-time PoCL run (~60-120 s)
    return run_pipeline(str(folder), target, "q4f16", out=str(out), report=Reporter(quiet=True),
                        force_cpu=force, verify=False).bundle


@pytest.fixture(scope="module")
def forced_adreno(tiny_llama, tmp_path_factory):
    return _run(tiny_llama, "android-adreno", tmp_path_factory.mktemp("forced"), "rmsnorm")


def test_unknown_op_class_is_one_line_error(capsys):
    with pytest.raises(ConfigError, match="unknown op class.*softmax.*use some of: dequant-gemv, "):
        force_cpu.parse_classes("rmsnorm,softmax", "--force-cpu")
    assert cli_main(["build", "--model", "smollm2-135m", "--force-cpu", "rmsnorm,softmax"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "softmax" in err and "rmsnorm" in err and "--force-cpu" in err


def test_target_yaml_force_cpu(tmp_path, monkeypatch):
    text = config.TARGETS["android-adreno"].read_text()
    good, bad = tmp_path / "adreno-norm-cpu.yaml", tmp_path / "adreno-bad.yaml"
    good.write_text(text + "force_cpu: [rmsnorm]\n")
    bad.write_text(text + "force_cpu: [rmsnorm, nonsense]\n")
    monkeypatch.setitem(config.TARGETS, "adreno-norm-cpu", good)
    monkeypatch.setitem(config.TARGETS, "adreno-bad", bad)
    target = config.load_target("adreno-norm-cpu")
    assert target.force_cpu == ("rmsnorm",)
    assert force_cpu.reasons(target, "elementwise") == {
        "rmsnorm": "by config: targets/adreno-norm-cpu.yaml force_cpu", "elementwise": "by option --force-cpu"}
    with pytest.raises(ConfigError, match=r"adreno-bad.yaml: unknown op class\(es\) nonsense in force_cpu"):
        config.load_target("adreno-bad")


def test_forced_kernels_on_cpu_in_report(forced_adreno):
    cov = json.loads((forced_adreno / "reports" / "coverage.json").read_text())
    norms = [r for r in cov["kernels"] if r["op_class"] == "rmsnorm"]
    assert norms and all(r["placement"] == "CPU" and r["reason"] == "forced (by option --force-cpu)"
                         and r["rule"] == "forced-cpu" for r in norms)
    assert all(r["placement"] == "GPU" for r in cov["kernels"] if r["op_class"] != "rmsnorm")
    c = cov["summary"]["crossings"]
    # decode: CPU norm, GPU ... per layer two norms, then the final norm; the first kernel is a norm
    n_norm_calls = 2 * LAYERS + 1
    assert c["accelerator"] == "GPU" and c["crossings_per_token"] == 2 * n_norm_calls - 1
    # the first norm (of the embedding) copies its input and fp16 weight to the CPU and its output back; every
    # other is the GPU targets' fused residual add + RMSNorm (kernels/gpu/add_norm.py), pinned whole with its
    # CPU form: two inputs and the weight in, the sum and the normalised sum back
    assert c["bytes_moved_per_token"] == (3 + (n_norm_calls - 1) * 5) * HIDDEN * 2
    assert cov["summary"]["decode_step"]["cpu"]["bytes"] > 0
    md = (forced_adreno / "reports" / "coverage.md").read_text()
    assert "CPU<->GPU crossings per decoded token" in md and "forced (by option --force-cpu)" in md


def test_forced_kernels_compiled_for_host(forced_adreno):
    info = json.loads((forced_adreno / "reports" / "kernels.json").read_text())
    with tarfile.open(forced_adreno / "lib" / info["library"]) as tar:
        blobs = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    device = b"".join(v for k, v in blobs.items() if k.endswith("devc.o"))
    host = b"".join(v for k, v in blobs.items() if not k.endswith("devc.o"))
    prefix = info["system_lib_prefix"].encode()
    assert b"__kernel void " + prefix + b"fused_dequantize" in device          # GEMVs stay OpenCL
    assert b"__kernel void " + prefix + b"rms_norm" not in device            # norms are not OpenCL
    assert b"__tvm_ffi_" + prefix + b"rms_norm" in host                       # ... but host code


@pytest.mark.slow   # a second Adreno build (~40 s); the forced build's report is pinned above
def test_force_changes_cache_key(forced_adreno, tiny_llama, tmp_path):
    plain = _run(tiny_llama, "android-adreno", tmp_path)
    key = lambda b: json.loads((b / "reports" / "kernels.json").read_text())["key"]  # noqa: E731
    assert key(plain) != key(forced_adreno)
    cov = json.loads((plain / "reports" / "coverage.json").read_text())
    assert {r["placement"] for r in cov["kernels"]} == {"GPU"} and "crossings" not in cov["summary"]


def test_device_copies_keep_numerics():
    """The rewrite (inputs to the CPU device, call there, output back) computes the same values on a VM."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    w = relax.Var("w", relax.TensorType((64,), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_te(lambda a: te.compute((4, 64), lambda i, j: a[i, j] * 2.0), x, primfunc_name_hint="mul")
            z = bb.emit_te(lambda a, b: te.compute((4, 64), lambda i, j: a[i, j] + b[j]), y, w,
                           primfunc_name_hint="pinned")
            o = bb.emit_output(bb.emit_te(lambda a: te.compute((4, 64), lambda i, j: a[i, j] - 1.0), z,
                                          primfunc_name_hint="sub"))
        bb.emit_func_output(o)
    mod = bb.get()
    target = tvm.target.Target({"kind": "llvm"})
    funcs = {gv.name_hint: f for gv, f in mod.functions_items()}
    moved = force_cpu._to_host(mod, funcs, ["pinned"], target)
    text = moved["main"].script()
    assert text.count("R.to_vdevice") == 3
    from pipeline.compiler.compile import lowering_pipeline

    vm = relax.VirtualMachine(relax.build(moved, target, relax_pipeline=lowering_pipeline(target)),
                                [tvm.cpu(), tvm.cpu()])   # like [GPU, host CPU] on a phone
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 64)).astype("float32"), rng.standard_normal(64).astype("float32")
    got = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_allclose(got, a * 2 + b - 1, rtol=1e-6)


def test_hexagon_force_leaves_npu():
    """On the NPU target a forced class leaves the NPU (placement only; the CPU library has every kernel)."""
    from pipeline.compiler.schedule import KernelSchedule

    rec = [KernelSchedule("rms_norm", "hvx", True, "HVX: compiled, not executed")]
    mod = tvm.IRModule({"rms_norm": _norm_func()})
    _, out = force_cpu.apply(mod, {}, rec, {"rmsnorm": "by option --force-cpu"},
                             config.load_target("android-hexagon"))
    assert out[0].on_device is False and out[0].reason == "forced (by option --force-cpu)"


def _norm_func():
    x = te.placeholder((1, 64), name="x")
    wt = te.placeholder((64,), name="w")
    k = te.reduce_axis((0, 64), "k")
    sq = te.compute((1,), lambda i: te.sum(x[i, k] * x[i, k], axis=k), name="sq")
    y = te.compute((1, 64), lambda i, j: x[i, j] * te.rsqrt(sq[i] / 64.0) * wt[j], name="y")
    return te.create_prim_func([x, wt, y])


def test_runtime_driven_kernels_cannot_be_pinned_on_gpu():
    """Paged-KV attention runs inside the runtime's KV cache on GPU buffers: pinning it is a one-line error."""
    from pipeline.compiler.schedule import KernelSchedule
    from pipeline.config import load_target

    rec = [KernelSchedule("batch_decode_paged_kv", "library", True)]
    mod = tvm.IRModule({"batch_decode_paged_kv": _norm_func()})
    with pytest.raises(ConfigError, match="batch_decode_paged_kv .*library kernel.*cannot be pinned"):
        force_cpu.apply(mod, {}, rec, {"attention": "by option --force-cpu"}, load_target("android-adreno"))
