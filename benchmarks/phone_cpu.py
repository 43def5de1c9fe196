"""Phone-CPU cost without a phone: instructions, vector share and bytes per token, ours vs llama.cpp, under qemu.

Both sides run as aarch64 code under qemu-aarch64 with the project's counting plugin (benchmarks/qemu_counter.py):

* llama.cpp: `llama-bench` cross-built from the llama-cpp-python sdist (benchmarks/llamacpp_aarch64.py) on
  SmolLM2-135M Q4_0 / Q8_0 / TQ2_0 (made from the registry GGUF like benchmarks/speed.py does, by the aarch64
  llama-quantize under qemu). Per decoded token at 128 cached tokens: (run with -d 128 -n 10) - (-d 128 -n 2),
  divided by 8. Per prefill token: ((-p 128) - (-p 1)) / 127. Whole program (all threads, the pool's waiting too).
* ours: the android-cpu bundle (q4f16 / q8f16 / ternary_ptq) linked with the cross-built TVM runtime as an app
  links it, a whole program too, differenced the same way (benchmarks/phone_cpu_whole.py); `--kernels` adds the
  1-thread step kernel by kernel (benchmarks/phone_cpu_ours.py: where the instructions go).

1 and 4 threads; the goals of issue #37 judged per row; a phone PREDICTION from a stated core model.
Results: benchmarks/results/phone_cpu-<class>.json and .md.

    .venv/bin/python benchmarks/phone_cpu.py [--cls dotprod] [--threads 1,4] [--schemes q4f16,q8f16,ternary_ptq]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: import the checkout's pipeline/ and benchmarks/
    sys.path.insert(0, str(ROOT))


import numpy as np  # noqa: E402

from benchmarks import qemu_counter as qc  # noqa: E402

PAIRS = {"q4f16": "Q4_0", "q8f16": "Q8_0", "ternary_ptq": "TQ2_0"}
CONTEXT = 128                 # cached tokens at the measured decode step
DECODE_RUNS = (2, 10)         # llama-bench -n: the difference is 8 decoded tokens
PROMPT = 128
GEMV_SYMBOLS = re.compile(r"^(ggml_vec_dot_|ggml_gemv_|ggml_gemm_)")   # llama.cpp's GEMV / GEMM kernels
# PREDICTION model (stated, not measured): a 2024 flagship phone's big cores and its LPDDR5X.
PHONE = {"name": "Cortex-X4 + Cortex-A720 class (e.g. Dimensity 9300: 1x X4 3.25 GHz, 3x X4 2.85 GHz, "
                 "4x A720 2.0 GHz)",
         "cores_1t": [3.25e9], "cores_4t": [3.25e9, 2.85e9, 2.85e9, 2.85e9], "ipc": 3.0,
         "bandwidth_bytes_s": 76.8e9,
         "model": "time per token = max(instructions / (IPC x sum of the used cores' clocks), (weights + KV bytes) / "
                  "bandwidth); IPC 3.0 for both sides' code (an assumption: a wide core on a well-fed inner loop); "
                  "4 threads on the four X4 cores, the 1-thread instruction count split evenly (no waiting)"}


def llama_counts(bench: Path, gguf: Path, threads: int, args: list[str], extra: tuple[str, ...] = ()) -> qc.Counts:
    """One llama-bench run under the plugin (GEMV / GEMM symbols as the range)."""
    ranges = list(qc.symbol_ranges(bench, prefix="ggml_").items())
    gemv = [r for name, r in ranges if GEMV_SYMBOLS.match(name) and r[1] > r[0]][:256]
    argv = [bench, "-m", gguf, "-t", str(threads), "-r", "1", "--no-warmup", "-o", "json", *extra, *args]
    counts, _ = qc.run(argv, gemv)
    return counts


def measure_llamacpp(bench: Path, gguf: Path, threads: int, log=print, extra: tuple[str, ...] = ()) -> dict:
    """Per decoded token (run difference at CONTEXT cached tokens) and per prefill token; `extra`: more
    llama-bench options (e.g. --poll 0)."""
    def counts(*args: str) -> qc.Counts:
        return llama_counts(bench, gguf, threads, list(args), extra)

    short = counts("-p", "0", "-n", str(DECODE_RUNS[0]), "-d", str(CONTEXT))
    long = counts("-p", "0", "-n", str(DECODE_RUNS[1]), "-d", str(CONTEXT))
    one = counts("-p", "1", "-n", "0")
    full = counts("-p", str(PROMPT), "-n", "0")
    decode = long.minus(short).scaled(1 / (DECODE_RUNS[1] - DECODE_RUNS[0]))
    prefill = full.minus(one).scaled(1 / (PROMPT - 1))
    log(f"  llama.cpp {gguf.stem} t{threads} {' '.join(extra)}: decode {decode['total']['insns'] / 1e6:.1f} M "
        f"instr/token, prefill {prefill['total']['insns'] / 1e6:.1f} M instr/token")
    return {"decode": decode, "prefill": prefill, "options": list(extra)}


def ggufs(build, work: Path) -> dict[str, Path]:
    """Q4_0 / Q8_0 / TQ2_0 of the registry model's GGUF, as benchmarks/speed.py makes them (aarch64 quantizer)."""
    from benchmarks.speed import llamacpp_ggufs
    from pipeline.config import load_model

    return llamacpp_ggufs(build, load_model("smollm2-135m").weights, list(PAIRS.values()), work)


def measure_ours(quant: str, threads_list: list[int], work: Path, log=print, kernels: bool = False,
                 cls: str = "dotprod") -> dict:
    """Whole program per thread count (benchmarks/phone_cpu_whole.py); with `kernels`, also the 1-thread step
    kernel by kernel in the harness (benchmarks/phone_cpu_ours.py: where the instructions go). Our library is
    built for CPU class `cls`, as llama.cpp is (the i8mm class: the smmla prefill, kernels/cpu/arm_mmla.py)."""
    from benchmarks import phone_cpu_ours as ours
    from benchmarks import phone_cpu_whole as whole

    bundle = ours.build_bundle(quant, work / ("dist" if ours.class_phone(cls) is None else f"dist-{cls}"), cls)
    weights = sum(r["nbytes"] for r in json.loads((bundle / "tensor-cache.json").read_text())["records"])
    mod = ours.final_module(quant, cls)     # what the library was compiled from (minutes: computed once)
    out = {"weights_bytes": weights, "threads": whole.measure(bundle, threads_list, log),
           "gemv": standalone_gemvs(quant, mod, bundle, log)}
    if kernels:
        out["kernels"] = kernel_breakdown(quant, mod, bundle, threads_list[0], log)
    return out


def standalone_gemvs(quant: str, mod, bundle: Path, log=print) -> dict:
    """The decode GEMV kernels run one by one in the harness (1 thread), times their calls per decode step:
    inside the whole program they are merged into the CPU regions with the norms and activations."""
    from benchmarks import phone_cpu_ours as ours

    coverage = json.loads((bundle / "reports" / "coverage.json").read_text())
    calls_of = {k["name"]: k["decode_step"]["calls"] for k in coverage["kernels"]}
    rng = np.random.default_rng(0)
    calls = [ours.Call(k["name"], ours.random_args(mod[k["name"]], 1, rng), calls_of[k["name"]], "decode GEMV")
             for k in coverage["kernels"] if k["op_class"].startswith("dequant-gemv") and calls_of[k["name"]]]
    with tempfile.TemporaryDirectory(prefix="phone-cpu-") as tmp:
        exe, prefix, ranges = ours.link_harness(bundle, 1, Path(tmp))
        log(f"  ours {quant}: standalone GEMV kernels (vector share)")
        return ours.measure_step(exe, prefix, ranges, calls, log)


def kernel_breakdown(quant: str, mod, bundle: Path, threads: int, log=print) -> dict:
    from benchmarks import phone_cpu_ours as ours
    from pipeline.config import load_model
    from pipeline.stages import load

    decoder = load(load_model(ours.MODEL)).decoder
    with tempfile.TemporaryDirectory(prefix="phone-cpu-") as tmp:
        exe, prefix, ranges = ours.link_harness(bundle, threads, Path(tmp))
        log(f"  ours {quant} t{threads}: decode step kernel by kernel")
        decode = ours.measure_step(exe, prefix, ranges, ours.step_calls(mod, decoder, "decode", 1, CONTEXT), log)
        log(f"  ours {quant} t{threads}: prefill {PROMPT} kernel by kernel")
        prefill = ours.measure_step(exe, prefix, ranges, ours.step_calls(mod, decoder, "prefill", PROMPT, 0), log)
    return {"threads": threads, "decode": decode, "prefill": prefill}


def kv_bytes(decoder, context: int = CONTEXT) -> int:
    """fp16 K and V of every layer for context + 1 positions (the step's own token included)."""
    return decoder.num_hidden_layers * 2 * decoder.num_key_value_heads * decoder.head_dim * 2 * (context + 1)


def predict(insns: float, dram_bytes: float, threads: int) -> dict:
    """PREDICTION: tokens/s on the stated phone model (not a measurement)."""
    clocks = sum(PHONE["cores_1t" if threads == 1 else "cores_4t"])
    compute = insns / (PHONE["ipc"] * clocks)
    memory = dram_bytes / PHONE["bandwidth_bytes_s"]
    return {"tok_s": 1 / max(compute, memory), "bound": "compute" if compute >= memory else "memory",
            "compute_s": compute, "memory_s": memory}


def goals(rows: dict, threads_list: list[int]) -> list[dict]:
    """Issue #37's goals, each pass / fail from the rows."""
    out = []
    t1 = str(threads_list[0])
    for quant, theirs in PAIRS.items():
        if quant not in rows["ours"] or theirs not in rows["llamacpp"]:
            continue
        o, t = rows["ours"][quant]["threads"][t1], rows["llamacpp"][theirs][t1]
        ratio = o["decode"]["total"]["insns"] / t["decode"]["total"]["insns"]
        out.append({"goal": f"decode instr/token {quant} <= 1.0x llama.cpp {theirs} ({t1} thread)",
                    "value": ratio, "limit": 1.0, "pass": ratio <= 1.0})
        if quant == "q4f16":
            ratio = o["prefill"]["total"]["insns"] / t["prefill"]["total"]["insns"]
            out.append({"goal": f"prefill-{PROMPT} instr/token q4f16 <= 1.0x llama.cpp Q4_0", "value": ratio,
                        "limit": 1.0, "pass": ratio <= 1.0})
    for quant, data in rows["ours"].items():
        o = data["threads"][t1]
        floor = data["weights_bytes"] + rows["kv_bytes"]
        ratio = o["decode"]["total"]["load_bytes"] / floor
        out.append({"goal": f"bytes loaded per decoded token {quant} <= 1.1x weights + KV", "value": ratio,
                    "limit": 1.1, "pass": ratio <= 1.1})
        gemv = data["gemv"]["total"]
        share = gemv["vector_insns"] / max(gemv["insns"], 1)
        out.append({"goal": f">= 80% vector instructions inside the GEMV kernels {quant}", "value": share,
                    "limit": 0.8, "pass": share >= 0.8})
        if "4" in data["threads"] and "1" in data["threads"]:
            ratio = data["threads"]["4"]["decode"]["total"]["insns"] / data["threads"]["1"]["decode"]["total"]["insns"]
            out.append({"goal": f"4-thread decode instructions {quant} <= 1.15x 1-thread (whole program; "
                                "TVM_THREAD_POOL_SPIN_COUNT=0: workers sleep between kernels)", "value": ratio,
                        "limit": 1.15, "pass": ratio <= 1.15})
    return out


def _m(x: float) -> str:
    return f"{x / 1e6:.1f}"


def table(result: dict) -> str:
    """The results as markdown: counts per token side by side, the goals, the PREDICTION."""
    lines = [f"# Phone-CPU cost under qemu-aarch64 ({result['class']}: -march={result['march']})", "",
             f"{result['date']}, commit {result['commit']}. Counts per token (M = 10^6); decode at {CONTEXT} cached "
             f"tokens, prefill of a {PROMPT}-token prompt. `vec` = instructions naming a SIMD vector register. "
             "Both sides: whole program, all threads (ours: the bundle's objects linked with the TVM runtime as an "
             "app links them, run by clients/aarch64_vm/decode_driver.cc: VM, KV cache, thread pool included; "
             f"multi-thread runs with TVM_THREAD_POOL_SPIN_COUNT=0). Ours is built for the same CPU class "
             f"({result['class']}, configs/cpu_classes.yaml).", "",
             "GEMV: the decode instructions inside the GEMV / GEMM kernels (llama.cpp: ggml_vec_dot_* / ggml_gemv_* / "
             "ggml_gemm_* symbols; ours: the decode GEMV kernels run standalone x their calls: in the program they "
             "are merged with each layer's norms and activations into CPU regions).", "",
             "| side | scheme | threads | decode M instr | vec | decode MB loaded | GEMV M instr | GEMV vec "
             "| prefill M instr/token | vec |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for side, qtype, t, r in _llama_rows(result):
        d, p, g = r["decode"]["total"], r["prefill"]["total"], r["decode"]["range"]
        lines.append(f"| {side} | {qtype} | {t} | {_m(d['insns'])} | {d['vector_insns'] / d['insns']:.0%} | "
                     f"{d['load_bytes'] / 1e6:.1f} | {_m(g['insns'])} | {g['vector_insns'] / max(g['insns'], 1):.0%} | "
                     f"{_m(p['insns'])} | {p['vector_insns'] / p['insns']:.0%} |")
    for quant, data in result["ours"].items():
        for t, r in data["threads"].items():
            d, p, g = r["decode"]["total"], r["prefill"]["total"], data["gemv"]["total"]
            lines.append(f"| ours | {quant} | {t} | {_m(d['insns'])} | {d['vector_insns'] / d['insns']:.0%} | "
                         f"{d['load_bytes'] / 1e6:.1f} | {_m(g['insns'])} | "
                         f"{g['vector_insns'] / max(g['insns'], 1):.0%} | {_m(p['insns'])} | "
                         f"{p['vector_insns'] / p['insns']:.0%} |")
    if result.get("added"):
        lines += ["", "Rows added to this run later (both sides measured together): " + "; ".join(
            f"{a['scheme']} (commit {a['commit']}, {a['date']})" for a in result["added"])]
    if result.get("notes"):
        lines += ["", f"Note: {result['notes']}"]
    lines += ["", "| goal | value | limit | |", "|---|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['goal']} | {g['value']:.3g} | {g['limit']} | {'PASS' if g['pass'] else 'FAIL'} |")
    lines += ["", f"PREDICTION (a model, not a measurement): {PHONE['name']}; {PHONE['model']}; "
              f"{PHONE['bandwidth_bytes_s'] / 1e9:.1f} GB/s.", "",
              "| side | scheme | threads | decode tok/s | bound | prefill tok/s |", "|---|---|---|---|---|---|"]
    for p in result["prediction"]:
        lines.append(f"| {p['side']} | {p['scheme']} | {p['threads']} | PREDICTION {p['decode']['tok_s']:.0f} | "
                     f"{p['decode']['bound']} | PREDICTION {p['prefill']['tok_s']:.0f} |")
    return "\n".join(lines) + "\n"


def _llama_rows(result: dict):
    """(side, type, threads, row) of llama.cpp, with the --poll 0 runs after the default ones."""
    for key, side in (("llamacpp", "llama.cpp"), ("llamacpp_poll0", "llama.cpp --poll 0")):
        for qtype, per in result.get(key, {}).items():
            for t, r in per.items():
                yield side, qtype, t, r


def predictions(result: dict, gguf_bytes: dict) -> list[dict]:
    """Per side, scheme and thread count. The work is the 1-thread count split over the cores (llama.cpp's
    multi-thread counts are mostly its barrier spinning under qemu, which says nothing of a phone's time)."""
    out = []
    for qtype, per in result["llamacpp"].items():
        work = per.get("1", next(iter(per.values())))
        dram = gguf_bytes[qtype] + result["kv_bytes"]
        for t in per:
            out.append({"side": "llama.cpp", "scheme": qtype, "threads": int(t),
                        "decode": predict(work["decode"]["total"]["insns"], dram, int(t)),
                        "prefill": predict(work["prefill"]["total"]["insns"], 0, int(t))})
    for quant, data in result["ours"].items():
        work = data["threads"].get("1", next(iter(data["threads"].values())))
        dram = data["weights_bytes"] + result["kv_bytes"]
        for t in data["threads"]:
            out.append({"side": "ours", "scheme": quant, "threads": int(t),
                        "decode": predict(work["decode"]["total"]["insns"], dram, int(t)),
                        "prefill": predict(work["prefill"]["total"]["insns"], 0, int(t))})
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks import llamacpp, llamacpp_aarch64
    from pipeline.config import load_model
    from pipeline.stages import load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cls", choices=sorted(llamacpp_aarch64.MARCH), default="dotprod")
    ap.add_argument("--threads", default="1,4")
    ap.add_argument("--schemes", default=None, help=f"default {','.join(PAIRS)} (with --update: none)")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "phone-cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--poll0", action="store_true", help="also run llama.cpp's multi-thread rows with --poll 0")
    ap.add_argument("--kernels", action="store_true", help="also count our 1-thread step kernel by kernel")
    ap.add_argument("--update", type=Path, help="an existing results file: add the --poll 0 rows, re-measure "
                    "llama.cpp's rows of --schemes (none unless given), keep everything else")
    ap.add_argument("--add", type=Path, help="an existing results file: measure --schemes on both sides and add "
                    "them to it (same class; the other rows kept, the commit of each run recorded)")
    args = ap.parse_args(argv)
    missing = qc.missing_tools() + llamacpp_aarch64.missing_tools()
    if missing:
        print(f"error: needs Debian packages {' '.join(missing)} (make system-deps)", file=sys.stderr)
        return 2
    threads_list = [int(t) for t in args.threads.split(",")]
    schemes = [s for s in (args.schemes if args.schemes is not None else
                           ("" if args.update else ",".join(PAIRS))).split(",") if s]
    start = time.time()
    try:
        build = llamacpp_aarch64.ensure_built(args.cls)
        files = ggufs(build, args.work / "gguf")
    except (llamacpp.BuildError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    decoder = load(load_model("smollm2-135m")).decoder
    if args.update:
        result = json.loads(args.update.read_text())
        for quant in schemes:   # re-measured default rows (e.g. after a change to the counted ranges)
            result["llamacpp"][PAIRS[quant]] = {t: measure_llamacpp(build.bench, files[PAIRS[quant]], int(t))
                                                for t in result["llamacpp"][PAIRS[quant]]}
        result["llamacpp_poll0"] = poll0_rows(build.bench, files, result["llamacpp"])
        return finish(result, files, [int(t) for t in result["ours"][next(iter(result["ours"]))]["threads"]],
                      args.update.parent, start)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    if args.add:
        result = json.loads(args.add.read_text())
        if result["class"] != args.cls:
            print(f"error: {args.add} is for class {result['class']}, not {args.cls}", file=sys.stderr)
            return 2
        for quant in schemes:
            result["llamacpp"][PAIRS[quant]] = {str(t): measure_llamacpp(build.bench, files[PAIRS[quant]], t)
                                                for t in threads_list}
            result["ours"][quant] = measure_ours(quant, threads_list, args.work, kernels=args.kernels, cls=args.cls)
            result.setdefault("added", []).append({"scheme": quant, "commit": commit,
                                                   "date": datetime.date.today().isoformat()})
        return finish(result, files, threads_list, args.add.parent, start)
    result = {"date": datetime.date.today().isoformat(), "commit": commit, "class": args.cls,
              "march": llamacpp_aarch64.MARCH[args.cls], "context": CONTEXT, "prompt": PROMPT,
              "kv_bytes": kv_bytes(decoder), "llamacpp_build_key": build.key, "llamacpp": {}, "ours": {},
              "phone_model": PHONE}
    for quant in schemes:
        qtype = PAIRS[quant]
        print(f"llama.cpp {qtype}", flush=True)
        result["llamacpp"][qtype] = {str(t): measure_llamacpp(build.bench, files[qtype], t) for t in threads_list}
        print(f"ours {quant}", flush=True)
        result["ours"][quant] = measure_ours(quant, threads_list, args.work, kernels=args.kernels, cls=args.cls)
    if args.poll0:
        result["llamacpp_poll0"] = poll0_rows(build.bench, files, result["llamacpp"])
    return finish(result, files, threads_list, args.out, start)


def poll0_rows(bench: Path, files: dict, rows: dict) -> dict:
    """llama.cpp's multi-thread rows again with --poll 0 (threads sleep between graphs instead of polling)."""
    return {q: {t: measure_llamacpp(bench, files[q], int(t), extra=("--poll", "0")) for t in per if t != "1"}
            for q, per in rows.items()}


def finish(result: dict, files: dict, threads_list: list[int], out: Path, start: float) -> int:
    """Goals, PREDICTION, then the JSON and the markdown table."""
    from benchmarks.speed import gguf_decode_bytes

    gguf_bytes = {q: gguf_decode_bytes(files[q])["bytes_per_token"] for q in result["llamacpp"]}
    result["llamacpp_weights_bytes"] = gguf_bytes
    result["goals"] = goals(result, threads_list)
    result["prediction"] = predictions(result, gguf_bytes)
    result["seconds"] = result.get("seconds", 0) + round(time.time() - start)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"phone_cpu-{result['class']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(table(result))
    print(table(result))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
