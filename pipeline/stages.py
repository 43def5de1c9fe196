"""The whole pipeline in one place: load -> quantize -> fuse -> tune -> build -> emit.

Each stage is a function with explicit inputs and outputs. The two expensive products — converted
weights and the compiled library — are cached under a key that hashes everything they depend on
(model config, weights identity, quantization, target, pipeline source, TVM versions), so an unchanged
rebuild only re-checks keys and re-emits the bundle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from pipeline.artifacts.bundle import atomic_dir, bundle_current, tool_versions, write_manifest
from pipeline.artifacts.chat_config import chat_config
from pipeline.artifacts.conversation import template_digest
from pipeline.cache import (
    ENTRY_MANIFEST,
    cache_root,
    copy_file,
    digest,
    reusable_entry,
    source_hash,
    tvm_versions,
    write_entry_manifest,
)
from pipeline.compiler import force_cpu as forcing
from pipeline.compiler.backend import backend_for
from pipeline.compiler.compile import compile_library, memory_usage
from pipeline.compiler.force_cpu import reasons
from pipeline.compiler.fuse import fusion_passes
from pipeline.compiler.signatures import function_signatures, kv_cache_config_fields
from pipeline.compiler.tuning import database_digest, load_database
from pipeline.config import (
    Q4_INTERLEAVE,
    Q8_INTERLEAVE,
    T2_INTERLEAVE,
    T3_INTERLEAVE,
    TILE_FIELDS,
    ModelSpec,
    QuantSpec,
    TargetSpec,
    load_cpu_class,
    load_model,
    load_phone,
    load_quant,
    load_runtime,
    load_target,
)
from pipeline.errors import ConfigError, PipelineError, WeightsError
from pipeline.frontend.checkpoint import config_only, open_checkpoint
from pipeline.frontend.hf_config import text_config
from pipeline.frontend.validate import UNUSED_PREFIXES, check_against_checkpoint
from pipeline.kernels.cpu import rope as cpu_rope
from pipeline.models import config_from_hf, model_class
from pipeline.models.engine_table import with_kv_config_fields
from pipeline.models.split import SplitFactory
from pipeline.onnx_stages import build_graph, check_quant, emit_graph, is_onnx
from pipeline.progress import Reporter
from pipeline.quant.auto_plan import auto_markdown, plan_auto
from pipeline.quant.calibrate import Calibration
from pipeline.quant.convert import unread_tensors
from pipeline.quant.memory_plan import memory_plan, modes_for_scheme, plan_markdown
from pipeline.quant.resumable import convert_weights
from pipeline.report.coverage import add_dot_code, coverage_report, write_coverage
from pipeline.report.html import write_coverage_html
from pipeline.verify.execution import record_execution, verify_mode


# --------------------------------------------------------------------------------------- stages
@dataclass
class Loaded:
    """Output of load: the model's config and (optionally) a streaming weight source."""

    spec: ModelSpec
    hf_config: dict[str, Any]
    decoder: Any                      # DecoderConfig
    checkpoint: Any | None            # load.Checkpoint or None (config-only build)
    generation_config: dict[str, Any] = field(default_factory=dict)


def load(spec: ModelSpec, report: Reporter | None = None) -> Loaded:
    """Open the checkpoint and read its every byte once (remembered per file, see cache.remembered): the
    weights' content key, and NaN / inf refused before any work. A HF folder with a config.json and no
    weight files is a config-only build, like a registry model without weights."""
    bare = config_only(spec.weights) if spec.weights is not None and spec.hf_config is None else None
    ckpt = open_checkpoint(spec.weights) if spec.weights is not None and bare is None else None
    if bare is not None and report is not None:
        report.info(f"load: {spec.weights} has a config.json and no weight files: building the library and "
                    "configs alone (the bundle says so in NO_WEIGHTS.txt)")
    hf = spec.hf_config or bare or (ckpt.config if ckpt else None)
    if hf is None:
        raise PipelineError("no config and no weights", path=spec.path, fix="give --weights DIR")
    source = str(spec.path or spec.weights)
    decoder = config_from_hf(hf, source=source, context_window_size=spec.context_window_size,
                             prefill_chunk_size=spec.prefill_chunk_size)
    if ckpt is not None:   # before any stage: a config that disagrees with its tensors is one line, not a late crash
        config_file = spec.path if spec.hf_config else ckpt.path / "config.json" if ckpt.path.is_dir() else ckpt.path
        check_against_checkpoint(text_config(hf, source=config_file), ckpt, config_file)
        ckpt.fingerprint()   # after the cheap checks: reads every byte (once per file, then remembered)
    return Loaded(spec, hf, decoder, ckpt, ckpt.generation_config if ckpt else {})


@dataclass
class Defined:
    """The nn.Module with storage chosen by the quantization scheme, and its parameter list."""

    module: Any
    params: list[tuple[str, Any]]
    mod: Any                          # exported Relax IRModule
    layout: str
    activation_dtype: str
    splits: list[dict[str, Any]] = field(default_factory=list)   # tensors split for max_buffer_bytes


def define(loaded: Loaded, quant: QuantSpec, target: TargetSpec, report: Reporter | None = None) -> Defined:
    """The model in the scheme's storage; vocab tables over the target's `capabilities.max_buffer_bytes`
    come in parts (models/split.py)."""
    layout = quant.layout_for(target)
    act = quant.activation_dtype(target)
    limit = (target.capabilities or {}).get("max_buffer_bytes")
    factory = SplitFactory(dtype=act, weight_format=quant.weight_format, weight_dtype=quant.weight_dtype,
                           layout=layout, formats=dict(quant.formats), rotation=quant.rotation,
                           ternary_source=quant.ternary_source, kv_dtype=quant.kv_cache_dtype(target),
                           max_buffer_bytes=int(limit) if limit else None,
                           q8_tile=target.q8_tile if layout == "KN" else target.q8_interleave,   # NK: rows
                           q4_tile=target.q4_tile if layout == "KN" else target.q4_interleave,   # NK: rows
                           t2_tile=target.t2_tile if layout == "KN" else target.t2_interleave,   # NK: rows
                           t3_interleave=target.t3_interleave if layout == "NK" else 0)
    module = model_class(loaded.decoder)(loaded.decoder, factory, target.tvm())
    mod, params = module.export_tvm(spec=module.export_spec())
    mod = with_kv_config_fields(mod, load_runtime(target.runtime).kv_cache_config_fields)
    if hasattr(module, "rope_settings"):      # for the CPU RoPE kernel (cpu_rope.py)
        mod = cpu_rope.annotate(mod, module.rope_settings())
    too_big = [n for n, p in params if limit and _nbytes(p) > int(limit)]
    if too_big and report is not None:
        report.info(f"[yellow]warning:[/] {', '.join(too_big[:3])} exceed {target.name}'s max single allocation "
                    f"({limit} bytes) and are not vocab tables, which alone are split")
    for sp in factory.splits:
        size = f"{sp['bytes'] / 2**30:.2f} GiB" if sp["bytes"] >= 2**28 else f"{sp['bytes']} bytes"
        sp["message"] = (f"split {sp['role']} ({size}) into {sp['parts']} parts "
                         f"(reason: max single allocation {sp['max_buffer_bytes']} bytes on {target.name})")
        if report is not None:
            report.info(sp["message"])
    return Defined(module, params, mod, layout, act, factory.splits)


def _nbytes(param: Any) -> int:
    return int(np.prod([int(d) for d in param.shape])) * np.dtype(str(param.dtype)).itemsize


def quantize(loaded: Loaded, defined: Defined, quant: QuantSpec, report: Reporter,
             calibration: Any = None) -> Path | None:
    """Stream checkpoint tensors through conversion + quantization into a cached tensor cache.

    Memory stays bounded (tensors are converted in row blocks) and an interrupted conversion resumes
    where it stopped on the next run (see `resumable.convert_weights`). `calibration`: the run's
    calibrate.Calibration, shared with QUANT=auto's planning (made here when None and the scheme asks).
    """
    if loaded.checkpoint is None:
        return None
    _report_unused(loaded.checkpoint, report)
    _refuse_unread(loaded, defined)
    # conversion options ride on the parameters' attrs (ternary format/source, rotation): part of the key
    calib = quant.calibration_spec
    key = digest({"weights": loaded.checkpoint.fingerprint(), "quant": quant.name, "layout": defined.layout,
                   "params": [(n, [int(x) for x in p.shape], p.dtype, *([dict(p.attrs)] if p.attrs else []))
                              for n, p in defined.params],
                   "code": source_hash(), **({"calibration": calib.identity()} if calib else {})})
    out = cache_root() / "weights" / key
    ptq = quant.ternary and quant.ternary_source == "ptq"
    if ptq and _sign_kind(quant) == "binary":
        report.info(f"[yellow]warning:[/] {quant.name}: post-training binarisation of an ordinary model destroys "
                    "its quality (worse than ternarisation); for real use import a natively binary checkpoint "
                    "(--quant binary)")
    elif ptq:
        report.info(f"[yellow]warning:[/] {quant.name}: post-training ternarisation of an ordinary model loses "
                    "quality (Llama-3-8B at 1.88 bpw: perplexity 6.77 -> 69.6); for real use import a natively "
                    "ternary checkpoint (--quant ternary)")
    if reusable_entry(out, "tensor-cache.json", "quantize", report):
        return out
    stats: dict[str, float] = {}
    with _calibration(loaded, calib, report, calibration) as calibration:
        result = convert_weights(loaded.checkpoint, defined.params, defined.layout, out, report=report,
                                 tied=loaded.decoder.tie_word_embeddings,
                                 metadata={"ParamSize": len(defined.params)}, stats=stats, calibration=calibration)
    _report_ternary(quant, stats, report)
    if stats.get("calib_tensors"):
        rel = (stats["calib_err"] / stats["calib_energy"]) ** 0.5 if stats["calib_energy"] else 0.0
        report.info(f"quantize: {int(stats['calib_tensors'])} tensors calibrated; relative output error "
                    f"||(W - Q) x|| / ||W x|| on the calibration text {rel:.1%} overall, worst "
                    f"{stats['calib_worst'] ** 0.5:.1%} ({stats['calib_worst_name']})")
    return result


@contextlib.contextmanager
def _calibration(loaded: Loaded, spec: Any, report: Reporter, given: Any = None):
    """A calibrate.Calibration (None for round-to-nearest schemes or without weights); `given` is reused."""
    if given is not None or spec is None or loaded.checkpoint is None:
        yield given if spec is not None else None
        return

    tmp = cache_root() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    with Calibration(loaded.checkpoint, loaded.hf_config, spec, report, work_dir=tmp,
                     store=cache_root() / "calibrated") as calibration:
        yield calibration   # measured on first use: not at all when every tensor is in the store


def _sign_kind(quant: QuantSpec) -> str:
    """"binary" when the scheme stores any role in b1, else "ternary" (for messages)."""
    return "binary" if "b1" in (quant.weight_format, *quant.formats.values()) else "ternary"


def _report_ternary(quant: QuantSpec, stats: dict[str, float], report: Reporter) -> None:
    """The measured weight-space loss of ternarisation / binarisation (PTQ), or how exact a native import was."""
    if not stats.get("groups"):
        return
    rel = (stats["err2"] / stats["norm2"]) ** 0.5 if stats["norm2"] else 0.0
    kind = _sign_kind(quant)
    if quant.ternary_source == "ptq":
        report.info(f"[yellow]warning:[/] {quant.name}: {kind} weights differ from the checkpoint's by "
                    f"||W - T||/||W|| = {rel:.3f} over {int(stats['groups'])} groups of 128")
    else:
        rounded = int(stats.get("scale_rounded", 0))
        report.info(f"quantize: imported {int(stats['groups'])} {kind} groups; relative error {rel:.2g}"
                    + (f"; {rounded} scales are not fp16 numbers and were rounded to fp16" if rounded else
                       "; every scale kept exactly"))


def _report_unused(ckpt: Any, report: Reporter) -> None:
    names = ckpt.names()
    skipped = []
    for prefix, what in UNUSED_PREFIXES.items():
        n = sum(1 for name in names if name.startswith(prefix))
        if n:
            skipped.append(f"{n} {what} tensors ({prefix}*)")
    if skipped:
        report.info(f"load: skipping {' and '.join(skipped)}: not needed for text generation")


def _refuse_unread(loaded: Loaded, defined: Defined) -> None:
    """One line, before anything is written, for checkpoint tensors the model built from this config never
    reads: the bundle would silently compute a different model than the checkpoint's."""
    unread = unread_tensors(loaded.checkpoint, defined.params, defined.layout, loaded.decoder.tie_word_embeddings)
    if unread:
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        raise WeightsError(f"the model this config describes never reads checkpoint tensor {unread[0]!r}{more}: "
                           "a bundle built without them would compute a different model",
                           path=loaded.checkpoint.path,
                           fix="use the config.json that came with these weights (model_type, biases, norms)")


def fuse(defined: Defined, target: TargetSpec):
    with target.tvm():
        return tvm.transform.Sequential(fusion_passes())(defined.mod)


def tune(mod: Any, target: TargetSpec):
    """Tuned records of the target's database first (compiler/tuning.py), then the target's default rules."""
    return backend_for(target).schedule(mod, load_database(target.name))


def build(loaded: Loaded, defined: Defined, quant: QuantSpec, target: TargetSpec,
          report: Reporter, force_cpu: str | None = None,
          verify: bool | str | None = None) -> tuple[Path, dict[str, Any]]:
    """fuse + tune + compile, cached by a key over everything the library depends on.

    `force_cpu`: comma-separated op classes pinned to the CPU on top of the target's `force_cpu`.
    `verify`: run the kernels on PoCL (None: the target's `verify_kernels`; see execution.verify_mode for
    "oclgrind" / "no-oclgrind" and the default quick Oclgrind pass)."""
    meta = defined.module.metadata(quant.name, defined.params)
    meta["activation_dtype"] = defined.activation_dtype
    meta["weight_layout"] = defined.layout
    # KN codes stored tiled: q8 (quantize.tile_q8: [N / q8_tile, K / 2, 2 q8_tile]); q4 / t2 codes and scales
    # (quantize.tile_kn: [N / t, rows, t], t per tensor at most the recorded one)
    for tile_field in TILE_FIELDS:
        tiles = {int(p.attrs[tile_field]) for _, p in defined.params if p.attrs and p.attrs.get(tile_field)}
        if tiles:
            meta[tile_field] = max(tiles)
    for tile_field, rows_field in (("q4_tile", Q4_INTERLEAVE), ("q8_tile", Q8_INTERLEAVE), ("t2_tile", T2_INTERLEAVE)):
        if defined.layout == "NK" and tile_field in meta:   # NK rows interleaved (formats.interleave_rows)
            meta[rows_field] = meta.pop(tile_field)
    t3_rows = {int(p.attrs[T3_INTERLEAVE]) for _, p in defined.params if p.attrs and p.attrs.get(T3_INTERLEAVE)}
    if t3_rows:     # NK t3 rows interleaved (no KN tile exists for t3)
        meta[T3_INTERLEAVE] = max(t3_rows)
    tvm_target = target.tvm()
    backend = backend_for(target)
    forced = forcing.reasons(target, force_cpu)
    verify = verify_mode(target, verify, sum(_nbytes(p) for _, p in defined.params))
    key = digest({"decoder": loaded.decoder.to_json(), "quant": quant.name,
                  "prefix": system_lib_prefix(loaded.spec.name, quant.name), "layout": defined.layout,
                   "act": defined.activation_dtype, "target": str(tvm_target.export()),
                   "rules": target.schedule_rules, "code": source_hash(), "versions": tvm_versions(),
                   "meta": meta, "force_cpu": forced, "verify": verify, "tuning": database_digest(target.name),
                   "formats": dict(quant.formats), "ternary_source": quant.ternary_source, "runtime": target.runtime,
                   **({"rotation": quant.rotation} if quant.rotation else {}), **backend.key_facts()})
    out = cache_root() / "lib" / key
    if reusable_entry(out, "build.json", "build", report):
        return out, json.loads((out / "build.json").read_text())
    prefix = system_lib_prefix(loaded.spec.name, quant.name)
    with atomic_dir(out) as tmp:
        with report.step("fuse"):
            mod = fuse(defined, target)
        unscheduled = {gv.name_hint: f for gv, f in mod.functions_items()}
        with report.step(backend.tune_step):
            mod, schedules = tune(mod, target)
        schedules = backend.place(mod, schedules, loaded.decoder.vocab_size, report, unscheduled)
        mod, schedules = forcing.apply(mod, unscheduled, schedules, forced, target)
        if forced:
            n = sum(1 for s in schedules if s.rule == "forced-cpu")
            report.info(f"force_cpu: {n} kernel(s) of {', '.join(forced)} pinned to the CPU")
        coverage = coverage_report(mod, schedules, target, prefill_chunk=loaded.decoder.prefill_chunk_size,
                                   param_names=[n for n, _ in defined.params])
        record_execution(coverage, backend.device_module(mod), loaded, quant, target, schedules, verify, report)
        coverage["splits"] = list(defined.splits)
        coverage["largest_parameter"] = _largest_parameter(defined, target)
        mod, regions = backend.finish(mod)   # after the report: it lists the kernels, not the regions
        if regions is not None:
            coverage["cpu_regions"] = regions
        chunk, batch = meta["prefill_chunk_size"], meta["max_batch_size"]
        meta["memory_usage"] = memory_usage(mod, {"seq_len": chunk, "batch_size": batch, "num_seq": batch}, chunk)
        engine_abi = {"runtime": target.runtime, "device": target.device, "target_kind": target.tvm_target.get("kind"),
                      "kv_cache_config_fields": kv_cache_config_fields(defined.mod),
                      "functions": function_signatures(defined.mod)}
        info = compile_library(mod, meta, schedules, backend, prefix, key, tmp, report, extra={"engine_abi": engine_abi})
        if "dot_code" in info:   # read from the compiled objects: which kernels really run sdot
            add_dot_code(coverage, info["dot_code"])
        write_coverage(coverage, tmp)
        write_entry_manifest(tmp)   # last: a later build reuses the entry only when it matches
    return out, info


def system_lib_prefix(model: str, quant: str) -> str:
    """The library's symbol prefix, unique per model and scheme: an app links several models into one binary,
    and MLC's engine finds each as `system://<model_lib>` (its `-` read as `_`)."""
    name = re.sub(r"[^0-9A-Za-z_]", "_", f"{model}_{quant}")
    return f"{'m_' if name[0].isdigit() else ''}{name}_"


def _largest_parameter(defined: Defined, target: TargetSpec) -> dict[str, Any]:
    """The biggest single tensor the device must allocate, against the target's max single allocation."""
    name, param = max(defined.params, key=lambda kv: _nbytes(kv[1]))
    limit = (target.capabilities or {}).get("max_buffer_bytes")
    return {"name": name, "bytes": _nbytes(param), "max_buffer_bytes": limit,
            "fits": None if not limit else _nbytes(param) <= int(limit)}


def emit(loaded: Loaded, quant: QuantSpec, target: TargetSpec, weights: Path | None, lib_dir: Path,
         build_info: dict[str, Any], out_root: Path, report: Reporter, request_key: str = "",
         extra_reports: dict[str, str] | None = None) -> Path:
    """Assemble dist/<model>-<quant>-<target>/ in a temp dir and rename it into place."""
    name = f"{loaded.spec.name}-{quant.name}-{target.name}"
    final = out_root / name
    build_key = digest({"weights": weights.name if weights else None, "lib": build_info["key"],
                         "code": source_hash(), "reports": extra_reports or {}, "phone": target.phone,
                         "conv_template": template_digest(loaded.spec.conv_template)})
    if bundle_current(final, build_key):
        report.info(f"emit: {final} is up to date (build key {build_key})")
        return final
    with atomic_dir(final) as tmp:
        (tmp / "lib").mkdir()
        copy_file(lib_dir / build_info["library"], tmp / "lib" / build_info["library"])
        if build_info.get("npu_library"):
            copy_file(lib_dir / build_info["npu_library"], tmp / "lib" / build_info["npu_library"])
        (tmp / "reports").mkdir()
        shutil.copyfile(lib_dir / "build.json", tmp / "reports" / "kernels.json")
        for name in ("coverage.json", "coverage.md"):
            shutil.copyfile(lib_dir / name, tmp / "reports" / name)
        _write_memory_plan(loaded, quant, target, build_info, tmp / "reports", report)
        for name, text in (extra_reports or {}).items():
            (tmp / "reports" / name).write_text(text)
        write_coverage_html(tmp / "reports")   # reports/coverage.html: coverage + memory plan, self-contained
        if weights is not None:
            for f in sorted(weights.iterdir()):
                if f.name != ENTRY_MANIFEST:   # the cache's own record, not part of the bundle
                    copy_file(f, tmp / f.name)
        tokenizer_files = []
        if loaded.checkpoint:
            try:
                tokenizer_files = loaded.checkpoint.write_tokenizer(tmp)
            except WeightsError as err:   # a compiled model is still useful; say what is missing
                report.info(f"[yellow]warning:[/] {err} (the bundle has no tokenizer)")
        cfg = chat_config(loaded, quant, build_info, tokenizer_files, tmp, report)
        (tmp / "mlc-chat-config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        if weights is None:
            (tmp / "NO_WEIGHTS.txt").write_text(
                "Built from the model config alone: the library and configs are here, the weights are not.\n"
                "Rebuild with the weights (*.safetensors beside config.json, or --weights DIR) to add "
                "tensor-cache.json + shards.\n")
        write_manifest(tmp, build_key=build_key, tool_versions=tool_versions(),
                       extra={"model": loaded.spec.name, "quantization": quant.name, "target": target.name,
                              "library": f"lib/{build_info['library']}", "has_weights": weights is not None,
                              "runtime": target.runtime,
                              "request_key": request_key})
    return final


def choose_formats(loaded: Loaded, quant: QuantSpec, target: TargetSpec, report: Reporter,
                   calibration: Any = None) -> tuple[QuantSpec, dict[str, str]]:
    """QUANT=auto: per-role formats that fit the phone (see auto_quant.py); the plan is printed and saved.
    With a calibration, each role's error is its layers' output error on the calibration text."""
    result = plan_auto(loaded.hf_config, phone=target.phone, context=int(quant.auto_context),
                       compute_dtype=quant.activation_dtype(target), prefill_chunk=loaded.decoder.prefill_chunk_size,
                       ckpt=loaded.checkpoint, model_name=loaded.spec.name, calibration=calibration,
                       min_format=quant.auto_min_format)
    text = auto_markdown(result)
    report.info(text.rstrip())
    saved = {k: v for k, v in result.items() if k != "plan"}
    return (dataclasses.replace(quant, formats=result["formats"]),
            {"quant_auto.md": text, "quant_auto.json": json.dumps(saved, indent=1, sort_keys=True, default=str)})


def _phone_with_class(target: TargetSpec) -> dict[str, Any] | None:
    """The target's phone for the memory plan, naming the CPU class the library was built for (if any)."""
    if not target.phone:
        return None
    if not target.cpu_class:
        return dict(target.phone)
    cls = load_cpu_class(target.cpu_class)
    return {**target.phone, "cpu_class": cls["name"], "cpu_class_description": cls["description"]}


def _write_memory_plan(loaded: Loaded, quant: QuantSpec, target: TargetSpec, build_info: dict[str, Any],
                       out: Path, report: Reporter) -> None:
    """Memory / bandwidth plan for the target's phone (weights, KV at several contexts, activations)."""
    scheme, group_modes = modes_for_scheme(quant.weight_format, quant.weight_dtype, quant.formats)
    try:
        plan = memory_plan(loaded.hf_config, quant=scheme, group_modes=group_modes,
                           compute_dtype=build_info["metadata"]["activation_dtype"],
                           kv_dtype=build_info["metadata"]["kv_cache"].get("dtype"),
                           prefill_chunk=loaded.decoder.prefill_chunk_size, phone=_phone_with_class(target),
                           max_buffer_bytes=(target.capabilities or {}).get("max_buffer_bytes"))
    except ValueError as err:
        report.info(f"[yellow]note:[/] no memory plan ({err})")
        return
    (out / "memory.json").write_text(json.dumps(plan, indent=1, sort_keys=True, default=str))
    (out / "memory.md").write_text(plan_markdown(plan))


# ------------------------------------------------------------------------------------- pipeline
@dataclass
class BuildResult:
    bundle: Path
    seconds: float
    cached: bool
    has_weights: bool


def request_key(model: ModelSpec, quant: QuantSpec, target: TargetSpec) -> str:
    """A cheap key over a build's inputs, checked before anything is loaded or imported.

    Weights enter by path, size, mtime, ctime and inode (any write moves ctime, even one that puts size
    and mtime back, e.g. `cp -p` over a file); configs and code by content. When it matches the bundle's
    manifest and every file is intact, the build is a no-op that takes about a second.
    """
    def stat(path: Path | None):
        if path is None or not path.exists():
            return None
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        return [(f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                for f in files for st in [f.stat()]]

    def text(path: Path | None):
        return path.read_text() if path else None


    return digest({"model": text(model.path), "hf": model.hf_config, "weights": stat(model.weights),
                    "quant": text(quant.path), "target": text(target.path), "runtime": target.runtime,
                    "code": source_hash(), "versions": tvm_versions(), "tuning": database_digest(target.name),
                    "conv_template": template_digest(model.conv_template)})


def _with_calibration(quant: QuantSpec, calibration: str | None) -> QuantSpec:
    """The scheme with its calibration text replaced (--calibration), checked like the YAML entry."""
    if calibration is None:
        return quant
    if calibration in ("none", "off"):
        return dataclasses.replace(quant, calibration=None)
    base = dict(quant.calibration) if isinstance(quant.calibration, dict) else {}
    return dataclasses.replace(quant, calibration={**base, "text": calibration})


def _check_out(out: Path) -> None:
    """--out must be (or become) a writable folder: checked before any work, not when the bundle is renamed in."""
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--out {out}: {probe} is a file, not a folder", path=probe,
                          fix="give --out a folder (it is created if missing)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {probe} is not writable", path=probe, fix="give --out a writable folder")


def run_pipeline(model: str, target: str, quant: str, *, weights: str | None = None, out: str = "dist",
                 report: Reporter | None = None, phone: str | dict | None = None,
                 force_cpu: str | None = None, verify: bool | str | None = None,
                 calibration: str | None = None, kv_cache: str | None = None,
                 runtime: str | None = None) -> BuildResult:
    """`phone`: a configs/phones.yaml name (or a dict) replacing the target's phone for memory planning
    and QUANT=auto. `force_cpu`: comma-separated op classes pinned to the CPU (see force_cpu.py).
    `verify`: run the kernels on PoCL at build time (None: the target's `verify_kernels`, on OpenCL targets
    then the kernels up to a size cap under Oclgrind; "oclgrind": all of them; "no-oclgrind": none).
    `calibration`: none | builtin | a text file, replacing the scheme's calibration text (see calibrate.py).
    `kv_cache`: auto | float16 | float32, replacing the scheme's KV-cache precision.
    `runtime`: the app runtime contract (configs/runtimes/) replacing the target's `runtime`."""
    report = report or Reporter()
    t0 = time.time()
    _check_out(Path(out))
    target_spec = load_target(target)
    if runtime is not None:
        load_runtime(runtime)   # an unknown name fails here, in one line
        target_spec = dataclasses.replace(target_spec, runtime=runtime)
    if phone is not None:
        # the registry name rides along so that a refusal names the phone as the user wrote it
        target_spec = dataclasses.replace(target_spec, phone={"id": phone, **load_phone(phone)}
                                          if isinstance(phone, str) else phone)
        if target_spec.cpu_class and target_spec.phone.get("cpu_class"):   # build for that phone's CPU class
            target_spec = dataclasses.replace(target_spec, cpu_class=load_cpu_class(target_spec.phone["cpu_class"])["name"])
    quant_spec = _with_calibration(load_quant(quant), calibration)
    if kv_cache is not None:   # checked like the YAML entry (QuantSpec.__post_init__)
        quant_spec = dataclasses.replace(quant_spec, kv_cache=kv_cache)
    model_spec = load_model(model, weights)

    forced = reasons(target_spec, force_cpu)   # an unknown op class fails here, before any work
    req = digest([request_key(model_spec, quant_spec, target_spec), target_spec.phone, forced, verify,
                   *([quant_spec.calibration_spec.identity() if quant_spec.calibration_spec else None]
                     if calibration is not None else []), *([kv_cache] if kv_cache is not None else [])])
    final = Path(out) / f"{model_spec.name}-{quant_spec.name}-{target_spec.name}"
    onnx = is_onnx(model_spec)
    if onnx:
        check_quant(quant_spec, model_spec.weights)
    if bundle_current(final, req, field="request_key"):
        report.info(f"{final} is up to date (cache hit: inputs unchanged, all files intact)")
        has_weights = onnx or (final / "tensor-cache.json").exists()
        return BuildResult(final, time.time() - t0, True, has_weights)
    if onnx:   # an ONNX graph: import instead of load/define/quantize, then the same fuse/tune/build/report
        lib_dir, info = build_graph(model_spec, quant_spec, target_spec, report)
        bundle = emit_graph(model_spec, quant_spec, target_spec, lib_dir, info, Path(out), req)
        return BuildResult(bundle, time.time() - t0, report.all_cached, True)
    with report.step(f"load {model_spec.name}"):
        loaded = load(model_spec, report)
    extra_reports: dict[str, str] = {}
    with _calibration(loaded, quant_spec.calibration_spec, report) as calibration:
        if quant_spec.auto_context:
            quant_spec, extra_reports = choose_formats(loaded, quant_spec, target_spec, report, calibration)
        defined = define(loaded, quant_spec, target_spec, report)
        weights_dir = quantize(loaded, defined, quant_spec, report, calibration)
    lib_dir, info = build(loaded, defined, quant_spec, target_spec, report, force_cpu=force_cpu, verify=verify)
    bundle = emit(loaded, quant_spec, target_spec, weights_dir, lib_dir, info, Path(out), report,
                  request_key=req, extra_reports=extra_reports)
    seconds = time.time() - t0
    return BuildResult(bundle, seconds, report.all_cached, weights_dir is not None)
