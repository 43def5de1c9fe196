"""Instructions per call of android-hexagon's CPU-half KN t2 / b1 GEMVs / prefill matmuls: arm_kn_signs.py's sdot
kernel against what the build ran before it ("cpu-default": the fused function left to TVM's default lowering),
SmolLM2's layer shapes, counted under qemu-aarch64 — kn_q8_counts.py's method for the ternary / binary formats.

Why: the object's hot loop (arm_code.hot_loop) leaves out x's quantization, the tails (K = 576: a last group of
64) and the default path's scratch dequantize; this counts whole calls, one thread, inside the kernels' own
code. The cpu-default kernels are the fused functions of android-hexagon ternary_ptq / binary_ptq builds of a
SmolLM2-shaped model (their lm_head is q8: kn_q8_counts.py's), unscheduled, as those builds compiled them.

    .venv/bin/python -m benchmarks.kn_sign_counts [--out benchmarks/results/kn_sign_counts]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.kn_q8_counts import PROMPT, PROMPTED, SMALL, TARGET
from benchmarks.kn_q8_counts import SHAPES as Q8_SHAPES
from benchmarks.phone_cpu_ours import count_single_task
from benchmarks.phone_cpu_whole import extended_ranges

SHAPES = {role: shape for role, shape in Q8_SHAPES.items() if role != "lm_head"}
SCHEMES = {"t2": "ternary_ptq", "b1": "binary_ptq"}
PER_WORD = {"t2": 16, "b1": 32}


def _fused(fmt: str) -> dict[tuple[int, int, bool], object]:
    """{(N, K, prompt): the fused KN `fmt` dequantize + matmul} of an android-hexagon build of SMALL."""
    from tvm import tirx

    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.kernels.cpu.recognize import block_names
    from pipeline.models import config_from_hf
    from pipeline.stages import Loaded, define, fuse

    loaded = Loaded(ModelSpec(name="small", hf_config=SMALL, weights=None), SMALL, config_from_hf(SMALL), None)
    target = load_target("android-hexagon")
    out = {}
    for _, func in fuse(define(loaded, load_quant(SCHEMES[fmt]), target), target).functions_items():
        if isinstance(func, tirx.PrimFunc) and block_names(func) == [f"dequantize_{fmt}_kn", "matmul"]:
            n, k = int(func.params[-1].shape[2]), int(func.params[-2].shape[2])
            out[(n, k, not isinstance(func.params[-1].shape[1], tirx.IntImm))] = func
    return out


def cases() -> dict[str, tuple[str, int, int, bool]]:
    return {f"{fmt}_{name}": (fmt, n, k, prompt) for fmt in SCHEMES
            for name, (n, k, prompt) in {**{role: (n, k, False) for role, (n, k) in SHAPES.items()},
                                          **{f"{role}_prompt": (*SHAPES[role], True) for role in PROMPTED}}.items()}


def kernels() -> dict:
    """{name: PrimFunc}: ours_<case> (arm_kn_signs.py) and default_<case> (the fused function as the build had it)."""
    from pipeline.kernels.cpu.arm_kn_signs import kn_sign_dot_kernel

    fused = {fmt: _fused(fmt) for fmt in SCHEMES}
    funcs = {}
    for case, (fmt, n, k, prompt) in cases().items():
        funcs[f"ours_{case}"] = kn_sign_dot_kernel(fmt, n, k, "float16", "float16", prompt)
        funcs[f"default_{case}"] = fused[fmt][(n, k, prompt)]
    return {name: f.with_attr("global_symbol", name) for name, f in funcs.items()}


def inputs(fmt: str, n: int, k: int, rows: int, rng) -> list[np.ndarray]:
    """Random code words [K / per_word, N], fp16 scales and x (the count does not depend on their values)."""
    return [rng.integers(0, 2**32, (k // PER_WORD[fmt], n), dtype=np.uint32), np.ones((-(-k // 128), n), np.float16),
            rng.standard_normal((1, rows, k)).astype(np.float16), np.zeros((1, rows, n), np.float16)]


def main(argv: list[str] | None = None) -> int:
    from pipeline.verify.qemu_aarch64 import build_kernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/kn_sign_counts")
    out = Path(parser.parse_args(argv).out)
    rng = np.random.default_rng(0)
    rows, funcs = {}, kernels()
    with tempfile.TemporaryDirectory(prefix="kn-sign-") as tmp:
        build_kernels(funcs, TARGET, "", Path(tmp))
        exe = Path(tmp) / "harness"
        spans = extended_ranges(exe)
        for name in funcs:
            fmt, n, k, prompt = cases()[name.split("_", 1)[1]]
            m = PROMPT if prompt else 1
            ranges = [r for sym, r in spans.items() if name in sym]   # another kernel's: not run in this call
            c = count_single_task(exe, name, inputs(fmt, n, k, m, rng), ranges)
            rows[name] = {"n": n, "k": k, "rows": m, "insns": c.range["insns"], "vector_insns": c.range["vector_insns"],
                          "per_weight": round(c.range["insns"] / (n * k * m), 4)}
            print(f"{name}: {c.range['insns'] / 1e3:.1f} k instructions, {rows[name]['per_weight']} per weight")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# android-hexagon CPU half, KN t2 / b1: instructions per call under qemu-aarch64",
             "",
             "One thread, inside the kernels' code only (x's quantization included), `python -m benchmarks.kn_sign_counts`;",
             f"ours: arm_kn_signs.py (sdot, two-byte x); cpu-default: the fused function left to TVM. Prompts: {PROMPT} rows,",
             "per weight and row. K = 576: a last group of 64 values.",
             "",
             "| format, shape (N x K) | cpu-default: k instr / call (per weight) | ours: k instr / call (per weight) | ratio |",
             "|---|---|---|---|"]
    for case, (fmt, n, k, _) in cases().items():
        ours, default = rows[f"ours_{case}"], rows[f"default_{case}"]
        lines.append(f"| {fmt} {case.split('_', 1)[1]} ({n} x {k}) | {default['insns'] / 1e3:.1f} ({default['per_weight']}) | "
                     f"{ours['insns'] / 1e3:.1f} ({ours['per_weight']}) | {default['insns'] / ours['insns']:.1f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
