"""GPU kernels under Oclgrind (pipeline/verify/oclgrind.py): data races, out-of-bounds and uninitialised reads.

A race between one work-item's write and another's read of global memory is the positive control: Oclgrind
must report it, and nothing for the same exchange through local memory, where TVM puts a barrier between. Our decode GEMV kernels (pipeline/kernels/gpu/gemv.py) at
SmolLM2 / qwen27b shapes must run with zero reports and match numpy; the slow test runs every kernel of the
SmolLM2-shaped android-adreno model that the PoCL tests run."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from pipeline.verify.oclgrind import oclgrind_library, run_under_oclgrind
from pipeline.verify.opencl_plan import ADRENO_TARGET

if oclgrind_library() is None:
    pytest.skip("oclgrind not installed (`make system-deps`)", allow_module_level=True)

TOL = 1e-4
GEMV_SHAPES = [("q4", 576, 960), ("q4", 1536, 576), ("q8", 576, 576), ("t2", 576, 576), ("b1", 576, 576),
               ("q4", 5120, 96)]


def _exchange(scope: str):
    """b[i] = a[(i + 1) % 64] through a `scope` buffer. In local memory TVM puts a barrier between the writes
    and the reads (its thread-sync pass); in global memory it does not, and work-item i reads the slot that
    work-item i + 1 writes: a race."""

    @T.prim_func(s_tir=True)
    def exchange(a: T.Buffer((64,), "float32"), tmp: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        T.func_attr({"tirx.is_scheduled": True})
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("exchange"):
                tmp[tx] = a[tx]
                b[tx] = tmp[(tx + 1) % 64]

    @T.prim_func(s_tir=True)
    def local_exchange(a: T.Buffer((64,), "float32"), unused: T.Buffer((64,), "float32"),
                       b: T.Buffer((64,), "float32")):
        T.func_attr({"tirx.is_scheduled": True})
        tmp = T.sblock_alloc_buffer((64,), "float32", scope="shared")
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("exchange"):
                tmp[tx] = a[tx]
                b[tx] = tmp[(tx + 1) % 64]

    return exchange if scope == "global" else local_exchange


@pytest.fixture(scope="module")
def oclgrind_run():
    """One Oclgrind child for the controls and the GEMV kernels: (the run, numpy's GEMV results)."""
    from test_gpu_gemv import fused_gemv, packed_weights

    from pipeline.compiler.schedule import schedule_module

    rng = np.random.default_rng(0)
    funcs = {"racy": _exchange("global"), "fenced": _exchange("local")}
    a = rng.standard_normal(64).astype(np.float32)
    cases = {n: [a, np.zeros(64, np.float32), np.zeros(64, np.float32)] for n in funcs}
    exact = {}
    for fmt, k, n in GEMV_SHAPES:
        name = f"gemv_{fmt}_{k}_{n}"
        func = fused_gemv(fmt, k, n).with_attr("global_symbol", name)
        mod, records = schedule_module(tvm.IRModule({name: func}), tvm.target.Target(ADRENO_TARGET),
                                       ("dequant_gemv",), "gpu")
        assert records[0].rule == "dequant_gemv"
        funcs[name] = mod[name]
        codes, scales, dense = packed_weights(fmt, k, n, rng)
        x = rng.standard_normal((1, 1, k)).astype(np.float32)
        cases[name] = [codes, scales, x, np.zeros((1, 1, n), np.float32)]
        exact[name] = x[0, 0].astype(np.float64) @ dense
    gdn_funcs, gdn_cases, gdn_refs = _gdn_decode_cases(GDN_GUARD_SHAPES)   # in the same child: one start
    funcs.update(gdn_funcs)
    cases.update(gdn_cases)
    exact.update(gdn_refs)
    funcs = {n: f.with_attr("global_symbol", n) for n, f in funcs.items()}
    return run_under_oclgrind(tvm.IRModule(funcs), ADRENO_TARGET, cases), exact


def test_oclgrind_reports_a_local_memory_race_and_not_its_fix(oclgrind_run):
    run, _ = oclgrind_run
    assert any("data race" in kind for kind in run.reports.get("racy", {})), run.reports
    assert run.total("fenced") == 0, run.first.get("fenced")
    np.testing.assert_array_equal(run.outputs["fenced"][2], np.roll(run.outputs["fenced"][0], -1))


@pytest.mark.parametrize("fmt,k,n", GEMV_SHAPES)
def test_gemv_kernel_is_clean_under_oclgrind(oclgrind_run, fmt, k, n):
    run, exact = oclgrind_run
    name = f"gemv_{fmt}_{k}_{n}"
    assert name not in run.failed, run.failed[name]
    assert run.total(name) == 0, run.first.get(name)
    assert name not in run.unchecked, run.unchecked[name]
    got = run.outputs[name][-1][0, 0]
    assert float(np.abs(got - exact[name]).max()) <= TOL * float(np.abs(exact[name]).max())


# TVM library kernels with a known Oclgrind finding the build does not fix: none. (TVM's KV append read
# position_map[ntoken] and its tree attention read the tree table past its end for the padding query rows of
# a tile; the build replaces the one and guards the other: kernel_fixes.py, test below.)
KNOWN_TVM_READS: set[str] = set()
TREE_KERNELS = ("batch_tree_attn", "tree_attn_paged_kv")


def _tree_kernels(monkeypatch=None):
    """{name: (the scheduled fp32-twin tree-attention kernel, its in-range KV inputs)} of the SmolLM2-shaped
    android-adreno module; with `monkeypatch`, built without kernel_fixes' table guard (TVM's own kernels)."""
    from test_model_kernels_pocl import adreno_twin

    from pipeline.compiler.schedule import schedule_module
    from pipeline.kernels.gpu import kernel_fixes
    from pipeline.verify.execution import attention_heads, kv_args

    if monkeypatch is not None:
        monkeypatch.setattr(kernel_fixes, "TABLES_READ_PAST_END", {})
    mod, target = adreno_twin()
    heads, out = attention_heads(mod), {}
    for name in TREE_KERNELS:
        func = mod[name].with_attr("global_symbol", name)
        scheduled, _ = schedule_module(tvm.IRModule({name: func}), target.tvm(), target.schedule_rules, "gpu")
        out[name] = scheduled[name], [np.asarray(a) for a in kv_args(name, func, np.random.default_rng(0), heads)]
    return out, target


def test_tree_attention_reads_its_tree_table_in_bounds(monkeypatch):
    """TVM's tree-attention kernels read their tree table past its end (126 invalid reads each on this shape: the
    slow control below); with kernel_fixes.bounded_table_reads none, and their outputs equal TVM's kernels' to
    the bit on PoCL."""
    from pipeline.verify.opencl import run_on_pocl
    from pipeline.verify.opencl_plan import opencl_kernels

    def copies(args):
        return [a.copy() for a in args]

    guarded, target = _tree_kernels()
    theirs, _ = _tree_kernels(monkeypatch)
    cases = {n: copies(args) for n, (_, args) in guarded.items()}
    run = run_under_oclgrind(tvm.IRModule({n: f for n, (f, _) in guarded.items()}), dict(target.tvm_target), cases)
    assert not run.failed and all(run.total(n) == 0 for n in TREE_KERNELS), (run.failed, run.reports)
    for name, (func, args) in guarded.items():
        ours = run_on_pocl(opencl_kernels(tvm.IRModule({name: func}), target.tvm()), name, copies(args))
        tvms = run_on_pocl(opencl_kernels(tvm.IRModule({name: theirs[name][0]}), target.tvm()), name, copies(args))
        assert all(np.array_equal(a, b) for a, b in zip(ours, tvms, strict=True) if isinstance(a, np.ndarray)), name


@pytest.mark.slow
def test_tvms_tree_attention_reads_past_its_table(monkeypatch):
    """The control of the guard above: TVM's own tree-attention kernels still read their table out of bounds."""
    theirs, target = _tree_kernels(monkeypatch)
    run = run_under_oclgrind(tvm.IRModule({n: f for n, (f, _) in theirs.items()}), dict(target.tvm_target),
                             {n: [a.copy() for a in args] for n, (_, args) in theirs.items()})
    assert not run.failed and all(run.total(n) > 0 for n in TREE_KERNELS), (run.failed, run.reports)


@pytest.mark.slow
def test_every_smollm2_adreno_kernel_under_oclgrind():
    """Every kernel the PoCL tests run (test_model_kernels_pocl.py: dlight-scheduled matmuls and gathers, ours for
    the norms and the decode GEMVs; execution.py's paged-KV-cache runs), on in-range inputs, under Oclgrind: no report
    but the known out-of-bounds table reads of TVM's kernels above, LLVM's results for the non-KV ones (~5 min)."""
    from test_model_kernels_pocl import KV_DRIVEN, adreno_twin
    from tvm import tirx

    from pipeline.compiler.schedule import schedule_module
    from pipeline.kernels.gpu.add_norm import cpu_variant
    from pipeline.verify.execution import attention_heads, kv_args, random_args, small_ints
    from pipeline.verify.opencl import run_on_llvm

    mod, target = adreno_twin()
    heads = attention_heads(mod)
    funcs, cases, expected, rules = {}, {}, {}, {}
    for gv, func in mod.functions_items():
        name = gv.name_hint
        kv = any(k in name for k in KV_DRIVEN)
        reference = cpu_variant(func) if isinstance(func, tirx.PrimFunc) else None   # our RMSNorms (norm_rows.py)
        if not isinstance(func, tirx.PrimFunc) or (not kv and reference is None and func.attrs is not None
                                                   and func.attrs.get("tirx.is_scheduled")):
            continue
        func = func.with_attr("global_symbol", name)
        scheduled, records = schedule_module(tvm.IRModule({name: func}), target.tvm(), target.schedule_rules, "gpu")
        funcs[name], rules[name] = scheduled[name], records[0].rule
        if kv:
            cases[name] = [np.asarray(a) for a in kv_args(name, func, np.random.default_rng(0), heads)]
            continue
        args = random_args(func, np.random.default_rng(0), {"seq_len": 5, "batch_size": 16, "num_seq": 16})
        # token ids and row positions below 5, the smallest dimension they index (seq_len)
        cases[name] = small_ints(args, 5)
        expected[name] = run_on_llvm((reference or func).with_attr("global_symbol", name),
                                     [a.copy() for a in cases[name]])[-1]
    run = run_under_oclgrind(tvm.IRModule(funcs), dict(target.tvm_target), cases, timeout=3000)
    print(f"\nOclgrind: {len(cases)} kernels; reports: { {n: run.reports[n] for n in cases if run.total(n)} }; "
          f"uninitialised-value check not possible on {sorted(run.unchecked)}")
    assert not run.failed, run.failed
    reported = {n for n in cases if run.total(n)}
    assert reported <= KNOWN_TVM_READS, {n: run.first[n] for n in reported - KNOWN_TVM_READS}
    assert all(kind.startswith("Invalid read of size 4") for n in reported for kind in run.reports[n]), run.reports
    assert "tir_attention_merge_state" in cases and sum(r == "dequant_gemv" for r in rules.values()) >= 5, rules
    assert {"batch_decode_paged_kv", "fused_add_rms_norm", "rms_norm_split"} <= set(cases), sorted(cases)   # ours
    for name in expected:
        scale = max(float(np.abs(expected[name]).max()), 1e-30)
        assert float(np.abs(run.outputs[name][-1] - expected[name]).max()) <= TOL * scale, name


def _attention_under_oclgrind(shapes: dict[str, tuple[tuple[int, int, int], list[int]]]):
    """The split-KV decode attention (kernels/gpu/attention.py) at each (KV heads, query heads, head size) on a paged
    cache of sequences of the given lengths (the second sharing the first's first page): the run and the references."""
    from test_gpu_attention import paged_case

    from pipeline.kernels.gpu.attention import paged_decode_gpu

    funcs, cases, refs = {}, {}, {}
    for name, (shape, lengths) in shapes.items():
        funcs[name] = paged_decode_gpu(*shape, "float32").with_attr("global_symbol", name)
        args, out, lse = paged_case(*shape, lengths, seed=1, shared=len(lengths) > 1)
        cases[name] = [np.asarray(a) for a in args]
        refs[name] = (out, lse)
    return run_under_oclgrind(tvm.IRModule(funcs), ADRENO_TARGET, cases), refs


def _assert_clean_and_right(run, refs, outputs=(7, 8)):
    """No report, every check ran, and the arguments at `outputs` (attention: out, lse; GDN: o, state) within
    TOL of each reference in refs[name]."""
    for name, wants in refs.items():
        assert name not in run.failed, run.failed[name]
        assert run.total(name) == 0, run.first.get(name)
        assert name not in run.unchecked, run.unchecked[name]
        for i, want in zip(outputs, wants, strict=True):
            got = run.outputs[name][i]
            assert float(np.abs(got - want).max()) <= TOL * max(1.0, float(np.abs(want).max())), name


def test_split_kv_attention_is_clean_under_oclgrind():
    """SmolLM2's shape (3 KV / 9 query heads of 64), 37 and 70 cached tokens (not multiples of the page or the
    tile; a shared page): no race, out-of-bounds or uninitialised read in either launch; numpy's result (~10 s)."""
    run, refs = _attention_under_oclgrind({"split_kv_smollm2": ((3, 9, 64), [37, 70])})
    _assert_clean_and_right(run, refs)


@pytest.mark.slow
def test_split_kv_attention_is_clean_under_oclgrind_at_large_heads():
    """qwen27b's (4 KV / 24 query heads of 256) and Qwen3-0.6B's (8 / 16 of 128) shapes, one of them past a tile
    (~40 s: each runs in its own Oclgrind process, see pipeline/verify/oclgrind.py)."""
    run, refs = _attention_under_oclgrind({"split_kv_qwen27b": ((4, 24, 256), [17]),
                                           "split_kv_qwen3": ((8, 16, 128), [90, 3])})
    _assert_clean_and_right(run, refs)


# GDN decode shapes ((Hk, Hv, Dk, Dv), max_threads): rows past Dk in the last row group, columns past Dv with 2- and
# 1-column vectors, a GQA group of 3
GDN_GUARD_SHAPES = {"gdn_rows": ((1, 2, 36, 30), 256), "gdn_cols": ((1, 3, 20, 27), 256)}


def _gdn_decode_cases(shapes: dict[str, tuple[tuple[int, int, int, int], int]]):
    """The tiled GDN decode step (kernels/gpu/gdn.py) at each ((Hk, Hv, Dk, Dv), max_threads) on model-like inputs
    (test_gdn_kernels._inputs): the functions, their arguments and numpy's float64 (o, state)."""
    from test_gdn_kernels import _inputs

    from pipeline.models.gdn_kernels import gdn_decode, gdn_reference

    funcs, cases, refs = {}, {}, {}
    for name, (shape, max_threads) in shapes.items():
        funcs[name] = gdn_decode(*shape, "float32", gpu=True, max_threads=max_threads).with_attr("global_symbol", name)
        q, k, v, g, beta, state = _inputs(shape, 1, seed=4)
        cases[name] = [q[0], k[0], v[0], g[0], beta[0], state, np.zeros(v.shape[1:], np.float32), np.zeros_like(state)]
        o, s = gdn_reference(q, k, v, g, beta, state)
        refs[name] = (o[0], s)
    return funcs, cases, refs


def _gdn_decode_under_oclgrind(shapes: dict[str, tuple[tuple[int, int, int, int], int]]):
    funcs, cases, refs = _gdn_decode_cases(shapes)
    return run_under_oclgrind(tvm.IRModule(funcs), ADRENO_TARGET, cases), refs


def test_gdn_decode_is_clean_under_oclgrind(oclgrind_run):
    """GDN_GUARD_SHAPES, in the GEMVs' Oclgrind child: no race (the local-memory partial sums), out-of-bounds or
    uninitialised read; numpy's o and state."""
    run, exact = oclgrind_run
    _assert_clean_and_right(run, {n: exact[n] for n in GDN_GUARD_SHAPES}, outputs=(6, 7))   # o, state_out


@pytest.mark.slow
def test_gdn_decode_is_clean_under_oclgrind_at_model_shapes():
    """qwen27b's GDN layer (16 key / 48 value heads of 128: 192 work-groups of 128 work-items, 3 MiB of state) and
    the 4-value-head test model's (2 / 4 heads of 32: 16 work-groups of 8) (~1 min)."""
    run, refs = _gdn_decode_under_oclgrind({"gdn_qwen27b": ((16, 48, 128, 128), 256), "gdn_tiny": ((2, 4, 32, 32), 256)})
    _assert_clean_and_right(run, refs, outputs=(6, 7))


@pytest.mark.slow
def test_every_hybrid_adreno_non_kv_kernel_under_oclgrind():
    """The fp32 twin of a qwen27b-shaped hybrid (one GDN and one full-attention layer of the 4-layer test model's
    sizes; verify/execution.twin_module, as the build's PoCL check) for android-adreno: every kernel but the paged
    KV cache's (run above on their consistent cache for SmolLM2), scheduled by the target's rules, on in-range
    inputs under Oclgrind: no report. The GDN conv / gates / norms, the RNN state's copies (slot ids below the
    5 sequences and 5 history slots), the GDN decode, prefill and segments included (~45-70 s)."""
    from test_coverage import HYBRID_SHAPE
    from tvm import tirx

    from pipeline.compiler.schedule import schedule_module
    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.models import config_from_hf
    from pipeline.stages import Loaded
    from pipeline.verify.execution import KV_DRIVEN, random_args, small_ints, twin_module

    hf = HYBRID_SHAPE
    target = load_target("android-adreno")
    loaded = Loaded(ModelSpec(name="hybrid-shape", hf_config=hf, weights=None), hf, config_from_hf(hf), None)
    mod = twin_module(loaded, load_quant("q4f16"), target)
    spec = {**target.tvm_target, "host": {"kind": "llvm"}}
    tvm_target = tvm.target.Target(spec)
    sizes = {"seq_len": 5, "batch_size": 5, "num_seq": 5, "num_seqs": 5, "history": 5, "batch": 5, "n": 5, "b": 5}
    funcs, cases = {}, {}
    for gv, func in mod.functions_items():
        name = gv.name_hint
        if not isinstance(func, tirx.PrimFunc) or any(k in name for k in KV_DRIVEN):
            continue
        func = func.with_attr("global_symbol", name)
        scheduled, _ = schedule_module(tvm.IRModule({name: func}), tvm_target, target.schedule_rules, "gpu")
        try:
            args = random_args(func, np.random.default_rng(0), sizes)
        except KeyError:   # a size this test does not give (a kernel sized by something else): listed below
            continue
        funcs[name] = scheduled[name]
        cases[name] = small_ints(args, 5)   # ids, slots, token rows, segment ends: 0 .. 4, distinct
    run = run_under_oclgrind(tvm.IRModule(funcs), spec, cases, timeout=3000)
    print(f"\nOclgrind: {len(cases)} kernels of {sum(isinstance(f, tirx.PrimFunc) for _, f in mod.functions_items())}; "
          f"reports: { {n: run.reports[n] for n in cases if run.total(n)} }; unchecked: {sorted(run.unchecked)}; "
          f"left out: {sorted({gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)} - set(cases))}")
    assert not run.failed, run.failed
    assert {"gdn_decode", "gdn_prefill", "gdn_segments", "rnn_state_get_1", "rnn_state_set_1"} <= set(cases), sorted(cases)
    assert not {n: run.first[n] for n in cases if run.total(n)}
