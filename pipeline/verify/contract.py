"""Does a bundle satisfy an app runtime's contract (configs/runtimes/<name>.yaml)? Read, never run.

Works for a bundle of any target: the function signatures come from reports/kernels.json (recorded from the Relax
module that was compiled, compiler/signatures.py) and are cross-checked against the library file itself — the
names must be in its executable, a phone library's system-lib symbol must carry its prefix, and a library this
computer can load must report the same `_metadata`. One line per violation.
"""

from __future__ import annotations

import json
import math
import platform
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import GPU_SAMPLER_KINDS, RuntimeSpec, load_runtime

LIBRARY_SYMBOL = "{prefix}__tvm_ffi__library_bin"   # the system-lib blob every model library defines
_TYPE = re.compile(r"^(?P<dtype>\w+)\[(?P<dims>[^\]]*)\]$")
_OBJECTS = {"kv_cache": "paged_kv_cache", "rnn_state": "rnn_state"}


@dataclass
class CheckResult:
    bundle: Path
    runtime: str
    violations: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


def _read_json(path: Path, what: str, result: CheckResult) -> dict[str, Any] | None:
    if not path.is_file():
        result.violations.append(f"{path.name}: missing ({what})")
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        result.violations.append(f"{path.name}: not valid JSON ({err})")
        return None


def check_bundle(bundle: Path, runtime: str | None = None) -> CheckResult:
    """Every way `bundle` differs from the runtime contract `runtime` (default: the one it was built for)."""
    manifest = json.loads((bundle / "manifest.json").read_text()) if (bundle / "manifest.json").is_file() else {}
    extra = manifest.get("extra", {})
    built_for = extra.get("runtime")
    spec = load_runtime(runtime or built_for or "mlc-llm-79d603f")
    result = CheckResult(bundle, spec.name)
    if not manifest:
        result.violations.append("manifest.json: missing (not a pipeline bundle)")
    elif built_for is None:
        result.violations.append("manifest.json: names no runtime contract (built before contracts existed): rebuild")
    elif built_for != spec.name:
        result.violations.append(f"manifest.json: built for runtime {built_for}, checked against {spec.name}")
    build = _read_json(bundle / "reports" / "kernels.json", "the build record", result)
    chat = _read_json(bundle / "mlc-chat-config.json", "the runtime config", result)
    if build is None:
        return result
    meta = build.get("metadata") or {}
    abi = build.get("engine_abi")
    if abi is None:
        result.violations.append("reports/kernels.json: no engine_abi (functions unrecorded): rebuild the bundle")
        return result
    _check_kv_fields(abi, spec, result)
    _check_functions(abi.get("functions", {}), meta, spec, build, result)
    _check_metadata(meta, spec, result)
    library = bundle / extra.get("library", f"lib/{build.get('library', '')}")
    _check_library(library, build, meta, spec, result)
    if chat is not None:
        _check_chat_config(bundle, chat, build, spec, result)
    _check_tensor_cache(bundle, meta, result)
    return result


def _check_kv_fields(abi: dict[str, Any], spec: RuntimeSpec, result: CheckResult) -> None:
    have = abi.get("kv_cache_config_fields")
    if have is not None and have != spec.kv_cache_config_fields:
        result.violations.append(
            f"KV cache: the library passes {have} config fields to vm.builtin.paged_attention_kv_cache_create, "
            f"runtime {spec.name} takes {spec.kv_cache_config_fields} (rebuild with --runtime {spec.name})")


def _applies(entry: dict[str, Any], meta: dict[str, Any], kind: str) -> bool:
    when = entry.get("when", "all")
    hybrid = meta.get("kv_state_kind") == "hybrid"
    return {"all": True, "hybrid": hybrid, "dense": not hybrid,
            "gpu_sampler": kind in GPU_SAMPLER_KINDS}.get(when, False)


def _check_functions(functions: dict[str, Any], meta: dict[str, Any], spec: RuntimeSpec, build: dict[str, Any],
                     result: CheckResult) -> None:
    model = meta.get("model_config") or {}
    vocab = model.get("vocab_size")
    sizes = {"h": model.get("hidden_size"), "V": vocab, "C": meta.get("prefill_chunk_size"),
             "W": math.ceil(vocab / 32) if vocab else None}
    kind = (build.get("engine_abi") or {}).get("target_kind", "llvm")
    n = 0
    for key, entry in spec.functions.items():
        if not _applies(entry, meta, kind):
            continue
        name = entry.get("name", key)
        got = functions.get(name)
        if got is None:
            if entry.get("required", True):
                result.violations.append(f"function {name}: missing (runtime {spec.name} calls it)")
            continue
        n += 1
        for what in ("args", "returns"):
            if what not in entry:
                continue
            want, have = entry[what], got.get(what, [])
            if len(want) != len(have):
                result.violations.append(f"function {name}: {len(have)} {what}, runtime {spec.name} expects "
                                         f"{len(want)} ({', '.join(want)})")
                continue
            binding: dict[str, str] = {}
            for i, (w, h) in enumerate(zip(want, have, strict=True)):
                problem = _mismatch(w, h, sizes, meta.get("activation_dtype"), binding, what == "args")
                if problem:
                    result.violations.append(f"function {name}: {what[:-1]} {i} is {_show(h)}, expected {w} "
                                             f"({problem})")
    result.checked["functions"] = n


def _show(desc: dict[str, Any]) -> str:
    if desc.get("kind") == "tensor":
        return f"{desc['dtype']}[{', '.join(str(d) for d in desc.get('dims') or ['?'])}]"
    return desc.get("name") or desc.get("kind", "?")


def _mismatch(want: str, have: dict[str, Any], sizes: dict[str, Any], act: str | None, binding: dict[str, str],
              is_arg: bool) -> str | None:
    kind = have.get("kind")
    if want in _OBJECTS:
        if kind != "object":
            return "not a runtime object"
        if is_arg and have.get("name") not in (None, _OBJECTS[want]):
            return f"the {have.get('name')} object in the {want} slot"
        return None
    if want == "params":
        return None if kind == "params" else "the packed weights belong here"
    if want == "int":
        return None if kind == "int" else "a runtime size belongs here"
    m = _TYPE.match(want)
    if m is None:
        return f"unknown contract type {want!r}"
    if kind != "tensor":
        return "not a tensor"
    dtype = act if m["dtype"] == "act" else m["dtype"]
    if have.get("dtype") != dtype:
        return f"dtype {have.get('dtype')}, not {dtype}"
    dims = [d.strip() for d in m["dims"].split(",")] if m["dims"].strip() else []
    got = have.get("dims")
    if got is None or len(got) != len(dims):
        return f"rank {len(got) if got is not None else '?'}, not {len(dims)}"
    for w, g in zip(dims, got, strict=True):
        if w.isdigit() or w in sizes:
            value = int(w) if w.isdigit() else sizes[w]
            if g != value:
                return f"size {g} where {w} = {value}"
        elif not isinstance(g, str):
            return f"fixed size {g} where the runtime passes any {w}"
        elif binding.setdefault(w, g) != g:
            return f"{g} and {binding[w]} must be the same size {w}"
    return None


def _check_metadata(meta: dict[str, Any], spec: RuntimeSpec, result: CheckResult) -> None:
    for name in spec.metadata_fields:
        if name not in meta:
            result.violations.append(f"_metadata: no {name!r} (runtime {spec.name} reads it)")
    params = meta.get("params") or []
    for p in params:
        missing = [f for f in spec.param_fields if f not in p]
        if missing:
            result.violations.append(f"_metadata: param {p.get('name', '?')} has no {', '.join(missing)}")
            break
    if meta.get("kv_state_kind", "kv_cache") in ("kv_cache", "hybrid"):
        kv = meta.get("kv_cache") or {}
        for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if name not in kv:
                result.violations.append(f"_metadata: kv_cache has no {name!r}")
    result.checked["params"] = len(params)


def _library_bytes(library: Path) -> list[bytes]:
    if library.suffix == ".tar":
        with tarfile.open(library) as tar:
            return [tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()]
    return [library.read_bytes()]


def _check_library(library: Path, build: dict[str, Any], meta: dict[str, Any], spec: RuntimeSpec,
                   result: CheckResult) -> None:
    if not library.is_file():
        result.violations.append(f"{library.name}: the model library is missing")
        return
    blobs = _library_bytes(library)
    names = [n for n in (build.get("engine_abi") or {}).get("functions", {})]
    absent = [n for n in names if not any(n.encode() in b for b in blobs)]
    if absent:
        result.violations.append(f"{library.name}: functions recorded but not in the library: {', '.join(absent)}")
    prefix = build.get("system_lib_prefix", "")
    if library.suffix == ".tar" and not any(LIBRARY_SYMBOL.format(prefix=prefix).encode() in b for b in blobs):
        result.violations.append(f"{library.name}: no symbol {LIBRARY_SYMBOL.format(prefix=prefix)} "
                                 "(MLC's system://<model_lib> lookup would not find it)")
    live = _loaded_metadata(library)
    if live is not None and live != meta:
        differ = sorted(k for k in set(live) | set(meta) if live.get(k) != meta.get(k))
        result.violations.append(f"{library.name}: its _metadata() differs from reports/kernels.json in "
                                 f"{', '.join(differ)}")


def _loaded_metadata(library: Path) -> dict[str, Any] | None:
    """`_metadata()` of a shared library this computer can load (host-cpu); None for any other."""
    if library.suffix != ".so":
        return None


    machine = {b"\x3e\x00": "x86_64", b"\xb7\x00": "aarch64"}.get(library.read_bytes()[18:20])
    if machine != platform.machine():
        return None
    import tvm  # local: only this check loads TVM's runtime
    from tvm.runtime.vm import VirtualMachine

    vm = VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    return json.loads(vm["_metadata"]())


def _check_chat_config(bundle: Path, chat: dict[str, Any], build: dict[str, Any], spec: RuntimeSpec,
                       result: CheckResult) -> None:
    for name in spec.chat_config_fields:
        if name not in chat:
            result.violations.append(f"mlc-chat-config.json: no {name!r}")
    conv = chat.get("conv_template")
    if "conv_template" in chat and not isinstance(conv, dict):
        result.violations.append(f"mlc-chat-config.json: conv_template is {conv!r}, runtime {spec.name} needs the "
                                 "whole Conversation object")
    elif isinstance(conv, dict):
        missing = [f for f in spec.conv_template_fields if f not in conv]
        if missing:
            result.violations.append(f"mlc-chat-config.json: conv_template has no {', '.join(missing)}")
    for name in chat.get("tokenizer_files") or []:
        if not (bundle / name).is_file():
            result.violations.append(f"mlc-chat-config.json: tokenizer file {name} is not in the bundle")
    lib = chat.get("model_lib")
    if lib is not None and Path(lib).name != build.get("library"):
        result.violations.append(f"mlc-chat-config.json: model_lib {lib} is not the bundle's library "
                                 f"{build.get('library')}")


def _check_tensor_cache(bundle: Path, meta: dict[str, Any], result: CheckResult) -> None:
    path = bundle / "tensor-cache.json"
    if not path.is_file():
        return   # a config-only bundle (NO_WEIGHTS.txt): the library alone is checked
    records = {r["name"]: r for shard in json.loads(path.read_text()).get("records", [])
               for r in shard.get("records", [])}
    for p in meta.get("params") or []:
        r = records.get(p["name"])
        if r is None:
            result.violations.append(f"tensor-cache.json: no record for parameter {p['name']}")
        elif list(r.get("shape", [])) != list(p["shape"]) or r.get("dtype") != p["dtype"]:
            result.violations.append(f"tensor-cache.json: {p['name']} is {r.get('dtype')}{r.get('shape')}, the "
                                     f"library takes {p['dtype']}{p['shape']}")
    result.checked["records"] = len(records)
