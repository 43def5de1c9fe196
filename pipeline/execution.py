"""Which kernels of a build were executed here, and on what: the coverage report's "executed here" column.

Nothing is claimed without a run. For `verify_kernels: pocl` targets (android-adreno) the build runs
the existing PoCL verification on the kernels of a twin of the model: the same architecture, sizes and
weight formats with one layer of each kind and fp32 activations and scales (PoCL has no fp16), fused by
the same passes and scheduled by the target's own rules. Every kernel of the build whose twin ran on
PoCL and matched the unscheduled PrimFunc built by LLVM is "executed here (PoCL)"; the rest say why
they were only compiled (KV-cache-driven, host code, no OpenCL device, ...). Other targets record why
nothing ran at build time (Hexagon: no HVX runtime here).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

# Kernels the paged KV cache drives with its own page tables / position maps: random inputs would index
# out of bounds, so they are only compiled here (decode attention runs on PoCL in tests/test_opencl_exec.py).
KV_DRIVEN = ("paged_kv", "ragged_kv", "tree_attn", "kv_cache", "kv_copy", "copy_single_page", "merge_state",
             "fused_rope")
TOLERANCE = 1e-4          # of the output's largest magnitude
SEQ_LEN = 5               # the symbolic seq_len of prefill kernels
MAX_ARG_BYTES = 256 * 2**20   # bigger kernels (a 27B model's vocab GEMV) are only compiled: RAM and time
AUTO_VERIFY_MAX_BYTES = 2**30   # bigger models verify only with --verify (minutes, GBs of random inputs)
MAX_RESTARTS = 8              # child processes per build (each crash costs one kernel's verdict)
CHILD_TIMEOUT_S = 900


def not_executed(why: str) -> str:
    return f"compiled, not executed ({why})"


def executed(how: str) -> str:
    return f"executed here ({how})"


def signature(func: Any) -> list[list[str]]:
    """Buffer shapes of a kernel (dtypes aside: the twin runs fp32 where the build has fp16)."""
    from tvm import tirx

    return [[str(d) for d in p.shape] for p in func.params if isinstance(p.ty, tirx.BufferType)]


def verdicts(target: Any, records: list[Any], verify: bool, twin: Any = None,
             mod: Any = None) -> tuple[dict[str, str], dict[str, Any]]:
    """{kernel: "executed here (...)" | "compiled, not executed (...)"} and a summary for the report.

    A build kernel counts as executed only when the twin has a kernel of the same name and buffer shapes."""
    names = [r.name for r in records]
    on_host = {r.name for r in records if r.rule == "forced-cpu"}
    if getattr(target, "npu", None):
        out = {r.name: not_executed("HVX: no Hexagon runtime / FastRPC here" if r.on_device
                                    else "aarch64 CPU code") for r in records}
        return out, _summary(out, "none at build time")
    if not target.is_gpu:
        why = ("runs here with python -m pipeline run, not at build time" if target.runnable_here
               else f"{target.name} CPU code")
        out = {n: not_executed(why) for n in names}
        return out, _summary(out, "none at build time")
    if target.tvm_target.get("kind") != "opencl":
        out = {n: not_executed(f"no {target.tvm_target.get('kind')} device here") for n in names}
        return out, _summary(out, "none at build time")
    if verify == "too-big":
        out = {n: not_executed(f"build-time verification skipped: over {AUTO_VERIFY_MAX_BYTES // 2**30} GiB of "
                               "weights; pass --verify") for n in names}
        return out, _summary(out, "skipped (model size)")
    if not verify:
        out = {n: not_executed("kernel verification off (--no-verify or the target's verify_kernels)")
               for n in names}
        return out, _summary(out, "off")
    from . import verify_opencl

    if verify == "no-device" or verify_opencl.find_opencl_device() is None:
        out = {n: not_executed("no OpenCL device here: install pyopencl + pocl-opencl-icd") for n in names}
        return out, _summary(out, "no OpenCL device")
    t0 = time.time()
    results = run_twin(twin, target) if twin is not None else {}
    out = {}
    for n in names:
        if n in on_host:
            out[n] = not_executed("pinned to the CPU: aarch64 host code")
        elif any(k in n for k in KV_DRIVEN):
            out[n] = not_executed("driven by the paged KV cache's runtime tables")
        elif n in results and (mod is None or results[n][0] == signature(mod[n])):
            out[n] = results[n][1]
        else:
            out[n] = not_executed("no fp32 twin of this kernel (same name and shapes) to run on PoCL")
    return out, _summary(out, f"PoCL vs LLVM on an fp32 twin of the model ({time.time() - t0:.0f} s)")


def _summary(out: dict[str, str], how: str) -> dict[str, Any]:
    ran = [n for n, v in out.items() if v.startswith("executed here")]
    bad = [n for n, v in out.items() if "MISMATCH" in v]
    return {"executed": len(ran), "not_executed": len(out) - len(ran), "mismatched": sorted(bad), "how": how}


def twin_module(loaded: Any, quant: Any, target: Any):
    """The model with one layer of each kind, fp32 activations and scales, fused like the build."""
    import tvm

    from .fuse import fusion_passes
    from .models import model_class
    from .models.layers import LayerFactory

    cfg = loaded.decoder
    if hasattr(cfg, "layer_types"):
        keep = max(cfg.layer_types.index(k) for k in set(cfg.layer_types)) + 1
        cfg = dataclasses.replace(cfg, num_hidden_layers=keep, layer_types=list(cfg.layer_types[:keep]))
    else:
        cfg = dataclasses.replace(cfg, num_hidden_layers=1)
    weight_dtype = "float32"
    factory = LayerFactory("float32", quant.weight_format, weight_dtype, quant.layout_for(target),
                           scale_dtype="float32", formats=dict(quant.formats), rotation=quant.rotation,
                           ternary_source=quant.ternary_source)
    twin_target = dataclasses.replace(target, compute_dtype="float32",
                                      tvm_target={**target.tvm_target, "host": {"kind": "llvm"}})
    module = model_class(cfg)(cfg, factory, twin_target.tvm())
    mod, _ = module.export_tvm(spec=module.export_spec())
    with twin_target.tvm():
        mod = tvm.transform.Sequential(fusion_passes())(mod)
    return mod


def run_twin(mod: Any, target: Any) -> dict[str, tuple[list[list[str]], str]]:
    """Run the twin's kernels in a child process, so that a kernel that crashes the OpenCL driver (or reads
    out of bounds on random inputs) costs its own verdict, not the build: the child streams one JSON line
    per kernel; when it dies, the kernel it had started is marked crashed and a new child goes on.
    {kernel: (its buffer shapes, verdict)}."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    import tvm

    from .config import ROOT

    out: dict[str, tuple[list[list[str]], str]] = {}
    with tempfile.TemporaryDirectory(prefix="mlp-verify-") as tmp:
        twin, log = Path(tmp) / "twin.json", Path(tmp) / "results.jsonl"
        twin.write_text(tvm.ir.save_json(mod))
        spec = json.dumps({"tvm_target": dict(target.tvm_target), "rules": list(target.schedule_rules)})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        for _ in range(MAX_RESTARTS):
            skip = json.dumps(sorted(out))
            try:
                code = subprocess.run([sys.executable, "-m", "pipeline.execution", str(twin), spec, str(log), skip],
                                      env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            started = None
            for line in log.read_text().splitlines() if log.exists() else []:
                rec = json.loads(line)
                if "start" in rec:
                    started = rec
                else:
                    out[rec["name"]] = (rec["sig"], rec["verdict"])
                    started = None
            log.unlink(missing_ok=True)
            if code == 0:
                break
            if started is None:   # died before any kernel: nothing more to learn
                break
            out[started["start"]] = (started["sig"], not_executed(f"the PoCL run crashed (exit {code})"))
    return out


def _run_kernels(twin_path: str, spec: dict[str, Any], log_path: str, skip: list[str]) -> None:
    """Child process: schedule, run on PoCL and LLVM, compare, one JSON line per kernel (see run_twin)."""
    import os
    import warnings

    import tvm
    from tvm import tirx

    warnings.filterwarnings("ignore")      # pyopencl's "non-empty compiler output"
    mod = tvm.ir.load_json(open(twin_path).read())
    target = tvm.target.Target({**spec["tvm_target"], "host": {"kind": "llvm"}})
    with open(log_path, "a") as log:
        for gv, func in mod.functions_items():
            name = gv.name_hint
            if not isinstance(func, tirx.PrimFunc) or any(k in name for k in KV_DRIVEN) or name in skip:
                continue
            sig = signature(func)
            log.write(json.dumps({"start": name, "sig": sig}) + "\n")
            log.flush()
            if os.environ.get("MLP_VERIFY_ABORT_ON") == name:   # test hook: a kernel that kills the driver
                os.abort()
            verdict = run_kernel(name, func, target, tuple(spec["rules"]))
            log.write(json.dumps({"name": name, "sig": sig, "verdict": verdict}) + "\n")
            log.flush()


def run_kernel(name: str, func: Any, target: Any, rules: tuple[str, ...]) -> str:
    """One kernel: scheduled by the target's rules, run on PoCL, compared with LLVM; the verdict."""
    import tvm

    from .tune import schedule_module
    from .verify_opencl import opencl_kernels, run_on_llvm, run_on_pocl

    try:
        args = random_args(func, np.random.default_rng(0), {"seq_len": SEQ_LEN})
    except KeyError as err:
        return not_executed(f"symbolic size {err.args[0]} has no test value here")
    size = sum(a.nbytes for a in args)
    if size > MAX_ARG_BYTES:
        return not_executed(f"too large to run here ({size / 2**20:.0f} MiB of arguments)")
    try:
        func = func.with_attr("global_symbol", name)
        scheduled, _ = schedule_module(tvm.IRModule({name: func}), target, rules, "gpu")
        expected = run_on_llvm(func, [a.copy() for a in args])[-1]
        got = run_on_pocl(opencl_kernels(scheduled, target), name, [a.copy() for a in args])[-1]
    except Exception as err:  # noqa: BLE001 - one kernel that cannot run here must not stop the others
        return not_executed(f"PoCL run failed: {str(err).strip().splitlines()[-1][:80]}")
    scale = max(float(np.abs(expected).max()), 1e-30)
    err = float(np.abs(got - expected).max()) / scale
    if err <= TOLERANCE:
        return executed(f"PoCL, fp32 twin, matches LLVM: rel. err {err:.1e}")
    return executed(f"PoCL, fp32 twin: MISMATCH vs LLVM, rel. err {err:.1e}")


def random_args(func: Any, rng: np.random.Generator, sizes: dict[str, int]) -> list[np.ndarray]:
    """Inputs for a kernel: random codes / normals, small in-range integers for ids and row indices."""
    from tvm import tirx

    from .verify_opencl import _param_spec

    args = []
    for p in func.params:
        spec = _param_spec(p)
        shape = tuple(int(d) if isinstance(d, (int, tirx.IntImm)) else sizes[str(d)] for d in spec.shape)
        if spec.dtype == "uint32":
            args.append(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))
        elif spec.dtype.startswith("int"):
            args.append(rng.integers(0, 16, shape).astype(spec.dtype))
        else:
            args.append(rng.standard_normal(shape).astype(spec.dtype))
    return args


def annotate(report: dict[str, Any], verdict: dict[str, str], summary: dict[str, Any]) -> None:
    """Add the per-kernel column and the counts to a coverage report (in place)."""
    for row in report["kernels"]:
        row["executed"] = verdict.get(row["name"], not_executed("not recorded"))
    report["summary"]["execution"] = summary


if __name__ == "__main__":   # the child of run_twin
    _run_kernels(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
