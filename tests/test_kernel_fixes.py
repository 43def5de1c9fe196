"""The race in TVM's GPU attention-state merge, and the replacement the build uses (kernel_fixes.py),
run on PoCL against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from pipeline.kernels.gpu.kernel_fixes import RACY_MERGE_STATE, race_free_merge_state, replace_racy_kernels
from pipeline.verify.opencl import find_opencl_device, run_on_pocl
from pipeline.verify.opencl_plan import opencl_kernels

needs_pocl = pytest.mark.skipif(find_opencl_device() is None, reason="no OpenCL platform (install pocl-opencl-icd)")
ADRENO = {"kind": "opencl", "device": "adreno", "host": {"kind": "llvm"}}


def _states(n: int, h: int, d: int):
    rng = np.random.default_rng(0)
    v, vo = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(2))
    s, so = (3 * rng.standard_normal((n, h)).astype(np.float32) for _ in range(2))
    m = np.maximum(s, so)
    a, b = np.exp2(s - m), np.exp2(so - m)
    want_v = v * (a / (a + b))[..., None] + vo * (b / (a + b))[..., None]
    return [v, s, vo, so], want_v, np.log2(a + b) + m


def _run(func, args):
    target = tvm.target.Target(ADRENO)
    prog = opencl_kernels(tvm.IRModule({"merge": func.with_attr("global_symbol", "merge")}), target)
    return run_on_pocl(prog, "merge", [a.copy() for a in args])


@needs_pocl
def test_tvm_merge_state_races_between_work_items():
    """TVM's kernel: 16 work-items per head each read S and then write it. Run one after another (PoCL),
    only work-item 0's slice of V sees the original S; if TVM fixes this, drop kernel_fixes.py."""
    from tvm.relax.frontend.nn.llm.kv_cache import _merge_state_inplace

    heads, head_dim = 9, 64
    args, want_v, _ = _states(5, heads, head_dim)
    got = _run(_merge_state_inplace(heads, head_dim, "float32", tvm.target.Target(ADRENO)), args)
    err = np.abs(got[0] - want_v).reshape(5, heads, 16, head_dim // 16).max(axis=(0, 1, 3))
    assert err[0] < 1e-5 and (err[1:] > 1e-2).all(), err


@needs_pocl
@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 80)])
def test_race_free_merge_state_matches_numpy(heads, head_dim):
    args, want_v, want_s = _states(4, heads, head_dim)
    got = _run(race_free_merge_state("float32"), args)
    np.testing.assert_allclose(got[0], want_v, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], want_s, atol=1e-5, rtol=1e-5)


def test_replacement_keeps_name_and_attributes():
    from tvm.relax.frontend.nn.llm.kv_cache import _merge_state_inplace

    target = tvm.target.Target(ADRENO)
    name = RACY_MERGE_STATE[0]
    racy = _merge_state_inplace(8, 64, "float16", target).with_attr("op_pattern", 8)
    mod = replace_racy_kernels(tvm.IRModule({name: racy.with_attr("global_symbol", name)}))
    fixed = mod[name]
    assert "tvm_storage_sync" in fixed.script() and "tvm_storage_sync" not in racy.script()
    assert fixed.attrs["global_symbol"] == name and int(fixed.attrs["op_pattern"]) == 8
    assert str(fixed.params[0].dtype) == "float16"


def _append_case(ntoken: int = 5, h_kv: int = 3, d: int = 64, pages: int = 4):
    rng = np.random.default_rng(0)
    page_pool = rng.standard_normal((pages, 2, h_kv, 16, d)).astype(np.float32)
    k, v = (rng.standard_normal((ntoken, h_kv, d)).astype(np.float32) for _ in range(2))
    position = rng.permutation(pages * 16)[:ntoken].astype(np.int32)
    position[1::3] = -1                      # tokens the cache does not store
    want = page_pool.copy()
    for t, pos in enumerate(position):
        if pos != -1:
            want[pos // 16, 0, :, pos % 16], want[pos // 16, 1, :, pos % 16] = k[t], v[t]
    return [page_pool, k, v, position], want


def _gpu_append(fixed: bool):
    """TVM's KV append or ours, scheduled for Adreno as the build does (fuse + schedule stages)."""
    from tvm.relax.frontend.nn.llm.kv_cache import _kv_cache_transpose_append

    from pipeline.compiler.schedule import schedule_module

    target = tvm.target.Target(ADRENO)
    name = "tir_kv_cache_transpose_append"
    mod = tvm.IRModule({name: _kv_cache_transpose_append(3, 64, "float32").with_attr("global_symbol", name)})
    if fixed:
        with target:
            mod = replace_racy_kernels(mod)
    scheduled, _ = schedule_module(mod, target, ("fallback",), "gpu")
    return scheduled, name


@needs_pocl
@pytest.mark.parametrize("ntoken", [1, 5, 37])
def test_bounded_transpose_append_matches_numpy(ntoken):
    args, want = _append_case(ntoken, pages=8)
    mod, name = _gpu_append(fixed=True)
    assert mod[name].attrs["tirx.is_scheduled"]
    got = run_on_pocl(opencl_kernels(mod, tvm.target.Target(ADRENO)), name, [a.copy() for a in args])
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.slow
def test_tvm_append_reads_past_position_map_and_ours_does_not():
    """(~30 s) Under Oclgrind: TVM's append reads position_map past its end (work-items beyond the last element test it
    before the bounds check); ours reports nothing. If TVM's stops reporting, drop the replacement."""
    from pipeline.verify.oclgrind import oclgrind_library, run_under_oclgrind

    if oclgrind_library() is None:
        pytest.skip("oclgrind not installed (`make system-deps`)")
    args, want = _append_case()
    runs = {}
    for fixed in (False, True):
        mod, name = _gpu_append(fixed)
        runs[fixed] = run_under_oclgrind(mod, ADRENO, {name: args})
        np.testing.assert_array_equal(runs[fixed].outputs[name][0], want)
    assert list(runs[False].reports[name]) == ["Invalid read of size 4 at global memory address <addr>"]
    assert runs[True].total() == 0 and not runs[True].failed, runs[True].first
