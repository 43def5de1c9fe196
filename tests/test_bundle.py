"""atomic_dir never leaves half a bundle behind; manifest.json records and checks every file."""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.artifacts.bundle import atomic_dir, tool_versions, verify_manifest, write_manifest
from pipeline.errors import PipelineError, WeightsError


def _siblings(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def _fill(folder: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)


# ------------------------------------------------------------------------------------------ atomic_dir
def test_success_renames_into_place(tmp_path):
    final = tmp_path / "out" / "bundle"          # parent created on demand
    with atomic_dir(final) as tmp:
        assert tmp.parent == final.parent and tmp.name.startswith(".bundle.tmp-")
        assert tmp.is_dir() and not final.exists()
        _fill(tmp, {"a.txt": "A", "lib/b.so": "B"})
    assert (final / "a.txt").read_text() == "A" and (final / "lib" / "b.so").read_text() == "B"
    assert _siblings(final.parent) == ["bundle"]


def test_exception_leaves_nothing(tmp_path):
    final = tmp_path / "bundle"
    with pytest.raises(ValueError, match="boom"), atomic_dir(final) as tmp:
        _fill(tmp, {"a.txt": "A"})
        raise ValueError("boom")
    assert _siblings(tmp_path) == []


def test_keyboard_interrupt_leaves_nothing(tmp_path):
    final = tmp_path / "bundle"
    with pytest.raises(KeyboardInterrupt), atomic_dir(final) as tmp:
        _fill(tmp, {"a.txt": "A"})
        raise KeyboardInterrupt
    assert _siblings(tmp_path) == []


def test_old_bundle_survives_failed_rebuild(tmp_path):
    final = tmp_path / "bundle"
    with atomic_dir(final) as tmp:
        _fill(tmp, {"weights.bin": "old", "keep/me.txt": "old"})
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        _fill(tmp, {"weights.bin": "new, half written"})
        raise RuntimeError("compile failed")
    assert (final / "weights.bin").read_text() == "old" and (final / "keep" / "me.txt").read_text() == "old"
    assert _siblings(tmp_path) == ["bundle"]


def test_successful_rebuild_replaces_old_bundle(tmp_path):
    final = tmp_path / "bundle"
    with atomic_dir(final) as tmp:
        _fill(tmp, {"stale.txt": "old", "weights.bin": "old"})
    with atomic_dir(final) as tmp:
        _fill(tmp, {"weights.bin": "new"})
    assert _siblings(final) == ["weights.bin"] and (final / "weights.bin").read_text() == "new"
    assert _siblings(tmp_path) == ["bundle"]       # no .old-/.tmp- left behind


def test_disk_full_becomes_pipeline_error(tmp_path):
    final = tmp_path / "bundle"
    with pytest.raises(PipelineError) as err, atomic_dir(final) as tmp:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "params_shard_3.bin"))
    message = str(err.value)
    assert "disk full while writing" in message and "params_shard_3.bin" in message
    assert "free space or use --out on another disk" in message
    assert _siblings(tmp_path) == []


def test_disk_full_behind_another_error_is_reported(tmp_path):
    with pytest.raises(PipelineError, match="disk full while writing"), atomic_dir(tmp_path / "b"):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("write failed") from inner
    assert _siblings(tmp_path) == []


def test_other_os_errors_pass_through(tmp_path):
    with pytest.raises(PermissionError), atomic_dir(tmp_path / "b"):
        raise PermissionError(errno.EACCES, "denied")


def test_stale_temp_dirs_of_dead_builds_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(dead.stdout)
    (tmp_path / f".bundle.tmp-{pid}").mkdir()
    (tmp_path / f".bundle.tmp-{pid}" / "junk.bin").write_text("x")
    (tmp_path / ".other.tmp-1").mkdir()                 # another bundle's: not ours to touch
    with atomic_dir(tmp_path / "bundle") as tmp:
        _fill(tmp, {"a": "A"})
    assert _siblings(tmp_path) == [".other.tmp-1", "bundle"]


# -------------------------------------------------------------------------------------------- manifest
@pytest.fixture
def bundle(tmp_path) -> Path:
    folder = tmp_path / "bundle"
    folder.mkdir()
    _fill(folder, {"mlc-chat-config.json": "{}", "tensor-cache.json": "{}", "params_shard_0.bin": "x" * 1000,
                   "lib/model.so": "ELF", "reports/kernels.json": "[]"})
    return folder


def _write(folder: Path) -> dict:
    return write_manifest(folder, build_key="abc123", tool_versions={"tvm": "0.27.0", "python": "3.11"},
                          extra={"model": "tiny", "has_weights": True})


def test_manifest_lists_every_file_with_sha256(bundle):
    manifest = _write(bundle)
    on_disk = json.loads((bundle / "manifest.json").read_text())
    assert on_disk == manifest
    paths = [f["path"] for f in manifest["files"]]
    assert paths == sorted(paths) == ["lib/model.so", "mlc-chat-config.json", "params_shard_0.bin",
                                      "reports/kernels.json", "tensor-cache.json"]
    for entry in manifest["files"]:
        data = (bundle / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["size"] == len(data)
    assert manifest["build_key"] == "abc123"
    assert manifest["tool_versions"] == {"python": "3.11", "tvm": "0.27.0"}
    assert manifest["extra"] == {"model": "tiny", "has_weights": True}
    verify_manifest(bundle)


def test_manifest_is_deterministic(bundle):
    _write(bundle)
    first = (bundle / "manifest.json").read_bytes()
    _write(bundle)                                   # the old manifest is not listed in the new one
    assert (bundle / "manifest.json").read_bytes() == first
    assert b"manifest.json" not in first


def test_verify_catches_modified_file(bundle):
    _write(bundle)
    (bundle / "params_shard_0.bin").write_text("y" * 1000)       # same size, different bytes
    with pytest.raises(WeightsError, match=r"params_shard_0\.bin.*sha256") as err:
        verify_manifest(bundle)
    assert "rebuild the bundle" in str(err.value)


def test_verify_catches_size_change_missing_and_unlisted(bundle):
    _write(bundle)
    (bundle / "lib" / "model.so").write_text("ELF!")
    with pytest.raises(WeightsError, match=r"lib/model\.so has 4 bytes, manifest\.json says 3"):
        verify_manifest(bundle)
    (bundle / "lib" / "model.so").unlink()
    with pytest.raises(WeightsError, match=r"lib/model\.so is missing"):
        verify_manifest(bundle)
    _write(bundle)
    (bundle / "extra.bin").write_text("?")
    with pytest.raises(WeightsError, match=r"extra\.bin is not listed"):
        verify_manifest(bundle)
    verify_manifest(bundle, allow_unlisted=True)


def test_verify_without_manifest(bundle):
    with pytest.raises(WeightsError, match="manifest.json is missing"):
        verify_manifest(bundle)


def test_tool_versions():
    versions = tool_versions()
    for key in ("python", "tvm", "tvm-ffi", "numpy", "transformers", "pipeline"):
        assert isinstance(versions[key], str) and versions[key]
    assert versions["tvm"].startswith("0.27")
    assert tool_versions() == versions
