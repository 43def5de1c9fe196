"""Which kernels of a build were executed here, and on what: the coverage report's "executed here" column.

Nothing is claimed without a run. For `verify_kernels: pocl` targets (android-adreno) the build runs
the existing PoCL verification on the kernels of a twin of the model: the same architecture, sizes and
weight formats with one layer of each kind and fp32 activations and scales (PoCL has no fp16), fused by
the same passes and scheduled by the target's own rules. Every kernel of the build whose twin ran on
PoCL and matched the unscheduled PrimFunc built by LLVM is "executed here (PoCL)"; the rest say why
they were only compiled (host code, no OpenCL device, ...). The paged KV cache's own kernels (attention
over pages, append, copies) run on a small consistent cache (page tables and positions that stay in
bounds) and are compared with the CPU variant TVM's KV cache makes of the same kernel for LLVM. Other
targets record why nothing ran at build time. android-hexagon (`verify_kernels: qemu-hexagon`) runs its NPU
kernels' HVX objects under qemu-hexagon (verify/qemu_hexagon.py) against the same PrimFuncs built by LLVM;
a kernel qemu-hexagon 7.2 cannot decode is "compiled, not executed" with the packet and instruction.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import tirx

from pipeline.compiler.backend import backend_for
from pipeline.compiler.fuse import fusion_passes
from pipeline.compiler.schedule import schedule_module
from pipeline.config import ROOT, load_target
from pipeline.errors import ConfigError
from pipeline.kernels.cpu import rope as cpu_rope
from pipeline.kernels.gpu import add_norm
from pipeline.kernels.npu.hvx_int8_matmul import INT8_RULES as HVX_INT8_RULES
from pipeline.models import model_class
from pipeline.models.layers import LayerFactory
from pipeline.verify import opencl as verify_opencl
from pipeline.verify.opencl import run_on_llvm, run_on_pocl
from pipeline.verify.opencl_plan import eval_host, opencl_kernels, param_spec
from pipeline.verify.qemu_hexagon import HexagonRunError, hexagon_kernels, missing_tools

# Kernels the paged KV cache drives with its own page tables / position maps: random inputs would index
# out of bounds, so they get the consistent cache of kv_args() and a CPU reference kernel.
KV_DRIVEN = ("paged_kv", "ragged_kv", "tree_attn", "kv_cache", "kv_copy", "copy_single_page", "merge_state",
             "fused_rope")
TOLERANCE = 1e-4          # of the output's largest magnitude
HVX_FP16_TOLERANCE = 8 * 2.0 ** -10   # fp16 outputs (HVX qf16 rounds differently from LLVM's x86 fp16 code)
INT8_ACTIVATION_TOLERANCE = 2e-2      # matmuls that quantize activations to int8 per 32 (kernels/npu/hvx_*.py)
SEQ_LEN = 5               # the symbolic seq_len of prefill kernels
# symbolic sizes given test values: a prompt's tokens, the batch of sequences of the engine's batch functions
# (`take` of each sequence's last hidden state) and of its logit kernels; integer inputs are in range of SEQ_LEN
# and distinct (small_ints)
TEST_SIZES = {"seq_len": SEQ_LEN, "n": SEQ_LEN, "batch_size": SEQ_LEN, "batch": SEQ_LEN, "num_seq": SEQ_LEN,
              "num_token": SEQ_LEN}
MAX_ARG_BYTES = 256 * 2**20   # bigger kernels (a 27B model's vocab GEMV) are only compiled: RAM and time
AUTO_VERIFY_MAX_BYTES = 2**30   # bigger models verify only with --verify (minutes, GBs of random inputs)
MAX_RESTARTS = 8              # child processes per build (each crash costs one kernel's verdict)
CHILD_TIMEOUT_S = 900


def not_executed(why: str) -> str:
    return f"compiled, not executed ({why})"


def executed(how: str) -> str:
    return f"executed here ({how})"


def signature(func: Any) -> list[list[str]]:
    """Buffer shapes of a kernel (dtypes aside: the twin runs fp32 where the build has fp16)."""
    return [[str(d) for d in p.shape] for p in func.params if isinstance(p.ty, tirx.BufferType)]


def verdicts(target: Any, records: list[Any], verify: bool, twin: Any = None,
             mod: Any = None, reference: Any = None) -> tuple[dict[str, str], dict[str, Any]]:
    """{kernel: "executed here (...)" | "compiled, not executed (...)"} and a summary for the report.

    A build kernel counts as executed only when the twin has a kernel of the same name and buffer shapes."""
    names = [r.name for r in records]
    on_host = {r.name for r in records if r.rule == "forced-cpu"}
    backend = backend_for(target)
    if backend.kind == "npu":
        out = {r.name: not_executed("aarch64 CPU code") for r in records if not r.on_device}
        npu = [r for r in records if r.on_device]
        if verify == "qemu-hexagon" and mod is not None:
            t0 = time.time()
            out.update(hexagon_verdicts(mod, npu, target.npu))
            return out, _summary(out, f"NPU kernels under qemu-hexagon vs LLVM ({time.time() - t0:.0f} s)")
        missing = missing_tools()
        why = ("HVX: build-time qemu-hexagon run off (--no-verify)" if not verify else
               f"HVX: the qemu-hexagon harness needs apt-get install {' '.join(missing)}" if missing else
               "HVX: not run at build time")
        out.update({r.name: not_executed(why) for r in npu})
        return out, _summary(out, "none at build time")
    if backend.kind == "cpu":
        why = ("runs here with python -m pipeline run, not at build time" if target.runnable_here
               else f"{target.name} CPU code")
        out = {n: not_executed(why) for n in names}
        return out, _summary(out, "none at build time")
    if not backend.verifies_on_opencl:
        out = {n: not_executed(f"no {target.tvm_target.get('kind')} device here") for n in names}
        return out, _summary(out, "none at build time")
    if verify == "too-big":
        out = {n: not_executed(f"build-time verification skipped: over {AUTO_VERIFY_MAX_BYTES // 2**30} GiB of "
                               "weights; pass --verify") for n in names}
        return out, _summary(out, "skipped (model size)")
    if not verify:
        out = {n: not_executed("kernel verification off (--no-verify or the target's verify_kernels)")
               for n in names}
        return out, _summary(out, "off")

    if verify == "no-device" or verify_opencl.find_opencl_device() is None:
        out = {n: not_executed("no OpenCL device here: install pyopencl + pocl-opencl-icd") for n in names}
        return out, _summary(out, "no OpenCL device")
    t0 = time.time()
    results = run_twin(twin, target, reference) if twin is not None else {}
    out = {}
    for n in names:
        if n in on_host:
            out[n] = not_executed("pinned to the CPU: aarch64 host code")
        elif n in results and (mod is None or results[n][0] == signature(mod[n])):
            out[n] = results[n][1]
        elif n in results:
            out[n] = not_executed(f"the fp32 twin's {n} has other shapes ({'; '.join(map(str, results[n][0]))}), "
                                  f"it {results[n][1].split(' (')[0]}")
        elif mod is not None and _float16_only(mod[n]):
            out[n] = not_executed("an fp16-only kernel (a cast the fp32 twin has no need for); PoCL has no cl_khr_fp16")
        else:
            out[n] = not_executed("no fp32 twin of this kernel (same name and shapes) to run on PoCL")
    return out, _summary(out, f"PoCL vs LLVM on an fp32 twin of the model ({time.time() - t0:.0f} s)")


def _float16_only(func: Any) -> bool:
    """A kernel that exists only because the build computes in fp16 (a cast to or from float16)."""
    dtypes = {str(p.dtype) for p in func.params if isinstance(p.ty, tirx.BufferType)}
    return "float16" in dtypes


def _summary(out: dict[str, str], how: str) -> dict[str, Any]:
    ran = [n for n, v in out.items() if v.startswith("executed here")]
    bad = [n for n, v in out.items() if "MISMATCH" in v]
    return {"executed": len(ran), "not_executed": len(out) - len(ran), "mismatched": sorted(bad), "how": how}


def twin_module(loaded: Any, quant: Any, target: Any):
    """The model with one layer of each kind, fp32 activations and scales, fused like the build."""
    cfg = loaded.decoder
    if hasattr(cfg, "layer_types"):
        keep = max(cfg.layer_types.index(k) for k in set(cfg.layer_types)) + 1
        cfg = dataclasses.replace(cfg, num_hidden_layers=keep, layer_types=list(cfg.layer_types[:keep]))
    else:
        cfg = dataclasses.replace(cfg, num_hidden_layers=1)
    weight_dtype = "float32"
    factory = LayerFactory("float32", quant.weight_format, weight_dtype, quant.layout_for(target),
                           scale_dtype="float32", formats=dict(quant.formats), rotation=quant.rotation,
                           ternary_source=quant.ternary_source)
    twin_target = dataclasses.replace(target, compute_dtype="float32",
                                      tvm_target={**target.tvm_target, "host": {"kind": "llvm"}})
    module = model_class(cfg)(cfg, factory, twin_target.tvm())
    mod, _ = module.export_tvm(spec=module.export_spec())
    if hasattr(module, "rope_settings"):      # as stages.define: the RoPE kernel's settings (kernels/cpu/rope.py)
        mod = cpu_rope.annotate(mod, module.rope_settings())
    with twin_target.tvm():
        mod = tvm.transform.Sequential(fusion_passes())(mod)
    return mod


# Kernels the model emits already bound to GPU threads (`tirx.is_scheduled`; models/gdn_kernels.py): LLVM cannot
# build them, so their reference is the CPU variant of the same name that the model emits for an LLVM target.
# Each with the parameters it writes, of (q, k, v, g, beta, state_in, o, state_out).
GPU_BOUND_LIBRARY = {"gdn_decode": (6, 7), "gdn_prefill": (6, 7),
                     # the engine's logit kernels (models/engine_table.py), in place on the logits
                     "logit_bias_kernel": (0,), "penalty_kernel": (0,), "bitmask_kernel": (0,)}
GATED_DELTA = ("gdn_decode", "gdn_prefill")   # their inputs made as the model feeds them (gated_delta_inputs)


def reference_module(loaded: Any, quant: Any):
    """The CPU (LLVM) variants of the kernels that cannot be their own reference, for the same model: the paged
    KV cache's (TVM's KV cache makes one per target kind, with the same signature) and the model's GPU-bound
    library kernels (`GPU_BOUND_LIBRARY`)."""
    cpu = twin_module(loaded, quant, load_target("host-cpu"))
    return tvm.IRModule({gv: f for gv, f in cpu.functions_items()
                         if isinstance(f, tirx.PrimFunc)
                         and (any(k in gv.name_hint for k in KV_DRIVEN) or gv.name_hint in GPU_BOUND_LIBRARY)})


def run_twin(mod: Any, target: Any, reference: Any = None) -> dict[str, tuple[list[list[str]], str]]:
    """Run the twin's kernels in a child process, so that a kernel that crashes the OpenCL driver (or reads
    out of bounds on random inputs) costs its own verdict, not the build: the child streams one JSON line
    per kernel; when it dies, the kernel it had started is marked crashed and a new child goes on.
    {kernel: (its buffer shapes, verdict)}."""
    out: dict[str, tuple[list[list[str]], str]] = {}
    with tempfile.TemporaryDirectory(prefix="mlp-verify-") as tmp:
        twin, log, ref = Path(tmp) / "twin.json", Path(tmp) / "results.jsonl", Path(tmp) / "reference.json"
        twin.write_text(tvm.ir.save_json(mod))
        ref.write_text(tvm.ir.save_json(reference if reference is not None else tvm.IRModule({})))
        spec = json.dumps({"tvm_target": dict(target.tvm_target), "rules": list(target.schedule_rules)})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        for _ in range(MAX_RESTARTS):
            skip = json.dumps(sorted(out))
            try:
                code = subprocess.run([sys.executable, "-m", "pipeline.verify.execution", str(twin), spec, str(log), skip,
                                       str(ref)],
                                      env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            started = None
            for line in log.read_text().splitlines() if log.exists() else []:
                rec = json.loads(line)
                if "start" in rec:
                    started = rec
                else:
                    out[rec["name"]] = (rec["sig"], rec["verdict"])
                    started = None
            log.unlink(missing_ok=True)
            if code == 0:
                break
            if started is None:   # died before any kernel: nothing more to learn
                break
            out[started["start"]] = (started["sig"], not_executed(f"the PoCL run crashed (exit {code})"))
    return out


def _run_kernels(twin_path: str, spec: dict[str, Any], log_path: str, skip: list[str], ref_path: str) -> None:
    """Child process: schedule, run on PoCL and LLVM, compare, one JSON line per kernel (see run_twin)."""
    warnings.filterwarnings("ignore")      # pyopencl's "non-empty compiler output"
    mod = tvm.ir.load_json(open(twin_path).read())
    reference = {gv.name_hint: f for gv, f in tvm.ir.load_json(open(ref_path).read()).functions_items()}
    heads = attention_heads(mod)
    target = tvm.target.Target({**spec["tvm_target"], "host": {"kind": "llvm"}})
    with open(log_path, "a") as log:
        for gv, func in mod.functions_items():
            name = gv.name_hint
            if not isinstance(func, tirx.PrimFunc) or name in skip:
                continue
            sig = signature(func)
            log.write(json.dumps({"start": name, "sig": sig}) + "\n")
            log.flush()
            if os.environ.get("MLP_VERIFY_ABORT_ON") == name:   # test hook: a kernel that kills the driver
                os.abort()
            if any(k in name for k in KV_DRIVEN):
                ref = reference.get(kv_reference_name(name, set(reference)) or "")
                verdict = run_kv_kernel(name, func, ref, target, tuple(spec["rules"]), heads)
            elif func.attrs is not None and func.attrs.get("tirx.is_scheduled"):
                verdict = run_kernel(name, func, target, tuple(spec["rules"]), reference.get(name))
            else:
                verdict = run_kernel(name, func, target, tuple(spec["rules"]))
            log.write(json.dumps({"name": name, "sig": sig, "verdict": verdict}) + "\n")
            log.flush()


def run_kernel(name: str, func: Any, target: Any, rules: tuple[str, ...], reference: Any = None) -> str:
    """One kernel: scheduled by the target's rules, run on PoCL, compared with LLVM (itself unscheduled, or
    `reference`, the CPU variant of a kernel bound to GPU threads already); the verdict."""
    bound = func.attrs is not None and func.attrs.get("tirx.is_scheduled")
    ours = add_norm.cpu_variant(func) if bound else None   # our RMSNorm kernels: their LLVM variant
    if ours is not None:
        reference = ours
    if bound and reference is None:
        return not_executed("bound to GPU threads, and no CPU variant of it to compare with")
    try:
        args = small_ints(random_args(func, np.random.default_rng(0), TEST_SIZES), SEQ_LEN)
    except KeyError as err:
        return not_executed(f"symbolic size {err.args[0]} has no test value here")
    size = sum(a.nbytes for a in args)
    if size > MAX_ARG_BYTES:
        return not_executed(f"too large to run here ({size / 2**20:.0f} MiB of arguments)")
    if ours is not None:
        return _compare(name, func, reference, args, target, rules, "fp32 twin, its LLVM variant the reference",
                        outputs=add_norm.outputs(func), what="LLVM")
    if bound:
        if name not in GPU_BOUND_LIBRARY:
            return not_executed("bound to GPU threads, with no known outputs to compare")
        args = gated_delta_inputs(args) if name in GATED_DELTA else args
        return _compare(name, func, reference, args, target, rules,
                        "fp32 twin, its CPU variant the reference", outputs=list(GPU_BOUND_LIBRARY[name]),
                        what="LLVM")
    return _compare(name, func, func, args, target, rules, "fp32 twin", outputs=[len(args) - 1])


def gated_delta_inputs(args: list[np.ndarray]) -> list[np.ndarray]:
    """The gated delta rule's inputs (q, k, v, g, beta, state, ...) as the model feeds them: k L2-normalized per
    head, g a log decay (<= 0), beta in (0, 1). Random normals there make the state grow by ~|beta| Dk per
    token, so the comparison would measure fp32 overflow, not the kernel."""
    q, k, v, g, beta = args[:5]
    k = (k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)).astype(k.dtype)
    g = -np.abs(g).astype(g.dtype)
    beta = (1 / (1 + np.exp(-beta))).astype(beta.dtype)
    return [q, k, v, g, beta, *args[5:]]


def _copies(args: list[Any]) -> list[Any]:
    return [a.copy() if isinstance(a, np.ndarray) else a for a in args]


def attention_heads(mod: Any) -> dict[str, int]:
    """{"H": query heads, "D": head size} from the decode attention kernel's Q (batch, heads, head_dim)."""
    for gv, func in mod.functions_items():
        if gv.name_hint.startswith("batch_decode_paged_kv"):
            _, h, d = func.params[0].shape
            return {"H": int(h), "D": int(d)}
    return {}


def run_kv_kernel(name: str, func: Any, reference: Any, target: Any, rules: tuple[str, ...],
                  heads: dict[str, int] | None = None) -> str:
    """A paged-KV-cache kernel on the small cache of kv_args(), against its CPU variant built by LLVM."""
    if reference is None:
        return not_executed("no CPU variant of this KV-cache kernel to compare with")
    try:
        args = kv_args(name, func, np.random.default_rng(0), heads)
    except KeyError as err:
        return not_executed(f"KV-cache input {err.args[0]} has no test value here")
    floats = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.dtype.kind == "f"]
    return _compare(name, func, reference, args, target, rules, "fp32 twin, paged KV cache of 2 sequences",
                    outputs=floats, what="its CPU variant")


def _compare(name: str, func: Any, reference: Any, args: list[np.ndarray], target: Any, rules: tuple[str, ...],
             how: str, outputs: list[int], what: str = "LLVM") -> str:
    """Schedule `func` for the target, run it on PoCL and `reference` (unscheduled) on LLVM with the same
    inputs; the verdict from the largest difference over the `outputs` arguments (relative to each one's
    largest magnitude)."""
    try:
        func = func.with_attr("global_symbol", name)
        scheduled, _ = schedule_module(tvm.IRModule({name: func}), target, rules, "gpu")
        expected = run_on_llvm(reference.with_attr("global_symbol", "main"), _copies(args))
        got = run_on_pocl(opencl_kernels(scheduled, target), name, _copies(args))
    except Exception as err:  # noqa: BLE001 - one kernel that cannot run here must not stop the others
        return not_executed(f"PoCL run failed: {str(err).strip().splitlines()[-1][:80]}")
    err = 0.0
    for i in outputs:
        scale = max(float(np.abs(expected[i]).max()), 1e-30)
        err = max(err, float(np.abs(got[i] - expected[i]).max()) / scale)
    if err <= TOLERANCE:
        return executed(f"PoCL, {how}, matches {what}: rel. err {err:.1e}")
    return executed(f"PoCL, {how}: MISMATCH vs {what}, rel. err {err:.1e}")


def hexagon_verdicts(mod: Any, records: list[Any], npu: dict[str, Any]) -> dict[str, str]:
    """Each NPU kernel's HVX object run under qemu-hexagon on random inputs and compared with its PrimFunc
    built by LLVM here; a run qemu stops gets the packet it could not decode (or how it stopped)."""
    with tempfile.TemporaryDirectory(prefix="hvx-exec-") as tmp:
        kernels = hexagon_kernels(mod, records, npu, Path(tmp))
        return {r.name: _hexagon_verdict(kernels, r.name, mod[r.name], r.rule) for r in records}


def _hexagon_verdict(kernels: Any, name: str, func: Any, rule: str) -> str:
    args = random_args(func, np.random.default_rng(0), {"seq_len": SEQ_LEN})
    if sum(a.nbytes for a in args) > MAX_ARG_BYTES:
        return not_executed(f"over {MAX_ARG_BYTES >> 20} MiB of arguments")
    expected = run_on_llvm(func.with_attr("global_symbol", "main"), _copies(args))[-1]
    try:
        got = kernels.call(name, _copies(args))[-1]
    except HexagonRunError as err:
        stopped = kernels.diagnose(name, _copies(args))
        if stopped is not None:
            return not_executed(f"qemu-hexagon 7.2 cannot decode `{stopped.undecoded[0]}`: its HVX has no "
                                "v68+ float instructions (hf / qf16 / qf32 / sf)")
        return not_executed(f"qemu-hexagon stopped: {' '.join(str(err).split())[:160]}")
    scale = max(float(np.abs(expected.astype(np.float64)).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - expected.astype(np.float64)).max()) / scale
    int8 = rule in HVX_INT8_RULES
    tolerance = INT8_ACTIVATION_TOLERANCE if int8 else HVX_FP16_TOLERANCE if expected.dtype == np.float16 else TOLERANCE
    verdict = "matches LLVM" if err <= tolerance else "MISMATCH vs LLVM"
    return executed(f"qemu-hexagon, HVX{', int8 activations' if int8 else ''}, {verdict}: rel. err {err:.1e}")


def random_args(func: Any, rng: np.random.Generator, sizes: dict[str, int]) -> list[np.ndarray]:
    """Inputs for a kernel: random codes / normals, small in-range integers for ids and row indices."""
    args = []
    for p in func.params:
        spec = param_spec(p)
        shape = tuple(int(d) if isinstance(d, (int, tirx.IntImm)) else sizes[str(d)] for d in spec.shape)
        if spec.dtype == "uint32":
            args.append(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))
        elif spec.dtype.startswith("int"):
            args.append(rng.integers(0, 16, shape).astype(spec.dtype))
        else:
            args.append(rng.standard_normal(shape).astype(spec.dtype))
    return args


def small_ints(args: list[np.ndarray], high: int) -> list[np.ndarray]:
    """`args` with each integer input (ids, slots, rows, segment ends; not packed uint32 codes) set to 0, 1, ..,
    high - 1 repeating: in range of whatever a prompt of `high` tokens indexes, and distinct within each `high`
    (two batch rows writing one state slot would be a race of the inputs, not of the kernel: Oclgrind runs)."""
    return [(np.arange(a.size) % high).reshape(a.shape).astype(a.dtype)
            if a.dtype.kind in "iu" and a.dtype != np.uint32 else a for a in args]


# ---------------------------------------------------------------------------- KV-cache kernels
# The paged KV cache's kernels read page tables and position maps, which random inputs would send out of
# bounds. They run on one small, consistent cache instead: 2 sequences of 20 and 7 tokens in 16-token
# pages (sequence 0 in pages 3 and 0, sequence 1 in page 2, of 4), the last 5 and 3 tokens as queries.
# The reference is the CPU variant of the same kernel that TVM's KV cache makes for an LLVM target.
KV_PAGE = 16
KV_PAGES = 4
_CHAIN = np.array([[0, 5], [1, 5], [2, 5], [3, 5], [4, 5], [0, 3], [1, 3], [2, 3]], np.int32)  # tree = chains


def kv_state(decode: bool) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """(sizes of the symbolic dims, int32 tables by parameter name) of the small cache above."""
    indptr = np.array([0, 5, 8], np.int32)
    positions = np.array([15, 16, 17, 18, 19, 4, 5, 6], np.int32)   # of the query tokens in their sequence
    sizes = {"B": 2, "batch_size": 2, "batch_size_plus_1": 3, "max_num_pages": KV_PAGES, "num_pages": KV_PAGES,
             "nnz_pages": 3, "page_size": KV_PAGE, "total_len": 8, "qo_len": 8, "kv_len": 8, "tree_size": 8,
             "total_tree_order_len": 8, "total_copy_length": 3, "seq_len": 5, "seqlen": 5, "ntoken": 5,
             "N": 5, "H": 4, "D": 64}
    tables = {
        "page_table_indptr": np.array([0, 2, 3], np.int32), "page_indptr": np.array([0, 2, 3], np.int32),
        "page_table_values": np.array([3, 0, 2], np.int32), "page_values": np.array([3, 0, 2], np.int32),
        "last_page_len": np.array([4, 7], np.int32),
        "k_rope_pos_offset": np.zeros(2, np.int32),
        "q_rope_position": np.array([19, 6], np.int32) if decode else positions,
        "q_indptr": indptr, "kv_indptr": indptr, "mn_indptr": indptr, "tree_order_indptr": indptr,
        "mask": _CHAIN, "tree_order": _CHAIN,
        "copy_length_indptr": np.array([0, 2, 3], np.int32),
        "copy_src_dst_pos": np.array([[50, 51, 20], [3, 4, 33]], np.int32),   # slots (page * 16 + offset)
        "position_map": np.array([3, 17, 18, 40, 63], np.int32),              # distinct slots of 4 pages
    }
    return sizes, tables


KV_SCALARS: dict[str, float] = {"rotary_mode": 0, "causal": 1, "rope_scale": 1.0, "rope_theta": 10000.0, "sm_scale": 0.125,
              "batch_size": 2, "src_page_id": 1, "tgt_page_id": 2, "copy_length": 10, "layer_id": 0,
              "apply_rope": 1}


def kv_args(name: str, func: Any, rng: np.random.Generator, heads: dict[str, int] | None = None) -> list[Any]:
    """Inputs for a KV-cache kernel: the cache above, random K/V pages and queries. `heads`: the model's
    query heads and head size ({"H": .., "D": ..}) for kernels that are symbolic in them but launched
    for the model's (the attention-state merge)."""
    sizes, tables = kv_state("decode" in name)
    sizes.update(heads or {})
    args: list[Any] = []
    for p in func.params:
        spec = param_spec(p)
        if spec.kind == "scalar":   # a Python number: run_on_llvm passes arrays as tensors
            value = KV_SCALARS[spec.name]
            args.append(float(value) if spec.dtype.startswith("float") else int(value))
            continue
        try:
            shape = tuple(int(eval_host(d, {}, sizes)) for d in spec.shape)
        except KeyError:
            raise KeyError(f"{spec.name}{tuple(str(d) for d in spec.shape)}") from None
        if spec.name == "length_info":   # (B,) last page lengths, or (3, B) with sliding-window offset and sink
            last = tables["last_page_len"]
            args.append(last.copy() if len(shape) == 1 else np.stack([last, 0 * last, 0 * last]).astype(np.int32))
        elif spec.name in tables:
            arr = tables[spec.name]
            if arr.shape != shape:
                raise KeyError(f"{spec.name}{shape}")
            args.append(arr.astype(spec.dtype).copy())
        elif spec.dtype.startswith("int"):
            raise KeyError(spec.name)
        else:
            args.append(rng.standard_normal(shape).astype(spec.dtype))
    return args


def kv_reference_name(name: str, names: set[str]) -> str | None:
    """The CPU variant (LLVM target) of a GPU KV-cache kernel, by TVM's naming."""
    for cand in (name + "_cpu", name.replace("_sliding_window", "_cpu_sliding_window"),
                 {"tir_attention_merge_state": "merge_state_inplace_cpu"}.get(name, ""), name):
        if cand in names:
            return cand
    return None


def annotate(report: dict[str, Any], verdict: dict[str, str], summary: dict[str, Any]) -> None:
    """Add the per-kernel column and the counts to a coverage report (in place)."""
    for row in report["kernels"]:
        row["executed"] = verdict.get(row["name"], not_executed("not recorded"))
    report["summary"]["execution"] = summary


if __name__ == "__main__":   # the child of run_twin
    _run_kernels(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5])


OCLGRIND_MODES = ("pocl+oclgrind", "pocl+oclgrind-quick")   # verify_mode's values that run Oclgrind after PoCL


def verify_mode(target: Any, verify: bool | str | None, weight_bytes: int) -> str | bool:
    """Whether and how the build runs its kernels (part of the cache key: the report says what ran);
    `verify` None: the target's `verify_kernels`, skipped above AUTO_VERIFY_MAX_BYTES of weights; None or True on
    an OpenCL target: PoCL, then the quick Oclgrind pass (kernels up to a size cap) where Oclgrind is installed, unless the
    environment sets MLP_QUICK_OCLGRIND=0 (the test suite: its own tests run Oclgrind); "no-oclgrind": the
    same without it (`--no-oclgrind`); "oclgrind": every kernel under Oclgrind (`--oclgrind`)."""
    quick = verify in (None, True) and os.environ.get("MLP_QUICK_OCLGRIND", "1") != "0"
    if verify in (None, "no-oclgrind"):
        verify = bool(target.verify_kernels)
        if verify and weight_bytes > AUTO_VERIFY_MAX_BYTES:
            return "too-big"
    if verify is True and quick and backend_for(target).verifies_on_opencl:
        from pipeline.verify.oclgrind_build import missing

        if not missing() and verify_opencl.find_opencl_device() is not None:
            return "pocl+oclgrind-quick"   # the kernels up to a size cap (oclgrind_build.QUICK_MAX_ARG_BYTES)
    if verify == "oclgrind":   # PoCL, then the same kernels under Oclgrind (verify/oclgrind_build.py)
        from pipeline.verify.oclgrind_build import missing

        if not backend_for(target).verifies_on_opencl:
            raise ConfigError(f"--oclgrind checks OpenCL kernels and {target.name} has none",
                              path=f"targets/{target.name}.yaml", fix="build android-adreno with OCLGRIND=1")
        if missing() or verify_opencl.find_opencl_device() is None:
            raise ConfigError(f"--oclgrind: {missing() or 'no OpenCL device for the PoCL run before it'}",
                              fix="make system-deps (installs oclgrind, pocl-opencl-icd)")
        return "pocl+oclgrind"
    if verify and backend_for(target).kind == "npu":
        return "qemu-hexagon" if not missing_tools() else "no-qemu-hexagon"
    if not verify or not backend_for(target).verifies_on_opencl:
        return bool(verify)
    return "pocl" if verify_opencl.find_opencl_device() is not None else "no-device"


def record_execution(coverage: dict[str, Any], mod: Any, loaded: Any, quant: Any, target: Any,
                     schedules: list[Any], verify: Any, report: Any) -> None:
    """The coverage report's "executed here" column, from actual runs (`verify` from verify_mode)."""
    twin = None
    if verify in ("pocl", *OCLGRIND_MODES) and verify_opencl.find_opencl_device() is not None:
        with report.step("verify kernels on PoCL (fp32 twin vs LLVM)"):
            twin = twin_module(loaded, quant, target)
            reference = reference_module(loaded, quant)
            verdict, summary = verdicts(target, schedules, verify, twin, mod, reference)
    elif verify == "qemu-hexagon":
        with report.step("run NPU kernels under qemu-hexagon (HVX vs LLVM)"):
            verdict, summary = verdicts(target, schedules, verify, mod=mod)
        report.info(f"executed here: {summary['executed']} of {len(verdict)} kernels under qemu-hexagon "
                    f"({summary['not_executed']} compiled only; reasons in reports/coverage.md)")
    else:
        verdict, summary = verdicts(target, schedules, verify)
    if twin is not None and verify in OCLGRIND_MODES:
        from pipeline.report.coverage import oclgrind_line
        from pipeline.verify.oclgrind_build import oclgrind_verdicts

        with report.step("run the twin's kernels under Oclgrind (races, bounds, uninitialised reads)"):
            found, summary["oclgrind"] = oclgrind_verdicts(twin, target, quick=verify == "pocl+oclgrind-quick")
        verdict = {n: f"{v}; {found[n]}" if n in found and v.startswith("executed here") else v
                   for n, v in verdict.items()}
        report.info(oclgrind_line(summary["oclgrind"]))
    annotate(coverage, verdict, summary)
    if twin is not None:
        report.info(f"executed here: {summary['executed']} of {len(verdict)} kernels on PoCL "
                    f"({summary['not_executed']} compiled only; reasons in reports/coverage.md)")
        if verify not in OCLGRIND_MODES:
            from pipeline.verify.oclgrind_build import missing

            report.info(f"Oclgrind: not run ({missing() or 'OCLGRIND=0 / --no-oclgrind'}; OCLGRIND=1 / --oclgrind "
                        "runs all the twin's kernels under its race, bounds and uninitialised-read checks: minutes)")
    if summary["mismatched"]:
        report.info(f"[yellow]warning:[/] kernels differ from LLVM on PoCL: {', '.join(summary['mismatched'])}")
