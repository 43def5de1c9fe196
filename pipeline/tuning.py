"""Tuned schedules: MetaSchedule searches measured on the machine that runs the code, kept per target in
the repository (`targets/<target>/tuning/`) and applied by builds before the default rules.

Measurement goes through a TVM RPC tracker (`python -m tvm.exec.rpc_tracker`) to which phones (TVM's
Android RPC app) or boards register under a key — the device-farm engine TVM already has. Without
`--rpc` the search measures on this machine (right for host-cpu only).

The database is one small JSON file per (kernel workload, device key): the workload is the structural
hash of the unscheduled kernel, so a record applies to every model that has the same kernel, and files
from several devices or CI jobs merge by copying them side by side (distinct names, never the same file
edited twice). A build takes, per workload, the fastest record of its target's folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

TUNING_DIR_ENV = "MLP_TUNING_DIR"   # another database root (tests, CI jobs), <root>/<target>/
HOT_CLASSES = ("dequant-gemv", "dequant-matmul", "dequant-gemv-ternary", "dequant-matmul-ternary", "gemv", "matmul",
               "attention", "gdn-recurrence")


@dataclass
class TunedRecord:
    workload: str          # structural hash of the unscheduled kernel
    kernel: str            # its name where it was tuned (for people; names differ between models)
    target: str            # pipeline target name
    device_key: str        # RPC key it was measured on, or "local"
    latency_us: float      # best measured run of the tuned schedule
    default_us: float | None   # the default rule's schedule, measured the same way
    trials: int
    trace: str             # the schedule: a MetaSchedule trace (tvm.ir.save_json), replayed at build time
    tvm: str

    @property
    def file_name(self) -> str:
        return f"{self.kernel[:60]}-{self.workload}-{_safe(self.device_key)}.json"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text) or "device"


def database_dir(target_name: str) -> Path:
    from .config import ROOT

    root = os.environ.get(TUNING_DIR_ENV)
    return (Path(root) if root else ROOT / "targets") / target_name / "tuning"


def workload_key(func: Any) -> str:
    """The kernel's identity across models and builds: structural hash of the function named `main`."""
    import tvm_ffi

    return f"{tvm_ffi.structural_hash(func.with_attr('global_symbol', 'main')) & (2**64 - 1):016x}"


def load_database(target_name: str) -> dict[str, TunedRecord]:
    """{workload: fastest record} over every file of the target's folder (any device key); a record no
    faster than the default rule it was measured against is not applied."""
    best: dict[str, TunedRecord] = {}
    folder = database_dir(target_name)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            rec = TunedRecord(**json.loads(path.read_text()))
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{path}: not a tuning record ({err})",
                              fix="delete the file or re-run make tune for this target") from None
        if rec.default_us is not None and rec.latency_us >= rec.default_us:
            continue   # no faster than the default rule measured beside it: kept for reference, not applied
        if rec.workload not in best or rec.latency_us < best[rec.workload].latency_us:
            best[rec.workload] = rec
    return best


def database_digest(target_name: str) -> str:
    """A hash of the target's tuning files: part of the build cache key (new records -> rebuild)."""
    h = hashlib.sha256()
    folder = database_dir(target_name)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def apply_record(func: Any, record: TunedRecord) -> Any:
    """The kernel scheduled by replaying the record's trace (raises if the trace does not fit)."""
    import tvm
    from tvm.s_tir import Schedule
    from tvm.s_tir.schedule import Trace

    sch = Schedule(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    Trace.apply_json_to_schedule(tvm.ir.load_json(record.trace), sch)
    return sch.mod["main"]


def write_record(record: TunedRecord, target_name: str) -> Path:
    """Write one record atomically (temp file + rename) into the target's database folder."""
    folder = database_dir(target_name)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / record.file_name
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".partial-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, final)
    return final


# ------------------------------------------------------------------------------------------ search
@dataclass
class RPCSpec:
    host: str
    port: int
    key: str

    @classmethod
    def parse(cls, text: str) -> RPCSpec:
        parts = text.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[0] or not parts[2]:
            raise ConfigError(f"RPC={text!r} is not host:port:key", fix="e.g. RPC=127.0.0.1:9190:android")
        return cls(parts[0], int(parts[1]), parts[2])


def hot_kernels(mod: Any, names: list[str] | None = None, limit: int = 4) -> tuple[list[str], dict[str, str]]:
    """Kernels worth tuning (HOT_CLASSES, static shapes, not pre-scheduled by TVM's library), biggest
    first; and {kernel: why it is not tuned} for the hot ones left out."""
    from tvm import tirx

    from .coverage import classify
    from .tune import is_scheduled

    picked, skipped = [], {}
    for gv, func in mod.functions_items():
        name = gv.name_hint
        if not isinstance(func, tirx.PrimFunc) or (names and not any(n in name for n in names)):
            continue
        if classify(name, func) not in HOT_CLASSES:
            continue
        if is_scheduled(func):
            skipped[name] = "TVM library kernel (scheduled by its generator)"
        elif any(not isinstance(d, tirx.IntImm) for p in func.params if isinstance(p.ty, tirx.BufferType)
                 for d in p.shape):
            skipped[name] = "symbolic shape (MetaSchedule tunes static shapes; prefill keeps its rule)"
        else:
            picked.append((_work(func), name))
    picked.sort(reverse=True)
    return [n for _, n in picked[:limit]], skipped


def _work(func: Any) -> int:
    """Elements touched: a cheap proxy for how much a kernel costs."""
    import math

    from tvm import tirx

    return sum(math.prod(int(d) for d in p.shape) for p in func.params if isinstance(p.ty, tirx.BufferType))


def tune_kernel(func: Any, name: str, target_name: str, tvm_target: Any, rules: tuple[str, ...], device: str,
                trials: int, rpc: RPCSpec | None, work_dir: Path) -> TunedRecord:
    """MetaSchedule search for one kernel, measured through the RPC tracker (or locally); the default
    rule's schedule is measured the same way for the comparison in the record."""
    import tvm
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder import LocalBuilder
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, LocalRunner, RPCConfig, RPCRunner

    from .tune import schedule_module

    main = func.with_attr("global_symbol", "main")
    tvm_target = _with_cores(tvm_target)
    evaluator = EvaluatorConfig(number=3, repeat=3, min_repeat_ms=20, enable_cpu_cache_flush=False)
    if rpc is not None:
        runner = RPCRunner(RPCConfig(rpc.host, rpc.port, rpc.key, session_timeout_sec=120), evaluator)
    else:
        runner = LocalRunner(evaluator)
    try:
        import xgboost  # noqa: F401
        cost_model = "xgb"
    except ImportError:
        cost_model = "random"
    db = ms.tune_tir(tvm.IRModule({"main": main}), tvm_target, str(work_dir), max_trials_global=trials,
                     num_trials_per_iter=min(trials, 16), builder=LocalBuilder(timeout_sec=300), runner=runner,
                     cost_model=cost_model, seed=0)
    sch = db.query_schedule(tvm.IRModule({"main": main}), tvm_target, workload_name="main")
    measured = [r for r in db.get_all_tuning_records() if r.run_secs]
    if sch is None or not measured:
        raise RuntimeError(f"{name}: no candidate ran (see {work_dir}/logs)")
    best = min(_median_us(r.run_secs) for r in measured)
    scheduled, _ = schedule_module(tvm.IRModule({"main": main}), tvm_target, rules, device)   # as a build would
    default_us = _measure(scheduled["main"], tvm_target, rpc, evaluator)
    return TunedRecord(workload=workload_key(func), kernel=name, target=target_name,
                       device_key=rpc.key if rpc else "local", latency_us=best, default_us=default_us,
                       trials=trials, trace=tvm.ir.save_json(sch.trace.as_json(remove_postproc=False)),
                       tvm=tvm.__version__)


def _with_cores(tvm_target: Any) -> Any:
    """MetaSchedule's CPU rules need the core count in an llvm target; this machine's when unset."""
    import tvm

    spec = dict(tvm_target.export())
    if spec.get("kind") == "llvm" and not spec.get("num-cores"):
        spec["num-cores"] = os.cpu_count() or 1
        return tvm.target.Target(spec)
    return tvm_target


def _median_us(run_secs: Any) -> float:
    values = sorted(float(x) for x in run_secs)
    return values[len(values) // 2] * 1e6


def _measure(func: Any, tvm_target: Any, rpc: RPCSpec | None, evaluator: Any) -> float:
    """Median run time (us) of one compiled kernel on the device (through the tracker) or here."""
    import numpy as np
    import tvm
    from tvm import tirx

    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tvm_target)
    with tempfile.TemporaryDirectory(prefix="mlp-measure-") as tmp:
        path = Path(tmp) / "kernel.so"
        lib.export_library(str(path))
        if rpc is not None:
            from tvm import rpc as tvm_rpc

            session = tvm_rpc.connect_tracker(rpc.host, rpc.port).request(rpc.key, session_timeout=120)
            session.upload(str(path))
            module, dev = session.load_module(path.name), session.cpu()
        else:
            module, dev = tvm.runtime.load_module(str(path)), tvm.cpu()
        rng = np.random.default_rng(0)
        args = []
        for p in func.params:
            if not isinstance(p.ty, tirx.BufferType):
                continue
            shape = [int(d) for d in p.shape]
            arr = (rng.integers(0, 2**31, shape).astype(str(p.dtype)) if "int" in str(p.dtype)
                   else rng.standard_normal(shape).astype(str(p.dtype)))
            args.append(tvm.runtime.tensor(arr, dev))
        timer = module.time_evaluator("main", dev, number=evaluator.number, repeat=evaluator.repeat,
                                      min_repeat_ms=evaluator.min_repeat_ms)
        return _median_us(timer(*args).results)


def tune(model: str, target: str, *, rpc: str | None = None, trials: int = 32, kernels: list[str] | None = None,
         limit: int = 4, report: Any = None) -> list[TunedRecord]:
    """`make tune`: tune the model's hot kernels for the target and write their records."""
    from .config import load_model, load_quant, load_target
    from .progress import Reporter
    from .stages import define, fuse, load

    report = report or Reporter()
    spec = load_target(target)
    rpc_spec = RPCSpec.parse(rpc) if rpc else None
    if rpc_spec is None and not spec.runnable_here:
        raise ConfigError(f"target {target!r} runs on a device, not here: tuning needs it measured there",
                          fix="start an RPC tracker, register the device under a key and pass RPC=host:port:key")
    if trials < 1:
        raise ConfigError(f"TRIALS={trials}", fix="pass a positive number of trials")
    with report.step(f"load {model}"):
        loaded = load(load_model(model))
    defined = define(loaded, load_quant("q4f16"), spec, report)
    mod = fuse(defined, spec)
    names, skipped = hot_kernels(mod, kernels, limit)
    for name, why in sorted(skipped.items()):
        report.info(f"not tuned: {name} ({why})")
    if not names:
        raise ConfigError(f"no kernel of {model} on {target} to tune" + (f" matches {kernels}" if kernels else ""),
                          fix="check KERNELS= (substrings of kernel names) or the model")
    out = []
    for name in names:
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="mlp-tune-") as work, report.step(f"tune {name} ({trials} trials)"):
            rec = tune_kernel(mod[name], name, target, spec.tvm(), tuple(spec.schedule_rules), spec.device,
                              trials, rpc_spec, Path(work))
        path = write_record(rec, target)
        speed = f"{rec.default_us / rec.latency_us:.2f}x" if rec.default_us else "n/a"
        slower = rec.default_us is not None and rec.latency_us >= rec.default_us
        report.info(f"{name}: default {rec.default_us:.1f} us -> tuned {rec.latency_us:.1f} us ({speed}) "
                    f"in {time.time() - t0:.0f} s; {path}"
                    + (" — no faster than the default rule: kept, not applied (more TRIALS?)" if slower else ""))
        out.append(rec)
    return out
