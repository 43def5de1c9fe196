"""`make conformance`: MLC-LLM's own C++ engine (built by `make mlc-engine`) serves our bundles.

Checks, each printed with what was measured:
1. the host-cpu SmolLM2 q4f16 bundle through the JSON FFI (what MLC's apps call): the greedy answer to "What is
   the capital of France?" contains "Paris" and equals `pipeline run`'s; through the serve engine, its first 32
   greedy token ids equal our runner's (EOS ignored on both sides, same prompt ids);
2. 4 concurrent streamed requests with different prompts: each output equals the same request served alone (the
   engine batches them: batch_prefill / batch_decode at batch > 1);
3. a tiny Qwen3.5 hybrid bundle made here (random weights, word tokenizer): 32 greedy ids equal transformers';
4. ternary_ptq and q8f16 bundles load and decode (their ids equal our runner's);
5. the default release's mlc-app-config.json / libmodel_*.a follow MLC's packaging rules;
6. bundles of the phone targets (android-adreno, android-cpu, ios-metal, android-hexagon) pass `pipeline check`.

Exit 1 on the first failed check, with what differed. `--quick` runs 1 and 2 only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from clients.mlc_engine import build
from clients.mlc_engine.client import MLCEngine, MLCServeEngine

PROMPT = "What is the capital of France?"
CONCURRENT = ["Name three primary colors.", "What is 12 times 12?", "Write one sentence about the sea.",
              "What language is spoken in Brazil?"]
N_IDS = 32
PHONE_TARGETS = ("android-adreno", "android-cpu", "ios-metal", "android-hexagon")


class Failed(Exception):
    pass


def _say(msg: str) -> None:
    print(msg, flush=True)


def _bundle(model: str, target: str, quant: str, out: Path) -> Path:
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    t0 = time.time()
    path = run_pipeline(model, target, quant, out=str(out), report=Reporter(quiet=True)).bundle
    _say(f"  bundle {path.name} ({time.time() - t0:.0f} s)")
    return path


def prompt_ids(bundle_path: Path, text: str) -> list[int]:
    """The ids `pipeline run` feeds for a one-message chat (runtime/runner.generate's tokenization)."""
    from pipeline.runtime.runner import Bundle

    tok = Bundle(bundle_path).tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def runner_greedy(bundle_path: Path, ids: list[int], n: int) -> list[int]:
    """n greedy ids from our runner's engine (prefill + decode_greedy, as `pipeline run`), EOS not stopping it."""
    import numpy as np

    from pipeline.runtime.runner import Bundle

    engine = Bundle(bundle_path).engine()
    out = [int(np.argmax(engine.prefill(ids)))]
    while len(out) < n:
        out.append(engine.decode_greedy(out[-1]))
    return out


def _first_difference(a: list[int], b: list[int]) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i}: {a[i:i + 4]} vs {b[i:i + 4]}"


def check_served_answer(lib: Path, bundle: Path) -> None:
    from pipeline.runtime.runner import Bundle, generate

    ours = generate(Bundle(bundle), PROMPT, max_new_tokens=64, stream=None)
    with MLCEngine(lib, bundle) as engine:
        got = engine.chat([{"role": "user", "content": PROMPT}], max_tokens=64, temperature=0)
    _say(f"  MLC engine (JSON FFI) answer: {got.text!r} ({got.usage.get('prompt_tokens')} prompt tokens, "
         f"{got.usage.get('completion_tokens')} generated)")
    if "Paris" not in got.text:
        raise Failed(f"the served answer has no 'Paris': {got.text!r}")
    if got.text.strip() != ours["text"].strip() or got.usage.get("prompt_tokens") != ours["prompt_tokens"]:
        raise Failed(f"the served answer differs from pipeline run's {ours['text']!r} "
                     f"({ours['prompt_tokens']} prompt tokens)")
    ids = prompt_ids(bundle, PROMPT)
    want = runner_greedy(bundle, ids, N_IDS)
    with MLCServeEngine(lib, bundle) as engine:
        got_ids = engine.generate(ids, N_IDS, temperature=0, debug_config={"ignore_eos": True}).token_ids
    _say(f"  first {N_IDS} greedy ids, MLC serve engine vs our runner: {'equal' if got_ids == want else 'DIFFER'}")
    if got_ids != want:
        raise Failed(_first_difference(got_ids, want))


def check_concurrent(lib: Path, bundle: Path) -> None:
    """The 4 requests alone, then together (streamed, in 4 threads): the same text each."""
    fields = {"max_tokens": 48, "temperature": 0}
    with MLCEngine(lib, bundle, max_num_sequence=4) as engine:
        alone = [engine.chat([{"role": "user", "content": p}], **fields).text for p in CONCURRENT]
        texts: list[list[str]] = [[] for _ in CONCURRENT]
        arrivals: list[tuple[float, int]] = []
        lock = threading.Lock()
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                for chunk in engine.stream([{"role": "user", "content": CONCURRENT[i]}], **fields):
                    if chunk.delta:
                        with lock:
                            texts[i].append(chunk.delta)
                            arrivals.append((time.perf_counter(), i))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CONCURRENT))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise Failed(f"a concurrent request failed: {errors[0]}")
    together = ["".join(t) for t in texts]
    order = [i for _, i in sorted(arrivals)]
    last_first = max(order.index(i) for i in range(len(CONCURRENT)))
    first_last = min(len(order) - 1 - order[::-1].index(i) for i in range(len(CONCURRENT)))
    overlapped = last_first < first_last   # every stream had started before any one finished
    for i, p in enumerate(CONCURRENT):
        same = together[i] == alone[i]
        _say(f"  [{i}] {p!r}: {'same as alone' if same else 'DIFFERENT'}: {together[i][:60]!r}")
        if not same:
            raise Failed(f"request {i} served with 3 others gave {together[i]!r}, alone {alone[i]!r}")
    _say(f"  4 streams interleaved ({len(arrivals)} chunks; all 4 started before the first finished: "
         f"{'yes' if overlapped else 'no'})")
    if not overlapped:
        raise Failed("the 4 requests were not served concurrently (no decode step carried all 4)")


def check_hybrid(lib: Path, work: Path) -> None:
    import numpy as np
    import torch

    from tests.test_qwen3_5 import VOCAB, reference, tiny_qwen35, word_tokenizer

    folder = work / "qwen35-tiny"
    model = tiny_qwen35(folder)
    model.save_pretrained(folder, safe_serialization=True)
    word_tokenizer().save_pretrained(folder)
    bundle = _bundle(str(folder), "host-cpu", "q0f32", work / "dist")
    ids = [int(i) for i in np.random.default_rng(5).integers(0, VOCAB, 24)]
    with torch.no_grad():
        want = reference(model, ids, N_IDS)[2]
    with MLCServeEngine(lib, bundle) as engine:
        got = engine.generate(ids, N_IDS, temperature=0, debug_config={"ignore_eos": True}).token_ids
    _say(f"  Qwen3.5 hybrid: {N_IDS} greedy ids, MLC serve engine vs transformers: "
         f"{'equal' if got == want else 'DIFFER'}")
    if got != want:
        raise Failed(_first_difference(got, want))


def check_other_schemes(lib: Path, dist: Path) -> None:
    for quant in ("ternary_ptq", "q8f16"):
        bundle = _bundle("smollm2-135m", "host-cpu", quant, dist)
        ids = prompt_ids(bundle, PROMPT)
        want = runner_greedy(bundle, ids, 16)
        with MLCServeEngine(lib, bundle) as engine:
            got = engine.generate(ids, 16, temperature=0, debug_config={"ignore_eos": True}).token_ids
        _say(f"  {quant}: 16 greedy ids, MLC serve engine vs our runner: {'equal' if got == want else 'DIFFER'}")
        if got != want:
            raise Failed(f"{quant}: {_first_difference(got, want)}")


def check_phone_bundles(dist: Path) -> None:
    from pipeline.verify.contract import check_bundle

    failed = []
    for target in PHONE_TARGETS:
        bundle = _bundle("smollm2-135m", target, "q4f16", dist)
        result = check_bundle(bundle)
        _say(f"  pipeline check {bundle.name}: {'ok' if result.ok else '; '.join(result.violations)}")
        if not result.ok:
            failed.append(bundle.name)
    if failed:
        raise Failed(f"{', '.join(failed)} do(es) not satisfy the runtime contract (see above)")


def check_release_packaging(dist: Path, work: Path) -> None:
    """configs/release/default.yaml packaged: MLC's app-config rules (a model_url per Android entry, one model_lib
    per model, each model_lib's system-lib symbol in the merged static library)."""
    import json
    import subprocess

    from pipeline.commands.release import LIBRARY_SYMBOL, NM_CANDIDATES, _tool, load_release, make_release
    from pipeline.progress import Reporter

    out = make_release(load_release("default"), out=work / "release", dist=dist, report=Reporter(quiet=True))
    problems = []
    for config in sorted(out.glob("*/mlc-app-config.json")):
        target = config.parent.name
        entries = json.loads(config.read_text())["model_list"]
        libs = [e["model_lib"] for e in entries]
        if len(set(libs)) != len(libs):
            problems.append(f"{target}: model_lib not unique: {libs}")
        static = sorted((config.parent / "lib").glob("*.a"))
        symbols = ""
        if static:
            symbols = subprocess.run([_tool(NM_CANDIDATES, "LLVM_NM"), "--defined-only", "--just-symbol-name",
                                      str(static[0])], capture_output=True, text=True, check=True).stdout
        for e in entries:
            if target.startswith("android") and not str(e.get("model_url", "")).startswith("https://"):
                problems.append(f"{target}: {e['model_id']} has no model_url")
            if static and LIBRARY_SYMBOL.format(prefix=f"{e['model_lib']}_") not in symbols.split():
                problems.append(f"{target}: {static[0].name} has no symbol for model_lib {e['model_lib']}")
        _say(f"  {target}: {len(entries)} models, model_lib {', '.join(libs)}"
             f"{', static library ' + static[0].name if static else ''}")
    if problems:
        raise Failed("; ".join(problems))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dist", default="dist", help="where the bundles are built (default: dist)")
    ap.add_argument("--quick", action="store_true", help="only the served answer and the 4 concurrent requests")
    args = ap.parse_args(argv)
    lib = build.cached_library()
    if lib is None:
        print("error: the MLC engine is not built for this checkout — fix: run `make mlc-engine` first",
              file=sys.stderr)
        return 1
    dist = Path(args.dist)
    t0 = time.time()
    try:
        _say("1. served answer (host-cpu SmolLM2 q4f16)")
        bundle = _bundle("smollm2-135m", "host-cpu", "q4f16", dist)
        check_served_answer(lib, bundle)
        _say("2. four concurrent requests")
        check_concurrent(lib, bundle)
        if not args.quick:
            _say("3. hybrid (tiny Qwen3.5)")
            with tempfile.TemporaryDirectory() as work:
                check_hybrid(lib, Path(work))
            _say("4. ternary_ptq and q8f16")
            check_other_schemes(lib, dist)
            _say("5. the release's app packaging (configs/release/default.yaml)")
            with tempfile.TemporaryDirectory() as work:
                check_release_packaging(dist, Path(work))
            _say("6. phone targets against the runtime contract")
            check_phone_bundles(dist)
    except Failed as err:
        print(f"conformance FAILED: {err}", file=sys.stderr)
        return 1
    _say(f"conformance passed ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
