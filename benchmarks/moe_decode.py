"""Decode speed of a mixture-of-experts model vs the dense model with the same active parameters (issue #40).

Two synthetic Qwen3 models made here (random weights, host-cpu, one thread pool): a Qwen3-MoE with `--experts`
experts of FFN width `--inter`, top-`--top-k`, and a dense Qwen3 whose MLP width is top-k x inter (the same
weights read per token apart from the router), same attention and vocabulary. Greedy decode after a 16-token
prompt, tokens/s as the median of `--rounds` alternating runs; also the MoE's total vs active parameters.

    .venv/bin/python benchmarks/moe_decode.py [--experts 64 --top-k 2 --inter 256 --hidden 1024 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _models(a: argparse.Namespace, folder: Path) -> dict[str, Path]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                  num_key_value_heads=max(1, a.hidden // 256), head_dim=64, vocab_size=a.vocab,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=a.top_k * a.inter,
                                             moe_intermediate_size=a.inter, num_experts=a.experts,
                                             num_experts_per_tok=a.top_k, norm_topk_prob=True))
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.02)
    dense = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=a.top_k * a.inter))
    out = {}
    for name, model in (("moe", moe), ("dense", dense)):
        model.save_pretrained(folder / name, safe_serialization=True)
        out[name] = folder / name
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--quant", default="q0f32")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep", default="", help="build the bundles under this folder and keep them (for profiling)")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=BUNDLE",
                   help="also time this built bundle in the same alternation (e.g. the kernels before a change)")
    a = p.parse_args(argv)

    import numpy as np

    from pipeline.progress import Reporter
    from pipeline.runtime.runner import Bundle
    from pipeline.stages import run_pipeline

    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        folders = _models(a, Path(tmp))
        dist = Path(a.keep) if a.keep else Path(tmp) / "dist"
        engines = {name: Bundle(run_pipeline(str(f), "host-cpu", a.quant, out=str(dist),
                                             report=Reporter(quiet=True)).bundle).engine()
                   for name, f in folders.items()}
        for extra in a.extra:
            name, _, bundle = extra.partition("=")
            engines[name] = Bundle(bundle).engine()
        prompt = list(range(1, 17))
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[int]] = {}
        load_before = os.getloadavg()
        for _ in range(a.rounds):
            for name, engine in engines.items():
                engine.reset()
                tok = int(np.argmax(engine.prefill(prompt)))
                tokens[name] = []
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    tok = engine.decode_greedy(tok)
                    tokens[name].append(tok)
                speeds[name].append(a.steps / (time.perf_counter() - t0))
    expert = 3 * a.hidden * a.inter
    result = {"config": vars(a), "load_average_before_after": [load_before, os.getloadavg()],
              "moe_expert_params_total": a.layers * a.experts * expert,
              "moe_expert_params_active": a.layers * a.top_k * expert,
              "tok_s": {name: round(statistics.median(v), 2) for name, v in speeds.items()},
              "tok_s_rounds": {name: [round(x, 2) for x in v] for name, v in speeds.items()},
              # an extra bundle named after a built one (moe_before) decodes the same tokens?
              "same_tokens": {name: tokens[name] == tokens[base] for name in tokens for base in folders
                              if name != base and name.startswith(base)}}
    result["moe_over_dense"] = round(result["tok_s"]["moe"] / result["tok_s"]["dense"], 3)
    # the ratio within each round (MoE and dense timed back to back), its median: robust to the machine's
    # speed drifting between rounds, which moves both medians above but not always together
    result["moe_over_dense_paired"] = round(statistics.median(
        m / d for m, d in zip(speeds["moe"], speeds["dense"], strict=True)), 3)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
