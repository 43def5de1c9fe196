"""What a decode step costs outside the library's `decode` function, and why: the roofline goal's host share.

Three measurements on one host-cpu bundle, in one process, greedy tokens after a `--ctx`-token prompt:
1. the engine's step split into its calls (id tensor, embed, begin_forward, decode, end_forward, the logits'
   copy to numpy, argmax), the mean over the timed tokens;
2. the same tiny TVM call (a 4-byte copy into a tensor) timed four times in a row right after a decode
   step, and after a streaming read of as many bytes as the step's weights with no decode at all: the
   first call pays for caches the weights' stream evicted;
3. side by side, alternated, against the engine's logits loop (`Engine.decode` + numpy's argmax, what
   sampling with a temperature runs): `Engine.decode_greedy` (the library's embed + decode + argmax in one
   call, what `pipeline run` and the speed benchmark time for greedy decoding) and a loop of begin_forward /
   decode / end_forward alone (the same embedding every step, no logits read back: not a valid decode, the
   upper bound of what the host side of a step could still give).

    .venv/bin/python benchmarks/host_overhead.py dist/smollm2-135m-q4f16-host-cpu [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 120                       # decode tokens per timed run (after the prompt)
SEGMENTS = ("id tensor", "embed", "begin_forward", "decode", "end_forward", "logits to numpy", "argmax")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--ctx", type=int, default=128, help="prompt tokens before each decode run")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of the three decode loops")
    args = ap.parse_args(argv)

    from pipeline.runtime.lean import enter_runtime_process

    enter_runtime_process()
    import numpy as np
    import tvm

    from pipeline.runtime.engine import _builtin, _shape
    from pipeline.runtime.runner import Bundle

    loaded = Bundle(args.bundle)
    engine = loaded.engine()
    prompt = [(7 + 31 * i) % int(loaded.config["vocab_size"]) for i in range(args.ctx)]
    begin, end = _builtin("vm.builtin.kv_state_begin_forward"), _builtin("vm.builtin.kv_state_end_forward")
    embed, decode = engine._fn("embed"), engine._fn("decode")
    first, one = _shape(0), _shape(1)
    ids = tvm.runtime.tensor(np.zeros(1, dtype="int32"), engine.device)
    host_id = np.zeros(1, dtype="int32")

    def start() -> int:
        engine.reset()
        return int(np.argmax(engine.prefill(prompt)))

    def step(token: int, clock: list[int] | None = None) -> int:
        """The engine's decode step, call by call (`Engine.decode` + the caller's argmax)."""
        ticks = [time.perf_counter_ns()]
        x = tvm.runtime.tensor(np.asarray([token], dtype="int32"), engine.device)
        ticks.append(time.perf_counter_ns())
        emb = embed(x, engine._param_array)
        emb = emb._create_view((1, 1, emb.shape[-1]))
        ticks.append(time.perf_counter_ns())
        begin(engine.kv, first, one)
        ticks.append(time.perf_counter_ns())
        logits, engine.kv = decode(emb, engine.kv, engine._param_array)
        ticks.append(time.perf_counter_ns())
        end(engine.kv)
        ticks.append(time.perf_counter_ns())
        row = logits.numpy()[0, -1]
        ticks.append(time.perf_counter_ns())
        token = int(np.argmax(row))
        ticks.append(time.perf_counter_ns())
        engine.length += 1
        if clock is not None:
            clock.extend(np.diff(ticks))
        return token

    def tiny_calls() -> list[float]:
        """us of four 4-byte copies into a TVM tensor, back to back."""
        ticks = [time.perf_counter_ns()]
        for _ in range(4):
            ids.copyfrom(host_id)
            ticks.append(time.perf_counter_ns())
        return list(np.diff(ticks) / 1e3)

    # 1. the step, call by call
    spent: list[int] = []
    after_step: list[list[float]] = []
    for run in range(3):
        token = start()
        for _ in range(STEPS):
            token = step(token, spent if run else None)
            if run:
                after_step.append(tiny_calls())
    per_call = np.asarray(spent, dtype=float).reshape(-1, len(SEGMENTS)).mean(axis=0) / 1e3
    total = per_call.sum()
    print(f"decode step {total:.0f} us ({1e6 / total:.0f} tok/s), {args.ctx}-token prompt; mean per token:")
    for name, us in zip(SEGMENTS, per_call, strict=True):
        print(f"  {name:16s} {us:8.1f} us  {us / total:6.1%}")
    print(f"  outside decode   {total - per_call[3]:8.1f} us  {(total - per_call[3]) / total:6.1%}")

    # 2. the same tiny call, cold and warm
    coverage = json.loads((args.bundle / "reports" / "coverage.json").read_text())
    weights = np.ones(int(coverage["summary"]["decode_step"]["total"]["bytes"]) // 8)   # the step's bytes
    after_read = []
    for _ in range(200):
        weights.sum()
        after_read.append(tiny_calls())
    idle = [tiny_calls() for _ in range(200)]
    for what, times in (("after a decode step", after_step), (f"after a {weights.nbytes >> 20} MB read", after_read),
                        ("back to back, nothing between", idle)):
        print(f"4-byte tensor copy, 1st..4th call {what}: "
              + " / ".join(f"{v:.1f}" for v in np.median(np.asarray(times), axis=0)) + " us")

    # 3. the greedy step and the upper bound, against the logits loop
    def tok_s(loop: str) -> float:
        token = start()
        emb = embed(tvm.runtime.tensor(np.asarray([token], dtype="int32"), engine.device), engine._param_array)
        emb = emb._create_view((1, 1, emb.shape[-1]))
        t = time.perf_counter()
        for _ in range(STEPS):
            if loop == "bare":
                begin(engine.kv, first, one)
                _, engine.kv = decode(emb, engine.kv, engine._param_array)
                end(engine.kv)
                engine.length += 1
            elif loop == "greedy":
                token = engine.decode_greedy(token)
            else:
                token = int(np.argmax(engine.decode(token)))
        return STEPS / (time.perf_counter() - t)

    loops = ("logits", "greedy", "bare")
    ratios: dict[str, list[float]] = {"greedy": [], "bare": []}
    for r in range(args.rounds):
        order = loops[r % 3:] + loops[:r % 3]
        got = {loop: tok_s(loop) for loop in order}
        for loop in ratios:
            ratios[loop].append(got[loop] / got["logits"])
    for loop, what in (("greedy", "Engine.decode_greedy (one library call)"),
                       ("bare", "begin/decode/end alone (upper bound)")):
        rs = ratios[loop]
        print(f"{what} vs the logits loop: {np.median(rs):.3f}x median ({min(rs):.3f}-{max(rs):.3f}, "
              f"{args.rounds} rounds, order rotated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
