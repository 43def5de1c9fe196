"""Finding llvm-objdump: what reads the ISA out of the objects we emit (sdot / smmla on Arm, HVX on Hexagon)."""

from __future__ import annotations

import os
import shutil

OBJDUMP_CANDIDATES = tuple(f"llvm-objdump-{v}" for v in range(21, 13, -1)) + ("llvm-objdump",)


def find_objdump() -> str | None:
    """llvm-objdump (any Debian llvm version, newest first; LLVM_OBJDUMP overrides): None when absent."""
    env = os.environ.get("LLVM_OBJDUMP")
    return next((found for c in ((env,) if env else OBJDUMP_CANDIDATES) if (found := shutil.which(c))), None)
