"""Benchmark: one MoE layer's routed experts over a prefill chunk, gathered per token vs grouped by expert.

The gather kernels (models/moe_kernels.py) compute each token's k experts on their own, so a chunk of n tokens
reads n x k expert matrices; the grouped kernels (models/moe_grouped.py: counting sort, then one pass per
expert row over the tokens routed to it) read each used expert once per chunk. Both are compiled for this
host (LLVM, the host-cpu path) and timed on the same random chunk (router logits random: the tokens spread
over the experts like a trained router's roughly do); outputs are compared (the same fp32 dot order:
equal up to 1e-6). Each row: milliseconds per chunk (median of --repeat runs after one warm-up), the
speed-up, and the expert bytes each path reads.

    .venv/bin/python benchmarks/moe_prefill.py                      # the decode benchmark's synthetic shape
    .venv/bin/python benchmarks/moe_prefill.py --shape 35b --fmt q4 # one Qwen3.5-35B-A3B layer (256 x top-8)

Results: benchmarks/results/moe_prefill.json (one entry per shape / format / chunk, replaced when re-run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.models.moe_grouped import moe_grouped_down, moe_grouped_gate_up, moe_sort  # noqa: E402
from pipeline.models.moe_kernels import moe_down, moe_gate_up, moe_route  # noqa: E402
from pipeline.quant.quantize import quantize_q4, quantize_q8  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "moe_prefill.json"
# (experts, top_k, hidden, expert FFN): moe_decode.py's synthetic model, and one layer of the 35B
SHAPES = {"synthetic": (64, 2, 1024, 256), "35b": (256, 8, 2048, 512)}


def _compile(func):
    import tvm

    return tvm.compile(tvm.IRModule({"main": func}), target="llvm")["main"]


def _timed(fn, args, repeat: int) -> float:
    fn(*args)   # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(shape: str, fmt: str, chunk: int, repeat: int) -> dict:
    import tvm

    E, K, H, M = SHAPES[shape]
    rng = np.random.default_rng(0)
    dev = tvm.cpu()
    x = rng.standard_normal((chunk, H)).astype("float32")
    logits = rng.standard_normal((chunk, E)).astype("float32")
    gu = (rng.standard_normal((E, 2 * M, H)) * 0.05).astype("float32")
    dn = (rng.standard_normal((E, H, M)) * 0.05).astype("float32")
    if fmt == "float":
        gu_w, dn_w = [gu], [dn]
    else:
        quant = quantize_q4 if fmt == "q4" else quantize_q8
        gu_w = [np.stack(a) for a in zip(*(quant(m) for m in gu), strict=True)]
        dn_w = [np.stack(a) for a in zip(*(quant(m) for m in dn), strict=True)]
    del gu, dn

    def t(a):
        return tvm.runtime.tensor(a, dev)

    def zeros(shape, dtype):
        return tvm.runtime.tensor(np.zeros(shape, dtype), dev)

    idx, w = zeros((chunk, K), "int32"), zeros((chunk, K), "float32")
    _compile(moe_route(E, K, True))(t(logits), idx, w)
    gu_t, dn_t, x_t = [t(a) for a in gu_w], [t(a) for a in dn_w], t(x)

    gate_up, down = _compile(moe_gate_up(E, M, H, K, "float32", fmt)), _compile(moe_down(E, H, M, K, "float32", fmt))
    h_g, y_g = zeros((chunk, K, M), "float32"), zeros((chunk, H), "float32")

    def gathered():
        gate_up(x_t, idx, *gu_t, h_g)
        down(h_g, idx, w, *dn_t, y_g)

    sort = _compile(moe_sort(E, K))
    g_gate_up = _compile(moe_grouped_gate_up(E, M, H, K, "float32", fmt))
    g_down = _compile(moe_grouped_down(E, H, M, K, "float32", fmt))
    offsets, order = zeros((E + 1,), "int32"), zeros((chunk * K,), "int32")
    h_s, o_s = zeros((chunk, K, M), "float32"), zeros((chunk, K, H), "float32")

    def grouped():
        sort(idx, offsets, order)
        g_gate_up(x_t, offsets, order, *gu_t, h_s)
        g_down(h_s, offsets, order, *dn_t, o_s)

    t_gather = _timed(gathered, (), repeat)
    t_group = _timed(grouped, (), repeat)
    y_grouped = (o_s.numpy() * w.numpy()[..., None]).sum(1)
    err = float(np.abs(y_grouped - y_g.numpy()).max() / np.abs(y_g.numpy()).max())
    if err > 1e-5:
        sys.exit(f"error: grouped and gathered outputs differ ({err:.2e} of the output scale)")
    expert_bytes = sum(a.nbytes for a in gu_w + dn_w) // E
    used = len(np.unique(idx.numpy()))
    return {"shape": shape, "experts": E, "top_k": K, "hidden": H, "expert_ffn": M, "fmt": fmt, "chunk": chunk,
            "gathered_ms": t_gather * 1e3, "grouped_ms": t_group * 1e3, "speedup": t_gather / t_group,
            "experts_used": used, "expert_bytes_read_gathered": chunk * K * expert_bytes,
            "expert_bytes_read_grouped": used * expert_bytes, "max_rel_diff": err,
            "threads": os.environ.get("TVM_NUM_THREADS") or os.cpu_count(),
            "loadavg": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="synthetic")
    ap.add_argument("--fmt", choices=("float", "q4", "q8"), default="float")
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per call")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    r = run(args.shape, args.fmt, args.chunk, args.repeat)
    print(f"{r['shape']} ({r['experts']} experts top-{r['top_k']}, hidden {r['hidden']}, FFN {r['expert_ffn']}, "
          f"{r['fmt']}), chunk {r['chunk']}: gathered {r['gathered_ms']:.1f} ms, grouped {r['grouped_ms']:.1f} ms "
          f"({r['speedup']:.2f}x); expert bytes read {r['expert_bytes_read_gathered'] / 1e6:.0f} MB vs "
          f"{r['expert_bytes_read_grouped'] / 1e6:.0f} MB ({r['experts_used']} experts used); load average "
          f"{r['loadavg']:.1f}")
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    keep = [o for o in old if (o["shape"], o["fmt"], o["chunk"]) != (r["shape"], r["fmt"], r["chunk"])]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(keep + [r], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
