"""What int8 activations in the i8mm class's smmla prefill (pipeline/kernels/cpu/arm_mmla.py) do to the logits.

Two android-cpu bundles of the same model and scheme, one built for the i8mm class (`--phone android-16gb`:
prefill matmuls on smmla, x in int8) and one for the dotprod class (sdot prefill, x in two bytes); everything
else, the weights and the decode kernels included, is the same. Each prompt is run by the whole program
under qemu-aarch64 (clients/aarch64_vm): the dotprod bundle decodes greedily, the i8mm bundle is teacher-forced
on those ids, and the logits of the prompt's last position and of every step are compared (max |Δlogit|,
top-1 agreement, KL(dotprod || i8mm)). ~1 min of qemu per prompt and bundle.
Since 2026-12-07 the dotprod class's prompt matmuls over interleaved rows take int8 x as well
(arm_rows.PROMPT_X_BYTES), with the same int8 values: the figures in docs/kernels.md compared against the
two-byte prompt of commit e05a57e; building at that commit (or with PROMPT_X_BYTES = 2) gives that reference.

    .venv/bin/python benchmarks/i8mm_prefill_accuracy.py DIST/<model>-q4f16-android-cpu (i8mm) \\
        DIST/<model>-q4f16-android-cpu (dotprod) [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: the checkout's clients/
    sys.path.insert(0, str(ROOT))

PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
    "wine. Within fifty years printing shops had spread across Europe, and the number of books grew from "
    "thousands to millions. Historians often say that",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    "    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return b\n\n\ndef is_prime(n):\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical "
    "energy. In the chloroplasts, chlorophyll absorbs mostly red and blue light. The light reactions split "
    "water, release oxygen and store energy in ATP and NADPH; the Calvin cycle then uses that energy to fix "
    "carbon dioxide into sugars. Because nearly all food chains start with it, photosynthesis supports "
    "almost every living thing on Earth. Scientists are now studying how to improve its efficiency, because",
)


def compare(reference: np.ndarray, got: np.ndarray) -> dict:
    """Per-position logits [positions, vocab] of the two bundles: max |Δ|, top-1 agreement, KL(reference || got)."""
    a, b = reference.astype(np.float64), got.astype(np.float64)
    p = np.exp(a - a.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    log_q = b - b.max(1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(1, keepdims=True))
    kl = (p * (np.log(p + 1e-30) - log_q)).sum(1)
    return {"positions": len(a), "max_abs_dlogit": float(np.abs(a - b).max()), "logit_scale": float(np.abs(a).max()),
            "top1_same": int((a.argmax(1) == b.argmax(1)).sum()), "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def main(argv: list[str] | None = None) -> int:
    from clients.aarch64_vm.run import decode, tokenize

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("i8mm", type=Path, help="android-cpu bundle built for the i8mm class")
    ap.add_argument("dotprod", type=Path, help="the same model and scheme built for the dotprod class")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    rows = []
    for prompt in PROMPTS:
        ids = tokenize(args.dotprod, prompt)
        reference = decode(args.dotprod, ids, args.steps)
        got = decode(args.i8mm, ids, args.steps, forced=reference.ids)
        rows.append({"prompt_tokens": len(ids), **compare(reference.logits, got.logits)})
        print(json.dumps(rows[-1]), flush=True)
    same, total = sum(r["top1_same"] for r in rows), sum(r["positions"] for r in rows)
    print(f"top-1 the same at {same} of {total} positions; max |dlogit| {max(r['max_abs_dlogit'] for r in rows):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
