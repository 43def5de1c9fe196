"""llama.cpp cross-compiled for phone CPUs (aarch64), from the same llama-cpp-python sdist as benchmarks/llamacpp.py.

Only `llama-bench` (the measured program) and `llama-quantize` (makes the Q4_0 / Q8_0 / TQ2_0 GGUFs, run under
qemu too: no x86 build is needed) are built, statically (it runs under qemu-aarch64 without an aarch64 sysroot), with the Debian
cross compiler (`gcc-aarch64-linux-gnu`), GGML_NATIVE off and an explicit `-march` per phone-CPU class:

    dotprod   -march=armv8.2-a+dotprod          (Cortex-A76 and later: sdot / udot)
    i8mm      -march=armv8.2-a+dotprod+i8mm     (Cortex-X2 / A710 and later: smmla too)

ggml's own thread pool is used (GGML_OPENMP off): a static OpenMP runtime under qemu-user is one more thing to
go wrong, and ggml's pool is what its Android builds without OpenMP run. CPU repacking (Q4_0 -> Q4_0_4x4 /
4x8 at load) stays on, as in a default build. Cached in a folder keyed by the sdist's sha256 and the flags:

    .cache/llama.cpp/<version>/aarch64-<class>-<key>/bin/llama-{bench,quantize}    (BUILT written last)

    .venv/bin/python benchmarks/llamacpp_aarch64.py [--cls dotprod|i8mm] [--jobs 2]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: import the checkout's benchmarks/
    sys.path.insert(0, str(ROOT))

from benchmarks import llamacpp  # noqa: E402
from pipeline.artifacts.bundle import file_sha256  # noqa: E402

MARCH = {"dotprod": "armv8.2-a+dotprod", "i8mm": "armv8.2-a+dotprod+i8mm"}
CROSS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++")
TOOLS = ("llama-bench", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DCMAKE_SYSTEM_NAME=Linux",
    "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
    f"-DCMAKE_C_COMPILER={CROSS[0]}",
    f"-DCMAKE_CXX_COMPILER={CROSS[1]}",
    "-DCMAKE_EXE_LINKER_FLAGS=-static",
    "-DGGML_NATIVE=OFF",
    "-DGGML_OPENMP=OFF",
    "-DGGML_LLAMAFILE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
)


@dataclass(frozen=True)
class ArmBuild:
    """A finished cross build: the static aarch64 tools and the flags they were built with."""

    cls: str
    march: str
    bin: Path
    key: str

    @property
    def bench(self) -> Path:
        return self.bin / "llama-bench"

    def tool(self, name: str) -> Path:
        """A tool as a command for this machine: a script that runs the aarch64 binary under qemu-aarch64
        (benchmarks/speed.py's `llamacpp_ggufs` calls `tool("llama-quantize")`)."""
        script = self.bin / f"qemu-{name}"
        if not script.exists():
            script.write_text(f'#!/bin/sh\nexec qemu-aarch64 "{self.bin / name}" "$@"\n')
            script.chmod(0o755)
        return script


def missing_tools() -> list[str]:
    """Debian packages needed for the cross build (empty when all are present)."""
    return ["g++-aarch64-linux-gnu"] if any(shutil.which(c) is None for c in CROSS) else []


def build_key(sdist: Path, cls: str) -> str:
    """sdist content + every flag: a different sdist or -march never reuses a build."""
    text = file_sha256(sdist) + "\n" + "\n".join(CMAKE_FLAGS) + "\n" + MARCH[cls]
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def ensure_built(cls: str = "dotprod", version: str = llamacpp.VERSION, cache: Path = llamacpp.CACHE,
                 jobs: int = 2, quiet: bool = False) -> ArmBuild:
    """Reuse the cached build for this class, else fetch the sdist (pip) and cross-build llama-bench."""
    if cls not in MARCH:
        raise llamacpp.BuildError(f"unknown phone-CPU class {cls!r} — fix: one of {', '.join(MARCH)}")
    missing = missing_tools()
    if missing:
        raise llamacpp.BuildError(f"no aarch64 cross compiler — fix: apt-get install {' '.join(missing)}")
    home = cache / version
    sdist = llamacpp._sdist(version, home)
    key = build_key(sdist, cls)
    folder = home / f"aarch64-{cls}-{key}"
    found = ArmBuild(cls, MARCH[cls], folder / "bin", key)
    if (folder / "BUILT").exists() and all((found.bin / t).exists() for t in TOOLS):
        return found
    src = llamacpp._extract(sdist, home / "src")
    cmake = llamacpp._which_or_pip("cmake")
    try:
        generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={llamacpp._which_or_pip('ninja')}"]
    except llamacpp.BuildError:
        generator = []
    log = home / f"aarch64-{cls}-{key}.log"
    if not quiet:
        print(f"cross-building llama-bench {version} for aarch64 ({MARCH[cls]}) with -j{jobs}; log: {log}",
              flush=True)
    if not (folder / "CMakeCache.txt").exists():
        llamacpp._run([cmake, "-S", str(src), "-B", str(folder), *generator, *CMAKE_FLAGS,
                       f"-DGGML_CPU_ARM_ARCH={MARCH[cls]}", f"-DCMAKE_RUNTIME_OUTPUT_DIRECTORY={folder / 'bin'}"],
                      log, nice=True)
    llamacpp._run([cmake, "--build", str(folder), "-j", str(jobs), "--target", *TOOLS], log, nice=True)
    missing = [t for t in TOOLS if not (found.bin / t).exists()]
    if missing:
        raise llamacpp.BuildError(f"build finished but {', '.join(missing)} missing from {found.bin} — see {log}")
    (folder / "BUILT").write_text(version + "\n")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cls", choices=sorted(MARCH), default="dotprod", help="phone-CPU class (-march)")
    ap.add_argument("--jobs", "-j", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        print(ensure_built(args.cls, jobs=args.jobs).bench)
    except llamacpp.BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
