"""Instructions per decode call of android-cpu's MoE expert kernels, the fp32 form (kernels/cpu/expert_rows.py) against
the sdot form (kernels/cpu/expert_arm.py), counted under qemu-aarch64 at Qwen3.5-35B-A3B's shapes (hidden 2048,
expert FFN 512, top-8; 8 experts stored: the count does not depend on how many).

Why: the object's hot loop (docs/moe.md) leaves out x's quantization, the work items' set-up and the routing sum;
this counts whole calls (one token, one thread: HARNESS_TASKS=1), inside the library's own code (the harness's
file reading and TVM's thread-pool stand-in are outside the range), with the project's TCG plugin
(benchmarks/qemu_counter.py).

    .venv/bin/python -m benchmarks.moe_expert_counts [--out benchmarks/results/moe_expert_counts]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.phone_cpu_ours import count_single_task
from benchmarks.phone_cpu_whole import extended_ranges

HIDDEN, INTER, TOP_K, EXPERTS = 2048, 512, 8, 8
FORMS = {"fp32": None, "sdot": "dotprod"}
LIB_SYMBOLS = ("__tvm_ffi_", "__tvm_set_raised", "__tvm_module_startup", "__truncsfhf2", "__extendhfsf2")


def kernels() -> dict:
    from pipeline.models.moe_kernels import moe_down, moe_gate_up

    funcs = {}
    for fmt in ("q4", "q8"):
        for form, dot in FORMS.items():
            funcs[f"gate_up_{fmt}_{form}"] = moe_gate_up(EXPERTS, INTER, HIDDEN, TOP_K, "float16", fmt, expert_dot=dot,
                                                         name=f"gate_up_{fmt}_{form}")
            funcs[f"down_{fmt}_{form}"] = moe_down(EXPERTS, HIDDEN, INTER, TOP_K, "float16", fmt, expert_dot=dot,
                                                   name=f"down_{fmt}_{form}")
    return funcs


def inputs(name: str, rng) -> tuple[list[np.ndarray], int]:
    """Random codes (the count does not depend on their values), fp16 scales, x / h, the routing; and the number
    of weights the call reads (top-k experts' rows x K)."""
    proj, fmt = "gate_up" if name.startswith("gate_up") else "down", name.split("_")[-2]
    rows, k = (2 * INTER, HIDDEN) if proj == "gate_up" else (HIDDEN, INTER)
    if fmt == "q8":
        codes = rng.integers(-127, 128, (EXPERTS, rows, k), dtype=np.int8)
    else:
        codes = rng.integers(0, 2**32, (EXPERTS, rows, k // 8), dtype=np.uint64).astype(np.uint32)
    scales = (rng.standard_normal((EXPERTS, rows, k // 32)) * 0.02).astype(np.float16)
    idx = rng.permutation(EXPERTS)[:TOP_K].astype(np.int32)[None]
    if proj == "gate_up":
        x = rng.standard_normal((1, HIDDEN)).astype(np.float16)
        return [x, idx, codes, scales, np.zeros((1, TOP_K, INTER), np.float16)], TOP_K * rows * k
    h = rng.standard_normal((1, TOP_K, INTER)).astype(np.float16)
    w = np.full((1, TOP_K), 1.0 / TOP_K, np.float32)
    return [h, idx, w, codes, scales, np.zeros((1, HIDDEN), np.float16)], TOP_K * rows * k



def main(argv: list[str] | None = None) -> int:
    from pipeline.config import load_target
    from pipeline.verify.qemu_aarch64 import build_kernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/moe_expert_counts")
    out = Path(parser.parse_args(argv).out)
    rng = np.random.default_rng(0)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="moe-experts-") as tmp:
        build_kernels(kernels(), load_target("android-cpu").tvm(), "", Path(tmp))
        exe = Path(tmp) / "harness"
        ranges = [r for sym, r in extended_ranges(exe).items() if sym.startswith(LIB_SYMBOLS)]
        for name in kernels():
            args, weights = inputs(name, rng)
            c = count_single_task(exe, name, args, ranges)
            rows[name] = {"weights": weights, "insns": c.range["insns"], "vector_insns": c.range["vector_insns"],
                          "per_weight": round(c.range["insns"] / weights, 4)}
            print(f"{name}: {c.range['insns'] / 1e6:.2f} M instructions, {rows[name]['per_weight']} per weight")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# android-cpu MoE expert kernels, fp32 form vs sdot form: instructions per decode call under qemu-aarch64",
             "",
             f"Qwen3.5-35B-A3B's shapes (hidden {HIDDEN}, expert FFN {INTER}, top-{TOP_K}), one token, one thread, inside the",
             "library's code (x's quantization included), fp16 activations, `python -m benchmarks.moe_expert_counts`.",
             "",
             "| kernel | weights read | fp32 form: M instr (per weight) | sdot: M instr (per weight) | ratio |",
             "|---|---:|---:|---:|---:|"]
    for fmt in ("q4", "q8"):
        for proj in ("gate_up", "down"):
            a, b = rows[f"{proj}_{fmt}_fp32"], rows[f"{proj}_{fmt}_sdot"]
            lines.append(f"| {proj} {fmt} | {a['weights'] / 1e6:.2f} M | {a['insns'] / 1e6:.2f} ({a['per_weight']}) | "
                         f"{b['insns'] / 1e6:.2f} ({b['per_weight']}) | {a['insns'] / b['insns']:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
