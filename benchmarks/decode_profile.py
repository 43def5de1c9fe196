"""Where a host-cpu bundle's decode step spends its time, from `perf` samples: the roofline goal's "why not".

The speed benchmark gives one number per bundle (decode tok/s x bytes per token / bulk bandwidth); this
script splits the step: each kernel's share of the wall time and the GB/s it streams its bytes at (the
coverage report's bytes per call), and per thread the time in kernels, waiting at the thread pool's
joins (kernel-mode samples: TVM's pool spins with sched_yield), in TVM's VM / FFI and in Python. A kernel
streaming near the bulk bandwidth while the step as a whole does not says the loss is between kernels.

    .venv/bin/python benchmarks/decode_profile.py dist/smollm2-135m-q4f16-host-cpu [--ctx 128] [--seconds 8]

Needs Linux `perf` allowed to sample this user's processes (perf_event_paranoid <= 2). The child decodes
greedily after a `--ctx`-token prompt, up to 128 tokens, then starts over; perf samples only the decode
calls (the prompt's prefill runs with sampling off, through perf's control fifo). Sampling slows the step
a little: the figures are shares, and the bytes' GB/s are relative to the same run's step time.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DECODE_RUN = 128          # decode tokens per prompt before the child starts over
SAMPLE_HZ = 4999

# perf's dso names -> the part of the process they stand for (first match wins)
PARTS = (("[kernel", "kernel mode (pool waits)"), ("libtvm_runtime", "TVM VM / runtime"),
         ("libtvm_ffi", "TVM VM / runtime"), ("libpython", "Python"), ("_multiarray", "Python"),
         ("core.cpython", "Python"), ("libc.so", "libc"), ("libm.so", "libc"))
# a thread's parts in report order: the model library's kernels, the PARTS, anything else
THREAD_PARTS = ("kernels", *dict.fromkeys(part for _, part in PARTS), "other")


def child(bundle: str, ctx: int, seconds: float, ctl: str, ack: str) -> None:
    """Runs under perf: decode with sampling on, prefill with it off; prints the decode's ms per token."""
    from pipeline.runtime.lean import enter_runtime_process

    enter_runtime_process()
    import numpy as np

    from benchmarks.speed import prompt_ids
    from pipeline.runtime.runner import Bundle

    loaded = Bundle(bundle)
    engine = loaded.engine()
    ids = prompt_ids(ctx, int(loaded.config["vocab_size"]), seed=0)
    with open(ctl, "w") as control, open(ack) as acked:
        def perf_says(cmd: str) -> None:
            control.write(cmd + "\n")
            control.flush()
            acked.readline()

        decoded, spent, begun = 0, 0.0, time.perf_counter()
        while time.perf_counter() - begun < seconds:
            engine.reset()
            token = int(np.argmax(engine.prefill(ids)))
            perf_says("enable")
            t0 = time.perf_counter()
            for _ in range(DECODE_RUN):
                token = engine.decode_greedy(token)     # what the speed benchmark times
            spent += time.perf_counter() - t0
            perf_says("disable")
            decoded += DECODE_RUN
    print(json.dumps({"pid": os.getpid(), "ms_per_token": spent / decoded * 1e3, "tokens": decoded}))


def library_symbols(lib: Path) -> tuple[list[int], list[str]]:
    """(addresses, names) of the library's functions, sorted: perf leaves the local ones as addresses."""
    out = subprocess.run(["nm", "-n", str(lib)], capture_output=True, text=True, check=True).stdout
    rows = [(int(a, 16), n) for a, kind, n in (line.split() for line in out.splitlines() if len(line.split()) == 3)
            if kind in "tT"]
    return [a for a, _ in rows], [n for _, n in rows]


def kernel_name(symbol: str) -> str:
    """A compiled function's symbol -> the coverage report's kernel name."""
    return re.sub(r"^__tvm_ffi_", "", re.sub(r"_compute_$", "", symbol))


def parse_perf_report(text: str) -> list[tuple[float, str, str]]:
    """(percent, thread id, the rest) per sample line of `perf report --sort pid,...` text."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\d+):\S+\s+(.*\S)", line)
        if m:
            rows.append((float(m[1]), m[2], m[3]))
    return rows


def perf_rows(data: Path, sort: str) -> list[tuple[float, str, str]]:
    text = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", f"pid,{sort}", "--stdio",
                           "-g", "none"], capture_output=True, text=True, check=True).stdout
    return parse_perf_report(text)


def analyse(by_symbol: list[tuple[float, str, str]], symbols: tuple[list[int], list[str]], coverage: dict,
            lib_name: str, main_tid: str, ms_per_token: float) -> dict:
    """Shares of the step per thread part and per kernel, from `perf report` rows by (thread, dso, symbol);
    `symbols`: the library's (sorted addresses, names) for perf's bare addresses."""
    step_bytes = {k["name"]: k["decode_step"]["bytes"] for k in coverage["kernels"] if k["decode_step"]["calls"]}
    calls = {k["name"]: k["decode_step"]["calls"] for k in coverage["kernels"] if k["decode_step"]["calls"]}
    per_call = {k["name"]: k["decode_step"].get("bytes_per_call") for k in coverage["kernels"]}
    for name, region in (coverage.get("cpu_regions") or {}).get("regions", {}).items():
        # a merged region (pipeline/kernels/cpu/regions.py) reads its kernels' bytes; the child decodes greedily
        n = region["calls"].get("decode_greedy", 0)
        members = [per_call.get(k) for k in region["kernels"]]
        calls[name] = n
        step_bytes[name] = n * sum(members) if n and all(m is not None for m in members) else None
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    addrs, names = symbols
    per_kernel: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for pct, tid, rest in by_symbol:
        dso = rest.split()[0]
        threads[tid]["kernels" if dso == lib_name else next((p for key, p in PARTS if key in dso), "other")] += pct
        m = re.match(r"(\S+)\s+\[\.\]\s+(\S+)", rest)
        if not m or m[1] != lib_name:
            continue
        token = m[2]
        if token.startswith("0x"):
            at = bisect.bisect_right(addrs, int(token, 16)) - 1
            if at < 0:
                continue
            token = names[at]
        per_kernel[kernel_name(token)][tid] += pct
    if main_tid not in threads:
        raise ValueError(f"no samples of the main thread {main_tid}")
    wall_pct = sum(threads[main_tid].values())   # the main thread runs (or spins) the whole step: the wall
    kernels = []
    for name, by_tid in per_kernel.items():
        share = max(by_tid.values()) / wall_pct
        ms = share * ms_per_token
        nbytes = step_bytes.get(name)
        kernels.append({"kernel": name, "share_of_step": share, "ms_per_token": ms, "calls_per_token": calls.get(name),
                        "bytes_per_token": nbytes,
                        "gb_s": nbytes / (ms * 1e-3) / 1e9 if nbytes and ms > 0 else None})
    kernels.sort(key=lambda k: -k["share_of_step"])
    parts = {("main" if tid == main_tid else f"thread {tid}"): {p: v / sum(c.values()) for p, v in c.items()}
             for tid, c in threads.items() if sum(c.values()) > 0.02 * wall_pct}
    return {"ms_per_token": ms_per_token, "threads": parts, "kernels": kernels,
            "bytes_per_token": coverage["summary"]["decode_step"]["total"]["bytes"]}


def report(res: dict, bandwidth_gbs: float | None) -> str:
    lines = [f"decode step {res['ms_per_token']:.3f} ms under perf; bytes per token "
             f"{res['bytes_per_token'] / 1e6:.1f} MB -> {res['bytes_per_token'] / res['ms_per_token'] / 1e6:.1f} GB/s"
             + (f" ({res['bytes_per_token'] / res['ms_per_token'] / 1e6 / bandwidth_gbs:.0%} of {bandwidth_gbs:.1f})"
                if bandwidth_gbs else ""), "", "| thread | " + " | ".join(THREAD_PARTS) + " |",
             "|---|" + "---:|" * len(THREAD_PARTS)]
    for tid, parts in res["threads"].items():
        lines.append(f"| {tid} | " + " | ".join(f"{parts.get(p, 0):.0%}" for p in THREAD_PARTS) + " |")
    lines += ["", "| kernel | share of step | us per call | calls / token | MB / token | GB/s |",
              "|---|---:|---:|---:|---:|---:|"]
    kern_total = 0.0
    for k in res["kernels"]:
        if k["share_of_step"] < 0.002:
            continue
        kern_total += k["share_of_step"]
        per_call = k["ms_per_token"] * 1e3 / k["calls_per_token"] if k["calls_per_token"] else None
        lines.append(f"| {k['kernel']} | {k['share_of_step']:.1%} | "
                     + (f"{per_call:.1f}" if per_call else "—") + f" | {k['calls_per_token'] or '—'} | "
                     + (f"{k['bytes_per_token'] / 1e6:.2f}" if k["bytes_per_token"] else "—") + " | "
                     + (f"{k['gb_s']:.1f}" if k["gb_s"] else "—") + " |")
    lines.append(f"| (all kernels, the slower thread's time) | {kern_total:.1%} | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--ctx", type=int, default=128, help="prompt tokens before each decode run")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long to keep decoding")
    ap.add_argument("--bandwidth", type=float, help="GB/s to compare the step with (e.g. the speed run's best read)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ctl", help=argparse.SUPPRESS)
    ap.add_argument("--ack", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(str(args.bundle), args.ctx, args.seconds, args.ctl, args.ack)
        return 0
    if shutil.which("perf") is None or shutil.which("nm") is None:
        print("error: decode_profile needs Linux `perf` and `nm` (Debian: apt-get install linux-perf binutils)",
              file=sys.stderr)
        return 2
    if not (args.bundle / "reports" / "coverage.json").exists():
        print(f"error: {args.bundle}: not a built bundle (no reports/coverage.json); build one with "
              "`python -m pipeline build --target host-cpu`", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        ctl, ack, data = Path(tmp, "ctl"), Path(tmp, "ack"), Path(tmp, "perf.data")
        os.mkfifo(ctl)
        os.mkfifo(ack)
        env = dict(os.environ, TVM_NUM_THREADS=os.environ.get("TVM_NUM_THREADS", "2"), PYTHONPATH=str(ROOT))
        proc = subprocess.run(["perf", "record", "-D", "-1", "--control", f"fifo:{ctl},{ack}", "-F", str(SAMPLE_HZ),
                               "-o", str(data), "--", sys.executable, __file__, str(args.bundle), "--child",
                               "--ctx", str(args.ctx), "--seconds", str(args.seconds), "--ctl", str(ctl),
                               "--ack", str(ack)], capture_output=True, text=True, env=env)
        result = next((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), None)
        if proc.returncode != 0 or result is None:
            print(f"error: perf record failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}\n"
                  "fix: allow sampling (sysctl kernel.perf_event_paranoid=2) or run where perf works",
                  file=sys.stderr)
            return 2
        lib = args.bundle / json.loads((args.bundle / "mlc-chat-config.json").read_text())["model_lib"]
        coverage = json.loads((args.bundle / "reports" / "coverage.json").read_text())
        res = analyse(perf_rows(data, "dso,sym"), library_symbols(lib), coverage, lib.name, str(result["pid"]),
                      result["ms_per_token"])
    res.update(bundle=str(args.bundle), ctx=args.ctx, tokens=result["tokens"])
    print(report(res, args.bandwidth))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
