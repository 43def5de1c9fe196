"""Predicted android-adreno decode step vs its bandwidth floor (issue #39's goal: >= 60%), per model.

For each model (registry name, q4f16, no weights: the kernels and their byte counts only need the config) this
runs the build's own define, fuse and schedule stages for android-adreno and the coverage report with a
context of CONTEXT cached tokens, then compares

* the bandwidth floor: every decode-step byte of the GPU kernels the report costs, at the phone's bandwidth
  (target `phone.bandwidth_gbs`, 76.8 GB/s for the Snapdragon 8 Gen 3);
* the PREDICTION of the report's per-kernel model (report/gpu_cost.py): each launch's bytes / (bandwidth x
  min(1, work-groups / 48)); no launch overhead, caches or compute (a stated model, not a measurement);

and lists every decode launch below 48 work-groups with its bytes and predicted time. Only the Relax
functions of a decode step (`decode`, `embed`) and the KV cache's constructor (its attention kernels) are
kept before scheduling: the rest (prefill, batch functions) is dropped so that a prefill kernel the rules
cannot schedule does not stop a decode study (qwen27b's 16480-wide prefill in_proj: matmul_f32 fails on it).

    .venv/bin/python benchmarks/gpu_decode_prediction.py smollm2-135m qwen27b [--context 1024] [--out FILE.json]

The kernels' bytes are the report's: the GDN state's runtime copies (rnn_state_get / set) are in, reshapes that
become views are not; the rows our RMSNorm kernels re-read are charged by the PREDICTION, not counted in the floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONTEXT = 1024
GOAL = 0.60


def decode_module(mod):
    """The fused module with only the decode step's Relax functions and the KV cache's constructor, and the
    kernels they reach."""
    import tvm
    from tvm import relax

    from pipeline.report.coverage import DECODE_FUNCS

    names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
    keep = [n for n in names if n in DECODE_FUNCS or "kv_cache" in n or "rnn_state" in n or n.startswith("create")]
    kept = tvm.IRModule({gv: f for gv, f in mod.functions_items()
                         if not isinstance(f, relax.Function) or gv.name_hint in keep}, attrs=mod.attrs,
                        global_infos=mod.global_infos)
    return relax.transform.DeadCodeElimination(keep)(kept), keep


def study(model: str, context: int) -> dict:
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.report.coverage import coverage_report
    from pipeline.report.gpu_cost import FILL_GROUPS
    from pipeline.stages import define, fuse, load, tune

    t0 = time.time()
    target = load_target("android-adreno")
    loaded = load(load_model(model))
    defined = define(loaded, load_quant("q4f16"), target)
    mod, kept = decode_module(fuse(defined, target))
    mod, records = tune(mod, target)
    report = coverage_report(mod, records, target, context_len=context, param_names=[n for n, _ in defined.params])
    bandwidth = report["summary"]["gpu_prediction"]["bandwidth_gbs"]
    rows, costed_bytes, reread_bytes, predicted_us, low, uncosted = [], 0, 0, 0.0, [], []
    for r in report["kernels"]:
        d = r["decode_step"]
        if not d["calls"]:
            continue
        cost = r.get("gpu_cost") or {}
        row = {"name": r["name"], "op_class": r["op_class"], "rule": r["rule"], "calls": d["calls"],
               "bytes_per_call": d["bytes_per_call"], "launches": cost.get("launches"),
               "predicted_us_per_call": cost.get("predicted_us_per_call"), "reread_bytes": cost.get("reread_bytes", 0)}
        rows.append(row)
        if row["predicted_us_per_call"] is None:
            uncosted.append(row)
            continue
        costed_bytes += d["bytes_per_call"] * d["calls"]
        reread_bytes += row["reread_bytes"] * d["calls"]
        predicted_us += row["predicted_us_per_call"] * d["calls"]
        if any(g < FILL_GROUPS for g, _ in row["launches"]):
            # charged: the model slowed it (its streaming launch is under FILL_GROUPS); else a small launch beside
            # a full one (the split-KV attention's merge)
            row["charged"] = row["predicted_us_per_call"] > d["bytes_per_call"] / (bandwidth * 1e3) + 0.01
            low.append(row)
    floor_us = costed_bytes / (bandwidth * 1e3)
    by_name = {r["name"]: r for r in rows}
    gdn = {n: by_name[n] for n in ("gdn_decode", "rnn_state_get_1", "rnn_state_set_1") if n in by_name}
    return {"model": model, "quant": "q4f16", "target": "android-adreno", "context": context,
            "relax_functions_kept": kept, "phone_bandwidth_gbs": bandwidth,
            "cost_model": report["summary"]["gpu_prediction"]["model"],
            "decode_bytes_costed": costed_bytes, "decode_reread_bytes": reread_bytes, "floor_us": round(floor_us, 1),
            "predicted_us": round(predicted_us, 1),
            "floor_over_predicted": round(floor_us / predicted_us, 4) if predicted_us else None,
            "goal": GOAL, "below_fill": low, "not_costed": uncosted, "gdn_state": gdn, "kernels": rows,
            "seconds": round(time.time() - t0, 1)}


def to_markdown(results: list[dict]) -> str:
    """The results as a page for benchmarks/results/."""
    lines = ["# android-adreno decode step: PREDICTION vs bandwidth floor", "",
             f"Model: {results[0]['cost_model']}; {results[0]['phone_bandwidth_gbs']} GB/s (Snapdragon 8 Gen 3). "
             "Floor: the decode step's costed bytes at that bandwidth; the PREDICTION also charges the rows our "
             "RMSNorm kernels re-read (every work-group of a row reads the whole row), which the floor leaves out. "
             "q4f16, one sequence, "
             f"{results[0]['context']} cached tokens. Not a measurement: no GPU here.", "",
             "| model | decode bytes | norm re-reads | floor µs | PREDICTION µs | floor / PREDICTION | goal >= 60% |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        ok = "PASS" if (r["floor_over_predicted"] or 0) >= r["goal"] else "FAIL"
        lines.append(f"| {r['model']} | {r['decode_bytes_costed'] / 1e6:.1f} MB | {r['decode_reread_bytes'] / 1e6:.1f} MB | "
                     f"{r['floor_us']} | {r['predicted_us']} | "
                     f"{100 * r['floor_over_predicted']:.1f}% | {ok} |")
    for r in results:
        lines += ["", f"## {r['model']}: decode launches under 48 work-groups", "",
                  "| kernel | op class | rule | launches (work-groups x work-items) | calls | bytes / call | "
                  "predicted µs / call | charged by the model |", "|---|---|---|---|---|---|---|---|"]
        for k in sorted(r["below_fill"], key=lambda k: -k["predicted_us_per_call"] * k["calls"]):
            shape = "; ".join(f"{g} x {i}" for g, i in k["launches"])
            lines.append(f"| `{k['name']}` | {k['op_class']} | {k['rule']} | {shape} | {k['calls']} | {k['bytes_per_call']} | "
                         f"{k['predicted_us_per_call']} | {'yes' if k['charged'] else 'no (streaming launch full)'} |")
        if r["not_costed"]:
            lines += ["", "Not costed (symbolic launch or bytes): " + ", ".join(
                f"`{k['name']}` x {k['calls']}" for k in r["not_costed"])]
        if r["gdn_state"]:
            lines += ["", "GDN state per token: " + "; ".join(
                f"`{n}` {k['calls']} x {k['bytes_per_call']} B, {k['launches']}, {k['predicted_us_per_call']} µs"
                for n, k in r["gdn_state"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--out", type=Path, help="results JSON (and a .md page beside it)")
    ap.add_argument("--from-json", type=Path, help="render an earlier --out file to its .md page and stop")
    args = ap.parse_args(argv)
    if args.from_json:
        args.from_json.with_suffix(".md").write_text(to_markdown(json.loads(args.from_json.read_text())))
        return 0
    results = []
    for model in args.models:
        res = study(model, args.context)
        results.append(res)
        verdict = "PASS" if res["floor_over_predicted"] and res["floor_over_predicted"] >= GOAL else "FAIL"
        print(f"{model}: floor {res['floor_us']} µs ({res['decode_bytes_costed'] / 1e6:.1f} MB at "
              f"{res['phone_bandwidth_gbs']} GB/s), PREDICTION {res['predicted_us']} µs: "
              f"{100 * (res['floor_over_predicted'] or 0):.1f}% of the floor ({verdict}, goal {GOAL:.0%})")
        for r in res["below_fill"]:
            print(f"  below 48 work-groups: {r['name']} ({r['op_class']}, {r['rule']}) {r['launches']} x {r['calls']} "
                  f"calls, {r['bytes_per_call']} B/call, {r['predicted_us_per_call']} µs/call")
        for r in res["not_costed"]:
            print(f"  not costed: {r['name']} ({r['op_class']}) x {r['calls']}, launches {r['launches']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
