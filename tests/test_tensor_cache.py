"""tensor-cache.json + params_shard_*.bin: TVM's own loaders read what we write; damage is caught."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pipeline.artifacts.tensor_cache import TensorCacheWriter, iter_records, read_tensor_cache
from pipeline.errors import WeightsError

MiB = 2**20
SMALL_CAP = 64 * 1024


def _raw(a) -> np.ndarray:
    """Bytes of an array (works for 0-d and custom dtypes such as bfloat16)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_raw(a), _raw(b))


def _mixed() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "embed.weight": rng.standard_normal((64, 32)).astype(np.float16),
        "norm.weight": rng.standard_normal(32).astype(np.float32),
        "q.weight": rng.integers(0, 2**32, (16, 8), dtype=np.uint32),
        "q.scale": rng.standard_normal((16, 2)).astype(ml_dtypes.bfloat16),
        "mask": rng.integers(-128, 128, (5, 3), dtype=np.int8),
        "scalar": np.array(0.5, dtype=np.float32),
        "big.weight": rng.standard_normal(10 * MiB).astype(np.float16),   # 20 MiB: a shard of its own
    }
    for i in range(40):                                                  # ~8-16 KiB each
        arrays[f"layers.{i}.w"] = rng.standard_normal((i % 5 + 4, 512)).astype(np.float32)
    arrays["tail.bias"] = rng.standard_normal(7).astype(np.float16)
    return arrays


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    return _mixed()


def _write(out: Path, arrays: dict[str, np.ndarray], **kw) -> dict:
    with TensorCacheWriter(out, **kw) as writer:
        for name, arr in arrays.items():
            writer.add(name, arr)
    return json.loads((out / "tensor-cache.json").read_text())


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory, arrays) -> Path:
    out = tmp_path_factory.mktemp("tc-default")
    _write(out, arrays, metadata={"Model": "test"})
    return out


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, arrays) -> Path:
    out = tmp_path_factory.mktemp("tc-small")
    small = {k: v for k, v in arrays.items() if k != "big.weight"}
    _write(out, small, shard_cap_bytes=SMALL_CAP)
    return out


def _shards(folder: Path) -> list[dict]:
    return json.loads((folder / "tensor-cache.json").read_text())["records"]


# ----------------------------------------------------------------------------------------------- format
def test_index_layout_matches_tvmjs(default_cache, arrays):
    index = json.loads((default_cache / "tensor-cache.json").read_text())
    assert list(index) == ["metadata", "records"]
    assert index["metadata"] == {"ParamSize": len(arrays), "ParamBytes": sum(a.nbytes for a in arrays.values()),
                                 "Model": "test"}
    for shard in index["records"]:
        assert list(shard) == ["dataPath", "format", "nbytes", "records", "md5sum"]
        assert shard["format"] == "raw-shard"
        assert (default_cache / shard["dataPath"]).stat().st_size == shard["nbytes"]
        for rec in shard["records"]:
            assert list(rec) == ["name", "shape", "dtype", "format", "nbytes", "byteOffset"]
            assert rec["format"] == "raw"
    dtypes = {rec["name"]: rec["dtype"] for shard in index["records"] for rec in shard["records"]}
    assert dtypes["q.scale"] == "bfloat16" and dtypes["q.weight"] == "uint32" and dtypes["mask"] == "int8"
    big = [s for s in index["records"] if any(r["name"] == "big.weight" for r in s["records"])]
    assert len(big) == 1 and len(big[0]["records"]) == 1 and big[0]["nbytes"] == 20 * MiB
    assert sorted(p.name for p in default_cache.iterdir()) == sorted(
        ["tensor-cache.json"] + [s["dataPath"] for s in index["records"]])


def test_bits_per_param_when_param_count_given(tmp_path):
    index = _write(tmp_path, {"w": np.zeros((4, 4), np.uint32)}, total_params=128)
    assert index["metadata"] == {"ParamSize": 1, "ParamBytes": 64, "BitsPerParam": 4.0}


def test_shards_respect_cap(small_cache):
    shards = _shards(small_cache)
    assert len(shards) >= 4
    for shard in shards:
        assert shard["nbytes"] <= SMALL_CAP
        offset = 0
        for rec in shard["records"]:            # packed back to back, in order
            assert rec["byteOffset"] == offset
            offset += rec["nbytes"]
        assert offset == shard["nbytes"]
    assert [s["dataPath"] for s in shards] == [f"params_shard_{i}.bin" for i in range(len(shards))]


def test_big_tensor_gets_own_shard_and_open_shard_continues(tmp_path):
    cap = 1024
    arrays = {"a": np.ones(100, np.uint8), "big": np.ones(600, np.uint8), "b": np.ones(100, np.uint8)}
    shards = _write(tmp_path, arrays, shard_cap_bytes=cap)["records"]
    assert [[r["name"] for r in s["records"]] for s in shards] == [["a", "b"], ["big"]]
    assert _same(read_tensor_cache(tmp_path)["big"], arrays["big"])


# ------------------------------------------------------------------------------------------ TVM reads it
@pytest.mark.parametrize("which", ["default_cache", "small_cache"])
def test_tvmjs_loader_reads_it(which, request, arrays):
    import tvm
    from tvm.contrib import tvmjs

    folder = request.getfixturevalue(which)
    loaded, metadata = tvmjs.load_tensor_cache(str(folder), tvm.cpu())
    assert metadata["ParamSize"] == len(loaded)
    expected = {n for n, _, _ in iter_records(folder)}
    assert set(loaded) == expected
    for name, tensor in loaded.items():
        got = tensor.numpy()
        if arrays[name].dtype == ml_dtypes.bfloat16:     # tvmjs hands back a bfloat16 tensor of the raw bits
            assert str(tensor.dtype) == "bfloat16"
            assert np.array_equal(_raw(got), _raw(arrays[name]))
            np.testing.assert_array_equal(got.astype(np.float32), arrays[name].astype(np.float32))
        assert _same(got, arrays[name]), name


def test_tvm_cpp_loader_reads_it(default_cache, arrays):
    """The C++ loader MLC's phone runtimes use (vm.builtin.tensor_cache.*)."""
    import tvm  # noqa: F401  (registers the vm.builtin functions)
    import tvm_ffi

    tvm_ffi.get_global_func("vm.builtin.tensor_cache.load")(str(default_cache), 1, 0)   # kDLCPU, device 0
    try:
        get = tvm_ffi.get_global_func("vm.builtin.tensor_cache.get")
        for name, arr in arrays.items():
            tensor = get(name)
            assert tensor is not None, name
            assert tuple(tensor.shape) == arr.shape and str(tensor.dtype) == iter_dtype(default_cache, name)
            assert np.array_equal(_raw(tensor.numpy()), _raw(arr)), name
    finally:
        tvm_ffi.get_global_func("vm.builtin.tensor_cache.clear")()


def iter_dtype(folder: Path, name: str) -> str:
    return next(d for n, _, d in iter_records(folder) if n == name)


# ------------------------------------------------------------------------------------------- our reader
@pytest.mark.parametrize("which", ["default_cache", "small_cache"])
def test_own_reader_round_trips(which, request, arrays):
    folder = request.getfixturevalue(which)
    loaded = read_tensor_cache(folder)
    assert list(loaded) == [n for n, _, _ in iter_records(folder)]
    for name, arr in loaded.items():
        assert _same(arr, arrays[name]), name
    assert loaded["q.scale"].dtype == ml_dtypes.bfloat16
    assert loaded["scalar"].shape == ()


def test_iter_records_header_only(small_cache, arrays):
    records = list(iter_records(small_cache))
    assert [(n, s, d) for n, s, d in records if n == "q.scale"] == [("q.scale", (16, 2), "bfloat16")]
    assert {n for n, _, _ in records} == set(arrays) - {"big.weight"}


def test_strided_and_big_endian_inputs(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = {"t": base.T, "be": np.arange(5, dtype=">u4"), "f16be": np.arange(3, dtype=">f2")}
    _write(tmp_path, arrays)
    loaded = read_tensor_cache(tmp_path)
    np.testing.assert_array_equal(loaded["t"], base.T)
    np.testing.assert_array_equal(loaded["be"], np.arange(5, dtype=np.uint32))
    assert loaded["be"].dtype == np.uint32 and loaded["f16be"].dtype == np.float16
    assert iter_dtype(tmp_path, "be") == "uint32"


# --------------------------------------------------------------------------------------------- damage
def _copy_small(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_corrupt_byte_names_shard_and_md5(small_cache, tmp_path):
    folder = _copy_small(small_cache, tmp_path / "c")
    shard = folder / "params_shard_1.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="md5") as err:
        read_tensor_cache(folder)
    assert "params_shard_1.bin" in str(err.value) and "rebuild the bundle" in str(err.value)
    read_tensor_cache(folder, verify=False)      # size still right: only md5 catches it


def test_truncated_and_missing_shard(small_cache, tmp_path):
    folder = _copy_small(small_cache, tmp_path / "t")
    shard = folder / "params_shard_2.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(WeightsError, match=r"params_shard_2\.bin is truncated"):
        read_tensor_cache(folder)
    shard.unlink()
    with pytest.raises(WeightsError, match=r"params_shard_2\.bin is missing.*rebuild the bundle"):
        read_tensor_cache(folder)


def test_missing_or_bad_index(tmp_path):
    with pytest.raises(WeightsError, match="tensor-cache.json is missing"):
        read_tensor_cache(tmp_path)
    (tmp_path / "tensor-cache.json").write_text("{not json")
    with pytest.raises(WeightsError, match="not valid JSON"):
        list(iter_records(tmp_path))


# ------------------------------------------------------------------------------------- writer behaviour
def test_deterministic(tmp_path, arrays):
    small = {k: v for k, v in arrays.items() if k != "big.weight"}
    for run in ("one", "two"):
        _write(tmp_path / run, small, shard_cap_bytes=SMALL_CAP, metadata={"ParamSize": 3})
    one = {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir()}
    two = {p.name: p.read_bytes() for p in (tmp_path / "two").iterdir()}
    assert one == two and len(one) > 2


def test_rewrite_removes_stale_shards(tmp_path):
    _write(tmp_path, {f"w{i}": np.full(400, i, np.uint8) for i in range(6)}, shard_cap_bytes=1000)
    assert len(list(tmp_path.glob("params_shard_*.bin"))) == 3
    _write(tmp_path, {"w": np.ones(10, np.uint8)}, shard_cap_bytes=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params_shard_0.bin", "tensor-cache.json"]


def test_failure_inside_writes_no_index(tmp_path):
    with pytest.raises(RuntimeError), TensorCacheWriter(tmp_path) as writer:
        writer.add("a", np.ones(4, np.float32))
        raise RuntimeError("boom")
    assert not (tmp_path / "tensor-cache.json").exists()


def test_rejects_duplicates_and_unknown_dtypes(tmp_path):
    with TensorCacheWriter(tmp_path) as writer:
        writer.add("a", np.ones(2, np.float16))
        with pytest.raises(WeightsError, match="written twice"):
            writer.add("a", np.ones(2, np.float16))
        with pytest.raises(WeightsError, match="complex64"):
            writer.add("c", np.ones(2, np.complex64))
    assert [n for n, _, _ in iter_records(tmp_path)] == ["a"]


def test_close_returns_index_and_is_idempotent(tmp_path):
    writer = TensorCacheWriter(tmp_path)
    writer.add("x", np.zeros((2, 3), np.float32))
    index = writer.close()
    assert index == json.loads((tmp_path / "tensor-cache.json").read_text())
    assert writer.close() is index
    with pytest.raises(RuntimeError):
        writer.add("y", np.zeros(1, np.float32))
