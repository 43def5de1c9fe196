"""Run GPU-scheduled kernels under Oclgrind, an OpenCL simulator that checks every memory access.

PoCL runs a work-group's work-items one after another, so a kernel whose work-items race on local memory, or
that reads a buffer out of bounds or before it is written, can still match LLVM there. Oclgrind (Debian
package `oclgrind`) interprets the same OpenCL C and reports data races (OCLGRIND_DATA_RACES), out-of-bounds
accesses (always) and uses of uninitialised values (OCLGRIND_UNINITIALIZED). It is an ICD: a child process
sees it as its only OpenCL platform through OCL_ICD_VENDORS pointing at a directory with one .icd file, and
runs the kernels there with the same launch plans as PoCL (pipeline.verify.opencl.run_on_pocl). Its
diagnostics go to a log file, attributed to our functions by the OpenCL kernel names each one launches.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ICD_LIBRARY = "liboclgrind-rt-icd.so"
SEARCH = ("/usr/lib/oclgrind", "/usr/lib/x86_64-linux-gnu/oclgrind", "/usr/lib/aarch64-linux-gnu/oclgrind",
          "/usr/local/lib/oclgrind", "/usr/local/lib")
CHECKS = {"OCLGRIND_DATA_RACES": "1", "OCLGRIND_UNINITIALIZED": "1", "OCLGRIND_MAX_ERRORS": "100000"}
# Oclgrind 21.10's uninitialised-value plugin stops on LLVM's `freeze` instruction, which its clang emits for
# some 64-bit index arithmetic (TVM's fallback-scheduled gathers): such a function is run again without that
# one check, and the run says so.
NO_FREEZE = "Unsupported instruction: freeze"
ROOT = Path(__file__).resolve().parents[2]


def oclgrind_library() -> Path | None:
    """Oclgrind's ICD library, or None when Oclgrind is not installed."""
    dirs = list(SEARCH)
    exe = shutil.which("oclgrind")
    if exe:
        prefix = Path(exe).resolve().parents[1]
        dirs += [str(prefix / "lib" / "oclgrind"), str(prefix / "lib")]
    return next((Path(d) / ICD_LIBRARY for d in dirs if (Path(d) / ICD_LIBRARY).is_file()), None)


@dataclass
class OclgrindRun:
    """Per function: its outputs (the arguments after the run, as run_on_pocl returns them), Oclgrind's reports
    ({kind: count}, addresses left out), and the first report in full."""

    outputs: dict[str, list[np.ndarray]] = field(default_factory=dict)
    reports: dict[str, dict[str, int]] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)   # functions the child could not run, and why
    unchecked: dict[str, str] = field(default_factory=dict)   # checks that could not run on a function, and why
    seconds: dict[str, float] = field(default_factory=dict)   # each function's time under Oclgrind

    def total(self, name: str | None = None) -> int:
        picked = [self.reports.get(name, {})] if name else self.reports.values()
        return sum(sum(r.values()) for r in picked)


def run_under_oclgrind(mod: Any, target: Any, cases: dict[str, list[np.ndarray]], timeout: float = 600) -> OclgrindRun:
    """Run each function of `mod` (GPU-scheduled, one IRModule) named in `cases` on those arguments under Oclgrind
    with its race / bounds / uninitialised checks on. `target`: the OpenCL target dict the kernels are built for."""
    run = _run(mod, target, cases, timeout, uninitialized=True)
    stopped = [n for n, first in run.first.items() if NO_FREEZE in first and n in cases]
    # After the plugin stopped on a kernel, later kernels of the same process got spurious uninitialised-value
    # reports (a SmolLM2 prefill matmul: 1440 in sequence, none alone): those run again without the stopped ones.
    # Functions that allocate a workspace between two launches (the split-KV decode attention) got them after
    # any earlier function of the process (its merge launch: one per output element; the same inputs alone, or
    # first in a process: none): those run again, each in a process of its own.
    order = list(cases)
    only_uninitialized = [n for n in order[1:] if n not in stopped and run.reports.get(n)
                          and all(k.startswith("Uninitialized") for k in run.reports[n])]
    after = [n for n in only_uninitialized if stopped and order.index(n) > order.index(stopped[0])]
    for group in ([after] if after else []) + [[n] for n in only_uninitialized if n not in after
                                               and _has_workspace(mod[n])]:
        alone = _run(mod, target, {n: cases[n] for n in group}, timeout, uninitialized=True)
        for n in group:
            for part in ("outputs", "reports", "first", "failed"):
                getattr(run, part).pop(n, None)
                if n in getattr(alone, part):
                    getattr(run, part)[n] = getattr(alone, part)[n]
    if stopped:
        again = _run(mod, target, {n: cases[n] for n in stopped}, timeout, uninitialized=False)
        for n in stopped:
            run.reports.pop(n, None)
            run.first.pop(n, None)
            for part in ("outputs", "reports", "first", "failed"):
                if n in getattr(again, part):
                    getattr(run, part)[n] = getattr(again, part)[n]
            run.unchecked[n] = "uninitialised values (Oclgrind 21.10 stops on LLVM's freeze instruction)"
    return run


def _has_workspace(func: Any) -> bool:
    """Whether a scheduled function allocates a global buffer outside its kernels (a workspace between launches)."""
    from tvm import tirx
    from tvm.s_tir import SBlock

    from pipeline.tir_walk import statements

    def buffers(s):
        return list(s.alloc_buffers) if isinstance(s, SBlock) else [s.buffer] if isinstance(s, tirx.AllocBuffer) else []

    return any(str(b.scope()) == "global" for s in statements(func.body) for b in buffers(s))


def _run(mod: Any, target: Any, cases: dict[str, list[np.ndarray]], timeout: float, uninitialized: bool) -> OclgrindRun:
    import tvm

    library = oclgrind_library()
    if library is None:
        raise RuntimeError("Oclgrind is not installed (Debian package `oclgrind`: `make system-deps`)")
    with tempfile.TemporaryDirectory(prefix="mlp-oclgrind-") as tmp:
        work = Path(tmp)
        (work / "icd").mkdir()
        (work / "icd" / "oclgrind.icd").write_text(f"{library}\n")
        (work / "module.json").write_text(tvm.ir.save_json(tvm.IRModule({n: mod[n] for n in cases})))
        (work / "spec.json").write_text(json.dumps({"target": dict(target), "names": list(cases)}))
        for i, name in enumerate(cases):
            np.savez(work / f"args{i}.npz", *cases[name])
        checks = {**CHECKS, "OCLGRIND_UNINITIALIZED": "1" if uninitialized else "0"}
        env = {**os.environ, **checks, "OCL_ICD_VENDORS": str(work / "icd"), "OCLGRIND_LOG": str(work / "log.txt"),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        child = subprocess.run([sys.executable, "-m", "pipeline.verify.oclgrind", str(work)], env=env,
                               capture_output=True, text=True, timeout=timeout)
        if child.returncode != 0 or not (work / "kernels.json").exists():
            raise RuntimeError(f"the Oclgrind run failed (exit {child.returncode}): "
                               f"{(child.stderr or child.stdout).strip().splitlines()[-1:]}")
        kernels = json.loads((work / "kernels.json").read_text())
        run = OclgrindRun(failed=kernels.pop("_failed", {}), seconds=kernels.pop("_seconds", {}))
        for i, name in enumerate(cases):
            if name in kernels:
                with np.load(work / f"out{i}.npz") as saved:
                    run.outputs[name] = [saved[f"arr_{j}"] for j in range(len(saved.files))]
        log = (work / "log.txt").read_text() if (work / "log.txt").exists() else ""
    owner = {k: name for name, ks in kernels.items() for k in ks}
    for report in _reports(log):
        kernel = next((line.split(":", 1)[1].strip() for line in report if line.strip().startswith("Kernel:")), "")
        name = owner.get(kernel, kernel or "?")
        kind = re.sub(r"0x[0-9a-f]+", "<addr>", report[0].strip())
        per = run.reports.setdefault(name, {})
        per[kind] = per.get(kind, 0) + 1
        run.first.setdefault(name, "\n".join(report))
    return run


def _reports(log: str) -> list[list[str]]:
    """Oclgrind's reports in its log: each starts with an unindented line (the kind of error) and goes on with
    indented lines, blank lines between its parts (a race names both work-items); its own notes are left out."""
    reports: list[list[str]] = []
    for line in log.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace() and not (reports and len(reports[-1]) == 1 and "FATAL" in reports[-1][0]):
            reports.append([line])
        elif reports:
            reports[-1].append(line)
    return [r for r in reports if not r[0].startswith("Oclgrind: ")]   # e.g. "errors suppressed"


def _child(work: Path) -> None:
    """In the child (Oclgrind its only OpenCL platform): build, run, save outputs and each function's kernels."""
    import warnings

    import tvm

    from pipeline.verify.opencl import run_on_pocl
    from pipeline.verify.opencl_plan import opencl_kernels

    warnings.filterwarnings("ignore")
    spec = json.loads((work / "spec.json").read_text())
    mod = tvm.ir.load_json((work / "module.json").read_text())
    kernels: dict[str, Any] = {"_failed": {}, "_seconds": {}}
    for i, name in enumerate(spec["names"]):
        t0 = time.monotonic()
        with np.load(work / f"args{i}.npz") as saved:
            args = [saved[f"arr_{j}"].copy() for j in range(len(saved.files))]
        try:
            program = opencl_kernels(tvm.IRModule({name: mod[name]}), spec["target"])
            kernels[name] = sorted({launch.kernel for launch in program.launches(name)})
            out = run_on_pocl(program, name, args)
        except Exception as err:  # noqa: BLE001 - one function that cannot run is reported, the others go on
            kernels.pop(name, None)
            kernels["_failed"][name] = str(err).strip().splitlines()[-1][:200] if str(err).strip() else repr(err)
            continue
        np.savez(work / f"out{i}.npz", *out)
        kernels["_seconds"][name] = round(time.monotonic() - t0, 2)
    (work / "kernels.json").write_text(json.dumps(kernels))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
