"""The TVM runtime cross-built for phone CPUs (aarch64), and an android-cpu bundle linked into one executable.

    .venv/bin/python -m clients.aarch64_vm.build                       # build (or reuse) the runtime archive
    .venv/bin/python -m clients.aarch64_vm.build --bundle dist/<name>  # ... and link that bundle's driver

An Android app links an android-cpu bundle's `.tar` objects (the kernels, lib0.o, and the VM bytecode object)
into its own binary beside the TVM runtime and loads them as a system library. This does the same for
aarch64 Linux, so that qemu-aarch64 runs the whole decode step — VM, KV cache, every kernel — here:

- runtime: the apache-tvm wheel's own runtime sources (tvm/src/runtime: tensors, modules, thread pool, memory
  manager, the Relax VM, paged KV cache, RNN state, tensor cache) and tvm-ffi's (tvm_ffi/src/ffi), compiled
  with the Debian cross compiler. The wheel ships these sources but not the tvm/support headers they
  include; those come from the tvm-support vendor archive (the one the MLC engine build uses). Nothing is
  copied into the repository.
- driver: decode_driver.cc (here) + the bundle's objects + the runtime, linked statically (no aarch64 sysroot
  is needed at run time), the runtime archive whole so that its registration blocks are kept.

Cached in <repo>/.cache/aarch64-vm/<key>/ (runtime: libtvm_runtime.a, manifest.json written last) keyed by the
wheel versions, the vendor archive, the compiler and the flags; drivers under drivers/<bundle library hash>/.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

if str(Path(__file__).resolve().parents[2]) not in sys.path:   # run as a script: the checkout's clients/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from clients.mlc_engine.build import vendor_dir  # noqa: E402
from clients.native_build import Missing, compile_all, key, log, package_dir  # noqa: E402
from pipeline.artifacts.bundle import file_sha256  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CXX = "aarch64-linux-gnu-g++"
SUPPORT_ARCHIVE = "tvm-support-5d4dc87.tar.gz"
RECIPE = 1  # bump when the recipe changes in a way the flags and source lists do not show
ARCHIVE = "libtvm_runtime.a"
DRIVER_SOURCE = HERE / "decode_driver.cc"

# -O2 as a release app build; no libbacktrace (not shipped in the wheel); the runtime's fp16 fallbacks
# (builtin_fp16.cc) are left out: aarch64's libgcc has the conversions and +fullfp16 kernels use instructions.
CXXFLAGS = ["-std=c++17", "-O2", "-DNDEBUG", "-pthread", "-DTVM_FFI_USE_LIBBACKTRACE=0",
            "-DTVM_FFI_BACKTRACE_ON_SEGFAULT=0"]
RUNTIME_DIRS = ("runtime", "runtime/memory", "runtime/vm")   # under tvm/src, not recursive
LEFT_OUT = {"runtime/builtin_fp16.cc": "needs TVM's 3rdparty compiler-rt header (not in the wheel); "
                                       "libgcc provides the fp16 conversions on aarch64"}
FFI_DIRS = ("ffi", "ffi/extra")                               # under tvm_ffi/src
FFI_LEFT_OUT = {"ffi/backtrace_win.cc": "Windows only"}


def cross_compiler() -> str:
    path = shutil.which(CXX)
    if path is None:
        raise Missing(f"{CXX} not found; run `make system-deps` (Debian: apt-get install g++-aarch64-linux-gnu)")
    return path


def _sources(src_root: Path, dirs: tuple[str, ...], left_out: dict[str, str]) -> list[str]:
    found = []
    for d in dirs:
        found += [f"{d}/{p.name}" for p in sorted((src_root / d).glob("*.cc"))]
    return [s for s in found if s not in left_out]


def key_inputs(cxx: str) -> dict:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    tvm_src, ffi_src = package_dir("tvm") / "src", package_dir("tvm_ffi") / "src"
    return {
        "recipe": RECIPE,
        "compiler": version,
        "wheel": {p: importlib.metadata.version(p) for p in ("apache-tvm", "apache-tvm-ffi")},
        "support": file_sha256(vendor_dir() / SUPPORT_ARCHIVE),
        "cxxflags": CXXFLAGS,
        "sources": {"tvm": _sources(tvm_src, RUNTIME_DIRS, LEFT_OUT), "ffi": _sources(ffi_src, FFI_DIRS, FFI_LEFT_OUT)},
    }


def cache_root() -> Path:
    return Path(os.environ.get("AARCH64_VM_CACHE_DIR", REPO / ".cache" / "aarch64-vm"))


def _complete(folder: Path, name: str) -> Path | None:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        out = folder / name
        if out.is_file() and file_sha256(out) == manifest["sha256"]:
            return out
    except (OSError, ValueError, KeyError):
        pass
    return None


def _stage(work: Path) -> Path:
    """tvm/src/{runtime,support} as TVM's tree has them: the runtime's sources include "../support/*.h"
    (resolved after symlinks, so the runtime folder is copied, not linked)."""
    src = work / "tvm" / "src"
    shutil.copytree(package_dir("tvm") / "src" / "runtime", src / "runtime",
                    ignore=shutil.ignore_patterns("cuda", "hexagon", "extra", "rpc"))
    with tarfile.open(vendor_dir() / SUPPORT_ARCHIVE) as tar:
        tar.extractall(work / "unpack", filter="data")
    top = next((work / "unpack").iterdir())
    shutil.copytree(top / "src" / "support", src / "support")
    shutil.copytree(top / "include", work / "support-include")
    return work


def include_flags(staged: Path) -> list[str]:
    tvm, ffi = package_dir("tvm"), package_dir("tvm_ffi")
    return [f"-I{tvm / 'include'}", f"-I{ffi / 'include'}", f"-I{ffi / '3rdparty' / 'dlpack' / 'include'}",
            f"-I{staged / 'support-include'}"]


def runtime(jobs: int | None = None) -> Path:
    """The cross-built runtime archive (built on first use: ~50 files, several minutes on 2 cores)."""
    cxx = cross_compiler()
    inputs = key_inputs(cxx)
    final = cache_root() / key(inputs)
    done = _complete(final, ARCHIVE)
    if done is not None:
        return done
    t0 = time.perf_counter()
    workers = jobs or os.cpu_count() or 2
    objects = cache_root() / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_root()))
    try:
        staged = _stage(work)
        base = [cxx, *CXXFLAGS, *include_flags(staged)]
        ffi_src = package_dir("tvm_ffi") / "src"
        obj_key = {k: inputs[k] for k in ("recipe", "compiler", "wheel", "support", "cxxflags")}
        jobs_list = [(f"tvm/src/{s}", staged / "tvm" / "src" / s, base, objects / f"{key({**obj_key, 's': s})}.o")
                     for s in inputs["sources"]["tvm"]]
        jobs_list += [(f"tvm_ffi/src/{s}", ffi_src / s, base, objects / f"{key({**obj_key, 'ffi': s})}.o")
                      for s in inputs["sources"]["ffi"]]
        log(f"aarch64-vm: cross-compiling the TVM runtime, {len(jobs_list)} sources, {workers} at a time ({cxx})")
        failures = compile_all(staged, jobs_list, workers, "aarch64-vm")
        if failures:
            raise SystemExit(f"aarch64-vm: {len(failures)} file(s) failed to compile: {', '.join(failures)}")
        out = work / "out"
        out.mkdir()
        ar = shutil.which("aarch64-linux-gnu-ar") or "ar"
        subprocess.run([ar, "rcs", str(out / ARCHIVE), *(str(j[3]) for j in jobs_list)], check=True)
        manifest = {"archive": ARCHIVE, "sha256": file_sha256(out / ARCHIVE), "inputs": inputs, "left_out":
                    {**LEFT_OUT, **FFI_LEFT_OUT}, "build_seconds": round(time.perf_counter() - t0, 1)}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            out.rename(final)
        except OSError:
            if _complete(final, ARCHIVE) is None:
                raise
        log(f"aarch64-vm: runtime built in {time.perf_counter() - t0:.0f} s: {final / ARCHIVE}")
        return final / ARCHIVE
    finally:
        shutil.rmtree(work, ignore_errors=True)


def library_tar(bundle: Path) -> Path:
    tars = sorted((bundle / "lib").glob("*.tar"))
    if len(tars) != 1:
        raise Missing(f"{bundle / 'lib'}: expected one .tar (an android-cpu bundle's library), found "
                      f"{[t.name for t in tars]}; build one with `make build TARGET=android-cpu`")
    return tars[0]


def driver(bundle: Path, jobs: int | None = None) -> Path:
    """The bundle's library linked with decode_driver.cc and the runtime into one static aarch64 executable."""
    archive = runtime(jobs)
    tar = library_tar(bundle)
    folder = archive.parent / "drivers" / key({"tar": file_sha256(tar), "driver": file_sha256(DRIVER_SOURCE)})
    done = _complete(folder, "decode_driver")
    if done is not None:
        return done
    cxx = cross_compiler()
    work = Path(tempfile.mkdtemp(prefix=".link-", dir=archive.parent))
    try:
        staged = _stage(work)
        with tarfile.open(tar) as t:
            t.extractall(work / "lib", filter="data")
        objs = sorted(str(p) for p in (work / "lib").glob("*.o"))
        exe = work / "out" / "decode_driver"
        exe.parent.mkdir()
        cmd = [cxx, *CXXFLAGS, *include_flags(staged), str(DRIVER_SOURCE), *objs, "-static", "-o", str(exe),
               "-Wl,--whole-archive", str(archive), "-Wl,--no-whole-archive", "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log("\n".join(r.stderr.strip().splitlines()[-40:]))
            raise SystemExit(f"aarch64-vm: linking {tar.name} with the driver failed (above)")
        (exe.parent / "manifest.json").write_text(json.dumps({"sha256": file_sha256(exe), "library": str(tar)}) + "\n")
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            exe.parent.rename(folder)
        except OSError:
            if _complete(folder, "decode_driver") is None:
                raise
        return folder / "decode_driver"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, help="an android-cpu bundle folder: link its decode driver too")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        print(driver(args.bundle, args.jobs) if args.bundle else runtime(args.jobs))
    except Missing as e:
        print(f"aarch64-vm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
