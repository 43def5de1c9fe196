"""Command line: `python -m pipeline build|run|tune|report|release`. User mistakes end in one line, exit code 2.

Each command imports its implementation when it runs (the local imports below): `pipeline run` must load
TVM's runtime alone (runtime/lean.py), never the compiler, torch or transformers."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from pipeline.errors import ConfigError, PipelineError
from pipeline.progress import Reporter


def _build(args) -> int:
    from pipeline.stages import run_pipeline

    if args.oclgrind is not None and args.verify is False:
        raise ConfigError("--oclgrind / --no-oclgrind choose what runs after the PoCL verification that --no-verify "
                          "turns off",
                          fix="drop one of them")
    report = Reporter()
    result = run_pipeline(args.model, args.target, args.quant, weights=args.weights, out=args.out,
                          report=report, phone=args.phone, force_cpu=args.force_cpu,
                          verify={True: "oclgrind", False: "no-oclgrind"}.get(args.oclgrind, args.verify),
                          calibration=args.calibration, kv_cache=args.kv_cache, runtime=args.runtime)
    how = "cache hit, nothing rebuilt" if result.cached else "built"
    report.console.print(f"[bold]{result.bundle}[/] — {how} in {result.seconds:.1f} s"
                         + ("" if result.has_weights else " (no weights given: library + configs only)"))
    return 0


def _check_sampling(args) -> None:
    """Sampling options checked before anything is loaded (NaN compares false to every bound)."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise PipelineError(f"--temperature {args.temperature} is not a number >= 0", fix="e.g. --temperature 0.7 "
                            "(0: greedy)")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise PipelineError(f"--top-p {args.top_p} is not in (0, 1]", fix="e.g. --top-p 0.95")
    if args.max_new_tokens < 1:
        raise PipelineError(f"--max-new-tokens {args.max_new_tokens} is not a positive number", fix="e.g. 64")


def _run(args) -> int:
    _check_sampling(args)
    from pipeline.runtime.lean import enter_runtime_process

    enter_runtime_process()   # running needs neither the compiler nor torch: 169 MiB RSS instead of 474
    from pipeline.runtime.runner import Bundle, generate

    bundle = Bundle(args.bundle, verify=not args.skip_verify)
    stats = generate(bundle, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     top_p=args.top_p, seed=args.seed)
    print(f"[{stats['prompt_tokens']} prompt tokens, time to first token {stats['ttft_s'] * 1000:.0f} ms, "
          f"prefill {stats['prefill_tok_s']:.1f} tok/s, decode {stats['decode_tok_s']:.1f} tok/s]",
          file=sys.stderr)
    return 0


def _tune(args) -> int:
    from pipeline.commands.tune import tune

    tune(args.model, args.target, rpc=args.rpc, trials=args.trials,
         kernels=[k for k in (args.kernels or "").split(",") if k], limit=args.max_kernels)
    return 0


def _report(args) -> int:
    from pipeline.commands.report import main as report_main

    return report_main(args.bundles, as_json=args.json, html=args.html)


def _check(args) -> int:
    from pipeline.commands.check import main as check_main

    return check_main(args.bundles, runtime=args.runtime)


def _release(args) -> int:

    from pipeline.commands.release import load_release, make_release, matrix_json, summary

    spec = load_release(args.file)
    if args.matrix:
        print(json.dumps(matrix_json(spec), sort_keys=True))
        return 0
    report = Reporter()
    t0 = time.time()
    final = make_release(spec, out=Path(args.out) if args.out else None, dist=Path(args.dist), report=report)
    report.console.print(summary(spec, final, time.time() - t0))
    return 0


class _OneLineParser(argparse.ArgumentParser):
    """A bad option is one line like every other user error (argparse prints its whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} — fix: see {self.prog} --help\n")


def parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="python -m pipeline", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile a model into a bundle for a target")
    b.add_argument("--model", default="smollm2-135m", help="registry name (configs/models), a HF folder, a .gguf or an .onnx file")
    b.add_argument("--target", default="android-adreno", help="a name from targets/")
    b.add_argument("--quant", default="q4f16", help="a name from configs/quant/ or a path to a scheme .yaml")
    b.add_argument("--weights", default=None, help="weights folder/file (overrides the model config's)")
    b.add_argument("--out", default="dist", help="output root (default: dist)")
    b.add_argument("--phone", default=None, help="a phone from configs/phones.yaml (memory plan, --quant auto)")
    b.add_argument("--force-cpu", default=None, metavar="CLASSES",
                   help="comma-separated op classes pinned to the CPU (e.g. rmsnorm,elementwise)")
    b.add_argument("--calibration", default=None, metavar="none|builtin|FILE",
                   help="calibration text for q4/q8 tensors (overrides the scheme's `calibration`): none = "
                        "round-to-nearest (faster builds, lower quality), builtin, or a UTF-8 text file")
    b.add_argument("--kv-cache", default=None, choices=("auto", "float16", "float32"),
                   help="KV-cache precision (overrides the scheme's `kv_cache`): auto = fp16 except q0f32")
    b.add_argument("--runtime", default=None, metavar="NAME",
                   help="app runtime contract from configs/runtimes/ (default: the target's, mlc-llm-79d603f)")
    b.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="run the GPU kernels on PoCL vs LLVM during the build (default: the target's "
                        "verify_kernels; on for android-adreno)")
    b.add_argument("--oclgrind", action=argparse.BooleanOptionalAction, default=None,
                   help="after the PoCL run, run the same kernels under Oclgrind (data races, out-of-bounds, "
                        "uninitialised reads): the verdict is printed and in reports/coverage.md. Default: the "
                        "kernels up to a size cap where Oclgrind is installed; --oclgrind: all (minutes); "
                        "--no-oclgrind: none")
    b.set_defaults(func=_build)
    r = sub.add_parser("run", help="chat with a host-cpu bundle on this computer")
    r.add_argument("bundle")
    r.add_argument("--prompt", required=True)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-p", type=float, default=0.95)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--skip-verify", action="store_true",
                   help="do not check the bundle's files against manifest.json's sha256 first (saves a read "
                        "of every file; for a bundle already verified)")
    r.set_defaults(func=_run)
    t = sub.add_parser("tune", help="tune a model's hot kernels for a target into targets/<t>/tuning/",
                       description="MetaSchedule search per kernel, measured through a TVM RPC tracker "
                                   "(--rpc host:port:key; devices register under the key) or on this machine "
                                   "(host-cpu). Records go to targets/<target>/tuning/ and builds apply them.")
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--target", default="host-cpu")
    t.add_argument("--rpc", default=None, metavar="HOST:PORT:KEY", help="RPC tracker and device key")
    t.add_argument("--trials", type=int, default=32, help="MetaSchedule trials per kernel (default 32)")
    t.add_argument("--kernels", default=None, help="comma-separated substrings of kernel names to tune")
    t.add_argument("--max-kernels", type=int, default=4, help="tune at most this many (biggest first)")
    t.set_defaults(func=_tune)
    c = sub.add_parser("report", help="a bundle's coverage summary, or the coverage diff of two bundles",
                       description="One bundle: its coverage summary. Two: what changed from A to B (kernels "
                                   "moved between CPU and accelerator, kernels only in one, accelerator shares, "
                                   "op classes).")
    c.add_argument("bundles", nargs="+", metavar="BUNDLE", help="a bundle folder or its reports/coverage.json (1 or 2)")
    c.add_argument("--json", action="store_true", help="print JSON instead of tables")
    c.add_argument("--html", default=None, metavar="OUT",
                   help="also write the HTML coverage page for one bundle to OUT")
    c.set_defaults(func=_report)
    ck = sub.add_parser("check", help="does a bundle satisfy an app runtime's contract (no execution)",
                        description="Compare bundles of any target with an app runtime's contract "
                                    "(configs/runtimes/): functions and their signatures, _metadata and chat-config "
                                    "fields, tensor-cache records, library symbol and prefix. One line per "
                                    "violation; exit 1 when there is any.")
    ck.add_argument("bundles", nargs="+", metavar="BUNDLE")
    ck.add_argument("--runtime", default=None, metavar="NAME",
                    help="the contract to check against (default: the one the bundle was built for)")
    ck.set_defaults(func=_check)
    rel = sub.add_parser("release", help="build a release matrix and package it for app teams",
                         description="Build every model x quantization x target of a release file "
                                     "(configs/release/<name>.yaml) and package per target: merged static "
                                     "library or .so files, weights folders, mlc-app-config.json, reports, "
                                     "tarballs, release.json and SHA256SUMS (byte-reproducible).")
    rel.add_argument("file", help="a release .yaml or a name in configs/release/")
    rel.add_argument("--out", default=None, help="release folder (default: <dist>/release/<name>)")
    rel.add_argument("--dist", default="dist", help="where the bundles are built (default: dist)")
    rel.add_argument("--matrix", action="store_true",
                     help="only print the CI job matrix (JSON: one job per model x target) and exit")
    rel.set_defaults(func=_release)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no partial output was left behind (a weight conversion resumes where it stopped "
              "when the build is rerun)", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - an internal failure: short by default, full on request
        if os.environ.get("MLP_DEBUG"):
            raise
        lines = [ln for ln in str(err).strip().splitlines() if ln.strip()] or [type(err).__name__]
        print(f"internal error ({type(err).__name__}): {lines[-1][:300]} — no partial output was left "
              "behind; rerun with MLP_DEBUG=1 for the full trace", file=sys.stderr)
        return 1
