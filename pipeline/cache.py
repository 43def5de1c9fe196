"""Cache keys: what a cached output depends on, hashed, and where cached outputs live.

Every stage that caches (converted weights, compiled libraries, calibration statistics, bundles) keys
its output with `digest` over everything the output depends on, including `source_hash` (the pipeline's
own code) and `tvm_versions`, so a changed pass, kernel or compiler invalidates what it produced.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.config import ROOT

PIPELINE_DIR = Path(__file__).resolve().parent


def digest(obj: Any) -> str:
    """A short stable hash of a JSON-able description (dict keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


@functools.cache
def source_hash() -> str:
    """Content hash of the pipeline's own code: a changed pass or kernel invalidates cached outputs."""
    h = hashlib.sha256()
    for path in sorted(PIPELINE_DIR.rglob("*.py")):
        h.update(path.relative_to(PIPELINE_DIR).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def tvm_versions() -> dict[str, str]:
    return {"apache-tvm": version("apache-tvm"), "apache-tvm-ffi": version("apache-tvm-ffi"),
            "pipeline": __version__}


def cache_root() -> Path:
    return Path(os.environ.get("MLP_CACHE_DIR", ROOT / ".cache"))


FICLONE = 0x40049409   # Linux ioctl: make dst a copy-on-write clone of src (btrfs, XFS, ...)


def copy_file(src: Path, dst: Path) -> None:
    """Copy a cached file into a bundle (or a bundle's file into a release) so that the two never share bytes:
    a reflink where the filesystem offers one (instant, copy-on-write), else a plain copy. Never a hard link:
    editing one byte of a bundle then changed the cache entry and every other bundle built from it."""
    with open(src, "rb") as s, open(dst, "wb") as d:
        try:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        except OSError:
            shutil.copyfileobj(s, d, 16 * 2**20)
    shutil.copymode(src, dst)   # a library stays executable, as the release's tar headers record
