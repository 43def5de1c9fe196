"""An unchanged rebuild is a cache hit that touches nothing; a changed input rebuilds only what depends on it."""

from __future__ import annotations

import json

import torch

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
