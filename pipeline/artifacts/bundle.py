"""Output directories that appear whole or not at all, and the bundle manifest.

`atomic_dir` builds into a hidden sibling directory and renames it into place only when everything
inside succeeded, so an interrupted or failed build never leaves half a bundle (or destroys the
previous good one). `write_manifest` / `verify_manifest` record and check every file's sha256.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path, PurePosixPath

from pipeline import __version__
from pipeline.errors import PipelineError, WeightsError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
REBUILD_FIX = "rebuild the bundle (rerun `python -m pipeline build` for it)"
_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


# ------------------------------------------------------------------------------------------ atomic_dir
def _remove(path: Path) -> None:
    """Delete a file, symlink or directory tree if it exists; never follows a symlink into its target."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _sweep_stale(parent: Path, name: str) -> None:
    """Remove temp / old siblings of `name` left by builds whose process no longer exists (e.g. kill -9)."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(?:tmp|old)-(\d+)")
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _remove(entry)


def _disk_full(err: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT OSError behind `err` (itself, its cause or its context), if any."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL_ERRNOS:
            return current
        current = current.__cause__ or current.__context__
    return None


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` is moved aside first and deleted only afterwards."""
    if not os.path.lexists(final):
        os.rename(tmp, final)
        return
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    _remove(old)
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        try:
            os.rename(old, final)        # put the previous version back
        except OSError:
            pass
        raise
    _remove(old)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temp directory beside `final` (same filesystem) to build into.

    On success the temp directory replaces `final` by rename; a previous `final` is renamed aside,
    the new one renamed in, then the old one deleted. On any exception (KeyboardInterrupt included)
    the temp directory is deleted and a previous `final` is left untouched. A full disk (ENOSPC) is
    reported as a PipelineError naming the file being written.
    """
    final = Path(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _sweep_stale(final.parent, final.name)
        _remove(tmp)
        tmp.mkdir()
        yield tmp
        _swap_in(tmp, final)
    except BaseException as err:
        _remove(tmp)
        raise_if_disk_full(err, final)
        raise


def raise_if_disk_full(err: BaseException, final: Path, fix: str = "free space or use --out on another disk") -> None:
    """Raise a one-line PipelineError naming the file being written when `err` is a full disk (ENOSPC)."""
    full = _disk_full(err)
    if full is not None:
        where = full.filename or final
        raise PipelineError(f"disk full while writing {where}", fix=fix) from err


# ------------------------------------------------------------------------------------------ manifest
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def tool_versions() -> dict[str, str]:
    """Versions of everything that shapes a bundle's bytes (read from package metadata, no imports)."""
    return {
        "python": platform.python_version(),
        "pipeline": __version__,
        "tvm": _version("apache-tvm", "tvm"),
        "tvm-ffi": _version("apache-tvm-ffi", "tvm-ffi"),
        "numpy": _version("numpy"),
        "ml_dtypes": _version("ml_dtypes", "ml-dtypes"),
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "safetensors": _version("safetensors"),
        "gguf": _version("gguf"),
    }


def _is_manifest(rel: str) -> bool:
    return rel == MANIFEST or rel.startswith(f".{MANIFEST}.tmp-")


def _bundle_files(bundle_dir: Path) -> list[str]:
    """Relative POSIX paths of every regular file under `bundle_dir` except the manifest, sorted."""
    out = []
    for root, dirs, names in os.walk(bundle_dir):
        dirs.sort()
        for name in names:
            path = Path(root) / name
            rel = path.relative_to(bundle_dir).as_posix()
            if path.is_file() and not _is_manifest(rel):
                out.append(rel)
    return sorted(out)


def write_manifest(bundle_dir: Path, *, build_key: str, tool_versions: dict, extra: dict | None = None) -> dict:
    """Write `bundle_dir/manifest.json` and return it.

    It lists every file in the bundle (relative path, sha256, size; sorted by path; the manifest itself
    excluded), the tool versions, the build key and `extra`. No timestamps: the same bundle always
    gives a byte-identical manifest.
    """
    bundle_dir = Path(bundle_dir)
    files = [{"path": rel, "sha256": file_sha256(bundle_dir / rel), "size": (bundle_dir / rel).stat().st_size}
             for rel in _bundle_files(bundle_dir)]
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "build_key": build_key,
        "tool_versions": dict(sorted(tool_versions.items())),
        "files": files,
        "extra": dict(extra or {}),
    }
    text = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n"
    tmp = bundle_dir / f".{MANIFEST}.tmp-{os.getpid()}"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, bundle_dir / MANIFEST)
    finally:
        tmp.unlink(missing_ok=True)
    return manifest


def read_bundle_json(path: Path, *, missing: str, list_key: str, no_list: str) -> dict:
    """A bundle's JSON index (manifest, tensor cache) as a dict holding a list under `list_key`; every
    way it can be broken is a WeightsError naming the file, with the fix (rebuild)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WeightsError(missing, path=path, fix=REBUILD_FIX) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise WeightsError(f"{path.name} is not valid JSON ({err})", path=path, fix=REBUILD_FIX) from None
    if not isinstance(data, dict) or not isinstance(data.get(list_key), list):
        raise WeightsError(no_list, path=path, fix=REBUILD_FIX)
    return data


def read_manifest(bundle_dir: Path) -> dict:
    return read_bundle_json(Path(bundle_dir) / MANIFEST, missing="manifest.json is missing (not a complete bundle)",
                            list_key="files", no_list="manifest.json has no file list")


def escapes(rel: str) -> bool:
    """Whether a path a bundle file names (manifest entry, model_lib) could leave the bundle: empty, absolute
    or through `..`."""
    pure = PurePosixPath(rel)
    return not pure.parts or pure.is_absolute() or ".." in pure.parts


def verify_manifest(bundle_dir: Path, *, allow_unlisted: bool = False) -> None:
    """Check every file listed in manifest.json is present with the recorded size and sha256.

    Raises WeightsError naming the first (in path order) file that is missing or differs; then, unless
    `allow_unlisted`, the first file in the bundle that the manifest does not list.
    """
    bundle_dir = Path(bundle_dir)
    listed = set()
    for entry in sorted(read_manifest(bundle_dir)["files"], key=lambda e: e["path"]):
        rel = entry["path"]
        if escapes(rel):
            raise WeightsError(f"manifest.json lists an unsafe path {rel!r}", path=bundle_dir / MANIFEST,
                               fix=REBUILD_FIX)
        listed.add(rel)
        path = bundle_dir / rel
        if not path.is_file():
            raise WeightsError(f"{rel} is missing (listed in manifest.json)", path=path, fix=REBUILD_FIX)
        size = path.stat().st_size
        if size != entry["size"]:
            raise WeightsError(f"{rel} has {size} bytes, manifest.json says {entry['size']}", path=path,
                               fix=REBUILD_FIX)
        if file_sha256(path) != entry["sha256"]:
            raise WeightsError(f"{rel} was modified or is corrupt (sha256 differs from manifest.json)",
                               path=path, fix=REBUILD_FIX)
    if not allow_unlisted:
        for rel in _bundle_files(bundle_dir):
            if rel not in listed:
                raise WeightsError(f"{rel} is not listed in manifest.json", path=bundle_dir / rel,
                                   fix=f"remove it, or {REBUILD_FIX}")


def bundle_current(final: Path, key: str, field: str = "build_key") -> bool:
    """Whether the bundle at `final` was made under `key` (its manifest's `field`) and every file in it is the
    one the manifest lists (size and sha256)."""
    manifest = final / "manifest.json"
    if not manifest.exists():
        return False
    try:
        data = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return False
    if data.get(field, (data.get("extra") or {}).get(field)) != key:
        return False
    try:   # content, not sizes: a file edited in place is not "up to date"
        verify_manifest(final)
    except WeightsError:
        return False
    return True
