"""The HVX matmuls counted packet by packet under qemu-hexagon (issue #38 item 4).

The android-hexagon build places SmolLM2's KN matmuls on the NPU as vrmpy kernels (kernels/npu/hvx_int8_matmul.py):
q4 and q8 decode GEMVs and prefill matmuls.
Here, for each of these four kinds, each of the four layer shapes (qkv, o_proj, gate_up, down: read from the
model's config) is built for Hexagon v73 exactly as the build builds it, linked into the freestanding harness
(pipeline/verify/qemu_hexagon.py), run once on random weights under `qemu-hexagon` with the project's counting
plugin (benchmarks/native/insn_counter.c) restricted to the kernel's own symbols, and its result checked
against numpy before its counts are kept. qemu translates a Hexagon packet as one guest instruction, so the
counts are packets; an HVX packet is one naming an HVX register. Loads are bytes the kernel loads (cache hits
included), against the bytes of its weights (codes + fp16 scales). Prefills run PROMPT_ROWS prompt rows.

    .venv/bin/python benchmarks/hexagon_hvx.py          # ~3 minutes; results in benchmarks/results/hexagon_hvx.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: import the checkout's pipeline/ and benchmarks/
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import qemu_counter as qc  # noqa: E402

# A published peer figure, for scale only (whole-model decode on a phone; no per-weight count is published):
# llama.cpp's Hexagon backend decodes Qwen3-8B Q4_K_M at 6.7 tok/s on a Snapdragon 8 Elite Gen 5.
PEER = "llama.cpp Hexagon backend: Qwen3-8B Q4_K_M 6.7 tok/s on Snapdragon 8 Elite Gen 5 (published; whole model)"
# PREDICTION model (assumptions, not a datasheet): one packet per cycle per HVX context, HVX clock 1.0 GHz,
# the step's GEMVs split over `contexts` contexts with no overhead; memory floor at the phone's bandwidth.
HVX_CLOCK_GHZ = 1.0
BANDWIDTH_GBS = 76.8


def layer_shapes(decoder) -> dict[str, tuple[int, int]]:
    """(K, N) of one decoder layer's decode GEMVs."""
    h, d = decoder.hidden_size, decoder.head_dim
    qkv = (decoder.num_attention_heads + 2 * decoder.num_key_value_heads) * d
    return {"qkv": (h, qkv), "o_proj": (decoder.num_attention_heads * d, h),
            "gate_up": (h, 2 * decoder.intermediate_size), "down": (decoder.intermediate_size, h)}


KINDS = {"q4 decode": ("q4", 0), "q8 decode": ("q8", 0), "q4 prefill": ("q4", 1), "q8 prefill": ("q8", 1)}
PROMPT_ROWS = 16     # prompt rows of each prefill measurement (4 passes of the kernels' ROWS rows)


def _kernel(fmt: str, k: int, n: int, prompt: bool):
    """The HVX kernel the android-hexagon build places on the NPU for this fused function."""
    from pipeline.kernels.npu.hvx_int8_matmul import int8_matmul

    return int8_matmul(fmt, k, n, prompt)


def measure(shapes: dict[str, tuple[int, int]], folder: Path, fmt: str = "q4", rows: int = 0,
            seed: int = 0) -> dict[str, dict]:
    """Counts per GEMV shape (one call each: one token, or a prefill of `rows` prompt rows), after checking each
    result against numpy."""
    import tvm

    from pipeline.compiler.schedule import KernelSchedule
    from pipeline.config import load_target
    from pipeline.quant.quantize import dequantize_q4, dequantize_q8, quantize_q4, quantize_q8
    from pipeline.verify import qemu_hexagon as qh

    quantize, dequantize = {"q4": (quantize_q4, dequantize_q4), "q8": (quantize_q8, dequantize_q8)}[fmt]
    funcs = {name: _kernel(fmt, k, n, rows > 0) for name, (k, n) in shapes.items()}
    kernels = qh.hexagon_kernels(tvm.IRModule(funcs), [KernelSchedule(n, "hvx", True) for n in funcs],
                                 load_target("android-hexagon").npu, folder)
    symbols = qc.symbol_ranges(kernels.harness, nm=qh._tool("llvm-nm"), prefix="")
    rng = np.random.default_rng(seed)
    m = max(rows, 1)
    out = {}
    for name, (k, n) in shapes.items():
        codes, scales = quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), "KN")
        x = rng.standard_normal((1, m, k)).astype(np.float16)
        args = [codes, scales, x, np.zeros((1, m, n), np.float16)]
        got = kernels.call(name, args)[-1][0].astype(np.float64)
        exact = x[0].astype(np.float64) @ dequantize(codes, scales, "KN").astype(np.float64).T
        rel = float(np.abs(got - exact).max() / np.abs(exact).max())
        if rel > 2e-2:
            raise RuntimeError(f"{name}: the HVX kernel's result differs from numpy by {rel:.3g} of scale")
        # the kernel's packed-call entry and its compute function (TVM names it <kernel>_compute_)
        own = [r for s, r in symbols.items() if s == qh.SYMBOL_PREFIX + kernels.prefix + name
               or (s.startswith(kernels.prefix + name) and s.endswith("_compute_"))]
        if len(own) != 2:
            raise RuntimeError(f"{name}: expected its entry and compute symbols in the harness, found {len(own)}")
        counts, _ = qc.run([kernels.harness], own, qemu="qemu-hexagon",
                           stdin=qh._request(qh.SYMBOL_PREFIX + kernels.prefix + name, args))
        c, weights = counts.range, k * n
        out[name] = {"k": k, "n": n, "rows": m, "weights": weights, "weight_bytes": codes.nbytes + scales.nbytes,
                     "packets": c["insns"], "hvx_packets": c["vector_insns"], "load_bytes": c["load_bytes"],
                     "store_bytes": c["store_bytes"], "packets_per_weight": c["insns"] / (weights * m),
                     "hvx_share": c["vector_insns"] / c["insns"], "rel_err_vs_numpy": rel}
    return out


def summary(rows: dict[str, dict], layers: int, contexts: int) -> dict:
    """Per decode token or per prompt row (all layers' GEMVs / matmuls) and the PREDICTION."""
    m = next(iter(rows.values()))["rows"]
    packets = layers * sum(r["packets"] for r in rows.values()) / m
    weight_bytes = layers * sum(r["weight_bytes"] for r in rows.values())
    weights = layers * sum(r["weights"] for r in rows.values())
    compute_s = packets / (contexts * HVX_CLOCK_GHZ * 1e9)
    from pipeline.kernels.npu.hvx_int8_matmul import ROWS

    memory_s = weight_bytes / min(m, ROWS) / (BANDWIDTH_GBS * 1e9)   # a prefill reads the weights once per ROWS rows
    return {"layers": layers, "rows": m, "packets_per_token": packets, "weights": weights,
            "packets_per_weight": packets / weights,
            "hvx_share": layers * sum(r["hvx_packets"] for r in rows.values()) / (packets * m),
            "load_bytes_per_weight_byte": layers * sum(r["load_bytes"] for r in rows.values()) / weight_bytes / m,
            "prediction": {"contexts": contexts, "hvx_clock_ghz": HVX_CLOCK_GHZ, "bandwidth_gbs": BANDWIDTH_GBS,
                           "gemv_ms_per_token": 1e3 * max(compute_s, memory_s),
                           "bound": "compute" if compute_s > memory_s else "memory"}}


KERNEL_NOTES = {
    "q4 decode": "kernels/npu/hvx_int8_matmul.py (vrmpy over nibble codes, int8 activations per group of 32)",
    "q8 decode": "kernels/npu/hvx_int8_matmul.py (4 KN rows shuffled into vrmpy lanes, int8 activations per group of 32)",
    "q4 prefill": "kernels/npu/hvx_int8_matmul.py, 4 prompt rows per pass over the weights",
    "q8 prefill": "kernels/npu/hvx_int8_matmul.py, 4 prompt rows per pass over the weights",
}


def markdown(result: dict) -> str:
    lines = [f"# HVX matmuls under qemu-hexagon ({result['date']}, commit {result['commit']})", "",
             f"{result['model']}, KN weights, one call per shape on random weights (a prefill: "
             f"{PROMPT_ROWS} prompt rows), result checked against numpy; counted inside the kernel's symbols. "
             "A packet is what qemu counts as one Hexagon instruction; an HVX packet names an HVX register. "
             "Per weight = per weight and prompt row.", ""]
    for kind, part in result["kinds"].items():
        s, p = part["per_token"], part["per_token"]["prediction"]
        unit = "decoded token" if s["rows"] == 1 else "prompt row"
        lines += [f"## {kind}: {KERNEL_NOTES.get(kind, '')}", "",
                  "| GEMV | K x N | packets | per weight | HVX packets | load bytes / weight bytes | rel. err vs numpy |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in part["kernels"].items():
            lines.append(f"| {name} | {r['k']} x {r['n']} | {r['packets']:,} | {r['packets_per_weight']:.3f} | "
                         f"{r['hvx_share']:.0%} | {r['load_bytes'] / r['weight_bytes']:.2f} | {r['rel_err_vs_numpy']:.1e} |")
        lines += ["", f"Per {unit} ({s['layers']} layers, {s['weights'] / 1e6:.1f} M weights): "
                  f"{s['packets_per_token'] / 1e6:.1f} M packets, {s['packets_per_weight']:.3f} per weight, "
                  f"{s['hvx_share']:.0%} HVX packets, {s['load_bytes_per_weight_byte']:.2f} bytes loaded per weight "
                  f"byte. PREDICTION (a model, not a measurement): {p['gemv_ms_per_token']:.2f} ms per {unit} "
                  f"({p['bound']} bound).", ""]
    p = next(iter(result["kinds"].values()))["per_token"]["prediction"]
    lines += [f"PREDICTION model: one packet per cycle per HVX context, HVX clock {p['hvx_clock_ghz']} GHz (assumed), "
              f"{p['contexts']} contexts with no overhead (the kernels are single-threaded today), "
              f"{p['bandwidth_gbs']} GB/s for the weights.", "", f"Peer, for scale: {result.get('peer', PEER)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import load_model
    from pipeline.stages import load
    from pipeline.verify import qemu_hexagon as qh

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, default=4, help="HVX contexts the PREDICTION splits the work over")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    missing = qh.missing_tools() + qc.missing_tools(("gcc",))
    if missing:
        print(f"error: needs Debian packages {' '.join(missing)} (make system-deps)", file=sys.stderr)
        return 2
    decoder = load(load_model(args.model)).decoder
    kinds = {}
    for kind, (fmt, prompt) in KINDS.items():
        with tempfile.TemporaryDirectory(prefix="hexagon-hvx-") as tmp:
            rows = measure(layer_shapes(decoder), Path(tmp), fmt, PROMPT_ROWS if prompt else 0)
        kinds[kind] = {"kernels": rows, "per_token": summary(rows, decoder.num_hidden_layers, args.contexts)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "commit": commit, "model": args.model,
              "kinds": kinds, "peer": PEER}
    args.out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(result, indent=2) + "\n"), (".md", markdown(result))):
        path = args.out / f"hexagon_hvx{suffix}"
        tmp_path = path.with_suffix(path.suffix + ".tmp")
        tmp_path.write_text(text)
        tmp_path.replace(path)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
