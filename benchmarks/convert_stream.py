"""Benchmark: weight conversion (the quantize stage) of a big model, in time and peak memory.

For a few reduced layer counts of a real model config (by default Qwen3-32B, with its real 151936 x 5120
embedding and lm_head, which dominate memory), this writes a synthetic bf16 safetensors checkpoint
(random data, real HF tensor names and shapes, written shard by shard in blocks: never a whole tensor in
memory), runs the pipeline's quantize stage on it in a subprocess while measuring that process's peak RSS,
and reports checkpoint GB, seconds, GB/s and peak RSS, then extrapolates the peak RSS to the model's full
layer count (a fit over the layer counts run: streaming conversion should not grow with layers).

    .venv/bin/python benchmarks/convert_stream.py                 # qwen3-32b, 2 and 4 layers
    .venv/bin/python benchmarks/convert_stream.py --quick         # 1 and 2 layers
    .venv/bin/python benchmarks/convert_stream.py --layers 1,2 --vocab 32768   # small embedding, fast
    .venv/bin/python benchmarks/convert_stream.py --model qwen3.5-35b-a3b --layers 1,2 --vocab 32768 \
        --experts 64 --results benchmarks/results/convert_stream_moe_e64.json   # MoE: peak RSS vs expert count

Models are pluggable: `MODELS` maps a name to its HF config.json, `GENERATORS` maps a config's
model_type to a function returning its checkpoint's [(HF tensor name, shape)] (add a family there), and
`with_layers` cuts a config down to N layers (top level or under "text_config"). Results go to
benchmarks/results/convert_stream.json. Not a test: nothing here is run by `make test`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "convert_stream.json"
GB = 1e9
MiB = 2**20

MODELS: dict[str, Path] = {
    "qwen3-32b": ROOT / "configs" / "models" / "hf" / "qwen3-32b.config.json",
    # converts once the pipeline defines the hybrid model; until then its worker fails with the pipeline's error
    "qwen3.5-27b": ROOT / "configs" / "models" / "hf" / "qwen3.5-27b.config.json",
    # 256 experts per layer, one tensor per expert and projection (as released): 1.6 GB of bf16 per layer
    "qwen3.5-35b-a3b": ROOT / "configs" / "models" / "hf" / "qwen3.5-35b-a3b.config.json",
}

Shape = tuple[int, ...]


# ------------------------------------------------------------------------------------ model families
def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: "text_config" for multimodal wrappers, else the config itself."""
    return cfg.get("text_config") or cfg


def mlp_tensors(t: dict[str, Any], prefix: str, layer: int) -> list[tuple[str, Shape]]:
    """HF tensors of one layer's MLP: dense SwiGLU, or (Qwen3-MoE / Qwen3.5-MoE) a router, one tensor per
    routed expert and projection as the released checkpoints store them, and the shared expert with its gate."""
    hidden, experts = t["hidden_size"], int(t.get("num_experts") or 0)
    step, dense_layers = int(t.get("decoder_sparse_step") or 1), t.get("mlp_only_layers") or []
    m = prefix + "mlp."
    if not experts or layer in dense_layers or (layer + 1) % step:
        inter = t["intermediate_size"]
        return [(m + "gate_proj.weight", (inter, hidden)), (m + "up_proj.weight", (inter, hidden)),
                (m + "down_proj.weight", (hidden, inter))]
    inter = t["moe_intermediate_size"]
    out: list[tuple[str, Shape]] = [(m + "gate.weight", (experts, hidden))]
    for e in range(experts):
        out += [(m + f"experts.{e}.gate_proj.weight", (inter, hidden)), (m + f"experts.{e}.up_proj.weight", (inter, hidden)),
                (m + f"experts.{e}.down_proj.weight", (hidden, inter))]
    shared = int(t.get("shared_expert_intermediate_size") or 0)
    if shared:
        out += [(m + "shared_expert.gate_proj.weight", (shared, hidden)), (m + "shared_expert.up_proj.weight", (shared, hidden)),
                (m + "shared_expert.down_proj.weight", (hidden, shared)), (m + "shared_expert_gate.weight", (1, hidden))]
    return out


def dense_tensors(cfg: dict[str, Any]) -> list[tuple[str, Shape]]:
    """HF tensors of a dense GQA decoder (Llama / Qwen2 / Qwen3)."""
    t = text_config(cfg)
    hidden, vocab = t["hidden_size"], t["vocab_size"]
    heads, layers = t["num_attention_heads"], t["num_hidden_layers"]
    kv = t.get("num_key_value_heads") or heads
    head_dim = t.get("head_dim") or hidden // heads
    bias = t.get("attention_bias", t.get("model_type") == "qwen2")
    qk_norm = t.get("model_type") in ("qwen3", "qwen3_moe")
    out: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv * head_dim), ("v_proj", kv * head_dim)):
            out.append((p + f"self_attn.{proj}.weight", (rows, hidden)))
            if bias:
                out.append((p + f"self_attn.{proj}.bias", (rows,)))
        out.append((p + "self_attn.o_proj.weight", (hidden, heads * head_dim)))
        if qk_norm:
            out += [(p + "self_attn.q_norm.weight", (head_dim,)), (p + "self_attn.k_norm.weight", (head_dim,))]
        out += mlp_tensors(t, p, i)
    out.append(("model.norm.weight", (hidden,)))
    if not (t.get("tie_word_embeddings") or cfg.get("tie_word_embeddings")):
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def qwen3_5_tensors(cfg: dict[str, Any]) -> list[tuple[str, Shape]]:
    """HF tensors of the Qwen3.5 hybrid's language model (Gated-DeltaNet "linear_attention" layers and
    gated full-attention layers, per `layer_types`), under `model.language_model.`. Shapes match
    transformers' Qwen3_5 modeling; the vision tower and MTP head are left out (not converted)."""
    t = text_config(cfg)
    hidden, vocab, heads = t["hidden_size"], t["vocab_size"], t["num_attention_heads"]
    kv, head_dim = t["num_key_value_heads"], t["head_dim"]
    k_heads, k_dim = t["linear_num_key_heads"], t["linear_key_head_dim"]
    v_heads, v_dim = t["linear_num_value_heads"], t["linear_value_head_dim"]
    conv = 2 * k_heads * k_dim + v_heads * v_dim
    gate = 2 if t.get("attn_output_gate", True) else 1
    types = t.get("layer_types") or ["linear_attention"] * t["num_hidden_layers"]
    pre = "model.language_model."
    out: list[tuple[str, Shape]] = [(pre + "embed_tokens.weight", (vocab, hidden))]
    for i, kind in enumerate(types[:t["num_hidden_layers"]]):
        p = f"{pre}layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
        if kind == "linear_attention":
            a = p + "linear_attn."
            out += [(a + "in_proj_qkv.weight", (conv, hidden)), (a + "in_proj_z.weight", (v_heads * v_dim, hidden)),
                    (a + "in_proj_b.weight", (v_heads, hidden)), (a + "in_proj_a.weight", (v_heads, hidden)),
                    (a + "conv1d.weight", (conv, 1, t["linear_conv_kernel_dim"])), (a + "A_log", (v_heads,)),
                    (a + "dt_bias", (v_heads,)), (a + "norm.weight", (v_dim,)),
                    (a + "out_proj.weight", (hidden, v_heads * v_dim))]
        else:
            a = p + "self_attn."
            out += [(a + "q_proj.weight", (heads * head_dim * gate, hidden)), (a + "k_proj.weight", (kv * head_dim, hidden)),
                    (a + "v_proj.weight", (kv * head_dim, hidden)), (a + "o_proj.weight", (hidden, heads * head_dim)),
                    (a + "q_norm.weight", (head_dim,)), (a + "k_norm.weight", (head_dim,))]
        out += mlp_tensors(t, p, i)
    out.append((pre + "norm.weight", (hidden,)))
    if not (t.get("tie_word_embeddings") or cfg.get("tie_word_embeddings")):
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


# model_type (of the config, or of its text_config) -> tensor generator. Add a family here.
GENERATORS: dict[str, Callable[[dict[str, Any]], list[tuple[str, Shape]]]] = {
    "llama": dense_tensors,
    "mistral": dense_tensors,
    "qwen2": dense_tensors,
    "qwen3": dense_tensors,
    "qwen3_5": qwen3_5_tensors,
    "qwen3_moe": dense_tensors,
    "qwen3_5_moe": qwen3_5_tensors,
}


def generator_for(cfg: dict[str, Any]) -> Callable[[dict[str, Any]], list[tuple[str, Shape]]]:
    for kind in (cfg.get("model_type"), text_config(cfg).get("model_type")):
        if kind in GENERATORS:
            return GENERATORS[kind]
    sys.exit(f"error: no tensor generator for model_type {cfg.get('model_type')!r} — fix: add one to "
             f"GENERATORS in {Path(__file__).relative_to(ROOT)}")


def with_layers(cfg: dict[str, Any], layers: int, vocab: int | None = None, experts: int | None = None) -> dict[str, Any]:
    """A copy of `cfg` cut down to `layers` layers (per-layer lists too), with an optional smaller vocab and
    (mixture of experts) expert count."""
    cfg = json.loads(json.dumps(cfg))
    t = text_config(cfg)
    t["num_hidden_layers"] = layers
    if experts:
        t["num_experts"] = experts
        t["num_experts_per_tok"] = min(experts, int(t.get("num_experts_per_tok") or 1))
    for key in ("layer_types",):
        if isinstance(t.get(key), list):
            t[key] = t[key][:layers]
    if vocab:
        t["vocab_size"] = vocab
        if t is not cfg and "vocab_size" in cfg:
            cfg["vocab_size"] = vocab
    return cfg


def full_layers(cfg: dict[str, Any]) -> int:
    return int(text_config(cfg)["num_hidden_layers"])


# ------------------------------------------------------------------------------ synthetic checkpoint
def _random_pool(nbytes: int, seed: int) -> np.ndarray:
    """Random bf16 bit patterns of magnitude ~2^-7..2^-3, either sign (no inf/NaN/denormals)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16, nbytes // 2, dtype=np.uint16)
    bits &= 0x81FF
    bits |= 0x3C00
    return bits


def write_checkpoint(folder: Path, cfg: dict[str, Any], tensors: list[tuple[str, Shape]],
                     shard_bytes: int, block_bytes: int = 64 * MiB) -> int:
    """Write config.json + bf16 safetensors shards + index, streaming; returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    shards: list[list[tuple[str, Shape]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    pool = _random_pool(block_bytes, seed=0).view(np.uint8)
    weight_map: dict[str, str] = {}
    total = 0
    cursor = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in shard:
            nbytes = math.prod(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            left = offset
            while left:
                n = min(left, len(pool) - cursor)
                f.write(pool[cursor:cursor + n])
                left -= n
                cursor = (cursor + n + 2 * 7919) % len(pool)   # rotate through the pool, 2-byte aligned
        total += 8 + len(raw) + offset
    index = {"metadata": {"total_size": sum(math.prod(s) * 2 for _, s in tensors)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


# -------------------------------------------------------------------------------------- measurement
def _worker(folder: str, quant: str) -> None:
    """Runs in the subprocess: load + define, then time the quantize stage alone."""
    sys.path.insert(0, str(ROOT))
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.progress import Reporter
    from pipeline.stages import define, load, quantize

    quiet = os.environ.get("BENCH_QUIET") == "1"
    loaded = load(load_model(folder))
    q = load_quant(quant)
    defined = define(loaded, q, load_target("host-cpu"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    out = quantize(loaded, defined, q, Reporter(quiet=quiet))
    seconds = time.perf_counter() - t0
    out_bytes = sum(p.stat().st_size for p in out.iterdir())
    print("BENCH " + json.dumps({"seconds": seconds, "rss_before_quantize": before, "out_bytes": out_bytes,
                                 "pipeline": str(sys.modules["pipeline"].__file__)}), flush=True)


def measure(folder: Path, quant: str, cache: Path, quiet: bool) -> dict[str, Any]:
    """Run the worker; peak RSS from wait4's ru_maxrss (exact) and from psutil sampling (a check)."""
    env = {**os.environ, "MLP_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "BENCH_QUIET": "1" if quiet else "0"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(folder), quant],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    sampled = [0]
    done = threading.Event()

    def sample() -> None:
        try:
            import psutil

            p = psutil.Process(proc.pid)
            while not done.is_set():
                sampled[0] = max(sampled[0], p.memory_info().rss)
                time.sleep(0.05)
        except Exception:   # psutil missing or the process is gone
            pass

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    thread.join()
    if proc.returncode != 0:
        sys.exit(f"error: the conversion of {folder} failed (exit {proc.returncode}) — fix: see its output above")
    line = next(ln for ln in stdout.splitlines() if ln.startswith("BENCH "))
    result = json.loads(line[len("BENCH "):])
    scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss: bytes on macOS, KiB on Linux
    result["peak_rss"] = usage.ru_maxrss * scale
    result["peak_rss_sampled"] = sampled[0]
    return result


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-32b", help=f"one of {', '.join(MODELS)}")
    ap.add_argument("--config", type=Path, help="a HF config.json instead of --model")
    ap.add_argument("--layers", default=None, help="comma-separated layer counts (default 2,4; --quick 1,2)")
    ap.add_argument("--vocab", type=int, default=None, help="override vocab_size (smaller embedding, faster)")
    ap.add_argument("--experts", type=int, default=None, help="override num_experts (mixture-of-experts configs)")
    ap.add_argument("--quant", default="q4f16")
    ap.add_argument("--quick", action="store_true", help="1 and 2 layers (a few minutes)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="safetensors shard size (default 4 GB)")
    ap.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints and caches")
    ap.add_argument("--progress", action="store_true", help="show the conversion's progress bar")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--worker", nargs=2, metavar=("FOLDER", "QUANT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0

    config_path = args.config or MODELS.get(args.model)
    if config_path is None or not Path(config_path).is_file():
        sys.exit(f"error: {config_path or args.model}: no such model config — fix: use --model "
                 f"{'/'.join(MODELS)} or --config PATH")
    base = json.loads(Path(config_path).read_text())
    name = args.model if not args.config else Path(args.config).stem
    layers = [int(x) for x in (args.layers or ("1,2" if args.quick else "2,4")).split(",")]
    generate = generator_for(base)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mlp-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)

    rows = []
    try:
        for n in layers:
            cfg = with_layers(base, n, args.vocab, args.experts)
            tensors = generate(cfg)
            need = sum(math.prod(s) * 2 for _, s in tensors)
            free = shutil.disk_usage(work).free
            if free < need * 1.5:
                sys.exit(f"error: {work}: {need * 1.5 / GB:.1f} GB needed for {n} layers, {free / GB:.1f} GB free"
                         " — fix: pass --workdir on a bigger disk, fewer --layers or a smaller --vocab")
            folder, cache = work / f"{name}-{n}l", work / f"cache-{n}l"
            t0 = time.perf_counter()
            ckpt_bytes = write_checkpoint(folder, cfg, tensors, int(args.shard_gb * GB))
            write_s = time.perf_counter() - t0
            largest = max(tensors, key=lambda t: math.prod(t[1]))
            print(f"[{n} layers] wrote {ckpt_bytes / GB:.2f} GB in {write_s:.0f} s; converting ...",
                  file=sys.stderr, flush=True)
            r = measure(folder, args.quant, cache, quiet=not args.progress)
            rows.append({"layers": n, "checkpoint_gb": ckpt_bytes / GB, "seconds": r["seconds"],
                         "gb_per_s": ckpt_bytes / GB / r["seconds"], "peak_rss_gb": r["peak_rss"] / GB,
                         "peak_rss_sampled_gb": r["peak_rss_sampled"] / GB,
                         "rss_before_quantize_gb": r["rss_before_quantize"] / GB,
                         "output_gb": r["out_bytes"] / GB, "largest_tensor": largest[0],
                         "largest_tensor_fp32_gb": math.prod(largest[1]) * 4 / GB,
                         "pipeline": r["pipeline"]})
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    full = full_layers(base)
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        slope = (b["peak_rss_gb"] - a["peak_rss_gb"]) / (b["layers"] - a["layers"])
    else:
        slope = 0.0
    last = rows[-1]
    extrapolated = last["peak_rss_gb"] + slope * (full - last["layers"])
    ckpt_full = a_ckpt_full = rows[0]["checkpoint_gb"]
    if len(rows) >= 2:
        per_layer = (rows[-1]["checkpoint_gb"] - rows[0]["checkpoint_gb"]) / (rows[-1]["layers"] - rows[0]["layers"])
        a_ckpt_full = ckpt_full + per_layer * (full - rows[0]["layers"])

    print(f"\nconvert_stream: {name} ({args.quant}), vocab {text_config(with_layers(base, 1, args.vocab))['vocab_size']}, "
          f"pipeline {rows[0]['pipeline']}")
    head = f"{'layers':>6} {'ckpt GB':>8} {'seconds':>8} {'GB/s':>6} {'peak RSS GB':>12} {'RSS before GB':>14} {'out GB':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['layers']:>6} {r['checkpoint_gb']:>8.2f} {r['seconds']:>8.1f} {r['gb_per_s']:>6.3f} "
              f"{r['peak_rss_gb']:>12.2f} {r['rss_before_quantize_gb']:>14.2f} {r['output_gb']:>7.2f}")
    print(f"{full:>6} {a_ckpt_full:>8.1f} {'':>8} {'':>6} {extrapolated:>12.2f}   <- extrapolated "
          f"({slope * 1000:+.1f} MB of peak RSS per layer)")
    print(f"largest tensor: {last['largest_tensor']} ({last['largest_tensor_fp32_gb']:.2f} GB as fp32)")

    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({
        "benchmark": "convert_stream", "model": name, "quant": args.quant, "vocab_override": args.vocab,
        "experts_override": args.experts,
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform}, "runs": rows,
        "full_layers": full, "peak_rss_gb_per_layer": slope, "peak_rss_gb_extrapolated_full": extrapolated,
        "checkpoint_gb_extrapolated_full": a_ckpt_full,
    }, indent=2) + "\n")
    print(f"wrote {args.results.relative_to(ROOT) if args.results.is_relative_to(ROOT) else args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
