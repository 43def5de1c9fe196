"""Release artifacts: build a matrix of bundles and package what app teams consume, reproducibly.

A release file (`configs/release/<name>.yaml`) names models x quantizations x targets. Every combination
is built through the ordinary pipeline (`stages.run_pipeline`, so the content-addressed build cache is
shared with `make build` and CI jobs), then packaged per target in MLC-LLM's app layout:

    <out>/<target>/mlc-app-config.json      model_list: model_id, model_lib, model_path, model_url, estimated_vram_bytes
    <out>/<target>/lib/libmodel_android.a   android-*: every model's system-lib objects (libmodel_iphone.a: ios)
    <out>/<target>/lib/<model_id>.so        host-cpu: each model's shared library, copied
    <out>/<target>/<model_id>/              weights folder (mlc-chat-config.json, tensor cache, tokenizer)
    <out>/<target>/reports/<model_id>/      coverage + memory reports of that library
    <out>/<name>-<target>.tar.gz            the <target>/ folder (+ release.json) as one tarball
    <out>/release.json, SHA256SUMS          tool versions, build keys, git commit; a checksum per file

The same inputs give byte-identical output: sorted file order, tar entries with a fixed mtime
(SOURCE_DATE_EPOCH, else 0), uid/gid 0 and empty owner names, normalised modes, gzip without a name or
timestamp, `ar` in deterministic mode, and no timings or absolute paths in any file.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import string
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts.bundle import atomic_dir, file_sha256, tool_versions
from pipeline.cache import copy_file
from pipeline.config import (
    CONFIGS,
    ROOT,
    TargetSpec,
    _read_yaml,
    _registry,
    load_model,
    load_quant,
    load_target,
)
from pipeline.errors import CompileError, ConfigError, PipelineError
from pipeline.progress import Reporter
from pipeline.stages import run_pipeline

RELEASE_DIR = CONFIGS / "release"
FIELDS = ("name", "models", "quantizations", "targets", "verify", "model_url")
EXAMPLES = {"models": "smollm2-135m", "quantizations": "q4f16, q0f16", "targets": "host-cpu, android-cpu"}
LIBRARY_SYMBOL = "{prefix}__tvm_ffi__library_bin"   # the system-lib blob every model library defines
# model_url: where an app downloads a model's weights folder. MLCChat on Android fetches
# <model_url>/resolve/main/<file> (mlc-chat-config.json, tensor-cache.json, its shards, the tokenizer files), the
# layout of a Hugging Face model repo; `mlc_llm package` writes it for every model it does not bundle.
URL_FIELDS = ("model_id", "target")
URL_EXAMPLE = "https://huggingface.co/<your-org>/{model_id}-{target}"
# Static library per OS (from the target's LLVM triple): file name and the `ar` format its linker wants.
STATIC_LIBS = {"android": ("libmodel_android.a", "gnu"), "ios": ("libmodel_iphone.a", "darwin")}
AR_CANDIDATES = ("/usr/lib/llvm-15/bin/llvm-ar", "llvm-ar")
NM_CANDIDATES = ("/usr/lib/llvm-15/bin/llvm-nm", "llvm-nm")


# ------------------------------------------------------------------------------------- release file
@dataclass(frozen=True)
class ReleaseSpec:
    """A release file: the build matrix and how to package it."""

    name: str
    models: tuple[str, ...]
    quantizations: tuple[str, ...]
    targets: tuple[str, ...]
    verify: bool = False              # run android-adreno's kernels on PoCL during the builds (slow)
    model_url: str | None = None      # e.g. https://huggingface.co/org/{model_id}-{target} (see URL_FIELDS)
    path: Path | None = None
    target_specs: dict[str, TargetSpec] = field(default_factory=dict, compare=False, repr=False)

    def entries(self) -> list[tuple[str, str, str]]:
        """(model, quantization, target) in file order."""
        return [(m, q, t) for m in self.models for q in self.quantizations for t in self.targets]

    def verify_for(self, target: str) -> bool | None:
        """The build's verify flag: the release decides only for targets that verify by default."""
        return self.verify if self.target_specs[target].verify_kernels else None


def release_file(name_or_path: str) -> Path:
    """A path to a release YAML, or a name in configs/release/."""
    known = _registry(RELEASE_DIR) if RELEASE_DIR.is_dir() else {}
    if name_or_path in known:
        return known[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise ConfigError(f"no release file {name_or_path!r}",
                      fix=f"give a path to a release .yaml or one of: {', '.join(known) or '(none)'}")


def load_release(name_or_path: str | Path) -> ReleaseSpec:
    """Parse and check a release file; every unknown name is a one-line error naming the file."""
    path = release_file(str(name_or_path))
    data = _read_yaml(path)
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}", path=path, fix=f"use only: {', '.join(FIELDS)}")
    lists = {key: _names(data, key, path) for key in ("models", "quantizations", "targets")}
    for model in lists["models"]:
        _checked(path, load_model, model)
    for quant in lists["quantizations"]:
        _checked(path, load_quant, quant)
    specs = {t: _checked(path, load_target, t) for t in lists["targets"]}
    for spec in specs.values():
        _packaging(spec, path)
    verify = data.get("verify", False)
    if not isinstance(verify, bool):
        raise ConfigError(f"verify must be true or false, not {verify!r}", path=path, fix="write verify: false")
    url = _model_url(data.get("model_url"), specs, path)
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name or any(not (c.isalnum() or c in "-_.") for c in name):
        raise ConfigError(f"name {name!r} is not a plain file name", path=path,
                          fix="use letters, digits, '-', '_' and '.' only")
    return ReleaseSpec(name=name, verify=verify, model_url=url, path=path, target_specs=specs,
                       **{k: tuple(v) for k, v in lists.items()})


def _model_url(url: Any, targets: dict[str, TargetSpec], path: Path) -> str | None:
    """The release's model_url template: needed as soon as an Android app is packaged (MLCChat downloads every
    model from it); {model_id} in it, and {target} when several targets' weights folders would share it."""
    android = [t for t, spec in targets.items() if _packaging(spec, path) == STATIC_LIBS["android"]]
    if url is None:
        if android:
            raise ConfigError(f"no model_url, which MLCChat on Android needs for {', '.join(android)} (it downloads "
                              "each model from <model_url>/resolve/main/)", path=path,
                              fix=f"add model_url: {URL_EXAMPLE} (docs/releases.md)")
        return None
    if not isinstance(url, str) or not url.startswith(("https://", "http://")):
        raise ConfigError(f"model_url {url!r} is not an http(s) address", path=path,
                          fix=f"write e.g. model_url: {URL_EXAMPLE}")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(url) if f is not None]
    except ValueError as err:
        raise ConfigError(f"model_url {url!r} is not a valid template ({err})", path=path,
                          fix=f"write e.g. model_url: {URL_EXAMPLE}") from None
    unknown = sorted({f for f in fields if f not in URL_FIELDS})
    if unknown or "model_id" not in fields:
        named = ", ".join("{" + f + "}" for f in unknown)
        what = f"has unknown field(s) {named}" if unknown else "does not contain {model_id}"
        raise ConfigError(f"model_url {url!r} {what}", path=path,
                          fix=f"use {{model_id}} and {{target}} only, e.g. model_url: {URL_EXAMPLE}")
    if len(targets) > 1 and "target" not in fields:
        raise ConfigError(f"model_url {url!r} has no {{target}}: {', '.join(targets)} would share one address for "
                          "different weights folders", path=path, fix=f"write e.g. model_url: {URL_EXAMPLE}")
    if url.rstrip("/").endswith("/resolve/main"):
        raise ConfigError(f"model_url {url!r} ends in resolve/main, which MLCChat appends itself", path=path,
                          fix="give the repository's address, without /resolve/main")
    return url


def _names(data: dict[str, Any], key: str, path: Path) -> list[str]:
    value = data.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key} must be a non-empty list of names", path=path,
                          fix=f"write e.g. {key}: [{EXAMPLES[key]}]")
    dupes = sorted({v for v in value if value.count(v) > 1})
    if dupes:
        raise ConfigError(f"{key} lists {', '.join(dupes)} more than once", path=path, fix="remove the duplicate")
    return value


def _checked(path: Path, loader, name: str):
    """A config loader whose error names the release file it came from."""
    try:
        return loader(name)
    except ConfigError as err:
        raise ConfigError(str(err), path=path) from None


def _packaging(target: TargetSpec, path: Path | None = None) -> tuple[str, str] | None:
    """(static library, ar format) for a system-lib target; None for a shared-library target."""
    if target.library == "so":
        return None
    tvm_target = target.tvm_target
    triple = str(tvm_target.get("mtriple") or (tvm_target.get("host") or {}).get("mtriple") or "")
    for os_name, lib in STATIC_LIBS.items():
        if os_name in triple:
            return lib
    raise ConfigError(f"target {target.name!r} builds a {target.library} library for {triple or 'an unknown OS'}, "
                      f"which a release cannot package (known: {', '.join(STATIC_LIBS)}, shared libraries)",
                      path=path, fix="remove it from targets")


# ----------------------------------------------------------------------------------------- building
@dataclass
class Built:
    """One bundle of the matrix, as the packager reads it."""

    model: str
    quant: str
    target: str
    bundle: Path

    @property
    def model_id(self) -> str:
        return f"{self.model}-{self.quant}"

    def json(self, name: str) -> dict[str, Any]:
        return json.loads((self.bundle / name).read_text())


def build_matrix(spec: ReleaseSpec, dist: Path, report) -> list[Built]:
    """Every (model, quantization, target) through the pipeline; unchanged ones are cache hits."""
    built = []
    for model, quant, target in spec.entries():
        report.info(f"[bold]release {spec.name}:[/] {model} {quant} {target}")
        result = run_pipeline(model, target, quant, out=str(dist), report=report, verify=spec.verify_for(target))
        extra = json.loads((result.bundle / "manifest.json").read_text())["extra"]   # names, also for paths
        built.append(Built(extra["model"], extra["quantization"], target, result.bundle))
    return built


def make_release(spec: ReleaseSpec, *, out: Path | None = None, dist: Path = Path("dist"), report=None) -> Path:
    """Build the matrix and package it into `out` (default dist/release/<name>), atomically."""
    report = report or Reporter()
    final = Path(out) if out else Path(dist) / "release" / spec.name
    _check_out(final, Path(dist))
    built = build_matrix(spec, Path(dist), report)
    with report.step(f"package release {spec.name}"), atomic_dir(final) as tmp:
        package(spec, built, tmp)
    return final


def _check_out(final: Path, dist: Path) -> None:
    """The release folder is replaced as a whole: never let that be the bundles or some other folder."""
    here, bundles = final.resolve(), dist.resolve()
    if bundles == here or bundles.is_relative_to(here):
        raise ConfigError(f"--out {final} would replace the bundles in {dist}", fix="give a folder of its own")
    if here.is_dir() and any(here.iterdir()) and not (here / "release.json").exists():
        raise ConfigError(f"--out {final} exists and is not a release folder (it would be replaced as a whole)",
                          fix="give a new or empty folder, or delete it first")


# ---------------------------------------------------------------------------------------- packaging
def package(spec: ReleaseSpec, built: list[Built], out: Path) -> None:
    """Lay out every target's libraries, weights, reports and app config; then manifest, tarballs, sums."""
    ar, nm = _tool(AR_CANDIDATES, "LLVM_AR"), _tool(NM_CANDIDATES, "LLVM_NM")
    epoch = source_date_epoch()
    rows: list[dict[str, Any]] = []
    for target in spec.targets:
        items = sorted((b for b in built if b.target == target), key=lambda b: b.model_id)
        rows += _package_target(spec, spec.target_specs[target], items, out / target, ar, nm)
    manifest = release_manifest(spec, rows, epoch, ar)
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (out / "release.json").write_text(text)
    for target in spec.targets:
        write_tarball(out / target, out / f"{spec.name}-{target}.tar.gz", f"{spec.name}-{target}", epoch,
                      extra={"release.json": text.encode()})
    write_sha256sums(out)


def _package_target(spec: ReleaseSpec, target: TargetSpec, items: list[Built], out: Path,
                    ar: str, nm: str) -> list[dict[str, Any]]:
    ids = [b.model_id for b in items]
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"{', '.join(twice)} would be packaged twice for {target.name} (a model or scheme "
                          "named both by name and by path?)", path=spec.path, fix="list each model and scheme once")
    (out / "lib").mkdir(parents=True)
    static = _packaging(target, spec.path)
    libs = (_merge_static(spec, target, items, out / "lib" / static[0], static[1], ar, nm) if static
            else {b.model_id: _copy_shared(b, out / "lib") for b in items})
    rows, app = [], []
    for b in items:
        kernels = b.json("reports/kernels.json")
        if kernels.get("npu_library"):     # a second library for another processor: shipped beside it
            copy_file(b.bundle / "lib" / kernels["npu_library"], out / "lib" / f"{b.model_id}-{kernels['npu_library']}")
        _copy_weights(b, out / b.model_id, libs[b.model_id])
        _copy_reports(b, out / "reports" / b.model_id)
        entry = {"model_id": b.model_id, "model_lib": libs[b.model_id], "model_path": b.model_id,
                 "estimated_vram_bytes": estimated_vram_bytes(b)}
        if spec.model_url:
            entry["model_url"] = spec.model_url.format(model_id=b.model_id, target=target.name)
        app.append(entry)
        rows.append({"model": b.model, "quantization": b.quant, "target": b.target, "model_id": b.model_id,
                     "model_lib": libs[b.model_id], "system_lib_prefix": kernels["system_lib_prefix"],
                     "library_key": kernels["key"], "bundle_build_key": b.json("manifest.json")["build_key"],
                     "has_weights": (b.bundle / "tensor-cache.json").exists()})
    (out / "mlc-app-config.json").write_text(json.dumps({"model_list": app}, indent=2, sort_keys=True) + "\n")
    return rows


def _merge_static(spec: ReleaseSpec, target: TargetSpec, items: list[Built], dest: Path, fmt: str,
                  ar: str, nm: str) -> dict[str, str]:
    """Every model's system-lib objects (from its bundle's .tar) in one deterministic static library.

    Members are renamed `<model_id>-<object>` (each .tar has a `lib0.o`); returns model_id -> model_lib,
    the system-lib prefix without its trailing `_`. MLC's app runtimes load `system://<model_lib>`, i.e. the
    symbol `<model_lib, '-' read as '_'>___tvm_ffi__library_bin`, which is checked in the merged library
    (the rule of `mlc_llm package`'s validate_model_lib)."""
    prefixes: dict[str, str] = {}
    members: list[str] = []
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".objects-") as work:
        for b in items:
            kernels = b.json("reports/kernels.json")
            prefix = kernels["system_lib_prefix"]
            if prefix in prefixes:
                raise PipelineError(f"{prefixes[prefix]} and {b.model_id} share the system-lib prefix {prefix!r} on "
                                    f"{target.name}: one static library cannot hold both", path=spec.path,
                                    fix="put them in separate release files")
            prefixes[prefix] = b.model_id
            members += _extract_objects(b.bundle / "lib" / kernels["library"], Path(work), b.model_id)
        _run([ar, f"--format={fmt}", "rcsD", str(dest.resolve()), *members], cwd=work)
    symbols = {s.removeprefix("_") if fmt == "darwin" else s      # Mach-O prepends `_` to C names
               for s in _run([nm, "--defined-only", "--just-symbol-name", str(dest)]).split()}
    libs = {model_id: model_lib(prefix) for prefix, model_id in prefixes.items()}
    missing = [m for m, lib in libs.items() if LIBRARY_SYMBOL.format(prefix=lib.replace("-", "_") + "_") not in symbols]
    if missing:
        raise CompileError(f"{dest.name} lacks the library symbol of {', '.join(missing)}",
                           fix="rebuild the bundles (make clean, then make release)")
    return libs


def model_lib(prefix: str) -> str:
    """mlc-app-config.json's model_lib for a system library: its symbol prefix without the trailing `_`."""
    if not prefix.endswith("_") or prefix == "_":
        raise CompileError(f"system-lib prefix {prefix!r} does not end in '_'",
                           fix="rebuild the bundles (make clean, then make release)")
    return prefix.removesuffix("_")


def _extract_objects(tar_path: Path, work: Path, model_id: str) -> list[str]:
    names = []
    with tarfile.open(tar_path) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and member.name.endswith(".o"):
                name = f"{model_id}-{Path(member.name).name}"
                (work / name).write_bytes(tar.extractfile(member).read())
                names.append(name)
    if not names:
        raise CompileError(f"{tar_path.name} holds no object files", path=tar_path,
                           fix="rebuild the bundle (make clean, then make release)")
    return names


def _copy_shared(b: Built, lib_dir: Path) -> str:
    """host-cpu: the model's .so, copied as lib/<model_id>.so (shared libraries are not merged)."""
    kernels = b.json("reports/kernels.json")
    copy_file(b.bundle / "lib" / kernels["library"], lib_dir / f"{b.model_id}.so")
    return f"lib/{b.model_id}.so"


def _copy_weights(b: Built, dest: Path, model_lib: str) -> None:
    """The bundle's weights folder as is (no reconversion); mlc-chat-config.json names the release's lib."""
    dest.mkdir(parents=True)
    for entry in b.json("manifest.json")["files"]:
        rel = entry["path"]
        if "/" in rel or rel == "mlc-chat-config.json":   # lib/ and reports/ are packaged separately
            continue
        copy_file(b.bundle / rel, dest / rel)
    config = b.json("mlc-chat-config.json")
    config["model_lib"] = model_lib
    (dest / "mlc-chat-config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_reports(b: Built, dest: Path) -> None:
    dest.mkdir(parents=True)
    for src in sorted((b.bundle / "reports").iterdir()):
        if src.is_file():
            copy_file(src, dest / src.name)


def estimated_vram_bytes(b: Built) -> int:
    """Weights + KV cache at the model's context window + recurrent state + activations (memory plan)."""
    path = b.bundle / "reports" / "memory.json"
    if not path.exists():
        raise PipelineError(f"{b.bundle.name} has no memory plan, so no estimated_vram_bytes", path=path,
                            fix="release only LLM bundles (ONNX graphs have no memory plan)")
    plan = json.loads(path.read_text())
    context = int(b.json("mlc-chat-config.json")["context_window_size"])
    return int(plan["weights_total"]["bytes"] + plan["kv_cache"]["bytes_per_token"] * context
               + plan["recurrent_state"]["bytes"] + plan["activations"]["bytes"])


# ----------------------------------------------------------------------------- manifest, tar, sums
def release_manifest(spec: ReleaseSpec, rows: list[dict[str, Any]], epoch: int, ar: str) -> dict[str, Any]:
    path = spec.path.resolve() if spec.path else None
    shown = path.relative_to(ROOT).as_posix() if path and path.is_relative_to(ROOT) else spec.name
    return {
        "release": spec.name,
        "release_file": {"path": shown, "sha256": file_sha256(path) if path else None},
        "git": git_state(),
        "source_date_epoch": epoch,
        "tool_versions": {**tool_versions(), "llvm-ar": _run([ar, "--version"]).strip().splitlines()[0]},
        "matrix": {"models": list(spec.models), "quantizations": list(spec.quantizations),
                   "targets": list(spec.targets), "verify": spec.verify},
        "builds": rows,
    }


def git_state() -> dict[str, Any]:
    """The commit the release was built from, and whether the work tree differed from it."""
    try:
        commit = _run(["git", "rev-parse", "HEAD"], cwd=ROOT).strip()
        dirty = bool(_run(["git", "status", "--porcelain"], cwd=ROOT).strip())
    except (PipelineError, OSError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def source_date_epoch() -> int:
    """The timestamp every archive entry gets: $SOURCE_DATE_EPOCH (reproducible-builds.org), else 0."""
    value = os.environ.get("SOURCE_DATE_EPOCH", "0")
    if not value.isdigit():
        raise ConfigError(f"SOURCE_DATE_EPOCH={value!r} is not a whole number of seconds",
                          fix="unset it or set it to e.g. $(git log -1 --format=%ct)")
    return int(value)


def _walk(root: Path) -> list[Path]:
    """Every directory and file under root (root excluded), in a fixed order."""
    found = []
    for here, dirs, files in os.walk(root):
        dirs.sort()
        found += [Path(here) / d for d in dirs] + [Path(here) / f for f in sorted(files)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def write_tarball(src: Path, dest: Path, arcroot: str, epoch: int, extra: dict[str, bytes] | None = None) -> None:
    """src/ as <arcroot>/... in a byte-reproducible .tar.gz (fixed mtimes, owners, modes, order, gzip header)."""
    def info(name: str, *, size: int = 0, directory: bool = False, executable: bool = False) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
        ti.size, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = size, epoch, 0, 0, "", ""
        ti.mode = 0o755 if directory or executable else 0o644
        return ti

    with open(dest, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                  compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(info(arcroot, directory=True))
        entries = {p.relative_to(src).as_posix(): p for p in _walk(src)}
        entries.update(dict.fromkeys(extra or {}))
        for rel in sorted(entries):
            path, name = entries[rel], f"{arcroot}/{rel}"
            if path is None:
                data = (extra or {})[rel]
                tar.addfile(info(name, size=len(data)), io.BytesIO(data))
            elif path.is_dir():
                tar.addfile(info(name, directory=True))
            else:
                with open(path, "rb") as f:
                    tar.addfile(info(name, size=path.stat().st_size, executable=os.access(path, os.X_OK)), f)


def write_sha256sums(root: Path) -> None:
    """SHA256SUMS (the `sha256sum -c` format) over every file in the release, in path order."""
    lines = [f"{file_sha256(p)}  {p.relative_to(root).as_posix()}\n"
             for p in _walk(root) if p.is_file() and p.name != "SHA256SUMS"]
    (root / "SHA256SUMS").write_text("".join(lines))


# -------------------------------------------------------------------------------------------- helpers
def _tool(candidates: tuple[str, ...], env: str) -> str:
    for candidate in ((os.environ[env],) if os.environ.get(env) else candidates):
        found = shutil.which(candidate)
        if found:
            return found
    raise PipelineError(f"{candidates[-1]} not found (needed to merge the static libraries)",
                        fix=f"apt-get install llvm, or set {env}=/path/to/{candidates[-1]}")


def _run(cmd: list[str], cwd: str | Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise PipelineError(f"{Path(cmd[0]).name} failed: {last}")
    return proc.stdout


def summary(spec: ReleaseSpec, final: Path, seconds: float | None = None) -> str:
    """A few lines for the terminal: the tarballs and their sizes."""
    lines = [f"release {spec.name}: {final}"]
    for target in spec.targets:
        tarball = final / f"{spec.name}-{target}.tar.gz"
        lines.append(f"  {tarball.name}  {tarball.stat().st_size / 2**20:.1f} MiB")
    if seconds is not None:
        lines.append(f"  {len(spec.entries())} builds + packaging in {seconds:.1f} s")
    return "\n".join(lines)


def matrix_json(spec: ReleaseSpec) -> dict[str, Any]:
    """CI's job matrix: one job per (model, target) building every quantization with the release's flags."""
    include = []
    for model in spec.models:
        for target in spec.targets:
            flag = spec.verify_for(target)
            include.append({"model": model, "target": target, "quants": " ".join(spec.quantizations),
                            "verify": "" if flag is None else str(int(flag))})
    return {"include": include}
