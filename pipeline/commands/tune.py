"""`make tune` / `python -m pipeline tune`: MetaSchedule searches of a model's hot kernels, measured on the
machine that runs the code (here, or a device behind a TVM RPC tracker); records go to the target's tuning
database (compiler/tuning.py), which later builds apply."""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import LocalBuilder
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, LocalRunner, RPCConfig, RPCRunner

from pipeline.compiler.schedule import is_scheduled, schedule_module
from pipeline.compiler.tuning import HOT_CLASSES, TunedRecord, workload_key, write_record
from pipeline.config import load_model, load_quant, load_target
from pipeline.errors import ConfigError
from pipeline.op_classes import classify
from pipeline.progress import Reporter
from pipeline.stages import define, fuse, load


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
    return sum(math.prod(int(d) for d in p.shape) for p in func.params if isinstance(p.ty, tirx.BufferType))


def tune_kernel(func: Any, name: str, target_name: str, tvm_target: Any, rules: tuple[str, ...], device: str,
                trials: int, rpc: RPCSpec | None, work_dir: Path) -> TunedRecord:
    """MetaSchedule search for one kernel, measured through the RPC tracker (or locally); the default
    rule's schedule is measured the same way for the comparison in the record."""
    main = func.with_attr("global_symbol", "main")
    tvm_target = _with_cores(tvm_target)
    evaluator = EvaluatorConfig(number=3, repeat=3, min_repeat_ms=20, enable_cpu_cache_flush=False)
    if rpc is not None:
        runner = RPCRunner(RPCConfig(rpc.host, rpc.port, rpc.key, session_timeout_sec=120), evaluator)
    else:
        runner = LocalRunner(evaluator)
    try:
        import xgboost  # noqa: F401 - optional (MetaSchedule's cost model): present or not, said in one line
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
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tvm_target)
    with tempfile.TemporaryDirectory(prefix="mlp-measure-") as tmp:
        path = Path(tmp) / "kernel.so"
        lib.export_library(str(path))
        if rpc is not None:
            from tvm import rpc as tvm_rpc  # local: RPC needs tornado, only for RPC=host:port:key

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
