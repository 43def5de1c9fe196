"""Our android-cpu library's decode and prefill steps, counted kernel by kernel under qemu-aarch64.

There is no aarch64 TVM runtime here, so the Relax VM cannot run a step. Instead the step's call sequence is
read from the library's own final module (the build's define -> fuse -> schedule -> CPU-region passes, redone
here: the same code the library was compiled from): every `call_tir` of `embed` + `decode` (CPU regions) or of
`embed` + `prefill` (seq_len = the prompt), and per layer one KV-cache attention call, which the MLC runtime
turns into RoPE (`fused_rope`), the K/V append (`tir_kv_cache_transpose_append`) and the attention kernel
(decode: `batch_decode_paged_kv_cpu` over context + 1 keys; a fresh prompt: `batch_prefill_ragged_kv`, causal).
Each distinct kernel runs once in the harness of pipeline/verify/qemu_aarch64.py (the library's `lib0.o`
linked statically; parallel loops split into `threads` tasks run one after another) with the counting plugin
restricted to the library's code plus the libm / memcpy functions it calls, and its counts are multiplied by
its calls per step. Not counted: the VM's own work between calls and the thread pool's waiting.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import qemu_counter as qc

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
KV_CALL = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
PAGE = 16
# libc / libm / libgcc functions the kernels call (exp2f, memcpy, fp16 conversions, ...; glibc's ifunc variants
# and helpers too)
LIBC_HELPERS = re.compile(r"^_*(expf|exp2f|log2f|powf|sinf|cosf|sincosf|memcpy|memset|memmove|math_)\w*$"
                          r"|^__(extend|trunc|float|fix)\w*[hsdtx]f2$")


@dataclass
class Call:
    """One kernel of a step: its arguments (arrays / ints), calls per step and which step function calls it."""

    name: str
    args: list
    calls: int
    role: str


def class_phone(cls: str | None) -> str | None:
    """A phone of configs/phones.yaml whose CPU class is `cls` (the build's `--phone` then compiles for that
    class), None for the android-cpu target's own class; an error when no phone has it."""
    import yaml

    from pipeline.config import PHONES_FILE, load_phone, load_target

    if cls is None or cls == load_target("android-cpu").cpu_class:
        return None
    phones = yaml.safe_load(PHONES_FILE.read_text())
    found = next((name for name in phones if load_phone(name).get("cpu_class") == cls), None)
    if found is None:
        raise qc.CounterError(f"no phone of configs/phones.yaml has cpu_class {cls}")
    return found


def final_module(quant: str, cls: str | None = None):
    """The android-cpu module as the build compiles it (after fusion, scheduling and the CPU regions), for CPU
    class `cls` (default: the target's own)."""
    import dataclasses

    from pipeline.compiler.backend import backend_for
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.stages import define, fuse, load, tune

    target = load_target("android-cpu")
    if cls is not None:
        target = dataclasses.replace(target, cpu_class=cls)
    defined = define(load(load_model(MODEL)), load_quant(quant), target)
    mod, _ = tune(fuse(defined, target), target)
    mod, _ = backend_for(target).finish(mod)
    return mod


def call_counts(mod, function: str) -> collections.Counter:
    """{kernel: calls} of a Relax function's call_tir bindings, plus {KV_CALL: calls}."""
    from tvm import relax

    counts = collections.Counter()
    for block in mod[function].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not isinstance(value, relax.Call):
                continue
            if getattr(value.op, "name", "") == "relax.call_tir":
                counts[value.args[0].name_hint] += 1
            elif getattr(value.args[0], "global_symbol", None) == KV_CALL:
                counts[KV_CALL] += 1
    return counts


def random_args(func, seq_len: int, rng) -> list:
    """Arrays of the kernel's parameter shapes (symbolic dims = seq_len); ints for scalar parameters."""
    from tvm import tirx

    from pipeline.verify.opencl_plan import param_spec

    args = []
    for p in func.params:
        spec = param_spec(p)
        if spec.kind == "scalar":
            args.append(1)
            continue
        shape = tuple(int(d) if isinstance(d, int | tirx.IntImm) else seq_len for d in spec.shape)
        if spec.dtype.startswith(("int", "uint")):
            hi = 16 if spec.dtype == "int32" else 2**31
            args.append(rng.integers(0, hi, shape).astype(spec.dtype))
        else:
            args.append(rng.standard_normal(shape).astype(spec.dtype))
    return args


def _kv_kernels(decoder, new: int, context: int, rng) -> list[tuple[str, list]]:
    """The KV cache's kernels of one layer's attention call: `new` tokens after `context` cached ones."""
    h_q, h_kv, d = decoder.num_attention_heads, decoder.num_key_value_heads, decoder.head_dim
    total = context + new
    pages = (total + PAGE - 1) // PAGE
    f16 = np.float16
    positions = np.arange(context, total, dtype=np.int32)
    qkv = rng.standard_normal((new, h_q + 2 * h_kv, d)).astype(f16)
    q, k, v = (np.zeros((new, h, d), f16) for h in (h_q, h_kv, h_kv))
    pool = rng.standard_normal((pages, 2, h_kv, PAGE, d)).astype(f16)
    out, lse = np.zeros((new, h_q, d), f16), np.zeros((new, h_q), np.float32)
    kernels = [("fused_rope", [qkv, positions, q, k, v, 1]),
               ("tir_kv_cache_transpose_append", [pool, k, v, positions])]
    zero = np.zeros(1, np.int32)
    if context:   # decode: the new token was appended first, attention over every cached key
        indptr = np.array([0, pages], np.int32)
        last = np.array([total - (pages - 1) * PAGE], np.int32)
        kernels.append(("batch_decode_paged_kv_cpu", [q, pool, indptr, np.arange(pages, dtype=np.int32), last,
                                                      zero, positions, out, lse, 0, 1, 10000, 0]))
    else:         # a fresh prompt: causal attention over its own keys
        indptr = np.array([0, new], np.int32)
        kernels.append(("batch_prefill_ragged_kv", [q, indptr, k, v, indptr, positions, zero, out, lse, 1, 0, 1,
                                                    10000, 0]))
    return kernels


def step_calls(mod, decoder, step: str, tokens: int, context: int, seed: int = 0) -> list[Call]:
    """Every distinct kernel of `embed` + `decode` (tokens 1, after context) or `embed` + `prefill` (tokens =
    the prompt, context 0), with its arguments and calls per step."""
    rng = np.random.default_rng(seed)
    calls = []
    for function in ("embed", step):
        for name, n in call_counts(mod, function).items():
            if name == KV_CALL:
                for kv_name, args in _kv_kernels(decoder, tokens, context, rng):
                    calls.append(Call(kv_name, args, n, f"{function}: KV-cache attention"))
            else:
                calls.append(Call(name, random_args(mod[name], tokens, rng), n, function))
    return calls


def build_bundle(quant: str, out: Path, cls: str | None = None) -> Path:
    """The android-cpu bundle from the project's CLI (reused from the pipeline's cache when unchanged), for CPU
    class `cls` through `--phone` (`class_phone`; default: the target's own class)."""
    phone = class_phone(cls)
    cmd = [sys.executable, "-m", "pipeline", "build", "--model", MODEL, "--target", "android-cpu", "--quant",
           quant, "--calibration", "none", "--out", str(out), *(["--phone", phone] if phone else [])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise qc.CounterError(f"pipeline build {quant} failed: {done.stderr.strip()[-400:]}")
    return out / f"{MODEL}-{quant}-android-cpu"


def link_harness(bundle: Path, threads: int, folder: Path) -> tuple[Path, str, list[tuple[int, int]]]:
    """(static aarch64 harness with `threads` tasks per parallel loop, the library's symbol prefix, the address
    ranges counted: the library's code as one span + each libc / libm helper it calls)."""
    import json

    from pipeline.verify.qemu_aarch64 import HARNESS_SOURCE, _ffi_include, library_objects

    info = json.loads((bundle / "reports" / "kernels.json").read_text())
    objects = library_objects(bundle / "lib" / info["library"], folder / "objects")
    exe = folder / f"harness-{threads}"
    cmd = ["aarch64-linux-gnu-gcc", "-static", "-O1", f"-DHARNESS_TASKS={threads}", "-I", str(_ffi_include()),
           str(HARNESS_SOURCE), *map(str, objects), "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True)
    lib_names = set()
    for obj in objects:
        out = subprocess.run(["aarch64-linux-gnu-nm", "--defined-only", str(obj)], capture_output=True, text=True,
                             check=True).stdout
        lib_names |= {ln.split()[2] for ln in out.splitlines() if len(ln.split()) == 3 and ln.split()[1] in "tT"}
    every = qc.symbol_ranges(exe, prefix="")
    lib = [r for n, r in every.items() if n in lib_names]
    lo, hi = min(r[0] for r in lib), max(r[1] for r in lib)
    strays = [n for n, (a, _) in every.items() if lo <= a < hi and n not in lib_names and not LIBC_HELPERS.match(n)]
    if strays:
        raise qc.CounterError(f"the library's code is not one span in {exe.name}: {strays[:3]} inside it")
    helpers = [r for n, r in every.items() if LIBC_HELPERS.match(n) and r[1] > r[0] and not lo <= r[0] < hi]
    return exe, info["system_lib_prefix"], [(lo, hi), *helpers[:255]]


def count_kernel(exe: Path, symbol: str, args: list, ranges, env: dict | None = None) -> qc.Counts:
    """One run of kernel `symbol` (its name with the library prefix) in the harness under the plugin (inputs
    from files, outputs not written back)."""
    from pipeline.verify.qemu_aarch64 import SYMBOL_PREFIX, write_args

    with tempfile.TemporaryDirectory(prefix="phone-cpu-") as tmp:
        args_file, _ = write_args(Path(tmp), args, write_back=False)
        counts, _ = qc.run([exe, "call", SYMBOL_PREFIX + symbol, args_file], ranges, env=env)
    return counts


def count_single_task(exe: Path, symbol: str, args: list, ranges) -> qc.Counts:
    """count_kernel with every parallel loop run as one task (HARNESS_TASKS=1): a kernel's own instructions."""
    return count_kernel(exe, symbol, args, ranges, env={"HARNESS_TASKS": "1", "PATH": "/usr/bin:/bin"})


def count_call(exe: Path, prefix: str, ranges, call: Call) -> qc.Counts:
    """One run of the step's kernel `call` (see count_kernel)."""
    return count_kernel(exe, prefix + call.name, call.args, ranges)


def measure_step(exe: Path, prefix: str, ranges, calls: list[Call], log=print) -> dict:
    """Per kernel and summed over the step: counts x calls (counted inside the library's ranges)."""
    kernels, total = [], dict.fromkeys(qc.COUNT_KEYS, 0)
    for call in calls:
        counts = count_call(exe, prefix, ranges, call)
        row = {"kernel": call.name, "role": call.role, "calls": call.calls, "per_call": counts.range}
        kernels.append(row)
        for key in qc.COUNT_KEYS:
            total[key] += counts.range[key] * call.calls
        log(f"  {call.name} x{call.calls}: {counts.range['insns'] / 1e6:.2f} M instr/call "
            f"({counts.range['vector_insns'] / max(counts.range['insns'], 1):.0%} vector)")
    return {"total": total, "kernels": kernels}


def missing_tools() -> list[str]:
    return qc.missing_tools() + ([] if shutil.which("aarch64-linux-gnu-nm") else ["binutils-aarch64-linux-gnu"])
