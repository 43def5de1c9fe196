"""Benchmark: CPU speed of our host-cpu bundles side by side with llama.cpp, and the bandwidth roofline.

For every model of benchmarks/speed.yaml (the default SmolLM2-135M and a larger Llama-architecture model
with random weights made here), on this machine, with the same number of threads on both sides:

* ours: a host-cpu bundle per scheme (`python -m pipeline build`), each measured in a fresh child
  process (TVM_NUM_THREADS) through the pipeline's own runtime (`pipeline.runtime.runner.Bundle(...).engine()`,
  the Engine that `python -m pipeline run` uses): prefill tok/s at each prompt length, decode tok/s over
  `decode_tokens` greedy tokens (right after the 128-token prompt), time to first token (prefill of
  the 128-token prompt + argmax), peak RSS through decode (the child's own VmHWM after its decode
  runs) and over the whole child (its VmHWM polled while it runs: `run_measured`);
* llama.cpp on the same weights (its converter to an F16 GGUF, llama-quantize to each type), with each
  build this machine gets (llamacpp.variants(): the native one, and on a CPU with AMX one without it):
  `llama-bench -t <threads> -r N -o json` with `-p <lengths> -n 0` (prefill; peak RSS of that process, the
  same way), `-p 0 -n <decode> -d <first prompt length>` (the decode figure: after as many cached tokens as
  ours) and `-p 0 -n <decode>` (empty context, kept beside it; its process's peak is the RSS through decode),
  each in its own process so a build that crashes in one (AMX in prompt processing) keeps the others. Each
  figure is the fastest build's that ran it (the peer at its best), and the row records which build gave it
  and the others' figures or crashes (fastest_builds);
* this machine's streaming-read bandwidth (a small C program, pthreads, compiled here with cc -O3 at
  bench time; the best of several passes over 1 GiB with `threads` threads), probed at the start and
  after each model (the best probe is the run's bandwidth: the machine's speed drifts), and for each decode
  figure the roofline ratio tok/s x bytes read per token / bandwidth; also a short probe (256 MiB) between
  measurements, so each row's roofline is given against the better of the probes right before and after
  it too (`roofline_near`: the same minutes; the goal's verdict stays on the run's best probe). Bytes per token: ours, the coverage
  report's decode-step bytes (reports/coverage.json, summary.decode_step.total.bytes: weights read +
  activations); llama.cpp, the GGUF's tensor bytes except the token embedding table (unless there is no
  output.weight: then the table is the tied lm_head and counts); on both sides plus the KV cache's keys
  and values the attention reads, on average over the decode run (ours: reports/memory.json's bytes per
  cached position, fp32 on host-cpu; llama.cpp: f16, llama-bench's default cache type);
* compile time per target into a fresh empty cache (MLP_CACHE_DIR) and the no-change rebuild;
* a phone prediction table: share x peak bandwidth / decode-step bytes for each bundle and phone of
  configs/phones.yaml (a prediction, not a measurement).

Every figure is a median over repetitions with its min and max. The machine is shared (load average
recorded before and after): figures are what was measured under that load.

    .venv/bin/python benchmarks/speed.py              # full run (< 40 min on 2 cores)
    .venv/bin/python benchmarks/speed.py --quick      # default model, 128-token prefill, fewer reps
    make bench-speed [BENCH_ARGS=--quick]

Results: benchmarks/results/speed-<date>[-quick][-<commit>].{json,md} (the commit when that day's name is
taken). Not a test: `make test` runs only
tests/test_bench_speed.py (the math here).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: import the checkout's pipeline/ and benchmarks/
    sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "benchmarks" / "speed.yaml"
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / ".cache" / "speed"


# ------------------------------------------------------------------------------------------ math
def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements (None when there are none)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def roofline_ratio(tok_s: float, bytes_per_token: float, bandwidth_bytes_s: float) -> float:
    """The share of the memory bandwidth a decode speed uses: tok/s x bytes read per token / bytes/s."""
    return tok_s * bytes_per_token / bandwidth_bytes_s


def predicted_tok_s(bandwidth_gbs: float, bytes_per_token: float, share: float) -> float:
    """Bandwidth-bound decode prediction: share x peak bandwidth (decimal GB/s) / bytes read per token."""
    return share * bandwidth_gbs * 1e9 / bytes_per_token


def kv_read_bytes(bytes_per_position: float, depth: int, decode: int) -> float:
    """Bytes one decode step's attention reads from the KV cache, on average over a `decode`-token run after
    a `depth`-token prompt: step i (1..decode) reads the keys and values of depth + i positions."""
    return bytes_per_position * (depth + (decode + 1) / 2)


# llama-bench's KV cache type unless -ctk / -ctv say otherwise: f16
LLAMACPP_KV_BYTES = 2


def gguf_decode_bytes(path: Path) -> dict[str, Any]:
    """Bytes a decode step reads from a GGUF's tensors: all of them except the token-embedding table
    (one row is gathered), unless the model has no output.weight — then the table is the tied lm_head.
    Also the KV cache's bytes per cached position (keys + values of every layer, in llama-bench's f16)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in sizes
    embd = sizes.get("token_embd.weight", 0)
    total = sum(sizes.values())
    read = total if tied else total - embd
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode() if "general.architecture" in \
        reader.fields else "llama"

    def field(key: str) -> int | None:
        f = reader.fields.get(f"{arch}.{key}")
        return None if f is None else int(f.parts[f.data[0]][0])

    kv_position = None
    layers, heads, kv_heads = field("block_count"), field("attention.head_count"), field("attention.head_count_kv")
    if layers and heads:
        width = field("embedding_length") or 0
        key_len = field("attention.key_length") or width // heads
        value_len = field("attention.value_length") or width // heads
        kv_position = layers * (kv_heads or heads) * (key_len + value_len) * LLAMACPP_KV_BYTES
    return {"bytes_per_token": read, "file_tensor_bytes": total, "tied_embeddings": tied,
            "params": sum(int(t.n_elements) for t in reader.tensors), "kv_bytes_per_position": kv_position}


def bundle_decode_bytes(bundle: Path) -> int:
    """The coverage report's decode-step bytes (weights read + activations) of a built bundle."""
    cov = json.loads((Path(bundle) / "reports" / "coverage.json").read_text())
    return int(cov["summary"]["decode_step"]["total"]["bytes"])


def bundle_kv_bytes_per_position(bundle: Path) -> int | None:
    """The memory report's KV-cache bytes per cached position (keys + values of every attention layer, in
    the bundle's cache dtype) of a built bundle."""
    mem = Path(bundle) / "reports" / "memory.json"
    if not mem.exists():
        return None
    return (json.loads(mem.read_text()).get("kv_cache") or {}).get("bytes_per_token")


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or theirs in (None, 0) else ours / theirs


# ----------------------------------------------------------------------------------------- config
def load_config(path: Path = CONFIG, quick: bool = False) -> dict[str, Any]:
    """The yaml with --quick's overrides applied: fewer models, reps, prompt lengths and decode tokens."""
    cfg = yaml.safe_load(Path(path).read_text())
    if quick:
        q = cfg.get("quick", {})
        keep = set(q.get("models", [m["name"] for m in cfg["models"]]))
        cfg["models"] = [dict(m, prefill=q.get("prefill", m["prefill"]), reps=q.get("reps", m["reps"]),
                              long_reps=min(m.get("long_reps", 1), q.get("reps", m["reps"])),
                              llamacpp_reps=q.get("llamacpp_reps", m.get("llamacpp_reps", cfg["llamacpp_reps"])))
                         for m in cfg["models"] if m["name"] in keep]
        cfg["decode_tokens"] = q.get("decode_tokens", cfg["decode_tokens"])
        if "compile_targets" in q:
            cfg["compile"]["targets"] = [t for t in cfg["compile"]["targets"] if t["target"] in q["compile_targets"]]
        cfg["llamacpp_reps"] = q.get("llamacpp_reps", cfg["llamacpp_reps"])
    return cfg


# ----------------------------------------------------------------------------------- random model
def _dims(spec: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(hidden, intermediate, vocab, head_dim, q width): head_dim defaults to hidden / heads (Llama)."""
    h = spec["hidden_size"]
    hd = spec.get("head_dim", h // spec["num_attention_heads"])
    return h, spec["intermediate_size"], spec["vocab_size"], hd, spec["num_attention_heads"] * hd


def random_model_params(spec: dict[str, Any]) -> int:
    """Parameter count of a Llama or Qwen3 config (tied embeddings counted once; Qwen3's q/k norms)."""
    h, i, v, hd, qw = _dims(spec)
    kv = spec["num_key_value_heads"] * hd
    qk_norms = 2 * hd if spec.get("architecture", "llama") == "qwen3" else 0
    layer = 2 * h * qw + 2 * h * kv + 3 * h * i + 2 * h + qk_norms
    emb = v * h * (1 if spec.get("tie_word_embeddings", True) else 2)
    return spec["num_hidden_layers"] * layer + emb + h


RANDOM_ARCHITECTURES = {   # speed.yaml's random.architecture -> the HF config's class, model type and norms' eps
    "llama": ("LlamaForCausalLM", "llama", 1e-5, 100000.0),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", 1e-6, 1000000.0),
}


def _hf_config(spec: dict[str, Any]) -> dict[str, Any]:
    arch = spec.get("architecture", "llama")
    if arch not in RANDOM_ARCHITECTURES:
        raise ValueError(f"speed.yaml: random.architecture {arch!r} is not one of {sorted(RANDOM_ARCHITECTURES)}")
    cls, model_type, eps, theta = RANDOM_ARCHITECTURES[arch]
    h, i, v, hd, _ = _dims(spec)
    cfg = {"architectures": [cls], "model_type": model_type, "hidden_act": "silu",
           "hidden_size": h, "intermediate_size": i,
           "num_hidden_layers": spec["num_hidden_layers"], "num_attention_heads": spec["num_attention_heads"],
           "num_key_value_heads": spec["num_key_value_heads"], "head_dim": hd,
           "vocab_size": v, "max_position_embeddings": spec["max_position_embeddings"],
           "rms_norm_eps": eps, "rope_theta": theta, "tie_word_embeddings": spec["tie_word_embeddings"],
           "attention_bias": False, "torch_dtype": "float16",
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    if arch == "llama":
        cfg["mlp_bias"] = False
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec["num_hidden_layers"])
    return cfg


def _random_tensors(spec: dict[str, Any]) -> dict[str, np.ndarray]:
    """HF Llama / Qwen3 tensor names -> fp16 arrays: matrices N(0, std^2) from one seeded generator, norms 1."""
    rng = np.random.default_rng(spec["seed"])
    h, i, v, hd, qw = _dims(spec)
    kv = spec["num_key_value_heads"] * hd

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * spec["std"]).astype(np.float16)

    out = {"model.embed_tokens.weight": mat(v, h)}
    for n in range(spec["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out[p + "self_attn.q_proj.weight"] = mat(qw, h)
        out[p + "self_attn.k_proj.weight"] = mat(kv, h)
        out[p + "self_attn.v_proj.weight"] = mat(kv, h)
        out[p + "self_attn.o_proj.weight"] = mat(h, qw)
        if spec.get("architecture", "llama") == "qwen3":
            out[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float16)
            out[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float16)
        out[p + "mlp.gate_proj.weight"] = mat(i, h)
        out[p + "mlp.up_proj.weight"] = mat(i, h)
        out[p + "mlp.down_proj.weight"] = mat(h, i)
        out[p + "input_layernorm.weight"] = np.ones(h, np.float16)
        out[p + "post_attention_layernorm.weight"] = np.ones(h, np.float16)
    out["model.norm.weight"] = np.ones(h, np.float16)
    if not spec["tie_word_embeddings"]:
        out["lm_head.weight"] = mat(v, h)
    return out


def make_random_model(spec: dict[str, Any], dest: Path) -> Path:
    """A HF folder (config.json, model.safetensors, tokenizer) made once; reused when complete."""
    from safetensors.numpy import save_file

    from pipeline.config import load_model
    from pipeline.frontend.checkpoint import open_checkpoint

    dest = Path(dest)
    if (dest / "DONE").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=dest.name + ".tmp"))
    os.chmod(tmp, 0o755)   # mkdtemp makes it private
    (tmp / "config.json").write_text(json.dumps(_hf_config(spec), indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    open_checkpoint(load_model(spec["tokenizer_from"]).weights).write_tokenizer(tmp)
    save_file(_random_tensors(spec), str(tmp / "model.safetensors"))
    (tmp / "DONE").write_text(json.dumps(spec, sort_keys=True) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


# ---------------------------------------------------------------------------------- child process
def vm_hwm_bytes(pid: int | str = "self") -> int | None:
    """Peak resident set of a running process's own address space (VmHWM of /proc/<pid>/status), or None
    (no /proc, or the process has exited). Unlike getrusage's ru_maxrss it starts afresh at exec: a child
    forked from this process inherits this process's peak in ru_maxrss (Linux keeps it across execve),
    which once gave every bundle and llama-bench run of a model the 1 GB the parent had used to write
    the model's weights."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def run_measured(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """Run a command; its exit code, output, wall seconds and peak RSS in bytes: the largest VmHWM seen
    while it runs (polled every 20 ms), else (a process too short to poll, no /proc) os.wait4's ru_maxrss."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)   # returns after its exec
        hwm = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            seen = vm_hwm_bytes(proc.pid)
            hwm = seen if hwm is None or (seen is not None and seen > hwm) else hwm
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)   # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        return {"rc": proc.returncode, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace"), "seconds": wall,
                "max_rss_bytes": hwm if hwm is not None else int(usage.ru_maxrss) * 1024}


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """Deterministic prompt token ids (special tokens of SmolLM2's vocabulary are below 100)."""
    return np.random.default_rng(seed).integers(100, vocab, size=n).tolist()


def child_measure(bundle: Path, prefill: list[int], reps: int, long_reps: int, decode: int,
                  seed: int) -> dict[str, Any]:
    """Runs inside the fresh child: TTFT + prefill-128 then decode, `reps` times; the longer prompts
    `long_reps` times, each length after one untimed prefill of its own. The Engine is the one `python -m pipeline run` drives, with TVM's runtime alone."""
    from pipeline.runtime.lean import enter_runtime_process

    enter_runtime_process()
    from pipeline.runtime.runner import Bundle

    t0 = time.perf_counter()
    loaded = Bundle(bundle)
    engine = loaded.engine()
    load_s = time.perf_counter() - t0
    first, longer = prefill[0], prefill[1:]
    ids = prompt_ids(max(prefill), int(loaded.config["vocab_size"]), seed)
    engine.reset()                                       # warm-up at the measured length, as llama-bench's
    engine.prefill(ids[:first])                          # own warm-up run: kernels load lazily, workspaces
    engine.decode_greedy(ids[0])                         # grow to the prompt's size on first use
    out: dict[str, Any] = {"load_s": load_s, "ttft_s": [], "decode_tok_s": [],
                           "prefill_tok_s": {str(n): [] for n in prefill}}
    for _ in range(reps):
        engine.reset()
        t = time.perf_counter()
        token = int(np.argmax(engine.prefill(ids[:first])))
        elapsed = time.perf_counter() - t
        out["ttft_s"].append(elapsed)
        out["prefill_tok_s"][str(first)].append(first / elapsed)
        if decode:
            t = time.perf_counter()
            for _ in range(decode):
                token = engine.decode_greedy(token)      # embed + decode + argmax: one library call
            out["decode_tok_s"].append(decode / (time.perf_counter() - t))
    out["decode_rss_bytes"] = vm_hwm_bytes() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for n in longer:
        engine.reset()                                   # warm-up at this length too (llama-bench warms up
        engine.prefill(ids[:n])                          # before each test): its workspaces are larger
        for _ in range(long_reps):
            engine.reset()
            t = time.perf_counter()
            engine.prefill(ids[:n])
            out["prefill_tok_s"][str(n)].append(n / (time.perf_counter() - t))
    return out


def measure_bundle(bundle: Path, model: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, TVM_NUM_THREADS=str(cfg["threads"]), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(bundle),
           "--child-prefill", ",".join(str(n) for n in model["prefill"]), "--child-reps", str(model["reps"]),
           "--child-long-reps", str(model.get("long_reps", 1)), "--child-decode", str(cfg["decode_tokens"]),
           "--child-seed", str(cfg["prompt_seed"])]
    run = run_measured(cmd, env=env)
    if run["rc"] != 0:
        tail = [ln for ln in run["stderr"].splitlines() if ln.strip()][-1:] or ["no output"]
        raise RuntimeError(f"measuring {bundle.name} failed (exit {run['rc']}): {tail[0][:200]}")
    raw = json.loads(run["stdout"].strip().splitlines()[-1])
    return {"raw": raw, "peak_rss_bytes": run["max_rss_bytes"], "decode_rss_bytes": raw["decode_rss_bytes"],
            "ttft_s": spread(raw["ttft_s"]), "decode_tok_s": spread(raw["decode_tok_s"]),
            "prefill_tok_s": {n: spread(v) for n, v in raw["prefill_tok_s"].items()},
            "load_s": raw["load_s"], "child_seconds": run["seconds"]}


# ------------------------------------------------------------------------------------------ builds
_STEP = re.compile(r"✓ (.+?) \(([0-9.]+) s\)")


def pipeline_build(model: str, target: str, quant: str, out: Path, env: dict[str, str] | None = None,
                   extra: list[str] | None = None) -> dict[str, Any]:
    """`python -m pipeline build` in a subprocess: the bundle path, wall seconds, per-step seconds."""
    cmd = [sys.executable, "-m", "pipeline", "build", "--model", model, "--target", target, "--quant", quant,
           "--out", str(out), *(extra or [])]
    run = run_measured(cmd, env=dict(env or os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    if run["rc"] != 0:
        tail = [ln for ln in run["stderr"].splitlines() if ln.strip()][-1:] or ["no output"]
        raise RuntimeError(f"build {quant}/{target} failed (exit {run['rc']}): {tail[0][:200]}")
    from pipeline.config import load_model

    steps = {m.group(1): float(m.group(2)) for m in _STEP.finditer(run["stderr"])}
    bundle = Path(out) / f"{load_model(model).name}-{quant}-{target}"   # the pipeline's bundle name
    return {"bundle": bundle, "seconds": run["seconds"], "steps": steps, "peak_rss_bytes": run["max_rss_bytes"]}


def compile_times(cfg: dict[str, Any], log=print) -> list[dict[str, Any]]:
    """Each target built into a fresh empty cache (MLP_CACHE_DIR), then rebuilt with nothing changed."""
    spec = cfg["compile"]
    rows = []
    for t in spec["targets"]:
        home = WORK / "compile" / t["target"]
        if home.exists():
            shutil.rmtree(home)
        home.mkdir(parents=True)
        env = dict(os.environ, MLP_CACHE_DIR=str(home / "cache"))
        row: dict[str, Any] = {"target": t["target"], "model": spec["model"], "quant": spec["quant"],
                               "args": t.get("args", [])}
        try:
            cold = pipeline_build(spec["model"], t["target"], spec["quant"], home / "dist", env, t.get("args"))
            warm = pipeline_build(spec["model"], t["target"], spec["quant"], home / "dist", env, t.get("args"))
            row.update(cold_s=cold["seconds"], steps=cold["steps"], rebuild_s=warm["seconds"],
                       peak_rss_bytes=cold["peak_rss_bytes"])
            log(f"  compile {t['target']}: {cold['seconds']:.1f} s cold, {warm['seconds']:.1f} s no-change rebuild")
        except RuntimeError as err:
            row["error"] = str(err)
            log(f"  compile {t['target']}: {err}")
        shutil.rmtree(home, ignore_errors=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ llama.cpp
def _checked(cmd: list[str], what: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {tail[0][:200]}")
    return proc.stdout


def llamacpp_ggufs(lc, source: Path, types: list[str], work: Path) -> dict[str, Path]:
    """F16 GGUF from the source (a HF folder: the converter; a GGUF: --allow-requantize), then each type."""
    work.mkdir(parents=True, exist_ok=True)
    f16 = work / "F16.gguf"
    if not f16.exists():
        tmp = work / "F16.tmp.gguf"
        if Path(source).is_dir():
            _checked([sys.executable, str(lc.converter), str(source), "--outfile", str(tmp), "--outtype", "f16"],
                     "convert_hf_to_gguf.py", env=lc.converter_env())
        else:
            _checked([str(lc.tool("llama-quantize")), "--allow-requantize", str(source), str(tmp), "F16", "2"],
                     "llama-quantize F16")
        os.replace(tmp, f16)
    out = {"F16": f16}
    for qtype in types:
        if qtype == "F16":
            continue
        dst = work / f"{qtype}.gguf"
        if not dst.exists():
            tmp = work / f"{qtype}.tmp.gguf"
            _checked([str(lc.tool("llama-quantize")), str(f16), str(tmp), qtype, "2"], f"llama-quantize {qtype}")
            os.replace(tmp, dst)
        out[qtype] = dst
    return {t: out[t] for t in types if t in out}


def parse_llama_bench(text: str) -> dict[str, Any]:
    """llama-bench -o json: per test (pp<n> / tg<n>) the tok/s samples' spread, plus build info."""
    entries = json.loads(text)
    tests: dict[str, Any] = {}
    for e in entries:
        name = f"pp{e['n_prompt']}" if e["n_gen"] == 0 else f"tg{e['n_gen']}"
        tests[name] = spread(e.get("samples_ts") or [e["avg_ts"]])
    first = entries[0] if entries else {}
    return {"tests": tests, "build_commit": first.get("build_commit"), "build_number": first.get("build_number"),
            "cpu_info": first.get("cpu_info"), "model_type": first.get("model_type")}


def _exit_text(rc: int) -> str:
    """'exit 1', or the signal that killed the process ('SIGSEGV')."""
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


def measure_gguf(lc, gguf: Path, prefill: list[int], decode: int, threads: int, reps: int) -> dict[str, Any]:
    """One build's llama-bench figures on a GGUF, in three processes so that a crash in one (the AMX matmul in
    prompt processing) leaves the others' figures: `crashed` names each run that died and how."""
    bench = str(lc.tool("llama-bench"))
    common = ["-m", str(gguf), "-t", str(threads), "-o", "json", "-r", str(reps)]
    runs = {  # decode after as many cached tokens as ours decodes after (its first prompt: -d, n_depth) is the
        # decode figure; the empty-context one is kept beside it, its process's peak RSS is the RSS through decode
        "prefill": ["-p", ",".join(map(str, prefill)), "-n", "0"],
        "decode": ["-p", "0", "-n", str(decode), "-d", str(prefill[0])],
        "decode_empty_context": ["-p", "0", "-n", str(decode)],
    }
    out: dict[str, Any] = {"build": lc.build, "crashed": {}, "decode_depth": prefill[0]}
    for name, args in runs.items():
        run = run_measured([bench, *common, *args])
        if run["rc"] != 0:
            tail = [ln for ln in run["stderr"].splitlines() if ln.strip()][-1:] or ["no output"]
            out["crashed"][name] = f"{_exit_text(run['rc'])}: {tail[0][:160]}"
            continue
        parsed = parse_llama_bench(run["stdout"])
        t = parsed["tests"]
        out.update(build_commit=parsed["build_commit"], build_number=parsed["build_number"],
                   model_type=parsed["model_type"])
        if name == "prefill":
            out.update(prefill_tok_s={str(n): t.get(f"pp{n}", spread([])) for n in prefill},
                       peak_rss_bytes=run["max_rss_bytes"], seconds=run["seconds"])
        elif name == "decode":
            out["decode_tok_s"] = t.get(f"tg{decode}", spread([]))
        else:
            out.update(decode_tok_s_empty_context=t.get(f"tg{decode}", spread([])),
                       decode_rss_bytes=run["max_rss_bytes"])
    return out


def _figure(m: dict[str, Any], figure: str) -> dict[str, Any] | None:
    """A measured figure by name — 'prefill-<n>', 'decode' or 'decode_empty_context' (the run it comes from,
    measure_gguf's, is the name before '-') — of a build's or a row's figures."""
    if figure.startswith("prefill-"):
        return (m.get("prefill_tok_s") or {}).get(figure.removeprefix("prefill-"))
    return m.get(figure.replace("decode", "decode_tok_s", 1))


def fastest_builds(measured: list[dict[str, Any]], prefill: list[int]) -> dict[str, Any]:
    """A row's llama.cpp figures from its builds' (measure_gguf's): each figure from the build that ran it
    fastest (median), a build that crashed on it left out: the peer is the fastest configuration that runs.
    `build_used` names that build per figure, `builds` keeps every build's own figures and crashes. The RSS
    figures come with the runs they were read in: the peak with the first prefill's, through decode with the
    empty-context decode's."""
    row: dict[str, Any] = {"builds": {m["build"]: m for m in measured}, "build_used": {}, "prefill_tok_s": {},
                           "decode_depth": prefill[0]}
    for figure in [f"prefill-{n}" for n in prefill] + ["decode", "decode_empty_context"]:
        ran = [m for m in measured if (_figure(m, figure) or {}).get("median") is not None]
        m = max(ran, key=lambda m: _figure(m, figure)["median"], default=None)
        value = _figure(m, figure) if m else spread([])
        if figure.startswith("prefill-"):
            row["prefill_tok_s"][figure.removeprefix("prefill-")] = value
        else:
            row[figure.replace("decode", "decode_tok_s", 1)] = value
        if m is None:
            continue
        row["build_used"][figure] = m["build"]
        if figure == f"prefill-{prefill[0]}":
            row["peak_rss_bytes"] = m["peak_rss_bytes"]
        elif figure == "decode_empty_context":
            row["decode_rss_bytes"] = m["decode_rss_bytes"]
    first = row["prefill_tok_s"][str(prefill[0])]["median"]
    row["ttft_s"] = {"median": prefill[0] / first if first else None, "derived": f"{prefill[0]} / pp{prefill[0]}"}
    info = next((m for m in measured if m.get("build_commit")), {})
    row.update({k: info.get(k) for k in ("build_commit", "build_number", "model_type")})
    return row


def builds_used(lcs: list, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results' record of the llama.cpp builds there were: each one's name, what it is, and how many of the
    run's figures it gave (0: it ran nothing fastest, or crashed on everything)."""
    used = [u for r in rows for u in (r.get("build_used") or {}).values()]
    return [{"name": lc.build, "note": lc.note, "figures": used.count(lc.build)} for lc in lcs]


def builds_note(row: dict[str, Any]) -> str:
    """For the markdown: which build gave each of a row's figures, beside the other builds' figures or crashes
    (nothing to say with one build: the Versions line names it)."""
    builds = row.get("builds") or {}
    if len(builds) < 2:
        return ""
    parts = []
    for figure, used in row.get("build_used", {}).items():
        others = [f"{name} crashed ({m['crashed'][figure.split('-')[0]].split(':')[0]})"
                  if figure.split("-")[0] in m["crashed"] else f"{name} {_s(_figure(m, figure))}"
                  for name, m in builds.items() if name != used]
        parts.append(f"{figure.replace('_', ' ')}: {used}" + (f" (vs {', '.join(others)})" if others else ""))
    return "builds — " + "; ".join(parts)


# ------------------------------------------------------------------------------------------ bandwidth
BANDWIDTH_C = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { const uint64_t *p; size_t n; uint64_t sum; } job_t;

static void *fill(void *arg) { job_t *j = arg; memset((void *)j->p, 1, j->n * 8); return NULL; }

static void *reader(void *arg) {
    job_t *j = arg;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= j->n; i += 4) { a += j->p[i]; b += j->p[i + 1]; c += j->p[i + 2]; d += j->p[i + 3]; }
    j->sum = a + b + c + d;
    return NULL;
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void run(void *(*fn)(void *), job_t *jobs, int threads) {
    pthread_t tid[64];
    for (int t = 0; t < threads; t++) pthread_create(&tid[t], NULL, fn, &jobs[t]);
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    size_t bytes = (size_t)(argc > 2 ? atof(argv[2]) : 1024) << 20;
    int passes = argc > 3 ? atoi(argv[3]) : 10;
    if (threads < 1 || threads > 64) return 2;
    size_t n = bytes / 8, per = n / threads;
    uint64_t *buf = aligned_alloc(64, n * 8);
    if (!buf) return 3;
    job_t jobs[64];
    for (int t = 0; t < threads; t++) { jobs[t].p = buf + t * per; jobs[t].n = per; }
    run(fill, jobs, threads);   /* first touch by the threads that read */
    uint64_t check = 0;
    for (int k = 0; k < passes; k++) {
        double t0 = now();
        run(reader, jobs, threads);
        double dt = now() - t0;
        for (int t = 0; t < threads; t++) check += jobs[t].sum;
        printf("%.6f\n", (double)per * threads * 8 / dt / 1e9);
    }
    fprintf(stderr, "checksum %llu\n", (unsigned long long)check);
    free(buf);
    return 0;
}
"""


def measure_bandwidth(threads: int, mib: int = 1024, passes: int = 10) -> dict[str, Any]:
    """Streaming read bandwidth (GB/s, decimal) with `threads` threads: the C reader compiled here."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc) for the bandwidth probe — fix: install gcc or set CC")
    digest = hashlib.sha256(BANDWIDTH_C.encode()).hexdigest()[:12]
    exe = WORK / f"bw-read-{digest}"
    if not exe.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        src = WORK / f"bw-read-{digest}.c"
        src.write_text(BANDWIDTH_C)
        tmp = exe.with_suffix(".tmp")
        _checked([cc, "-O3", "-march=native", "-pthread", "-o", str(tmp), str(src)], f"{cc} bandwidth probe")
        os.replace(tmp, exe)
    run = run_measured([str(exe), str(threads), str(mib), str(passes)])
    if run["rc"] != 0:
        raise RuntimeError(f"bandwidth probe failed (exit {run['rc']})")
    samples = [float(x) for x in run["stdout"].split()]
    s = spread(samples[1:] or samples)   # the first pass warms the TLB / page tables
    return {"gbs": s["max"], "spread_gbs": s, "threads": threads, "buffer_mib": mib, "passes": passes,
            "method": f"C reader (pthreads, 4 uint64 accumulators) compiled with `{Path(cc).name} -O3 "
                      "-march=native`; best pass (first excluded) is the roofline's bandwidth"}


def _near_probe(threads: int) -> float | None:
    """A short probe between two measurements (256 MiB, 6 passes: ~1 s): GB/s, None if it failed."""
    try:
        return measure_bandwidth(threads, mib=256, passes=6)["gbs"]
    except RuntimeError:
        return None


def combine_bandwidth(probes: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The run's bandwidth from probes taken at its start, between models and at its end: the best of them
    (a shared machine's speed drifts over minutes; one run measured 25 GB/s at its start while llama.cpp's F16
    rows later read ~32 GB/s, "127% of the roofline"). Against the best probe a roofline share is a lower
    bound; `drift` = worst / best probe."""
    ok = [(when, b) for when, b in probes if b.get("gbs")]
    if not ok:
        return probes[0][1] if probes else {"gbs": None, "error": "not measured"}
    best = max(ok, key=lambda wb: wb[1]["gbs"])[1]
    return {**best, "probes": [{"when": when, "gbs": b["gbs"]} for when, b in ok],
            "drift": min(b["gbs"] for _, b in ok) / best["gbs"]}


# ------------------------------------------------------------------------------------------- analysis
def add_rooflines(rows: list[dict[str, Any]], bandwidth_gbs: float) -> None:
    """`roofline` against the run's bandwidth; `roofline_near` against the row's own neighbouring probes.
    Bytes read per token: the weights' (+ activations') and the KV cache's mean over the decode run;
    `roofline_weights` counts the weights alone (what the runs before 2026-12-03 called the roofline)."""
    for r in rows:
        d, w, near = (r.get("decode_tok_s") or {}).get("median"), r.get("bytes_per_token"), r.get("bandwidth_near_gbs")
        b = w + (r.get("kv_bytes_per_token") or 0) if w else None
        r["roofline"] = roofline_ratio(d, b, bandwidth_gbs * 1e9) if d and b else None
        r["roofline_near"] = roofline_ratio(d, b, near * 1e9) if d and b and near else None
        r["roofline_weights"] = roofline_ratio(d, w, bandwidth_gbs * 1e9) if d and w else None


def phone_predictions(rows: list[dict[str, Any]], phones: dict[str, dict[str, Any]],
                      share: float) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["side"] != "ours" or not r.get("bytes_per_token"):
            continue
        pred = {k: round(predicted_tok_s(p["bandwidth_gbs"], r["bytes_per_token"], share), 1)
                for k, p in phones.items()}
        out.append({"model": r["model"], "scheme": r["scheme"], "bytes_per_token": r["bytes_per_token"],
                    "predicted_tok_s": pred})
    return out


def _metric(row: dict[str, Any] | None, goal: dict[str, Any], stat: str = "median") -> float | None:
    if row is None:
        return None
    m = goal["metric"]
    if m == "decode_tok_s":
        return (row.get("decode_tok_s") or {}).get(stat)
    if m == "prefill_tok_s":
        return ((row.get("prefill_tok_s") or {}).get(str(goal["prompt"])) or {}).get(stat)
    if m == "roofline":
        return row.get("roofline")
    if m == "decode_rss":
        return row.get("decode_rss_bytes")
    raise ValueError(f"unknown goal metric {m!r} in speed.yaml")


def goal_verdicts(rows: list[dict[str, Any]], goals: list[dict[str, Any]], models: list[str]) -> list[dict[str, Any]]:
    """Each goal on each model: the measured value (a ratio, or the roofline share) and met / not met
    (None: not measured)."""
    by = {(r["model"], r["side"], r["scheme"]): r for r in rows}
    out = []
    for model in models:
        for g in goals:
            ours_row, theirs_row = by.get((model, "ours", g["ours"])), by.get((model, "llama.cpp", g.get("theirs")))
            ours = _metric(ours_row, g)
            value = ours if "theirs" not in g else ratio(ours, _metric(theirs_row, g))
            met = None if value is None else (value >= g["at_least"] if "at_least" in g else value <= g["at_most"])
            best = None   # tok/s goals also best sample vs best sample: a shared machine's load hits runs unevenly
            if g["metric"] in ("decode_tok_s", "prefill_tok_s") and "theirs" in g:
                best = ratio(_metric(ours_row, g, "max"), _metric(theirs_row, g, "max"))
            near = (ours_row or {}).get("roofline_near") if g["metric"] == "roofline" else None
            out.append({**g, "model": model, "value": value, "met": met, "best_vs_best": best, "near": near})
    return out


def _goal_text(g: dict[str, Any]) -> str:
    what = {"decode_tok_s": "decode tok/s", "roofline": "decode share of the roofline",
            "prefill_tok_s": f"prefill-{g.get('prompt')} tok/s", "decode_rss": "peak RSS through decode"}[g["metric"]]
    lhs = f"our {g['ours']} {what}" + (f" / llama.cpp {g['theirs']}" if "theirs" in g else "")
    bound = f"≥ {g['at_least']}" if "at_least" in g else f"≤ {g['at_most']}"
    val = "not measured" if g["value"] is None else f"{g['value']:.3f}"
    verdict = "—" if g["met"] is None else ("MET" if g["met"] else "NOT MET")
    best = f"; best sample vs best sample {g['best_vs_best']:.3f}" if g.get("best_vs_best") is not None else ""
    if g.get("near") is not None:
        best += f"; against the probes right before and after it {g['near']:.3f} (not the verdict)"
    return f"{g['model']}: {lhs} = {val} (goal {bound}): {verdict}{best}"


# ------------------------------------------------------------------------------------------ report
def _f(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _s(s: dict[str, Any] | None, spec: str = ".2f") -> str:
    if not s or s.get("median") is None:
        return "—"
    if s.get("min") is None or s.get("n", 1) <= 1:
        return _f(s["median"], spec)
    return f"{_f(s['median'], spec)} ({_f(s['min'], spec)}–{_f(s['max'], spec)})"


def _mb(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**20:.0f}"


def _cache_note(res: dict[str, Any], model: str) -> list[str]:
    """A warning line when one of our rows' decode bytes per token fit in the last-level cache."""
    llc = res["machine"].get("llc_bytes")
    fits = [(r["scheme"], r["bytes_per_token"] + (r.get("kv_bytes_per_token") or 0)) for r in res["rows"]
            if r["model"] == model and r["side"] == "ours" and r.get("bytes_per_token")]
    fits = [(s, b) for s, b in fits if llc and b < llc]
    if not fits:
        return []
    return [f"Cache: {', '.join(f'{s} ({b / 1e6:.0f} MB)' for s, b in fits)} read fewer bytes per token than this "
            f"CPU's last-level cache ({llc / 2**20:.0f} MiB, shared with the machine's other tenants): part of a step "
            "may come from cache, so a roofline share against the DRAM probe can pass 100%.", ""]


def _builds_text(builds: list[dict[str, Any]] | None) -> str:
    """The Versions line's account of the llama.cpp builds (older results have none: they had one build, their note says which)."""
    if not builds:
        return ""
    each = ", ".join(f"{b['name']} ({b['note']}) gave {b['figures']} figure{'s' * (b['figures'] != 1)}"
                     for b in builds)
    rule = "; each figure is from the fastest build that ran it, named in the row's note" if len(builds) > 1 else ""
    return f"; builds: {each}{rule}"


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    bw = res["bandwidth"]
    lines = [f"# CPU speed — ours vs llama.cpp ({res['date']}{', quick' if res['quick'] else ''})", "",
             f"Machine: {m['cpu']} ({' '.join(m.get('isa') or ['ISA not recorded'])}), {m['cores']} cores, "
             f"{m['ram_gb']:.1f} GB RAM; {res['threads']} threads on both "
             f"sides; load average {res['load_average']['before']:.2f} before, {res['load_average']['after']:.2f} "
             "after (the machine is shared: figures are what was measured under that load).",
             f"Versions: TVM {m['packages'].get('apache-tvm')}, llama.cpp vendored in llama-cpp-python "
             f"{res['llamacpp'].get('version')} (llama-bench build commit: {res['llamacpp'].get('build_commit')}"
             + _builds_text(res["llamacpp"].get("builds"))
             + (f"; {res['llamacpp']['note']}" if res['llamacpp'].get('note') else "") + "), "
             f"ours at git {res['git_commit']}.",
             f"Memory bandwidth (streaming read, {bw.get('threads')} threads): "
             + (f"{bw['gbs']:.2f} GB/s best, {_s(bw['spread_gbs'])} over passes — {bw['method']}."
                if bw.get("gbs") else f"not measured ({bw.get('error')})")
             + (" Probed at the start, after each model: " + ", ".join(f"{p['gbs']:.1f} ({p['when']})" for p in
                bw["probes"]) + "; the roofline uses the best probe" + (
                 f" — the machine's bandwidth moved during the run (worst probe {bw['drift']:.0%} of the best)"
                 if bw["drift"] < 0.8 else "") + "." if bw.get("probes") else ""), "",
             "Figures: median (min–max) over the repetitions. Decode: greedy tokens right after the first (shortest) "
             "prompt (ours: `Engine.decode_greedy`, one library call per token; on a library without it, decode + "
             "numpy's argmax) / llama-bench tg after as many cached tokens (-d, llama.cpp; from an empty context in the "
             "JSON's decode_tok_s_empty_context). TTFT: prefill of the shortest prompt "
             "(+ argmax); llama.cpp's is derived as n / pp<n>. Roofline: decode tok/s × bytes read per token (the "
             "weights' `bytes/token` + the KV cache's mean over the decode run, `KV MB/token`: ours in the "
             "bundle's cache dtype; llama.cpp's f16) / bandwidth (the run's best probe; \"near\": the better of the short probes taken right before and "
             "after that row's measurement, the same minutes). RSS in MiB: through decode (ours: the child's peak after its decode runs; llama.cpp: a "
             "decode-only llama-bench process, -p 0 -n 16) and the whole process. Our processes run Python + TVM's "
             "runtime; llama-bench is one C++ binary with the GGUF mmapped.", ""]
    for model in res["models"]:
        size = f" ({model['params'] / 1e6:.0f} M parameters)" if model.get("params") else ""
        lines += [f"## {model['name']}{size}", "",
                  f"Repetitions: {model['reps']} (prefill-{model['prefill'][0]} + decode), "
                  f"{model.get('long_reps', 1)} (longer prompts); llama-bench -r "
                  f"{model.get('llamacpp_reps', res['llamacpp_reps'])}.", ""]
        lines += _cache_note(res, model["name"])
        pf = model["prefill"]
        head = ("| scheme | side | " + " | ".join(f"prefill-{n} tok/s" for n in pf)
                + f" | decode-{res['decode_tokens']} tok/s | TTFT ms | bytes/token MB | KV MB/token | roofline % "
                "| roofline % near | RSS decode | RSS peak | load 1m | note |")
        lines += [head, "|---|---|" + "---:|" * (len(pf) + 9) + "---|"]
        for r in [r for r in res["rows"] if r["model"] == model["name"]]:
            ttft = r.get("ttft_s") or {}
            ttft_ms = {k: (v * 1e3 if isinstance(v, float) else v) for k, v in ttft.items() if k in
                       ("median", "min", "max", "n")}
            cells = [_s((r.get("prefill_tok_s") or {}).get(str(n))) for n in pf]
            lines.append(f"| {r['scheme']} | {r['side']} | " + " | ".join(cells) + f" | {_s(r.get('decode_tok_s'))} | "
                         f"{_s(ttft_ms, '.0f')} | {_f(r.get('bytes_per_token') and r['bytes_per_token'] / 1e6, '.1f')} | "
                         f"{_f(r.get('kv_bytes_per_token') and r['kv_bytes_per_token'] / 1e6, '.1f')} | "
                         f"{_f(r.get('roofline') and 100 * r['roofline'], '.1f')} | "
                         f"{_f(r.get('roofline_near') and 100 * r['roofline_near'], '.1f')} | {_mb(r.get('decode_rss_bytes'))} | "
                         f"{_mb(r.get('peak_rss_bytes'))} | {_f(r.get('load_average_1m'))} | {r.get('note', '')} |")
        lines.append("")
    lines += ["## Compile time (fresh empty cache, then a no-change rebuild)", "",
              "| target | model / quant | cold s | steps (s) | no-change rebuild s |", "|---|---|---:|---|---:|"]
    for c in res["compile"]:
        steps = ", ".join(f"{k} {v:.1f}" for k, v in (c.get("steps") or {}).items())
        lines.append(f"| {c['target']} {' '.join(c['args'])} | {c['model']} / {c['quant']} | {_f(c.get('cold_s'), '.1f')} | "
                     f"{steps or c.get('error', '')} | {_f(c.get('rebuild_s'), '.1f')} |")
    phones = res["phones"]
    lines += ["", f"## Phone decode tok/s — PREDICTION, not a measurement ({res['phone_bandwidth_share']:.0%} of "
              "peak bandwidth / the host-cpu bundle's decode-step bytes; a phone build's fp16 activations "
              "move slightly fewer bytes)", "",
              "| model | scheme | bytes/token MB | " + " | ".join(f"{k} ({p['bandwidth_gbs']} GB/s)" for k, p in phones.items())
              + " |", "|---|---|---:|" + "---:|" * len(phones)]
    for p in res["phone_predictions"]:
        lines.append(f"| {p['model']} | {p['scheme']} | {p['bytes_per_token'] / 1e6:.1f} | "
                     + " | ".join(_f(p["predicted_tok_s"][k], ".1f") for k in phones) + " |")
    lines += ["", "## Goals (issue #6)", ""] + [f"- {_goal_text(g)}" for g in res["goals"]]
    return "\n".join(lines) + "\n"


def machine_info() -> dict[str, Any]:
    from benchmarks.quality import machine_info as base

    info = base()
    try:
        kb = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                  if ln.startswith("MemTotal"))
        info["ram_gb"] = kb * 1024 / 1e9
    except (OSError, StopIteration):
        info["ram_gb"] = float("nan")
    info["isa"] = cpu_isa()
    info["llc_bytes"] = last_level_cache_bytes()
    return info


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """Size of the CPU's last-level cache (sysfs: the highest level's `size`, e.g. "491520K"), None unknown.
    A decode step whose bytes fit in it may be served partly from cache: its roofline share against the
    DRAM probe can then pass 100% (markdown says so per model)."""
    best: tuple[int, int] | None = None
    for index in sorted(root.glob("index*")):
        try:
            level, text = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        try:
            size = int(text.rstrip("KMG")) * scale
        except ValueError:
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return best[1] if best else None


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def cpu_isa(cpuinfo: str | None = None) -> list[str]:
    """The vector ISA extensions both sides' kernels choose by (ours: cpu_schedule; llama.cpp: -march=native),
    from /proc/cpuinfo: a ratio measured on an AVX-512 VNNI CPU is not one measured on an AVX2-only one."""
    from benchmarks.llamacpp import cpu_flags

    flags = cpu_flags(cpuinfo)
    return [f for f in ISA_FLAGS if f in flags]


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout
        return sha.strip() + ("+dirty" if dirty.strip() else "")
    except OSError:
        return "unknown"


# ------------------------------------------------------------------------------------------- main
def model_source(model: dict[str, Any]) -> tuple[str, Path]:
    """(what `pipeline build --model` takes, the weights llama.cpp converts) for a config row."""
    from pipeline.config import load_model

    if "random" in model:
        path = make_random_model(model["random"], WORK / "models" / model["name"])
        return str(path), path
    return model["model"], load_model(model["model"]).weights


def model_params(model: dict[str, Any]) -> int | None:
    """Parameters: counted from the random model's config, else from the F16 GGUF made for llama.cpp."""
    if "random" in model:
        return random_model_params(model["random"])
    f16 = WORK / "gguf" / model["name"] / "F16.gguf"
    return gguf_decode_bytes(f16)["params"] if f16.exists() else None


def measurement_order(ours: list[str], theirs: list[str], counterparts: dict[str, str]) -> list[tuple[str, str]]:
    """(side, scheme) in the order measured: each of ours, then its llama.cpp counterpart; the rest last."""
    order: list[tuple[str, str]] = []
    for scheme in ours:
        order.append(("ours", scheme))
        partner = counterparts.get(scheme)
        if partner in theirs and ("llama.cpp", partner) not in order:
            order.append(("llama.cpp", partner))
    return order + [("llama.cpp", t) for t in theirs if ("llama.cpp", t) not in order]


def bench_model(model: dict[str, Any], cfg: dict[str, Any], lcs: list, log=print,
                near_probe=None) -> list[dict[str, Any]]:
    """Build every bundle and GGUF first, then measure them, each of ours right before its llama.cpp
    counterpart (speed.yaml: counterparts): the machine is shared and its speed drifts over minutes (a
    full run once saw 28-39 GB/s), so the two figures of a goal's ratio are taken next to each other.
    `lcs`: the llama.cpp builds (llamacpp.variants()), each GGUF measured with every one of them; the GGUFs
    are made with the last (llamacpp.safe_variant()'s, when built).
    `near_probe()`: GB/s (or None) read before the first measurement and after each; a row gets the better of
    its two neighbours as `bandwidth_near_gbs`."""
    log(f"{model['name']}: preparing weights ...")
    source, weights = model_source(model)
    long_ok = model.get("long_prefill_schemes", cfg["ours"])
    ours: dict[str, dict[str, Any]] = {}
    bundles: dict[str, Path] = {}
    for scheme in cfg["ours"]:
        row: dict[str, Any] = {"model": model["name"], "side": "ours", "scheme": scheme}
        ours[scheme] = row
        if scheme not in model.get("ours", cfg["ours"]):
            row["note"] = "not measured on this model (speed.yaml: the model's `ours`)"
            continue
        try:
            b = pipeline_build(source, "host-cpu", scheme, WORK / "dist")
            row["bundle"] = str(b["bundle"].relative_to(ROOT))
            row["build_s"] = b["seconds"]
            row["bytes_per_token"] = bundle_decode_bytes(b["bundle"])
            kv = bundle_kv_bytes_per_position(b["bundle"])
            if kv:   # decode right after the first prompt length's prefill (measure_bundle's child)
                row["kv_bytes_per_token"] = kv_read_bytes(kv, model["prefill"][0], cfg["decode_tokens"])
            bundles[scheme] = b["bundle"]
            log(f"  ours {scheme}: built ({b['seconds']:.0f} s)")
        except (RuntimeError, OSError, ValueError, KeyError) as err:
            row["note"] = f"failed: {str(err)[:200]}"
            log(f"  ours {scheme}: {row['note']}")
    theirs = {t: {"model": model["name"], "side": "llama.cpp", "scheme": t} for t in cfg["llamacpp"]}
    wanted = [t for t in cfg["llamacpp"] if t in model.get("llamacpp", cfg["llamacpp"])]
    ggufs: dict[str, Path] = {}
    if not lcs:
        for row in theirs.values():
            row["note"] = "llama.cpp not built"
    else:
        try:
            ggufs = llamacpp_ggufs(lcs[-1], weights, wanted, WORK / "gguf" / model["name"])
        except RuntimeError as err:
            log(f"  llama.cpp conversion: {err}")
        for qtype, row in theirs.items():
            if qtype not in wanted:
                row["note"] = "not measured on this model (speed.yaml: the model's `llamacpp`)"
            elif qtype not in ggufs:
                row["note"] = "no GGUF (conversion failed)"
    before = near_probe() if near_probe else None
    for side, name in measurement_order(cfg["ours"], cfg["llamacpp"], cfg.get("counterparts", {})):
        if side == "ours" and name in bundles:
            row = ours[name]
            _measure_ours(row, bundles[name], model, cfg, name in long_ok, log)
        elif side == "llama.cpp" and name in ggufs:
            row = theirs[name]
            _measure_theirs(row, ggufs[name], lcs, model, cfg, log)
        else:
            continue
        after = near_probe() if near_probe else None
        near = [g for g in (before, after) if g]
        if near:
            row["bandwidth_near_gbs"] = max(near)
        before = after
    return list(ours.values()) + list(theirs.values())


def _measure_ours(row: dict[str, Any], bundle: Path, model: dict[str, Any], cfg: dict[str, Any], long_ok: bool,
                  log=print) -> None:
    scheme = row["scheme"]
    try:
        measured = model if long_ok else dict(model, prefill=model["prefill"][:1])
        row["load_average_1m"] = os.getloadavg()[0]   # the machine is shared: the load it ran under
        row.update(measure_bundle(bundle, measured, cfg))
        if not long_ok and len(model["prefill"]) > 1:
            row["note"] = (f"prefill-{'/'.join(map(str, model['prefill'][1:]))} not measured "
                           "(speed.yaml: long_prefill_schemes)")
        log(f"  ours {scheme}: decode {_s(row['decode_tok_s'])} tok/s, prefill "
            + ", ".join(f"{n}: {_s(v)}" for n, v in row["prefill_tok_s"].items()))
    except (RuntimeError, OSError, ValueError, KeyError) as err:
        row["note"] = f"failed: {str(err)[:200]}"
        log(f"  ours {scheme}: {row['note']}")


def _measure_theirs(row: dict[str, Any], gguf: Path, lcs: list, model: dict[str, Any], cfg: dict[str, Any],
                    log=print) -> None:
    qtype = row["scheme"]
    try:
        info = gguf_decode_bytes(gguf)
        row["bytes_per_token"] = info["bytes_per_token"]
        if info["kv_bytes_per_position"]:   # decode at depth prefill[0] (measure_gguf's -d)
            row["kv_bytes_per_token"] = kv_read_bytes(info["kv_bytes_per_position"], model["prefill"][0],
                                                      cfg["decode_tokens"])
        row["load_average_1m"] = os.getloadavg()[0]
        measured = [measure_gguf(lc, gguf, model["prefill"], cfg["decode_tokens"], cfg["threads"],
                                 model.get("llamacpp_reps", cfg["llamacpp_reps"])) for lc in lcs]
        for m in measured:
            for run, how in m["crashed"].items():
                log(f"  llama.cpp {qtype} ({m['build']} build): {run} crashed: {how}")
        row.update(fastest_builds(measured, model["prefill"]))
        if not row["build_used"]:
            raise RuntimeError("llama-bench crashed with every build: " + "; ".join(
                f"{m['build']}: {', '.join(f'{r} {how}' for r, how in m['crashed'].items())}" for m in measured))
        row["note"] = "; ".join(filter(None, [_gguf_types(gguf), builds_note(row)]))
        log(f"  llama.cpp {qtype}: decode {_s(row['decode_tok_s'])} tok/s, prefill "
            + ", ".join(f"{n}: {_s(v)}" for n, v in row["prefill_tok_s"].items())
            + (f" ({builds_note(row)})" if builds_note(row) else ""))
    except (RuntimeError, ValueError, KeyError) as err:
        row["note"] = f"failed: {str(err)[:200]}"
        log(f"  llama.cpp {qtype}: {row['note']}")


def _gguf_types(path: Path) -> str:
    """Which quant types the GGUF's matrices got (llama.cpp falls back when rows do not fit a block)."""
    from benchmarks.quality import gguf_matrices

    return "types: " + ", ".join(f"{k}×{v}" for k, v in gguf_matrices(path)["types"].items())


def result_stem(folder: Path, date: str, quick: bool, commit: str) -> str:
    """speed-<date>[-quick], or with the commit appended when a run of that day already has the name (a
    second run must not overwrite the first: results are cited by name)."""
    stem = f"speed-{date}" + ("-quick" if quick else "")
    if not (folder / f"{stem}.json").exists():
        return stem
    short = re.sub(r"[^0-9A-Za-z+-]", "", commit)[:12] or "rerun"
    candidate, n = f"{stem}-{short}", 2
    while (folder / f"{candidate}.json").exists():
        candidate, n = f"{stem}-{short}-{n}", n + 1
    return candidate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="default model, 128-token prefill, fewer repetitions")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--no-llamacpp", action="store_true", help="only our bundles")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile-time measurement")
    ap.add_argument("--models", help="comma-separated model names of the config (default: all)")
    for name, kind in (("child", str), ("child-prefill", str), ("child-reps", int), ("child-long-reps", int),
                       ("child-decode", int), ("child-seed", int)):
        ap.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="no measuring: recompute the goals (config's) from a results .json's rows, rewrite it and its .md")
    args = ap.parse_args(argv)
    from benchmarks.quality import _write_atomic

    if args.render:
        res = json.loads(args.render.read_text())
        res["goals"] = goal_verdicts(res["rows"], load_config(args.config)["goals"], [m["name"] for m in res["models"]])
        _write_atomic(args.render, json.dumps(res, indent=1, default=str) + "\n")
        _write_atomic(args.render.with_suffix(".md"), markdown(res))
        return 0
    if args.child:
        res = child_measure(Path(args.child), [int(x) for x in args.child_prefill.split(",")], args.child_reps,
                            args.child_long_reps, args.child_decode, args.child_seed)
        print(json.dumps(res))
        return 0

    from benchmarks import llamacpp
    from pipeline.config import PHONES_FILE

    cfg = load_config(args.config, args.quick)
    if args.models:
        keep = set(args.models.split(","))
        cfg["models"] = [m for m in cfg["models"] if m["name"] in keep]
    load_before = os.getloadavg()
    t_start = time.time()
    print(f"speed: {', '.join(m['name'] for m in cfg['models'])}; {cfg['threads']} threads; "
          f"load average {load_before[0]:.2f}", flush=True)
    lcs, lc_notes = [], []
    for variant in [] if args.no_llamacpp else llamacpp.variants():
        try:
            lcs.append(llamacpp.ensure_built(variant=variant))
        except llamacpp.BuildError as err:
            lc_notes.append(f"{variant.name} build not available: {err}")
            print(f"  llama.cpp {lc_notes[-1]}")
    probes: list[tuple[str, dict[str, Any]]] = []

    def probe(when: str) -> None:
        try:
            b = measure_bandwidth(cfg["threads"])
            print(f"  bandwidth ({when}): {b['gbs']:.2f} GB/s (streaming read, {cfg['threads']} threads)", flush=True)
        except RuntimeError as err:
            b = {"gbs": None, "error": str(err), "threads": cfg["threads"]}
            print(f"  bandwidth: {err}")
        probes.append((when, b))

    probe("start")
    probing = bool(probes[0][1].get("gbs"))   # the reader builds and runs here: probe between measurements too
    rows: list[dict[str, Any]] = []
    models_out = []
    for model in cfg["models"]:
        rows += bench_model(model, cfg, lcs, log=lambda s: print(s, flush=True),
                            near_probe=(lambda: _near_probe(cfg["threads"])) if probing else None)
        models_out.append({**model, "params": model_params(model)})
        if probing:
            probe(f"after {model['name']}")
    bandwidth = combine_bandwidth(probes)
    if bandwidth.get("gbs"):
        add_rooflines(rows, bandwidth["gbs"])
    compile_rows = [] if args.no_compile else compile_times(cfg, log=lambda s: print(s, flush=True))
    phones = yaml.safe_load(PHONES_FILE.read_text())
    share = float(cfg["phone_bandwidth_share"])
    goals = goal_verdicts(rows, cfg.get("goals", []), [m["name"] for m in cfg["models"]])
    lc_info = {"version": llamacpp.VERSION, "note": "; ".join(lc_notes),
               "build_commit": next((r["build_commit"] for r in rows if r.get("build_commit")), None),
               "builds": builds_used(lcs, rows)}
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    result = {"date": date, "quick": args.quick, "threads": cfg["threads"], "decode_tokens": cfg["decode_tokens"],
              "llamacpp_reps": cfg["llamacpp_reps"], "machine": machine_info(), "git_commit": git_commit(),
              "llamacpp": lc_info, "bandwidth": bandwidth, "models": models_out, "rows": rows,
              "compile": compile_rows, "phones": phones, "phone_bandwidth_share": share,
              "phone_predictions": phone_predictions(rows, phones, share), "goals": goals,
              "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
              "seconds": time.time() - t_start}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = result_stem(RESULTS, date, args.quick, result.get("git_commit", ""))
    _write_atomic(RESULTS / f"{stem}.json", json.dumps(result, indent=1, default=str) + "\n")
    _write_atomic(RESULTS / f"{stem}.md", markdown(result))
    print(markdown(result))
    print(f"wrote {RESULTS / stem}.json and .md ({result['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
