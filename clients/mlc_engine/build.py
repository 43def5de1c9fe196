"""Build MLC-LLM's C++ serving engine as a client of our bundles: one shared library, libmlc_llm_client.so.

    .venv/bin/python clients/mlc_engine/build.py              # build (or reuse) and say where it is
    .venv/bin/python clients/mlc_engine/build.py --print-path  # the same; stdout is the library path only
    .venv/bin/python clients/mlc_engine/build.py --print-path --no-build   # exit 1 unless already built

What is compiled (docs/mlc-engine.md has the why of each choice): the unmodified `git archive`s in the vendor
folder (MLC_VENDOR_DIR, else <repo>/../shared/vendor, else /work/shared/vendor) are unpacked into a temporary
folder in MLC-LLM's own layout (3rdparty/{tvm,xgrammar,tokenizers-cpp,stb}) and compiled from there, never
copied into the repository: all of mlc-llm's cpp/*.cc, xgrammar's cpp/*.cc but its Python bindings,
tokenizers-cpp's src/huggingface_tokenizer.cc, plus this folder's glue (*.cc here). Everything is linked against
the apache-tvm wheel's libtvm_runtime / libtvm_runtime_extra / libtvm_ffi and the venv's libpython (the
tokenizer backend), with rpaths to them.

The result lives in <repo>/.cache/mlc-engine/<key>/ (MLC_ENGINE_CACHE_DIR overrides the folder), key = sha256
over the archives, the glue sources, the compiler, the tvm / tvm-ffi versions and library hashes, Python and the
flags. A folder is built beside its final place and renamed in complete, manifest.json written last; objects are
cached per source under objects/ so that a glue edit recompiles one file.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if str(Path(__file__).resolve().parents[2]) not in sys.path:   # run as a script: the checkout's clients/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from clients.native_build import Missing
from clients.native_build import compile_all as _compile_all
from clients.native_build import key as _key
from clients.native_build import log as _log
from clients.native_build import package_dir as _package_dir
from pipeline.artifacts.bundle import file_sha256 as _sha256

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LIB_NAME = "libmlc_llm_client.so"
RECIPE = 2  # bump when the recipe changes in a way that the flags and source lists below do not show

# archive -> where its top folder goes, relative to the staged mlc-llm root ("" = the root itself); the layout
# is MLC-LLM's own (its CMakeLists.txt and cpp/support/utils.h's "../../3rdparty/tvm/src/support/base64.h")
ARCHIVES = {
    "mlc-llm-79d603f.tar.gz": "",
    "xgrammar-d4f57c4.tar.gz": "3rdparty/xgrammar",
    "tokenizers-cpp-34885cf.tar.gz": "3rdparty/tokenizers-cpp",
    "stb-ae721c5.tar.gz": "3rdparty/stb",
    "tvm-support-5d4dc87.tar.gz": "3rdparty/tvm",
}
GLUE = ("tokenizers_c_python.cc", "tokenizers_unsupported.cc", "engine_log.cc")

# Left out, and why (printed into the manifest and docs/mlc-engine.md)
EXCLUDED = {
    "3rdparty/xgrammar/cpp/pybind/*.cc": "xgrammar's Python bindings (pybind11/nanobind); MLC's CMake drops them too",
    "3rdparty/tokenizers-cpp/src/sentencepiece_tokenizer.cc":
        "needs tokenizers-cpp's `sentencepiece` git submodule, which a git archive does not hold; "
        "tokenizers_unsupported.cc raises a clear error instead",
    "3rdparty/tokenizers-cpp/src/rwkv_world_tokenizer.cc":
        "needs tokenizers-cpp's `msgpack` git submodule (absent from the archive); stubbed likewise",
    "3rdparty/tokenizers-cpp/rust/": "the Rust C API behind tokenizer.json; replaced by tokenizers_c_python.cc",
}

# MLC's CMakeLists.txt: -ffast-math for its objects (xgrammar's own CMake even uses -Ofast), C++17, PIC, these
# definitions. -ffast-math is a compile flag only: passed when linking a shared library, gcc may add
# crtfastmath.o, which flips the whole process (the Python that loads us) to flush-to-zero.
CXXFLAGS = ["-std=c++17", "-O2", "-fPIC", "-DNDEBUG", "-ffast-math", "-pthread",
            "-D__STDC_FORMAT_MACROS=1", "-DXGRAMMAR_ENABLE_LOG_DEBUG=0", "-DMLC_LLM_EXPORTS"]
# relative to the staged mlc-llm root (the compiler runs there, so no temporary path reaches a flag or the key)
LOCAL_INCLUDES = ["3rdparty/tvm/include", "3rdparty/stb", "3rdparty/tokenizers-cpp/include",
                  "3rdparty/xgrammar/include", "3rdparty/xgrammar/3rdparty/picojson"]


@dataclass
class Toolchain:
    cxx: str
    cxx_version: str
    includes: list[str]          # absolute: the wheel's headers
    libdirs: list[str]
    libs: list[str]
    wheel: dict                  # versions and library hashes
    py_include: str
    py_site: str
    py_ldflags: list[str]
    py_shared: bool
    py_version: str
    link_extra: list[str] = field(default_factory=list)


def vendor_dir() -> Path:
    env = os.environ.get("MLC_VENDOR_DIR")
    candidates = [Path(env)] if env else [REPO.parent / "shared" / "vendor", Path("/work/shared/vendor")]
    for d in candidates:
        if d.is_dir():
            missing = [a for a in ARCHIVES if not (d / a).is_file()]
            if missing:
                raise Missing(f"vendor archive(s) {', '.join(missing)} missing from {d}; put the unmodified "
                              f"git archives there or point MLC_VENDOR_DIR at the folder that holds them")
            return d
    where = "MLC_VENDOR_DIR=" + env if env else " or ".join(str(c) for c in candidates)
    raise Missing(f"no vendor folder ({where}); set MLC_VENDOR_DIR to the folder with {', '.join(ARCHIVES)}")


def toolchain() -> Toolchain:
    cxx = os.environ.get("CXX", "g++")
    cxx_path = shutil.which(cxx)
    if cxx_path is None:
        raise Missing(f"C++ compiler `{cxx}` not found; install g++ (apt-get install g++) or set CXX")
    version = subprocess.run([cxx_path, "--version"], capture_output=True, text=True).stdout.splitlines()
    machine = subprocess.run([cxx_path, "-dumpmachine"], capture_output=True, text=True).stdout.strip()
    tvm_dir, ffi_dir = _package_dir("tvm"), _package_dir("tvm_ffi")
    wanted = {
        "tvm include": tvm_dir / "include" / "tvm" / "runtime" / "logging.h",
        "tvm_ffi include": ffi_dir / "include" / "tvm" / "ffi" / "function.h",
        "dlpack header": ffi_dir / "3rdparty" / "dlpack" / "include" / "dlpack" / "dlpack.h",
        "libtvm_runtime.so": tvm_dir / "lib" / "libtvm_runtime.so",
        "libtvm_runtime_extra.so": tvm_dir / "lib" / "libtvm_runtime_extra.so",
        "libtvm_ffi.so": ffi_dir / "lib" / "libtvm_ffi.so",
    }
    for what, path in wanted.items():
        if not path.exists():
            raise Missing(f"{what} missing ({path}); reinstall the apache-tvm / apache-tvm-ffi wheels (make setup)")
    py_include = sysconfig.get_paths()["include"]
    if not (Path(py_include) / "Python.h").is_file():
        raise Missing(f"Python.h missing from {py_include}; install the Python development headers "
                      f"(e.g. apt-get install python3-dev, or a Python built with its headers)")
    cfg = sysconfig.get_config_vars()
    py_shared = bool(cfg.get("Py_ENABLE_SHARED"))
    py_ldflags: list[str] = []
    if py_shared:  # what `python3-config --embed --ldflags` prints
        libdir = cfg["LIBDIR"]
        py_ldflags = [f"-L{libdir}", f"-lpython{cfg['LDVERSION']}", *cfg.get("LIBS", "").split(),
                      *cfg.get("SYSLIBS", "").split(), f"-Wl,-rpath,{libdir}"]
    wheel = {
        "apache-tvm": importlib.metadata.version("apache-tvm"),
        "apache-tvm-ffi": importlib.metadata.version("apache-tvm-ffi"),
        **{p.name: _sha256(p) for k, p in wanted.items() if k.endswith(".so")},
    }
    libdirs = [str(tvm_dir / "lib"), str(ffi_dir / "lib")]
    return Toolchain(
        cxx=cxx_path, cxx_version=f"{version[0] if version else '?'} ({machine})",
        includes=[str(tvm_dir / "include"), str(ffi_dir / "include"),
                  str(ffi_dir / "3rdparty" / "dlpack" / "include")],
        libdirs=libdirs, libs=["-ltvm_runtime_extra", "-ltvm_runtime", "-ltvm_ffi"],
        wheel=wheel, py_include=py_include, py_site=sysconfig.get_paths()["purelib"],
        py_ldflags=py_ldflags, py_shared=py_shared, py_version=sys.version.split()[0],
    )


def glue_flags(tc: Toolchain) -> list[str]:
    return [f"-I{tc.py_include}", f'-DMLC_CLIENT_PYTHON_SITE="{tc.py_site}"']


def compile_flags(tc: Toolchain) -> list[str]:
    return [*CXXFLAGS, *(f"-I{p}" for p in tc.includes), *(f"-I{p}" for p in LOCAL_INCLUDES)]


def link_flags(tc: Toolchain) -> list[str]:
    rpath = ":".join(tc.libdirs)
    flags = ["-shared", "-pthread", f"-Wl,-soname,{LIB_NAME}", *(f"-L{d}" for d in tc.libdirs), *tc.libs,
             f"-Wl,-rpath,{rpath}", *tc.py_ldflags, "-ldl"]
    if tc.py_shared:  # without libpython the Python symbols come from the process that loads us
        flags.append("-Wl,--no-undefined")
    return flags


def cache_root() -> Path:
    return Path(os.environ.get("MLC_ENGINE_CACHE_DIR", REPO / ".cache" / "mlc-engine"))


def key_inputs(vendor: Path, tc: Toolchain) -> dict:
    return {
        "recipe": RECIPE,
        "archives": {a: _sha256(vendor / a) for a in ARCHIVES},
        "glue": {g: _sha256(HERE / g) for g in GLUE},
        "compiler": tc.cxx_version,
        "wheel": tc.wheel,
        "python": {"version": tc.py_version, "include": tc.py_include, "site": tc.py_site,
                   "ldflags": tc.py_ldflags},
        "cxxflags": compile_flags(tc),
        "glueflags": glue_flags(tc),
        "ldflags": link_flags(tc),
    }


def complete(folder: Path) -> Path | None:
    """The library in a finished cache folder (manifest present, library hash as recorded), else None."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        lib = folder / manifest["library"]
        if lib.is_file() and _sha256(lib) == manifest["sha256"]:
            return lib
    except (OSError, ValueError, KeyError):
        pass
    return None


def _extract(vendor: Path, root: Path) -> None:
    """Unpack each archive's single top folder into its place under root (the staged mlc-llm tree)."""
    scratch = root.parent / "unpack"
    for archive, dest in ARCHIVES.items():
        out = scratch / archive
        with tarfile.open(vendor / archive) as tar:
            tar.extractall(out, filter="data")
        tops = [p for p in out.iterdir()]
        if len(tops) != 1 or not tops[0].is_dir():
            raise Missing(f"{archive}: expected one top folder, found {[p.name for p in tops]}; "
                          f"the vendor archives must be unmodified `git archive --prefix=<name>/` files")
        target = root / dest if dest else root
        target.parent.mkdir(parents=True, exist_ok=True)
        if dest:
            tops[0].rename(target)
        else:
            tops[0].rename(root)
    shutil.rmtree(scratch)


def sources(root: Path) -> list[str]:
    """The vendor sources compiled, relative to the staged root (sorted; see EXCLUDED for what is left out)."""
    mlc = sorted(p.relative_to(root).as_posix() for p in (root / "cpp").rglob("*.cc"))
    xg_root = root / "3rdparty" / "xgrammar" / "cpp"
    xgrammar = sorted(p.relative_to(root).as_posix() for p in xg_root.rglob("*.cc")
                      if "pybind" not in p.relative_to(xg_root).parts)
    return [*mlc, *xgrammar, "3rdparty/tokenizers-cpp/src/huggingface_tokenizer.cc"]


def build(jobs: int | None = None, quiet_if_cached: bool = False) -> Path:
    vendor = vendor_dir()
    tc = toolchain()
    inputs = key_inputs(vendor, tc)
    key = _key(inputs)
    root_cache = cache_root()
    final = root_cache / key
    lib = complete(final)
    if lib is not None:
        if not quiet_if_cached:
            _log(f"mlc-engine: cached {lib}")
        return lib
    workers = jobs or int(os.environ.get("MLC_ENGINE_JOBS", "0")) or os.cpu_count() or 2
    t_start = time.perf_counter()
    root_cache.mkdir(parents=True, exist_ok=True)
    objects = root_cache / "objects"
    objects.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=root_cache))
    try:
        staged = work / "src" / "mlc-llm"
        _extract(vendor, staged)
        vendor_srcs = sources(staged)
        base = [tc.cxx, *compile_flags(tc)]
        obj_key_base = {k: inputs[k] for k in ("recipe", "archives", "compiler", "wheel", "cxxflags")}
        jobs_list = []
        for rel in vendor_srcs:
            h = _key({**obj_key_base, "source": rel})
            # relative to the staged root, as MLC's own build names them: __FILE__ in its log lines is "cpp/..."
            jobs_list.append((rel, Path(rel), base, objects / f"{h}.o"))
        for g in GLUE:
            h = _key({**obj_key_base, "glue": g, "sha256": inputs["glue"][g], "flags": glue_flags(tc)})
            jobs_list.append((f"clients/mlc_engine/{g}", HERE / g, [*base, *glue_flags(tc)], objects / f"{h}.o"))
        _log(f"mlc-engine: {len(vendor_srcs)} vendor sources + {len(GLUE)} glue sources, {workers} at a time "
             f"({tc.cxx_version})")
        failures = _compile_all(staged, jobs_list, workers, "mlc-engine")
        if failures:
            raise SystemExit(f"mlc-engine: {len(failures)} file(s) failed to compile: {', '.join(failures)}")
        out = work / "out"
        out.mkdir()
        t_link = time.perf_counter()
        r = subprocess.run([tc.cxx, "-o", str(out / LIB_NAME), *(str(j[3]) for j in jobs_list), *link_flags(tc)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            _log("\n".join(r.stderr.strip().splitlines()[-40:]))
            raise SystemExit(f"mlc-engine: linking {LIB_NAME} failed (above)")
        _log(f"mlc-engine: linked {LIB_NAME} ({(out / LIB_NAME).stat().st_size / 1e6:.1f} MB, "
             f"{time.perf_counter() - t_link:.1f} s)")
        _smoke_test(out / LIB_NAME)
        manifest = {
            "library": LIB_NAME,
            "sha256": _sha256(out / LIB_NAME),
            "key": key,
            "inputs": inputs,
            "sources": [*vendor_srcs, *(f"clients/mlc_engine/{g}" for g in GLUE)],
            "excluded": EXCLUDED,
            "build_seconds": round(time.perf_counter() - t_start, 1),
            "jobs": workers,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            out.rename(final)
        except OSError:
            if complete(final) is None:  # not a concurrent build that finished first
                raise
        lib = complete(final)
        assert lib is not None
        _log(f"mlc-engine: built in {time.perf_counter() - t_start:.0f} s: {lib}")
        return lib
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _smoke_test(lib: Path) -> None:
    """Load the library into a fresh Python beside the wheel's runtime and look up the engine's entry point."""
    code = ("import ctypes, sys, tvm, tvm_ffi\n"
            "ctypes.CDLL(sys.argv[1], ctypes.RTLD_GLOBAL)\n"
            "tvm_ffi.get_global_func('mlc.json_ffi.CreateJSONFFIEngine')\n")
    r = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True)
    if r.returncode != 0:
        _log(r.stderr.strip())
        raise SystemExit(f"mlc-engine: {LIB_NAME} does not load or lacks mlc.json_ffi.CreateJSONFFIEngine (above)")


def cached_library() -> Path | None:
    """The library if this machine's inputs already have a complete build, else None (never builds)."""
    try:
        vendor = vendor_dir()
        tc = toolchain()
    except Missing:
        return None
    return complete(cache_root() / _key(key_inputs(vendor, tc)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--print-path", action="store_true", help="print the library path on stdout (only that)")
    ap.add_argument("--no-build", action="store_true", help="never build; exit 1 when not built yet")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    args = ap.parse_args(argv)
    try:
        if args.no_build:
            vendor_dir()
            toolchain()
            lib = cached_library()
            if lib is None:
                print("mlc-engine: not built yet for these inputs; run `make mlc-engine`", file=sys.stderr)
                return 1
        else:
            lib = build(jobs=args.jobs, quiet_if_cached=args.print_path)
    except Missing as e:
        print(f"mlc-engine: {e}", file=sys.stderr)
        return 1
    if args.print_path:
        print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
