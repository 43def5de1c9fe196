"""What every checkpoint format answers, and the helpers the formats share.

`Checkpoint` is the interface the rest of the pipeline reads weights through (names, shapes, dtypes, one
float32 tensor or a row range at a time, a fingerprint, the tokenizer files); `safetensors_folder` and
`gguf_file` implement it. It lives apart from `checkpoint.open_checkpoint`, which picks the format, so
that the formats can import it without an import cycle.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import WeightsError

REDOWNLOAD = "re-download it"

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

_SAMPLE = 64 * 1024  # bytes per data sample hashed by fingerprint()


def one_line(err: BaseException | str) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def natural_key(name: str) -> list[Any]:
    """Sort "layers.2" before "layers.10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def row_range(shape: tuple[int, ...], start: int, stop: int) -> tuple[int, int]:
    """Clamp [start, stop) to the rows (axis 0) of a tensor of `shape`, like a Python slice."""
    if not shape:
        raise ValueError("a 0-d tensor has no rows")
    start, stop, _ = slice(start, stop).indices(int(shape[0]))
    return start, max(start, stop)


def hash_file(h: Any, file: Path, head_end: int, data_end: int) -> None:
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
        start, stop = row_range(self.shape(name), start, stop)
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


def build_tokenizer(folder: Path, gguf_file: str | None, blame: Path) -> dict[str, bytes]:
    """Let transformers build a tokenizer from `folder` (or a GGUF in it); return its files' bytes by name."""
    try:
        # imported here: transformers takes seconds to import and only tokenizer-less checkpoints need it
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            tok.save_pretrained(tmp)
            return {n: (Path(tmp) / n).read_bytes() for n in TOKENIZER_FILES if (Path(tmp) / n).is_file()}
    except Exception as err:
        raise WeightsError(f"cannot build a tokenizer from it ({one_line(err)[:200]})", path=blame,
                           fix="add the model's tokenizer.json and tokenizer_config.json from its HF repo") from None
