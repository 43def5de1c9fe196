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
from pathlib import Path

import numpy as np

from benchmarks.kn_q8_counts import PROMPT, count_calls, fused_kn, layer_cases, write_results
from benchmarks.kn_q8_counts import SHAPES as Q8_SHAPES

SHAPES = {role: shape for role, shape in Q8_SHAPES.items() if role != "lm_head"}
SCHEMES = {"t2": "ternary_ptq", "b1": "binary_ptq"}
PER_WORD = {"t2": 16, "b1": 32}


def cases() -> dict[str, tuple[str, int, int, bool]]:
    return {f"{fmt}_{name}": (fmt, n, k, prompt) for fmt in SCHEMES for name, (n, k, prompt) in layer_cases(SHAPES).items()}


def kernels() -> dict:
    """{name: PrimFunc}: ours_<case> (arm_kn_signs.py) and default_<case> (the fused function as the build had it)."""
    from pipeline.kernels.cpu.arm_kn_signs import kn_sign_dot_kernel

    fused = {fmt: fused_kn(scheme, f"dequantize_{fmt}_kn") for fmt, scheme in SCHEMES.items()}
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/kn_sign_counts")
    out = Path(parser.parse_args(argv).out)
    rng = np.random.default_rng(0)

    def case_inputs(case):
        fmt, n, k, prompt = cases()[case]
        m = PROMPT if prompt else 1
        return n, k, m, inputs(fmt, n, k, m, rng)

    rows = count_calls(kernels(), case_inputs, "kn-sign-")
    write_results(out, rows, [
        "# android-hexagon CPU half, KN t2 / b1: instructions per call under qemu-aarch64", "",
        "One thread, inside the kernels' code only (x's quantization included), `python -m benchmarks.kn_sign_counts`;",
        f"ours: arm_kn_signs.py (sdot, two-byte x); cpu-default: the fused function left to TVM. Prompts: {PROMPT} rows,",
        "per weight and row. K = 576: a last group of 64 values."],
        {case: f"{fmt} {case.split('_', 1)[1]} ({n} x {k})" for case, (fmt, n, k, _) in cases().items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
