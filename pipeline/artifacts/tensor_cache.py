"""MLC-LLM's weight format, `tensor-cache.json` + `params_shard_<N>.bin`, written as a stream.

This is the layout TVM's `tvm.contrib.tvmjs` writes and that MLC's Android / iOS / web runtimes (and
TVM's C++ `vm.builtin.tensor_cache.load`) read::

    {"metadata": {"ParamSize": ..., "ParamBytes": ..., "BitsPerParam": ...},
     "records": [{"dataPath": "params_shard_0.bin", "format": "raw-shard", "nbytes": N,
                  "records": [{"name", "shape", "dtype", "format": "raw", "nbytes", "byteOffset"}, ...],
                  "md5sum": "<hex>"}, ...]}

Small tensors are packed into shards of at most `shard_cap_bytes` (32 MiB). A tensor of at least half
the cap is written to a shard of its own, while the shard being filled stays open for the tensors
after it (as tvmjs does). Bytes go to disk as soon as `add()` is called, so the writer never holds
more than the tensor it was handed. Output is a pure function of the (name, array) sequence.

A long conversion can be resumed: `state()` (taken when a shard has just been finished) is a small JSON
object — finished shard records, the open shard's records and length, the next shard index — and
`TensorCacheWriter(out_dir, resume=state)` validates it against the files (sizes, md5), cuts the open
shard back to the recorded length and carries on, so the tensors after it give the same bytes as an
uninterrupted write. With `durable=True` every shard file is fsynced when it is finished.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from pipeline.artifacts.bundle import REBUILD_FIX, read_bundle_json
from pipeline.errors import WeightsError

INDEX = "tensor-cache.json"
SHARD_PREFIX = "params_shard"
DEFAULT_SHARD_CAP = 32 * 2**20

# dtype string in tensor-cache.json <-> numpy dtype. Names follow TVM's DataType spelling.
_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(t)
    for name, t in {
        "bool": np.bool_,
        "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
        "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
        "float16": np.float16, "float32": np.float32, "float64": np.float64,
        "bfloat16": ml_dtypes.bfloat16,
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
        "float8_e5m2": ml_dtypes.float8_e5m2,
    }.items()
}
_NAMES: dict[np.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


def _dtype_name(name: str, dtype: np.dtype) -> str:
    try:
        return _NAMES[dtype.newbyteorder("=")]
    except KeyError:
        raise WeightsError(f"tensor {name} has dtype {dtype}, which tensor-cache.json cannot store",
                           fix=f"convert it to one of {', '.join(_DTYPES)} before writing") from None


def _as_le_bytes(array: np.ndarray) -> np.ndarray:
    """A flat little-endian uint8 view (copied only when the input is strided or big-endian)."""
    big = array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and not np.little_endian)
    if big and array.dtype.itemsize > 1:
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class ResumeError(ValueError):
    """A saved writer state does not match the files on disk (the caller starts over)."""


def _fsync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


class TensorCacheWriter:
    """Streams named arrays into `out_dir` as an MLC tensor cache.

    Use as a context manager (`close()` runs on a clean exit; on an exception the index is not
    written, so no half-written cache ever looks valid), or call `close()` yourself.

    `metadata` is merged over the computed {"ParamSize": tensor count, "ParamBytes": stored bytes}
    (plus "BitsPerParam" = ParamBytes * 8 / total_params when `total_params`, the model's parameter
    count before quantization, is given), so callers may override any of them, as MLC's convert does.
    """

    def __init__(self, out_dir: Path, shard_cap_bytes: int = DEFAULT_SHARD_CAP, metadata: dict | None = None,
                 *, total_params: int | None = None, durable: bool = False, resume: dict | None = None):
        if shard_cap_bytes <= 0:
            raise ValueError(f"shard_cap_bytes must be positive, got {shard_cap_bytes}")
        self.out_dir = Path(out_dir)
        self.shard_cap_bytes = int(shard_cap_bytes)
        self.metadata = dict(metadata or {})
        self.total_params = total_params
        self.durable = durable
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._shards: dict[int, dict[str, Any]] = {}   # shard index -> shard record
        self._next_index = 0
        self._open: tuple[int, BinaryIO, Any, list[dict]] | None = None   # (index, file, md5, records)
        self._open_nbytes = 0
        self._names: set[str] = set()
        self._param_bytes = 0
        self._result: dict | None = None
        self.shards_finished = 0          # shards finished by this writer (not counting resumed ones)
        if resume is not None:
            self._restore(resume)
        keep = {self._shard_name(i) for i in self._shards}
        if self._open is not None:
            keep.add(self._shard_name(self._open[0]))
        # Shards left by an earlier write here would otherwise survive next to the new index.
        for stale in self.out_dir.glob(f"{SHARD_PREFIX}_*.bin"):
            if stale.name not in keep:
                stale.unlink()

    @property
    def tensor_count(self) -> int:
        """How many tensors have been added (resumed ones included)."""
        return len(self._names)

    def state(self) -> dict:
        """A JSON-able snapshot to resume from; the open shard's bytes so far are flushed (and with
        `durable`, fsynced) first, so the files on disk hold everything the snapshot names."""
        if self._result is not None:
            raise RuntimeError("TensorCacheWriter.state() after close()")
        open_state = None
        if self._open is not None:
            index, f, _md5, records = self._open
            if self.durable:
                _fsync(f)
            else:
                f.flush()
            open_state = {"index": index, "nbytes": self._open_nbytes, "records": [dict(r) for r in records]}
        return {"shard_cap_bytes": self.shard_cap_bytes, "next_index": self._next_index,
                "shards": [self._shards[i] for i in sorted(self._shards)], "open": open_state}

    def _restore(self, state: dict) -> None:
        """Take over a `state()` after checking it against the shard files; ResumeError if they differ."""
        try:
            if int(state["shard_cap_bytes"]) != self.shard_cap_bytes:
                raise ResumeError(f"shard cap {state['shard_cap_bytes']} != {self.shard_cap_bytes}")
            next_index = int(state["next_index"])
            shards = {int(rec["dataPath"][len(SHARD_PREFIX) + 1:-len(".bin")]): dict(rec)
                      for rec in state["shards"]}
            open_state = state["open"]
            records = [r for rec in shards.values() for r in rec["records"]]
            if open_state is not None:
                records += open_state["records"]
            names = [r["name"] for r in records]
            param_bytes = sum(int(r["nbytes"]) for r in records)
        except ResumeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ResumeError(f"malformed writer state ({type(err).__name__}: {err})") from None
        if len(set(names)) != len(names):
            raise ResumeError("a tensor is listed twice")
        for index, rec in shards.items():
            if rec.get("dataPath") != self._shard_name(index) or index >= next_index:
                raise ResumeError(f"bad shard record {rec.get('dataPath')!r}")
            path = self.out_dir / rec["dataPath"]
            if not path.is_file() or path.stat().st_size != rec["nbytes"]:
                raise ResumeError(f"{rec['dataPath']} is missing or has the wrong size")
            if _md5_of(path) != rec["md5sum"]:
                raise ResumeError(f"{rec['dataPath']} does not match its md5")
        if open_state is not None:
            index, nbytes = int(open_state["index"]), int(open_state["nbytes"])
            path = self.out_dir / self._shard_name(index)
            if index in shards or index >= next_index or not path.is_file() or path.stat().st_size < nbytes:
                raise ResumeError(f"open shard {path.name} is missing or shorter than recorded")
            f = open(path, "r+b")   # closed by _finish_open / _abort
            try:
                f.truncate(nbytes)
                md5 = hashlib.md5(usedforsecurity=False)
                for block in iter(lambda: f.read(1 << 22), b""):
                    md5.update(block)
                f.seek(nbytes)
            except BaseException:
                f.close()
                raise
            self._open = (index, f, md5, [dict(r) for r in open_state["records"]])
            self._open_nbytes = nbytes
        self._shards = shards
        self._next_index = next_index
        self._names = set(names)
        self._param_bytes = param_bytes

    # -- context manager
    def __enter__(self) -> TensorCacheWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()

    # -- writing
    def add(self, name: str, array: np.ndarray) -> None:
        """Append one tensor; its bytes are on disk (in the current or a new shard) when this returns."""
        if self._result is not None:
            raise RuntimeError("TensorCacheWriter.add() after close()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
        if name in self._names:
            raise WeightsError(f"tensor {name} was written twice", path=self.out_dir / INDEX,
                               fix="give every parameter a unique name")
        array = np.asarray(array)
        dtype = _dtype_name(name, array.dtype)
        data = _as_le_bytes(array)
        nbytes = int(data.nbytes)
        self._names.add(name)
        self._param_bytes += nbytes
        record = {"name": name, "shape": [int(d) for d in array.shape], "dtype": dtype,
                  "format": "raw", "nbytes": nbytes}

        if 2 * nbytes >= self.shard_cap_bytes:
            # Big tensor: a shard of its own. The shard being filled stays open for later small tensors.
            index = self._take_index()
            path = self.out_dir / self._shard_name(index)
            md5 = hashlib.md5(usedforsecurity=False)
            with open(path, "wb") as f:
                md5.update(data)
                f.write(data)
                if self.durable:
                    _fsync(f)
            self._shards[index] = self._shard_record(index, nbytes, [{**record, "byteOffset": 0}], md5)
            self.shards_finished += 1
            return

        if self._open is not None and self._open_nbytes + nbytes > self.shard_cap_bytes:
            self._finish_open()
        if self._open is None:
            index = self._take_index()
            f = open(self.out_dir / self._shard_name(index), "wb")   # closed by _finish_open / _abort
            self._open = (index, f, hashlib.md5(usedforsecurity=False), [])
            self._open_nbytes = 0
        _, f, md5, records = self._open
        records.append({**record, "byteOffset": self._open_nbytes})
        md5.update(data)
        f.write(data)
        self._open_nbytes += nbytes

    def close(self) -> dict:
        """Finish the last shard, write tensor-cache.json atomically and return its contents."""
        if self._result is not None:
            return self._result
        self._finish_open()
        metadata: dict[str, Any] = {"ParamSize": len(self._names), "ParamBytes": self._param_bytes}
        if self.total_params:
            metadata["BitsPerParam"] = self._param_bytes * 8.0 / self.total_params
        metadata.update(self.metadata)
        index = {"metadata": metadata, "records": [self._shards[i] for i in sorted(self._shards)]}
        text = json.dumps(index, indent=4, allow_nan=False) + "\n"
        tmp = self.out_dir / f".{INDEX}.tmp-{os.getpid()}"
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.out_dir / INDEX)
        finally:
            tmp.unlink(missing_ok=True)
        self._result = index
        return index

    # -- internals
    @staticmethod
    def _shard_name(index: int) -> str:
        return f"{SHARD_PREFIX}_{index}.bin"

    def _take_index(self) -> int:
        index = self._next_index
        self._next_index += 1
        return index

    def _shard_record(self, index: int, nbytes: int, records: list[dict], md5) -> dict:
        return {"dataPath": self._shard_name(index), "format": "raw-shard", "nbytes": nbytes,
                "records": records, "md5sum": md5.hexdigest()}

    def _finish_open(self) -> None:
        if self._open is None:
            return
        index, f, md5, records = self._open
        self._open = None
        if self.durable:
            _fsync(f)
        f.close()
        self._shards[index] = self._shard_record(index, self._open_nbytes, records, md5)
        self.shards_finished += 1

    def _abort(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None


# ---------------------------------------------------------------------------------------------- reading
def _load_index(folder: Path) -> dict:
    return read_bundle_json(Path(folder) / INDEX, missing="tensor-cache.json is missing", list_key="records",
                            no_list="tensor-cache.json has no shard list ('records')")


def iter_records(folder: Path) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor, in file order, from tensor-cache.json alone."""
    for shard in _load_index(folder)["records"]:
        for rec in shard["records"]:
            yield rec["name"], tuple(int(d) for d in rec["shape"]), rec["dtype"]


def read_metadata(folder: Path) -> dict:
    """The cache's "metadata" object (ParamSize, ParamBytes, ...)."""
    return dict(_load_index(folder).get("metadata") or {})


def _md5_of(path: Path) -> str:
    md5 = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            md5.update(block)
    return md5.hexdigest()


def _check_shard(folder: Path, shard: dict, verify: bool) -> Path:
    name = shard.get("dataPath", "?")
    path = folder / name
    if shard.get("format", "raw-shard") != "raw-shard":
        raise WeightsError(f"shard {name} has format {shard.get('format')!r}, not 'raw-shard'",
                           path=path, fix=REBUILD_FIX)
    if not path.is_file():
        raise WeightsError(f"weight shard {name} is missing", path=path, fix=REBUILD_FIX)
    size = path.stat().st_size
    if size != shard["nbytes"]:
        what = "truncated" if size < shard["nbytes"] else "too long"
        raise WeightsError(f"weight shard {name} is {what}: {size} bytes, tensor-cache.json says {shard['nbytes']}",
                           path=path, fix=REBUILD_FIX)
    if verify and shard.get("md5sum"):
        actual = _md5_of(path)
        if actual != shard["md5sum"]:
            raise WeightsError(f"weight shard {name} is corrupt: md5 {actual} != {shard['md5sum']} "
                               "recorded in tensor-cache.json", path=path, fix=REBUILD_FIX)
    return path


def read_tensor_cache(folder: Path, verify: bool = True) -> dict[str, np.ndarray]:
    """name -> array for every tensor in the cache at `folder` (see `iter_tensor_cache`)."""
    return dict(iter_tensor_cache(folder, verify))


def iter_tensor_cache(folder: Path, verify: bool = True,
                      allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
                      ) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor in the cache at `folder`, one at a time.

    Each shard's presence, size and (with `verify`) md5 are checked before it is read, so a damaged
    bundle fails with a WeightsError naming the shard instead of producing garbage. Arrays are
    independent, writable copies read with `np.fromfile`, or (`allocate`: shape, dtype -> an empty
    C-contiguous array, e.g. `HugePageArena.empty`) read straight into the arrays it gives: no temporary copy.
    """
    folder = Path(folder)
    for shard in _load_index(folder)["records"]:
        path = _check_shard(folder, shard, verify)
        for rec in shard["records"]:
            name = rec["name"]
            if rec.get("format", "raw") != "raw":
                raise WeightsError(f"tensor {name} uses encoding {rec['format']!r}; only 'raw' is supported",
                                   path=path, fix=REBUILD_FIX)
            dtype = _DTYPES.get(rec["dtype"])
            if dtype is None:
                raise WeightsError(f"tensor {name} has unsupported dtype {rec['dtype']!r}", path=path,
                                   fix=REBUILD_FIX)
            shape = tuple(int(d) for d in rec["shape"])
            count = math.prod(shape)
            offset, nbytes = int(rec["byteOffset"]), int(rec["nbytes"])
            if count * dtype.itemsize != nbytes or offset < 0 or offset + nbytes > shard["nbytes"]:
                raise WeightsError(f"tensor {name} does not fit its record (shape {list(shape)} {rec['dtype']}, "
                                   f"{nbytes} bytes at offset {offset})", path=path, fix=REBUILD_FIX)
            if allocate is not None and sys.byteorder == "little" and nbytes:
                arr = allocate(shape, dtype)
                with open(path, "rb") as f:
                    f.seek(offset)
                    got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
                if got != nbytes:     # the shard changed under us after its size was checked
                    raise WeightsError(f"tensor {name}: read {got} of {nbytes} bytes", path=path, fix=REBUILD_FIX)
                yield name, arr
                continue
            arr = np.fromfile(path, dtype=dtype.newbyteorder("<"), count=count, offset=offset)
            yield name, arr.astype(dtype, copy=False).reshape(shape)
