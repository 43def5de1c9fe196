"""What the native clients' builds share: content keys, the wheel's package folders, parallel cached compiles.

Used by clients/mlc_engine/build.py (MLC's engine for this machine) and clients/aarch64_vm/build.py (the TVM
runtime cross-built for phones). Both cache objects by a key over everything that shapes them and write a
folder's manifest last, so an interrupted build is never taken for a finished one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class Missing(Exception):
    """A build input (compiler, vendor archive, wheel file) is not on this machine; the message says how to get it."""


def key(inputs: dict) -> str:
    """A short, stable content key over a JSON-able description of a build's inputs."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise Missing(f"Python package `{name}` not importable by {sys.executable}; run `make setup` "
                      f"(or run this script with the repository's .venv/bin/python)")
    return Path(spec.origin).parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compile_all(root: Path, jobs: list[tuple[str, Path, list[str], Path]], workers: int, what: str) -> list[str]:
    """jobs: (label, source, compiler command and flags, object), run in `root`. Objects already there are
    skipped; each is written to a temporary name and renamed when complete. Returns the labels that failed
    (with the compiler's last lines logged)."""
    todo = [j for j in jobs if not j[3].is_file()]
    total, cached = len(jobs), len(jobs) - len(todo)
    if cached:
        log(f"{what}: {cached}/{total} objects cached")
    failures: list[str] = []
    counter = {"n": cached}
    lock = threading.Lock()

    def run(job):
        label, src, flags, obj = job
        t0 = time.perf_counter()
        tmp = obj.with_name(f"{obj.name}.{os.getpid()}.tmp")
        r = subprocess.run([*flags, "-c", str(src), "-o", str(tmp)], cwd=root, capture_output=True, text=True)
        with lock:
            counter["n"] += 1
            n = counter["n"]
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            tail = "\n".join(r.stderr.strip().splitlines()[-30:])
            log(f"[{n}/{total}] FAILED {label}\n{tail}")
            failures.append(label)
            return
        os.replace(tmp, obj)
        log(f"[{n}/{total}] {label} ({time.perf_counter() - t0:.1f} s)")

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(run, todo))
    return failures
