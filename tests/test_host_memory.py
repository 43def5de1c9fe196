"""The huge-page weight arena (pipeline/runtime/host_memory.py): exact copies, TVM's alignment, chunks kept alive by
their tensors, and (Linux with THP built in) mappings the kernel marks as advised for huge pages."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pipeline.runtime.host_memory import ALIGN, HugePageArena


def test_place_copies_exactly_and_aligned():
    rng = np.random.default_rng(0)
    arena = HugePageArena(chunk=1 << 16)
    arrays = [rng.standard_normal((3, 5)).astype(np.float16), rng.integers(0, 2**32, (7, 9, 2), dtype=np.uint32),
              rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16),        # no numpy DLPack export: bits
              rng.standard_normal(5).astype(ml_dtypes.float8_e4m3fn),
              rng.standard_normal(1).astype(np.float32), np.zeros((0, 4), np.float32),
              rng.standard_normal((100, 300)).astype(np.float32)]      # 120 KB: a mapping of its own
    tensors = [arena.place(a) for a in arrays]
    for a, t in zip(arrays, tensors, strict=True):
        assert tuple(t.shape) == a.shape and str(t.dtype) == str(a.dtype)
        assert np.array_equal(t.numpy().view(np.uint8), a.view(np.uint8))   # bit for bit
        assert t.data_ptr() % ALIGN == 0
    assert len(arena.mappings) == 2
    ends = sorted((t.data_ptr(), t.data_ptr() + a.nbytes) for a, t in zip(arrays, tensors, strict=True) if a.nbytes)
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:], strict=False))   # no overlap


def test_tensors_keep_their_chunk_alive():
    arena = HugePageArena(chunk=1 << 16)
    want = np.arange(1000, dtype=np.float32)
    t = arena.place(want)
    del arena
    gc.collect()
    np.zeros(1 << 20).sum()            # reuse freed memory if the chunk had gone
    assert np.array_equal(t.numpy(), want)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="transparent huge pages are a Linux kernel feature (built into this one: no)")
def test_mappings_are_advised_for_huge_pages():
    """The kernel records the advice as the mapping's `hg` flag (whether a 2 MB page is actually there also
    depends on free memory, so that is not asserted)."""
    arena = HugePageArena(chunk=4 << 20)
    t = arena.place(np.ones(1 << 20, np.float32))
    assert arena.advised == 1
    flags = None
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        start, end = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
        if start <= t.data_ptr() < end:
            flags = re.search(r"VmFlags:(.*)", block).group(1).split()
    assert flags is not None and "hg" in flags


def test_out_of_memory_is_a_clear_error(monkeypatch):
    """A mapping the system refuses (ENOMEM) stops with a one-line error saying what to do."""
    import errno
    import mmap

    from pipeline.errors import PipelineError

    def refuse(*_args, **_kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(PipelineError, match=r"cannot map 64 MiB more for the weights .*fix: free memory"):
        HugePageArena().place(np.ones(4, np.float32))


def test_engine_places_host_arrays_and_keeps_tvm_tensors():
    """The engine's weights: numpy arrays go into its arena (on the CPU), TVM tensors (a stream or a list
    of them) are used as they are — as before the arena, minus the copy."""
    from types import SimpleNamespace

    import tvm

    from pipeline.runtime.engine import Engine

    engine = SimpleNamespace(arena=HugePageArena(), device=tvm.cpu())
    made = tvm.runtime.tensor(np.ones((2, 3), np.float16))
    assert Engine._to_device(engine, made) is made
    placed = Engine._to_device(engine, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert np.array_equal(placed.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert len(engine.arena.mappings) == 1


def test_empty_arrays_are_used_in_place():
    """`empty` + fill + `place`: the tensor is that memory (no copy); anything else placed is copied."""
    arena = HugePageArena(chunk=1 << 16)
    a = arena.empty((4, 8), np.float32)
    a[...] = np.arange(32, dtype=np.float32).reshape(4, 8)
    t = arena.place(a)
    assert t.data_ptr() == a.ctypes.data
    a[0, 0] = 99.0                         # same memory
    assert t.numpy()[0, 0] == 99.0
    other = np.ones(3, np.float32)
    u = arena.place(other)
    assert u.data_ptr() != other.ctypes.data and np.array_equal(u.numpy(), other)
    again = arena.place(a)                 # placed once already: now a copy
    assert again.data_ptr() != a.ctypes.data


def test_tensor_cache_reads_into_the_arena(tmp_path):
    """iter_tensor_cache(allocate=arena.empty) gives the same arrays as the plain read, in the arena's memory."""
    from pipeline.artifacts.tensor_cache import TensorCacheWriter, iter_tensor_cache

    rng = np.random.default_rng(3)
    tensors = {"a": rng.standard_normal((5, 7)).astype(np.float16),
               "b": rng.integers(0, 2**32, (33,), dtype=np.uint32),
               "c": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16)}
    with TensorCacheWriter(tmp_path, shard_cap_bytes=100) as writer:    # several shards
        for name, array in tensors.items():
            writer.add(name, array)
    arena = HugePageArena(chunk=1 << 16)
    placed = dict(iter_tensor_cache(tmp_path, allocate=arena.empty))
    plain = dict(iter_tensor_cache(tmp_path))
    assert list(placed) == list(plain) == list(tensors)
    for name, want in tensors.items():
        assert placed[name].dtype == want.dtype and placed[name].shape == want.shape
        assert placed[name].tobytes() == plain[name].tobytes() == want.tobytes()
        assert placed[name].ctypes.data in arena._given
