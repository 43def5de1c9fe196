"""Our android-cpu bundle counted as a whole program under qemu-aarch64, the way llama-bench is counted.

The bundle's objects linked with the cross-built TVM runtime and clients/aarch64_vm/decode_driver.cc (what an
app does) run a real decode: runtime start, weights loaded through the tensor cache, the Relax VM, the paged
KV cache, every kernel, the thread pool. Three runs per thread count, each under the counting plugin:

    A = prompt of 128 tokens, 2 greedy steps      B = the same prompt, 10 steps      C = a 1-token prompt, 0 steps

The driver runs in its benchmark mode (no logits read back, no argmax: llama-bench samples nothing either).
decode per token (at 128-138 cached tokens) = (B - A) / 8; prefill per token = (A - 2 x decode - C) / 127, i.e.
a 128-token prompt minus a 1-token one, as llama.cpp's (-p 128) - (-p 1). The counted range is the library's
code (all its kernels; the rest is the runtime and libc). The decode GEMVs cannot be told apart by symbol
here: the CPU regions (pipeline/kernels/cpu/regions.py) merge each layer's GEMVs, norms and activations into
one kernel, so the GEMV columns come from the standalone kernels (benchmarks/phone_cpu_ours.py). Multi-thread runs set
TVM_THREAD_POOL_SPIN_COUNT=0 (workers sleep instead of spinning between kernels: llama.cpp's --poll 0), so
the counts are work, not waiting.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from benchmarks import qemu_counter as qc

PROMPT = 128
DECODE_RUNS = (2, 10)


def prompt_ids(n: int = PROMPT) -> list[int]:
    """n token ids of ordinary text-range tokens (a step's cost does not depend on which)."""
    return [100 + (i * 7919) % 30000 for i in range(n)]


def library_span(exe: Path, bundle: Path) -> tuple[int, int]:
    """The address range of the bundle's own code (its kernels, in one contiguous stretch) inside exe."""
    prefix = json.loads((bundle / "mlc-chat-config.json").read_text())["system_lib_prefix"]
    lib = [r for name, r in extended_ranges(exe).items() if prefix in name]
    if not lib:
        raise qc.CounterError(f"no symbol of {bundle.name} (prefix {prefix}) found in {exe}")
    return min(lo for lo, _ in lib), max(hi for _, hi in lib)


def extended_ranges(exe: Path) -> dict[str, tuple[int, int]]:
    """Each function symbol's range extended to the next symbol: LLVM leaves parts of a kernel (its parallel
    loop bodies' helpers) as unnamed local code right after it, which `nm -S` sizes leave out."""
    syms = sorted(qc.symbol_ranges(exe, prefix="").items(), key=lambda kv: kv[1][0])
    starts = [lo for _, (lo, _) in syms]
    out = {}
    for i, (name, (lo, hi)) in enumerate(syms):
        nxt = next((s for s in starts[i + 1:] if s > lo), hi)
        out[name] = (lo, max(hi, nxt))
    return out


def _run(exe: Path, bundle: Path, ids: list[int], steps: int, threads: int, ranges, tmp: Path) -> qc.Counts:
    from clients.aarch64_vm.run import system_lib_prefix

    (tmp / "ids.txt").write_text(" ".join(map(str, ids)) + "\n")
    env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
    if threads > 1:
        env["TVM_THREAD_POOL_SPIN_COUNT"] = "0"
    # logits "-": no read-back or argmax (llama-bench samples nothing either); each step fed the prompt's last id
    argv = [exe, system_lib_prefix(bundle), bundle, tmp / "ids.txt", steps, "-", tmp / "ids_out.txt"]
    counts, _ = qc.run(argv, ranges, env=env)
    return counts


def _combine(parts: list[tuple[float, qc.Counts]]) -> dict[str, dict[str, float]]:
    """sum of weight x counts, per count key, for the totals and the range."""
    return {side: {k: sum(w * getattr(c, side)[k] for w, c in parts) for k in qc.COUNT_KEYS}
            for side in ("total", "range")}


def per_token(a: qc.Counts, b: qc.Counts, c: qc.Counts) -> tuple[dict, dict]:
    """(decode, prefill) per token from the runs A, B, C of the module docstring."""
    n, m = DECODE_RUNS[1] - DECODE_RUNS[0], PROMPT - 1
    decode = _combine([(1 / n, b), (-1 / n, a)])
    prefill = _combine([(1 / m, a), (-1 / m, c), (DECODE_RUNS[0] / n / m, a), (-DECODE_RUNS[0] / n / m, b)])
    return decode, prefill


def measure(bundle: Path, threads_list: list[int], log=print) -> dict:
    """Per thread count: decode and prefill per token, whole program ("total") and GEMV kernels ("range")."""
    from clients.aarch64_vm import build

    exe = build.driver(bundle)
    ranges = [library_span(exe, bundle)]
    out = {}
    with tempfile.TemporaryDirectory(prefix="phone-cpu-whole-") as tmp:
        for threads in threads_list:
            a = _run(exe, bundle, prompt_ids(), DECODE_RUNS[0], threads, ranges, Path(tmp))
            b = _run(exe, bundle, prompt_ids(), DECODE_RUNS[1], threads, ranges, Path(tmp))
            c = _run(exe, bundle, prompt_ids(1), 0, threads, ranges, Path(tmp))
            decode, prefill = per_token(a, b, c)
            out[str(threads)] = {"decode": decode, "prefill": prefill}
            log(f"  ours {bundle.name} t{threads}: decode {decode['total']['insns'] / 1e6:.1f} M instr/token "
                f"(kernels {decode['range']['insns'] / 1e6:.1f} M), prefill {prefill['total']['insns'] / 1e6:.1f} M "
                f"instr/token")
    return out
