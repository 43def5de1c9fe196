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
