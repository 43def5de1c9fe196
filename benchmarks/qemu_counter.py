"""Instruction, vector-instruction and memory-byte counts of aarch64 (qemu-aarch64) and Hexagon (qemu-hexagon) programs.

The counting is done by the project's TCG plugin (benchmarks/native/insn_counter.c), built with this machine's
gcc into `.cache/qemu-plugin/<source hash>/insn_counter.so` the first time it is needed. `run()` executes a
static aarch64 program under `qemu-aarch64 -plugin ...` (or a Hexagon one under qemu-hexagon: counts are then
packets, and vector ones name an HVX register) and returns its counts: whole-program totals and the
part executed inside given address ranges (e.g. a kernel's symbols, `symbol_ranges()`), summed over all guest
threads. The counts are exact for the code qemu executes; what they mean for a phone is the benchmark's model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(__file__).resolve().parent / "native" / "insn_counter.c"
CACHE = Path(os.environ.get("QEMU_PLUGIN_CACHE", ROOT / ".cache" / "qemu-plugin"))
TOOLS = {"gcc": "gcc", "qemu-aarch64": "qemu-user", "qemu-hexagon": "qemu-user",
         "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu"}
COUNT_KEYS = ("insns", "vector_insns", "loads", "load_bytes", "stores", "store_bytes")


class CounterError(RuntimeError):
    """The plugin could not be built or the program failed under qemu; one line naming the fix or the cause."""


def missing_tools(tools: tuple[str, ...] = tuple(TOOLS)) -> list[str]:
    """Debian packages for the named tools that are not on PATH (empty when all are present)."""
    return sorted({TOOLS[t] for t in tools if shutil.which(t) is None})


@dataclass(frozen=True)
class Counts:
    """One program run: totals, the part inside the address ranges, and instructions per guest thread (vCPU)."""

    total: dict[str, int]
    range: dict[str, int]
    per_vcpu_insns: list[int] = field(default_factory=list)

    def minus(self, other: Counts) -> Counts:
        """Counts of this run beyond `other` (e.g. a longer run minus a shorter one of the same program)."""
        return Counts({k: self.total[k] - other.total[k] for k in COUNT_KEYS},
                      {k: self.range[k] - other.range[k] for k in COUNT_KEYS})

    def scaled(self, factor: float) -> dict[str, dict[str, float]]:
        return {"total": {k: self.total[k] * factor for k in COUNT_KEYS},
                "range": {k: self.range[k] * factor for k in COUNT_KEYS}}


def plugin_path(cache: Path = CACHE) -> Path:
    """The built plugin, compiled now if this source version has not been built yet."""
    src = SOURCE.read_bytes()
    out = cache / hashlib.sha256(src).hexdigest()[:12] / "insn_counter.so"
    if out.exists():
        return out
    if shutil.which("gcc") is None:
        raise CounterError("gcc not found: the qemu counting plugin is built with the host gcc — fix: apt-get install gcc")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(tmp), str(SOURCE)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise CounterError(f"building {SOURCE.name} failed: {done.stderr.strip()[-400:]}")
    os.replace(tmp, out)
    return out


def run(argv: list[str], ranges: list[tuple[int, int]] = (), timeout: float = 1800,
        env: dict[str, str] | None = None, cwd: Path | None = None, qemu: str = "qemu-aarch64",
        stdin: bytes | None = None) -> tuple[Counts, subprocess.CompletedProcess]:
    """Run the program `argv` under `qemu` (qemu-aarch64 or qemu-hexagon) with the plugin, `stdin` as its
    input; its counts and the finished process (stdout / stderr as text, or bytes when `stdin` is given)."""
    missing = missing_tools((qemu,))
    if missing:
        raise CounterError(f"{qemu} not found — fix: apt-get install {' '.join(missing)}")
    plugin = plugin_path()
    with tempfile.TemporaryDirectory(prefix="qemu-count-") as tmp:
        out = Path(tmp) / "counts.json"
        args = [f"out={out}"] + [f"range={lo:#x}-{hi:#x}" for lo, hi in ranges]
        cmd = [qemu, "-plugin", ",".join([str(plugin), *args]), *map(str, argv)]
        done = subprocess.run(cmd, capture_output=True, text=stdin is None, input=stdin, timeout=timeout, env=env,
                              cwd=cwd)
        err = done.stderr if stdin is None else done.stderr.decode(errors="replace")
        if done.returncode != 0:
            raise CounterError(f"{Path(argv[0]).name} failed under {qemu} (exit {done.returncode}): "
                               f"{err.strip()[-400:]}")
        if not out.exists():
            raise CounterError(f"the plugin wrote no counts for {Path(argv[0]).name}: {err.strip()[-300:]}")
        data = json.loads(out.read_text())
    return Counts(data["total"], data["range"], data["per_vcpu_insns"]), done


def symbol_ranges(binary: Path, names: set[str] | None = None, prefix: str = "",
                  nm: str | None = None) -> dict[str, tuple[int, int]]:
    """Function symbols of a static aarch64 (or, with nm="llvm-nm", Hexagon) binary with their [lo, hi) address
    ranges (`nm -S`): those named in `names`, or all starting with `prefix`."""
    nm = shutil.which(nm) if nm else shutil.which("aarch64-linux-gnu-nm") or shutil.which("nm")
    if nm is None:
        raise CounterError("nm not found — fix: apt-get install binutils-aarch64-linux-gnu (llvm for llvm-nm)")
    out = subprocess.run([nm, "-S", "--defined-only", str(binary)], capture_output=True, text=True, check=True)
    found = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) != 4 or parts[2] not in "tTwW":
            continue
        addr, size, _, name = parts
        if (names is not None and name in names) or (names is None and name.startswith(prefix)):
            lo = int(addr, 16)
            found[name] = (lo, lo + int(size, 16))
    return found
