"""What the AArch64 code of a CPU library holds, read from its objects with llvm-objdump: per kernel, its
`sdot` / `smmla` instructions and its hottest loop (the innermost backward branch around dot products), so a
claim like "this GEMV uses sdot, ~0.37 instructions per weight" is read from what was emitted, never
assumed from the schedule that was asked for.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.kernels.objdump import find_objdump

DECODE_ATTRS = "+dotprod,+fullfp16,+i8mm"   # so every extension the kernels may use is decoded
DOT_MNEMONICS = ("sdot", "udot", "usdot", "smmla", "ummla", "usmmla")
BYTES_PER_DOT = 16   # byte products of one 128-bit sdot (smmla: 32, counted as two)

_SYMBOL = re.compile(r"^[0-9a-f]+ <([^>]+)>:$")
_INSN = re.compile(r"^\s*([0-9a-f]+):\s+(?:[0-9a-f]{8}|(?:[0-9a-f]{2} ){3}[0-9a-f]{2})\s+(\S+)\s*(.*)$")   # either byte style
_BRANCH = re.compile(r"^(?:b(?:\.\w+)?|cbn?z|tbn?z)$")


def disassemble(obj: Path, objdump: str) -> str:
    proc = subprocess.run([objdump, "-d", f"--mattr={DECODE_ATTRS}", str(obj)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(objdump).name} -d {obj.name}: {proc.stderr.strip()[-300:]}")
    return proc.stdout


@dataclass(frozen=True)
class Instruction:
    address: int
    mnemonic: str
    operands: str

    @property
    def vector(self) -> bool:
        """A SIMD&FP-register instruction on vectors (v registers, or q registers loaded / stored whole)."""
        return bool(re.search(r"\bv\d+\.|\{ ?v\d+|\bq\d+\b", self.operands))

    @property
    def dot(self) -> int:
        """Multiply-accumulate dot instructions it counts as (smmla: two sdot's work)."""
        if self.mnemonic in ("smmla", "ummla", "usmmla"):
            return 2
        return int(self.mnemonic in DOT_MNEMONICS)


def functions(disassembly: str) -> dict[str, list[Instruction]]:
    """{symbol: its instructions in address order} of an llvm-objdump -d listing."""
    out: dict[str, list[Instruction]] = {}
    symbol = None
    for line in disassembly.splitlines():
        head = _SYMBOL.match(line.strip())
        if head:
            symbol = head.group(1)
            out.setdefault(symbol, [])
            continue
        insn = _INSN.match(line)
        if insn and symbol is not None:
            out[symbol].append(Instruction(int(insn.group(1), 16), insn.group(2), insn.group(3)))
    return out


@dataclass(frozen=True)
class LoopMix:
    instructions: int
    vector: int
    dots: int

    def per_weight(self, dots_per_weight: int = 1) -> float:
        """Instructions per weight of the loop: each sdot multiplies 16 code bytes by 16 activation bytes, and
        each weight meets `dots_per_weight` of them (x in that many bytes)."""
        return self.instructions * dots_per_weight / (self.dots * BYTES_PER_DOT) if self.dots else float("inf")


MATRIX_MNEMONICS = ("smmla", "ummla", "usmmla")   # int8 operands only: x in one byte whatever the build's X_BYTES


def hot_loop(code: list[Instruction]) -> LoopMix | None:
    """The loop the dot products run in (a backward branch whose body has them: the one with the fewest
    instructions per dot, i.e. the innermost, and of a prompt kernel's loops the one over several prompt rows
    rather than its tail's), or None when the function has none."""
    best = None
    for i, insn in enumerate(code):
        if not _BRANCH.match(insn.mnemonic):
            continue
        target = re.search(r"0x([0-9a-f]+)", insn.operands) or re.search(r"\b([0-9a-f]+) <", insn.operands)
        if target is None:
            continue
        start = int(target.group(1), 16)
        if start > insn.address:
            continue
        body = [c for c in code[: i + 1] if c.address >= start]
        dots = sum(c.dot for c in body)
        if dots and (best is None or len(body) * best.dots < best.instructions * dots):
            best = LoopMix(len(body), sum(c.vector for c in body), dots)
    return best


def kernel_of(symbol: str) -> str:
    """The kernel a code symbol belongs to: TVM emits `__tvm_ffi_<sym>` (the packed-call wrapper) and
    `<sym>_compute_` (the body, parallel lambdas included)."""
    return symbol.removeprefix("__tvm_ffi_").removesuffix("_compute_")


def dot_kernels(objects: list[Path], objdump: str, prefix: str = "", x_bytes: int = 1) -> dict[str, dict[str, float]]:
    """{kernel (system-lib prefix removed): {"dot_instructions", "dot_mnemonics", "loop_instructions",
    "loop_vector", "instructions_per_weight"}} for every kernel of `objects` whose code holds a dot instruction;
    `x_bytes`: the bytes per activation the sdot kernels were built with (arm.X_BYTES), each a dot product per
    weight (a kernel of matrix dots: one; its figure is then per weight and prompt row)."""
    out: dict[str, dict[str, float]] = {}
    for obj in objects:
        for symbol, code in functions(disassemble(obj, objdump)).items():
            dots = sum(c.dot for c in code)
            loop = hot_loop(code)
            if not dots or loop is None:
                continue
            mnemonics = sorted({c.mnemonic for c in code if c.dot})
            per_dot = 1 if set(mnemonics) <= set(MATRIX_MNEMONICS) else x_bytes
            name = kernel_of(symbol).removeprefix(prefix)
            out[name] = {"dot_instructions": dots, "dot_mnemonics": mnemonics, "loop_instructions": loop.instructions,
                         "loop_vector": loop.vector, "instructions_per_weight": round(loop.per_weight(per_dot), 3)}
    return out


def tar_objects(tar_path: Path, dest: Path) -> list[Path]:
    """The objects at the top of a system-lib `.tar` (the kernels' host code, the embedded VM program), extracted
    into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".o") and "/" not in m.name]
        tar.extractall(dest, members=members, filter="data")
    return sorted(dest / m.name for m in members)


def library_dot_code(library: Path, prefix: str, x_bytes: int = 1) -> dict:
    """What a built AArch64 system-lib `.tar` holds: {"kernels": `dot_kernels` of its objects} or, where
    llvm-objdump is missing, {"kernels": None, "note": why} (never a guess)."""
    objdump = find_objdump()
    if objdump is None:
        return {"kernels": None, "note": "llvm-objdump not found: the object code was not read"}
    with tempfile.TemporaryDirectory(prefix="arm-code-") as tmp:
        return {"kernels": dot_kernels(tar_objects(library, Path(tmp)), objdump, prefix, x_bytes),
                "read_with": Path(objdump).name}
