"""Run the android-hexagon build's HVX kernels under qemu-hexagon, without a phone, a DSP or the Hexagon SDK.

The HVX `.tar` holds QDSP6 objects whose kernels are global `__tvm_ffi_<symbol>` functions with TVM's
packed-call ABI. `native/hexagon_harness.c` — freestanding: its own `_start`, raw Linux syscalls, no libc —
supplies the few symbols they reference (workspace allocator, error reporting, `__hexagon_sqrtf`); it is
compiled by clang for Hexagon, linked with the objects and a generated kernel table by `ld.lld`, and run by
`qemu-hexagon` (Debian `qemu-user`). Each call sends the kernel's DLTensor arguments on stdin and reads them
back from stdout after the call.

qemu-hexagon 7.2 (Debian 12) knows one CPU, v67, and maps an executable to it only when its ELF e_flags
name v5..v67; any newer version (the objects are v73: e_flags 0x73) stops the loader with "unable to find
CPU model 'unknown'" before one instruction runs. The linked executable's e_flags are therefore rewritten to
v67. That only selects QEMU's CPU model: QEMU does not gate instructions by version, it decodes the v73 code
with its own decoder, and an instruction it lacks raises SIGILL (reported by `call` as such).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tvm_ffi

from pipeline.errors import PipelineError
from pipeline.kernels.npu.hexagon import build_npu_library, find_objdump

HARNESS_SOURCE = Path(__file__).resolve().parent / "native" / "hexagon_harness.c"
SYMBOL_PREFIX = "__tvm_ffi_"          # packed-call entry of each kernel
QEMU_CPU_FLAGS = 0x67                 # the ELF e_flags qemu-hexagon 7.2 maps to its only CPU model (v67)
E_FLAGS_OFFSET = 36                   # of an ELF32 header
_VERSIONS = tuple(range(21, 13, -1))
TOOLS = {"qemu-hexagon": ("qemu-hexagon",), "ld.lld": ("ld.lld",),
         "clang": ("clang", *(f"clang-{v}" for v in _VERSIONS)),
         "llvm-nm": ("llvm-nm", *(f"llvm-nm-{v}" for v in _VERSIONS))}
PACKAGES = {"qemu-hexagon": "qemu-user", "ld.lld": "lld", "clang": "clang", "llvm-nm": "llvm"}
_DL_CODES = {"i": 0, "u": 1, "f": 2}


def _tool(name: str) -> str | None:
    return next((found for c in TOOLS[name] if (found := shutil.which(c))), None)


def missing_tools() -> list[str]:
    """Debian packages to install before anything here can run (empty when all are present)."""
    return [PACKAGES[name] for name in TOOLS if _tool(name) is None]


def library_objects(tar_path: Path, dest: Path) -> list[Path]:
    """The Hexagon objects of an HVX `.tar`, extracted into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".o") and "/" not in m.name]
        tar.extractall(dest, members=members, filter="data")
    return sorted(dest / m.name for m in members)


def kernel_symbols(objects: list[Path]) -> list[str]:
    """The packed-call entries the objects define (global text symbols `__tvm_ffi_*`)."""
    out = _checked([_tool("llvm-nm"), "--defined-only", *map(str, objects)], "llvm-nm")
    return sorted({f[2] for f in (ln.split() for ln in out.splitlines())
                   if len(f) == 3 and f[1] == "T" and f[2].startswith(SYMBOL_PREFIX)})


def _table_source(symbols: list[str]) -> str:
    """C source of the harness's kernel table: name -> packed-call function."""
    decls = "".join(f"int {s}(void*, const TVMFFIAny*, int32_t, TVMFFIAny*);\n" for s in symbols)
    rows = "".join(f'  {{"{s}", {s}}},\n' for s in symbols)
    return ("#include <tvm/ffi/c_api.h>\n"
            "typedef struct { const char* name; TVMFFISafeCallType fn; } HarnessKernel;\n"
            f"{decls}const HarnessKernel harness_kernels[] = {{\n{rows}  {{0, 0}}}};\n"
            f"const int harness_num_kernels = {len(symbols)};\n")


def _checked(cmd: list, what: str) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise PipelineError(f"{what} failed: {' | '.join(lines[-4:])}")
    return done.stdout


def link_harness(objects: list[Path], out: Path) -> Path:
    """A static Hexagon executable: the freestanding driver + a kernel table + the objects (e_flags -> v67)."""
    missing = missing_tools()
    if missing:
        raise PipelineError("cannot build the Hexagon kernel harness", fix=f"apt-get install {' '.join(missing)}")
    out = Path(out)
    table = out.with_name(out.name + "_table.c")
    table.write_text(_table_source(kernel_symbols(objects)))
    include = Path(tvm_ffi.__file__).resolve().parent / "include"
    compiled = []
    for src in (HARNESS_SOURCE, table):
        obj = out.with_name(f"{out.name}_{src.stem}.o")
        _checked([_tool("clang"), "--target=hexagon-unknown-none-elf", "-mcpu=hexagonv67", "-O2",
                  "-ffreestanding", "-nostdlib", "-Wall", "-I", include, "-c", src, "-o", obj], "compiling the harness")
        compiled.append(obj)
    _checked([_tool("ld.lld"), "-static", "-e", "_start", *compiled, *objects, "-o", out], "linking the harness")
    return set_qemu_cpu_flags(out)


def set_qemu_cpu_flags(executable: Path) -> Path:
    """Mark a Hexagon executable as v67 code (see the module docstring: qemu-hexagon 7.2 loads nothing newer)."""
    with open(executable, "r+b") as f:
        f.seek(E_FLAGS_OFFSET)
        f.write(struct.pack("<I", QEMU_CPU_FLAGS))
    return Path(executable)


@dataclass(frozen=True)
class StoppedAt:
    """The packet qemu-hexagon could not decode: its address in the harness, its instructions, and those of
    them the v67 decoder (qemu 7.2's) does not know."""

    address: int
    instructions: tuple[str, ...]
    undecoded: tuple[str, ...]

    def __str__(self) -> str:
        marked = [f"{i}  <- not decoded" if i in self.undecoded else i for i in self.instructions]
        return f"{self.address:#x}: {{ {'; '.join(marked)} }}"


class HexagonRunError(RuntimeError):
    """A kernel did not complete under qemu-hexagon; `signal` is the signal that stopped qemu, if any."""

    def __init__(self, message: str, signal: int | None):
        super().__init__(message)
        self.signal = signal


_TRACE_PC = re.compile(r"^Trace \S+ \S+ \[[0-9a-f]+/([0-9a-f]+)/")
_BRANCH_TARGET = re.compile(r"\b(?:jump|call)\s+0x([0-9a-f]+)")
_LINE = re.compile(r"^\s*([0-9a-f]+):\t(?:[0-9a-f]{2} ){3}[0-9a-f]{2}\t([0-9a-f]{8})\s+(.*)$")


def _last_traced_pc(log: Path) -> int | None:
    last = None
    with open(log, errors="replace") as f:
        for line in f:
            m = _TRACE_PC.match(line)
            if m:
                last = m.group(1)
    return int(last, 16) if last else None


def _packets(executable: Path) -> dict[int, list[tuple[int, int, str]]]:
    """{packet address: [(address, word, instruction)]}, decoded as v69 with 128-byte HVX (the newest CPU
    that Debian's LLVM 14/15 disassemblers know)."""
    out = subprocess.run([find_objdump() or "llvm-objdump", "-d", "--mcpu=hexagonv69",
                          "--mattr=+hvxv69,+hvx-length128b", str(executable)], capture_output=True, text=True).stdout
    packets: dict[int, list[tuple[int, int, str]]] = {}
    start = None
    for m in map(_LINE.match, out.splitlines()):
        if not m:
            continue
        addr, word, text = int(m.group(1), 16), int(m.group(2), 16), m.group(3).strip()
        if start is None or text.startswith("{"):
            start = addr
            packets[start] = []
        packets[start].append((addr, word, text.strip("{} \t")))
        if text.endswith("}"):
            start = None
    return packets


def _known_to_v67(word: int) -> bool | None:
    """Whether the v67 decoder (qemu 7.2's only CPU) knows one instruction word, decoded as a packet of its
    own (parse bits 15:14 set to end-of-packet); None without llvm-mc."""
    mc = next((found for c in ("llvm-mc", *(f"llvm-mc-{v}" for v in _VERSIONS)) if (found := shutil.which(c))), None)
    if mc is None:
        return None
    alone = (word | 0xC000).to_bytes(4, "little")
    done = subprocess.run([mc, "--disassemble", "-triple=hexagon", "-mcpu=hexagonv67", "-mattr=+hvxv67,+hvx-length128b"],
                          input=" ".join(f"{b:#04x}" for b in alone), capture_output=True, text=True)
    return "invalid instruction encoding" not in done.stderr


def _request(name: str, args: list) -> bytes:
    parts = [struct.pack("<I", len(name)), name.encode(), struct.pack("<I", len(args))]
    for arg in args:
        if isinstance(arg, np.ndarray):
            arr = np.ascontiguousarray(arg)
            parts += [struct.pack("<4I", 0, _DL_CODES[arr.dtype.kind], arr.dtype.itemsize * 8, arr.ndim),
                      struct.pack(f"<{arr.ndim}q", *arr.shape), arr.tobytes()]
        else:
            parts.append(struct.pack("<Iq", 1, int(arg)))
    return b"".join(parts)


class HexagonKernels:
    """The kernels of linked Hexagon objects, callable from Python through qemu-hexagon."""

    def __init__(self, harness: Path, prefix: str = ""):
        self.harness = Path(harness)
        self.prefix = prefix

    def _run(self, request: bytes, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["qemu-hexagon", str(self.harness)], input=request, capture_output=True,
                              timeout=timeout)

    def names(self) -> list[str]:
        """Kernel names (packed-call and symbol prefixes removed)."""
        head = SYMBOL_PREFIX + self.prefix
        out = self._run(_request("", []), 60).stdout.decode().split()
        return sorted(n[len(head):] for n in out if n.startswith(head))

    def call(self, name: str, args: list, timeout: float = 300) -> list:
        """Run kernel `name` on copies of `args` (numpy arrays / ints); returns them with the outputs filled."""
        done = self._run(_request(SYMBOL_PREFIX + self.prefix + name, args), timeout)
        if done.returncode != 0:
            signal = -done.returncode if done.returncode < 0 else None
            err = done.stderr.decode(errors="replace").strip()
            raise HexagonRunError(f"{name} failed under qemu-hexagon ({f'signal {signal}' if signal else f'exit {done.returncode}'}"
                                  f"): {err[-400:]}", signal)
        out, offset = list(args), 0
        for i, arg in enumerate(args):
            if isinstance(arg, np.ndarray):
                n = arg.nbytes
                out[i] = np.frombuffer(done.stdout[offset:offset + n], dtype=arg.dtype).reshape(arg.shape).copy()
                offset += n
        if offset != len(done.stdout):
            raise HexagonRunError(f"{name}: {len(done.stdout)} reply bytes, expected {offset}", None)
        return out

    def diagnose(self, name: str, args: list, timeout: float = 300) -> StoppedAt | None:
        """The packet qemu-hexagon stopped at while running `name`; None when the run does not stop at an
        instruction its decoder lacks.

        qemu translates one packet per block (-singlestep) and logs each block it executes (-d exec); an
        unknown encoding aborts the translation of the next block, so the packet that stopped it is the
        fall-through or a branch target of the last logged one: the candidate holding an instruction the
        v67 decoder does not know (qemu 7.2's HVX is the integer HVX of v66-v68: no hf / qf16 / qf32 / sf)."""
        with tempfile.TemporaryDirectory(prefix="qemu-hexagon-") as tmp:
            log = Path(tmp) / "exec.log"
            done = subprocess.run(["qemu-hexagon", "-singlestep", "-d", "exec,nochain", "-D", str(log),
                                   str(self.harness)], input=_request(SYMBOL_PREFIX + self.prefix + name, args),
                                  capture_output=True, timeout=timeout)
            if done.returncode == 0 or not log.exists():
                return None
            last = _last_traced_pc(log)
        if last is None:
            return None
        packets = _packets(self.harness)
        at = max((a for a in packets if a <= last), default=None)
        if at is None:
            return None
        following = [a for a in sorted(packets) if a > at][:1]
        targets = [int(t, 16) for _, _, text in packets[at] for t in _BRANCH_TARGET.findall(text)]
        for cand in following + targets:
            insns = packets.get(cand, [])
            undecoded = tuple(text for _, word, text in insns if _known_to_v67(word) is False)
            if undecoded:
                return StoppedAt(cand, tuple(text for _, _, text in insns), undecoded)
        return None


def hexagon_kernels(mod: Any, records: list[Any], npu: dict[str, Any], folder: Path) -> HexagonKernels:
    """The NPU-placed kernels of `records`, compiled as the build compiles them (build_npu_library) into
    folder and linked with the harness; kernel names as in `mod`."""
    lib = build_npu_library(mod, records, npu, "", folder)
    if lib is None:
        raise PipelineError("no NPU kernel to run under qemu-hexagon")
    return HexagonKernels(link_harness(library_objects(lib, folder / "objects"), folder / "harness"), "hvx_")
