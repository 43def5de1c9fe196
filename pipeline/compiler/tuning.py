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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm.s_tir import Schedule
from tvm.s_tir.schedule import Trace

from pipeline.config import ROOT
from pipeline.errors import ConfigError

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
    root = os.environ.get(TUNING_DIR_ENV)
    return (Path(root) if root else ROOT / "targets") / target_name / "tuning"


def workload_key(func: Any) -> str:
    """The kernel's identity across models and builds: structural hash of the function named `main`."""
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

