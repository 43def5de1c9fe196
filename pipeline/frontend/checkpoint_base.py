"""What every checkpoint format answers, and the helpers the formats share.

`Checkpoint` is the interface the rest of the pipeline reads weights through (names, shapes, dtypes, one
float32 tensor or a row range at a time, a fingerprint, the tokenizer files); `safetensors_folder` and
`gguf_file` implement it. It lives apart from `checkpoint.open_checkpoint`, which picks the format, so
that the formats can import it without an import cycle.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pipeline.cache import digest, remembered, stream_file
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


# float dtypes checked for NaN / inf on their raw bits: (unsigned view, exponent all ones with the sign cleared)
NONFINITE_BITS: dict[str, tuple[np.dtype, int]] = {
    "float16": (np.dtype("<u2"), 0x7C00),
    "bfloat16": (np.dtype("<u2"), 0x7F80),
    "float32": (np.dtype("<u4"), 0x7F800000),
    "float64": (np.dtype("<u8"), 0x7FF0000000000000),
}
FINGERPRINT_WORKERS = 4   # files hashed at once (hashlib and numpy release the GIL)


class FloatSpan(NamedTuple):
    """A floating-point tensor's bytes in a weight file, checked for NaN / inf while the file is hashed."""

    name: str
    dtype: str     # a NONFINITE_BITS key
    start: int     # absolute file offsets [start, end)
    end: int


def _nonfinite(view: memoryview, dtype: str) -> str | None:
    """"NaN" / "inf" when the little-endian elements in `view` hold one, else None (no float conversion)."""
    kind, limit = NONFINITE_BITS[dtype]
    bits = np.frombuffer(view, dtype=kind)
    if not len(bits):
        return None
    magnitude = np.bitwise_and(bits, kind.type(limit | (limit - 1)))   # sign bit cleared
    top = int(magnitude.max())
    if top < limit:
        return None
    return "NaN" if top > limit else "inf"


def content_hash(file: Path, spans: Sequence[FloatSpan]) -> str:
    """sha256 of the file's whole content; every span is checked finite in the same pass. Both are
    remembered under the file's identity (cache.remembered), so an unchanged file is read once.

    Raises WeightsError naming the tensor and the file when one holds NaN or inf.
    """
    def compute() -> dict[str, Any]:
        h = hashlib.sha256()
        bad: list[Any] = []

        def visit(i: int, view: memoryview) -> None:
            if not bad:
                what = _nonfinite(view, spans[i].dtype)
                if what:
                    bad.append([spans[i].name, what])
        try:
            stream_file(file, h, [(s.start, s.end) for s in spans], visit)
        except OSError as err:
            raise WeightsError(f"cannot be read ({one_line(err)})", path=file, fix=REDOWNLOAD) from None
        return {"sha256": h.hexdigest(), "nonfinite": bad[0] if bad else None}

    what = "sha256+finite v1 " + digest([list(s) for s in spans])
    result = remembered(file, what, compute)
    if result["nonfinite"]:
        name, kind = result["nonfinite"]
        raise WeightsError(f"tensor {name!r} is not finite (it holds {kind})", path=file,
                           fix="use a checkpoint without NaN / inf weights: re-download it, or re-export it "
                               "from a training run that did not diverge")
    return result["sha256"]


def files_fingerprint(tag: str, files: dict[Path, Sequence[FloatSpan]]) -> str:
    """A checkpoint's identity: every file's name, size and full content hash (files hashed in parallel)."""
    ordered = sorted(files, key=lambda p: p.name)
    with ThreadPoolExecutor(max_workers=min(FINGERPRINT_WORKERS, os.cpu_count() or 1)) as pool:
        hashes = list(pool.map(lambda f: content_hash(f, files[f]), ordered))
    h = hashlib.sha256(f"mobile-llm checkpoint fingerprint v2 {tag}\0".encode())
    for file, sha in zip(ordered, hashes, strict=True):
        h.update(f"{file.name}\0{file.stat().st_size}\0{sha}\0".encode())
    return h.hexdigest()


INSIDE_FIX = ("copy the file itself into the model folder (a Hugging Face hub snapshot may link into its own "
              "blobs/ folder, nowhere else)")


def model_roots(folder: Path) -> list[Path]:
    """Where the files of a model folder may resolve to: the folder itself and, for a snapshot of a Hugging Face
    hub cache (.../models--org--name/snapshots/<revision>/, whose files link to ../../blobs/), that blobs/."""
    root = folder.resolve()
    roots = [root]
    blobs = root.parent.parent / "blobs"
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--") and blobs.is_dir():
        roots.append(blobs.resolve())
    return roots


def check_inside(folder: Path, file: Path, *, named_by: tuple[Path, str] | None = None) -> None:
    """Refuse, in one line, a file of the model folder that resolves (through a symlink, `..` or an absolute
    path) outside it: a model folder is a boundary, and nothing outside it is read, let alone quoted.
    `named_by`: (index file, the name it gives) when the path comes from a shard index: the index is blamed
    when the name itself leaves the folder (`..`, an absolute path), the file when it is a symlink."""
    real = file.resolve()
    if any(real.is_relative_to(root) for root in model_roots(folder)):
        return
    lexical = Path(os.path.normpath(os.path.abspath(file)))
    if named_by is not None and not lexical.is_relative_to(os.path.abspath(folder)):
        index, name = named_by
        raise WeightsError(f"names shard {name[:120]!r}, which resolves outside the model folder {folder}",
                           path=index, fix="name shards by their file names in the model folder")
    raise WeightsError(f"resolves outside the model folder (to {str(real)[:200]})", path=file, fix=INSIDE_FIX)


class Checkpoint:
    """Model weights + HF config, read lazily. See `open_checkpoint`."""

    format: str = ""

    def __init__(self, path: Path, config: dict[str, Any], generation_config: dict[str, Any]):
        self.path = path
        self.config = config
        self.generation_config = generation_config
        self._fingerprint: str | None = None   # computed once: it reads every byte of the weights

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
        """The weights' identity for cache keys: their full content (see `files_fingerprint`); computing
        it checks that every float tensor is finite, so a NaN weight is refused here (once per file)."""
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
