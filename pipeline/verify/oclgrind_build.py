"""The build's Oclgrind pass: the fp32 twin's GPU kernels again, under Oclgrind's data-race, out-of-bounds and
uninitialised-read checks. A default android-adreno build runs the kernels up to QUICK_MAX_ARG_BYTES of
arguments (where Oclgrind is installed); `--oclgrind` (`make build OCLGRIND=1`) all of them; `--no-oclgrind`
(`OCLGRIND=0`) none.

PoCL (execution.py) shows that a kernel computes the right numbers on one driver; it runs the work-items of
a work-group one after another, so a race or a read past a buffer can still give them. Oclgrind checks every
access of the same OpenCL C (verify/oclgrind.py). Here every twin kernel that PoCL runs gets the same kind of
inputs (integers in range and distinct: execution.small_ints) and runs under Oclgrind in one
child process; the verdict is appended to the kernel's "executed here" cell and summed up in one line.

Why a cap by default: Oclgrind interprets every work-item, so SmolLM2's whole twin (one layer, its 49152-row
lm_head GEMV and prefill matmuls included) takes ~15 minutes; the kernels at test shapes are checked in the
test suite (tests/test_oclgrind.py) whatever the build does.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import tvm
from tvm import tirx

from pipeline.compiler.schedule import schedule_module
from pipeline.verify.execution import (
    GATED_DELTA,
    KV_DRIVEN,
    MAX_ARG_BYTES,
    SEQ_LEN,
    TEST_SIZES,
    attention_heads,
    gated_delta_inputs,
    kv_args,
    random_args,
    small_ints,
)
from pipeline.verify.oclgrind import oclgrind_library, run_under_oclgrind

# TVM kernels with a known finding the build does not fix (docs/verification.md): reported, not counted against
# the build's own. None at present: kernels/gpu/kernel_fixes.py replaces or guards the ones Oclgrind found.
KNOWN_TVM: dict[str, str] = {}
TIMEOUT_S = 3600
# A default (or --verify) build of an OpenCL target runs only kernels with at most this many bytes
# of arguments: Oclgrind interprets every work-item, and time grows with the bytes a kernel reads (SmolLM2's
# twin, all kernels: ~15 min, most of it the 49152-row lm_head and the prefill matmuls). OCLGRIND=1 runs all.
QUICK_MAX_ARG_BYTES = 8 * 2**20


def missing() -> str | None:
    """Why the pass cannot run here, or None."""
    if oclgrind_library() is None:
        return "Oclgrind is not installed (Debian package `oclgrind`; `make system-deps` installs it)"
    return None


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def twin_cases(twin: Any, target: Any, max_arg_bytes: int | None = None
               ) -> tuple[Any, dict[str, list[np.ndarray]], dict[str, str], set[str]]:
    """(the twin's kernels scheduled for the target, {kernel: inputs}, {kernel: why it is not run}, the kernels
    of those left out by `max_arg_bytes`: more argument bytes than the default build's cap, QUICK_MAX_ARG_BYTES)."""
    heads = attention_heads(twin)
    rules = tuple(target.schedule_rules)
    funcs, cases, skipped, capped = {}, {}, {}, set()
    for gv, func in twin.functions_items():
        name = gv.name_hint
        if not isinstance(func, tirx.PrimFunc):
            continue
        rng = np.random.default_rng(0)
        try:
            if any(k in name for k in KV_DRIVEN):
                args = [np.asarray(a) for a in kv_args(name, func, rng, heads)]
            else:
                args = small_ints(random_args(func, rng, TEST_SIZES), SEQ_LEN)
                if name in GATED_DELTA:
                    args = gated_delta_inputs(args)
        except KeyError as err:
            skipped[name] = f"symbolic size {err.args[0]} has no test value here"
            continue
        nbytes = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        if nbytes > MAX_ARG_BYTES:
            skipped[name] = "too large to run here"
            continue
        if max_arg_bytes is not None and nbytes > max_arg_bytes:
            skipped[name] = (f"{_size(nbytes)} of arguments, over the default build's {_size(max_arg_bytes)}: "
                             "OCLGRIND=1 checks it")
            capped.add(name)
            continue
        func = func.with_attr("global_symbol", name)
        scheduled, _ = schedule_module(tvm.IRModule({name: func}), target.tvm(), rules, "gpu")
        funcs[name], cases[name] = scheduled[name], args
    return tvm.IRModule(funcs), cases, skipped, capped


def oclgrind_verdicts(twin: Any, target: Any, quick: bool = False) -> tuple[dict[str, str], dict[str, Any]]:
    """({kernel: Oclgrind's verdict}, summary) for the twin's kernels; `quick` (the default build): only those
    with at most QUICK_MAX_ARG_BYTES of arguments."""
    t0 = time.time()
    mod, cases, skipped, capped = twin_cases(twin, target, QUICK_MAX_ARG_BYTES if quick else None)
    run = run_under_oclgrind(mod, dict(target.tvm_target), cases, timeout=TIMEOUT_S)
    out = {n: f"Oclgrind: not run ({why})" for n, why in skipped.items()}
    counts = {"races": 0, "out_of_bounds": 0, "uninitialised": 0, "other": 0}
    known: dict[str, int] = {}
    for name in cases:
        if name in run.failed:
            out[name] = f"Oclgrind: could not run ({run.failed[name]})"
            continue
        reports = run.reports.get(name, {})
        if not reports:
            unchecked = f"; not checked: {run.unchecked[name]}" if name in run.unchecked else ""
            out[name] = f"Oclgrind: no report{unchecked}"
            continue
        total = sum(reports.values())
        out[name] = f"Oclgrind: {total} reports ({'; '.join(sorted(reports))})"
        if name in KNOWN_TVM:
            known[name] = total
            out[name] += f", known: {KNOWN_TVM[name]}"
            continue
        for kind, n in reports.items():
            key = ("races" if "race" in kind.lower() else "out_of_bounds" if "invalid" in kind.lower()
                   else "uninitialised" if "uninitialized" in kind.lower() else "other")
            counts[key] += n
    summary = {"run": len(cases) - len(run.failed), "kernels": len(cases) + len(skipped), **counts,
               "known_tvm": known, "failed": sorted(run.failed), "seconds": round(time.time() - t0),
               "over_quick_cap": len(capped),
               "kernel_seconds": dict(sorted(run.seconds.items(), key=lambda kv: -kv[1]))}
    return out, summary
