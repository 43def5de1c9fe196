"""An unchanged rebuild is a cache hit that touches nothing; a changed input rebuilds only what depends on it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cache import ENTRY_MANIFEST, cache_root, damaged_entry
from pipeline.errors import WeightsError
from pipeline.progress import Reporter
from pipeline.stages import run_pipeline


def _tiny(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128)
    folder = tmp_path / "tiny-qwen3"
    Qwen3ForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def _snapshot(bundle):
    return {p.name: p.stat().st_mtime_ns for p in bundle.rglob("*") if p.is_file()}


def test_unchanged_rebuild_is_a_cache_hit(tmp_path):
    folder = _tiny(tmp_path)
    out = tmp_path / "dist"
    first = run_pipeline(str(folder), "host-cpu", "q0f32", out=str(out), report=Reporter(quiet=True))
    assert not first.cached
    before = _snapshot(first.bundle)
    second = run_pipeline(str(folder), "host-cpu", "q0f32", out=str(out), report=Reporter(quiet=True))
    assert second.cached and second.bundle == first.bundle
    assert _snapshot(second.bundle) == before          # nothing rewritten

    # A damaged bundle is not trusted: the next build re-emits it (from the stage caches).
    (first.bundle / "mlc-chat-config.json").write_text("{}")
    third = run_pipeline(str(folder), "host-cpu", "q0f32", out=str(out), report=Reporter(quiet=True))
    assert json.loads((third.bundle / "mlc-chat-config.json").read_text())["model_type"] == "qwen3"

    # A bundle owns its files (no hard link into the cache), and "up to date" checks content, not sizes: one
    # byte flipped in place in a weight shard is caught by the next build, which restores it from the cache.
    assert all(f.stat().st_nlink == 1 for f in third.bundle.rglob("*") if f.is_file())
    shard = sorted(third.bundle.glob("params_shard_*.bin"))[0]
    good = shard.read_bytes()
    with open(shard, "r+b") as f:
        f.seek(len(good) // 2)
        f.write(bytes([good[len(good) // 2] ^ 0xFF]))
    fourth = run_pipeline(str(folder), "host-cpu", "q0f32", out=str(out), report=Reporter(quiet=True))
    assert not fourth.cached and shard.read_bytes() == good

    # A different quantization is a different bundle with its own key.
    other = run_pipeline(str(folder), "host-cpu", "q0f16", out=str(out), report=Reporter(quiet=True))
    assert other.bundle != first.bundle and not other.cached
    keys = {json.loads((b / "manifest.json").read_text())["build_key"] for b in (first.bundle, other.bundle)}
    assert len(keys) == 2


class _Lines(Reporter):
    """A quiet Reporter that keeps what it was told."""

    def __init__(self):
        super().__init__(quiet=True)
        self.lines: list[str] = []

    def info(self, text: str) -> None:
        self.lines.append(text)


def _nan_copy(src, dst):
    """`src` with one weight changed to NaN in place: same files, sizes and shapes."""
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    entry = next(v for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)
    width = {"F32": 4, "BF16": 2, "F16": 2}[entry["dtype"]]
    nan = np.float32("nan").tobytes()[-width:] if width == 2 and entry["dtype"] == "BF16" else \
        np.array(np.nan, {"F32": np.float32, "F16": np.float16}[entry["dtype"]]).tobytes()
    at = 8 + n + entry["data_offsets"][0] + 5 * width
    shard.write_bytes(raw[:at] + nan + raw[at + width:])
    return shard


def test_nan_weight_is_refused_not_a_cache_hit(tmp_path):
    """One weight changed to NaN in an otherwise identical checkpoint is refused, whether it is a copy or was
    copied over the clean files with their times kept (cp -p): never a cache hit of the clean build."""
    folder = _tiny(tmp_path)
    out = tmp_path / "dist"
    clean = run_pipeline(str(folder), "host-cpu", "q0f32", out=str(out), report=Reporter(quiet=True))
    broken = _nan_copy(folder, tmp_path / "copy" / folder.name)
    with pytest.raises(WeightsError, match="is not finite"):
        run_pipeline(str(broken.parent), "host-cpu", "q0f32", out=str(tmp_path / "dist2"),
                     report=Reporter(quiet=True))
    assert not (tmp_path / "dist2").exists() or not any((tmp_path / "dist2").iterdir())

    target = sorted(folder.glob("*.safetensors"))[0]
    shutil.copy2(broken, target)                       # cp -p: size and mtime as before
    with pytest.raises(WeightsError, match="is not finite"):
        run_pipeline(str(folder), "host-cpu", "q0f32", out=str(out), report=Reporter(quiet=True))
    assert clean.bundle.exists()                        # the previous good bundle is left as it was


def _damage(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_damaged_cache_entries_are_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("MLP_CACHE_DIR", str(tmp_path / "cache"))   # this test's entries alone
    folder = _tiny(tmp_path)
    first = run_pipeline(str(folder), "host-cpu", "q0f32", out=str(tmp_path / "a"), report=Reporter(quiet=True))
    shards = {p.name: p.read_bytes() for p in first.bundle.glob("params_shard_*.bin")}
    weights, = (cache_root() / "weights").glob(f"*/{next(iter(shards))}")
    manifest = json.loads((first.bundle / "manifest.json").read_text())
    lib_key = manifest["extra"]["library"]
    lib, = (cache_root() / "lib").glob(f"*/{Path(lib_key).name}")
    assert damaged_entry(weights.parent) is None and damaged_entry(lib.parent) is None
    _damage(weights)
    _damage(lib)

    report = _Lines()
    second = run_pipeline(str(folder), "host-cpu", "q0f32", out=str(tmp_path / "b"), report=report)
    damaged = [line for line in report.lines if "is damaged" in line]
    assert any(line.startswith("quantize: cache entry weights/") for line in damaged), report.lines
    assert any(line.startswith("build: cache entry lib/") for line in damaged), report.lines
    assert {p.name: p.read_bytes() for p in second.bundle.glob("params_shard_*.bin")} == shards
    assert damaged_entry(weights.parent) is None and damaged_entry(lib.parent) is None
    assert not (second.bundle / ENTRY_MANIFEST).exists()

    report = _Lines()   # intact now: both are cache hits
    run_pipeline(str(folder), "host-cpu", "q0f32", out=str(tmp_path / "c"), report=report)
    assert sum("cache hit" in line for line in report.lines) >= 2, report.lines
    assert not any("is damaged" in x for x in report.lines), report.lines


def test_config_only_folder_builds_library_alone(tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copyfile(_tiny(tmp_path) / "config.json", folder / "config.json")
    report = _Lines()
    result = run_pipeline(str(folder), "host-cpu", "q0f32", out=str(tmp_path / "dist"), report=report)
    assert not result.has_weights and (result.bundle / "NO_WEIGHTS.txt").exists()
    assert not (result.bundle / "tensor-cache.json").exists()
    assert sum("no weight files" in line for line in report.lines) == 1
