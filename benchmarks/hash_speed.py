"""How long does the weights' content key take? Hashes a synthetic bf16 safetensors checkpoint.

A checkpoint's cache key is its full content: `Checkpoint.fingerprint()` streams every byte of every weight
file through sha256 and, in the same pass, checks each float tensor for NaN / inf
(pipeline/frontend/checkpoint_base.py). The result is remembered per file identity (pipeline/cache.py), so
only the first build of a checkpoint (or of a changed file) pays for it. This script writes a few GB of
bf16 shards, then times the first fingerprint with one worker and with the default worker count, and the
remembered one, and extrapolates the first to a 54 GB checkpoint.

    .venv/bin/python benchmarks/hash_speed.py [--gb 2] [--shards 4] [--dir /fast/disk]

The shards were just written, so they are read from the page cache: the figure is the CPU's rate; a cold
read cannot beat the disk's own speed. Results: benchmarks/results/hash_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.cache import RACY_S  # noqa: E402  (after the path insert)
from pipeline.frontend import checkpoint_base  # noqa: E402
from pipeline.frontend.checkpoint import open_checkpoint  # noqa: E402

FULL_CHECKPOINT_GB = 54.0      # the largest checkpoint the project builds (Qwen3-32B-class, bf16)
TENSOR_MB = 64                 # bytes per synthetic tensor


def write_shards(folder: Path, total_bytes: int, shards: int) -> None:
    """bf16 shards of finite values (the exponent's top bit cleared) plus a config.json."""
    rng = np.random.default_rng(0)
    block = (rng.integers(0, 2**16, TENSOR_MB * 2**19, dtype=np.uint16) & 0xBFFF).tobytes()
    per_shard = max(1, total_bytes // shards // len(block))
    for s in range(shards):
        header = {f"model.layers.{s}.t{i}.weight": {"dtype": "BF16", "shape": [len(block) // 2 // 1024, 1024],
                                                    "data_offsets": [i * len(block), (i + 1) * len(block)]}
                  for i in range(per_shard)}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(folder / f"model-{s:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for _ in range(per_shard):
                f.write(block)
    (folder / "config.json").write_text("{}")


def timed_fingerprint(folder: Path, cache: Path) -> float:
    os.environ["MLP_CACHE_DIR"] = str(cache)
    t0 = time.perf_counter()
    open_checkpoint(folder).fingerprint()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="synthetic checkpoint size in GB (default 2)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=None, help="where to write it (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hash_speed.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        write_shards(folder, int(args.gb * 1e9), args.shards)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        time.sleep(RACY_S)   # files this fresh are not remembered (their next write could keep the same ctime)
        results = {"bytes": size, "shards": args.shards, "cpus": os.cpu_count()}
        for workers in sorted({1, min(checkpoint_base.FINGERPRINT_WORKERS, os.cpu_count() or 1)}):
            checkpoint_base.FINGERPRINT_WORKERS = workers
            seconds = timed_fingerprint(folder, Path(tmp) / f"cache-{workers}")
            results[f"first_{workers}_workers"] = {"seconds": round(seconds, 3), "GB/s": round(size / seconds / 1e9, 2),
                                                   "54GB_seconds": round(FULL_CHECKPOINT_GB * 1e9 / (size / seconds), 1)}
            print(f"first fingerprint, {workers} worker(s): {size / 1e9:.2f} GB in {seconds:.2f} s = "
                  f"{size / seconds / 1e9:.2f} GB/s -> {FULL_CHECKPOINT_GB:.0f} GB in "
                  f"{FULL_CHECKPOINT_GB * seconds * 1e9 / size:.0f} s", flush=True)
        remembered = timed_fingerprint(folder, Path(tmp) / f"cache-{workers}")
        results["remembered_seconds"] = round(remembered, 4)
        print(f"remembered (unchanged files): {remembered * 1e3:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
