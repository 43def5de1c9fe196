"""The split-KV GPU decode attention (pipeline/kernels/gpu/attention.py) as OpenCL C on PoCL (fp32 twin: PoCL has
no fp16) against a float64 numpy softmax and against TVM's own kernel on the same paged cache; its launch shape,
barriers and fp32 sums read from the fp16 build; its place in the android-adreno module.

Tolerance: 1e-4 of the output scale (at least 1), as the other PoCL tests; lse (base 2) to 1e-4 relative."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from pipeline.kernels.gpu.attention import FILL_GROUPS, W, decode_splits, merge_chunks, paged_decode_gpu
from pipeline.verify.opencl_plan import ADRENO_TARGET, accumulators, opencl_kernels

pytest.importorskip("pyopencl")
from pipeline.verify.opencl import find_opencl_device, run_on_pocl  # noqa: E402

if find_opencl_device() is None:
    pytest.skip("no OpenCL platform found (install pocl-opencl-icd: `make system-deps`)", allow_module_level=True)

TOL = 1e-4
PAGE = 16
# (KV heads, query heads, head size): SmolLM2-135M, Qwen3-0.6B, qwen27b's full-attention layers
SHAPES = {"smollm2": (3, 9, 64), "qwen3-0.6b": (8, 16, 128), "qwen27b": (4, 24, 256)}


def paged_case(h_kv: int, h_q: int, d: int, lengths: list[int], seed: int = 0, shared: bool = False):
    """Arguments of the decode kernel for sequences of `lengths` cached tokens in shuffled pages of one pool (with
    `shared`, the second sequence's first page is the first one's: a common prefix), and the float64 reference
    (output, lse in base 2)."""
    rng = np.random.default_rng(seed)
    n_pages = [-(-n // PAGE) for n in lengths]
    pool = sum(n_pages) + 2
    order = rng.permutation(pool).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    values = order[:indptr[-1]].copy()
    if shared:
        values[indptr[1]] = values[0]
    pages = rng.standard_normal((pool, 2, h_kv, PAGE, d)).astype(np.float32)
    b = len(lengths)
    q = rng.standard_normal((b, h_q, d)).astype(np.float32)
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lengths, n_pages, strict=True)], np.int32)
    sm_scale = 1 / np.sqrt(d)
    args = [q, pages, indptr, values, last, np.zeros(b, np.int32), np.zeros(b, np.int32),
            np.zeros((b, h_q, d), np.float32), np.zeros((b, h_q), np.float32), 0, 1.0, 1e4, float(sm_scale)]
    group = h_q // h_kv
    out, lse = np.zeros((b, h_q, d)), np.zeros((b, h_q))
    for i, n in enumerate(lengths):
        ids = values[indptr[i]:indptr[i + 1]]
        k = np.concatenate([pages[p, 0] for p in ids], axis=1)[:, :n].astype(np.float64)
        v = np.concatenate([pages[p, 1] for p in ids], axis=1)[:, :n].astype(np.float64)
        for h in range(h_q):
            s = k[h // group] @ q[i, h].astype(np.float64) * sm_scale
            w = np.exp(s - s.max())
            out[i, h] = w @ v[h // group] / w.sum()
            lse[i, h] = (s.max() + np.log(w.sum())) / np.log(2)
    return args, out, lse


def _program(h_kv: int, h_q: int, d: int, dtype: str = "float32"):
    func = paged_decode_gpu(h_kv, h_q, d, dtype).with_attr("global_symbol", "main")
    return opencl_kernels(tvm.IRModule({"main": func}), ADRENO_TARGET)


def _errors(got: list, out: np.ndarray, lse: np.ndarray) -> tuple[float, float]:
    """(max |output - ref| / max(1, |ref|), max relative lse error)."""
    assert np.isfinite(got[7]).all() and np.isfinite(got[8]).all()
    e_out = float(np.abs(got[7] - out).max()) / max(1.0, float(np.abs(out).max()))
    e_lse = float((np.abs(got[8] - lse) / np.maximum(1.0, np.abs(lse))).max())
    return e_out, e_lse


# lengths: 1 token; one page exactly; one tile exactly; neither a multiple of the page nor of the tile, beside a
# 1K context; 1K exactly; three sequences of which two share their first page
LENGTHS = {"one": ([1], False), "page": ([16], False), "tile": ([64], False), "ragged": ([37, 1000], False),
           "1k": ([1024], False), "shared": ([300, 77, 5], True)}


@pytest.mark.parametrize("shape", SHAPES)
def test_split_kv_decode_matches_numpy(shape):
    program = _program(*SHAPES[shape])
    worst = []
    for seed, (lengths, shared) in enumerate(LENGTHS.values()):
        args, out, lse = paged_case(*SHAPES[shape], lengths, seed=seed, shared=shared)
        e_out, e_lse = _errors(run_on_pocl(program, "main", args), out, lse)
        assert e_out <= TOL and e_lse <= TOL, (lengths, e_out, e_lse)
        worst.append(max(e_out, e_lse))
    print(f"\n{shape}: worst error vs float64 numpy over {list(LENGTHS)}: {max(worst):.1e}")


def test_split_kv_decode_matches_tvms_kernel():
    """Same paged cache through TVM's `batch_decode_paged_kv` (what the adreno build had) and ours."""
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode

    from pipeline.verify.opencl_plan import schedule_for_gpu

    target = tvm.target.Target(ADRENO_TARGET)
    h_kv, h_q, d = SHAPES["smollm2"]
    theirs = opencl_kernels(schedule_for_gpu(
        _attention_decode(h_kv, h_q, d, "float32", False, rope_scaling={}, target=target), target), target)
    ours = _program(h_kv, h_q, d)
    args, _, _ = paged_case(h_kv, h_q, d, [37, 1000, 1], seed=7, shared=True)
    want = run_on_pocl(theirs, "main", [a.copy() if isinstance(a, np.ndarray) else a for a in args])
    got = run_on_pocl(ours, "main", args)
    assert _errors(got, want[7].astype(np.float64), want[8].astype(np.float64)) <= (TOL, TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_launches_fill_the_gpu_with_few_barriers(shape):
    """One sequence gives >= FILL_GROUPS work-groups of W work-items, the merge >= FILL_GROUPS too (a head's
    output columns split over work-groups); the split kernel has 4 barriers in all (q
    loaded, two per tile of W keys, the key lanes' sum), the merge none."""
    h_kv, h_q, d = SHAPES[shape]
    program = _program(h_kv, h_q, d, "float16")
    split, merge = program.launches("main")
    assert f"grid=(B, {h_kv}, {decode_splits(h_kv)}) block=({W}, 1, 1)" in split.describe()
    assert h_kv * decode_splits(h_kv) >= FILL_GROUPS
    chunks = merge_chunks(h_q, d // 8)
    assert f"grid=(B, {h_kv * chunks}, {h_q // h_kv}) block=({d // 8 // chunks}, 1, 1)" in merge.describe()
    assert h_kv * chunks * (h_q // h_kv) >= FILL_GROUPS
    kernels = program.source.split("// Function: ")
    assert [k.count("barrier(") for k in kernels[1:]] == [4, 0]
    assert "vload8(0, pages_ptr" in program.source       # 16-byte loads of fp16 K / V rows
    sums = {v: t for per in accumulators(program.source).values() for v, t in per.items()}
    assert sums and set(sums.values()) == {"float"}, sums   # fp32 sums in the fp16 kernel


def test_adreno_build_uses_the_split_kv_kernel():
    """The fuse stage for android-adreno swaps TVM's decode attention for ours (same name, same parameters) and
    keeps TVM's sliding-window variant; LLVM targets keep theirs (kernels/cpu/attention.py)."""
    from test_model_kernels_pocl import adreno_twin

    mod, _ = adreno_twin()
    funcs = {gv.name_hint: f for gv, f in mod.functions_items()}
    ours = funcs["batch_decode_paged_kv"]
    assert ours.attrs["mlp.kernel"] == "gpu_split_kv_attention"
    assert len(ours.params) == 13 and ours.attrs["global_symbol"] == "batch_decode_paged_kv"
    assert "mlp.kernel" not in (funcs["batch_decode_paged_kv_sliding_window"].attrs or {})


def test_metal_variant_builds_with_4_wide_loads():
    """ios-metal gets the same kernel with 4-element loads (Metal has no float8); it compiles to Metal."""
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode

    from pipeline.kernels.gpu.attention import decode_for

    metal = tvm.target.Target({"kind": "metal", "max_threads_per_block": 1024, "host": {"kind": "llvm"}})
    theirs = _attention_decode(*SHAPES["smollm2"], "float16", False, rope_scaling={}, target=metal)
    ours = decode_for(theirs, "metal")
    lanes = SHAPES["smollm2"][2] // 4   # the merge: D / 4 work-items per head, split over chunks of columns
    assert f'T.thread_binding({lanes // merge_chunks(SHAPES["smollm2"][1], lanes)}, thread="threadIdx.x")' in ours.script()
    tvm.compile(tvm.IRModule({"main": ours.with_attr("global_symbol", "main")}), target=metal)


def test_build_verification_runs_it_against_the_cpu_kernel():
    """The android-adreno build's PoCL check (verify/execution.py) finds its inputs by TVM's parameter names and
    compares it with the LLVM targets' decode kernel (kernels/cpu/attention.py) on its small paged cache."""
    from pipeline.kernels.cpu.attention import paged_decode
    from pipeline.verify.execution import run_kv_kernel

    h_kv, h_q, d = SHAPES["smollm2"]
    verdict = run_kv_kernel("batch_decode_paged_kv", paged_decode_gpu(h_kv, h_q, d, "float32"),
                            paged_decode(h_kv, h_q, d, "float32", prefetch=False), tvm.target.Target(ADRENO_TARGET),
                            ("fallback",), {"H": h_q, "D": d})
    assert "matches its CPU variant" in verdict, verdict
