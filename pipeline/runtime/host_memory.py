"""Weights in memory the kernels stream fast: anonymous mappings advised for transparent huge pages.

A decode step reads every weight once (80-300 MB here). Allocated the usual way (TVM's allocator ->
glibc -> mmap), that memory comes in 4 KB pages: with this kernel's THP mode `madvise` (the common
default) nothing backs it with 2 MB pages unless asked, and the stream takes a TLB miss every 4 KB.
Placed in mappings advised MADV_HUGEPAGE instead, measured on a Zen 4 EPYC (2 threads, decode after a
128-token prompt, same tokens): both engines in one process, alternated rounds, 1.045x SmolLM2-135M q4f16,
1.017x the 0.49B Qwen3-shaped model's q4f16, 1.048x its ternary_ptq; separate processes 1.05-1.06x and
1.04-1.09x (q4f16); a cold tiled q4 GEMV 1.03-1.14x. glibc's `glibc.malloc.hugetlb=1` tunable (the whole
process: KV cache, activations) added nothing on top. Where the advice is refused or unknown (macOS, THP
`never`) the arena is plain memory and nothing else changes.

The tensors handed to TVM are zero-copy views (DLPack) of the arena: each keeps its chunk alive.
"""

from __future__ import annotations

import mmap

import numpy as np
import tvm

from pipeline.errors import PipelineError

ALIGN = 64                 # bytes: TVM's allocation alignment, which its kernels may assume
CHUNK = 64 << 20           # bytes per mapping; a larger tensor gets a mapping of its own size


class HugePageArena:
    """Bump allocator over private anonymous mappings advised for huge pages: `place` makes a TVM tensor of an
    array (copied in, or used in place when `empty` gave it)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self.mappings: list[mmap.mmap] = []
        self.advised = 0          # mappings the kernel accepted the advice for
        self._free = np.empty(0, np.uint8)
        self._given: set[int] = set()   # addresses of `empty` arrays not placed yet

    def _grow(self, nbytes: int) -> None:
        size = max(self.chunk, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        try:
            mapping = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
        except OSError as err:      # ENOMEM: the weights do not fit this computer's memory (or its limits)
            raise PipelineError(f"cannot map {size / 2**20:.0f} MiB more for the weights ({err.strerror})",
                                fix="free memory, or run a smaller model / quantization") from None
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:
                mapping.madvise(advice)
                self.advised += 1
            except OSError:       # THP not built into this kernel: plain pages
                pass
        self.mappings.append(mapping)
        self._free = np.frombuffer(mapping, dtype=np.uint8)

    def _take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The next free ALIGN-aligned bytes of the arena as an array (a new mapping when they run out)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > self._free.size:
            self._grow(nbytes)
        view = self._free[:nbytes].view(dtype).reshape(shape)
        self._free = self._free[-(-nbytes // ALIGN) * ALIGN:]
        return view

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised C-contiguous array in the arena: fill it, then `place` it (no copy)."""
        dtype = np.dtype(dtype)
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.empty(shape, dtype)
        view = self._take(shape, dtype)
        self._given.add(view.ctypes.data)
        return view

    def place(self, array: np.ndarray):
        """A TVM CPU tensor of `array`: the array itself when `empty` gave it, else a copy in the arena."""
        array = np.asarray(array)
        if array.nbytes == 0:
            return tvm.runtime.tensor(array, tvm.cpu())
        if array.flags.c_contiguous and array.ctypes.data in self._given:
            self._given.discard(array.ctypes.data)
        else:
            view = self._take(array.shape, array.dtype)
            view[...] = array
            array = view
        try:
            return tvm.runtime.from_dlpack(array)
        except BufferError:   # numpy exports no bfloat16 / float8 (ml_dtypes): their bits, typed again in TVM
            raw = array.view(f"u{array.dtype.itemsize}")
            return tvm.runtime.from_dlpack(raw)._create_view(array.shape, array.dtype.name)
