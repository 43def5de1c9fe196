"""Tuning through a TVM RPC tracker (tuning.py): a tracker and two RPC servers on 127.0.0.1, one kernel
tuned for host-cpu with a few MetaSchedule trials, the record written, and a build applying it."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import tvm
from tvm import te

from pipeline.commands import tune as tune_command
from pipeline.compiler import tuning
from pipeline.compiler.schedule import schedule_module
from pipeline.errors import ConfigError

KEY = "mlp-test"
RULES = ("cpu_gemv", "cpu_reduction", "cpu_inline_parallel")


def _gemv():
    x = te.placeholder((1, 256), "float32", name="x")
    w = te.placeholder((256, 512), "float32", name="w")
    k = te.reduce_axis((0, 256), name="k")
    y = te.compute((1, 512), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="gemv")
    return te.create_prim_func([x, w, y])


@pytest.fixture()
def rpc_farm():
    """A tracker and two servers registered under one key: the device farm in miniature."""
    from tvm.rpc.server import Server
    from tvm.rpc.tracker import Tracker

    tracker = Tracker("127.0.0.1", port=9190, port_end=9290, silent=True)
    servers = [Server("127.0.0.1", port=9300, port_end=9400, key=KEY, tracker_addr=("127.0.0.1", tracker.port),
                      silent=True) for _ in range(2)]
    time.sleep(1)
    yield tune_command.RPCSpec("127.0.0.1", tracker.port, KEY)
    for s in servers:
        s.terminate()
    tracker.terminate()


@pytest.mark.slow     # ~3 min on 2 cores (MetaSchedule builder / runner pools): `make test-slow`
def test_tune_one_kernel_through_rpc_and_apply_it(rpc_farm, tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path / "db"))
    func = _gemv()
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    rec = tune_command.tune_kernel(func, "gemv", "host-cpu", target, RULES, "cpu", trials=4, rpc=rpc_farm,
                             work_dir=tmp_path / "work")
    path = tuning.write_record(rec, "host-cpu")
    assert path.parent == tmp_path / "db" / "host-cpu" / "tuning" and rec.device_key == KEY
    assert json.loads(path.read_text())["workload"] == tuning.workload_key(func)
    print(f"\ngemv 256x512: default rule {rec.default_us:.1f} us, tuned {rec.latency_us:.1f} us "
          f"({rec.default_us / rec.latency_us:.2f}x, {rec.trials} trials via the RPC tracker)")
    assert rec.latency_us > 0 and rec.default_us > 0

    # a build's tune stage applies the record in preference to the default rules, and it computes the same
    db = tuning.load_database("host-cpu")
    mod, records = schedule_module(tvm.IRModule({"gemv": func}), target, RULES, "cpu", db)
    assert records[0].rule == "tuned" and KEY in records[0].reason
    x = np.random.default_rng(0).standard_normal((1, 256)).astype("float32")
    w = np.random.default_rng(1).standard_normal((256, 512)).astype("float32")
    y = tvm.runtime.tensor(np.zeros((1, 512), "float32"))
    tvm.compile(tvm.IRModule({"main": mod["gemv"].with_attr("global_symbol", "main")}), target=target)["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(w), y)
    np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-4, atol=1e-4)


def test_databases_merge_and_the_fastest_record_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    base = dict(workload="ab" * 8, kernel="k", target="host-cpu", default_us=10.0, trials=4, trace=[], tvm="x")
    for key, us in (("phone-a", 5.0), ("phone-b", 3.0), ("ci", 7.0)):
        tuning.write_record(tuning.TunedRecord(device_key=key, latency_us=us, **base), "host-cpu")
    files = sorted(p.name for p in (tmp_path / "host-cpu" / "tuning").iterdir())
    assert len(files) == 3 and not any(f.startswith(".partial") for f in files)   # side by side, no clashes
    assert tuning.load_database("host-cpu")["ab" * 8].device_key == "phone-b"
    slow = dict(base, workload="cd" * 8)
    tuning.write_record(tuning.TunedRecord(device_key="ci", latency_us=12.0, **slow), "host-cpu")
    assert "cd" * 8 not in tuning.load_database("host-cpu")   # slower than its default rule: not applied
    digest = tuning.database_digest("host-cpu")
    tuning.write_record(tuning.TunedRecord(device_key="phone-c", latency_us=1.0, **base), "host-cpu")
    assert tuning.database_digest("host-cpu") != digest   # new records change the build key


def test_user_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="host:port:key"):
        tune_command.RPCSpec.parse("localhost:9190")
    with pytest.raises(ConfigError, match="RPC=host:port:key"):
        tune_command.tune("smollm2-135m", "android-adreno")
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    (tmp_path / "host-cpu" / "tuning").mkdir(parents=True)
    (tmp_path / "host-cpu" / "tuning" / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="bad.json: not a tuning record"):
        tuning.load_database("host-cpu")
