"""Run the aarch64 kernels of an android-cpu library under qemu-user, without a phone or the TVM runtime.

An android-cpu build is a system-lib `.tar` whose `lib0.o` holds every kernel as AArch64 code. That object
only needs a handful of runtime symbols (system-lib registration, workspace allocation, error reporting;
see `native/kernel_harness.c`, which supplies them) and libm. Linked statically with that small C driver by
the Debian cross compiler (`gcc-aarch64-linux-gnu`), it runs under `qemu-aarch64` (Debian `qemu-user`):
each kernel is called through its packed-call ABI with DLTensor arguments read from files, and its outputs
are written back, so they can be compared with an x86 LLVM build of the same PrimFunc.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import tvm_ffi

from pipeline.errors import PipelineError
from pipeline.kernels.cpu.arm_code import tar_objects

HARNESS_SOURCE = Path(__file__).resolve().parent / "native" / "kernel_harness.c"
TOOLS = {"qemu-aarch64": "qemu-user", "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu"}
SYMBOL_PREFIX = "__tvm_ffi_"   # packed-call entry of each kernel, after the system-lib prefix
_DL_CODES = {"i": 0, "u": 1, "f": 2}


def missing_tools() -> list[str]:
    """Debian packages to install before anything here can run (empty when all are present)."""
    return [pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None]


def _ffi_include() -> Path:
    return Path(tvm_ffi.__file__).resolve().parent / "include"


def library_objects(tar_path: Path, dest: Path) -> list[Path]:
    """The objects of a system-lib `.tar` (host code + the embedded VM program), extracted into dest."""
    return tar_objects(tar_path, dest)


def link_harness(objects: list[Path], out: Path) -> Path:
    """A static aarch64 executable: the C driver + the library's objects + libm."""
    missing = missing_tools()
    if missing:
        raise PipelineError("cannot build the aarch64 kernel harness", fix=f"apt-get install {' '.join(missing)}")
    cmd = ["aarch64-linux-gnu-gcc", "-static", "-O1", "-I", str(_ffi_include()), str(HARNESS_SOURCE),
           *map(str, objects), "-lm", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PipelineError(f"linking the aarch64 harness failed: {_link_error(done.stderr)}")
    return out


class AArch64Kernels:
    """The kernels of one aarch64 system-lib, callable from Python through qemu-aarch64."""

    def __init__(self, harness: Path, prefix: str = "", tasks: int = 0):
        self.harness = Path(harness)
        self.prefix = prefix
        self.tasks = tasks   # tasks per parallel loop (the phone's threads); 0: the harness's default

    def _run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**os.environ, "HARNESS_TASKS": str(self.tasks)} if self.tasks else None
        return subprocess.run(["qemu-aarch64", str(self.harness), *args], capture_output=True, text=True,
                              timeout=timeout, env=env)

    def names(self) -> list[str]:
        """Kernel names as in the Relax module (system-lib and packed-call prefixes removed)."""
        head = SYMBOL_PREFIX + self.prefix
        out = self._run("list").stdout.split()
        return sorted(n[len(head):] for n in out if n.startswith(head))

    def call(self, name: str, args: list) -> list:
        """Run kernel `name` on copies of `args` (numpy arrays / ints / floats); returns them with the outputs filled."""
        with tempfile.TemporaryDirectory(prefix="qemu-kernel-") as tmp:
            folder = Path(tmp)
            args_file, results = write_args(folder, args, write_back=True)
            done = self._run("call", SYMBOL_PREFIX + self.prefix + name, str(args_file))
            if done.returncode != 0:
                raise RuntimeError(f"{name} failed under qemu-aarch64 (exit {done.returncode}): "
                                   f"{done.stderr.strip()[-300:]}")
            out = list(args)
            for i, arr, dst in results:
                out[i] = np.frombuffer(dst.read_bytes(), dtype=arr.dtype).reshape(arr.shape).copy()
            return out


def write_args(folder: Path, args: list, write_back: bool) -> tuple[Path, list]:
    """The harness's argument file for `args` (numpy arrays / ints / floats) in `folder`: (its path, [(index, array, output
    file)] for the arrays, whose outputs the harness writes back only when `write_back`)."""
    lines, results = [], []
    for i, arg in enumerate(args):
        if isinstance(arg, np.ndarray):
            arr = np.ascontiguousarray(arg)
            src, dst = folder / f"in{i}.bin", folder / f"out{i}.bin"
            src.write_bytes(arr.tobytes())
            lines.append(f"T {_DL_CODES[arr.dtype.kind]} {arr.dtype.itemsize * 8} {arr.ndim} "
                         f"{' '.join(map(str, arr.shape))} {src} {dst if write_back else '-'}")
            results.append((i, arr, dst))
        elif isinstance(arg, float):
            lines.append(f"F {arg!r}")
        else:
            lines.append(f"I {int(arg)}")
    (folder / "args.txt").write_text("\n".join(lines) + "\n")
    return folder / "args.txt", results


def _link_error(stderr: str) -> str:
    """The informative lines of a failed link (undefined references first), not just collect2's summary."""
    lines = [ln.strip() for ln in stderr.strip().splitlines()]
    undefined = sorted({ln.split("undefined reference to", 1)[1].strip(" `'") for ln in lines
                        if "undefined reference to" in ln})
    if undefined:
        return "undefined symbols: " + ", ".join(undefined)
    return " | ".join(lines[-3:])


def build_kernels(funcs: dict, target: dict, prefix: str, out: Path) -> tuple[AArch64Kernels, AArch64Kernels,
                                                                              list[Path]]:
    """PrimFuncs built by LLVM for `target` into one system-lib (`prefix`) in `out` and linked with the harness:
    (its kernels with 1 task per parallel loop, with 4, the library's objects)."""
    import tvm
    from tvm.support import tar

    mod = tvm.IRModule(funcs).with_attr("system_lib_prefix", prefix)
    tvm.tirx.build(mod, target=tvm.target.Target(target)).export_library(str(out / "lib.tar"), fcompile=tar.tar)
    objects = library_objects(out / "lib.tar", out / "objects")
    harness = link_harness(objects, out / "harness")
    return AArch64Kernels(harness, tasks=1), AArch64Kernels(harness, tasks=4), objects
