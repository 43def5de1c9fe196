"""llama.cpp, built from the `llama-cpp-python` sdist, as a measuring peer for the benchmarks.

The sdist (a registry package, fetched with pip, no git or network beyond the package index) carries
`vendor/llama.cpp` with the HF converter and the tools. This builds only the tools the benchmarks run
(llama-quantize, llama-perplexity, llama-bench, llama-imatrix; CPU backend, native ISA) into a cache folder that is
never committed, and reuses it when present:

    .cache/llama.cpp/<version>/llama_cpp_python-<version>.tar.gz   the sdist
    .cache/llama.cpp/<version>/src/                                 its vendor/llama.cpp
    .cache/llama.cpp/<version>/build/bin/llama-*                    the tools (the native build)
    .cache/llama.cpp/<version>/BUILT                                written last (a finished build)
    .cache/llama.cpp/<version>/build-noamx/, BUILT-noamx            on a CPU with AMX, also a build without it

Which builds a machine gets: `variants()`. The speed benchmark measures with each of them and keeps each
figure from the fastest build that ran it; the other tools use `ensure_built()`'s one (`safe_variant()`).

    .venv/bin/python benchmarks/llamacpp.py            # build them (about 10 min each on 2 cores), print paths
    .venv/bin/python benchmarks/llamacpp.py --jobs 4

Needs cmake (>= 3.14), ninja (or make) and a C++17 compiler; `pip install cmake ninja` provides the
first two (pinned in pyproject's `bench` extra). Importable: `ensure_built()` returns a `LlamaCpp`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.3.36"
CACHE = Path(os.environ.get("LLAMA_CPP_CACHE", ROOT / ".cache" / "llama.cpp"))
TOOLS = ("llama-quantize", "llama-perplexity", "llama-bench", "llama-imatrix")
# CPU backend only; nothing that fetches or serves.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
)
# On a CPU with AMX, GGML_NATIVE compiles ggml's AMX matmul in, and in this version it segfaults in prompt
# processing (ggml_backend_amx_mul_mat, seen under gdb on a Xeon with amx_int8 on 2026-12-05: every Q4_0 / Q8_0 /
# Q4_K / TQ2_0 llama-bench run, prompt first, died with SIGSEGV; F16 ran). Its decode runs, though, and about
# twice as fast as a build without AMX (SmolLM2 Q4_0 tg128, empty context: 218-237 vs ~105 tok/s). So such CPUs
# get both builds, each in its own folder (a cached build of one kind is never taken for the other), and the
# speed benchmark keeps each figure from the one that runs it fastest. The build without AMX keeps the AVX-512 /
# VNNI paths and CPU repacking.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The first CPU's flags in /proc/cpuinfo (or in the `cpuinfo` text); [] when unreadable."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Whether this machine's CPU flags include AMX."""
    flags = cpu_flags(cpuinfo)
    return "amx_int8" in flags or "amx_tile" in flags


@dataclass(frozen=True)
class Variant:
    """One kind of build: its name in the results, folder suffix, extra cmake flags and what it is."""

    name: str
    suffix: str
    flags: tuple[str, ...]
    note: str


NATIVE = Variant("native", "", (), "GGML_NATIVE: every ISA extension of this CPU (AMX too, where it has it)")
NOAMX = Variant("no-amx", "-noamx", (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"),
                "GGML_NATIVE without AMX (-mno-amx-*): this version's AMX matmul segfaults in prompt processing")


def variants(amx: bool | None = None) -> list[Variant]:
    """The builds this machine gets: the native one always; with AMX (default: this CPU's flags) also one without
    it, since the native one crashes in prompt processing there but decodes fastest."""
    return [NATIVE, NOAMX] if (amx if amx is not None else cpu_has_amx()) else [NATIVE]


def safe_variant(amx: bool | None = None) -> Variant:
    """The build the tools other than the speed benchmark's llama-bench use: one that runs everything."""
    return variants(amx)[-1]


class BuildError(RuntimeError):
    """llama.cpp could not be fetched or built; the message is one line naming the fix."""


@dataclass(frozen=True)
class LlamaCpp:
    """A finished build: the tools' folder and the vendored sources (converter, gguf-py)."""

    version: str
    src: Path
    bin: Path
    build: str = NATIVE.name     # the Variant's name
    note: str = NATIVE.note

    def tool(self, name: str) -> Path:
        return self.bin / name

    @property
    def converter(self) -> Path:
        return self.src / "convert_hf_to_gguf.py"

    def converter_env(self) -> dict[str, str]:
        """The converter imports the vendored gguf-py (it matches the tools), not the venv's gguf."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.src / "gguf-py"), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        env.setdefault("NO_LOCAL_GGUF", "")
        return env


def _which_or_pip(name: str) -> str:
    """A build tool on PATH or beside this Python (pip's cmake / ninja wheels install there)."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    raise BuildError(f"{name} not found — fix: `.venv/bin/pip install {name}` (pinned in pyproject's bench extra)")


def _compiler_check() -> None:
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")):
        raise BuildError("no C++ compiler found — fix: install g++ (`apt-get install g++`) or set CXX")


def _sdist(version: str, where: Path) -> Path:
    """The sdist tarball, fetched with pip (sources only) if not cached yet."""
    name = f"llama_cpp_python-{version}.tar.gz"
    if (where / name).exists():
        return where / name
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
           "--no-binary", ":all:", "--no-deps", "-q", "-d", str(where)]
    if subprocess.run(cmd).returncode != 0 or not (where / name).exists():
        raise BuildError(f"pip could not download the llama-cpp-python=={version} sdist — fix: check access to "
                         "the package index (or put the .tar.gz into " f"{where})")
    return where / name


def _extract(tarball: Path, dest: Path) -> Path:
    """vendor/llama.cpp of the sdist into dest (atomically: a temp folder renamed)."""
    if (dest / "CMakeLists.txt").exists():
        return dest
    prefix = tarball.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, tarfile.open(tarball) as tf:
        members = []
        for m in tf.getmembers():
            if m.name.startswith(prefix) and m.name != prefix:
                m.name = m.name[len(prefix):]
                members.append(m)
        if not members:
            raise BuildError(f"{tarball}: no vendor/llama.cpp inside — fix: delete it and rerun to fetch it again")
        tf.extractall(tmp, members=members, filter="data")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        os.makedirs(tmp)  # TemporaryDirectory cleans up a folder that must exist
    return dest


def _run(cmd: list[str], log: Path, nice: bool) -> None:
    prefix = ["nice", "-n", "10"] if nice and shutil.which("nice") else []
    with open(log, "a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(prefix + cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise BuildError(f"`{' '.join(cmd[:3])} ...` failed (exit {rc}) — see {log} for the compiler output")


def find_built(version: str = VERSION, cache: Path = CACHE, variant: Variant | None = None) -> LlamaCpp | None:
    """The cached build of that kind (default `safe_variant()`) if it finished (its BUILT marker is written after
    the last tool linked)."""
    v = variant or safe_variant()
    home = cache / version
    lc = LlamaCpp(version, home / "src", home / f"build{v.suffix}" / "bin", v.name, v.note)
    if (home / f"BUILT{v.suffix}").exists() and all(lc.tool(t).exists() for t in TOOLS):
        return lc
    return None


def ensure_built(version: str = VERSION, cache: Path = CACHE, jobs: int = 2, nice: bool = True,
                 quiet: bool = False, variant: Variant | None = None) -> LlamaCpp:
    """Reuse a finished build of that kind (default `safe_variant()`), else fetch + configure + build the tools
    (resumes a half build: ninja)."""
    v = variant or safe_variant()
    found = find_built(version, cache, v)
    if found:
        return found
    home = cache / version
    home.mkdir(parents=True, exist_ok=True)
    cmake = _which_or_pip("cmake")
    _compiler_check()
    try:
        generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={_which_or_pip('ninja')}"]
    except BuildError:
        generator = []  # cmake's default (make) still works, only slower to start
    src = _extract(_sdist(version, home), home / "src")
    build = home / f"build{v.suffix}"
    log = home / f"build{v.suffix}.log"
    if not quiet:
        print(f"building llama.cpp {version} ({v.name}: {', '.join(TOOLS)}) with -j{jobs}; log: {log}", flush=True)
    if not (build / "CMakeCache.txt").exists():
        _run([cmake, "-S", str(src), "-B", str(build), *generator, *CMAKE_FLAGS, *v.flags], log, nice)
    _run([cmake, "--build", str(build), "-j", str(jobs), "--target", *TOOLS], log, nice)
    (home / f"BUILT{v.suffix}").write_text(version + "\n")
    lc = find_built(version, cache, v)
    if lc is None:
        raise BuildError(f"build finished but the tools are missing from {build / 'bin'} — see {log}")
    return lc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=VERSION, help="llama-cpp-python sdist version")
    ap.add_argument("--cache", type=Path, default=CACHE, help="cache folder (default .cache/llama.cpp)")
    ap.add_argument("--jobs", "-j", type=int, default=2)
    ap.add_argument("--no-nice", action="store_true", help="do not lower the build's priority")
    args = ap.parse_args(argv)
    for v in variants():
        try:
            lc = ensure_built(args.version, args.cache, args.jobs, nice=not args.no_nice, variant=v)
        except BuildError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        for t in TOOLS:
            print(lc.tool(t))
    print(lc.converter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
