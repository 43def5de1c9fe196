"""How fast can a decode step with this structure read its weights at all? A floor for the roofline goal.

The speed benchmark's roofline divides a decode's bytes per token by a bulk streaming read of 1 GB. A decode
step is not one read: it is ~30 layers x 4-5 weight tensors of 0.1-2 MB each, every one a separate parallel
kernel call (the thread pool wakes, the threads split the tensor, both join) with the activations'
dependency between them. This script times exactly that access pattern with nothing else in it: for a
built host-cpu bundle, every weight matrix of a decode step (codes + scales, in the library's parameter
order; an untied token embedding left out: a decode gathers one row of it) is read by one call per
module (its codes and scales together, as its GEMV reads them) of a kernel that only XORs its words into a
few vector registers (2 threads, each half of each tensor, the same TVM runtime thread pool the model uses). Its share of the bulk bandwidth is the most any decode
with one call per weight matrix could reach on this machine, before any arithmetic, attention or VM work.

    .venv/bin/python benchmarks/read_floor.py dist/smollm2-135m-q4f16-host-cpu [--reps 30]

Prints, interleaved in one process (the machine's bandwidth drifts within seconds): a bulk read of 256 MiB
by the same kernel, the read-only decode step (median) and the bundle's own decode step (median), each as
GB/s of the step's weight bytes and as a share of the best bulk read seen (that kernel's, or the speed
benchmark's C reader run before and after: the roofline).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BULK_BYTES = 256 << 20   # the bulk read every step is compared with
VEC = 16   # uint32 lanes XORed per step of the read loop (one 512-bit or two 256-bit registers)


def read_kernel(threads: int = 2):
    """PrimFunc (a [n] uint32, b [m] uint32, out [threads, VEC] uint32): thread t XORs words
    [t n / T, (t + 1) n / T) of a and the same share of b (in VEC-wide vectors; a tail shorter than
    threads * VEC words is left out) into out[t]. a and b: a weight matrix's codes and scales, read by one call
    like its GEMV; a lone tensor goes with an empty b."""
    from tvm.script import tirx as T

    @T.macro
    def xor_share(acc, a, per, t):
        for i in range(per):
            for j in T.vectorized(VEC):
                acc[j] = T.bitwise_xor(acc[j], a[(t * per + i) * VEC + j])

    @T.prim_func
    def read_xor(a_handle: T.handle, b_handle: T.handle, out: T.Buffer((threads, VEC), "uint32")):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        m = T.int64()
        a = T.match_buffer(a_handle, (n,), "uint32")
        b = T.match_buffer(b_handle, (m,), "uint32")
        for t in T.parallel(threads):
            acc = T.alloc_buffer((VEC,), "uint32", scope="local")
            for j in T.vectorized(VEC):
                acc[j] = T.uint32(0)
            xor_share(acc, a, n // (threads * VEC), t)
            xor_share(acc, b, m // (threads * VEC), t)
            for j in T.vectorized(VEC):
                out[t, j] = acc[j]

    return read_xor


def decode_weights(names: list[str]) -> list[str]:
    """The parameters a decode step reads in full: all of them but an untied token embedding (a decode
    gathers one row of it); a tied one is the lm_head and is read whole."""
    tied = not any("lm_head" in n for n in names)
    return [n for n in names if tied or "embed_tokens" not in n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import os

    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    import tvm

    from benchmarks.speed import measure_bandwidth
    from pipeline.config import load_target
    from pipeline.runtime.runner import Bundle

    engine = Bundle(args.bundle).engine()
    target = load_target("host-cpu").tvm()
    read = tvm.compile(tvm.IRModule({"main": read_kernel(args.threads).with_attr("global_symbol", "main")}),
                       target=target)["main"]
    names = [p["name"] for p in engine.meta["params"]]
    wanted = set(decode_weights(names))
    sizes = [int(np.prod(p.shape)) * np.dtype(str(p.dtype)).itemsize for p in engine.params]
    calls: dict[str, list] = {}      # one call per module: its codes and scales together, as its GEMV reads them
    for name, param, size in zip(names, engine.params, sizes, strict=True):
        if name in wanted and size % 4 == 0:
            calls.setdefault(name.rsplit(".", 1)[0], []).append(param._create_view((size // 4,), "uint32"))
    nothing = tvm.runtime.tensor(np.zeros(0, np.uint32))   # the second buffer of a lone tensor's call
    calls_list = [(views[0], views[1] if len(views) == 2 else nothing) for views in calls.values() if len(views) <= 2]
    step_bytes = sum(int(np.prod(v.shape)) * 4 for pair in calls_list for v in pair)
    out = tvm.runtime.tensor(np.zeros((args.threads, VEC), np.uint32))
    bulk = tvm.runtime.tensor(np.ones(BULK_BYTES // 4, np.uint32))
    ids = list(range(100, 228))
    engine.prefill(ids)
    c_reader = [measure_bandwidth(args.threads)["gbs"]]
    bulk_s, read_s, decode_s = [], [], []
    for _ in range(args.reps):          # interleaved: the machine's speed drifts within seconds
        t0 = time.perf_counter()
        read(bulk, nothing, out)
        bulk_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for codes, scales in calls_list:
            read(codes, scales, out)
        read_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.decode(5)
        decode_s.append(time.perf_counter() - t0)
    c_reader.append(measure_bandwidth(args.threads)["gbs"])
    kernel_gbs = BULK_BYTES / min(bulk_s) / 1e9
    best = max(kernel_gbs, *c_reader)    # the roofline: the best bulk read seen, by either reader
    step, decode = float(np.median(read_s)), float(np.median(decode_s))
    read_gbs, decode_gbs = step_bytes / step / 1e9, step_bytes / decode / 1e9
    print(f"{args.bundle.name}: {len(calls_list)} calls (a module's codes and scales together), "
          f"{step_bytes / 1e6:.1f} MB per decode step; {args.threads} threads")
    print(f"bulk read: {best:.1f} GB/s best (the speed benchmark's C reader before / after: "
          f"{c_reader[0]:.1f} / {c_reader[1]:.1f}; {BULK_BYTES >> 20} MiB by the same kernel, interleaved: best "
          f"{kernel_gbs:.1f}, median {BULK_BYTES / float(np.median(bulk_s)) / 1e9:.1f})")
    print(f"read-only decode step: median {step * 1e3:.2f} ms = {read_gbs:.1f} GB/s = {read_gbs / best:.0%} of the "
          f"best bulk read ({read_gbs * float(np.median(bulk_s)) * 1e9 / BULK_BYTES:.0%} of the interleaved bulk "
          "read's median)")
    print(f"the bundle's decode step: median {decode * 1e3:.2f} ms, its weights alone at {decode_gbs:.1f} GB/s = "
          f"{decode_gbs / best:.0%} of the best bulk read, {step / decode:.0%} of the read-only step's speed")


if __name__ == "__main__":
    main()
