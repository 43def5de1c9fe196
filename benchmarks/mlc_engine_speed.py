"""Decode speed of one host-cpu bundle served by MLC-LLM's own engine vs our runner, side by side in one run.

The same bundle, the same prompt ids, greedy, EOS ignored, `--tokens` new tokens; runs alternate (ours, MLC,
ours, MLC, ...) so both see the same machine state, and each side's median decode rate is compared:

- ours: `pipeline run`'s path (runtime/engine.py: prefill, then one `decode_greedy` call per token);
- MLC: the serve engine (clients/mlc_engine/client.MLCServeEngine), whose own usage record reports
  decode_tokens_per_s (time between the first and the last token, from its metrics).

    .venv/bin/python benchmarks/mlc_engine_speed.py [--bundle dist/smollm2-135m-q4f16-host-cpu] [--runs 3]

Needs `make mlc-engine` first. Results: benchmarks/results/mlc_engine_speed-<cpu>.json (a ratio, not a test).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.mlc_engine import build  # noqa: E402  (after the path insert)
from clients.mlc_engine.client import MLCServeEngine  # noqa: E402
from clients.mlc_engine.conformance import PROMPT, prompt_ids  # noqa: E402
from pipeline.runtime.runner import Bundle  # noqa: E402


def ours(bundle: Path, ids: list[int], tokens: int) -> float:
    import numpy as np

    engine = Bundle(bundle).engine()
    token = int(np.argmax(engine.prefill(ids)))
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        token = engine.decode_greedy(token)
    return (tokens - 1) / (time.perf_counter() - t0)


def mlc(engine: MLCServeEngine, ids: list[int], tokens: int) -> float:
    result = engine.generate(ids, tokens, temperature=0, debug_config={"ignore_eos": True})
    assert len(result.token_ids) == tokens, result
    return float(result.usage["extra"]["decode_tokens_per_s"])


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="dist/smollm2-135m-q4f16-host-cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/mlc_engine_speed-<cpu>.json)")
    args = ap.parse_args()
    lib = build.cached_library()
    if lib is None:
        print("error: the MLC engine is not built — fix: run `make mlc-engine` first", file=sys.stderr)
        return 1
    bundle = Path(args.bundle)
    ids = prompt_ids(bundle, PROMPT)
    rates: dict[str, list[float]] = {"ours": [], "mlc": []}
    with MLCServeEngine(lib, bundle, max_num_sequence=1) as engine:
        mlc(engine, ids, 8)       # warm-up: first-call allocations on both sides
        ours(bundle, ids, 8)
        for _ in range(args.runs):
            rates["ours"].append(ours(bundle, ids, args.tokens))
            rates["mlc"].append(mlc(engine, ids, args.tokens))
            print(f"ours {rates['ours'][-1]:.1f} tok/s, MLC engine {rates['mlc'][-1]:.1f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"bundle": bundle.name, "cpu": cpu_name(), "threads": "default (TVM's pool)", "tokens": args.tokens,
              "runs": rates, "median_tok_s": med, "mlc_over_ours": round(med["mlc"] / med["ours"], 3),
              "date": time.strftime("%Y-%m-%d")}
    print(f"median decode: ours {med['ours']:.1f} tok/s, MLC engine {med['mlc']:.1f} tok/s, "
          f"ratio {result['mlc_over_ours']}")
    kind = "amd" if "AMD" in result["cpu"] else "intel" if "Intel" in result["cpu"] else platform.machine()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"mlc_engine_speed-{kind}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
