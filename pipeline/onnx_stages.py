"""ONNX graphs through the same targets and reports as the LLMs: import -> fuse -> tune -> build -> emit.

`python -m pipeline build --model path/to/model.onnx --target <t> --quant q0f32|q0f16` imports the graph
with `tvm.relax.frontend.onnx` (weights become constants of the library: an ONNX graph is compiled as
given), then runs the LLM path's own fuse passes, schedule rules, coverage report and library export. The
bundle holds the library, `graph.json` (the inputs and outputs of its one entry function `main`),
`reports/{coverage.json,coverage.md,coverage.html,kernels.json}` and a manifest.

Weight quantization (q4/q8 schemes) is for the LLM path's own layers and is refused here in one line;
`q0f16` runs the graph in float16 (TVM's ToMixedPrecision: fp16 compute, fp32 at the graph's edges) on
targets whose compute dtype is float16.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import tvm
from tvm import relax, transform
from tvm.relax.frontend.onnx import from_onnx, onnx_frontend

from pipeline.artifacts.bundle import atomic_dir, file_sha256, tool_versions, write_manifest
from pipeline.cache import (
    cache_root,
    copy_file,
    digest,
    reusable_entry,
    source_hash,
    tvm_versions,
    write_entry_manifest,
)
from pipeline.compiler.backend import backend_for
from pipeline.compiler.compile import compile_library
from pipeline.compiler.fuse import fusion_passes
from pipeline.config import ModelSpec, QuantSpec, TargetSpec
from pipeline.errors import CompileError, ConfigError, WeightsError
from pipeline.report.coverage import coverage_report, write_coverage
from pipeline.report.html import write_coverage_html

ONNX_SUFFIX = ".onnx"
# An ONNX graph has one entry; both report phases count one inference of it.
PHASE_FUNCS = {"decode_step": ("main",), "prefill_chunk": ("main",)}
PHASE_NOTE = ("ONNX graph: one entry function `main`; the decode-step and prefill-chunk columns both count "
              "one inference of the graph")


def is_onnx(spec: ModelSpec) -> bool:
    return spec.weights is not None and spec.weights.suffix.lower() == ONNX_SUFFIX and spec.weights.is_file()


def check_quant(quant: QuantSpec, path: Path) -> None:
    if quant.weight_format != "float" or quant.formats:
        raise ConfigError(f"quantization {quant.name!r} is not available for ONNX graphs (they are compiled "
                          "as given, weights in float)", path=path, fix="use --quant q0f32 or --quant q0f16")


def read_onnx(path: Path):
    """The ModelProto, or a one-line WeightsError for a file that is not a valid ONNX model."""
    import onnx  # local: only ONNX builds load onnx / protobuf
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path))
    except (DecodeError, ValueError, RuntimeError, OSError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise WeightsError(f"not a readable ONNX model ({first})", path=path,
                           fix="re-export it (torch.onnx.export) or check the file was copied completely") from None
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        first = (str(err).strip().splitlines() or ["invalid"])[0][:160]
        raise WeightsError(f"not a valid ONNX model ({first})", path=path,
                           fix="re-export it (torch.onnx.export) or check the file was copied completely") from None
    if not model.graph.node:
        raise WeightsError("the ONNX graph has no nodes", path=path, fix="export a model with at least one op")
    return model


def unsupported_ops(model) -> list[str]:
    """Op types of the graph that TVM's ONNX importer has no converter for."""
    known = set(onnx_frontend._get_convert_map()) | {"Constant", "If"}
    return sorted({n.op_type for n in model.graph.node if n.op_type not in known})


def import_onnx(path: Path, compute_dtype: str):
    """Relax IRModule with one function `main` (weights as constants), in `compute_dtype`."""
    model = read_onnx(path)
    missing = unsupported_ops(model)
    if missing:
        raise CompileError(f"ONNX op(s) not supported by TVM's importer: {', '.join(missing)}", path=path,
                           fix="replace them with supported ops when exporting (or decompose them)")
    try:
        mod = from_onnx(model, keep_params_in_input=False)
    except (tvm.error.OpNotImplemented, NotImplementedError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise CompileError(f"TVM's ONNX importer cannot convert this graph ({first})", path=path,
                           fix="export with another opset or replace the op it names") from None
    mod = relax.transform.DecomposeOpsForInference()(mod)
    if compute_dtype == "float16":
        mod = relax.transform.ToMixedPrecision(out_dtype="float16")(mod)
    return mod


def graph_signature(mod) -> dict[str, Any]:
    """Inputs and outputs of `main` (name, shape, dtype): what a runtime needs to call the library."""
    func = mod["main"]

    def tensor(name: str, ty) -> dict[str, Any]:
        shape = [int(d) if hasattr(d, "value") else str(d) for d in ty.shape.values] \
            if isinstance(ty.shape, relax.ShapeExpr) else None
        return {"name": name, "shape": shape, "dtype": str(ty.dtype)}

    out_ty = func.ret_ty
    outs = out_ty.fields if isinstance(out_ty, relax.TupleType) else [out_ty]
    return {"entry": "main", "inputs": [tensor(p.name, p.ty) for p in func.params],
            "outputs": [tensor(f"output_{i}", t) for i, t in enumerate(outs)]}


def fuse_graph(mod, tvm_target):
    """The LLM path's fuse passes (transpose into matmul, FuseOps/FuseTIR) under the target."""
    with tvm_target:
        return transform.Sequential(fusion_passes())(mod)


def _prefix(name: str) -> str:
    """System-lib prefix: a C identifier fragment from the model name."""
    return "onnx_" + re.sub(r"[^0-9a-zA-Z_]", "_", name) + "_"


def build_graph(spec: ModelSpec, quant: QuantSpec, target: TargetSpec, report) -> tuple[Path, dict[str, Any]]:
    """import + fuse + tune + compile, cached like the LLM path's build under a key over the file's bytes."""
    path = spec.weights
    check_quant(quant, path)
    act = quant.activation_dtype(target)
    tvm_target = target.tvm()
    backend = backend_for(target)
    # key facts: android-cpu and android-hexagon share the host target dict but not the library set
    key = digest({"onnx": file_sha256(path), "quant": quant.name, "act": act, "target": str(tvm_target.export()),
                  "rules": target.schedule_rules, "device": target.device, **backend.key_facts(),
                  "code": source_hash(), "versions": tvm_versions()})
    out = cache_root() / "lib" / key
    if reusable_entry(out, "build.json", "build", report):
        return out, json.loads((out / "build.json").read_text())
    with report.step(f"import {path.name} (ONNX)"):
        mod = import_onnx(path, act)
    signature = graph_signature(mod)
    prefix = _prefix(spec.name)
    with atomic_dir(out) as tmp:
        with report.step("fuse"):
            mod = fuse_graph(mod, tvm_target)
        with report.step(backend.tune_step):
            mod, schedules = backend.schedule(mod)
        schedules = backend.place(mod, schedules, vocab_size=-1, report=report)   # no lm_head in a graph
        coverage = coverage_report(mod, schedules, target, phase_funcs=PHASE_FUNCS, phase_note=PHASE_NOTE)
        write_coverage(coverage, tmp)
        meta = {"model_type": "onnx", "source": path.name, "quantization": quant.name,
                "activation_dtype": act, **signature}
        info = compile_library(mod, meta, schedules, backend, prefix, key, tmp, report)
        write_entry_manifest(tmp)   # last: a later build reuses the entry only when it matches
    return out, info


def emit_graph(spec: ModelSpec, quant: QuantSpec, target: TargetSpec, lib_dir: Path, info: dict[str, Any],
               out_root: Path, request_key: str) -> Path:
    """dist/<name>-<quant>-<target>/: lib, graph.json, reports, manifest — written whole, then renamed."""
    final = out_root / f"{spec.name}-{quant.name}-{target.name}"
    with atomic_dir(final) as tmp:
        (tmp / "lib").mkdir()
        for lib in filter(None, (info["library"], info.get("npu_library"))):
            copy_file(lib_dir / lib, tmp / "lib" / lib)
        (tmp / "reports").mkdir()
        shutil.copyfile(lib_dir / "build.json", tmp / "reports" / "kernels.json")
        for name in ("coverage.json", "coverage.md"):
            shutil.copyfile(lib_dir / name, tmp / "reports" / name)
        write_coverage_html(tmp / "reports")
        graph = {k: info["metadata"][k] for k in ("entry", "inputs", "outputs", "activation_dtype", "source")}
        graph["system_lib_prefix"] = info["system_lib_prefix"]
        graph["library"] = f"lib/{info['library']}"
        (tmp / "graph.json").write_text(json.dumps(graph, indent=2, sort_keys=True))
        write_manifest(tmp, build_key=digest({"lib": info["key"], "code": source_hash()}),
                       tool_versions=tool_versions(),
                       extra={"model": spec.name, "model_format": "onnx", "quantization": quant.name,
                              "target": target.name, "library": f"lib/{info['library']}",
                              "has_weights": True, "weights": "constants inside the library",
                              "request_key": request_key})
    return final
