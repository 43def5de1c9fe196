"""Weight conversion into the tensor cache that survives being killed, and resumes where it stopped.

The cache for key K is written in a stable directory `K.partial/` beside its final place. Every time a
shard is finished, the shard files are fsynced and a small journal (`journal.json`, replaced atomically)
records the writer's state: the finished shards (size, md5, records), the open shard's records and length,
the next shard index. A rerun of the same build validates the journal against the files, skips the
tensors already written (without reading or quantizing them), cuts the open shard back to its recorded
length and carries on; at the end the journal is removed, a manifest of the files' sizes and sha256 is
written (cache.write_entry_manifest: a later build reuses `K/` only when it matches) and `K.partial/` is
renamed to `K/`. Because the writer's packing is a pure function of the tensor sequence, the result is
byte-identical to an uninterrupted run. A journal that is unreadable or does not match is dropped with a one-line note and
the conversion starts over. A lock file (`K.lock`) keeps two builds from writing the same directory.

`MLP_FAIL_AFTER_SHARDS=N` (for tests) makes the process exit at once (`os._exit(99)`) right after the
N-th shard this process finished has been journaled.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts.bundle import _swap_in, raise_if_disk_full
from pipeline.artifacts.tensor_cache import DEFAULT_SHARD_CAP, INDEX, ResumeError, TensorCacheWriter
from pipeline.cache import ENTRY_MANIFEST, reusable_entry, write_entry_manifest
from pipeline.errors import PipelineError
from pipeline.quant.convert import iter_converted

JOURNAL = "journal.json"
JOURNAL_VERSION = 1
FAIL_ENV = "MLP_FAIL_AFTER_SHARDS"
FAIL_EXIT_CODE = 99


def partial_dir(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


def param_nbytes(params: list[tuple[str, Any]]) -> list[int]:
    return [int(np.prod([int(x) for x in p.shape])) * np.dtype(p.dtype).itemsize for _, p in params]


@contextmanager
def _locked(final: Path, report: Any) -> Iterator[Any]:
    """Hold an exclusive lock on `final`'s lock file; yields a function that drops the lock file once
    `final` is complete (kept otherwise, so no two builds can ever hold different lock files)."""
    lock = final.with_name(final.name + ".lock")
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report.info(f"quantize: another build is converting these weights ({lock.name}); waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield lambda: lock.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_journal(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data))   # key order kept: records are restored into tensor-cache.json as they are
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _read_journal(path: Path, expect: dict, names: list[str]) -> tuple[dict | None, str | None]:
    """(writer state, None) for a journal that fits this conversion; (None, why) for one that does not;
    (None, None) when there is none."""
    if not path.exists():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"it is unreadable ({type(err).__name__})"
    if not isinstance(data, dict):
        return None, "it is not a JSON object"
    for field, value in expect.items():
        if data.get(field) != value:
            return None, f"its {field} does not match this build"
    state = data.get("writer")
    try:
        records = [r for shard in state["shards"] for r in shard["records"]]
        if state["open"] is not None:
            records += state["open"]["records"]
        done = [r["name"] for r in records]
    except (KeyError, TypeError) as err:
        return None, f"its writer state is malformed ({type(err).__name__})"
    if sorted(done) != sorted(names[:len(done)]):
        return None, "the tensors it lists are not a prefix of this model's parameters"
    return state, None


def convert_weights(ckpt: Any, params: list[tuple[str, Any]], layout: str, final: Path, *, report: Any,
                    tied: bool = False, metadata: dict | None = None, shard_cap_bytes: int | None = None,
                    block_bytes: int | None = None,
                    after_shard: Callable[[int], None] | None = None,
                    stats: dict | None = None, calibration: Any = None) -> Path:
    """Convert `params` from `ckpt` into the tensor cache `final`, resuming an interrupted run.

    `after_shard(n)` (tests) is called after the n-th shard finished by this call has been journaled;
    `stats` collects conversion statistics (ternary error) of the tensors converted by this call;
    `calibration` (calibrate.Calibration) selects calibrated quantization (see convert.iter_converted).
    """
    final = Path(final)
    cap = int(shard_cap_bytes or DEFAULT_SHARD_CAP)
    metadata = dict(metadata or {})
    names = [n for n, _ in params]
    sizes = param_nbytes(params)
    final.parent.mkdir(parents=True, exist_ok=True)
    fail_after = int(os.environ.get(FAIL_ENV) or 0)
    with _locked(final, report) as drop_lock:
        if reusable_entry(final, INDEX, "quantize", report):   # another build finished it while we waited
            return final
        partial = partial_dir(final)
        journal = partial / JOURNAL
        expect = {"version": JOURNAL_VERSION, "key": final.name, "shard_cap_bytes": cap, "metadata": metadata,
                  "params": len(params)}
        state, why = _read_journal(journal, expect, names)
        writer = None
        if state is not None:
            try:
                writer = TensorCacheWriter(partial, cap, metadata, durable=True, resume=state)
            except ResumeError as err:
                why = str(err)
        if writer is None:
            if why:
                report.info(f"quantize: cannot resume from {journal} ({why}); starting over")
            shutil.rmtree(partial, ignore_errors=True)
            writer = TensorCacheWriter(partial, cap, metadata, durable=True)
        start = writer.tensor_count
        done = sum(sizes[:start])
        if start:
            report.info(f"quantize: resuming {final.name}: skipped {len(state['shards'])} finished shards "
                        f"({start} of {len(params)} tensors, {done / 1e9:.2f} GB already converted)")
        try:
            with report.bytes_bar("quantize", sum(sizes), completed=done) as advance, writer:
                for name, arr in iter_converted(ckpt, params, layout, tied=tied, start=start,
                                                block_bytes=block_bytes, on_bytes=advance, stats=stats,
                                                calibration=calibration):
                    before = writer.shards_finished
                    writer.add(name, arr)
                    del arr                   # on disk now; do not hold it while the next one converts
                    if writer.shards_finished > before:
                        _write_journal(journal, {**expect, "writer": writer.state()})
                        if fail_after and writer.shards_finished >= fail_after:
                            os._exit(FAIL_EXIT_CODE)
                        if after_shard:
                            after_shard(writer.shards_finished)
            index = json.loads((partial / INDEX).read_text(encoding="utf-8"))
            keep = {INDEX} | {shard["dataPath"] for shard in index["records"]}
            for entry in partial.iterdir():
                if entry.name not in keep:
                    entry.unlink()
            write_entry_manifest(partial)   # last: what a later build checks the entry against
            _fsync_path(partial / INDEX)
            _fsync_path(partial / ENTRY_MANIFEST)
            _fsync_path(partial)
            _swap_in(partial, final)
            drop_lock()
        except BaseException as err:
            if isinstance(err, PipelineError):   # the inputs must change first, which changes the key:
                shutil.rmtree(partial, ignore_errors=True)   # nothing to resume, so no partial folder or lock left
                drop_lock()
            raise_if_disk_full(err, final, fix="free space and rerun the build: it resumes where it stopped")
            raise
    return final
