"""Instructions per call of android-cpu's t3 decode GEMVs (kernels/cpu/arm_t3.py, rows interleaved by 4) against
its t2 ones (arm_rows.py, rows interleaved by 8), SmolLM2-135M's four layer shapes, counted under qemu-aarch64.

Why: the object's hot loop (arm_code.hot_loop) leaves out x's quantization and the tails; this counts whole
calls, one thread, inside the kernels' own code (the harness's file reading is outside the range), with the
project's TCG plugin (benchmarks/qemu_counter.py).

    .venv/bin/python -m benchmarks.t3_gemv_counts [--out benchmarks/results/t3_gemv_counts]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.phone_cpu_ours import count_single_task
from benchmarks.phone_cpu_whole import extended_ranges

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon", "+fullfp16", "+dotprod"]}


def kernels() -> dict:
    from pipeline.kernels.cpu.arm_rows import rows_dot_kernel
    from pipeline.kernels.cpu.arm_t3 import t3_dot_kernel
    from pipeline.kernels.cpu.packed import NK_FORMATS

    funcs = {}
    for role, (n, k) in SHAPES.items():
        funcs[f"t3_{role}"] = t3_dot_kernel(n, k, layout="rows")
        funcs[f"t2_{role}"] = rows_dot_kernel(NK_FORMATS["t2"], n, k, 8)
    return {name: f.with_attr("global_symbol", name) for name, f in funcs.items()}


def inputs(name: str, n: int, k: int, rng) -> list[np.ndarray]:
    """Random codes of the kernel's layout (the count does not depend on their values), fp16 scales and x."""
    groups = -(-k // 128)
    if name.startswith("t3"):
        codes = rng.integers(0, 243, (n // 4, -(-k // 20), 4, 4), dtype=np.uint8).view(np.uint32)[..., 0]
        scales = np.ones((n // 4, groups, 4), np.float16)
    else:
        codes = rng.integers(0, 2**32, (n // 8, k // 16, 8), dtype=np.uint64).astype(np.uint32)
        scales = np.ones((n // 8, groups, 8), np.float16)
    return [codes, scales, rng.standard_normal((1, 1, k)).astype(np.float16), np.zeros((1, 1, n), np.float16)]



def main(argv: list[str] | None = None) -> int:
    from pipeline.verify.qemu_aarch64 import build_kernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/t3_gemv_counts")
    out = Path(parser.parse_args(argv).out)
    rng = np.random.default_rng(0)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="t3-gemvs-") as tmp:
        _, _, objects = build_kernels(kernels(), TARGET, "", Path(tmp))
        exe = Path(tmp) / "harness"
        spans = extended_ranges(exe)
        for name in kernels():
            fmt, role = name.split("_", 1)
            n, k = SHAPES[role]
            ranges = [r for sym, r in spans.items() if name in sym]
            c = count_single_task(exe, name, inputs(name, n, k, rng), ranges)
            rows[name] = {"n": n, "k": k, "insns": c.range["insns"], "vector_insns": c.range["vector_insns"],
                          "per_weight": round(c.range["insns"] / (n * k), 4)}
            print(f"{name}: {c.range['insns'] / 1e3:.1f} k instructions, {rows[name]['per_weight']} per weight")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# android-cpu decode GEMVs, t2 vs t3: instructions per call under qemu-aarch64",
             "",
             "One thread, inside the kernels' code only (x's quantization included), `python -m benchmarks.t3_gemv_counts`;",
             "t2: arm_rows.py over rows interleaved by 8, t3: arm_t3.py over rows interleaved by 4; two-byte x.",
             "",
             "| shape (N x K) | t2 rows of 8: k instr / call (per weight) | t3 rows of 4: k instr / call (per weight) |",
             "|---|---|---|"]
    for role, (n, k) in SHAPES.items():
        t2, t3 = rows[f"t2_{role}"], rows[f"t3_{role}"]
        lines.append(f"| {role} ({n} x {k}) | {t2['insns'] / 1e3:.1f} ({t2['per_weight']}) | "
                     f"{t3['insns'] / 1e3:.1f} ({t3['per_weight']}) |")
    total = {f: sum(r["insns"] for name, r in rows.items() if name.startswith(f)) for f in ("t2", "t3")}
    lines.append(f"| one layer | {total['t2'] / 1e3:.1f} | {total['t3'] / 1e3:.1f} ({total['t3'] / total['t2']:.2f}x) |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
