"""Cache keys: what a cached output depends on, hashed, and where cached outputs live.

Every stage that caches (converted weights, compiled libraries, calibration statistics, bundles) keys
its output with `digest` over everything the output depends on, including `source_hash` (the pipeline's
own code) and `tvm_versions`, so a changed pass, kernel or compiler invalidates what it produced.

Inputs enter keys by their full content: `remembered` keeps what was computed over a file's bytes (its
sha256, the finite check of its tensors) under the file's identity (path, size, mtime, ctime, inode), so an
unchanged checkpoint is read once, not on every build. Weights and library entries carry a manifest of
their files' sizes and hashes (`write_entry_manifest`) and are checked against it before reuse
(`damaged_entry`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
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


# ------------------------------------------------------------------------------ content hashes, remembered
HASH_STORE = "file-hashes"   # under cache_root(): one small JSON per (file identity, what was computed)
CHUNK = 4 * 2**20            # bytes read at a time; a multiple of every element size
RACY_S = 2.0                 # a file changed this recently may change again within its timestamp's tick
ENTRY_MANIFEST = "entry-manifest.json"   # inside a weights / lib cache entry: size + sha256 of its files


def file_identity(path: Path) -> dict[str, Any]:
    """What changes whenever the file's content may have: any write (even one that restores size and mtime
    with os.utime, or `cp -p` over it) moves ctime, a replaced file has a new inode."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


def remembered(path: Path, what: str, compute: Any) -> dict[str, Any]:
    """`compute()` (a JSON-able dict over the file's content), remembered under the file's identity and `what`
    so an unchanged file is read once, not on every build. Not remembered when the file changed while it
    was read, or so recently that a further write might leave its identity as it is."""
    before = file_identity(path)
    store = cache_root() / HASH_STORE / f"{digest([before['path'], what])}.json"
    try:
        saved = json.loads(store.read_text(encoding="utf-8"))
        if saved.get("identity") == before and saved.get("what") == what:
            return saved["result"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    result = compute()
    fresh = time.time_ns() - max(before["mtime_ns"], before["ctime_ns"]) < RACY_S * 1e9
    if file_identity(path) == before and not fresh:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f".{store.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"identity": before, "what": what, "result": result}), encoding="utf-8")
            os.replace(tmp, store)
        except OSError:   # a read-only or full cache only costs the next build a re-read
            tmp.unlink(missing_ok=True)
    return result


def stream_file(path: Path, h: Any, regions: Sequence[tuple[int, int]] = (),
                visit: Any = None) -> None:
    """Feed the whole file into hash `h` in one pass; `visit(i, view)` sees the bytes of region i (sorted,
    non-overlapping [start, end) ranges) in chunks that start at a multiple of CHUNK from the region's start,
    so an element never straddles two chunks."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    size = os.stat(path).st_size
    bounds = sorted((s, e, i) for i, (s, e) in enumerate(regions) if e > s)
    with open(path, "rb", buffering=0) as f:
        pos, r = 0, 0
        while pos < size:
            while r < len(bounds) and bounds[r][1] <= pos:
                r += 1
            inside = r < len(bounds) and bounds[r][0] <= pos
            stop = bounds[r][1] if inside else (bounds[r][0] if r < len(bounds) else size)
            want = min(CHUNK, stop - pos, size - pos)
            got = f.readinto(view[:want])
            if not got:
                raise OSError(f"{path} ended at byte {pos} of {size} while being read")
            h.update(view[:got])
            if inside and visit is not None:
                visit(bounds[r][2], view[:got])
            pos += got


def file_sha256(path: Path) -> str:
    """sha256 of the file's content, remembered under its identity (a cache entry is checked on every reuse)."""
    def compute() -> dict[str, Any]:
        h = hashlib.sha256()
        stream_file(path, h)
        return {"sha256": h.hexdigest()}
    return remembered(path, "sha256", compute)["sha256"]


def write_entry_manifest(entry: Path) -> None:
    """Record size + sha256 of every file of a cache entry, written last and atomically (tmp + rename)."""
    files = {p.relative_to(entry).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(entry.rglob("*")) if p.is_file() and p.name != ENTRY_MANIFEST}
    tmp = entry / f".{ENTRY_MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, entry / ENTRY_MANIFEST)


def damaged_entry(entry: Path) -> str | None:
    """Why the cache entry cannot be reused (a file missing, added, resized or changed), or None if intact."""
    try:
        files = json.loads((entry / ENTRY_MANIFEST).read_text(encoding="utf-8"))["files"]
        present = {p.relative_to(entry).as_posix() for p in entry.rglob("*")
                   if p.is_file() and p.name != ENTRY_MANIFEST}
        for rel in sorted(set(files) | present):
            if rel not in files:
                return f"{rel} is not in its {ENTRY_MANIFEST}"
            if rel not in present:
                return f"{rel} is missing"
            if (entry / rel).stat().st_size != files[rel]["size"] or file_sha256(entry / rel) != files[rel]["sha256"]:
                return f"{rel} differs from its {ENTRY_MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {ENTRY_MANIFEST} is missing or unreadable"
    return None


def reusable_entry(entry: Path, marker: str, stage: str, report: Any) -> bool:
    """True for a complete, intact cache entry (a cache hit); a damaged one is said in one line and removed,
    so the stage rebuilds it: a cache entry is never reused unchecked."""
    if not (entry / marker).exists():
        return False
    why = damaged_entry(entry)
    if why is None:
        report.info(f"{stage}: cache hit ({entry.name})")
        return True
    report.info(f"{stage}: cache entry {entry.parent.name}/{entry.name} is damaged ({why}); rebuilding it")
    shutil.rmtree(entry, ignore_errors=True)
    return False
