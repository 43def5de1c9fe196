"""Instructions per call of android-hexagon's CPU-half KN q8 GEMVs / prefill matmuls: arm_kn_q8.py's sdot kernel
against what the build ran before it ("cpu-default": the fused function left to TVM's default lowering), SmolLM2's
layer shapes, counted under qemu-aarch64.

Why: the object's hot loop (arm_code.hot_loop) leaves out x's quantization, the tails and the default path's
scratch dequantize; this counts whole calls, one thread, inside the kernels' own code, with the project's TCG
plugin (benchmarks/qemu_counter.py). The cpu-default kernels are the fused functions of an android-hexagon
q8f16 build of a SmolLM2-shaped model (2 layers, SmolLM2's vocab), unscheduled, as that build compiled them.

    .venv/bin/python -m benchmarks.kn_q8_counts [--out benchmarks/results/kn_q8_counts]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.phone_cpu_ours import count_single_task
from benchmarks.phone_cpu_whole import extended_ranges

# role: (N, K); decode GEMVs of all four, prompts (PROMPT rows) of two (the default path's prefill is slow under qemu)
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}
PROMPTED = ("o_proj", "down_proj")
PROMPT = 8
TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-android", "mattr": ["+neon", "+fullfp16", "+dotprod"]}
SMALL = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
             rms_norm_eps=1e-5, rope_theta=1e5)


def fused_kn(scheme: str, block: str) -> dict[tuple[int, int, bool], object]:
    """{(N, K, prompt): the fused KN dequantize (block `block`) + matmul} of an android-hexagon `scheme` build of
    SMALL, unscheduled, as that build compiled them."""
    from tvm import tirx

    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.kernels.cpu.recognize import block_names
    from pipeline.models import config_from_hf
    from pipeline.stages import Loaded, define, fuse

    loaded = Loaded(ModelSpec(name="small", hf_config=SMALL, weights=None), SMALL, config_from_hf(SMALL), None)
    target = load_target("android-hexagon")
    out = {}
    for _, func in fuse(define(loaded, load_quant(scheme), target), target).functions_items():
        if isinstance(func, tirx.PrimFunc) and block_names(func) == [block, "matmul"]:
            n, k = int(func.params[-1].shape[2]), int(func.params[-2].shape[2])   # out [1, m, N], x [1, m, K]
            out[(n, k, not isinstance(func.params[-1].shape[1], tirx.IntImm))] = func
    return out


def layer_cases(shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int, bool]]:
    """{case: (N, K, prompt)}: a decode GEMV of every shape, a prompt of the PROMPTED ones."""
    return {**{role: (n, k, False) for role, (n, k) in shapes.items()},
            **{f"{role}_prompt": (*shapes[role], True) for role in PROMPTED if role in shapes}}


def cases() -> dict[str, tuple[int, int, bool]]:
    return layer_cases(SHAPES)


def kernels() -> dict:
    """{name: PrimFunc}: ours_<case> (arm_kn_q8.py) and default_<case> (the fused function as the build had it)."""
    from pipeline.kernels.cpu.arm_kn_q8 import kn_q8_dot_kernel

    fused = fused_kn("q8f16", "dequantize_q8_kn")
    funcs = {}
    for case, (n, k, prompt) in cases().items():
        funcs[f"ours_{case}"] = kn_q8_dot_kernel(n, k, "float16", "float16", prompt)
        funcs[f"default_{case}"] = fused[(n, k, prompt)]
    return {name: f.with_attr("global_symbol", name) for name, f in funcs.items()}


def inputs(n: int, k: int, rows: int, rng) -> list[np.ndarray]:
    """Random int8 codes [K, N], fp16 scales and x (the count does not depend on their values)."""
    return [rng.integers(-128, 128, (k, n), dtype=np.int8), np.ones((k // 32, n), np.float16),
            rng.standard_normal((1, rows, k)).astype(np.float16), np.zeros((1, rows, n), np.float16)]


def count_calls(funcs: dict, case_inputs, prefix: str) -> dict[str, dict]:
    """{kernel name: its counts}: each of `funcs` (ours_<case> / default_<case>) built into one aarch64 harness and
    called once, one task, on case_inputs(case) = (N, K, rows, arguments); counted inside its own code."""
    from pipeline.verify.qemu_aarch64 import build_kernels

    rows = {}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        build_kernels(funcs, TARGET, "", Path(tmp))
        exe = Path(tmp) / "harness"
        spans = extended_ranges(exe)
        for name in funcs:
            n, k, m, args = case_inputs(name.split("_", 1)[1])
            ranges = [r for sym, r in spans.items() if name in sym]   # another kernel's: not run in this call
            c = count_single_task(exe, name, args, ranges)
            rows[name] = {"n": n, "k": k, "rows": m, "insns": c.range["insns"], "vector_insns": c.range["vector_insns"],
                          "per_weight": round(c.range["insns"] / (n * k * m), 4)}
            print(f"{name}: {c.range['insns'] / 1e3:.1f} k instructions, {rows[name]['per_weight']} per weight")
    return rows


def write_results(out: Path, rows: dict, head: list[str], labels: dict[str, str]) -> None:
    """The counts as JSON and a markdown table (`head` above it), one line per case: labels[case]."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [*head, "",
             "| shape (N x K) | cpu-default: k instr / call (per weight) | ours: k instr / call (per weight) | ratio |",
             "|---|---|---|---|"]
    for case, label in labels.items():
        ours, default = rows[f"ours_{case}"], rows[f"default_{case}"]
        lines.append(f"| {label} | {default['insns'] / 1e3:.1f} ({default['per_weight']}) | "
                     f"{ours['insns'] / 1e3:.1f} ({ours['per_weight']}) | {default['insns'] / ours['insns']:.1f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/kn_q8_counts")
    out = Path(parser.parse_args(argv).out)
    rng = np.random.default_rng(0)

    def case_inputs(case):
        n, k, prompt = cases()[case]
        m = PROMPT if prompt else 1
        return n, k, m, inputs(n, k, m, rng)

    rows = count_calls(kernels(), case_inputs, "kn-q8-")
    write_results(out, rows, [
        "# android-hexagon CPU half, KN q8: instructions per call under qemu-aarch64", "",
        "One thread, inside the kernels' code only (x's quantization included), `python -m benchmarks.kn_q8_counts`;",
        f"ours: arm_kn_q8.py (sdot, two-byte x); cpu-default: the fused function left to TVM. Prompts: {PROMPT} rows,",
        "per weight and row."], {case: f"{case} ({n} x {k})" for case, (n, k, _) in cases().items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
