"""Hugging Face model folders: config.json (+ generation_config.json) and *.safetensors (+ index).

Every header is parsed and checked when the folder is opened (cheap even for a 54 GB model), so a
truncated shard, a missing shard or a header whose shapes do not match its byte ranges is a one-line
`WeightsError` before any conversion starts. `get_rows` reads a row range straight from the file.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from safetensors import safe_open

from pipeline.errors import ConfigError, WeightsError
from pipeline.frontend.checkpoint_base import (
    NONFINITE_BITS,
    REDOWNLOAD,
    TOKENIZER_FILES,
    Checkpoint,
    FloatSpan,
    build_tokenizer,
    check_inside,
    files_fingerprint,
    natural_key,
    one_line,
    row_range,
)

_MAX_HEADER = 100 * 1024 * 1024  # safetensors itself refuses headers above 100 MB


def _read_json(path: Path, error: type[ConfigError] | type[WeightsError], fix: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"cannot be read ({one_line(err)})", path=path, fix=fix) from None
    except json.JSONDecodeError as err:
        raise error(f"is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})",
                    path=path, fix=fix) from None
    if not isinstance(data, dict):
        raise error(f"must hold a JSON object, not a {type(data).__name__}", path=path, fix=fix)
    return data



# safetensors dtype code -> (dtype name reported by Checkpoint.dtype, bits per element)
_ST_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 8),
    "U8": ("uint8", 8),
    "I8": ("int8", 8),
    "U16": ("uint16", 16),
    "I16": ("int16", 16),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "U32": ("uint32", 32),
    "I32": ("int32", 32),
    "F32": ("float32", 32),
    "U64": ("uint64", 64),
    "I64": ("int64", 64),
    "F64": ("float64", 64),
    "C64": ("complex64", 64),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F6_E2M3": ("float6_e2m3fn", 6),
    "F6_E3M2": ("float6_e3m2fn", 6),
    "F4": ("float4_e2m1fn", 4),
}
# read with safe_open(framework="numpy"); the float8 / bfloat16 codes go through torch instead
_ST_NUMPY = {"BOOL", "U8", "I8", "U16", "I16", "F16", "U32", "I32", "F32", "U64", "I64", "F64"}
# codes `get_rows` reads itself (little-endian raw -> float32); BF16 is read as its uint16 bits
_ST_RAW = {code: np.dtype(t).newbyteorder("<") for code, t in {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "F16": np.float16,
    "BF16": np.uint16, "U32": np.uint32, "I32": np.int32, "F32": np.float32, "U64": np.uint64,
    "I64": np.int64, "F64": np.float64}.items()}
_ST_TORCH = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
             "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu"}


class _STEntry(NamedTuple):
    file: Path
    code: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int = 0  # absolute file offset of the tensor's first byte


class _STHeader(NamedTuple):
    entries: dict[str, _STEntry]
    header_end: int  # 8 + header length: where the data starts
    data_end: int  # header_end + bytes the tensors need


def _read_safetensors_header(file: Path) -> _STHeader:
    """Parse and check a safetensors header (8-byte little-endian length + JSON) without reading data."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise WeightsError(f"truncated: expected at least 8 bytes, file has {size}", path=file, fix=REDOWNLOAD)
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER:
            raise WeightsError("not a safetensors file (its first 8 bytes are not a plausible header length)",
                               path=file, fix=REDOWNLOAD)
        if 8 + length > size:
            raise WeightsError(f"truncated: expected at least {8 + length} bytes for the header, file has {size}",
                               path=file, fix=REDOWNLOAD)
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:   # its reason, never the bytes: the file may not be a model file at all
        raise WeightsError(f"safetensors header is not UTF-8 text ({err.reason} at byte {8 + err.start})",
                           path=file, fix=REDOWNLOAD) from None
    except json.JSONDecodeError as err:
        raise WeightsError(f"safetensors header is not valid JSON ({err.msg} at character {err.pos})",
                           path=file, fix=REDOWNLOAD) from None
    if not isinstance(header, dict):
        raise WeightsError("safetensors header is not a JSON object", path=file, fix=REDOWNLOAD)

    entries: dict[str, _STEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code = info["dtype"]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            ok = (all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise WeightsError(f"tensor {name!r} has a malformed header entry {json.dumps(info)[:120]}",
                               path=file, fix=REDOWNLOAD)
        if code not in _ST_DTYPES:
            raise WeightsError(f"tensor {name!r} has unknown dtype {code!r}", path=file,
                               fix="save it with a current safetensors version")
        bits = _ST_DTYPES[code][1]
        need = (math.prod(shape) * bits + 7) // 8
        if end - begin != need:
            raise WeightsError(
                f"header lies about tensor {name!r}: shape {list(shape)} of {code} needs {need} bytes "
                f"but its data_offsets [{begin}, {end}] span {end - begin}", path=file, fix=REDOWNLOAD)
        entries[name] = _STEntry(file, code, shape, 8 + length + begin)
        spans.append((begin, end, name))

    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a {begin - pos}-byte gap"
            raise WeightsError(f"tensor {name!r} data_offsets [{begin}, {end}] {what}", path=file, fix=REDOWNLOAD)
        pos = end
    expected = 8 + length + pos
    if size < expected:
        raise WeightsError(f"truncated: expected {expected} bytes, file has {size}", path=file, fix=REDOWNLOAD)
    if size > expected:
        raise WeightsError(f"has {size - expected} bytes after the last tensor (expected {expected} bytes, "
                           f"file has {size})", path=file, fix=REDOWNLOAD)
    return _STHeader(entries, 8 + length, expected)


class SafetensorsCheckpoint(Checkpoint):
    """A HF model folder: config.json (+ generation_config.json) and *.safetensors (+ index)."""

    format = "safetensors"

    def __init__(self, folder: Path, files: list[Path], index: Path | None):
        if index is not None:
            check_inside(folder, index)
        config = self.load_config(folder)
        gen_file = folder / "generation_config.json"
        generation = (_read_json(gen_file, ConfigError, "fix or delete generation_config.json")
                      if gen_file.is_file() else {})
        super().__init__(folder, config, generation)
        self._index = index

        weight_map: dict[str, str] = {}
        if index is not None:
            data = _read_json(index, WeightsError, REDOWNLOAD)
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise WeightsError("has no \"weight_map\" object", path=index, fix=REDOWNLOAD)
            files = []
            for shard in sorted(set(map(str, weight_map.values()))):
                file = folder / shard
                check_inside(folder, file, named_by=(index, shard))
                if not file.is_file():
                    raise WeightsError(f"shard {shard} is missing (it is named in this index)",
                                       path=index, fix=f"{REDOWNLOAD} ({shard}), or the whole folder")
                files.append(file)

        for file in [*files, *(folder / n for n in (*TOKENIZER_FILES, "generation_config.json")
                               if (folder / n).exists())]:
            check_inside(folder, file)
        self._files = files
        self._headers: dict[Path, _STHeader] = {}
        entries: dict[str, _STEntry] = {}
        for file in files:
            header = _read_safetensors_header(file)
            self._headers[file] = header
            for name, entry in header.entries.items():
                if name in entries:
                    raise WeightsError(f"tensor {name!r} is in both {entries[name].file.name} and {file.name}",
                                       path=folder, fix="remove the safetensors files that are not one model")
                entries[name] = entry
        for name, shard in weight_map.items():
            if name not in entries or entries[name].file.name != Path(shard).name:
                raise WeightsError(f"says tensor {name!r} is in {shard}, but that shard does not hold it",
                                   path=index, fix=REDOWNLOAD)
        if not entries:
            raise WeightsError("the safetensors files hold no tensors", path=folder, fix=REDOWNLOAD)
        self._entries = {name: entries[name] for name in sorted(entries, key=natural_key)}

    @staticmethod
    def load_config(folder: Path) -> dict[str, Any]:
        file = folder / "config.json"
        fix = "copy config.json from the model's Hugging Face repo into the folder"
        if not file.is_file():
            raise ConfigError("is missing", path=file, fix=fix)
        check_inside(folder, file)
        return _read_json(file, ConfigError, fix)

    def _entry(self, name: str) -> _STEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise self._unknown(name) from None

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        return _ST_DTYPES[self._entry(name).code][0]

    def get(self, name: str) -> np.ndarray:
        entry = self._entry(name)
        try:
            if entry.code in _ST_NUMPY:
                with safe_open(str(entry.file), framework="numpy") as f:
                    arr = f.get_tensor(name)
            elif entry.code in _ST_TORCH:
                # imported here: torch is heavy and only bfloat16 / float8 tensors need it
                import torch

                with safe_open(str(entry.file), framework="pt") as f:
                    arr = f.get_tensor(name).to(torch.float32).numpy()
            else:
                raise WeightsError(f"tensor {name!r} has dtype {entry.code}, which cannot be converted to float32",
                                   path=entry.file, fix="save the checkpoint in bfloat16/float16/float32")
        except WeightsError:
            raise
        except Exception as err:  # the header checks passed, so this is damage inside the data
            raise WeightsError(f"cannot read tensor {name!r} ({one_line(err)})", path=entry.file,
                               fix=REDOWNLOAD) from None
        arr = np.asarray(arr).astype(np.float32, copy=False).reshape(entry.shape)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=np.float32, order="C")
        return arr

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) read straight from the file (no memory map, nothing else read), as float32."""
        entry = self._entry(name)
        raw = _ST_RAW.get(entry.code)
        if raw is None or not entry.shape:
            return super().get_rows(name, start, stop)
        start, stop = row_range(entry.shape, start, stop)
        row = math.prod(entry.shape[1:])
        buf = np.empty((stop - start) * row, dtype=raw)
        want = buf.nbytes
        try:
            with open(entry.file, "rb") as f:
                f.seek(entry.offset + start * row * raw.itemsize)
                got = f.readinto(memoryview(buf).cast("B")) if want else 0
        except OSError as err:
            raise WeightsError(f"cannot read tensor {name!r} ({one_line(err)})", path=entry.file,
                               fix=REDOWNLOAD) from None
        if got != want:
            raise WeightsError(f"truncated while reading tensor {name!r} ({got} of {want} bytes)",
                               path=entry.file, fix=REDOWNLOAD)
        if entry.code == "BF16":   # bfloat16 is the top half of a float32: widening is exact
            wide = np.empty(buf.shape, np.uint32)
            np.left_shift(buf, 16, out=wide, dtype=np.uint32)
            arr = wide.view(np.float32)
        else:
            arr = buf.astype(np.float32)
        return arr.reshape((stop - start, *entry.shape[1:]))

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            spans: dict[Path, list[FloatSpan]] = {file: [] for file in self._files}
            for name, e in self._entries.items():
                dtype = _ST_DTYPES[e.code][0]
                if dtype in NONFINITE_BITS:
                    nbytes = math.prod(e.shape) * _ST_DTYPES[e.code][1] // 8
                    spans[e.file].append(FloatSpan(name, dtype, e.offset, e.offset + nbytes))
            self._fingerprint = files_fingerprint("safetensors", spans)
        return self._fingerprint

    def total_bytes(self) -> int:
        return sum(file.stat().st_size for file in self._files)

    def write_tokenizer(self, dest: Path) -> list[str]:
        dest = Path(dest)
        present = [n for n in TOKENIZER_FILES if (self.path / n).is_file()]
        if not present:
            raise WeightsError("has no tokenizer files", path=self.path,
                               fix="copy tokenizer.json and tokenizer_config.json from the model's HF repo")
        dest.mkdir(parents=True, exist_ok=True)
        written = []
        for n in present:
            shutil.copyfile(self.path / n, dest / n)
            written.append(n)
        if "tokenizer.json" not in present:
            # e.g. only a sentencepiece tokenizer.model: let transformers convert it to the fast format
            built = build_tokenizer(self.path, None, self.path)
            for n, data in built.items():
                if n == "tokenizer.json":
                    (dest / n).write_bytes(data)
                    written.append(n)
        return written

